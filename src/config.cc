// src/config.cc - Hugging Face style config.json -> ModelConfig (docs/model-configs.md).
//
// Strict reading: every key that decides the positional encoding is type-checked, range-checked
// and cross-checked against its aliases (rope_theta / rotary_emb_base, type / rope_type,
// rope_scaling / rope_parameters, partial_rotary_factor / rotary_pct / rotary_dim, ...). Any
// problem is an IoError "<source>: <key> ...". Keys that do not concern positions are ignored.
#include "posenc/config.h"

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
#include "posenc/error.h"
#include "posenc/io.h"

namespace posenc {
namespace {

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
  double query_pre_attn_scalar = 0;  // Gemma 2 / 3: the score scale is its -1/2 power
  int64_t original_max_pos = 0;      // Phi-3's top-level original_max_position_embeddings
};

constexpr TypeDefaults kFamilies[] = {
    {.model_type = "llama",
     .family = Family::kRopeHalf,
     .config_class = "LlamaConfig",
     .hidden = 4096,
     .heads = 32,
     .max_pos = 2048,
     .layers = 32},
    {.model_type = "mistral",
     .family = Family::kRopeHalf,
     .config_class = "MistralConfig",
     .hidden = 4096,
     .heads = 32,
     .kv_heads = 8,
     .max_pos = 131072,
     .layers = 32,
     .sliding_window = 4096},
    {.model_type = "mixtral",
     .family = Family::kRopeHalf,
     .config_class = "MixtralConfig",
     .hidden = 4096,
     .heads = 32,
     .kv_heads = 8,
     .max_pos = 131072,
     .layers = 32,
     .theta = 1e6},
    {.model_type = "qwen2",
     .family = Family::kRopeHalf,
     .config_class = "Qwen2Config",
     .hidden = 4096,
     .heads = 32,
     .kv_heads = 32,
     .max_pos = 32768,
     .layers = 32,
     .sliding_window = 4096,
     .window_needs_flag = true,
     .max_window_layers = 28},
    {.model_type = "qwen2_moe",
     .family = Family::kRopeHalf,
     .config_class = "Qwen2MoeConfig",
     .hidden = 2048,
     .heads = 16,
     .kv_heads = 16,
     .max_pos = 8192,
     .layers = 24,
     .sliding_window = 4096,
     .window_needs_flag = true,
     .max_window_layers = 28},
    {.model_type = "qwen3",
     .family = Family::kRopeHalf,
     .config_class = "Qwen3Config",
     .hidden = 4096,
     .heads = 32,
     .kv_heads = 32,
     .head_dim = 128,
     .max_pos = 32768,
     .layers = 32,
     .sliding_window = 4096,
     .window_needs_flag = true,
     .max_window_layers = 28},
    {.model_type = "qwen3_moe",
     .family = Family::kRopeHalf,
     .config_class = "Qwen3MoeConfig",
     .hidden = 2048,
     .heads = 32,
     .kv_heads = 4,
     .max_pos = 32768,
     .layers = 24,
     .sliding_window = 4096,
     .window_needs_flag = true,
     .max_window_layers = 28},
    {.model_type = "phi",
     .family = Family::kRopeHalf,
     .config_class = "PhiConfig",
     .hidden = 2048,
     .heads = 32,
     .max_pos = 2048,
     .layers = 24,
     .partial = 0.5},
    {.model_type = "phi3",
     .family = Family::kRopeHalf,
     .config_class = "Phi3Config",
     .hidden = 3072,
     .heads = 32,
     .max_pos = 4096,
     .layers = 32,
     .original_max_pos = 4096},
    {.model_type = "gpt_neox",
     .family = Family::kRopeHalf,
     .config_class = "GPTNeoXConfig",
     .hidden = 6144,
     .heads = 64,
     .max_pos = 2048,
     .layers = 44,
     .partial = 0.25},
    {.model_type = "gemma",
     .family = Family::kRopeHalf,
     .config_class = "GemmaConfig",
     .hidden = 3072,
     .heads = 16,
     .kv_heads = 16,
     .head_dim = 256,
     .max_pos = 8192,
     .layers = 28},
    {.model_type = "gemma2",
     .family = Family::kRopeHalf,
     .config_class = "Gemma2Config",
     .hidden = 2304,
     .heads = 8,
     .kv_heads = 4,
     .head_dim = 256,
     .max_pos = 8192,
     .layers = 26,
     .sliding_window = 4096,
     .query_pre_attn_scalar = 256},
    {.model_type = "stablelm",
     .family = Family::kRopeHalf,
     .config_class = "StableLmConfig",
     .hidden = 2560,
     .heads = 32,
     .kv_heads = 32,
     .max_pos = 4096,
     .layers = 32,
     .partial = 0.25},
    {.model_type = "starcoder2",
     .family = Family::kRopeHalf,
     .config_class = "Starcoder2Config",
     .hidden = 3072,
     .heads = 24,
     .kv_heads = 2,
     .max_pos = 4096,
     .layers = 30},
    {.model_type = "olmo",
     .family = Family::kRopeHalf,
     .config_class = "OlmoConfig",
     .hidden = 4096,
     .heads = 32,
     .max_pos = 2048,
     .layers = 32},
    {.model_type = "qwen2_vl",
     .family = Family::kRopeVl,
     .config_class = "Qwen2VLTextConfig",
     .hidden = 8192,
     .heads = 64,
     .kv_heads = 8,
     .max_pos = 32768,
     .layers = 80,
     .theta = 1e6,
     .sliding_window = 4096,
     .window_needs_flag = true,
     .max_window_layers = 80},
    {.model_type = "qwen2_5_vl",
     .family = Family::kRopeVl,
     .config_class = "Qwen2_5_VLTextConfig",
     .hidden = 8192,
     .heads = 64,
     .kv_heads = 8,
     .max_pos = 32768,
     .layers = 80,
     .theta = 1e6,
     .sliding_window = 4096,
     .window_needs_flag = true,
     .max_window_layers = 80},
    {.model_type = "qwen3_vl",
     .family = Family::kRopeVl,
     .config_class = "Qwen3VLTextConfig",
     .hidden = 4096,
     .heads = 32,
     .kv_heads = 32,
     .head_dim = 128,
     .max_pos = 128000,
     .layers = 36,
     .theta = 5e6},
    {.model_type = "gptj",
     .family = Family::kRopeInterleaved,
     .config_class = "GPTJConfig",
     .hidden = 4096,
     .heads = 16,
     .max_pos = 2048,
     .layers = 28,
     .rotary_dim = 64},
    {.model_type = "codegen",
     .family = Family::kRopeInterleaved,
     .config_class = "CodeGenConfig",
     .hidden = 4096,
     .heads = 16,
     .max_pos = 2048,
     .layers = 28,
     .rotary_dim = 64},
    {.model_type = "deepseek_v2",
     .family = Family::kDeepseek,
     .config_class = "DeepseekV2Config",
     .hidden = 5120,
     .heads = 128,
     .kv_heads = 128,
     .max_pos = 2048,
     .layers = 60},
    {.model_type = "deepseek_v3",
     .family = Family::kDeepseek,
     .config_class = "DeepseekV3Config",
     .hidden = 7168,
     .heads = 128,
     .kv_heads = 128,
     .max_pos = 4096,
     .layers = 61},
    {.model_type = "kimi_k2",
     .family = Family::kDeepseek,
     .config_class = "DeepseekV3Config",
     .hidden = 7168,
     .heads = 128,
     .kv_heads = 128,
     .max_pos = 4096,
     .layers = 61},
    {.model_type = "llama4",
     .family = Family::kLlama4,
     .config_class = "Llama4TextConfig",
     .hidden = 5120,
     .heads = 40,
     .kv_heads = 8,
     .head_dim = 128,
     .max_pos = 131072,
     .layers = 48,
     .theta = 5e5},
    {.model_type = "llama4_text",
     .family = Family::kLlama4,
     .config_class = "Llama4TextConfig",
     .hidden = 5120,
     .heads = 40,
     .kv_heads = 8,
     .head_dim = 128,
     .max_pos = 131072,
     .layers = 48,
     .theta = 5e5},
    {.model_type = "gpt_oss",
     .family = Family::kGptOss,
     .config_class = "GptOssConfig",
     .hidden = 2880,
     .heads = 64,
     .kv_heads = 8,
     .head_dim = 64,
     .max_pos = 131072,
     .layers = 36,
     .theta = 150000,
     .sliding_window = 128},
    {.model_type = "gemma3",
     .family = Family::kGemma3,
     .config_class = "Gemma3TextConfig",
     .hidden = 2304,
     .heads = 8,
     .kv_heads = 4,
     .head_dim = 256,
     .max_pos = 131072,
     .layers = 26,
     .theta = 1e6,
     .sliding_window = 4096,
     .query_pre_attn_scalar = 256},
    {.model_type = "gemma3_text",
     .family = Family::kGemma3,
     .config_class = "Gemma3TextConfig",
     .hidden = 2304,
     .heads = 8,
     .kv_heads = 4,
     .head_dim = 256,
     .max_pos = 131072,
     .layers = 26,
     .theta = 1e6,
     .sliding_window = 4096,
     .query_pre_attn_scalar = 256},
    {.model_type = "falcon",
     .family = Family::kFalcon,
     .config_class = "FalconConfig",
     .hidden = 4544,
     .heads = 71,
     .max_pos = 2048,
     .layers = 32},
    {.model_type = "bloom",
     .family = Family::kBloom,
     .config_class = "BloomConfig",
     .hidden = 64,
     .heads = 8,
     .layers = 2},
    {.model_type = "mpt",
     .family = Family::kMpt,
     .config_class = "MptConfig",
     .hidden = 2048,
     .heads = 16,
     .max_pos = 2048,
     .layers = 24},
    {.model_type = "t5",
     .family = Family::kT5,
     .config_class = "T5Config",
     .hidden = 512,
     .heads = 8,
     .head_dim = 64,
     .layers = 6},
    {.model_type = "mt5",
     .family = Family::kT5,
     .config_class = "MT5Config",
     .hidden = 512,
     .heads = 6,
     .head_dim = 64,
     .layers = 8},
    {.model_type = "deberta",
     .family = Family::kDeberta,
     .config_class = "DebertaConfig",
     .hidden = 768,
     .heads = 12,
     .max_pos = 512,
     .layers = 12},
    {.model_type = "deberta-v2",
     .family = Family::kDebertaV2,
     .config_class = "DebertaV2Config",
     .hidden = 1536,
     .heads = 24,
     .max_pos = 512,
     .layers = 24},
    {.model_type = "gpt2",
     .family = Family::kGpt2,
     .config_class = "GPT2Config",
     .hidden = 768,
     .heads = 12,
     .max_pos = 1024,
     .layers = 12},
    {.model_type = "bert",
     .family = Family::kBert,
     .config_class = "BertConfig",
     .hidden = 768,
     .heads = 12,
     .max_pos = 512,
     .layers = 12},
    {.model_type = "roberta",
     .family = Family::kBert,
     .config_class = "RobertaConfig",
     .hidden = 768,
     .heads = 12,
     .max_pos = 512,
     .layers = 12},
};
using FamilyEntry = TypeDefaults;

std::string supported_families() {
  std::string s;
  for (const auto& f : kFamilies) s += (s.empty() ? "" : ", ") + std::string(f.model_type);
  return s;
}

// ---------------------------------------------------------------------------------------------
// Formatting.

// A JSON value for messages: compact, one line, shortened. Bounded in depth and length, so a
// hostile deeply nested value cannot exhaust the stack (json::dump recurses).
void show_into(const json& v, std::string& out, int depth) {
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

std::string show(const json& v) {
  std::string s;
  show_into(v, s, 0);
  if (s.size() > 64) s = s.substr(0, 61) + "...";
  return s;
}

// json::operator== with a depth bound (false beyond it): no recursion on hostile input.
bool same(const json& a, const json& b, int depth = 0) {
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

using model::fmt;

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

const std::initializer_list<const char*> kHeadKeys = {"num_attention_heads", "n_head", "n_heads",
                                                      "num_heads"};
const std::initializer_list<const char*> kHiddenKeys = {"hidden_size", "n_embd", "n_embed",
                                                        "d_model"};
const std::initializer_list<const char*> kContextKeys = {"max_position_embeddings", "n_positions"};

// A value taken from the model type's configuration class because the file left the key out.
void note_default(ModelConfig& cfg, const std::string& key, const std::string& value) {
  cfg.defaults.emplace_back(key, value);
}

// A dimension from its aliases, else the class default (recorded), else "missing <keys>".
std::pair<int64_t, std::string> dim_or_default(const Reader& r, const Scope& s,
                                               std::initializer_list<const char*> keys, int64_t def,
                                               ModelConfig& cfg) {
  if (auto v = r.positive_int_alias(s, keys, Reader::kMaxDim)) return *v;
  if (def > 0) {
    note_default(cfg, *keys.begin(), fmt(def));
    return {def, std::string(*keys.begin())};
  }
  return r.require_dim_alias(s, keys);
}

const std::initializer_list<const char*> kLayerKeys = {"num_hidden_layers", "n_layer", "num_layers",
                                                       "n_layers"};

// head_dim = hidden / heads, divisible.
int64_t split_heads(const Reader& r, int64_t hidden, const std::string& hidden_name, int64_t heads,
                    const std::string& heads_name) {
  if (hidden % heads != 0) {
    r.fail(hidden_name + " (" + fmt(hidden) + ") is not divisible by " + heads_name + " (" +
           fmt(heads) + ")");
  }
  return hidden / heads;
}

void read_common_dims(const Reader& r, const Scope& s, const TypeDefaults& td, ModelConfig& cfg) {
  const auto heads = dim_or_default(r, s, kHeadKeys, td.heads, cfg);
  const auto hidden = dim_or_default(r, s, kHiddenKeys, td.hidden, cfg);
  cfg.heads_q = heads.first;
  cfg.heads_kv = heads.first;
  cfg.hidden_size = hidden.first;
  cfg.head_dim = split_heads(r, hidden.first, hidden.second, heads.first, heads.second);
}

void check_kv_heads(const Reader& r, const ModelConfig& cfg, const std::string& kv_name) {
  if (cfg.heads_q % cfg.heads_kv != 0) {
    r.fail(kv_name + " (" + fmt(cfg.heads_kv) + ") must divide the query heads (" +
           fmt(cfg.heads_q) + ")");
  }
}

// ---------------------------------------------------------------------------------------------
// RoPE.

// rope_scaling and / or rope_parameters read as one dict: keys present in both must agree.
struct ScalingDict {
  std::vector<Node> dicts;  // one or two objects
  std::string name;         // "rope_scaling" or "rope_parameters", maybe "text_config."-prefixed

  std::optional<Value> get(const std::string& key) const {
    for (const auto& d : dicts) {
      if (auto v = d.get(key)) return v;
    }
    return std::nullopt;
  }
  std::string key_name(const std::string& key) const { return name + "." + key; }
};

// transformers 5 writes one RoPE dict per layer type for models whose local layers rotate
// differently (Gemma 3): rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}.
bool per_layer_type(const json& j) {
  if (!j.is_object() || j.empty()) return false;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (!it->is_object()) return false;
    if (it.key() != "full_attention" && it.key() != "sliding_attention" &&
        it.key() != "chunked_attention") {
      return false;
    }
  }
  return true;
}

// rope_parameters, or its "full_attention" entry when it is written per layer type.
std::optional<Value> global_rope_parameters(const Reader& r, const Scope& s) {
  const auto b = s.get("rope_parameters");
  if (!b) return b;
  r.object(*b);
  if (!per_layer_type(*b->v)) return b;
  const auto full = Node{b->v, b->name}.get("full_attention");
  if (!full) r.fail(b->name + " is written per layer type but has no 'full_attention' entry");
  return full;
}

// The per-layer-type entry for `layer_type` ("sliding_attention"), if rope_parameters has one.
std::optional<Value> layer_rope_parameters(const Scope& s, const char* layer_type) {
  const auto b = s.get("rope_parameters");
  if (!b || !per_layer_type(*b->v)) return std::nullopt;
  return Node{b->v, b->name}.get(layer_type);
}

std::optional<ScalingDict> scaling_dict(const Reader& r, const Scope& s) {
  const auto a = s.get("rope_scaling");
  const auto b = global_rope_parameters(r, s);
  if (a) r.object(*a);
  if (b) r.object(*b);
  ScalingDict out;
  for (const auto& x : {a, b}) {
    if (x) out.dicts.push_back(Node{x->v, x->name});
  }
  if (out.dicts.empty()) return std::nullopt;
  out.name = out.dicts.front().path;
  if (a && b) {
    for (auto it = b->v->begin(); it != b->v->end(); ++it) {
      const auto other = a->v->find(it.key());
      if (other != a->v->end() && !other->is_null() && !it->is_null() && !same(*other, *it)) {
        r.fail(a->name + " and " + b->name + " disagree on '" + it.key() + "' (" + show(*other) +
               " vs " + show(*it) + ")");
      }
    }
  }
  return out;
}

struct Kind {
  RopeScalingType type = RopeScalingType::kDefault;
  bool mrope = false;  // "mrope": default + M-RoPE
};

std::optional<Kind> parse_kind(const std::string& s) {
  if (s == "default") return Kind{RopeScalingType::kDefault, false};
  if (s == "mrope") return Kind{RopeScalingType::kDefault, true};
  if (s == "linear") return Kind{RopeScalingType::kLinear, false};
  if (s == "dynamic") return Kind{RopeScalingType::kDynamic, false};
  if (s == "yarn") return Kind{RopeScalingType::kYarn, false};
  if (s == "llama3") return Kind{RopeScalingType::kLlama3, false};
  if (s == "longrope" || s == "su") return Kind{RopeScalingType::kLongRope, false};
  return std::nullopt;
}

// Keys each kind accepts. M-RoPE keys go with default / "mrope", and with any kind in the *_vl
// families (Qwen2.5-VL's long-context recipe pairs yarn with mrope_section).
std::vector<std::string> allowed_scaling_keys(RopeScalingType t, bool vl) {
  std::vector<std::string> keys = {"rope_type", "type", "rope_theta", "partial_rotary_factor"};
  if (vl && t != RopeScalingType::kDefault) {
    keys.emplace_back("mrope_section");
    keys.emplace_back("mrope_interleaved");
  }
  auto add = [&](std::initializer_list<const char*> more) {
    for (const char* k : more) keys.emplace_back(k);
  };
  switch (t) {
    case RopeScalingType::kDefault:
      add({"mrope_section", "mrope_interleaved"});
      break;
    case RopeScalingType::kLinear:
      add({"factor", "original_max_position_embeddings"});
      break;
    case RopeScalingType::kDynamic:
      add({"factor", "original_max_position_embeddings"});
      break;
    case RopeScalingType::kYarn:
      add({"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
           "mscale", "mscale_all_dim", "attention_factor"});
      break;
    case RopeScalingType::kLlama3:
      add({"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"});
      break;
    case RopeScalingType::kLongRope:
      add({"factor", "original_max_position_embeddings", "short_factor", "long_factor",
           "attention_factor"});
      break;
  }
  return keys;
}

std::vector<double> factor_list(const Reader& r, const Value& x, int64_t pairs) {
  if (!x.v->is_array()) {
    r.fail(x.name + " must be a list of " + fmt(pairs) + " numbers (got " + show(*x.v) + ")");
  }
  if (static_cast<int64_t>(x.v->size()) != pairs) {
    r.fail(x.name + " must have rotary_dim / 2 = " + fmt(pairs) + " entries (got " +
           fmt(static_cast<int64_t>(x.v->size())) + ")");
  }
  std::vector<double> out;
  out.reserve(x.v->size());
  for (std::size_t i = 0; i < x.v->size(); ++i) {
    out.push_back(r.positive(Value{&(*x.v)[i], x.name + "[" + std::to_string(i) + "]"}));
  }
  return out;
}

// base: rope_theta / rotary_emb_base / the scaling dict's rope_theta, all agreeing.
double read_theta(const Reader& r, const Scope& s, const std::optional<ScalingDict>& sd,
                  const TypeDefaults& td, ModelConfig& cfg) {
  std::optional<std::pair<double, std::string>> theta;
  auto take = [&](const std::optional<Value>& x) {
    if (!x) return;
    if (!x->v->is_number() || !(x->v->get<double>() > 1) || !std::isfinite(x->v->get<double>())) {
      r.fail(x->name + " must be a number > 1 (got " + show(*x->v) + ")");
    }
    const double v = x->v->get<double>();
    if (!theta) {
      theta = std::make_pair(v, x->name);
    } else if (theta->first != v) {
      r.fail(x->name + " (" + fmt(v) + ") contradicts " + theta->second + " (" + fmt(theta->first) +
             ")");
    }
  };
  take(s.get("rope_theta"));
  take(s.get("rotary_emb_base"));
  if (sd) take(sd->get("rope_theta"));
  if (theta) return theta->first;
  note_default(cfg, "rope_theta", fmt(td.theta));
  return td.theta;
}

// R from partial_rotary_factor (scope or scaling dict), rotary_pct or rotary_dim, all agreeing.
int64_t read_rotary_dim(const Reader& r, const Scope& s, const std::optional<ScalingDict>& sd,
                        int64_t head_dim, const TypeDefaults& td, ModelConfig& cfg) {
  std::optional<std::pair<int64_t, std::string>> rot;
  auto agree = [&](int64_t v, const std::string& how) {
    if (!rot) {
      rot = std::make_pair(v, how);
    } else if (rot->first != v) {
      r.fail("rotary dim " + fmt(v) + " from " + how + " contradicts rotary dim " +
             fmt(rot->first) + " from " + rot->second);
    }
  };
  auto fraction = [&](const std::optional<Value>& x) {
    if (!x) return;
    if (!x->v->is_number() || !(x->v->get<double>() > 0) || !(x->v->get<double>() <= 1)) {
      r.fail(x->name + " must be a number in (0, 1] (got " + show(*x->v) + ")");
    }
    const double f = x->v->get<double>();
    // Python's int(head_dim * f): truncation of the double product.
    const auto v = static_cast<int64_t>(static_cast<double>(head_dim) * f);
    const std::string how =
        x->name + " " + show(*x->v) + " (int(" + fmt(head_dim) + " x " + show(*x->v) + "))";
    if (v < 2 || v % 2 != 0) {
      r.fail("rotary dim " + fmt(v) + " from " + how + " is odd or < 2; it must be even and >= 2");
    }
    agree(v, how);
  };
  fraction(s.get("partial_rotary_factor"));
  if (sd) fraction(sd->get("partial_rotary_factor"));
  fraction(s.get("rotary_pct"));
  if (const auto x = s.get("rotary_dim")) {
    const int64_t v = r.positive_int(*x);
    if (v > head_dim) {
      r.fail(x->name + " (" + fmt(v) + ") exceeds the head dim (" + fmt(head_dim) + ")");
    }
    if (v < 2 || v % 2 != 0) {
      r.fail("rotary dim " + fmt(v) + " from " + x->name + " is odd or < 2; it must be even");
    }
    agree(v, x->name);
  }
  if (!rot && td.rotary_dim > 0) {
    // GPT-J / CodeGen: rotary_dim 64 unless the file says otherwise (capped by the head).
    const int64_t v = std::min(td.rotary_dim, head_dim);
    note_default(cfg, "rotary_dim", fmt(v));
    return v;
  }
  if (!rot && td.partial > 0) {
    const char* key = td.family == Family::kRopeHalf && std::string(td.model_type) == "gpt_neox"
                          ? "rotary_pct"
                          : "partial_rotary_factor";
    const auto v = static_cast<int64_t>(static_cast<double>(head_dim) * td.partial);
    if (v < 2 || v % 2 != 0) {
      r.fail("rotary dim " + fmt(v) + " from the default " + key + " " + fmt(td.partial) +
             " (int(" + fmt(head_dim) + " x " + fmt(td.partial) + ")) is odd or < 2");
    }
    note_default(cfg, key, fmt(td.partial));
    return v;
  }
  if (!rot) {
    if (head_dim % 2 != 0) {
      r.fail("rotary dim = head dim " + fmt(head_dim) + " is odd; it must be even");
    }
    return head_dim;
  }
  return rot->first;
}

// original_max_position_embeddings from the scaling dict or the top level (both: must agree).
std::optional<std::pair<int64_t, std::string>> read_original(const Reader& r, const Scope& s,
                                                             const ScalingDict& d) {
  std::optional<std::pair<int64_t, std::string>> out;
  for (const auto& x :
       {d.get("original_max_position_embeddings"), s.get("original_max_position_embeddings")}) {
    if (!x) continue;
    const int64_t v = r.positive_int(*x);
    if (!out) {
      out = std::make_pair(v, x->name);
    } else if (out->first != v) {
      r.fail(x->name + " (" + fmt(v) + ") contradicts " + out->second + " (" + fmt(out->first) +
             ")");
    }
  }
  return out;
}

struct MRopeKeys {
  std::optional<std::array<int64_t, 3>> section;
  std::optional<bool> interleaved;
  bool named = false;  // rope_type / type "mrope"
};

// The RoPE of the model (its global layers when they differ): theta, rotary dim, scaling and
// M-RoPE into cfg.rope / cfg.mrope. cfg.rope.head_dim and cfg.rope.style are set by the caller.
void read_rope(const Reader& r, const Scope& s, const TypeDefaults& td,
               const std::string& model_type, ModelConfig& cfg) {
  const Family family = td.family;
  const auto sd = scaling_dict(r, s);
  cfg.rope.base = read_theta(r, s, sd, td, cfg);
  cfg.rope.rotary_dim = read_rotary_dim(r, s, sd, cfg.rope.head_dim, td, cfg);
  const int64_t pairs = cfg.rope.rotary_dim / 2;

  RopeScaling& sc = cfg.rope.scaling;
  sc.max_position_embeddings = cfg.max_position_embeddings;
  MRopeKeys mk;
  if (sd) {
    const ScalingDict& d = *sd;
    // Kind: rope_type or legacy type (both: must name the same kind).
    std::optional<std::pair<Kind, std::string>> kind;  // kind, the string given
    for (const char* key : {"rope_type", "type"}) {
      const auto x = d.get(key);
      if (!x) continue;
      const std::string name = r.string(*x);
      const auto k = parse_kind(name);
      if (!k) {
        r.fail(x->name + ": unknown rope_type '" + name +
               "' (supported: default, linear, dynamic, yarn, llama3, longrope, su, mrope)");
      }
      if (!kind) {
        kind = std::make_pair(*k, name);
      } else if (kind->first.type != k->type) {
        r.fail(sd->name + ": type '" + name + "' contradicts rope_type '" + kind->second + "'");
      }
      mk.named = mk.named || k->mrope;
    }
    if (!kind) r.fail(sd->name + " needs 'rope_type' (or the legacy 'type')");
    sc.type = kind->first.type;
    const std::string& kname = kind->second;

    const auto allowed = allowed_scaling_keys(sc.type, family == Family::kRopeVl);
    for (const auto& node : d.dicts) {
      for (auto it = node.obj->begin(); it != node.obj->end(); ++it) {
        if (std::find(allowed.begin(), allowed.end(), it.key()) == allowed.end()) {
          r.fail(node.path + ": unknown key '" + it.key() + "' for rope_type '" + kname + "'");
        }
      }
    }

    const bool needs_factor =
        sc.type == RopeScalingType::kLinear || sc.type == RopeScalingType::kDynamic ||
        sc.type == RopeScalingType::kYarn || sc.type == RopeScalingType::kLlama3;
    if (const auto x = d.get("factor")) {
      sc.factor = r.positive(*x);
    } else if (needs_factor) {
      r.fail(d.key_name("factor") + " is required for rope_type '" + kname + "'");
    }

    const auto orig = read_original(r, s, d);
    switch (sc.type) {
      case RopeScalingType::kDefault:
        break;
      case RopeScalingType::kLinear:
        if (orig) sc.original_max_position_embeddings = orig->first;
        break;
      case RopeScalingType::kDynamic:
        // The model code scales against max_position_embeddings (the rope init functions read
        // config.max_position_embeddings, not the dict): an original length that differs would
        // be ignored there, so it is refused here.
        if (cfg.max_position_embeddings > 0) {
          if (orig && orig->first != cfg.max_position_embeddings) {
            r.fail(orig->second + " (" + fmt(orig->first) +
                   ") differs from max_position_embeddings (" + fmt(cfg.max_position_embeddings) +
                   "), which dynamic NTK scales against in the model code");
          }
          sc.original_max_position_embeddings = cfg.max_position_embeddings;
        } else if (orig) {
          sc.original_max_position_embeddings = orig->first;
        } else {
          r.fail(d.key_name("original_max_position_embeddings") + " (or max_position_embeddings) " +
                 "is required for rope_type '" + kname + "'");
        }
        break;
      case RopeScalingType::kYarn:
        // HF falls back on max_position_embeddings as the original length.
        if (orig) {
          sc.original_max_position_embeddings = orig->first;
        } else if (cfg.max_position_embeddings > 0) {
          sc.original_max_position_embeddings = cfg.max_position_embeddings;
        } else {
          r.fail(d.key_name("original_max_position_embeddings") + " (or max_position_embeddings) " +
                 "is required for rope_type '" + kname + "'");
        }
        break;
      case RopeScalingType::kLlama3:
      case RopeScalingType::kLongRope:
        // The configuration classes fill the original length in: Phi-3's class default
        // (original_max_position_embeddings 4096), else max_position_embeddings (transformers'
        // standardize_rope_params).
        if (orig) {
          sc.original_max_position_embeddings = orig->first;
        } else if (td.original_max_pos > 0) {
          sc.original_max_position_embeddings = td.original_max_pos;
          note_default(cfg, "original_max_position_embeddings", fmt(td.original_max_pos));
        } else if (cfg.max_position_embeddings > 0) {
          sc.original_max_position_embeddings = cfg.max_position_embeddings;
          note_default(cfg, "original_max_position_embeddings",
                       fmt(cfg.max_position_embeddings) + " (= max_position_embeddings)");
        } else {
          r.fail(d.key_name("original_max_position_embeddings") +
                 " (or max_position_embeddings) is required for rope_type '" + kname + "'");
        }
        break;
    }

    if (const auto x = d.get("low_freq_factor")) sc.low_freq_factor = r.positive(*x);
    if (const auto x = d.get("high_freq_factor")) sc.high_freq_factor = r.positive(*x);
    if (sc.type == RopeScalingType::kLlama3 && !(sc.high_freq_factor >= sc.low_freq_factor)) {
      // Equal factors are valid (Llama 4: no blend band).
      r.fail(sd->name + ": high_freq_factor (" + fmt(sc.high_freq_factor) +
             ") must exceed low_freq_factor (" + fmt(sc.low_freq_factor) + ")");
    }
    if (const auto x = d.get("beta_fast")) sc.beta_fast = r.positive(*x);
    if (const auto x = d.get("beta_slow")) sc.beta_slow = r.positive(*x);
    if (const auto x = d.get("truncate")) sc.truncate = r.boolean(*x);
    if (const auto x = d.get("mscale")) sc.mscale = r.non_negative(*x);
    if (const auto x = d.get("mscale_all_dim")) sc.mscale_all_dim = r.non_negative(*x);
    if (const auto x = d.get("attention_factor")) sc.attention_factor = r.positive(*x);
    if (sc.type == RopeScalingType::kLongRope) {
      const auto sf = d.get("short_factor");
      const auto lf = d.get("long_factor");
      if (!sf || !lf) {
        r.fail(d.key_name(sf ? "long_factor" : "short_factor") + " is required for rope_type '" +
               kname + "'");
      }
      sc.short_factor = factor_list(r, *sf, pairs);
      sc.long_factor = factor_list(r, *lf, pairs);
    }

    if (const auto x = d.get("mrope_section")) {
      const json& j = *x->v;
      std::array<int64_t, 3> sec{};
      bool ok = j.is_array() && j.size() == 3;
      for (std::size_t i = 0; ok && i < 3; ++i) {
        ok = j[i].is_number_integer() && j[i].get<int64_t>() >= 0 && j[i].get<int64_t>() <= pairs;
        if (ok) sec[i] = j[i].get<int64_t>();
      }
      if (!ok)
        r.fail(x->name + " must be a list of 3 integers in [0, rotary_dim / 2] (got " + show(j) +
               ")");
      mk.section = sec;
    }
    if (const auto x = d.get("mrope_interleaved")) mk.interleaved = r.boolean(*x);
  }

  // M-RoPE: Qwen2/2.5-VL sectioned (mrope_section required), Qwen3-VL interleaved (sections
  // default to [24, 20, 20]); other families when the dict asks for it.
  const bool vl = family == Family::kRopeVl;
  const bool qwen3_vl = model_type == "qwen3_vl";
  const bool wants = vl || mk.named || mk.section || mk.interleaved.value_or(false);
  if (wants) {
    const std::string where = sd ? sd->name : std::string("rope_scaling");
    MRope m;
    m.layout = qwen3_vl || mk.interleaved.value_or(false) ? MRopeLayout::kInterleaved
                                                          : MRopeLayout::kSectioned;
    if (qwen3_vl && mk.interleaved && !*mk.interleaved) {
      r.fail(where + ".mrope_interleaved is false, but qwen3_vl uses interleaved M-RoPE");
    }
    if (vl && !qwen3_vl && mk.interleaved.value_or(false)) {
      r.fail(where + ".mrope_interleaved is true, but " + model_type + " uses sectioned M-RoPE");
    }
    if (mk.section) {
      m.sections = *mk.section;
    } else if (m.layout == MRopeLayout::kInterleaved) {
      m.sections = {24, 20, 20};
    } else {
      r.fail(where + ".mrope_section is required for M-RoPE (" + model_type + ")");
    }
    r.checked([&] { validate(m, pairs); }, where + ".mrope_section");
    cfg.mrope = m;
  }

  r.checked([&] { validate(cfg.rope); });
}

// ---------------------------------------------------------------------------------------------
// Per-family readers.

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

void read_rope_family(const Reader& r, const json& top, const TypeDefaults& td,
                      const std::string& model_type, ModelConfig& cfg) {
  const Family family = td.family;
  Scope s;
  // Multimodal wrappers keep the language model's settings under text_config.
  if (family == Family::kRopeVl || model_type == "llama4" || model_type == "gemma3") {
    if (const auto tc = Node{&top, ""}.get("text_config")) {
      s.nodes.push_back(Node{&r.object(*tc), "text_config"});
    }
  }
  s.nodes.push_back(Node{&top, ""});
  cfg.scheme = ModelScheme::kRope;
  cfg.default_source = td.config_class;

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

  // Sliding window: explicit; null: none; absent: the class's. Qwen's window applies only with
  // use_sliding_window (default false).
  std::optional<int64_t> window;
  if (const auto x = s.get("sliding_window")) {
    window = r.positive_int(*x);
  } else if (td.sliding_window > 0 && !s.is_null("sliding_window")) {
    window = td.sliding_window;
    note_default(cfg, "sliding_window", fmt(td.sliding_window));
  }
  int64_t first_sliding = 0;
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

  // RoPE style and the global RoPE.
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
  if (family != Family::kGemma3) {
    // One RoPE for every layer here: per-layer-type entries must repeat full_attention's.
    const auto full = global_rope_parameters(r, s);
    for (const char* t : {"sliding_attention", "chunked_attention"}) {
      const auto x = layer_rope_parameters(s, t);
      if (x && full && !same(*x->v, *full->v)) {
        r.fail(x->name + " differs from " + full->name + "; " + model_type +
               " rotates every layer alike (per-layer-type RoPE is read for gemma3)");
      }
    }
  }

  // Layers.
  const auto nl = r.positive_int_alias(s, kLayerKeys, Reader::kMaxDim);
  const int64_t num_layers = nl ? nl->first : td.layers;
  if (!nl) note_default(cfg, "num_hidden_layers", fmt(td.layers));
  const auto explicit_types = read_layer_types(r, s, num_layers);

  // Score scale: 1 / sqrt(head_dim); Gemma 2 / 3: query_pre_attn_scalar^-1/2; DeepSeek:
  // 1 / sqrt(qk_head_dim) times YaRN's mscale(factor, mscale_all_dim) squared.
  double scale = 1.0 / std::sqrt(static_cast<double>(cfg.head_dim));
  if (td.query_pre_attn_scalar > 0) {
    scale = 1.0 / std::sqrt(number_or_default(r, s, "query_pre_attn_scalar",
                                              td.query_pre_attn_scalar, cfg));
  }
  if (family == Family::kDeepseek && cfg.rope.scaling.type != RopeScalingType::kDefault &&
      cfg.rope.scaling.mscale_all_dim > 0 && cfg.rope.scaling.factor > 1.0) {
    const double m =
        0.1 * cfg.rope.scaling.mscale_all_dim * std::log(cfg.rope.scaling.factor) + 1.0;
    scale *= m * m;
  }

  // Gemma 3's local layers: rope_local_base_freq (default 10000), no scaling.
  RopeConfig local = cfg.rope;
  int64_t pattern = 0;
  if (family == Family::kGemma3) {
    local.base = 1e4;
    std::optional<std::pair<double, std::string>> theta;
    auto take = [&](const std::optional<Value>& x) {
      if (!x) return;
      if (!x->v->is_number() || !(x->v->get<double>() > 1) || !std::isfinite(x->v->get<double>())) {
        r.fail(x->name + " must be a number > 1 (got " + show(*x->v) + ")");
      }
      const double v = x->v->get<double>();
      if (theta && theta->first != v) {
        r.fail(x->name + " (" + fmt(v) + ") contradicts " + theta->second + " (" +
               fmt(theta->first) + ")");
      }
      theta = std::make_pair(v, x->name);
    };
    take(s.get("rope_local_base_freq"));
    if (const auto sl = layer_rope_parameters(s, "sliding_attention")) {
      // The local layers rotate without scaling: only the kind "default" and a theta.
      const Node node{sl->v, sl->name};
      for (auto it = sl->v->begin(); it != sl->v->end(); ++it) {
        if (it.key() != "rope_type" && it.key() != "type" && it.key() != "rope_theta") {
          r.fail(sl->name + ": unknown key '" + it.key() +
                 "' (Gemma 3's sliding layers take rope_type 'default' and rope_theta)");
        }
      }
      for (const char* key : {"rope_type", "type"}) {
        if (const auto x = node.get(key); x && r.string(*x) != "default") {
          r.fail(x->name + ": rope_type '" + r.string(*x) +
                 "' on Gemma 3's sliding layers is not supported (they rotate with 'default')");
        }
      }
      take(node.get("rope_theta"));
    }
    if (theta) {
      local.base = theta->first;
    } else {
      note_default(cfg, "rope_local_base_freq", "10000");
    }
    local.scaling = RopeScaling{};
    if (!explicit_types) {
      pattern = count_or_default(r, s, "sliding_window_pattern", 6, cfg);
    }
  }

  // Llama 4: RoPE on no_rope_layers[i] == 1 (default: all but every no_rope_layer_interval-th),
  // chunked local attention on those, temperature tuning on the NoPE ones.
  std::vector<bool> uses_rope(static_cast<std::size_t>(num_layers), true);
  std::optional<int64_t> chunk;
  std::optional<AttentionTemperature> temperature;
  if (family == Family::kLlama4) {
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

  cfg.layers.resize(static_cast<std::size_t>(num_layers));
  for (int64_t i = 0; i < num_layers; ++i) {
    ModelLayer& l = cfg.layers[static_cast<std::size_t>(i)];
    l.index = i;
    l.rope = uses_rope[static_cast<std::size_t>(i)];
    l.rope_config = cfg.rope;
    l.softmax_scale = scale;
    l.attention_sinks = family == Family::kGptOss;
    std::string type = "full_attention";
    if (explicit_types) {
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
      if (family == Family::kGemma3) l.rope_config = local;
    } else if (type == "chunked_attention") {
      if (!chunk) {
        r.fail("layer " + fmt(i) + " is chunked_attention but attention_chunk_size is not set");
      }
      l.attention_chunk = chunk;
    }
    if (!l.rope && temperature) l.temperature = temperature;
  }
  if (family == Family::kGemma3 || model_type == "gemma2" || family == Family::kGptOss) {
    // cfg.sliding_window stays the window the sliding layers use.
    cfg.sliding_window = window;
  }
  r.checked([&] {
    for (const ModelLayer& l : cfg.layers) validate(l.rope_config);
  });
}

void read_alibi_family(const Reader& r, const json& top, const TypeDefaults& td, ModelConfig& cfg) {
  const Family family = td.family;
  Scope s{{Node{&top, ""}}};
  cfg.scheme = ModelScheme::kAlibi;
  cfg.default_source = td.config_class;
  read_common_dims(r, s, td, cfg);
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
  Scope s{{Node{&top, ""}}};
  cfg.scheme = ModelScheme::kT5;
  cfg.default_source = td.config_class;
  const auto heads = dim_or_default(r, s, kHeadKeys, td.heads, cfg);
  const auto hidden = dim_or_default(r, s, kHiddenKeys, td.hidden, cfg);
  cfg.heads_q = cfg.heads_kv = heads.first;
  cfg.hidden_size = hidden.first;
  cfg.head_dim = count_or_default(r, s, "d_kv", td.head_dim, cfg, Reader::kMaxDim);
  cfg.t5.num_buckets = count_or_default(r, s, "relative_attention_num_buckets", 32, cfg);
  cfg.t5.max_distance = count_or_default(r, s, "relative_attention_max_distance", 128, cfg);
  cfg.t5.bidirectional = true;
  r.checked([&] { validate(cfg.t5); });
}

void read_deberta(const Reader& r, const json& top, const TypeDefaults& td, ModelConfig& cfg) {
  const Family family = td.family;
  Scope s{{Node{&top, ""}}};
  cfg.scheme = ModelScheme::kDeberta;
  cfg.default_source = td.config_class;
  const auto heads = dim_or_default(r, s, kHeadKeys, td.heads, cfg);
  const auto hidden = dim_or_default(r, s, kHiddenKeys, td.hidden, cfg);
  cfg.heads_q = cfg.heads_kv = heads.first;
  cfg.hidden_size = hidden.first;
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
  Scope s{{Node{&top, ""}}};
  cfg.scheme = ModelScheme::kLearned;
  cfg.default_source = td.config_class;
  read_common_dims(r, s, td, cfg);
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

}  // namespace

// ---------------------------------------------------------------------------------------------
// Public API.

int64_t ModelConfig::effective_context() const {
  if (scheme != ModelScheme::kRope || rope.scaling.type == RopeScalingType::kDefault) {
    return max_position_embeddings;
  }
  // original x factor; configs such as Llama 3.1 (8192 x 8 < 131072) or Phi-3 (no factor) state a
  // larger max_position_embeddings, which then wins.
  const RopeScaling& s = rope.scaling;
  const int64_t lo = s.original_max_position_embeddings > 0 ? s.original_max_position_embeddings
                                                            : max_position_embeddings;
  const double scaled = static_cast<double>(lo) * s.factor;
  const int64_t e = scaled >= 9.0e18 ? std::numeric_limits<int64_t>::max()
                                     : static_cast<int64_t>(std::llround(scaled));
  return std::max(e, max_position_embeddings);
}

ModelConfig parse_model_config(const std::string& json_text, const std::string& what) {
  const Reader r(what);
  json top;
  try {
    top = json::parse(json_text);
  } catch (const json::parse_error& e) {
    // "[json.exception.parse_error.101] parse error at line 1, column 5: ..." -> one line
    // without the exception id.
    std::string msg = e.what();
    if (const auto p = msg.find("] "); msg.rfind("[json.exception", 0) == 0 && p != msg.npos) {
      msg = msg.substr(p + 2);
    }
    for (char& c : msg) {
      if (static_cast<unsigned char>(c) < 0x20) c = ' ';
    }
    r.fail("invalid JSON (byte " + std::to_string(e.byte) + "): " + msg);
  } catch (const json::exception& e) {
    // A number beyond double's range ("1e400"): out_of_range.406.
    const std::string msg = e.what();
    const auto p = msg.find("] ");
    r.fail("invalid JSON: " + (p == msg.npos ? msg : msg.substr(p + 2)));
  }
  if (!top.is_object()) r.fail("the top level must be a JSON object (got " + show(top) + ")");
  const Node root{&top, ""};
  const auto mt = root.get("model_type");
  if (!mt) r.fail("missing required key 'model_type'");
  ModelConfig cfg;
  cfg.model_type = r.string(*mt);
  // The text model's type under a multimodal wrapper names the same family.
  if (cfg.model_type == "llama4" || cfg.model_type == "gemma3") {
    if (const auto tc = root.get("text_config")) {
      if (const auto tt = Node{&r.object(*tc), "text_config"}.get("model_type")) {
        const std::string inner = r.string(*tt);
        if (inner != cfg.model_type + "_text") {
          r.fail(tt->name + " '" + inner + "' does not belong to model_type '" + cfg.model_type +
                 "' (expected '" + cfg.model_type + "_text')");
        }
      }
    }
  }
  const FamilyEntry* entry = nullptr;
  for (const auto& f : kFamilies) {
    if (cfg.model_type == f.model_type) entry = &f;
  }
  if (entry == nullptr) {
    r.fail("model_type '" + cfg.model_type +
           "' is not supported (supported: " + supported_families() + ")");
  }
  switch (entry->family) {
    case Family::kRopeHalf:
    case Family::kRopeInterleaved:
    case Family::kRopeVl:
    case Family::kDeepseek:
    case Family::kLlama4:
    case Family::kGptOss:
    case Family::kGemma3:
      read_rope_family(r, top, *entry, cfg.model_type, cfg);
      break;
    case Family::kFalcon: {
      const auto alibi = root.get("alibi");
      if (alibi && r.boolean(*alibi)) {
        read_alibi_family(r, top, *entry, cfg);
        // The kv heads do not change ALiBi; record them as HF computes them.
        read_falcon_kv_heads(r, Scope{{root}}, cfg);
      } else {
        read_rope_family(r, top, *entry, cfg.model_type, cfg);
      }
      break;
    }
    case Family::kBloom:
    case Family::kMpt:
      read_alibi_family(r, top, *entry, cfg);
      break;
    case Family::kT5:
      read_t5(r, top, *entry, cfg);
      break;
    case Family::kDeberta:
    case Family::kDebertaV2:
      read_deberta(r, top, *entry, cfg);
      break;
    case Family::kGpt2:
    case Family::kBert:
      read_learned(r, top, *entry, cfg);
      break;
  }
  return cfg;
}

ModelConfig read_model_config(const std::string& path) {
  const std::vector<unsigned char> bytes = read_file(path, std::size_t{64} << 20);
  return parse_model_config(std::string(bytes.begin(), bytes.end()), path);
}

RopeFrequencies model_rope_frequencies(const ModelConfig& cfg, int64_t seq_len, RopeAngles angles) {
  if (cfg.scheme != ModelScheme::kRope) {
    throw ValueError("model_rope_frequencies: model_type '" + cfg.model_type +
                     "' does not use RoPE");
  }
  return rope_frequencies(cfg.rope, seq_len, angles);
}

namespace model {

std::string fmt(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.10g", v);
  return buf;
}

std::string fmt(int64_t v) { return std::to_string(v); }

}  // namespace model

}  // namespace posenc
