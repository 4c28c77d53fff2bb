// src/rope.cc - rotary position embedding (Su et al. 2021, "RoFormer"; docs/rope.md) and the HF
// frequency scalings (docs/rope-scaling/): position interpolation (Chen et al. 2023), dynamic NTK,
// YaRN (Peng et al. 2023), Llama 3.1's wavelength-banded scaling, LongRoPE (Ding et al. 2024).
//
// Precision: inverse frequencies are double; p * inv_freq, cos and sin are double; the rotated
// pair is formed in double from the float inputs and rounded once. The float32 output is thus
// the float64 result rounded once (up to an ulp), at any position. float32 views with accurate
// angles and a unit-stride head_dim go to the SIMD kernel (kernels/rope_hwy.cc: same math, cos/sin
// once per token shared by all heads, threads); the scalar `rotate` below serves the float64
// reference, float32 angles, M-RoPE, re-rotation and strided head_dims.
#include "posenc/rope.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <numbers>
#include <utility>
#include <vector>

#include "common.h"
#include "kernels/parallel.h"
#include "kernels/rope_kernels.h"
#include "posenc/half.h"

namespace posenc {
namespace {

// YaRN's ramp bounds: find_correction_dim / find_correction_range of the reference code, in
// Python doubles (beta_fast gives the low dim, beta_slow the high one).
std::pair<double, double> yarn_correction_range(const RopeScaling& s, double rd, double lo,
                                                double base) {
  const double log_theta = std::log(base);
  auto corr = [&](double n) {
    return rd * std::log(lo / (n * 2.0 * std::numbers::pi)) / (2.0 * log_theta);
  };
  double low = corr(s.beta_fast), high = corr(s.beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, rd - 1.0);
  if (low == high) high += 0.001;
  return {low, high};
}

double yarn_mscale(double scale, double m) {
  return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
}

void require_factor(const RopeScaling& s, const char* type) {
  if (!std::isfinite(s.factor) || s.factor <= 0.0) {
    detail::fail(std::string("rope scaling '") + type + "': factor must be finite and > 0 (got " +
                 detail::num(s.factor) + ")");
  }
}

void require_original(const RopeScaling& s, const char* type) {
  if (s.original_max_position_embeddings < 1) {
    detail::fail(std::string("rope scaling '") + type +
                 "': original_max_position_embeddings must be >= 1 (got " +
                 std::to_string(s.original_max_position_embeddings) + ")");
  }
}

int64_t effective_rotary_dim(const RopeConfig& cfg) {
  return cfg.rotary_dim == 0 ? cfg.head_dim : cfg.rotary_dim;
}

// The float32 recipe of the reference frameworks (Hugging Face's rope init functions run by
// PyTorch on CPU), step by step: every tensor operation rounds to float32 in the reference's
// order, and the Python scalars it mixes in (factor, 2 pi, lengths) are rounded to float32 where
// a tensor operation takes them. Scalar arithmetic the reference does in Python (the YaRN
// correction range, llama3's wavelength bounds) stays in double. Two PyTorch details matter:
// `scalar / tensor` is `tensor.reciprocal() * scalar`, and `base ** tensor` is a float32 pow.
// The pow here is the C library's powf; PyTorch's vectorised pow (SLEEF, 1 ulp) agrees with it on
// most but not all inputs, so the table is bit-identical where the two pows agree.
namespace f32 {

float cast(double v) { return static_cast<float>(v); }
float recip(float x) { return 1.0f / x; }

// arange(0, R, 2).float() / R
std::vector<float> exponents(int64_t r) {
  std::vector<float> e(static_cast<std::size_t>(r / 2));
  for (std::size_t i = 0; i < e.size(); ++i) {
    e[i] = static_cast<float>(2 * static_cast<int64_t>(i)) / static_cast<float>(r);
  }
  return e;
}

// base ** exponents (float32 pow), base already a float32 value.
std::vector<float> powers(float base, const std::vector<float>& e) {
  std::vector<float> p(e.size());
  for (std::size_t i = 0; i < e.size(); ++i) p[i] = std::pow(base, e[i]);
  return p;
}

// 1.0 / (base ** (arange(0, R, 2).float() / R))
std::vector<float> default_inv(float base, int64_t r) {
  std::vector<float> inv = powers(base, exponents(r));
  for (float& v : inv) v = recip(v);
  return inv;
}

void frequencies(const RopeConfig& cfg, int64_t r, int64_t seq_len, RopeFrequencies& out) {
  const RopeScaling& s = cfg.scaling;
  const double lo = static_cast<double>(s.original_max_position_embeddings);
  std::vector<float> inv;
  switch (s.type) {
    case RopeScalingType::kDefault:
      inv = default_inv(cast(cfg.base), r);
      break;
    case RopeScalingType::kLinear:
      inv = default_inv(cast(cfg.base), r);
      for (float& v : inv) v /= cast(s.factor);  // inv_freq /= factor
      break;
    case RopeScalingType::kDynamic: {
      if (static_cast<double>(seq_len) > lo) {
        // The update path passes seq_len as an int64 tensor, so the new base is a float32
        // 0-dim tensor: base * ((factor * L / Lo) - (factor - 1)) ** (R / (R - 2)); the
        // tensor ** Python-float power runs pow(float, double).
        const float t = cast(s.factor) * static_cast<float>(seq_len) / static_cast<float>(lo) -
                        cast(s.factor - 1.0);
        const double ex = static_cast<double>(r) / static_cast<double>(r - 2);
        const float grown = cast(std::pow(static_cast<double>(t), ex));
        inv = default_inv(cast(cfg.base) * grown, r);
      } else {
        inv = default_inv(cast(cfg.base), r);
      }
      break;
    }
    case RopeScalingType::kLlama3: {
      inv = default_inv(cast(cfg.base), r);
      const double low_wl = lo / s.low_freq_factor, high_wl = lo / s.high_freq_factor;
      const float low_f = cast(low_wl), high_f = cast(high_wl);
      const float factor = cast(s.factor);
      const float two_pi = cast(2.0 * std::numbers::pi);
      const float band = cast(s.high_freq_factor - s.low_freq_factor);
      for (float& v : inv) {
        const float wl = recip(v) * two_pi;                     // 2 * math.pi / inv_freq
        const float scaled = wl > low_f ? v / factor : v;       // where(wl > low, inv / f, inv)
        if (!(wl < high_f) && !(wl > low_f) && band != 0.0f) {  // is_medium_freq
          const float smooth = (recip(wl) * cast(lo) - cast(s.low_freq_factor)) / band;
          v = (1.0f - smooth) * scaled / factor + smooth * scaled;
        } else {
          v = scaled;
        }
      }
      break;
    }
    case RopeScalingType::kYarn: {
      const std::vector<float> pos = powers(cast(cfg.base), exponents(r));
      const double rd = static_cast<double>(r);
      // find_correction_dim / find_correction_range, in Python doubles.
      const auto [low, high] = yarn_correction_range(s, rd, lo, cfg.base);
      const float span = cast(high - low);
      inv.resize(pos.size());
      for (std::size_t i = 0; i < pos.size(); ++i) {
        const float extrapolation = recip(pos[i]);
        const float interpolation = recip(cast(s.factor) * pos[i]);
        const float ramp = std::clamp((static_cast<float>(i) - cast(low)) / span, 0.0f, 1.0f);
        const float extra_factor = 1.0f - ramp;  // 1 - linear_ramp_factor(...)
        inv[i] = interpolation * (1.0f - extra_factor) + extrapolation * extra_factor;
      }
      break;
    }
    case RopeScalingType::kLongRope: {
      const auto& ext = static_cast<double>(seq_len) > lo ? s.long_factor : s.short_factor;
      const std::vector<float> pos = powers(cast(cfg.base), exponents(r));
      inv.resize(pos.size());
      for (std::size_t i = 0; i < pos.size(); ++i) inv[i] = recip(cast(ext[i]) * pos[i]);
      break;
    }
  }
  for (std::size_t i = 0; i < inv.size(); ++i) out.inv_freq[i] = static_cast<double>(inv[i]);
}

}  // namespace f32

}  // namespace

void validate(const RopeConfig& cfg) {
  detail::require_positive(cfg.head_dim, "rope: head_dim");
  const int64_t r = effective_rotary_dim(cfg);
  if (r < 2 || r % 2 != 0) {
    detail::fail("rope: rotary_dim must be even and >= 2 (got " + std::to_string(r) + ")");
  }
  if (r > cfg.head_dim) {
    detail::fail("rope: rotary_dim (" + std::to_string(r) + ") must not exceed head_dim (" +
                 std::to_string(cfg.head_dim) + ")");
  }
  if (!std::isfinite(cfg.base) || cfg.base <= 1.0) {
    detail::fail("rope: base (rope_theta) must be finite and > 1 (got " + detail::num(cfg.base) +
                 ")");
  }
  const RopeScaling& s = cfg.scaling;
  const std::size_t pairs = static_cast<std::size_t>(r / 2);
  switch (s.type) {
    case RopeScalingType::kDefault:
      break;
    case RopeScalingType::kLinear:
      require_factor(s, "linear");
      break;
    case RopeScalingType::kDynamic:
      require_factor(s, "dynamic");
      require_original(s, "dynamic");
      if (r <= 2) detail::fail("rope scaling 'dynamic': rotary_dim must be > 2");
      break;
    case RopeScalingType::kLlama3:
      require_factor(s, "llama3");
      require_original(s, "llama3");
      // Equal factors (Llama 4) leave an empty blend band.
      if (!(s.low_freq_factor > 0) || !(s.high_freq_factor >= s.low_freq_factor) ||
          !std::isfinite(s.high_freq_factor)) {
        detail::fail("rope scaling 'llama3': need 0 < low_freq_factor <= high_freq_factor (got " +
                     detail::num(s.low_freq_factor) + ", " + detail::num(s.high_freq_factor) + ")");
      }
      break;
    case RopeScalingType::kYarn:
      require_factor(s, "yarn");
      require_original(s, "yarn");
      if (!std::isfinite(s.beta_fast) || !std::isfinite(s.beta_slow) || s.beta_fast <= 0 ||
          s.beta_slow <= 0) {
        detail::fail("rope scaling 'yarn': beta_fast and beta_slow must be finite and > 0");
      }
      if (s.attention_factor < 0 || s.mscale < 0 || s.mscale_all_dim < 0) {
        detail::fail("rope scaling 'yarn': attention_factor, mscale, mscale_all_dim must be >= 0");
      }
      break;
    case RopeScalingType::kLongRope:
      require_original(s, "longrope");
      if (s.short_factor.size() != pairs || s.long_factor.size() != pairs) {
        detail::fail("rope scaling 'longrope': short_factor and long_factor need rotary_dim/2 = " +
                     std::to_string(pairs) + " entries (got " +
                     std::to_string(s.short_factor.size()) + " and " +
                     std::to_string(s.long_factor.size()) + ")");
      }
      for (std::size_t i = 0; i < pairs; ++i) {
        if (!(s.short_factor[i] > 0) || !(s.long_factor[i] > 0) ||
            !std::isfinite(s.short_factor[i]) || !std::isfinite(s.long_factor[i])) {
          detail::fail("rope scaling 'longrope': factor lists must be finite and > 0 (entry " +
                       std::to_string(i) + ")");
        }
      }
      if (s.attention_factor < 0) detail::fail("rope scaling 'longrope': attention_factor < 0");
      break;
  }
}

RopeFrequencies rope_frequencies(const RopeConfig& cfg, int64_t seq_len, RopeAngles angles) {
  validate(cfg);
  if (seq_len < 0) detail::fail("rope_frequencies: seq_len must be >= 0");
  const int64_t r = effective_rotary_dim(cfg);
  const int64_t pairs = r / 2;
  const double rd = static_cast<double>(r);
  const RopeScaling& s = cfg.scaling;
  RopeFrequencies out;
  out.inv_freq.resize(static_cast<std::size_t>(
      checked_elements("rope_frequencies: inv_freq", {{"rotary_dim / 2", pairs}}, 8)));
  out.angles = angles;
  auto base_inv = [&](double theta) {
    for (int64_t i = 0; i < pairs; ++i) {
      out.inv_freq[static_cast<std::size_t>(i)] =
          std::pow(theta, -2.0 * static_cast<double>(i) / rd);
    }
  };
  const double lo = static_cast<double>(s.original_max_position_embeddings);
  switch (s.type) {
    case RopeScalingType::kDefault:
      base_inv(cfg.base);
      break;
    case RopeScalingType::kLinear:
      base_inv(cfg.base);
      for (auto& f : out.inv_freq) f /= s.factor;
      break;
    case RopeScalingType::kDynamic: {
      const double l = static_cast<double>(seq_len);
      double theta = cfg.base;
      if (l > lo) theta *= std::pow(s.factor * l / lo - (s.factor - 1.0), rd / (rd - 2.0));
      base_inv(theta);
      break;
    }
    case RopeScalingType::kLlama3: {
      base_inv(cfg.base);
      const double low_wl = lo / s.low_freq_factor, high_wl = lo / s.high_freq_factor;
      for (auto& f : out.inv_freq) {
        const double wl = 2.0 * std::numbers::pi / f;
        if (wl > low_wl) {
          f /= s.factor;
        } else if (wl >= high_wl && s.high_freq_factor > s.low_freq_factor) {
          const double sigma =
              (lo / wl - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
          f = (1.0 - sigma) * f / s.factor + sigma * f;
        }
      }
      break;
    }
    case RopeScalingType::kYarn: {
      base_inv(cfg.base);
      const auto [low, high] = yarn_correction_range(s, rd, lo, cfg.base);
      for (int64_t i = 0; i < pairs; ++i) {
        const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
        double& f = out.inv_freq[static_cast<std::size_t>(i)];
        f = (f / s.factor) * ramp + f * (1.0 - ramp);
      }
      if (s.attention_factor > 0) {
        out.attention_factor = s.attention_factor;
      } else if (s.mscale > 0 && s.mscale_all_dim > 0) {
        out.attention_factor =
            yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim);
      } else {
        out.attention_factor = yarn_mscale(s.factor, 1.0);
      }
      break;
    }
    case RopeScalingType::kLongRope: {
      const auto& ext = static_cast<double>(seq_len) > lo ? s.long_factor : s.short_factor;
      for (int64_t i = 0; i < pairs; ++i) {
        out.inv_freq[static_cast<std::size_t>(i)] =
            1.0 / (ext[static_cast<std::size_t>(i)] *
                   std::pow(cfg.base, 2.0 * static_cast<double>(i) / rd));
      }
      if (s.attention_factor > 0) {
        out.attention_factor = s.attention_factor;
      } else {
        const double sc = static_cast<double>(s.max_position_embeddings) / lo;
        out.attention_factor = sc <= 1.0 ? 1.0 : std::sqrt(1.0 + std::log(sc) / std::log(lo));
      }
      break;
    }
  }
  if (angles == RopeAngles::kFloat32) {
    // Same attention factor (a Python float in the reference, applied to float32 cos / sin);
    // the table follows the reference's float32 steps.
    f32::frequencies(cfg, r, seq_len, out);
    out.attention_factor = static_cast<double>(static_cast<float>(out.attention_factor));
  }
  return out;
}

namespace {

void validate_freqs(const RopeFrequencies& freqs, const std::string& f) {
  if (freqs.inv_freq.empty()) detail::fail(f + ": freqs.inv_freq is empty");
  for (double v : freqs.inv_freq) {
    if (!std::isfinite(v)) detail::fail(f + ": freqs.inv_freq has a non-finite entry");
  }
  if (!std::isfinite(freqs.attention_factor) || freqs.attention_factor <= 0) {
    detail::fail(f + ": attention_factor must be finite and > 0");
  }
}

template <class T>
void validate_apply(const RopeFrequencies& freqs, const View<const T, 4>& x, const View<T, 4>& out,
                    const std::string& f) {
  detail::require_data(x, f + ": x");
  detail::require_data(out, f + ": out");
  validate_freqs(freqs, f);
  if (x.shape != out.shape) {
    detail::fail<ShapeError>(f + ": out shape " + shape_str(out.shape) + " differs from x shape " +
                             shape_str(x.shape));
  }
  if (freqs.rotary_dim() > x.shape[3]) {
    detail::fail<ShapeError>(f + ": rotary_dim (" + std::to_string(freqs.rotary_dim()) +
                             ") exceeds head_dim (" + std::to_string(x.shape[3]) +
                             ") of x [batch, seq, heads, head_dim]");
  }
}

// Rotates every (batch, token) of x into out. `fill(b, i, cs)` writes c_k at cs[2k] and s_k at
// cs[2k + 1] (attention factor and direction included) for every pair k. Accurate mode forms the
// pair in double and rounds once; float32 mode multiplies and subtracts in float32 as the
// frameworks do.
template <class T, class Fill>
void rotate(int64_t pairs, RopeStyle style, bool float32_math, const View<const T, 4>& x,
            const View<T, 4>& out, Fill&& fill) {
  const int64_t batch = x.shape[0], seq = x.shape[1], heads = x.shape[2], dim = x.shape[3];
  std::vector<double> cs(static_cast<std::size_t>(2 * pairs));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < seq; ++i) {
      fill(b, i, cs.data());
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x.data + b * x.stride[0] + i * x.stride[1] + h * x.stride[2];
        T* orow = out.data + b * out.stride[0] + i * out.stride[1] + h * out.stride[2];
        const int64_t xs = x.stride[3], ost = out.stride[3];
        for (int64_t k = 0; k < pairs; ++k) {
          const int64_t i0 = style == RopeStyle::kHalf ? k : 2 * k;
          const int64_t i1 = style == RopeStyle::kHalf ? k + pairs : 2 * k + 1;
          const double c = cs[static_cast<std::size_t>(2 * k)];
          const double s = cs[static_cast<std::size_t>(2 * k + 1)];
          if (float32_math) {
            const float x0 = static_cast<float>(xr[i0 * xs]), x1 = static_cast<float>(xr[i1 * xs]);
            const float cf = static_cast<float>(c), sf = static_cast<float>(s);
            const float a = x0 * cf, bb = x1 * sf, e = x1 * cf, g = x0 * sf;
            orow[i0 * ost] = static_cast<T>(a - bb);
            orow[i1 * ost] = static_cast<T>(e + g);
          } else {
            const double x0 = static_cast<double>(xr[i0 * xs]);
            const double x1 = static_cast<double>(xr[i1 * xs]);
            orow[i0 * ost] = static_cast<T>(x0 * c - x1 * s);
            orow[i1 * ost] = static_cast<T>(x1 * c + x0 * s);
          }
        }
        if (static_cast<const void*>(orow) != static_cast<const void*>(xr) || ost != xs) {
          for (int64_t d = 2 * pairs; d < dim; ++d) orow[d * ost] = xr[d * xs];
        }
      }
    }
  }
}

