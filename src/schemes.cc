// src/schemes.cc - the registry of attention schemes (posenc/schemes.h).
#include "posenc/schemes.h"

#include <algorithm>

#include "posenc/attention.h"
#include "posenc/error.h"

namespace posenc {

namespace {

std::vector<SchemeInfo> make_registry() {
  std::vector<SchemeInfo> r;
  r.push_back({SchemeKind::kNone,
               "none",
               "no positions",
               "plain scaled dot-product attention",
               "encoder-only baselines, NoPE layers (Llama 4)",
               "docs/attention.md",
               {},
               {},
               false,
               false});
  r.push_back({SchemeKind::kRope,
               "rope",
               "RoPE",
               "q and k rotated by p * theta^(-2i/R) in pairs",
               "Llama, Mistral, Qwen, Gemma, GPT-NeoX, Phi (half); GPT-J, RoFormer (interleaved)",
               "docs/rope.md",
               {},
               {{"base", "--base", "theta (rope_theta), default 10000"},
                {"rotary_dim", "--rotary-dim", "rotary dim R (even; default head_dim)"},
                {"style", "--style", "half (rotate_half pairs) or interleaved (adjacent pairs)"},
                {"angles", "--angles",
                 "accurate (angles in double) or float32 (the frameworks' float32 recipe)"},
                {"seq_len", "--seq-len",
                 "sequence length for length-dependent scaling (default: max position + 1)"},
                {"freqs", "", "inverse frequencies given directly (a RopeFrequencies)"},
                {"scaling", "",
                 "frequency scaling (a Hugging Face rope_scaling dict) at the sequence's length"}},
               false,
               false});
  r.push_back({SchemeKind::kAlibi,
               "alibi",
               "ALiBi",
               "-m_h * |pos_q - pos_k| added to the scores",
               "BLOOM, MPT, Falcon-RW",
               "docs/alibi.md",
               {{"slopes", "[heads]", false, true,
                 "per-head slopes m_h (default: the geometric sequence of max_bias)"}},
               {{"max_bias", "--max-bias", "maximum bias B when slopes are computed (default 8)"}},
               true,
               true});
  r.push_back(
      {SchemeKind::kT5,
       "t5",
       "T5 relative bias",
       "a learned bias per log bucket of pos_k - pos_q",
       "T5, mT5, Flan-T5, UL2",
       "docs/t5.md",
       {{"relative_attention_bias", "[num_buckets, heads]", true, true,
         "the bias table, one row per bucket"}},
       {{"num_buckets", "--num-buckets",
         "number of buckets (must equal the table's rows; default: the table's)"},
        {"max_distance", "--max-distance", "distance of the last bucket (default 128)"},
        {"bidirectional", "", "buckets for both signs of the offset (default: not causal)"}},
       true,
       true});
  r.push_back({SchemeKind::kShaw,
               "shaw",
               "Shaw et al. relative positions",
               "clipped relative key (and value) embeddings a_K, a_V",
               "Shaw et al. 2018, relative-position NMT (OpenNMT, tensor2tensor)",
               "docs/shaw.md",
               {{"rel_k", "[2K+1, head_dim] or [2K+1, heads, head_dim]", true, true,
                 "relative key embeddings a_K, clip distance K"},
                {"rel_v", "[2K+1, head_dim] or [2K+1, heads, head_dim]", false, true,
                 "relative value embeddings a_V (optional)"}},
               {},
               true,
               true});
  r.push_back(
      {SchemeKind::kXl,
       "xl",
       "Transformer-XL relative positions",
       "content and position biases u, v and a projected sinusoid of the distance",
       "Transformer-XL, XLNet",
       "docs/transformer-xl.md",
       {{"r_w_bias", "[heads, head_dim]", true, true, "content bias u"},
        {"r_r_bias", "[heads, head_dim]", true, true, "position bias v"},
        {"r_net", "[heads * head_dim, d_model]", true, true, "projection W_r of the sinusoid R"}},
       {{"base", "--base", "sinusoid base (default 10000)"}},
       true,
       false});
  r.push_back(
      {SchemeKind::kDeberta,
       "deberta",
       "DeBERTa disentangled attention",
       "content-to-position and position-to-content terms over log buckets",
       "DeBERTa v1, v2, v3",
       "docs/deberta.md",
       {{"pos_key", "[2K, heads, head_dim]", true, true, "projected relative embeddings for c2p"},
        {"pos_query", "[2K, heads, head_dim]", true, true,
         "projected relative embeddings for p2c"}},
       {{"position_buckets", "--position-buckets",
         "position_buckets (0 = no log bucketing; default 0)"},
        {"max_relative_positions", "--max-relative-positions",
         "max_relative_positions (default 512)"},
        {"deberta_p2c", "--deberta-p2c",
         "p2c index: model (what trained checkpoints compute; default) or paper"},
        {"deberta_float64_log", "--deberta-float64-log",
         "log bucketing in float64 (the authors' code) instead of float32 (HF)"}},
       true,
       true});
  return r;
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

const SchemeInfo& scheme_info(SchemeKind kind) {
  return attention_schemes().at(static_cast<std::size_t>(kind));
}

std::string scheme_name(const PositionScheme& scheme) {
  return scheme_info(static_cast<SchemeKind>(scheme.index())).name;
}

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

}  // namespace posenc
