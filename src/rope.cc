// src/rope.cc - rotary position embedding (Su et al. 2021, "RoFormer"; SPEC §3) and the HF
// frequency scalings (SPEC §3.1): position interpolation (Chen et al. 2023), dynamic NTK,
// YaRN (Peng et al. 2023), Llama 3.1's wavelength-banded scaling, LongRoPE (Ding et al. 2024).
//
// Precision: inverse frequencies are double; p * inv_freq, cos and sin are double; the rotated
// pair is formed in double from the float inputs and rounded once. The float32 output is thus
// the float64 result rounded once (up to an ulp), at any position.
#include "posenc/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "common.h"

namespace posenc {
namespace {

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
      if (!(s.low_freq_factor > 0) || !(s.high_freq_factor > s.low_freq_factor) ||
          !std::isfinite(s.high_freq_factor)) {
        detail::fail("rope scaling 'llama3': need 0 < low_freq_factor < high_freq_factor (got " +
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

RopeFrequencies rope_frequencies(const RopeConfig& cfg, int64_t seq_len) {
  validate(cfg);
  if (seq_len < 0) detail::fail("rope_frequencies: seq_len must be >= 0");
  const int64_t r = effective_rotary_dim(cfg);
  const int64_t pairs = r / 2;
  const double rd = static_cast<double>(r);
  const RopeScaling& s = cfg.scaling;
  RopeFrequencies out;
  out.inv_freq.resize(static_cast<std::size_t>(pairs));
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
        } else if (wl >= high_wl) {
          const double sigma =
              (lo / wl - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
          f = (1.0 - sigma) * f / s.factor + sigma * f;
        }
      }
      break;
    }
    case RopeScalingType::kYarn: {
      base_inv(cfg.base);
      const double log_theta = std::log(cfg.base);
      auto corr = [&](double n) {
        return rd * std::log(lo / (2.0 * std::numbers::pi * n)) / (2.0 * log_theta);
      };
      double low = corr(s.beta_fast), high = corr(s.beta_slow);
      if (s.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, rd - 1.0);
      if (low == high) high += 0.001;
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
  return out;
}

namespace {

void validate_apply(const RopeFrequencies& freqs, const std::array<int64_t, 4>& xs,
                    const std::array<int64_t, 4>& os, const char* fn) {
  const std::string f = fn;
  if (freqs.inv_freq.empty()) detail::fail(f + ": freqs.inv_freq is empty");
  for (double v : freqs.inv_freq) {
    if (!std::isfinite(v)) detail::fail(f + ": freqs.inv_freq has a non-finite entry");
  }
  if (!std::isfinite(freqs.attention_factor)) {
    detail::fail(f + ": attention_factor must be finite");
  }
  if (xs != os) {
    detail::fail<ShapeError>(f + ": out shape " + shape_str(os) + " differs from x shape " +
                             shape_str(xs));
  }
  if (freqs.rotary_dim() > xs[3]) {
    detail::fail<ShapeError>(f + ": rotary_dim (" + std::to_string(freqs.rotary_dim()) +
                             ") exceeds head_dim (" + std::to_string(xs[3]) +
                             ") of x [batch, seq, heads, head_dim]");
  }
}

// One kernel for float (API) and double (reference); the arithmetic is double in both.
template <class T>
void rope_impl(const RopeFrequencies& freqs, RopeStyle style, View<const T, 4> x, View<T, 4> out,
               const Positions& pos, Direction dir) {
  const int64_t batch = x.shape[0], seq = x.shape[1], heads = x.shape[2], dim = x.shape[3];
  const int64_t pairs = static_cast<int64_t>(freqs.inv_freq.size());
  const int64_t half = pairs;
  const double af = freqs.attention_factor;
  const double sign = dir == Direction::kForward ? 1.0 : -1.0;
  std::vector<double> cs(static_cast<std::size_t>(2 * pairs));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < seq; ++i) {
      const double p = static_cast<double>(pos.at(b, i));
      for (int64_t k = 0; k < pairs; ++k) {
        const double a = p * freqs.inv_freq[static_cast<std::size_t>(k)];
        cs[static_cast<std::size_t>(2 * k)] = std::cos(a) * af;
        cs[static_cast<std::size_t>(2 * k + 1)] = sign * std::sin(a) * af;
      }
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x.data + b * x.stride[0] + i * x.stride[1] + h * x.stride[2];
        T* orow = out.data + b * out.stride[0] + i * out.stride[1] + h * out.stride[2];
        const int64_t xs = x.stride[3], ost = out.stride[3];
        for (int64_t k = 0; k < pairs; ++k) {
          const int64_t i0 = style == RopeStyle::kHalf ? k : 2 * k;
          const int64_t i1 = style == RopeStyle::kHalf ? k + half : 2 * k + 1;
          const double c = cs[static_cast<std::size_t>(2 * k)];
          const double s = cs[static_cast<std::size_t>(2 * k + 1)];
          const double x0 = static_cast<double>(xr[i0 * xs]);
          const double x1 = static_cast<double>(xr[i1 * xs]);
          orow[i0 * ost] = static_cast<T>(x0 * c - x1 * s);
          orow[i1 * ost] = static_cast<T>(x1 * c + x0 * s);
        }
        if (static_cast<const void*>(orow) != static_cast<const void*>(xr) || ost != xs) {
          for (int64_t d = 2 * pairs; d < dim; ++d) orow[d * ost] = xr[d * xs];
        }
      }
    }
  }
}

template <class T>
void apply_checked(const RopeFrequencies& freqs, RopeStyle style, View<const T, 4> x,
                   View<T, 4> out, const Positions* positions, Direction dir, const char* fn) {
  detail::require_data(x, std::string(fn) + ": x");
  detail::require_data(out, std::string(fn) + ": out");
  validate_apply(freqs, x.shape, out.shape, fn);
  const Positions pos = positions ? *positions : Positions::offset(0);
  pos.validate(x.shape[0], x.shape[1], std::string(fn) + ": positions");
  rope_impl<T>(freqs, style, x, out, pos, dir);
}

}  // namespace

void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<const float, 4> x,
                View<float, 4> out, const Positions* positions, Direction direction) {
  apply_checked<float>(freqs, style, x, out, positions, direction, "apply_rope");
}

void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<float, 4> x,
                const Positions* positions, Direction direction) {
  apply_checked<float>(freqs, style, x, x, positions, direction, "apply_rope");
}

namespace ref {
void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<const double, 4> x,
                View<double, 4> out, const Positions* positions, Direction direction) {
  apply_checked<double>(freqs, style, x, out, positions, direction, "ref::apply_rope");
}
}  // namespace ref

}  // namespace posenc
