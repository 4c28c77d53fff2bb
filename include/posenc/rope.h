// posenc/rope.h - rotary position embedding (RoPE, Su et al. 2021; SPEC §3).
//
//   inv_freq[i] = theta^(-2i/R), i in [0, R/2);  a = p * inv_freq[i];  c = cos(a)*af, s = sin(a)*af
//   half (GPT-NeoX, HF rotate_half):  y[i] = x[i] c - x[i+R/2] s,   y[i+R/2] = x[i+R/2] c + x[i] s
//   interleaved (GPT-J, RoFormer, Meta Llama):  y[2i] = x[2i] c - x[2i+1] s,  y[2i+1] = ... + x[2i]
//   s
// Dims >= R pass through. Inverse (= backward): rotate by -a (and multiply by af).
//
// Precision: p * inv_freq and cos/sin are evaluated in double and rounded once, so the float32
// output equals the float64 reference to float32 rounding at every position (measured: see
// docs/rope.md). The double angle itself carries a relative error of 2^-53, i.e. about p * 1e-16
// rad: negligible below 2^28 (1e-8 rad), 1e-4 rad at 2^40. Peers form the angle in float32
// (~1e-2 rad error at 128k).
#pragma once

#include <cstdint>
#include <vector>

#include "posenc/tensor.h"

namespace posenc {

enum class RopeStyle { kHalf, kInterleaved };
enum class Direction { kForward, kInverse };

// HF `rope_scaling` / `rope_parameters` (SPEC §3.1). Only the fields of `type` are read.
enum class RopeScalingType { kDefault, kLinear, kDynamic, kYarn, kLlama3, kLongRope };
struct RopeScaling {
  RopeScalingType type = RopeScalingType::kDefault;
  double factor = 1.0;                           // f
  int64_t original_max_position_embeddings = 0;  // Lo (dynamic, yarn, llama3, longrope)
  int64_t max_position_embeddings = 0;           // longrope's default attention factor
  double low_freq_factor = 1.0;                  // llama3
  double high_freq_factor = 4.0;                 // llama3
  double beta_fast = 32.0;                       // yarn
  double beta_slow = 1.0;                        // yarn
  bool truncate = true;                          // yarn
  double mscale = 0.0;                           // yarn (0 = not given)
  double mscale_all_dim = 0.0;                   // yarn (0 = not given)
  double attention_factor = 0.0;                 // yarn, longrope (0 = not given)
  std::vector<double> short_factor;              // longrope, R/2 entries
  std::vector<double> long_factor;               // longrope, R/2 entries
};

struct RopeConfig {
  int64_t head_dim = 0;    // D
  int64_t rotary_dim = 0;  // R, even, <= D; 0 means R = D
  double base = 1e4;       // theta (`rope_theta`)
  RopeStyle style = RopeStyle::kHalf;
  RopeScaling scaling = {};
};

// Inverse frequencies (double, R/2 entries) and the attention factor af.
struct RopeFrequencies {
  std::vector<double> inv_freq;
  double attention_factor = 1.0;
  int64_t rotary_dim() const { return 2 * static_cast<int64_t>(inv_freq.size()); }
};

// Throws ValueError naming the field (head_dim < 1, odd or too large rotary_dim, base <= 1,
// bad scaling parameters).
void validate(const RopeConfig& cfg);

// inv_freq and af for a sequence of length `seq_len` (max position + 1; only dynamic NTK and
// LongRoPE depend on it).
RopeFrequencies rope_frequencies(const RopeConfig& cfg, int64_t seq_len = 0);

// Rotates x [batch, seq, heads, head_dim] into out (same shape; any strides; out may be x itself
// for in-place, other partial overlap is undefined). head_dim >= freqs.rotary_dim(); positions
// default to offset(0). Thread-safe for distinct outputs.
void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<const float, 4> x,
                View<float, 4> out, const Positions* positions = nullptr,
                Direction direction = Direction::kForward);
// In-place form.
void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<float, 4> x,
                const Positions* positions = nullptr, Direction direction = Direction::kForward);

namespace ref {
// The float64 oracle, same contract.
void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<const double, 4> x,
                View<double, 4> out, const Positions* positions = nullptr,
                Direction direction = Direction::kForward);
}  // namespace ref

}  // namespace posenc
