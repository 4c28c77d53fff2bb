// src/model/reader.h - what the readers of config.json share (src/model/): the model families and
// their reference configuration classes' defaults, typed access to JSON values with messages that
// name the key (Value, Node, Scope, Reader), the common dimensions, and the readers' entry points.
#pragma once

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

#include "model/format.h"
#include "posenc/config.h"
#include "posenc/error.h"

namespace posenc::model {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Families.

enum class Family {
  kRopeHalf,         // llama, mistral, qwen2, phi3, gpt_neox, gemma2, ...
  kRopeInterleaved,  // gptj, codegen
  kRopeVl,           // qwen2_vl, qwen2_5_vl, qwen3_vl: half style, M-RoPE, optional text_config
  kDeepseek,         // deepseek_v2, deepseek_v3, kimi_k2: MLA, decoupled RoPE, YaRN mscale
  kLlama4,           // llama4 (text_config), llama4_text: interleaved, NoPE layers, chunks
  kGptOss,           // gpt_oss: YaRN, sliding / full layers, attention sinks
  kGemma3,           // gemma3 (text_config), gemma3_text: local / global layers
  kGemma4,           // gemma4 (text_config), gemma4_text: local / global layers of their own
                     // head dims and key/value heads, proportional RoPE, score scale 1
  kFalcon,           // RoPE (half) or ALiBi with "alibi": true
  kBloom,
  kMpt,
  kT5,
  kDeberta,    // v1
  kDebertaV2,  // v2 / v3
  kGpt2,       // learned
  kBert,       // learned (bert, roberta)
};

// A model type and the defaults of its reference configuration class (Hugging Face
// transformers' <Name>Config): what the model's code uses when config.json leaves a key out.
// 0 means "no default" for counts and "none" for windows; kv_heads 0 means "the query heads"
// and head_dim 0 "hidden / heads" (the classes' None).
struct TypeDefaults {
  const char* model_type;
  Family family;
  const char* config_class;
  int64_t hidden = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_pos = 0;
  int64_t layers = 0;
  double theta = 1e4;
  double partial = 0;              // partial_rotary_factor / rotary_pct (0: rotate the whole head)
  int64_t rotary_dim = 0;          // gptj / codegen rotary_dim
  int64_t sliding_window = 0;      // 0: none
  bool window_needs_flag = false;  // Qwen: use_sliding_window (default false) gates the window
  int64_t max_window_layers = 0;   // Qwen: layers from this index on slide
  double query_pre_attn_scalar = 0;   // Gemma 2 / 3: the score scale is its -1/2 power
  double attn_logit_softcapping = 0;  // Gemma 2: logit soft-capping (0: none)
  int64_t original_max_pos = 0;       // Phi-3's top-level original_max_position_embeddings
};

// The defaults of `model_type`, or null when it is not supported (defaults.cc).
const TypeDefaults* find_type_defaults(const std::string& model_type);
// The supported model types, comma-separated.
std::string supported_families();

// ---------------------------------------------------------------------------------------------
// Formatting.

// A JSON value for messages: compact, one line, shortened. Bounded in depth and length, so a
// hostile deeply nested value cannot exhaust the stack (json::dump recurses).
inline void show_into(const json& v, std::string& out, int depth) {
  constexpr std::size_t kMax = 64;
  if (out.size() > kMax) return;
  if (v.is_array() || v.is_object()) {
    if (depth >= 4) {
      out += v.is_array() ? "[...]" : "{...}";
      return;
    }
    out += v.is_array() ? "[" : "{";
    bool first = true;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (out.size() > kMax) break;
      if (!first) out += ", ";
      first = false;
      if (v.is_object()) out += json(it.key()).dump() + ": ";
      show_into(*it, out, depth + 1);
    }
    out += v.is_array() ? "]" : "}";
    return;
  }
  out += v.dump(-1, ' ', false, json::error_handler_t::replace);
}

