// src/schemes/rope_frequencies.cc - RoPE's inverse frequencies (Su et al. 2021, "RoFormer";
// docs/rope.md) and the HF frequency scalings (docs/rope-scaling/): position interpolation (Chen
// et al. 2023), dynamic NTK, YaRN (Peng et al. 2023), Llama 3.1's wavelength-banded scaling,
// LongRoPE (Ding et al. 2024); and the rope scheme's builder (build_scheme).
//
// Precision: inverse frequencies are double, or float32 as the reference code computes them
// (RopeAngles::kFloat32).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <utility>
#include <vector>

#include "common.h"
#include "posenc/rope.h"
#include "schemes/build.h"
#include "schemes/rope_term.h"

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

// proportional: the pairs that rotate, int(partial_rotary_factor * R // 2) as the reference
// computes it (a product in double, then a floor division by 2).
std::size_t rotated_pairs(const RopeScaling& s, int64_t r) {
  return static_cast<std::size_t>(
      std::floor(s.partial_rotary_factor * static_cast<double>(r) / 2.0));
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
    case RopeScalingType::kProportional: {
      // 1.0 / (base ** (arange(0, 2 * rotated, 2).float() / R)), zeros for the others, then
      // inv_freq /= factor.
      inv = default_inv(cast(cfg.base), r);
      const std::size_t rotated = rotated_pairs(s, r);
      for (std::size_t i = 0; i < inv.size(); ++i) {
        inv[i] = i < rotated ? inv[i] / cast(s.factor) : 0.0f;
      }
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
    case RopeScalingType::kProportional:
      require_factor(s, "proportional");
      if (!(s.partial_rotary_factor >= 0.0 && s.partial_rotary_factor <= 1.0)) {
        detail::fail("rope scaling 'proportional': partial_rotary_factor must be in [0, 1] (got " +
                     detail::num(s.partial_rotary_factor) + ")");
      }
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
    case RopeScalingType::kProportional: {
      base_inv(cfg.base);
      const std::size_t rotated = rotated_pairs(s, r);
      for (std::size_t i = 0; i < out.inv_freq.size(); ++i) {
        out.inv_freq[i] = i < rotated ? out.inv_freq[i] / s.factor : 0.0;
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

namespace attn {

// The scheme from its settings, parameters and model config (build_scheme).
template <class T>
void RopeTerm<T>::build(detail::SchemeBuild& b, const ModelLayer* layer) {
  if (layer != nullptr && !layer->rope) {  // a NoPE layer (Llama 4)
    if (b.settings.freqs)
      detail::fail("freqs conflicts with a NoPE layer (layer " + std::to_string(layer->index) +
                   ")");
    b.out.scheme = NoPositions{};
    b.out.name = "none";
    return;
  }
  if (b.settings.freqs) {
    if (b.model) b.conflict(b.settings.style.has_value(), "style");
    b.out.scheme = Rope{*b.settings.freqs, layer     ? layer->rope_config.style
                                           : b.model ? b.model->rope.style
                                                     : b.settings.style.value_or(RopeStyle::kHalf)};
    return;
  }
  if (b.model) {
    b.conflict(b.settings.base.has_value(), "base");
    b.conflict(b.settings.rotary_dim.has_value(), "rotary_dim");
    b.conflict(b.settings.scaling.has_value(), "scaling");
    b.conflict(b.settings.style.has_value(), "style");
    // DeepSeek's decoupled RoPE: heads [qk_nope | qk_rope] rotate from rope_offset on; q and k
    // may also be the rotary parts alone. Pairs rotate as the model's code pairs them (its
    // de-interleaved output layout permutes q and k alike and leaves every score unchanged).
    int64_t offset = 0;
    if (b.model->rope_offset > 0) {
      const int64_t full = b.model->rope_offset + b.model->rope.head_dim;
      if (b.dims.head_dim == full) {
        offset = b.model->rope_offset;
        if (!layer && !b.model->layers.empty() && b.model->layers[0].softmax_scale > 0) {
          b.out.scale = b.model->layers[0].softmax_scale;  // 1 / sqrt(qk_head_dim) x mscale^2
        }
      } else if (b.dims.head_dim != b.model->rope.head_dim) {
        detail::fail<ShapeError>(
            b.settings.q_name + ": head_dim " + std::to_string(b.dims.head_dim) + " fits " +
            b.settings.config_name + " (model_type '" + b.model->model_type +
            "') neither as full heads (qk_nope_head_dim + qk_rope_head_dim = " +
            std::to_string(full) + ") nor as their rotary parts (" +
            std::to_string(b.model->rope.head_dim) + ")");
      }
    }
    if (layer != nullptr) {
      b.out.scheme =
          Rope{layer_rope_frequencies(*b.model, layer->index, b.dims.seq_len, b.settings.angles),
               layer->rope_config.style, offset};
      return;
    }
    // M-RoPE configs: text positions (t = h = w) make M-RoPE plain RoPE with these frequencies.
    b.out.scheme = Rope{model_rope_frequencies(*b.model, b.dims.seq_len, b.settings.angles),
                        b.model->rope.style, offset};
    return;
  }
  RopeConfig cfg;
  cfg.head_dim = b.dims.head_dim;
  cfg.rotary_dim = b.settings.rotary_dim.value_or(0);
  cfg.base = b.settings.base.value_or(1e4);
  if (b.settings.scaling) cfg.scaling = *b.settings.scaling;
  cfg.style = b.settings.style.value_or(RopeStyle::kHalf);
  validate(cfg);
  b.out.scheme = Rope{rope_frequencies(cfg, b.dims.seq_len, b.settings.angles), cfg.style};
}
template void RopeTerm<float>::build(detail::SchemeBuild&, const ModelLayer*);

}  // namespace attn

}  // namespace posenc
