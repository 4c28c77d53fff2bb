// src/schemes.cc - the registry of attention schemes (posenc/schemes.h).
#include "posenc/schemes.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "common.h"
#include "posenc/attention.h"
#include "posenc/error.h"
#include "posenc/names.h"
#include "posenc/scheme.h"

namespace posenc {

namespace {

// The largest position, distance or length a setting takes (2^48, as for positions).
constexpr double kMaxPosition = 281474976710656.0;

// Setting rows, by type. `store` functions put a checked value into its SchemeSettings field.
SchemeSettingInfo number(std::string keyword, std::string flag, SettingType type,
                         std::optional<double> min, std::optional<double> max, bool min_exclusive,
                         std::string default_value, std::string help, bool model_sets,
                         void (*store)(SchemeSettings&, const SettingValue&)) {
  SchemeSettingInfo i;
  i.keyword = std::move(keyword);
  i.flag = std::move(flag);
  i.type = type;
  i.min = min;
  i.max = max;
  i.min_exclusive = min_exclusive;
  i.default_value = std::move(default_value);
  i.help = std::move(help);
  i.model_sets = model_sets;
  i.store = store;
  return i;
}

SchemeSettingInfo choice(std::string keyword, std::string flag, std::vector<std::string> choices,
                         std::string default_value, std::string help, bool model_sets,
                         void (*store)(SchemeSettings&, const SettingValue&)) {
  SchemeSettingInfo i =
      number(std::move(keyword), std::move(flag), SettingType::kChoice, std::nullopt, std::nullopt,
             false, std::move(default_value), std::move(help), model_sets, store);
  i.choices = std::move(choices);
  return i;
}

SchemeSettingInfo flag(std::string keyword, std::string flag, std::string default_value,
                       std::string help, void (*store)(SchemeSettings&, const SettingValue&)) {
  return number(std::move(keyword), std::move(flag), SettingType::kBool, std::nullopt, std::nullopt,
                false, std::move(default_value), std::move(help), false, store);
}

SchemeSettingInfo object(std::string keyword, SettingType type, std::string default_value,
                         std::string help, bool model_sets) {
  return number(std::move(keyword), "", type, std::nullopt, std::nullopt, false,
                std::move(default_value), std::move(help), model_sets, nullptr);
}

double real(const SettingValue& v) { return std::get<double>(v); }
int64_t whole(const SettingValue& v) { return std::get<int64_t>(v); }
bool yes(const SettingValue& v) { return std::get<bool>(v); }
const std::string& text(const SettingValue& v) { return std::get<std::string>(v); }

std::vector<SchemeInfo> make_registry() {
  using T = SettingType;
  std::vector<SchemeInfo> r;
  r.push_back({.name = "none",
               .title = "no positions",
               .summary = "plain scaled dot-product attention",
               .models = "encoder-only baselines, NoPE layers (Llama 4)",
               .doc = "docs/attention.md"});
  r.push_back(
      {.name = "rope",
       .title = "RoPE",
       .summary = "q and k rotated by p * theta^(-2i/R) in pairs",
       .models = "Llama, Mistral, Qwen, Gemma, GPT-NeoX, Phi (half); GPT-J, RoFormer (interleaved)",
       .doc = "docs/rope.md",
       .settings = {
           number("base", "--base", T::kFloat, 0.0, std::nullopt, true, "10000",
                  "theta (rope_theta)", true,
                  [](SchemeSettings& s, const SettingValue& v) { s.base = real(v); }),
           number("rotary_dim", "--rotary-dim", T::kInt, 0.0, 4294967296.0, false, "head_dim",
                  "rotary dim R (even, <= head_dim; 0: head_dim)", true,
                  [](SchemeSettings& s, const SettingValue& v) { s.rotary_dim = whole(v); }),
           choice("style", "--style", {"half", "interleaved"}, "half",
                  "rotate_half pairs (i, i + R/2) or adjacent pairs (2i, 2i + 1)", true,
                  [](SchemeSettings& s, const SettingValue& v) {
                    s.style = parse_rope_style(text(v));
                  }),
           choice("angles", "--angles", {"accurate", "float32"}, "accurate",
                  "angles in double, or the frameworks' float32 recipe (docs/precision.md)", false,
                  [](SchemeSettings& s, const SettingValue& v) {
                    s.angles = parse_rope_angles(text(v));
                  }),
           number("seq_len", "--seq-len", T::kInt, 0.0, kMaxPosition, false, "max position + 1",
                  "sequence length for length-dependent scaling", false, nullptr),
           object("freqs", T::kRopeFrequencies, "from base, rotary_dim and scaling",
                  "inverse frequencies given directly (a RopeFrequencies)", false),
           object("scaling", T::kRopeScaling, "none",
                  "frequency scaling (a Hugging Face rope_scaling dict) at the sequence's length",
                  true)}});
  r.push_back(
      {.name = "alibi",
       .title = "ALiBi",
       .summary = "-m_h * |pos_q - pos_k| added to the scores",
       .models = "BLOOM, MPT, Falcon-RW",
       .doc = "docs/alibi.md",
       .params = {{"slopes", "[heads]", false, true,
                   "per-head slopes m_h (default: the geometric sequence of max_bias)", 0}},
       .settings = {number("max_bias", "--max-bias", T::kFloat, 0.0, std::nullopt, true, "8",
                           "maximum bias B when slopes are computed", true,
                           [](SchemeSettings& s, const SettingValue& v) { s.max_bias = real(v); })},
       .relative = true,
       .bias_map = true});
  r.push_back(
      {.name = "t5",
       .title = "T5 relative bias",
       .summary = "a learned bias per log bucket of pos_k - pos_q",
       .models = "T5, mT5, Flan-T5, UL2",
       .doc = "docs/t5.md",
       .params = {{"relative_attention_bias", "[num_buckets, heads]", true, true,
                   "the bias table, one row per bucket", 1}},
       .settings =
           {number("num_buckets", "--num-buckets", T::kInt, 1.0, kMaxPosition, false,
                   "the table's rows", "number of buckets (must equal the table's rows)", true,
                   [](SchemeSettings& s, const SettingValue& v) { s.num_buckets = whole(v); }),
            number("max_distance", "--max-distance", T::kInt, 1.0, kMaxPosition, false, "128",
                   "distance of the last bucket", true,
                   [](SchemeSettings& s, const SettingValue& v) { s.max_distance = whole(v); }),
            flag("bidirectional", "", "not causal", "buckets for both signs of the offset",
                 [](SchemeSettings& s, const SettingValue& v) { s.bidirectional = yes(v); })},
       .relative = true,
       .bias_map = true});
  r.push_back({.name = "shaw",
               .title = "Shaw et al. relative positions",
               .summary = "clipped relative key (and value) embeddings a_K, a_V",
               .models = "Shaw et al. 2018, relative-position NMT (OpenNMT, tensor2tensor)",
               .doc = "docs/shaw.md",
               .params = {{"rel_k", "[2K+1, head_dim] or [2K+1, heads, head_dim]", true, true,
                           "relative key embeddings a_K, clip distance K", -1},
                          {"rel_v", "[2K+1, head_dim] or [2K+1, heads, head_dim]", false, true,
                           "relative value embeddings a_V (optional)", -1}},
               .relative = true,
               .bias_map = true});
  r.push_back(
      {.name = "xl",
       .title = "Transformer-XL relative positions",
       .summary = "content and position biases u, v and a projected sinusoid of the distance",
       .models = "Transformer-XL, XLNet",
       .doc = "docs/transformer-xl.md",
       .params = {{"r_w_bias", "[heads, head_dim]", true, true, "content bias u", 0},
                  {"r_r_bias", "[heads, head_dim]", true, true, "position bias v", 0},
                  {"r_net", "[heads * head_dim, d_model]", true, true,
                   "projection W_r of the sinusoid R", -1}},
       .settings = {number("base", "--base", T::kFloat, 0.0, std::nullopt, true, "10000",
                           "sinusoid base", false,
                           [](SchemeSettings& s, const SettingValue& v) { s.base = real(v); })},
       .relative = true});
  r.push_back(
      {.name = "deberta",
       .title = "DeBERTa disentangled attention",
       .summary = "content-to-position and position-to-content terms over log buckets",
       .models = "DeBERTa v1, v2, v3",
       .doc = "docs/deberta.md",
       .params = {{"pos_key", "[2K, heads, head_dim]", true, true,
                   "projected relative embeddings for c2p", 1},
                  {"pos_query", "[2K, heads, head_dim]", true, true,
                   "projected relative embeddings for p2c", 1}},
       .settings =
           {number("position_buckets", "--position-buckets", T::kInt, 0.0, kMaxPosition, false, "0",
                   "position_buckets (0 = no log bucketing)", true,
                   [](SchemeSettings& s, const SettingValue& v) { s.position_buckets = whole(v); }),
            number("max_relative_positions", "--max-relative-positions", T::kInt, 0.0, kMaxPosition,
                   false, "512", "max_relative_positions", true,
                   [](SchemeSettings& s, const SettingValue& v) {
                     s.max_relative_positions = whole(v);
                   }),
            choice("deberta_p2c", "--deberta-p2c", {"model", "paper"}, "model",
                   "p2c index: model (clamp(rho + K), what trained checkpoints compute) or paper "
                   "(clamp(-rho + K), the paper's delta(j, i))",
                   false,
                   [](SchemeSettings& s, const SettingValue& v) {
                     s.deberta_p2c = parse_deberta_p2c(text(v));
                   }),
            flag("deberta_float64_log", "--deberta-float64-log", "false",
                 "log bucketing in float64 (the authors' code) instead of float32 (HF)",
                 [](SchemeSettings& s, const SettingValue& v) { s.deberta_float64_log = yes(v); })},
       .relative = true,
       .bias_map = true});
  return r;
}

// "2^48" for the largest position, else the number as written.
std::string bound_text(double x) {
  if (x == kMaxPosition) return "2^48";
  if (x == 4294967296.0) return "2^32";
  return detail::num(x);
}

}  // namespace

const std::vector<SchemeInfo>& attention_schemes() {
  static const std::vector<SchemeInfo> registry = make_registry();
  return registry;
}

const SchemeInfo& scheme_info(const std::string& name) {
  for (const SchemeInfo& s : attention_schemes()) {
    if (s.name == name) return s;
  }
  throw ValueError("unknown scheme '" + name + "' (" + scheme_names_text() + ")");
}

const SchemeInfo& scheme_info(std::size_t index) { return attention_schemes().at(index); }

std::string scheme_name(const PositionScheme& scheme) { return scheme_info(scheme.index()).name; }

std::vector<std::string> scheme_names() {
  std::vector<std::string> out;
  for (const SchemeInfo& s : attention_schemes()) out.push_back(s.name);
  return out;
}

std::string scheme_names_text() {
  const std::vector<std::string> names = scheme_names();
  std::string s;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i > 0) s += i + 1 == names.size() ? " or " : ", ";
    s += names[i];
  }
  return s;
}