inline std::string show(const json& v) {
  std::string s;
  show_into(v, s, 0);
  if (s.size() > 64) s = s.substr(0, 61) + "...";
  return s;
}

// json::operator== with a depth bound (false beyond it): no recursion on hostile input.
inline bool same(const json& a, const json& b, int depth = 0) {
  if (depth > 16) return false;
  if (a.is_array() && b.is_array()) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (!same(a[i], b[i], depth + 1)) return false;
    }
    return true;
  }
  if (a.is_object() && b.is_object()) {
    if (a.size() != b.size()) return false;
    for (auto it = a.begin(); it != a.end(); ++it) {
      const auto jt = b.find(it.key());
      if (jt == b.end() || !same(*it, *jt, depth + 1)) return false;
    }
    return true;
  }
  if (a.is_structured() || b.is_structured()) return false;
  return a == b;  // scalars; 8 == 8.0
}

// ---------------------------------------------------------------------------------------------
// Typed access. A Value is a present, non-null JSON value together with its dotted name in
// messages ("rope_scaling.factor", "text_config.rope_theta", "attn_config.alibi").

struct Value {
  const json* v = nullptr;
  std::string name;
};

// A JSON object and the dotted path that names it ("" for the top level).
struct Node {
  const json* obj = nullptr;
  std::string path;

  std::string name(const std::string& key) const { return path.empty() ? key : path + "." + key; }
  // A null value counts as absent (HF writes "rope_scaling": null, "num_key_value_heads": null).
  std::optional<Value> get(const std::string& key) const {
    if (obj == nullptr) return std::nullopt;
    const auto it = obj->find(key);
    if (it == obj->end() || it->is_null()) return std::nullopt;
    return Value{&*it, name(key)};
  }
};

// Where the model's settings live: for *_vl models text_config first, then the top level.
struct Scope {
  std::vector<Node> nodes;
  std::optional<Value> get(const std::string& key) const {
    for (const auto& n : nodes) {
      if (auto v = n.get(key)) return v;
    }
    return std::nullopt;
  }
  // The key is written as null (and nowhere with a value). The configuration classes keep an
  // explicit None ("sliding_window": null: no window; "head_dim": null: hidden / heads), which
  // differs from leaving the key out (the class default).
  bool is_null(const std::string& key) const {
    if (get(key)) return false;
    for (const auto& n : nodes) {
      if (n.obj == nullptr) continue;
      const auto it = n.obj->find(key);
      if (it != n.obj->end() && it->is_null()) return true;
    }
    return false;
  }
};

class Reader {
 public:
  explicit Reader(std::string what) : what_(std::move(what)) {}

  [[noreturn]] void fail(const std::string& msg) const { throw IoError(what_ + ": " + msg); }

