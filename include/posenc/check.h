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

}  // namespace posenc
