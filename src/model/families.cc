// src/model/families.cc - the per-family readers of config.json: the RoPE families (layers,
// windows, chunks, sinks, NoPE layers, MLA), ALiBi (BLOOM, MPT, Falcon), T5, DeBERTa and the
// learned absolute encodings (docs/model-configs.md).
#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "model/reader.h"

namespace posenc::model {

// Falcon's key/value heads as HF computes them: num_kv_heads (default: the query heads) with
// new_decoder_architecture or without multi_query, else 1 (multi_query defaults to true).
void read_falcon_kv_heads(const Reader& r, const Scope& s, ModelConfig& cfg) {
  const auto nda = s.get("new_decoder_architecture");
  const auto mq = s.get("multi_query");
  const bool new_arch = nda ? r.boolean(*nda) : false;
  const bool multi_query = mq ? r.boolean(*mq) : true;
  cfg.heads_kv = cfg.heads_q;
  std::string kv_name = "num_kv_heads";
  if (new_arch || !multi_query) {
    if (const auto x = s.get("num_kv_heads")) {
      cfg.heads_kv = r.positive_int(*x, Reader::kMaxDim);
      kv_name = x->name;
    }
  } else {
    cfg.heads_kv = 1;
  }
  check_kv_heads(r, cfg, kv_name);
}

namespace {

// A top-level family (ALiBi, learned): the scheme, where defaults come from, heads, hidden size
// and head_dim = hidden / heads.
void read_family_dims(const Reader& r, const Scope& s, const TypeDefaults& td, ModelScheme scheme,
                      ModelConfig& cfg) {
  cfg.scheme = scheme;
  cfg.default_source = td.config_class;
  read_common_dims(r, s, td, cfg);
}

// A family without per-layer data (T5, DeBERTa): the scheme, where defaults come from, and the
// query heads (= key/value heads) and hidden size with the keys that gave them.
std::pair<std::pair<int64_t, std::string>, std::pair<int64_t, std::string>> read_heads_and_hidden(
    const Reader& r, const Scope& s, const TypeDefaults& td, ModelScheme scheme, ModelConfig& cfg) {
  cfg.scheme = scheme;
  cfg.default_source = td.config_class;
  const auto heads = dim_or_default(r, s, kHeadKeys, td.heads, cfg);
  const auto hidden = dim_or_default(r, s, kHiddenKeys, td.hidden, cfg);
  cfg.heads_q = cfg.heads_kv = heads.first;
  cfg.hidden_size = hidden.first;
  return {heads, hidden};
}

// A count from its key or the class default (recorded).
int64_t count_or_default(const Reader& r, const Scope& s, const char* key, int64_t def,
                         ModelConfig& cfg, int64_t max = Reader::kMaxCount) {
  if (const auto x = s.get(key)) return r.positive_int(*x, max);
  note_default(cfg, key, fmt(def));
  return def;
}

// A number from its key or the class default (recorded).
double number_or_default(const Reader& r, const Scope& s, const char* key, double def,
                         ModelConfig& cfg) {
  if (const auto x = s.get(key)) return r.positive(*x);
  note_default(cfg, key, fmt(def));
  return def;
}

// A Python-truthy flag: true / false, or a number (Llama 4's first release wrote
// "attn_temperature_tuning": 4, which its code tests for truth).
bool truthy(const Reader& r, const Value& x) {
  if (x.v->is_boolean()) return x.v->get<bool>();
  if (x.v->is_number()) return x.v->get<double>() != 0.0;
  r.fail(x.name + " must be true or false (got " + show(*x.v) + ")");
}

const char* const kLayerTypeNames[] = {"full_attention", "sliding_attention", "chunked_attention"};

// The explicit `layer_types` list, checked against the layer count.
std::optional<std::vector<std::string>> read_layer_types(const Reader& r, const Scope& s,
                                                         int64_t layers) {
  const auto x = s.get("layer_types");
  if (!x) return std::nullopt;
  if (!x->v->is_array()) {
    r.fail(x->name + " must be a list of strings (got " + show(*x->v) + ")");
  }
  if (static_cast<int64_t>(x->v->size()) != layers) {
    r.fail(x->name + " has " + fmt(static_cast<int64_t>(x->v->size())) +
           " entries; num_hidden_layers is " + fmt(layers));
  }
  std::vector<std::string> out;
  for (std::size_t i = 0; i < x->v->size(); ++i) {
    const json& e = (*x->v)[i];
    const std::string name = x->name + "[" + std::to_string(i) + "]";
    if (!e.is_string()) r.fail(name + " must be a string (got " + show(e) + ")");
    const std::string t = e.get<std::string>();
    if (std::find(std::begin(kLayerTypeNames), std::end(kLayerTypeNames), t) ==
        std::end(kLayerTypeNames)) {
      r.fail(name + ": unknown layer type '" + t +
             "' (known: full_attention, sliding_attention, chunked_attention)");
    }
    out.push_back(t);
  }
  return out;
}

// The dimensions of a RoPE model: heads, hidden size, context, head_dim (DeepSeek's MLA: q and k
// heads [nope | rope], v heads of their own) and the key/value heads. Returns the rotary head dim.
int64_t read_rope_dims(const Reader& r, const Scope& s, const TypeDefaults& td, ModelConfig& cfg) {
  const Family family = td.family;
  const auto heads = dim_or_default(r, s, kHeadKeys, td.heads, cfg);
  const auto hidden = dim_or_default(r, s, kHiddenKeys, td.hidden, cfg);
  cfg.heads_q = heads.first;
  cfg.hidden_size = hidden.first;

  if (const auto ctx = r.positive_int_alias(s, kContextKeys)) {
    cfg.max_position_embeddings = ctx->first;
  } else if (td.max_pos > 0) {
    cfg.max_position_embeddings = td.max_pos;
    note_default(cfg, "max_position_embeddings", fmt(td.max_pos));
  }

  // head_dim, and for DeepSeek's MLA the rotary part of it.
  int64_t rope_head_dim = 0;
  if (family == Family::kDeepseek) {
    const int64_t rope = count_or_default(r, s, "qk_rope_head_dim", 64, cfg, Reader::kMaxDim);
    const int64_t nope = count_or_default(r, s, "qk_nope_head_dim", 128, cfg, Reader::kMaxDim);
    cfg.v_head_dim = count_or_default(r, s, "v_head_dim", 128, cfg, Reader::kMaxDim);
    if (const auto x = s.get("head_dim"); x && r.positive_int(*x, Reader::kMaxDim) != rope) {
      r.fail(x->name + " (" + show(*x->v) + ") contradicts qk_rope_head_dim (" + fmt(rope) +
             "): the model's code sets head_dim = qk_rope_head_dim");
    }
    cfg.head_dim = nope + rope;  // q and k heads: [nope | rope]
    cfg.rope_offset = nope;
    rope_head_dim = rope;
  } else {
    // Explicit (Gemma's 256 is not hidden / heads); null: hidden / heads; absent: the class's.
    if (const auto x = s.get("head_dim")) {
      cfg.head_dim = r.positive_int(*x, Reader::kMaxDim);
    } else if (td.head_dim > 0 && !s.is_null("head_dim")) {
      cfg.head_dim = td.head_dim;
      note_default(cfg, "head_dim", fmt(td.head_dim));
    } else {
      cfg.head_dim = split_heads(r, hidden.first, hidden.second, heads.first, heads.second);
    }
    rope_head_dim = cfg.head_dim;
  }

  // Key/value heads: explicit; null: the query heads; absent: the class's.
  if (family == Family::kFalcon) {
    read_falcon_kv_heads(r, s, cfg);
  } else {
    cfg.heads_kv = cfg.heads_q;
    std::string kv_name = "num_key_value_heads";
    if (const auto x = s.get("num_key_value_heads")) {
      cfg.heads_kv = r.positive_int(*x, Reader::kMaxDim);
      kv_name = x->name;
    } else if (td.kv_heads > 0 && !s.is_null("num_key_value_heads")) {
      cfg.heads_kv = td.kv_heads;
      note_default(cfg, "num_key_value_heads", fmt(td.kv_heads));
    }
    check_kv_heads(r, cfg, kv_name);
  }

  return rope_head_dim;
}

// The sliding window: explicit; null: none; absent: the class's. Qwen's window applies only with
// use_sliding_window (default false), from max_window_layers on (first_sliding).
std::optional<int64_t> read_window(const Reader& r, const Scope& s, const TypeDefaults& td,
                                   ModelConfig& cfg, int64_t& first_sliding) {
  std::optional<int64_t> window;
  if (const auto x = s.get("sliding_window")) {
    window = r.positive_int(*x);
  } else if (td.sliding_window > 0 && !s.is_null("sliding_window")) {
    window = td.sliding_window;
    note_default(cfg, "sliding_window", fmt(td.sliding_window));
  }
  first_sliding = 0;
  if (td.window_needs_flag && window) {
    const auto use = s.get("use_sliding_window");
    if (!use || !r.boolean(*use)) window.reset();
    if (window) {
      first_sliding = count_or_default(r, s, "max_window_layers", td.max_window_layers, cfg);
    }
  } else if (const auto use = s.get("use_sliding_window"); use && !r.boolean(*use)) {
    window.reset();
  }
  cfg.sliding_window = window;
  return window;
}

// The RoPE style (DeepSeek's pair layouts) and the global RoPE; one RoPE for every layer except
// Gemma 3's.
void read_rope_style(const Reader& r, const Scope& s, const TypeDefaults& td,
                     const std::string& model_type, int64_t rope_head_dim, ModelConfig& cfg) {
  const Family family = td.family;
  cfg.rope.head_dim = rope_head_dim;
  cfg.rope.style = family == Family::kRopeInterleaved || family == Family::kLlama4
                       ? RopeStyle::kInterleaved
                       : RopeStyle::kHalf;
  if (family == Family::kDeepseek) {
    // deepseek_v2 rotates interleaved pairs in place (complex multiplication); deepseek_v3 with
    // rope_interleave (default true) de-interleaves them before rotate_half.
    cfg.rope.style = RopeStyle::kInterleaved;
    if (model_type != "deepseek_v2") {
      bool interleave = true;
      if (const auto x = s.get("rope_interleave")) {
        interleave = r.boolean(*x);
      } else {
        note_default(cfg, "rope_interleave", "true");
      }
      if (interleave) {
        cfg.rope_deinterleave = true;
      } else {
        cfg.rope.style = RopeStyle::kHalf;
      }
    }
  }
  read_rope(r, s, td, model_type, cfg);
  if (family != Family::kGemma3 && family != Family::kGemma4) {
    // One RoPE for every layer here: per-layer-type entries must repeat full_attention's.
    const auto full = global_rope_parameters(r, s);
    for (const char* t : {"sliding_attention", "chunked_attention"}) {
      const auto x = layer_rope_parameters(s, t);
      if (x && full && !same(*x->v, *full->v)) {
        r.fail(x->name + " differs from " + full->name + "; " + model_type +
               " rotates every layer alike (per-layer-type RoPE is read for gemma3 and gemma4)");
      }
    }
  }
}

// The score scale: 1 / sqrt(head_dim); Gemma 2 / 3: query_pre_attn_scalar^-1/2; DeepSeek:
// 1 / sqrt(qk_head_dim) times YaRN's mscale(factor, mscale_all_dim) squared.
double read_softmax_scale(const Reader& r, const Scope& s, const TypeDefaults& td,
                          ModelConfig& cfg) {
  if (td.family == Family::kGemma4) return 1.0;  // q and k are RMS-normalised; no scale
  double scale = 1.0 / std::sqrt(static_cast<double>(cfg.head_dim));
  if (td.query_pre_attn_scalar > 0) {
    scale = 1.0 / std::sqrt(number_or_default(r, s, "query_pre_attn_scalar",
                                              td.query_pre_attn_scalar, cfg));
  }
  if (td.family == Family::kDeepseek && cfg.rope.scaling.type != RopeScalingType::kDefault &&
      cfg.rope.scaling.mscale_all_dim > 0 && cfg.rope.scaling.factor > 1.0) {
    const double m =
        0.1 * cfg.rope.scaling.mscale_all_dim * std::log(cfg.rope.scaling.factor) + 1.0;
    scale *= m * m;
  }

  return scale;
}

// Gemma 3's local layers: rope_local_base_freq (default 10000), no scaling; the layer pattern
// when the config lists no layer types.
RopeConfig read_gemma3_local(const Reader& r, const Scope& s, bool explicit_types, ModelConfig& cfg,
                             int64_t& pattern, const char* who = "Gemma 3") {
  RopeConfig local = cfg.rope;
  pattern = 0;
  {
    local.base = 1e4;
    AgreeingTheta theta(r);
    theta.take(s.get("rope_local_base_freq"));
    if (const auto sl = layer_rope_parameters(s, "sliding_attention")) {
      // The local layers rotate without scaling: only the kind "default" and a theta.
      const Node node{sl->v, sl->name};
      for (auto it = sl->v->begin(); it != sl->v->end(); ++it) {
        if (it.key() != "rope_type" && it.key() != "type" && it.key() != "rope_theta") {
          r.fail(sl->name + ": unknown key '" + it.key() + "' (" + who +
                 "'s sliding layers take rope_type 'default' and rope_theta)");
        }
      }
      for (const char* key : {"rope_type", "type"}) {
        if (const auto x = node.get(key); x && r.string(*x) != "default") {
          r.fail(x->name + ": rope_type '" + r.string(*x) + "' on " + who +
                 "'s sliding layers is not supported (they rotate with 'default')");
        }
      }
      theta.take(node.get("rope_theta"));
    }
    if (theta.value()) {
      local.base = theta.value()->first;
    } else {
      note_default(cfg,
                   std::string(who) == "Gemma 3" ? "rope_local_base_freq"
                                                 : "rope_parameters.sliding_attention.rope_theta",
                   "10000");
    }
    local.scaling = RopeScaling{};
    if (!explicit_types) {
      pattern = count_or_default(r, s, "sliding_window_pattern", 6, cfg);
    }
  }

  return local;
}

// Llama 4's layers: RoPE on no_rope_layers[i] == 1 (default: all but every
// no_rope_layer_interval-th), chunked local attention on those, temperature tuning on the others.
struct Llama4Layers {
  std::vector<bool> uses_rope;
  std::optional<int64_t> chunk;
  std::optional<AttentionTemperature> temperature;
};
void read_llama4_layers(const Reader& r, const Scope& s, int64_t num_layers, ModelConfig& cfg,
                        Llama4Layers& out) {
  std::vector<bool>& uses_rope = out.uses_rope;
  std::optional<int64_t>& chunk = out.chunk;
  std::optional<AttentionTemperature>& temperature = out.temperature;
  const auto nr = s.get("no_rope_layers");
  if (nr && !(nr->v->is_array() && nr->v->empty())) {
    if (!nr->v->is_array() || static_cast<int64_t>(nr->v->size()) < num_layers) {
      r.fail(nr->name + " must be a list of 0 / 1 with at least num_hidden_layers (" +
             fmt(num_layers) + ") entries (got " + show(*nr->v) + ")");
    }
    for (int64_t i = 0; i < num_layers; ++i) {
      const json& e = (*nr->v)[static_cast<std::size_t>(i)];
      if (!e.is_number_integer() || (e.get<int64_t>() != 0 && e.get<int64_t>() != 1)) {
        r.fail(nr->name + "[" + fmt(i) + "] must be 0 or 1 (got " + show(e) + ")");
      }
      uses_rope[static_cast<std::size_t>(i)] = e.get<int64_t>() == 1;
    }
  } else {
    const int64_t interval = count_or_default(r, s, "no_rope_layer_interval", 4, cfg);
    for (int64_t i = 0; i < num_layers; ++i) {
      uses_rope[static_cast<std::size_t>(i)] = (i + 1) % interval != 0;
    }
  }
  if (const auto x = s.get("attention_chunk_size")) {
    chunk = r.positive_int(*x);
  } else if (!s.is_null("attention_chunk_size")) {
    chunk = 8192;
    note_default(cfg, "attention_chunk_size", "8192");
  }
  bool tuning = true;
  if (const auto x = s.get("attn_temperature_tuning")) {
    tuning = truthy(r, *x);
  } else {
    note_default(cfg, "attn_temperature_tuning", "true");
  }
  if (tuning) {
    AttentionTemperature t;
    t.floor_scale = number_or_default(r, s, "floor_scale", 8192, cfg);
    t.attn_scale = number_or_default(r, s, "attn_scale", 0.1, cfg);
    temperature = t;
  }
}

// Gemma 4's layers: their types (five sliding to one global by default; the last layer is
// always global, as the configuration class forces it), and each layer's head dim and key/value
// heads: per_layer_config when the file has one (transformers writes it), else global_head_dim
// (default 512) on the global layers and, with attention_k_eq_v, num_global_key_value_heads.
struct Gemma4Layers {
  std::vector<std::string> types;
  std::vector<int64_t> head_dim, heads_kv;
  int64_t global_head_dim = 0, local_head_dim = 0;
};
Gemma4Layers read_gemma4_layers(const Reader& r, const Scope& s, int64_t num_layers,
                                const std::optional<std::vector<std::string>>& explicit_types,
                                ModelConfig& cfg) {
  if (const auto x = s.get("use_bidirectional_attention"); x && !x->v->is_null()) {
    const std::string v = r.string(*x);
    if (v == "all") {
      r.fail(x->name +
             " 'all' (bidirectional attention over text) is not supported: posenc "
             "reads Gemma 4 as a causal decoder");
    }
    if (v != "vision") r.fail(x->name + ": unknown value '" + v + "' (null, 'vision' or 'all')");
  }
  Gemma4Layers g;
  const auto n = static_cast<std::size_t>(num_layers);
  g.types.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    g.types[i] = explicit_types ? (*explicit_types)[i]
                                : ((i + 1) % 6 != 0 ? "sliding_attention" : "full_attention");
    if (g.types[i] == "chunked_attention") {
      r.fail("layer_types[" + std::to_string(i) + "]: Gemma 4 has no chunked_attention layers");
    }
  }
  if (n > 0) g.types[n - 1] = "full_attention";
  g.head_dim.assign(n, cfg.head_dim);
  g.heads_kv.assign(n, cfg.heads_kv);
  auto check_kv = [&](int64_t kv, const std::string& name) {
    if (cfg.heads_q % kv != 0) {
      r.fail(name + " (" + fmt(kv) + ") must divide num_attention_heads (" + fmt(cfg.heads_q) +
             ")");
    }
  };
  if (const auto plc = s.get("per_layer_config"); plc && !plc->v->is_null()) {
    const json& obj = r.object(*plc);
    for (auto it = obj.begin(); it != obj.end(); ++it) {
      const std::string& key = it.key();
      const std::string name = plc->name + "." + key;
      if (key.empty() || key.size() > 9 ||
          !std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; })) {
        r.fail(name + ": the keys are layer indices");
      }
      const auto i = static_cast<std::size_t>(std::stoll(key));
      if (i >= n)
        r.fail(name + ": layer " + key + " is past num_hidden_layers (" + fmt(num_layers) + ")");
      const Node layer{&r.object(Value{&it.value(), name}), name};
      for (auto f = it.value().begin(); f != it.value().end(); ++f) {
        if (f.key() == "head_dim") {
          g.head_dim[i] = r.positive_int(*layer.get("head_dim"), Reader::kMaxDim);
        } else if (f.key() == "num_key_value_heads") {
          const auto x = layer.get("num_key_value_heads");
          g.heads_kv[i] = r.positive_int(*x, Reader::kMaxDim);
          check_kv(g.heads_kv[i], x->name);
        } else if (f.key() == "rope_parameters" || f.key() == "rope_scaling" ||
                   f.key() == "rope_theta" || f.key() == "partial_rotary_factor" ||
                   f.key() == "sliding_window" || f.key() == "layer_types") {
          r.fail(name + "." + f.key() + ": a per-layer positional setting posenc does not read");
        }
      }
    }
  } else {
    const int64_t global = count_or_default(r, s, "global_head_dim", 512, cfg, Reader::kMaxDim);
    std::optional<std::pair<int64_t, std::string>> global_kv;
    bool k_eq_v = false;
    if (const auto x = s.get("attention_k_eq_v")) k_eq_v = r.boolean(*x);
    if (const auto x = s.get("num_global_key_value_heads"); x && k_eq_v) {
      global_kv = std::make_pair(r.positive_int(*x, Reader::kMaxDim), x->name);
      check_kv(global_kv->first, global_kv->second);
    }
    for (std::size_t i = 0; i < n; ++i) {
      if (g.types[i] != "full_attention") continue;
      g.head_dim[i] = global;
      if (global_kv) g.heads_kv[i] = global_kv->first;
    }
  }
  // One head dim per layer type: the RoPE of a type is read once.
  for (std::size_t i = 0; i < n; ++i) {
    int64_t& want = g.types[i] == "full_attention" ? g.global_head_dim : g.local_head_dim;
    if (want == 0) want = g.head_dim[i];
    if (g.head_dim[i] != want) {
      r.fail("layer " + std::to_string(i) + " (" + g.types[i] + ") has head_dim " +
             fmt(g.head_dim[i]) + ", another layer of its type " + fmt(want) +
             ": posenc reads one head dim per layer type");
    }
  }
  if (g.local_head_dim == 0) g.local_head_dim = cfg.head_dim;
  if (g.global_head_dim == 0) g.global_head_dim = cfg.head_dim;
  return g;
}

}  // namespace