// cos/sin of p * inv_freq[k] for the pairs whose position component is `pos_of(k)`.
template <class PosOf>
void fill_angles(const RopeFrequencies& freqs, Direction dir, PosOf&& pos_of, double* cs) {
  const double af = freqs.attention_factor;
  const double sign = dir == Direction::kForward ? 1.0 : -1.0;
  const std::size_t pairs = freqs.inv_freq.size();
  for (std::size_t k = 0; k < pairs; ++k) {
    const int64_t p = pos_of(k);
    if (freqs.angles == RopeAngles::kFloat32) {
      const float a = static_cast<float>(p) * static_cast<float>(freqs.inv_freq[k]);
      const float aff = static_cast<float>(af);
      cs[2 * k] = static_cast<double>(std::cos(a) * aff);
      cs[2 * k + 1] = static_cast<double>(static_cast<float>(sign) * (std::sin(a) * aff));
    } else {
      const double a = static_cast<double>(p) * freqs.inv_freq[k];
      cs[2 * k] = std::cos(a) * af;
      cs[2 * k + 1] = sign * std::sin(a) * af;
    }
  }
}

void require_threads(int num_threads, const std::string& fn) {
  if (num_threads < 0) {
    detail::fail(fn + ": num_threads must be >= 0 (0 = all; got " + std::to_string(num_threads) +
                 ")");
  }
}

