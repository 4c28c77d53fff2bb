// src/model/json.cc - a model config's positional encoding as JSON (posenc/config.h:
// describe_json, rope_scaling_json): the one serializer behind `posenc describe --json` and the
// Python ModelConfig's dicts.
#include <nlohmann/json.hpp>
#include <string>

#include "posenc/config.h"
#include "posenc/error.h"
#include "posenc/names.h"

namespace posenc {

namespace {

nlohmann::json scaling_json(const RopeScaling& s) {
  nlohmann::json j;
  j["type"] = scaling_name(s.type);
  if (s.type == RopeScalingType::kDefault) return j;
  j["factor"] = s.factor;
  if (s.type == RopeScalingType::kProportional) {
    j["partial_rotary_factor"] = s.partial_rotary_factor;
    return j;
  }
  // The other scalings have the original context (linear: only when the config gave it).
  if (s.type != RopeScalingType::kLinear || s.original_max_position_embeddings > 0) {
    j["original_max_position_embeddings"] = s.original_max_position_embeddings;
  }
  if (s.attention_factor > 0 &&
      (s.type == RopeScalingType::kYarn || s.type == RopeScalingType::kLongRope)) {
    j["attention_factor"] = s.attention_factor;
  }
  if (s.type == RopeScalingType::kLlama3) {
    j["low_freq_factor"] = s.low_freq_factor;
    j["high_freq_factor"] = s.high_freq_factor;
  } else if (s.type == RopeScalingType::kYarn) {
    j["beta_fast"] = s.beta_fast;
    j["beta_slow"] = s.beta_slow;
    j["truncate"] = s.truncate;
    if (s.mscale > 0) j["mscale"] = s.mscale;
    if (s.mscale_all_dim > 0) j["mscale_all_dim"] = s.mscale_all_dim;
  } else if (s.type == RopeScalingType::kLongRope) {
    j["max_position_embeddings"] = s.max_position_embeddings;
    j["short_factor"] = s.short_factor;
    j["long_factor"] = s.long_factor;
  }
  return j;
}

nlohmann::json layer_json(const ModelLayer& l) {
  nlohmann::json j;
  j["index"] = l.index;
  j["attention"] = l.attention;
  j["rope"] = l.rope;
  j["nope"] = !l.rope;
  j["rope_theta"] = l.rope ? nlohmann::json(l.rope_config.base) : nlohmann::json(nullptr);
  j["rope_scaling"] = l.rope ? scaling_json(l.rope_config.scaling) : nlohmann::json(nullptr);
  j["sliding_window"] = l.sliding_window ? nlohmann::json(*l.sliding_window) : nullptr;
  j["attention_chunk"] = l.attention_chunk ? nlohmann::json(*l.attention_chunk) : nullptr;
  j["softmax_scale"] = l.softmax_scale;
  j["temperature"] = l.temperature ? nlohmann::json{{"floor_scale", l.temperature->floor_scale},
                                                    {"attn_scale", l.temperature->attn_scale}}
                                   : nlohmann::json(nullptr);
  j["attention_sinks"] = l.attention_sinks;
  j["softcap"] = l.softcap ? nlohmann::json(*l.softcap) : nlohmann::json(nullptr);
  j["head_dim"] = l.head_dim;
  j["heads_kv"] = l.heads_kv;
  return j;
}

nlohmann::json describe_object(const ModelConfig& cfg) {
  nlohmann::json j;
  j["model_type"] = cfg.model_type;
  j["scheme"] = model_scheme_name(cfg.scheme);
  j["hidden_size"] = cfg.hidden_size;
  j["heads_q"] = cfg.heads_q;
  j["heads_kv"] = cfg.heads_kv;
  j["head_dim"] = cfg.head_dim;
  j["max_position_embeddings"] = cfg.max_position_embeddings;
  j["sliding_window"] = cfg.sliding_window ? nlohmann::json(*cfg.sliding_window) : nullptr;
  j["effective_context"] = cfg.effective_context();
  switch (cfg.scheme) {
    case ModelScheme::kRope: {
      const RopeConfig& r = cfg.rope;
      nlohmann::json rope;
      rope["rotary_dim"] = r.rotary_dim == 0 ? r.head_dim : r.rotary_dim;
      rope["base"] = r.base;
      rope["style"] = style_name(r.style);
      rope["scaling"] = scaling_json(r.scaling);
      try {
        rope["attention_factor"] =
            model_rope_frequencies(cfg, cfg.effective_context()).attention_factor;
      } catch (const Error&) {
        rope["attention_factor"] = nullptr;  // describe() says "invalid configuration"
      }
      if (cfg.rope_offset > 0) rope["offset"] = cfg.rope_offset;
      if (cfg.rope_deinterleave) rope["deinterleave"] = true;
      if (cfg.mrope) {
        rope["mrope"] = {{"layout", cfg.mrope->layout == MRopeLayout::kInterleaved ? "interleaved"
                                                                                   : "sectioned"},
                         {"sections", cfg.mrope->sections}};
      }
      j["rope"] = rope;
      break;
    }
    case ModelScheme::kAlibi: {
      nlohmann::json slopes = nullptr;
      try {
        slopes = alibi_slopes(cfg.alibi);
      } catch (const Error&) {
      }
      j["alibi"] = {
          {"heads", cfg.alibi.heads}, {"max_bias", cfg.alibi.max_bias}, {"slopes", slopes}};
      break;
    }
    case ModelScheme::kT5:
      j["t5"] = {{"num_buckets", cfg.t5.num_buckets},
                 {"max_distance", cfg.t5.max_distance},
                 {"bidirectional", cfg.t5.bidirectional}};
      break;
    case ModelScheme::kDeberta:
      j["deberta"] = {{"span", cfg.deberta.span()},
                      {"position_buckets", cfg.deberta.position_buckets},
                      {"max_relative_positions", cfg.deberta.max_relative_positions},
                      {"pos_att_type", cfg.pos_att_type}};
      break;
    case ModelScheme::kLearned:
      j["learned"] = {{"positions", cfg.max_position_embeddings}};
      break;
  }
  if (cfg.v_head_dim > 0) j["v_head_dim"] = cfg.v_head_dim;
  if (!cfg.layers.empty()) {
    nlohmann::json layers = nlohmann::json::array();
    for (const ModelLayer& l : cfg.layers) layers.push_back(layer_json(l));
    j["layers"] = layers;
    j["layers_differ"] = cfg.layers_differ();
  }
  // Values the file left out, taken from the model type's configuration class.
  nlohmann::json defaults = nlohmann::json::object();
  for (const auto& [k, v] : cfg.defaults) defaults[k] = v;
  j["defaults"] = defaults;
  j["default_source"] = cfg.default_source;
  return j;
}

}  // namespace

std::string describe_json(const ModelConfig& cfg) {
  return describe_object(cfg).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string rope_scaling_json(const RopeScaling& s) {
  return scaling_json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace posenc