void read_rope_family(const Reader& r, const json& top, const TypeDefaults& td,
                      const std::string& model_type, ModelConfig& cfg) {
  const Family family = td.family;
  Scope s;
  // Multimodal wrappers keep the language model's settings under text_config.
  if (family == Family::kRopeVl || model_type == "llama4" || model_type == "gemma3" ||
      model_type == "gemma4") {
    if (const auto tc = Node{&top, ""}.get("text_config")) {
      s.nodes.push_back(Node{&r.object(*tc), "text_config"});
    }
  }
  s.nodes.push_back(Node{&top, ""});
  cfg.scheme = ModelScheme::kRope;
  cfg.default_source = td.config_class;
  const int64_t rope_head_dim = read_rope_dims(r, s, td, cfg);
  int64_t first_sliding = 0;
  const std::optional<int64_t> window = read_window(r, s, td, cfg, first_sliding);

  // Layers.
  const auto nl = r.positive_int_alias(s, kLayerKeys, Reader::kMaxDim);
  const int64_t num_layers = nl ? nl->first : td.layers;
  if (!nl) note_default(cfg, "num_hidden_layers", fmt(td.layers));
  const auto explicit_types = read_layer_types(r, s, num_layers);
  Gemma4Layers g4;
  if (family == Family::kGemma4) g4 = read_gemma4_layers(r, s, num_layers, explicit_types, cfg);
  // The global RoPE (Gemma 4: of the global layers' head dim).
  read_rope_style(r, s, td, model_type,
                  family == Family::kGemma4 ? g4.global_head_dim : rope_head_dim, cfg);

  const double scale = read_softmax_scale(r, s, td, cfg);
  // Logit soft-capping: read where the model's code applies it (Gemma 2, default 50; Gemma 3,
  // default none); null: none.
  std::optional<double> softcap;
  if (model_type == "gemma2" || family == Family::kGemma3) {
    if (const auto x = s.get("attn_logit_softcapping")) {
      softcap = r.positive(*x);
    } else if (td.attn_logit_softcapping > 0 && !s.is_null("attn_logit_softcapping")) {
      softcap = td.attn_logit_softcapping;
      note_default(cfg, "attn_logit_softcapping", fmt(td.attn_logit_softcapping));
    }
  }
  int64_t pattern = 0;
  RopeConfig local = cfg.rope;
  if (family == Family::kGemma3) {
    local = read_gemma3_local(r, s, explicit_types.has_value(), cfg, pattern);
  } else if (family == Family::kGemma4) {
    local = read_gemma3_local(r, s, true, cfg, pattern, "Gemma 4");
    local.head_dim = local.rotary_dim = g4.local_head_dim;
  }
  Llama4Layers l4{std::vector<bool>(static_cast<std::size_t>(num_layers), true), {}, {}};
  if (family == Family::kLlama4) read_llama4_layers(r, s, num_layers, cfg, l4);
  const std::vector<bool>& uses_rope = l4.uses_rope;
  const std::optional<int64_t>& chunk = l4.chunk;
  const std::optional<AttentionTemperature>& temperature = l4.temperature;

  cfg.layers.resize(static_cast<std::size_t>(num_layers));
  for (int64_t i = 0; i < num_layers; ++i) {
    ModelLayer& l = cfg.layers[static_cast<std::size_t>(i)];
    l.index = i;
    l.rope = uses_rope[static_cast<std::size_t>(i)];
    l.rope_config = cfg.rope;
    l.softmax_scale = scale;
    l.attention_sinks = family == Family::kGptOss;
    l.softcap = softcap;
    l.head_dim = cfg.head_dim;
    l.heads_kv = cfg.heads_kv;
    std::string type = "full_attention";
    if (family == Family::kGemma4) {
      type = g4.types[static_cast<std::size_t>(i)];
      l.head_dim = g4.head_dim[static_cast<std::size_t>(i)];
      l.heads_kv = g4.heads_kv[static_cast<std::size_t>(i)];
    } else if (explicit_types) {
      type = (*explicit_types)[static_cast<std::size_t>(i)];
    } else if (family == Family::kGemma3) {
      type = (i + 1) % pattern != 0 ? "sliding_attention" : "full_attention";
    } else if (model_type == "gemma2" || family == Family::kGptOss) {
      type = i % 2 == 0 ? "sliding_attention" : "full_attention";
    } else if (family == Family::kLlama4) {
      type = l.rope && chunk ? "chunked_attention" : "full_attention";
    } else if (window) {
      type = i >= first_sliding ? "sliding_attention" : "full_attention";
    }
    l.attention = type;
    if (type == "sliding_attention") {
      if (!window) {
        r.fail("layer " + fmt(i) + " is sliding_attention but the config has no sliding_window");
      }
      l.sliding_window = window;
      if (family == Family::kGemma3 || family == Family::kGemma4) l.rope_config = local;
    } else if (type == "chunked_attention") {
      if (!chunk) {
        r.fail("layer " + fmt(i) + " is chunked_attention but attention_chunk_size is not set");
      }
      l.attention_chunk = chunk;
    }
    if (!l.rope && temperature) l.temperature = temperature;
  }
  if (family == Family::kGemma3 || family == Family::kGemma4 || model_type == "gemma2" ||
      family == Family::kGptOss) {
    // cfg.sliding_window stays the window the sliding layers use.
    cfg.sliding_window = window;
  }
  r.checked([&] {
    for (const ModelLayer& l : cfg.layers) validate(l.rope_config);
  });
}

