// posenc/check.h - the seeds' claims, measured (`posenc check`).
//
// Each check builds random inputs from a seed, measures a property with the float64 reference
// and compares it with a threshold. They are library functions so tests, the CLI and the demo
// report the same numbers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace posenc {

struct CheckResult {
  std::string property;  // what is claimed, e.g. "attention(no positions) equivariant to ..."
  std::string scheme;    // none, sinusoidal, learned, rope, alibi, t5, shaw, xl, deberta
  double measured = 0;   // the measured quantity (an error, a value)
  double threshold = 0;  // pass iff the comparison described by `expect` holds
  std::string expect;    // "<= threshold", ">= threshold", "== 7.4852 (4 dp)", "error raised"
  bool pass = false;
};

struct CheckOptions {
  uint64_t seed = 20260101;
};

std::vector<CheckResult> run_checks(const CheckOptions& options = {});

// Individual measurements (float64 reference underneath).
// Max |out(perm q) - perm out(q)| over random q, k, v without positions.
double query_permutation_error(bool causal, uint64_t seed);
// Max |out(q; perm k, perm v) - out(q; k, v)|.
double key_permutation_error(bool causal, uint64_t seed);
// Sinusoidal PE(a).PE(b) in double (d, default config otherwise).
double sinusoidal_dot(int64_t dim, int64_t a, int64_t b);
// Max | |rope(x, p)| - |x| | / |x| over random x and positions up to 2^20.
double rope_norm_error(uint64_t seed);
// Max spread of <rope(q, m), rope(k, n)> over pairs (m, n) with the same n - m.
double rope_offset_spread(uint64_t seed);
// Max spread of a scheme's score over (i, j) with the same offset, shifting both positions by
// a common amount (scheme: alibi, t5, shaw, xl, deberta).
double relative_score_spread(const std::string& scheme, uint64_t seed);

// RoPE angle precision at large positions (`posenc rope-precision`, docs/precision.md). For each
// position p, 8 tokens at p .. p + 7 with 4 heads of unit-normal float32 inputs (from `seed`, the
// same for every p), RopeConfig{head_dim, base}, half style:
//   accurate_error: max |apply_rope (kAccurate) - ref::apply_rope|, the same frequencies;
//   float32_error: max |apply_rope (kFloat32) - ref::apply_rope| where the reference uses the
//     same float32-rounded inv_freq with accurate angles, so only the angle error shows;
//   float32_angle_error: max over tokens and pairs of |remainder(float32(q) * float32(inv) -
//     q * inv, 2 pi)| (q the token's position, inv the float32-rounded inv_freq; the float32
//     product is compared with the exact one).
// Throws ValueError for positions outside [0, 2^53 - 8] or a bad head_dim / base.
struct RopePrecisionRow {
  int64_t position = 0;
  double accurate_error = 0;
  double float32_error = 0;
  double float32_angle_error = 0;
};
std::vector<RopePrecisionRow> rope_precision(const std::vector<int64_t>& positions,
                                             int64_t head_dim = 128, double base = 5e5,
                                             uint64_t seed = 1);

}  // namespace posenc
