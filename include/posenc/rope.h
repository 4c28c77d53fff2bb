// posenc/rope.h - rotary position embedding (RoPE, Su et al. 2021; docs/rope.md).
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

#include <array>
#include <cstdint>
#include <vector>

#include "posenc/half.h"
#include "posenc/tensor.h"

namespace posenc {

enum class RopeStyle { kHalf, kInterleaved };
enum class Direction { kForward, kInverse };

// HF `rope_scaling` / `rope_parameters` (docs/rope-scaling/). Only the fields of `type` are read.
enum class RopeScalingType {
  kDefault,
  kLinear,
  kDynamic,
  kYarn,
  kLlama3,
  kLongRope,
  kProportional
};
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
  // proportional (Gemma 4): pairs i < floor(partial_rotary_factor * R / 2) rotate with
  // theta^(-2i/R) / factor (the exponent over the whole R); the others have frequency 0 and pass
  // through unrotated. R is the whole head here: the factor does not shorten it.
  double partial_rotary_factor = 1.0;
};

struct RopeConfig {
  int64_t head_dim = 0;    // D
  int64_t rotary_dim = 0;  // R, even, <= D; 0 means R = D
  double base = 1e4;       // theta (`rope_theta`)
  RopeStyle style = RopeStyle::kHalf;
  RopeScaling scaling = {};
};

// How angles are formed (docs/precision.md).
//   kAccurate (default): p * inv_freq, cos and sin in double, the rotation in double, one
//     rounding: float32 output equals the float64 reference to float32 rounding at any position.
//   kFloat32: the frameworks' recipe, for comparison and compatibility: inverse frequencies
//     rounded to float32 (the base ones computed as 1 / float32(theta^(2i/R)) in float32), then
//     float32(p) * inv_freq, cosf/sinf and the rotation in float32. Its error grows with p
//     (about 3e-2 rad at p = 2^20). Bit-identity with one framework build needs its own inv_freq
//     (inject a RopeFrequencies) and its math library.
enum class RopeAngles { kAccurate, kFloat32 };

// Inverse frequencies (double, R/2 entries), the attention factor af and the angle mode. Callers
// may fill one directly to inject a framework's inv_freq table.
struct RopeFrequencies {
  std::vector<double> inv_freq;
  double attention_factor = 1.0;
  RopeAngles angles = RopeAngles::kAccurate;
  int64_t rotary_dim() const { return 2 * static_cast<int64_t>(inv_freq.size()); }
};

// Throws ValueError naming the field (head_dim < 1, odd or too large rotary_dim, base <= 1,
// bad scaling parameters).
void validate(const RopeConfig& cfg);

// inv_freq and af for a sequence of length `seq_len` (max position + 1; only dynamic NTK and
// LongRoPE depend on it).
RopeFrequencies rope_frequencies(const RopeConfig& cfg, int64_t seq_len = 0,
                                 RopeAngles angles = RopeAngles::kAccurate);

// Rotates x [batch, seq, heads, head_dim] into out (same shape; any strides, stride 0 allowed in
// x; out may be x itself for in-place, other partial overlap is undefined). head_dim >=
// freqs.rotary_dim(); dims >= rotary_dim are copied. positions default to offset(0).
// Accurate angles on views whose head_dim is unit-stride run the SIMD kernel (every Highway
// target, `num_threads` OpenMP threads, 0 = all; results bit-identical for any thread count);
// float32 angles and strided head_dims run a scalar loop. Both round the float64 result once.
// Thread-safe for distinct outputs. Throws ShapeError (shapes, rotary_dim > head_dim) and
// ValueError (freqs, positions, num_threads < 0).
void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<const float, 4> x,
                View<float, 4> out, const Positions* positions = nullptr,
                Direction direction = Direction::kForward, int num_threads = 0);
// In-place form.
void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<float, 4> x,
                const Positions* positions = nullptr, Direction direction = Direction::kForward,
                int num_threads = 0);