// The SIMD kernel (src/kernels/rope_hwy.cc) takes accurate angles on views whose head_dim is
// unit-stride; everything else (float32 angles, strided head_dim) runs the scalar `rotate`.
bool kernel_applies(const RopeFrequencies& freqs, const View<const float, 4>& x,
                    const View<float, 4>& out) {
  return freqs.angles == RopeAngles::kAccurate && x.last_dim_contiguous() &&
         out.last_dim_contiguous() && x.numel() > 0;
}

kernels::RopeTensor kernel_tensor(const View<const float, 4>& x, const View<float, 4>& out) {
  kernels::RopeTensor t;
  t.x = x.data;
  t.out = out.data;
  t.heads = x.shape[2];
  for (std::size_t d = 0; d < 3; ++d) {
    t.x_stride[d] = x.stride[d];
    t.out_stride[d] = out.stride[d];
  }
  return t;
}

template <class T>
kernels::RopeParams kernel_params(const RopeFrequencies& freqs, RopeStyle style,
                                  const View<const T, 4>& x, const Positions& pos, Direction dir,
                                  int num_threads) {
  kernels::RopeParams p;
  p.batch = x.shape[0];
  p.seq = x.shape[1];
  p.head_dim = x.shape[3];
  p.inv_freq = freqs.inv_freq.data();
  p.pairs = static_cast<int64_t>(freqs.inv_freq.size());
  p.attention_factor = freqs.attention_factor;
  p.interleaved = style == RopeStyle::kInterleaved;
  p.inverse = dir == Direction::kInverse;
  p.positions = &pos;
  p.num_threads = kernels::resolve_threads(num_threads);
  return p;
}

