// src/model/rope_scaling.cc - a model's RoPE from config.json: theta, the rotary dim
// (partial_rotary_factor, rotary_pct, rotary_dim), rope_scaling / rope_parameters for every
// scaling type (linear, dynamic, yarn, llama3, longrope; per layer type) and M-RoPE sections.
// Strict: every key type-, range- and alias-checked (docs/model-configs.md).
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

namespace {

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

}  // namespace

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

namespace {

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
  if (s == "proportional") return Kind{RopeScalingType::kProportional, false};
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
    case RopeScalingType::kProportional:
      add({"factor"});
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
  AgreeingTheta theta(r);
  theta.take(s.get("rope_theta"));
  theta.take(s.get("rotary_emb_base"));
  if (sd) theta.take(sd->get("rope_theta"));
  if (theta.value()) return theta.value()->first;
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

// Whether the scaling dict names the proportional kind (Gemma 4's global layers).
bool names_proportional(const Reader& r, const std::optional<ScalingDict>& sd) {
  if (!sd) return false;
  for (const char* key : {"rope_type", "type"}) {
    if (const auto x = sd->get(key); x && x->v->is_string() && r.string(*x) == "proportional") {
      return true;
    }
  }
  return false;
}

// proportional's partial_rotary_factor: the scaling dict's or the top level's (both: must agree),
// in [0, 1]; 1 when neither gives one. It picks the rotated pairs; the rotary dim stays the head.
double read_proportion(const Reader& r, const Scope& s, const ScalingDict& d) {
  std::optional<std::pair<double, std::string>> out;
  for (const auto& x : {d.get("partial_rotary_factor"), s.get("partial_rotary_factor")}) {
    if (!x) continue;
    if (!x->v->is_number() || !(x->v->get<double>() >= 0) || !(x->v->get<double>() <= 1)) {
      r.fail(x->name + " must be a number in [0, 1] (got " + show(*x->v) + ")");
    }
    const double v = x->v->get<double>();
    if (!out) {
      out = std::make_pair(v, x->name);
    } else if (out->first != v) {
      r.fail(x->name + " (" + show(*x->v) + ") contradicts " + out->second + " (" +
             fmt(out->first) + ")");
    }
  }
  return out ? out->first : 1.0;
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

}  // namespace

// The RoPE of the model (its global layers when they differ): theta, rotary dim, scaling and
// M-RoPE into cfg.rope / cfg.mrope. cfg.rope.head_dim and cfg.rope.style are set by the caller.
void read_rope(const Reader& r, const Scope& s, const TypeDefaults& td,
               const std::string& model_type, ModelConfig& cfg) {
  const Family family = td.family;
  auto sd = scaling_dict(r, s);
  if (!sd && family == Family::kGptOss) {
    // GptOssConfig's default when the config gives no RoPE dict: YaRN over 4096 positions.
    static const json kGptOssYarn = {
        {"rope_type", "yarn"}, {"factor", 32.0},    {"beta_fast", 32.0},
        {"beta_slow", 1.0},    {"truncate", false}, {"original_max_position_embeddings", 4096}};
    sd = ScalingDict{{Node{&kGptOssYarn, "rope_parameters"}}, "rope_parameters"};
  }
  if (!sd && family == Family::kGemma4) {
    // Gemma4TextConfig's default for the global layers when the config gives no RoPE dict.
    static const json kGemma4Global = {
        {"rope_type", "proportional"}, {"partial_rotary_factor", 0.25}, {"rope_theta", 1e6}};
    sd = ScalingDict{{Node{&kGemma4Global, "rope_parameters.full_attention"}},
                     "rope_parameters.full_attention"};
    note_default(cfg, "rope_parameters.full_attention",
                 "{rope_type: proportional, partial_rotary_factor: 0.25, rope_theta: 1000000}");
  }
  cfg.rope.base = read_theta(r, s, sd, td, cfg);
  if (names_proportional(r, sd)) {
    // The whole head rotates (pairs past partial_rotary_factor with frequency 0).
    if (cfg.rope.head_dim % 2 != 0) {
      r.fail("rotary dim = head dim " + fmt(cfg.rope.head_dim) + " is odd; it must be even");
    }
    cfg.rope.rotary_dim = cfg.rope.head_dim;
  } else {
    cfg.rope.rotary_dim = read_rotary_dim(r, s, sd, cfg.rope.head_dim, td, cfg);
  }
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
               "' (supported: default, linear, dynamic, yarn, llama3, longrope, su, mrope, "
               "proportional)");
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
      case RopeScalingType::kProportional:
        sc.partial_rotary_factor = read_proportion(r, s, d);
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

}  // namespace posenc::model