void read_alibi_family(const Reader& r, const json& top, const TypeDefaults& td, ModelConfig& cfg) {
  const Family family = td.family;
  const Scope s{{Node{&top, ""}}};
  read_family_dims(r, s, td, ModelScheme::kAlibi, cfg);
  cfg.alibi.heads = cfg.heads_q;
  cfg.alibi.max_bias = 8.0;
  if (family == Family::kMpt) {
    cfg.max_position_embeddings = count_or_default(r, s, "max_seq_len", td.max_pos, cfg);
    const auto ac = s.get("attn_config");
    if (!ac) r.fail("attn_config is missing: mpt without alibi is not supported");
    const Node a{&r.object(*ac), "attn_config"};
    const auto alibi = a.get("alibi");
    if (!alibi || !r.boolean(*alibi)) {
      r.fail("attn_config.alibi is " + std::string(alibi ? "false" : "absent") +
             ": mpt without alibi is not supported");
    }
    if (const auto x = a.get("alibi_bias_max")) cfg.alibi.max_bias = r.positive(*x);
    // Key/value heads by attention type (LLM Foundry: multihead / multiquery / grouped_query).
    std::string kv_name = "attn_config.kv_n_heads";
    if (const auto t = a.get("attn_type")) {
      const std::string type = r.string(*t);
      if (type == "multiquery_attention") {
        cfg.heads_kv = 1;
      } else if (type == "grouped_query_attention") {
        const auto kv = a.get("kv_n_heads");
        if (!kv) r.fail("attn_config.kv_n_heads is required for grouped_query_attention");
        cfg.heads_kv = r.positive_int(*kv, Reader::kMaxDim);
      } else if (type != "multihead_attention") {
        r.fail(t->name + ": unknown attention type '" + type + "'");
      }
    }
    check_kv_heads(r, cfg, kv_name);
  } else {
    if (const auto ctx = r.positive_int_alias(s, kContextKeys)) {
      cfg.max_position_embeddings = ctx->first;
    }
  }
  r.checked([&] { (void)alibi_slopes(cfg.alibi); });
}