template <class T>
void apply_checked(const RopeFrequencies& freqs, RopeStyle style, View<const T, 4> x,
                   View<T, 4> out, const Positions* positions, Direction dir, const char* fn,
                   int num_threads = 1) {
  validate_apply(freqs, x, out, fn);
  require_threads(num_threads, fn);
  const Positions pos = positions ? *positions : Positions::offset(0);
  pos.validate(x.shape[0], x.shape[1], std::string(fn) + ": positions");
  if constexpr (std::is_same_v<T, float>) {
    if (kernel_applies(freqs, x, out)) {
      kernels::RopeParams p = kernel_params(freqs, style, x, pos, dir, num_threads);
      p.tensors[0] = kernel_tensor(x, out);
      kernels::rope_f32(p);
      return;
    }
  }
  const bool f32 = freqs.angles == RopeAngles::kFloat32 && std::is_same_v<T, float>;
  rotate<T>(static_cast<int64_t>(freqs.inv_freq.size()), style, f32, x, out,
            [&](int64_t b, int64_t i, double* cs) {
              const int64_t p = pos.at(b, i);
              fill_angles(
                  freqs, dir, [p](std::size_t) { return p; }, cs);
            });
}

template <class T>
void apply_mrope_checked(const RopeFrequencies& freqs, RopeStyle style, const MRope& m,
                         View<const T, 4> x, View<T, 4> out,
                         const std::array<Positions, 3>& positions, Direction dir, const char* fn) {
  validate_apply(freqs, x, out, fn);
  const int64_t pairs = static_cast<int64_t>(freqs.inv_freq.size());
  validate(m, pairs);
  static const char* kNames[] = {"t", "h", "w"};
  for (int c = 0; c < 3; ++c) {
    positions[static_cast<std::size_t>(c)].validate(
        x.shape[0], x.shape[1], std::string(fn) + ": positions (" + kNames[c] + ")");
  }
  std::vector<int> comp(static_cast<std::size_t>(pairs));
  for (int64_t k = 0; k < pairs; ++k) comp[static_cast<std::size_t>(k)] = mrope_component(m, k);
  const bool f32 = freqs.angles == RopeAngles::kFloat32 && std::is_same_v<T, float>;
  rotate<T>(pairs, style, f32, x, out, [&](int64_t b, int64_t i, double* cs) {
    fill_angles(
        freqs, dir,
        [&](std::size_t k) { return positions[static_cast<std::size_t>(comp[k])].at(b, i); }, cs);
  });
}

}  // namespace