const std::vector<SchemeParamInfo>& common_scheme_params() {
  static const std::vector<SchemeParamInfo> params = {
      {"sinks", "[heads_q]", false, true,
       "attention sinks: one logit per query head in every softmax denominator (gpt-oss)"}};
  return params;
}

std::vector<SchemeSettingUse> scheme_settings() {
  std::vector<SchemeSettingUse> out;
  for (const SchemeInfo& s : attention_schemes()) {
    for (const SchemeSettingInfo& set : s.settings) {
      auto it = std::find_if(out.begin(), out.end(), [&](const SchemeSettingUse& u) {
        return u.setting.keyword == set.keyword;
      });
      if (it == out.end()) {
        out.push_back({set, {s.name}});
      } else {
        it->schemes.push_back(s.name);
      }
    }
  }
  return out;
}

const SchemeSettingInfo* scheme_setting(const std::string& scheme, const std::string& keyword) {
  for (const SchemeSettingInfo& s : scheme_info(scheme).settings) {
    if (s.keyword == keyword) return &s;
  }
  return nullptr;
}

const char* setting_type_name(SettingType t) {
  switch (t) {
    case SettingType::kFloat:
      return "float";
    case SettingType::kInt:
      return "int";
    case SettingType::kBool:
      return "bool";
    case SettingType::kChoice:
      return "choice";
    case SettingType::kRopeFrequencies:
      return "rope_frequencies";
    case SettingType::kRopeScaling:
      return "rope_scaling";
  }
  return "?";
}

