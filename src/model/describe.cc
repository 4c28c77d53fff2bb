// src/model/describe.cc - a model config in words (posenc::describe, ModelConfig::layers_differ,
// model_scheme_name): what `posenc describe` prints.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "model/format.h"
#include "posenc/config.h"
#include "posenc/names.h"

namespace posenc {

using model::fmt;

namespace {

std::string scaling_summary(const RopeScaling& s);

// One line for a layer's position handling (without its index): equal lines, equal layers. The
// head dim and key/value heads appear where they differ from the model's (Gemma 4).
std::string layer_summary(const ModelLayer& l, const ModelConfig& cfg) {
  std::string out = l.attention;
  if ((l.head_dim > 0 && l.head_dim != cfg.head_dim) ||
      (l.heads_kv > 0 && l.heads_kv != cfg.heads_kv)) {
    out += ", head_dim " + fmt(l.head_dim) + ", " + fmt(l.heads_kv) + " kv heads";
  }
  if (l.sliding_window) out += ", window " + fmt(*l.sliding_window);
  if (l.attention_chunk) out += ", chunk " + fmt(*l.attention_chunk);
  if (l.rope) {
    const RopeConfig& r = l.rope_config;
    out += ", rope theta " + fmt(r.base) + " " + scaling_summary(r.scaling);
  } else {
    out += ", no RoPE (NoPE)";
  }
  if (l.temperature) {
    out += ", temperature tuning (floor_scale " + fmt(l.temperature->floor_scale) +
           ", attn_scale " + fmt(l.temperature->attn_scale) + ")";
  }
  if (l.attention_sinks) out += ", attention sinks";
  if (l.softcap) out += ", soft-cap " + fmt(*l.softcap);
  out += ", scale " + fmt(l.softmax_scale);
  return out;
}

// "0-4, 6-10, 12" for sorted indices.
std::string index_ranges(const std::vector<int64_t>& idx) {
  std::string out;
  for (std::size_t i = 0; i < idx.size();) {
    std::size_t j = i;
    while (j + 1 < idx.size() && idx[j + 1] == idx[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += fmt(idx[i]);
    if (j > i) {
      out += '-';
      out += fmt(idx[j]);
    }
    i = j + 1;
  }
  return out;
}

}  // namespace

bool ModelConfig::layers_differ() const {
  for (const ModelLayer& l : layers) {
    if (layer_summary(l, *this) != layer_summary(layers.front(), *this)) return true;
  }
  return false;
}

namespace {

std::string list_summary(const std::vector<double>& v) {
  if (v.empty()) return "[]";
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return "[" + std::to_string(v.size()) + " values, " + fmt(v.front()) + " .. " + fmt(v.back()) +
         ", min " + fmt(*lo) + ", max " + fmt(*hi) + "]";
}

std::string scaling_summary(const RopeScaling& s) {
  std::string sc = scaling_name(s.type);
  switch (s.type) {
    case RopeScalingType::kDefault:
      break;
    case RopeScalingType::kLinear:
      sc += ": factor " + fmt(s.factor);
      if (s.original_max_position_embeddings > 0) {
        sc += ", original_max_position_embeddings " + fmt(s.original_max_position_embeddings);
      }
      break;
    case RopeScalingType::kDynamic:
      sc += ": factor " + fmt(s.factor) + ", original_max_position_embeddings " +
            fmt(s.original_max_position_embeddings);
      break;
    case RopeScalingType::kLlama3:
      sc += ": factor " + fmt(s.factor) + ", original_max_position_embeddings " +
            fmt(s.original_max_position_embeddings) + ", low_freq_factor " +
            fmt(s.low_freq_factor) + ", high_freq_factor " + fmt(s.high_freq_factor);
      break;
    case RopeScalingType::kYarn:
      sc += ": factor " + fmt(s.factor) + ", original_max_position_embeddings " +
            fmt(s.original_max_position_embeddings) + ", beta_fast " + fmt(s.beta_fast) +
            ", beta_slow " + fmt(s.beta_slow) + ", truncate " + (s.truncate ? "true" : "false") +
            (s.mscale > 0 ? ", mscale " + fmt(s.mscale) : std::string()) +
            (s.mscale_all_dim > 0 ? ", mscale_all_dim " + fmt(s.mscale_all_dim) : std::string()) +
            (s.attention_factor > 0 ? ", attention_factor " + fmt(s.attention_factor)
                                    : std::string());
      break;
    case RopeScalingType::kLongRope:
      sc += ": original_max_position_embeddings " + fmt(s.original_max_position_embeddings) +
            ", max_position_embeddings " + fmt(s.max_position_embeddings) +
            (s.factor != 1.0 ? ", factor " + fmt(s.factor) : std::string()) +
            (s.attention_factor > 0 ? ", attention_factor " + fmt(s.attention_factor)
                                    : std::string()) +
            ", short_factor " + list_summary(s.short_factor) + ", long_factor " +
            list_summary(s.long_factor);
      break;
    case RopeScalingType::kProportional:
      sc += ": partial_rotary_factor " + fmt(s.partial_rotary_factor) +
            (s.factor != 1.0 ? ", factor " + fmt(s.factor) : std::string());
      break;
  }
  return sc;
}

}  // namespace

std::string describe(const ModelConfig& cfg) {
  std::string out;
  auto line = [&](const std::string& key, const std::string& value) {
    out += key + ": " + value + "\n";
  };
  line("model_type", cfg.model_type);
  line("scheme", model_scheme_name(cfg.scheme));
  line("hidden_size", fmt(cfg.hidden_size));
  line("heads", fmt(cfg.heads_q) + " q / " + fmt(cfg.heads_kv) + " kv");
  line("head_dim", fmt(cfg.head_dim));
  line("max_position_embeddings",
       cfg.max_position_embeddings > 0 ? fmt(cfg.max_position_embeddings) : "(none)");
  if (cfg.sliding_window) line("sliding_window", fmt(*cfg.sliding_window));
  switch (cfg.scheme) {
    case ModelScheme::kRope: {
      const RopeConfig& r = cfg.rope;
      const int64_t rd = r.rotary_dim == 0 ? r.head_dim : r.rotary_dim;
      line("rotary_dim", fmt(rd) + " of " + fmt(r.head_dim) + ", style " + style_name(r.style));
      line("rope_theta", fmt(r.base));
      line("rope_scaling", scaling_summary(r.scaling));
      if (cfg.mrope) {
        const auto& m = *cfg.mrope;
        line("mrope",
             std::string(m.layout == MRopeLayout::kInterleaved ? "interleaved" : "sectioned") +
                 ", sections [" + fmt(m.sections[0]) + ", " + fmt(m.sections[1]) + ", " +
                 fmt(m.sections[2]) + "] (t, h, w)");
      }
      const int64_t ctx = cfg.effective_context();
      try {
        const RopeFrequencies f = model_rope_frequencies(cfg, ctx);
        line("attention_factor", fmt(f.attention_factor) + " (at " + fmt(ctx) + " tokens)");
      } catch (const Error& e) {
        line("attention_factor", std::string("(invalid configuration: ") + e.what() + ")");
      }
      break;
    }
    case ModelScheme::kAlibi: {
      std::string sl;
      try {
        const auto slopes = alibi_slopes(cfg.alibi);
        const auto [lo, hi] = std::minmax_element(slopes.begin(), slopes.end());
        sl = ", slopes " + fmt(*hi) + " .. " + fmt(*lo);
      } catch (const Error&) {
        sl = ", slopes (invalid configuration)";
      }
      line("alibi", fmt(cfg.alibi.heads) + " heads, max_bias " + fmt(cfg.alibi.max_bias) + sl);
      break;
    }
    case ModelScheme::kT5:
      line("t5", "num_buckets " + fmt(cfg.t5.num_buckets) + ", max_distance " +
                     fmt(cfg.t5.max_distance) +
                     " (encoder bidirectional; decoder self-attention causal)");
      break;
    case ModelScheme::kDeberta: {
      std::string types;
      for (const auto& t : cfg.pos_att_type) types += (types.empty() ? "" : "|") + t;
      line("deberta", "span " + fmt(cfg.deberta.span()) + ", position_buckets " +
                          fmt(cfg.deberta.position_buckets) + ", max_relative_positions " +
                          fmt(cfg.deberta.max_relative_positions) + ", pos_att_type " +
                          (types.empty() ? "(none)" : types));
      break;
    }
    case ModelScheme::kLearned:
      line("learned", "table of " + fmt(cfg.max_position_embeddings) + " positions");
      break;
  }
  if (cfg.scheme == ModelScheme::kRope) {
    if (cfg.rope_offset > 0) {
      line("rope_layout", "rotary part = dims " + fmt(cfg.rope_offset) + ".." +
                              fmt(cfg.head_dim - 1) + " of each q / k head (qk_nope_head_dim " +
                              fmt(cfg.rope_offset) + " + qk_rope_head_dim " +
                              fmt(cfg.rope.head_dim) + "), v_head_dim " + fmt(cfg.v_head_dim));
    }
    if (cfg.rope_deinterleave) {
      line("rope_pairs",
           "interleaved pairs (2i, 2i+1) rotated and written de-interleaved to "
           "(i, i + R/2) (rope_interleave)");
    }
  }
  if (!cfg.layers.empty()) {
    if (!cfg.layers_differ()) {
      line("layers", fmt(static_cast<int64_t>(cfg.layers.size())) + ", all " +
                         layer_summary(cfg.layers.front(), cfg));
    } else {
      // Group equal layers; groups in the order of their first layer.
      std::vector<std::pair<std::string, std::vector<int64_t>>> groups;
      for (const ModelLayer& l : cfg.layers) {
        const std::string sig = layer_summary(l, cfg);
        auto it = std::find_if(groups.begin(), groups.end(),
                               [&](const auto& g) { return g.first == sig; });
        if (it == groups.end()) {
          groups.push_back({sig, {l.index}});
        } else {
          it->second.push_back(l.index);
        }
      }
      std::string pattern;
      for (const ModelLayer& l : cfg.layers) {
        for (std::size_t g = 0; g < groups.size(); ++g) {
          if (groups[g].first == layer_summary(l, cfg)) pattern += static_cast<char>('A' + g % 26);
        }
      }
      line("layers", fmt(static_cast<int64_t>(cfg.layers.size())) + ", pattern " + pattern);
      for (std::size_t g = 0; g < groups.size(); ++g) {
        out += "  " + std::string(1, static_cast<char>('A' + g % 26)) + ": layers " +
               index_ranges(groups[g].second) + ": " + groups[g].first + "\n";
      }
    }
  }
  line("effective_context", fmt(cfg.effective_context()));
  if (!cfg.defaults.empty()) {
    std::string d;
    for (const auto& [k, v] : cfg.defaults) d += (d.empty() ? "" : ", ") + k + " " + v;
    line("defaults", "(" + cfg.default_source + ", absent from the file) " + d);
  }
  return out;
}

const char* model_scheme_name(ModelScheme s) {
  switch (s) {
    case ModelScheme::kRope:
      return "rope";
    case ModelScheme::kAlibi:
      return "alibi";
    case ModelScheme::kT5:
      return "t5";
    case ModelScheme::kDeberta:
      return "deberta";
    case ModelScheme::kLearned:
      return "learned";
  }
  return "unknown";
}

}  // namespace posenc