// Half precision (posenc/half.h): x widened exactly, rotated as the float32 apply_rope rotates
// it, the result rounded once to bf16 / f16. out may be x itself (in place).
void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<const bf16, 4> x,
                View<bf16, 4> out, const Positions* positions = nullptr,
                Direction direction = Direction::kForward, int num_threads = 0);
void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<const f16, 4> x,
                View<f16, 4> out, const Positions* positions = nullptr,
                Direction direction = Direction::kForward, int num_threads = 0);

// Rotates q [batch, seq, heads_q, head_dim] and k [batch, seq, heads_kv, head_dim] in place in
// one pass: each token's cos/sin are computed once and applied to its q and k heads. Same
// positions for both; batch, seq and head_dim must match (heads may differ, e.g. GQA); any
// strides. q and k must not overlap. The result equals apply_rope on q and on k bit for bit.
// num_threads as in apply_rope. Throws ShapeError / ValueError as apply_rope.
void apply_rope_qk(const RopeFrequencies& freqs, RopeStyle style, View<float, 4> q,
                   View<float, 4> k, const Positions* positions = nullptr,
                   Direction direction = Direction::kForward, int num_threads = 0);

// Re-rotates keys cached as rope(k, p; from) into rope(k, p; to) in place, without the
// unrotated keys: a rotation by the angle difference p * to_i - p * from_i (formed in double) and
// a scaling by to.af / from.af. For dynamic-NTK growth and LongRoPE crossing the original length:
// cached keys keep the frequencies in force when they were written, and this moves them to new
// ones exactly (to float32 rounding) instead of a re-prefill. Both tables need the same rotary
// dim; accurate angles only.
void rerotate_rope(const RopeFrequencies& from, const RopeFrequencies& to, RopeStyle style,
                   View<float, 4> k, const Positions* positions = nullptr);
// A bf16 / f16 cache: widened, re-rotated as above, rounded once.
void rerotate_rope(const RopeFrequencies& from, const RopeFrequencies& to, RopeStyle style,
                   View<bf16, 4> k, const Positions* positions = nullptr);
void rerotate_rope(const RopeFrequencies& from, const RopeFrequencies& to, RopeStyle style,
                   View<f16, 4> k, const Positions* positions = nullptr);

// Multimodal RoPE (M-RoPE): positions have three components (t, h, w) and each frequency pair
// takes its angle from one of them.
//   kSectioned (Qwen2-VL, Qwen2.5-VL; `mrope_section` [s0, s1, s2] in pairs): pair i uses t for
//     i < s0, h for i < s0 + s1, w below s0 + s1 + s2.
//   kInterleaved (Qwen3-VL; default sections [24, 20, 20]): pair i uses h if i % 3 == 1 and
//     i < 3 s1, w if i % 3 == 2 and i < 3 s2, else t.
// The sections must add up to rotary_dim / 2.
enum class MRopeLayout { kSectioned, kInterleaved };
struct MRope {
  std::array<int64_t, 3> sections = {16, 24, 24};
  MRopeLayout layout = MRopeLayout::kSectioned;
};

// Component (0 = t, 1 = h, 2 = w) that drives frequency pair `pair`.
int mrope_component(const MRope& m, int64_t pair);
// Throws ValueError unless the sections are >= 0 and add up to `pairs`.
void validate(const MRope& m, int64_t pairs);

// Rotates x [batch, seq, heads, head_dim] with 3-component positions (t, h, w), each a Positions
// for [batch, seq]. Text tokens have t = h = w.
void apply_mrope(const RopeFrequencies& freqs, RopeStyle style, const MRope& mrope,
                 View<const float, 4> x, View<float, 4> out,
                 const std::array<Positions, 3>& positions,
                 Direction direction = Direction::kForward);

namespace ref {
void apply_mrope(const RopeFrequencies& freqs, RopeStyle style, const MRope& mrope,
                 View<const double, 4> x, View<double, 4> out,
                 const std::array<Positions, 3>& positions,
                 Direction direction = Direction::kForward);
// The float64 oracle, same contract.
void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<const double, 4> x,
                View<double, 4> out, const Positions* positions = nullptr,
                Direction direction = Direction::kForward);
}  // namespace ref

}  // namespace posenc
