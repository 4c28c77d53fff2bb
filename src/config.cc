// src/config.cc - Hugging Face style config.json -> ModelConfig (SPEC §3, §3.1, §4, §5, §8).
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

#include "posenc/error.h"
#include "posenc/io.h"

namespace posenc {
namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Families.

enum class Family {
  kRopeHalf,         // llama, mistral, qwen2, phi3, gpt_neox, ...
  kRopeInterleaved,  // gptj, codegen
  kRopeVl,           // qwen2_vl, qwen2_5_vl, qwen3_vl: half style, M-RoPE, optional text_config
  kFalcon,           // RoPE (half) or ALiBi with "alibi": true
  kBloom,
  kMpt,
  kT5,
  kDeberta,    // v1
  kDebertaV2,  // v2 / v3
  kGpt2,       // learned
  kBert,       // learned (bert, roberta)
};

struct FamilyEntry {
  const char* model_type;
  Family family;
};

constexpr FamilyEntry kFamilies[] = {
    {"llama", Family::kRopeHalf},
    {"mistral", Family::kRopeHalf},
    {"mixtral", Family::kRopeHalf},
    {"qwen2", Family::kRopeHalf},
    {"qwen2_moe", Family::kRopeHalf},
    {"qwen3", Family::kRopeHalf},
    {"qwen3_moe", Family::kRopeHalf},
    {"phi", Family::kRopeHalf},
    {"phi3", Family::kRopeHalf},
    {"gpt_neox", Family::kRopeHalf},
    {"gemma", Family::kRopeHalf},
    {"gemma2", Family::kRopeHalf},
    {"stablelm", Family::kRopeHalf},
    {"starcoder2", Family::kRopeHalf},
    {"olmo", Family::kRopeHalf},
    {"qwen2_vl", Family::kRopeVl},
    {"qwen2_5_vl", Family::kRopeVl},
    {"qwen3_vl", Family::kRopeVl},
    {"gptj", Family::kRopeInterleaved},
    {"codegen", Family::kRopeInterleaved},
    {"falcon", Family::kFalcon},
    {"bloom", Family::kBloom},
    {"mpt", Family::kMpt},
    {"t5", Family::kT5},
    {"mt5", Family::kT5},
    {"deberta", Family::kDeberta},
    {"deberta-v2", Family::kDebertaV2},
    {"gpt2", Family::kGpt2},
    {"bert", Family::kBert},
    {"roberta", Family::kBert},
};

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

std::string fmt(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.10g", v);
  return buf;
}

std::string fmt(int64_t v) { return std::to_string(v); }

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

// head_dim = hidden / heads, divisible.
int64_t split_heads(const Reader& r, int64_t hidden, const std::string& hidden_name, int64_t heads,
                    const std::string& heads_name) {
  if (hidden % heads != 0) {
    r.fail(hidden_name + " (" + fmt(hidden) + ") is not divisible by " + heads_name + " (" +
           fmt(heads) + ")");
  }
  return hidden / heads;
}

void read_common_dims(const Reader& r, const Scope& s, ModelConfig& cfg) {
  const auto heads = r.require_dim_alias(s, kHeadKeys);
  const auto hidden = r.require_dim_alias(s, kHiddenKeys);
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

std::optional<ScalingDict> scaling_dict(const Reader& r, const Scope& s) {
  const auto a = s.get("rope_scaling");
  const auto b = s.get("rope_parameters");
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
double read_theta(const Reader& r, const Scope& s, const std::optional<ScalingDict>& sd) {
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
  return theta ? theta->first : 1e4;
}

// R from partial_rotary_factor (scope or scaling dict), rotary_pct or rotary_dim, all agreeing.
int64_t read_rotary_dim(const Reader& r, const Scope& s, const std::optional<ScalingDict>& sd,
                        int64_t head_dim) {
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

void read_rope(const Reader& r, const Scope& s, Family family, const std::string& model_type,
               ModelConfig& cfg) {
  const auto sd = scaling_dict(r, s);
  cfg.rope.head_dim = cfg.head_dim;
  cfg.rope.style = family == Family::kRopeInterleaved ? RopeStyle::kInterleaved : RopeStyle::kHalf;
  cfg.rope.base = read_theta(r, s, sd);
  cfg.rope.rotary_dim = read_rotary_dim(r, s, sd, cfg.head_dim);
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
        if (!orig) {
          r.fail(d.key_name("original_max_position_embeddings") +
                 " (in the dict or at the top level) is required for rope_type '" + kname + "'");
        }
        sc.original_max_position_embeddings = orig->first;
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

void read_rope_family(const Reader& r, const json& top, Family family,
                      const std::string& model_type, ModelConfig& cfg) {
  Scope s;
  if (family == Family::kRopeVl) {
    if (const auto tc = Node{&top, ""}.get("text_config")) {
      s.nodes.push_back(Node{&r.object(*tc), "text_config"});
    }
  }
  s.nodes.push_back(Node{&top, ""});
  cfg.scheme = ModelScheme::kRope;

  const auto heads = r.require_dim_alias(s, kHeadKeys);
  const auto hidden = r.require_dim_alias(s, kHiddenKeys);
  cfg.heads_q = heads.first;
  cfg.hidden_size = hidden.first;
  // head_dim: explicit (Gemma's 256 is not hidden / heads) or hidden / heads.
  if (const auto x = s.get("head_dim")) {
    cfg.head_dim = r.positive_int(*x, Reader::kMaxDim);
  } else {
    cfg.head_dim = split_heads(r, hidden.first, hidden.second, heads.first, heads.second);
  }
  if (const auto ctx = r.positive_int_alias(s, kContextKeys)) {
    cfg.max_position_embeddings = ctx->first;
  }

  // Key/value heads.
  if (family == Family::kFalcon) {
    read_falcon_kv_heads(r, s, cfg);
  } else {
    cfg.heads_kv = cfg.heads_q;
    std::string kv_name = "num_key_value_heads";
    if (const auto x = s.get("num_key_value_heads")) {
      cfg.heads_kv = r.positive_int(*x, Reader::kMaxDim);
      kv_name = x->name;
    }
    check_kv_heads(r, cfg, kv_name);
  }

  // Sliding window (Qwen2 writes one with "use_sliding_window": false: then none applies).
  if (const auto x = s.get("sliding_window")) {
    const int64_t w = r.positive_int(*x);
    const auto use = s.get("use_sliding_window");
    if (!use || r.boolean(*use)) cfg.sliding_window = w;
  }

  read_rope(r, s, family, model_type, cfg);
}

void read_alibi_family(const Reader& r, const json& top, Family family, ModelConfig& cfg) {
  Scope s{{Node{&top, ""}}};
  cfg.scheme = ModelScheme::kAlibi;
  read_common_dims(r, s, cfg);
  cfg.alibi.heads = cfg.heads_q;
  cfg.alibi.max_bias = 8.0;
  if (family == Family::kMpt) {
    if (const auto x = s.get("max_seq_len")) cfg.max_position_embeddings = r.positive_int(*x);
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

void read_t5(const Reader& r, const json& top, ModelConfig& cfg) {
  Scope s{{Node{&top, ""}}};
  cfg.scheme = ModelScheme::kT5;
  const auto heads = r.require_dim_alias(s, kHeadKeys);
  const auto hidden = r.require_dim_alias(s, kHiddenKeys);
  cfg.heads_q = cfg.heads_kv = heads.first;
  cfg.hidden_size = hidden.first;
  const auto dkv = s.get("d_kv");
  if (!dkv) r.fail("missing d_kv");
  cfg.head_dim = r.positive_int(*dkv, Reader::kMaxDim);
  if (const auto x = s.get("relative_attention_num_buckets")) {
    cfg.t5.num_buckets = r.positive_int(*x);
  }
  if (const auto x = s.get("relative_attention_max_distance")) {
    cfg.t5.max_distance = r.positive_int(*x);
  }
  cfg.t5.bidirectional = true;
  r.checked([&] { validate(cfg.t5); });
}

void read_deberta(const Reader& r, const json& top, Family family, ModelConfig& cfg) {
  Scope s{{Node{&top, ""}}};
  cfg.scheme = ModelScheme::kDeberta;
  const auto heads = r.require_dim_alias(s, kHeadKeys);
  const auto hidden = r.require_dim_alias(s, kHiddenKeys);
  cfg.heads_q = cfg.heads_kv = heads.first;
  cfg.hidden_size = hidden.first;
  if (const auto x = s.get("attention_head_size"); x && family == Family::kDebertaV2) {
    cfg.head_dim = r.positive_int(*x, Reader::kMaxDim);
  } else {
    cfg.head_dim = split_heads(r, hidden.first, hidden.second, heads.first, heads.second);
  }
  if (const auto x = s.get("max_position_embeddings")) {
    cfg.max_position_embeddings = r.positive_int(*x);
  }
  const auto rel = s.get("relative_attention");
  if (!rel || !r.boolean(*rel)) {
    r.fail("relative_attention is " + std::string(rel ? "false" : "absent (default false)") +
           ": only DeBERTa with relative attention is supported");
  }
  // max_relative_positions < 1 (HF: -1) means max_position_embeddings.
  int64_t mrp = -1;
  if (const auto x = s.get("max_relative_positions")) mrp = r.integer(*x);
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

void read_learned(const Reader& r, const json& top, Family family, ModelConfig& cfg) {
  Scope s{{Node{&top, ""}}};
  cfg.scheme = ModelScheme::kLearned;
  read_common_dims(r, s, cfg);
  const auto ctx = r.positive_int_alias(s, kContextKeys);
  if (!ctx) r.fail("missing max_position_embeddings / n_positions (the learned table's size)");
  cfg.max_position_embeddings = ctx->first;
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
  }
  if (!top.is_object()) r.fail("the top level must be a JSON object (got " + show(top) + ")");
  const Node root{&top, ""};
  const auto mt = root.get("model_type");
  if (!mt) r.fail("missing required key 'model_type'");
  ModelConfig cfg;
  cfg.model_type = r.string(*mt);
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
      read_rope_family(r, top, entry->family, cfg.model_type, cfg);
      break;
    case Family::kFalcon: {
      const auto alibi = root.get("alibi");
      if (alibi && r.boolean(*alibi)) {
        read_alibi_family(r, top, entry->family, cfg);
        // The kv heads do not change ALiBi; record them as HF computes them.
        read_falcon_kv_heads(r, Scope{{root}}, cfg);
      } else {
        read_rope_family(r, top, entry->family, cfg.model_type, cfg);
      }
      break;
    }
    case Family::kBloom:
    case Family::kMpt:
      read_alibi_family(r, top, entry->family, cfg);
      break;
    case Family::kT5:
      read_t5(r, top, cfg);
      break;
    case Family::kDeberta:
    case Family::kDebertaV2:
      read_deberta(r, top, entry->family, cfg);
      break;
    case Family::kGpt2:
    case Family::kBert:
      read_learned(r, top, entry->family, cfg);
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

const char* style_name(RopeStyle s) {
  switch (s) {
    case RopeStyle::kHalf:
      return "half";
    case RopeStyle::kInterleaved:
      return "interleaved";
  }
  return "unknown";
}

const char* scaling_name(RopeScalingType t) {
  switch (t) {
    case RopeScalingType::kDefault:
      return "default";
    case RopeScalingType::kLinear:
      return "linear";
    case RopeScalingType::kDynamic:
      return "dynamic";
    case RopeScalingType::kYarn:
      return "yarn";
    case RopeScalingType::kLlama3:
      return "llama3";
    case RopeScalingType::kLongRope:
      return "longrope";
  }
  return "unknown";
}

namespace {

std::string list_summary(const std::vector<double>& v) {
  if (v.empty()) return "[]";
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return "[" + std::to_string(v.size()) + " values, " + fmt(v.front()) + " .. " + fmt(v.back()) +
         ", min " + fmt(*lo) + ", max " + fmt(*hi) + "]";
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
      const RopeScaling& s = r.scaling;
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
          sc +=
              ": factor " + fmt(s.factor) + ", original_max_position_embeddings " +
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
      }
      line("rope_scaling", sc);
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
  line("effective_context", fmt(cfg.effective_context()));
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