  double number(const Value& x) const {
    if (!x.v->is_number()) fail(x.name + " must be a number (got " + show(*x.v) + ")");
    return x.v->get<double>();
  }
  double positive(const Value& x) const {
    if (!x.v->is_number() || !(x.v->get<double>() > 0) || !std::isfinite(x.v->get<double>())) {
      fail(x.name + " must be a number > 0 (got " + show(*x.v) + ")");
    }
    return x.v->get<double>();
  }
  double non_negative(const Value& x) const {
    if (!x.v->is_number() || !(x.v->get<double>() >= 0) || !std::isfinite(x.v->get<double>())) {
      fail(x.name + " must be a number >= 0 (got " + show(*x.v) + ")");
    }
    return x.v->get<double>();
  }
  // Integers; an integral float (4096.0) is accepted as Python's json would give it.
  int64_t integer(const Value& x) const {
    const json& j = *x.v;
    if (j.is_number_unsigned()) {
      const auto u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        fail(x.name + " is out of range (got " + show(j) + ")");
      }
      return static_cast<int64_t>(u);
    }
    if (j.is_number_integer()) return j.get<int64_t>();
    if (j.is_number_float()) {
      const double d = j.get<double>();
      if (std::isfinite(d) && d == std::trunc(d) && std::fabs(d) < 9.0e15) {
        return static_cast<int64_t>(d);
      }
    }
    fail(x.name + " must be an integer (got " + show(j) + ")");
  }
  // Counts and lengths are bounded so that later allocations stay sane: dimensions (heads,
  // widths) by kMaxDim, positions and the rest by kMaxCount.
  static constexpr int64_t kMaxDim = int64_t{1} << 24;
  static constexpr int64_t kMaxCount = int64_t{1} << 40;
  int64_t positive_int(const Value& x, int64_t max = kMaxCount) const {
    const int64_t v = integer(x);
    if (v < 1 || v > max) {
      fail(x.name + " must be an integer in [1, " + std::to_string(max) + "] (got " + show(*x.v) +
           ")");
    }
    return v;
  }
  bool boolean(const Value& x) const {
    if (!x.v->is_boolean()) fail(x.name + " must be true or false (got " + show(*x.v) + ")");
    return x.v->get<bool>();
  }
  std::string string(const Value& x) const {
    if (!x.v->is_string()) fail(x.name + " must be a string (got " + show(*x.v) + ")");
    return x.v->get<std::string>();
  }
  const json& object(const Value& x) const {
    if (!x.v->is_object()) fail(x.name + " must be an object (got " + show(*x.v) + ")");
    return *x.v;
  }

  // The first of several alias keys, all present ones agreeing (HF's attribute_map aliases).
  std::optional<std::pair<int64_t, std::string>> positive_int_alias(
      const Scope& s, std::initializer_list<const char*> keys, int64_t max = kMaxCount) const {
    std::optional<std::pair<int64_t, std::string>> out;
    for (const char* k : keys) {
      const auto x = s.get(k);
      if (!x) continue;
      const int64_t v = positive_int(*x, max);
      if (!out) {
        out = std::make_pair(v, x->name);
      } else if (out->first != v) {
        fail(x->name + " (" + fmt(v) + ") contradicts " + out->second + " (" + fmt(out->first) +
             ")");
      }
    }
    return out;
  }
  // Dimensions (heads, widths): bounded by kMaxDim.
  std::pair<int64_t, std::string> require_dim_alias(const Scope& s,
                                                    std::initializer_list<const char*> keys) const {
    auto v = positive_int_alias(s, keys, kMaxDim);
    if (!v) {
      std::string names;
      for (const char* k : keys) names += (names.empty() ? "" : " / ") + std::string(k);
      fail("missing " + names);
    }
    return *v;
  }

  // Rethrows a ValueError of a typed validate() with the source prefixed.
  // `key`, when given, names the config key the checked value came from.
  template <class F>
  void checked(F&& f, const std::string& key = "") const {
    try {
      f();
    } catch (const IoError&) {
      throw;
    } catch (const Error& e) {
      fail(key.empty() ? std::string(e.what()) : key + ": " + e.what());
    }
  }

 private:
  std::string what_;
};

inline const std::initializer_list<const char*> kHeadKeys = {"num_attention_heads", "n_head",
                                                             "n_heads", "num_heads"};
inline const std::initializer_list<const char*> kHiddenKeys = {"hidden_size", "n_embd", "n_embed",
                                                               "d_model"};
inline const std::initializer_list<const char*> kContextKeys = {"max_position_embeddings",
                                                                "n_positions"};

// A value taken from the model type's configuration class because the file left the key out.
inline void note_default(ModelConfig& cfg, const std::string& key, const std::string& value) {
  cfg.defaults.emplace_back(key, value);
}

// A dimension from its aliases, else the class default (recorded), else "missing <keys>".
inline std::pair<int64_t, std::string> dim_or_default(const Reader& r, const Scope& s,
                                                      std::initializer_list<const char*> keys,
                                                      int64_t def, ModelConfig& cfg) {
  if (auto v = r.positive_int_alias(s, keys, Reader::kMaxDim)) return *v;
  if (def > 0) {
    note_default(cfg, *keys.begin(), fmt(def));
    return {def, std::string(*keys.begin())};
  }
  return r.require_dim_alias(s, keys);
}