void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<const float, 4> x,
                View<float, 4> out, const Positions* positions, Direction direction,
                int num_threads) {
  apply_checked<float>(freqs, style, x, out, positions, direction, "apply_rope", num_threads);
}

void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<float, 4> x,
                const Positions* positions, Direction direction, int num_threads) {
  apply_checked<float>(freqs, style, x, x, positions, direction, "apply_rope", num_threads);
}

void apply_rope_qk(const RopeFrequencies& freqs, RopeStyle style, View<float, 4> q,
                   View<float, 4> k, const Positions* positions, Direction direction,
                   int num_threads) {
  const std::string fn = "apply_rope_qk";
  validate_apply<float>(freqs, q, q, fn + ": q");
  validate_apply<float>(freqs, k, k, fn + ": k");
  require_threads(num_threads, fn);
  if (q.shape[0] != k.shape[0] || q.shape[1] != k.shape[1] || q.shape[3] != k.shape[3]) {
    detail::fail<ShapeError>(fn + ": q " + shape_str(q.shape) + " and k " + shape_str(k.shape) +
                             " [batch, seq, heads, head_dim] need the same batch, seq and "
                             "head_dim");
  }
  const Positions pos = positions ? *positions : Positions::offset(0);
  pos.validate(q.shape[0], q.shape[1], fn + ": positions");
  if (kernel_applies(freqs, q, q) && kernel_applies(freqs, k, k)) {
    // One pass: each token's cos/sin rotate the heads of q, then those of k.
    kernels::RopeParams p = kernel_params<float>(freqs, style, q, pos, direction, num_threads);
    p.tensors[0] = kernel_tensor(q, q);
    p.tensors[1] = kernel_tensor(k, k);
    p.num_tensors = 2;
    kernels::rope_f32(p);
    return;
  }
  apply_checked<float>(freqs, style, q, q, &pos, direction, "apply_rope_qk: q", num_threads);
  apply_checked<float>(freqs, style, k, k, &pos, direction, "apply_rope_qk: k", num_threads);
}