void read_t5(const Reader& r, const json& top, const TypeDefaults& td, ModelConfig& cfg) {
  const Scope s{{Node{&top, ""}}};
  const auto [heads, hidden] = read_heads_and_hidden(r, s, td, ModelScheme::kT5, cfg);
  cfg.head_dim = count_or_default(r, s, "d_kv", td.head_dim, cfg, Reader::kMaxDim);
  cfg.t5.num_buckets = count_or_default(r, s, "relative_attention_num_buckets", 32, cfg);
  cfg.t5.max_distance = count_or_default(r, s, "relative_attention_max_distance", 128, cfg);
  cfg.t5.bidirectional = true;
  r.checked([&] { validate(cfg.t5); });
}

void read_deberta(const Reader& r, const json& top, const TypeDefaults& td, ModelConfig& cfg) {
  const Family family = td.family;
  const Scope s{{Node{&top, ""}}};
  const auto [heads, hidden] = read_heads_and_hidden(r, s, td, ModelScheme::kDeberta, cfg);
  if (const auto x = s.get("attention_head_size"); x && family == Family::kDebertaV2) {
    cfg.head_dim = r.positive_int(*x, Reader::kMaxDim);
  } else {
    cfg.head_dim = split_heads(r, hidden.first, hidden.second, heads.first, heads.second);
  }
  cfg.max_position_embeddings = count_or_default(r, s, "max_position_embeddings", td.max_pos, cfg);
  const auto rel = s.get("relative_attention");
  if (!rel || !r.boolean(*rel)) {
    r.fail("relative_attention is " + std::string(rel ? "false" : "absent (default false)") +
           ": only DeBERTa with relative attention is supported");
  }
  // max_relative_positions < 1 (HF: -1) means max_position_embeddings.
  int64_t mrp = -1;
  if (const auto x = s.get("max_relative_positions")) {
    mrp = r.integer(*x);
  } else {
    note_default(cfg, "max_relative_positions", "-1");
  }
  if (mrp < 1) {
    if (cfg.max_position_embeddings < 1) {
      r.fail("max_relative_positions is " + fmt(mrp) + " and max_position_embeddings is missing");
    }
    mrp = cfg.max_position_embeddings;
  }
  cfg.deberta.max_relative_positions = mrp;
  cfg.deberta.position_buckets = 0;
  if (const auto x = s.get("position_buckets")) {
    const int64_t pb = r.integer(*x);
    if (family == Family::kDeberta && pb > 0) {
      r.fail(x->name + " (" + fmt(pb) + ") is a deberta-v2 setting; model_type is deberta");
    }
    cfg.deberta.position_buckets = pb > 0 ? pb : 0;
  }
  r.checked([&] { validate(cfg.deberta); });

  // pos_att_type: a list, or a "p2c|c2p" string (HF lower-cases and strips the parts).
  if (const auto x = s.get("pos_att_type")) {
    std::vector<std::string> parts;
    if (x->v->is_string()) {
      const std::string str = x->v->get<std::string>();
      std::size_t start = 0;
      while (true) {
        const std::size_t bar = str.find('|', start);
        parts.push_back(str.substr(start, bar == std::string::npos ? bar : bar - start));
        if (bar == std::string::npos) break;
        start = bar + 1;
      }
    } else if (x->v->is_array()) {
      for (const auto& e : *x->v) {
        if (!e.is_string()) {
          r.fail(x->name + " must be a list of strings or a 'p2c|c2p' string (got " + show(*x->v) +
                 ")");
        }
        parts.push_back(e.get<std::string>());
      }
    } else {
      r.fail(x->name + " must be a list of strings or a 'p2c|c2p' string (got " + show(*x->v) +
             ")");
    }
    std::set<std::string> seen;
    for (std::string p : parts) {
      const auto b = p.find_first_not_of(" \t");
      const auto e = p.find_last_not_of(" \t");
      p = b == std::string::npos ? std::string() : p.substr(b, e - b + 1);
      std::transform(p.begin(), p.end(), p.begin(),
                     [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      if (p != "p2c" && p != "c2p" && p != "p2p") {
        r.fail(x->name + ": unknown attention type '" + p + "' in " + show(*x->v) +
               " (allowed: p2c, c2p, p2p)");
      }
      if (!seen.insert(p).second) r.fail(x->name + ": '" + p + "' appears twice");
      cfg.pos_att_type.push_back(p);
    }
  }
}

void read_learned(const Reader& r, const json& top, const TypeDefaults& td, ModelConfig& cfg) {
  const Family family = td.family;
  const Scope s{{Node{&top, ""}}};
  read_family_dims(r, s, td, ModelScheme::kLearned, cfg);
  if (const auto ctx = r.positive_int_alias(s, kContextKeys)) {
    cfg.max_position_embeddings = ctx->first;
  } else {
    cfg.max_position_embeddings = td.max_pos;
    note_default(cfg, family == Family::kGpt2 ? "n_positions" : "max_position_embeddings",
                 fmt(td.max_pos));
  }
  if (family == Family::kBert) {
    if (const auto x = s.get("position_embedding_type")) {
      const std::string t = r.string(*x);
      if (t != "absolute") {
        r.fail(x->name + " '" + t + "' is not supported (only 'absolute')");
      }
    }
  }
}

}  // namespace posenc::model