std::string setting_range_text(const SchemeSettingInfo& s) {
  if (s.type == SettingType::kChoice) {
    std::string t;
    for (std::size_t i = 0; i < s.choices.size(); ++i) {
      if (i > 0) t += i + 1 == s.choices.size() ? " or " : ", ";
      t += s.choices[i];
    }
    return t;
  }
  if (s.type != SettingType::kFloat && s.type != SettingType::kInt) return "";
  if (s.min && s.max) return "in [" + bound_text(*s.min) + ", " + bound_text(*s.max) + "]";
  if (s.min) return (s.min_exclusive ? "> " : ">= ") + bound_text(*s.min);
  if (s.max) return "<= " + bound_text(*s.max);
  return "";
}

SettingValue check_setting(const SchemeSettingInfo& s, SettingValue value,
                           const std::string& name) {
  auto bad_type = [&](const char* want) {
    throw ValueError(name + ": expected " + want + " for setting '" + s.keyword + "'");
  };
  switch (s.type) {
    case SettingType::kFloat: {
      if (const int64_t* i = std::get_if<int64_t>(&value)) value = static_cast<double>(*i);
      const double* x = std::get_if<double>(&value);
      if (!x) bad_type("a number");
      const bool in = std::isfinite(*x) &&
                      (!s.min || (s.min_exclusive ? *x > *s.min : *x >= *s.min)) &&
                      (!s.max || *x <= *s.max);
      if (!in) {
        throw ValueError(name + " must be a finite number " + setting_range_text(s) + " (got " +
                         detail::num(*x) + ")");
      }
      return value;
    }
    case SettingType::kInt: {
      const int64_t* x = std::get_if<int64_t>(&value);
      if (!x) bad_type("an integer");
      const double d = static_cast<double>(*x);
      const bool in =
          (!s.min || (s.min_exclusive ? d > *s.min : d >= *s.min)) && (!s.max || d <= *s.max);
      if (!in) {
        throw ValueError(name + " must be an integer " + setting_range_text(s) + " (got " +
                         std::to_string(*x) + ")");
      }
      return value;
    }
    case SettingType::kBool:
      if (!std::holds_alternative<bool>(value)) bad_type("True or False");
      return value;
    case SettingType::kChoice: {
      const std::string* x = std::get_if<std::string>(&value);
      if (!x) bad_type("a string");
      if (std::find(s.choices.begin(), s.choices.end(), *x) == s.choices.end()) {
        throw ValueError(name + " must be " + setting_range_text(s) + " (got '" + *x + "')");
      }
      return value;
    }
    case SettingType::kRopeFrequencies:
    case SettingType::kRopeScaling:
      break;
  }
  throw ValueError(name + ": setting '" + s.keyword + "' takes a " + setting_type_name(s.type) +
                   " object, not a plain value");
}