namespace {

// rerotate_rope's checks on k (any element type); returns the positions.
template <class T>
Positions validate_rerotate(const RopeFrequencies& from, const RopeFrequencies& to,
                            const View<T, 4>& k, const Positions* positions) {
  const std::string fn = "rerotate_rope";
  validate_apply<T>(to, k, k, fn);
  validate_freqs(from, fn + ": from");
  if (from.inv_freq.size() != to.inv_freq.size()) {
    detail::fail<ShapeError>(fn + ": from and to have different rotary dims (" +
                             std::to_string(from.rotary_dim()) + " vs " +
                             std::to_string(to.rotary_dim()) + ")");
  }
  if (from.angles != RopeAngles::kAccurate || to.angles != RopeAngles::kAccurate) {
    detail::fail(fn + ": needs accurate angles");
  }
  const Positions pos = positions ? *positions : Positions::offset(0);
  pos.validate(k.shape[0], k.shape[1], fn + ": positions");
  return pos;
}

// cos/sin of the re-rotation at position p (cs[2j], cs[2j + 1]).
void rerotate_angles(const RopeFrequencies& from, const RopeFrequencies& to, int64_t pos,
                     double* cs) {
  const double scale = to.attention_factor / from.attention_factor;
  const std::size_t pairs = to.inv_freq.size();
  const double p = static_cast<double>(pos);
  for (std::size_t j = 0; j < pairs; ++j) {
    const double a = p * to.inv_freq[j] - p * from.inv_freq[j];
    cs[2 * j] = std::cos(a) * scale;
    cs[2 * j + 1] = std::sin(a) * scale;
  }
}

// True when no two elements of v share an address.
template <class T>
bool distinct_elements(const View<T, 4>& v) {
  std::array<std::pair<int64_t, int64_t>, 4> dims{};  // (|stride|, shape)
  for (std::size_t d = 0; d < 4; ++d) dims[d] = {std::abs(v.stride[d]), v.shape[d]};
  std::sort(dims.begin(), dims.end());
  int64_t extent = 1;
  for (const auto& [stride, n] : dims) {
    if (n <= 1) continue;
    if (stride < extent) return false;
    extent += stride * (n - 1);
  }
  return true;
}

// The bytes [lo, hi) that v's elements span.
template <class T>
std::pair<uintptr_t, uintptr_t> byte_range(const View<T, 4>& v) {
  int64_t lo = 0, hi = 0;
  for (std::size_t d = 0; d < 4; ++d) {
    const int64_t span = v.stride[d] * (v.shape[d] - 1);
    (span < 0 ? lo : hi) += span;
  }
  const auto base = reinterpret_cast<uintptr_t>(v.data);
  return {base + static_cast<uintptr_t>(lo * static_cast<int64_t>(sizeof(T))),
          base + static_cast<uintptr_t>((hi + 1) * static_cast<int64_t>(sizeof(T)))};
}

// The kernel writes rows of out as it reads the same rows of x, in parallel: out's elements must
// be distinct and x either the same view (in place) or elsewhere.
template <class T>
bool rows_independent(const View<const T, 4>& x, const View<T, 4>& out) {
  if (!distinct_elements(out)) return false;
  if (static_cast<const void*>(x.data) == static_cast<const void*>(out.data) &&
      x.stride == out.stride) {
    return true;
  }
  const auto [xlo, xhi] = byte_range(x);
  const auto [olo, ohi] = byte_range(out);
  return xhi <= olo || ohi <= xlo;
}

template <class T>
constexpr DType half_dtype() {
  return std::is_same_v<T, bf16> ? DType::kBF16 : DType::kF16;
}

}  // namespace