inline const std::initializer_list<const char*> kLayerKeys = {"num_hidden_layers", "n_layer",
                                                              "num_layers", "n_layers"};

// head_dim = hidden / heads, divisible.
inline int64_t split_heads(const Reader& r, int64_t hidden, const std::string& hidden_name,
                           int64_t heads, const std::string& heads_name) {
  if (hidden % heads != 0) {
    r.fail(hidden_name + " (" + fmt(hidden) + ") is not divisible by " + heads_name + " (" +
           fmt(heads) + ")");
  }
  return hidden / heads;
}

inline void read_common_dims(const Reader& r, const Scope& s, const TypeDefaults& td,
                             ModelConfig& cfg) {
  const auto heads = dim_or_default(r, s, kHeadKeys, td.heads, cfg);
  const auto hidden = dim_or_default(r, s, kHiddenKeys, td.hidden, cfg);
  cfg.heads_q = heads.first;
  cfg.heads_kv = heads.first;
  cfg.hidden_size = hidden.first;
  cfg.head_dim = split_heads(r, hidden.first, hidden.second, heads.first, heads.second);
}

inline void check_kv_heads(const Reader& r, const ModelConfig& cfg, const std::string& kv_name) {
  if (cfg.heads_q % cfg.heads_kv != 0) {
    r.fail(kv_name + " (" + fmt(cfg.heads_kv) + ") must divide the query heads (" +
           fmt(cfg.heads_q) + ")");
  }
}

// A RoPE theta (a number > 1) given by several keys that must agree: the first key taken names
// it in messages.
class AgreeingTheta {
 public:
  explicit AgreeingTheta(const Reader& r) : r_(r) {}
  void take(const std::optional<Value>& x) {
    if (!x) return;
    if (!x->v->is_number() || !(x->v->get<double>() > 1) || !std::isfinite(x->v->get<double>())) {
      r_.fail(x->name + " must be a number > 1 (got " + show(*x->v) + ")");
    }
    const double v = x->v->get<double>();
    if (!theta_) {
      theta_ = std::make_pair(v, x->name);
    } else if (theta_->first != v) {
      r_.fail(x->name + " (" + fmt(v) + ") contradicts " + theta_->second + " (" +
              fmt(theta_->first) + ")");
    }
  }
  const std::optional<std::pair<double, std::string>>& value() const { return theta_; }

 private:
  const Reader& r_;
  std::optional<std::pair<double, std::string>> theta_;
};

// ---------------------------------------------------------------------------------------------
// Readers.

// rope_parameters' global entry, and the entry of one layer type (rope_scaling.cc).
std::optional<Value> global_rope_parameters(const Reader& r, const Scope& s);
std::optional<Value> layer_rope_parameters(const Scope& s, const char* layer_type);
// The RoPE of the model (its global layers when they differ): theta, rotary dim, scaling and
// M-RoPE into cfg.rope / cfg.mrope. cfg.rope.head_dim and cfg.rope.style are set by the caller.
void read_rope(const Reader& r, const Scope& s, const TypeDefaults& td,
               const std::string& model_type, ModelConfig& cfg);

// The families' readers (families.cc).
void read_falcon_kv_heads(const Reader& r, const Scope& s, ModelConfig& cfg);
void read_rope_family(const Reader& r, const json& top, const TypeDefaults& td,
                      const std::string& model_type, ModelConfig& cfg);
void read_alibi_family(const Reader& r, const json& top, const TypeDefaults& td, ModelConfig& cfg);
void read_t5(const Reader& r, const json& top, const TypeDefaults& td, ModelConfig& cfg);
void read_deberta(const Reader& r, const json& top, const TypeDefaults& td, ModelConfig& cfg);
void read_learned(const Reader& r, const json& top, const TypeDefaults& td, ModelConfig& cfg);

}  // namespace posenc::model