SettingValue parse_setting(const SchemeSettingInfo& s, const std::string& text,
                           const std::string& name) {
  const char* begin = text.c_str();
  char* end = nullptr;
  errno = 0;
  switch (s.type) {
    case SettingType::kFloat: {
      const double x = std::strtod(begin, &end);
      if (text.empty() || end != begin + text.size() ||
          std::isspace(static_cast<unsigned char>(text[0]))) {
        throw ValueError(name + " must be a number " + setting_range_text(s) + " (got '" + text +
                         "')");
      }
      return check_setting(s, x, name);
    }
    case SettingType::kInt: {
      const long long x = std::strtoll(begin, &end, 10);
      if (text.empty() || end != begin + text.size() || errno == ERANGE ||
          std::isspace(static_cast<unsigned char>(text[0]))) {
        throw ValueError(name + " must be an integer " + setting_range_text(s) + " (got '" + text +
                         "')");
      }
      return check_setting(s, static_cast<int64_t>(x), name);
    }
    case SettingType::kBool:
      if (text == "true" || text == "1") return true;
      if (text == "false" || text == "0") return false;
      throw ValueError(name + " must be true or false (got '" + text + "')");
    case SettingType::kChoice:
      return check_setting(s, text, name);
    case SettingType::kRopeFrequencies:
    case SettingType::kRopeScaling:
      break;
  }
  throw ValueError(name + ": setting '" + s.keyword + "' is not given as text");
}

void set_scheme_setting(SchemeSettings& settings, const SchemeSettingInfo& s, SettingValue value,
                        const std::string& name) {
  value = check_setting(s, std::move(value), name);
  if (s.store == nullptr) {
    throw ValueError(name + ": setting '" + s.keyword + "' is not stored in the scheme's settings");
  }
  s.store(settings, value);
}

}  // namespace posenc