void rerotate_rope(const RopeFrequencies& from, const RopeFrequencies& to, RopeStyle style,
                   View<float, 4> k, const Positions* positions) {
  const Positions pos = validate_rerotate(from, to, k, positions);
  rotate<float>(
      static_cast<int64_t>(to.inv_freq.size()), style, false, k, k,
      [&](int64_t b, int64_t i, double* cs) { rerotate_angles(from, to, pos.at(b, i), cs); });
}

namespace detail {

template <class T>
bool apply_rope_half(const RopeFrequencies& freqs, RopeStyle style, View<const T, 4> x,
                     View<T, 4> out, const Positions* positions, Direction direction,
                     int num_threads) {
  const char* fn = "apply_rope";
  validate_apply(freqs, x, out, fn);
  require_threads(num_threads, fn);
  const Positions pos = positions ? *positions : Positions::offset(0);
  pos.validate(x.shape[0], x.shape[1], std::string(fn) + ": positions");
  if (freqs.angles != RopeAngles::kAccurate || !x.last_dim_contiguous() ||
      !out.last_dim_contiguous() || x.numel() == 0 || !rows_independent(x, out)) {
    return false;
  }
  kernels::RopeParams p = kernel_params<T>(freqs, style, x, pos, direction, num_threads);
  kernels::RopeTensor& t = p.tensors[0];
  t.x_half = reinterpret_cast<const uint16_t*>(x.data);
  t.out_half = reinterpret_cast<uint16_t*>(out.data);
  t.dtype = half_dtype<T>();
  t.heads = x.shape[2];
  for (std::size_t d = 0; d < 3; ++d) {
    t.x_stride[d] = x.stride[d];
    t.out_stride[d] = out.stride[d];
  }
  kernels::rope_f32(p);
  return true;
}

template <class T>
bool rerotate_rope_half(const RopeFrequencies& from, const RopeFrequencies& to, RopeStyle style,
                        View<T, 4> k, const Positions* positions) {
  const Positions pos = validate_rerotate(from, to, k, positions);
  if (!k.last_dim_contiguous() || k.numel() == 0 || !distinct_elements(k)) return false;
  // Token by token: its rows widened into `row`, re-rotated there by rerotate_rope's float32
  // code, rounded back once.
  const int64_t heads = k.shape[2], dim = k.shape[3];
  const DType dt = half_dtype<T>();
  std::vector<float> row(static_cast<std::size_t>(heads * dim));
  const auto rv = View<float, 4>::contiguous(row.data(), {1, 1, heads, dim});
  for (int64_t b = 0; b < k.shape[0]; ++b) {
    for (int64_t i = 0; i < k.shape[1]; ++i) {
      T* base = k.data + b * k.stride[0] + i * k.stride[1];
      for (int64_t h = 0; h < heads; ++h) {
        kernels::half_to_float(dt, reinterpret_cast<const uint16_t*>(base + h * k.stride[2]),
                               row.data() + h * dim, dim);
      }
      const int64_t p = pos.at(b, i);
      rotate<float>(static_cast<int64_t>(to.inv_freq.size()), style, false, rv, rv,
                    [&](int64_t, int64_t, double* cs) { rerotate_angles(from, to, p, cs); });
      for (int64_t h = 0; h < heads; ++h) {
        kernels::float_to_half(dt, row.data() + h * dim,
                               reinterpret_cast<uint16_t*>(base + h * k.stride[2]), dim);
      }
    }
  }
  return true;
}

template bool apply_rope_half(const RopeFrequencies&, RopeStyle, View<const bf16, 4>, View<bf16, 4>,
                              const Positions*, Direction, int);
template bool apply_rope_half(const RopeFrequencies&, RopeStyle, View<const f16, 4>, View<f16, 4>,
                              const Positions*, Direction, int);
template bool rerotate_rope_half(const RopeFrequencies&, const RopeFrequencies&, RopeStyle,
                                 View<bf16, 4>, const Positions*);
template bool rerotate_rope_half(const RopeFrequencies&, const RopeFrequencies&, RopeStyle,
                                 View<f16, 4>, const Positions*);

}  // namespace detail

