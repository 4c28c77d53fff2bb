// src/model/layers.cc - a model's layers (posenc/config.h): model_layer, the per-layer RoPE
// (layer_rope_frequencies, layer_rope) and apply_model_rope
// (DeepSeek's rotary offset and de-interleaved output).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "posenc/config.h"
#include "posenc/error.h"
#include "posenc/rope.h"

namespace posenc {

const ModelLayer& model_layer(const ModelConfig& cfg, int64_t layer) {
  if (cfg.layers.empty()) {
    throw ValueError("model_layer: model_type '" + cfg.model_type + "' lists no layers");
  }
  if (layer < 0 || layer >= static_cast<int64_t>(cfg.layers.size())) {
    throw ValueError("layer " + std::to_string(layer) + " is out of range: model_type '" +
                     cfg.model_type + "' has " + std::to_string(cfg.layers.size()) +
                     " layers (0.." + std::to_string(cfg.layers.size() - 1) + ")");
  }
  return cfg.layers[static_cast<std::size_t>(layer)];
}

RopeFrequencies layer_rope_frequencies(const ModelConfig& cfg, int64_t layer, int64_t seq_len,
                                       RopeAngles angles) {
  if (cfg.scheme != ModelScheme::kRope) {
    throw ValueError("layer_rope_frequencies: model_type '" + cfg.model_type +
                     "' does not use RoPE");
  }
  const ModelLayer& l = model_layer(cfg, layer);
  if (!l.rope) {
    throw ValueError("layer " + std::to_string(layer) + " of model_type '" + cfg.model_type +
                     "' uses no RoPE (a NoPE layer)");
  }
  return rope_frequencies(l.rope_config, seq_len, angles);
}

LayerRopeFrequencies layer_rope(const ModelConfig& cfg, int64_t layer, int64_t seq_len,
                                RopeAngles angles) {
  if (cfg.scheme != ModelScheme::kRope) {
    throw ValueError("layer_rope: model_type '" + cfg.model_type + "' does not use RoPE");
  }
  const ModelLayer& l = model_layer(cfg, layer);
  LayerRopeFrequencies out;
  if (l.rope) {
    static_cast<RopeFrequencies&>(out) = rope_frequencies(l.rope_config, seq_len, angles);
    out.style = l.rope_config.style;
  } else {
    out.angles = angles;
    out.style = cfg.rope.style;
  }
  out.layer = layer;
  out.nope = !l.rope;
  out.temperature = l.temperature;
  return out;
}

void apply_model_rope(const ModelConfig& cfg, const RopeFrequencies& freqs, View<const float, 4> x,
                      View<float, 4> out, const Positions* positions, Direction direction) {
  const int64_t rd = freqs.rotary_dim();
  const int64_t d = x.shape[3];
  if (x.shape != out.shape) {
    throw ShapeError("apply_model_rope: out shape " + shape_str(out.shape) +
                     " differs from x shape " + shape_str(x.shape));
  }
  // The rotary part: at rope_offset in a full head, or the whole of a rotary-only input.
  int64_t offset = 0;
  if (cfg.rope_offset > 0 && d >= cfg.rope_offset + rd) {
    offset = cfg.rope_offset;
  } else if (cfg.rope_offset > 0 && d != rd) {
    throw ShapeError("apply_model_rope: head_dim " + std::to_string(d) + " of x fits neither the " +
                     "full head (" + std::to_string(cfg.rope_offset + rd) +
                     ", rotary part from dim " + std::to_string(cfg.rope_offset) +
                     ") nor the rotary part alone (" + std::to_string(rd) + ") of model_type '" +
                     cfg.model_type + "'");
  }
  View<const float, 4> xr = x;
  View<float, 4> outr = out;
  xr.data = x.data + offset * x.stride[3];
  outr.data = out.data + offset * out.stride[3];
  xr.shape[3] = outr.shape[3] = d - offset;
  // Dims before the rotary part pass through.
  if (offset > 0) {
    for (int64_t b = 0; b < x.shape[0]; ++b) {
      for (int64_t i = 0; i < x.shape[1]; ++i) {
        for (int64_t h = 0; h < x.shape[2]; ++h) {
          for (int64_t c = 0; c < offset; ++c) out(b, i, h, c) = x(b, i, h, c);
        }
      }
    }
  }
  if (!cfg.rope_deinterleave) {
    apply_rope(freqs, cfg.rope.style, xr, outr, positions, direction);
    return;
  }
  // DeepSeek-V3: pair (2k, 2k + 1) rotates by inv_freq[k] and is written to (k, k + R/2).
  // Forward: rotate interleaved, then de-interleave. Inverse: re-interleave, then rotate back.
  const int64_t pairs = rd / 2;
  std::vector<float> tmp(static_cast<std::size_t>(rd));
  auto permute = [&](const View<const float, 4>& src, const View<float, 4>& dst, bool forward) {
    for (int64_t b = 0; b < src.shape[0]; ++b) {
      for (int64_t i = 0; i < src.shape[1]; ++i) {
        for (int64_t h = 0; h < src.shape[2]; ++h) {
          for (int64_t k = 0; k < pairs; ++k) {
            const int64_t a = forward ? 2 * k : k, bb = forward ? 2 * k + 1 : k + pairs;
            const int64_t ta = forward ? k : 2 * k, tb = forward ? k + pairs : 2 * k + 1;
            tmp[static_cast<std::size_t>(ta)] = src(b, i, h, a);
            tmp[static_cast<std::size_t>(tb)] = src(b, i, h, bb);
          }
          for (int64_t c = 0; c < rd; ++c) dst(b, i, h, c) = tmp[static_cast<std::size_t>(c)];
        }
      }
    }
  };
  if (direction == Direction::kForward) {
    apply_rope(freqs, RopeStyle::kInterleaved, xr, outr, positions, direction);
    permute(View<const float, 4>(outr), outr, true);
  } else {
    permute(xr, outr, false);
    apply_rope(freqs, RopeStyle::kInterleaved, View<const float, 4>(outr), outr, positions,
               direction);
  }
}

}  // namespace posenc