int mrope_component(const MRope& m, int64_t pair) {
  const auto& s = m.sections;
  if (m.layout == MRopeLayout::kSectioned) {
    if (pair < s[0]) return 0;
    if (pair < s[0] + s[1]) return 1;
    return 2;
  }
  if (pair % 3 == 1 && pair < 3 * s[1]) return 1;
  if (pair % 3 == 2 && pair < 3 * s[2]) return 2;
  return 0;
}

void validate(const MRope& m, int64_t pairs) {
  const auto& s = m.sections;
  if (s[0] < 0 || s[1] < 0 || s[2] < 0 || s[0] + s[1] + s[2] != pairs) {
    detail::fail("mrope: sections [" + std::to_string(s[0]) + ", " + std::to_string(s[1]) + ", " +
                 std::to_string(s[2]) +
                 "] must be >= 0 and add up to rotary_dim / 2 = " + std::to_string(pairs));
  }
}

void apply_mrope(const RopeFrequencies& freqs, RopeStyle style, const MRope& mrope,
                 View<const float, 4> x, View<float, 4> out,
                 const std::array<Positions, 3>& positions, Direction direction) {
  apply_mrope_checked<float>(freqs, style, mrope, x, out, positions, direction, "apply_mrope");
}

namespace ref {
void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<const double, 4> x,
                View<double, 4> out, const Positions* positions, Direction direction) {
  apply_checked<double>(freqs, style, x, out, positions, direction, "ref::apply_rope");
}

void apply_mrope(const RopeFrequencies& freqs, RopeStyle style, const MRope& mrope,
                 View<const double, 4> x, View<double, 4> out,
                 const std::array<Positions, 3>& positions, Direction direction) {
  apply_mrope_checked<double>(freqs, style, mrope, x, out, positions, direction,
                              "ref::apply_mrope");
}
}  // namespace ref

}  // namespace posenc
