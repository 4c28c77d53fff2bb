// Tests for posenc/config.h: every shipped tests/configs/*.json loads into the expected typed
// configuration (values checked by hand against the models' published config.json), the RoPE
// frequencies of a parsed model equal those of the same hand-built RopeConfig, describe() names
// the key numbers, and malformed configs fail with one-line IoErrors naming the source and key.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "posenc/config.h"
#include "posenc/error.h"
#include "posenc/rope.h"
#include "posenc/scheme.h"

namespace posenc {
namespace {

namespace fs = std::filesystem;

std::string config_path(const std::string& name) {
  return std::string(POSENC_TEST_CONFIGS_DIR) + "/" + name;
}

ModelConfig load(const std::string& name) { return read_model_config(config_path(name)); }

// The IoError message of parsing `text`, or a marker when it threw something else or nothing.
std::string parse_error(const std::string& text) {
  try {
    (void)parse_model_config(text, "cfg.json");
  } catch (const IoError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<not an IoError: ") + e.what() + ">";
  }
  return "<no error>";
}

// Parsing `text` throws an IoError whose one-line message starts with the source name and
// contains every fragment.
void expect_error(const std::string& text, std::initializer_list<const char*> fragments) {
  const std::string msg = parse_error(text);
  SCOPED_TRACE(text);
  EXPECT_EQ(msg.rfind("cfg.json: ", 0), 0u) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  for (const char* f : fragments) {
    EXPECT_NE(msg.find(f), std::string::npos) << "missing '" << f << "' in: " << msg;
  }
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// ---------------------------------------------------------------------------------------------
// Shipped configs.

TEST(ModelConfig, EveryShippedConfigLoads) {
  int n = 0;
  for (const auto& entry : fs::directory_iterator(POSENC_TEST_CONFIGS_DIR)) {
    if (entry.path().extension() != ".json") continue;
    SCOPED_TRACE(entry.path().string());
    ModelConfig cfg;
    ASSERT_NO_THROW(cfg = read_model_config(entry.path().string()));
    EXPECT_FALSE(cfg.model_type.empty());
    EXPECT_GE(cfg.heads_q, 1);
    EXPECT_GE(cfg.heads_kv, 1);
    EXPECT_EQ(cfg.heads_q % cfg.heads_kv, 0);
    EXPECT_GE(cfg.head_dim, 1);
    if (cfg.scheme == ModelScheme::kRope) {
      EXPECT_NO_THROW(validate(cfg.rope));
      EXPECT_NO_THROW((void)model_rope_frequencies(cfg));
    } else {
      EXPECT_THROW((void)model_rope_frequencies(cfg), ValueError);
    }
    const std::string text = describe(cfg);
    EXPECT_TRUE(contains(text, cfg.model_type)) << text;
    EXPECT_TRUE(contains(text, "effective_context")) << text;
    ++n;
  }
  EXPECT_GE(n, 19);
}

TEST(ModelConfig, Llama2) {
  const ModelConfig c = load("llama-2-7b.json");
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.scheme, ModelScheme::kRope);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.heads_q, 32);
  EXPECT_EQ(c.heads_kv, 32);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_FALSE(c.sliding_window.has_value());
  EXPECT_EQ(c.rope.head_dim, 128);
  EXPECT_EQ(c.rope.rotary_dim, 128);
  EXPECT_EQ(c.rope.base, 10000.0);  // no rope_theta key: the default
  EXPECT_EQ(c.rope.style, RopeStyle::kHalf);
  EXPECT_EQ(c.rope.scaling.type, RopeScalingType::kDefault);  // "rope_scaling": null
  EXPECT_FALSE(c.mrope.has_value());
  EXPECT_EQ(c.effective_context(), 4096);
}

TEST(ModelConfig, Llama31Llama3Scaling) {
  const ModelConfig c = load("llama-3.1-8b.json");
  EXPECT_EQ(c.heads_q, 32);
  EXPECT_EQ(c.heads_kv, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_EQ(c.rope.base, 500000.0);
  EXPECT_EQ(c.rope.rotary_dim, 128);
  const RopeScaling& s = c.rope.scaling;
  EXPECT_EQ(s.type, RopeScalingType::kLlama3);
  EXPECT_EQ(s.factor, 8.0);
  EXPECT_EQ(s.low_freq_factor, 1.0);
  EXPECT_EQ(s.high_freq_factor, 4.0);
  EXPECT_EQ(s.original_max_position_embeddings, 8192);
  EXPECT_EQ(s.max_position_embeddings, 131072);
  // 8192 x 8 = 65536 < the stated 131072, which wins.
  EXPECT_EQ(c.effective_context(), 131072);
}

TEST(ModelConfig, Llama31FrequenciesMatchHandBuiltConfig) {
  const ModelConfig c = load("llama-3.1-8b.json");
  RopeConfig hand{.head_dim = 128, .rotary_dim = 128, .base = 500000.0, .style = RopeStyle::kHalf};
  hand.scaling.type = RopeScalingType::kLlama3;
  hand.scaling.factor = 8.0;
  hand.scaling.low_freq_factor = 1.0;
  hand.scaling.high_freq_factor = 4.0;
  hand.scaling.original_max_position_embeddings = 8192;
  hand.scaling.max_position_embeddings = 131072;
  for (RopeAngles angles : {RopeAngles::kAccurate, RopeAngles::kFloat32}) {
    const RopeFrequencies got = model_rope_frequencies(c, 0, angles);
    const RopeFrequencies want = rope_frequencies(hand, 0, angles);
    ASSERT_EQ(got.inv_freq.size(), 64u);
    EXPECT_EQ(got.inv_freq, want.inv_freq);
    EXPECT_EQ(got.attention_factor, want.attention_factor);
    EXPECT_EQ(got.angles, angles);
  }
  // llama3 leaves the highest frequencies alone and divides the lowest by the factor.
  const RopeFrequencies f = model_rope_frequencies(c);
  EXPECT_EQ(f.inv_freq[0], 1.0);
  EXPECT_NEAR(f.inv_freq[63], std::pow(500000.0, -126.0 / 128.0) / 8.0, 1e-20);
}

TEST(ModelConfig, MistralSlidingWindow) {
  const ModelConfig c = load("mistral-7b.json");
  EXPECT_EQ(c.model_type, "mistral");
  EXPECT_EQ(c.heads_q, 32);
  EXPECT_EQ(c.heads_kv, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  ASSERT_TRUE(c.sliding_window.has_value());
  EXPECT_EQ(*c.sliding_window, 4096);
  EXPECT_EQ(c.rope.base, 10000.0);
  EXPECT_EQ(c.rope.scaling.type, RopeScalingType::kDefault);
}

TEST(ModelConfig, Qwen25Yarn) {
  const ModelConfig c = load("qwen2.5-7b-yarn.json");
  EXPECT_EQ(c.model_type, "qwen2");
  EXPECT_EQ(c.hidden_size, 3584);
  EXPECT_EQ(c.heads_q, 28);
  EXPECT_EQ(c.heads_kv, 4);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_FALSE(c.sliding_window.has_value());  // "use_sliding_window": false
  EXPECT_EQ(c.rope.base, 1e6);
  const RopeScaling& s = c.rope.scaling;
  EXPECT_EQ(s.type, RopeScalingType::kYarn);  // legacy "type"
  EXPECT_EQ(s.factor, 4.0);
  EXPECT_EQ(s.original_max_position_embeddings, 32768);
  EXPECT_EQ(s.beta_fast, 32.0);
  EXPECT_EQ(s.beta_slow, 1.0);
  EXPECT_TRUE(s.truncate);
  EXPECT_EQ(c.effective_context(), 131072);
  // Default yarn attention factor 0.1 ln 4 + 1.
  EXPECT_NEAR(model_rope_frequencies(c, 131072).attention_factor, 0.1 * std::log(4.0) + 1.0, 1e-15);
}

TEST(ModelConfig, Phi3LongRope) {
  const ModelConfig c = load("phi-3-mini-128k-like.json");
  EXPECT_EQ(c.model_type, "phi3");
  EXPECT_EQ(c.hidden_size, 3072);
  EXPECT_EQ(c.heads_q, 32);
  EXPECT_EQ(c.head_dim, 96);
  EXPECT_EQ(c.rope.rotary_dim, 96);
  const RopeScaling& s = c.rope.scaling;
  EXPECT_EQ(s.type, RopeScalingType::kLongRope);
  EXPECT_EQ(s.original_max_position_embeddings, 4096);  // top-level key
  EXPECT_EQ(s.max_position_embeddings, 131072);
  EXPECT_EQ(s.short_factor.size(), 48u);
  EXPECT_EQ(s.long_factor.size(), 48u);
  EXPECT_EQ(c.effective_context(), 131072);
  // Short table up to 4096 tokens, long beyond; af = sqrt(1 + ln(32) / ln(4096)) = sqrt(17/12).
  const RopeFrequencies short_f = model_rope_frequencies(c, 4096);
  const RopeFrequencies long_f = model_rope_frequencies(c, 4097);
  for (int i = 0; i < 48; ++i) {
    const double base = std::pow(10000.0, -2.0 * i / 96.0);
    EXPECT_NEAR(short_f.inv_freq[i], base / s.short_factor[i], 1e-15 * base);
    EXPECT_NEAR(long_f.inv_freq[i], base / s.long_factor[i], 1e-15 * base);
  }
  EXPECT_NEAR(long_f.attention_factor, std::sqrt(17.0 / 12.0), 1e-14);
  EXPECT_NEAR(short_f.attention_factor, std::sqrt(17.0 / 12.0), 1e-14);
}

TEST(ModelConfig, PartialRotary) {
  const ModelConfig phi2 = load("phi-2.json");
  EXPECT_EQ(phi2.model_type, "phi");
  EXPECT_EQ(phi2.head_dim, 80);
  EXPECT_EQ(phi2.heads_kv, 32);         // "num_key_value_heads": null
  EXPECT_EQ(phi2.rope.rotary_dim, 32);  // int(80 x 0.4) = int(32.000000000000004)
  EXPECT_EQ(phi2.max_position_embeddings, 2048);
  EXPECT_EQ(model_rope_frequencies(phi2).rotary_dim(), 32);

  const ModelConfig neox = load("gpt-neox-20b.json");
  EXPECT_EQ(neox.model_type, "gpt_neox");
  EXPECT_EQ(neox.hidden_size, 6144);
  EXPECT_EQ(neox.heads_q, 64);
  EXPECT_EQ(neox.head_dim, 96);
  EXPECT_EQ(neox.rope.rotary_dim, 24);  // rotary_pct 0.25
  EXPECT_EQ(neox.rope.base, 10000.0);   // rotary_emb_base
  EXPECT_EQ(neox.rope.style, RopeStyle::kHalf);
}

TEST(ModelConfig, GptJInterleaved) {
  const ModelConfig c = load("gpt-j-6b.json");
  EXPECT_EQ(c.model_type, "gptj");
  EXPECT_EQ(c.hidden_size, 4096);  // n_embd
  EXPECT_EQ(c.heads_q, 16);        // n_head
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.max_position_embeddings, 2048);  // n_positions
  EXPECT_EQ(c.rope.rotary_dim, 64);
  EXPECT_EQ(c.rope.style, RopeStyle::kInterleaved);
  EXPECT_EQ(c.rope.base, 10000.0);
}

TEST(ModelConfig, GemmaExplicitHeadDim) {
  const ModelConfig c = load("gemma-7b.json");
  EXPECT_EQ(c.hidden_size, 3072);
  EXPECT_EQ(c.heads_q, 16);
  EXPECT_EQ(c.head_dim, 256);  // not 3072 / 16
  EXPECT_EQ(c.rope.rotary_dim, 256);
  EXPECT_EQ(c.max_position_embeddings, 8192);
}

// Gemma 2 soft-caps its attention logits (attn_logit_softcapping, default 50); Gemma 3 only when
// the key is set; other families ignore the key, as their code does.
TEST(ModelConfig, Gemma2Softcap) {
  const ModelConfig c = load("gemma-2-2b.json");
  ASSERT_EQ(c.layers.size(), 26u);
  for (const ModelLayer& l : c.layers) {
    ASSERT_TRUE(l.softcap.has_value());
    EXPECT_EQ(*l.softcap, 50.0);
  }
  EXPECT_EQ(c.layers[0].sliding_window, 4096);
  EXPECT_FALSE(c.layers[1].sliding_window.has_value());
  const std::string base = R"({"model_type": "gemma2", "hidden_size": 64, "num_attention_heads": 2,
                               "head_dim": 32, "num_hidden_layers": 2, "num_key_value_heads": 1)";
  const ModelConfig d = parse_model_config(base + "}", "cfg.json");
  EXPECT_EQ(d.layers[0].softcap, 50.0);  // the class default
  const ModelConfig n =
      parse_model_config(base + R"(, "attn_logit_softcapping": null})", "cfg.json");
  EXPECT_FALSE(n.layers[0].softcap.has_value());
  const ModelConfig e = parse_model_config(base + R"(, "attn_logit_softcapping": 20})", "cfg.json");
  EXPECT_EQ(e.layers[1].softcap, 20.0);
  EXPECT_THROW(parse_model_config(base + R"(, "attn_logit_softcapping": -1})", "cfg.json"),
               IoError);
  EXPECT_FALSE(load("gemma-3-1b-it.json").layers[0].softcap.has_value());  // null
  const ModelConfig l = parse_model_config(
      R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 2,
          "attn_logit_softcapping": 30})",
      "cfg.json");
  EXPECT_FALSE(l.layers[0].softcap.has_value());
  // The layer's options carry it into attention.
  BuiltScheme b =
      build_scheme({.scheme = "rope", .layer = 1}, {}, &c,
                   SchemeDims{.heads_q = 8, .heads_kv = 4, .head_dim = 256, .seq_len = 16});
  EXPECT_EQ(b.options({}).softcap, 50.0);
  EXPECT_EQ(b.options({.softcap = 7.0}).softcap, 7.0);
}

TEST(ModelConfig, Qwen2VlSectionedMRope) {
  const ModelConfig c = load("qwen2-vl-7b.json");
  EXPECT_EQ(c.model_type, "qwen2_vl");
  EXPECT_EQ(c.heads_q, 28);
  EXPECT_EQ(c.heads_kv, 4);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.rope.base, 1e6);
  EXPECT_EQ(c.rope.scaling.type, RopeScalingType::kDefault);  // "mrope" = default + M-RoPE
  ASSERT_TRUE(c.mrope.has_value());
  EXPECT_EQ(c.mrope->layout, MRopeLayout::kSectioned);
  EXPECT_EQ(c.mrope->sections, (std::array<int64_t, 3>{16, 24, 24}));
  EXPECT_EQ(c.effective_context(), 32768);
}

TEST(ModelConfig, Qwen3VlInterleavedMRopeFromTextConfig) {
  const ModelConfig c = load("qwen3-vl-8b.json");
  EXPECT_EQ(c.model_type, "qwen3_vl");
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.heads_q, 32);
  EXPECT_EQ(c.heads_kv, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.max_position_embeddings, 262144);
  EXPECT_EQ(c.rope.base, 5e6);
  ASSERT_TRUE(c.mrope.has_value());
  EXPECT_EQ(c.mrope->layout, MRopeLayout::kInterleaved);
  EXPECT_EQ(c.mrope->sections, (std::array<int64_t, 3>{24, 20, 20}));
}

TEST(ModelConfig, LinearAndDynamicExamples) {
  const ModelConfig lin = load("llama-2-7b-linear-4x.json");
  EXPECT_EQ(lin.rope.scaling.type, RopeScalingType::kLinear);
  EXPECT_EQ(lin.rope.scaling.factor, 4.0);
  EXPECT_EQ(lin.effective_context(), 16384);
  const RopeFrequencies f = model_rope_frequencies(lin);
  EXPECT_EQ(f.inv_freq[0], 0.25);

  const ModelConfig dyn = load("llama-2-7b-dynamic-2x.json");
  EXPECT_EQ(dyn.rope.scaling.type, RopeScalingType::kDynamic);
  EXPECT_EQ(dyn.rope.scaling.factor, 2.0);
  // No original_max_position_embeddings: HF's fallback, max_position_embeddings.
  EXPECT_EQ(dyn.rope.scaling.original_max_position_embeddings, 4096);
  EXPECT_EQ(dyn.effective_context(), 8192);
  // seq_len is used as given: 0 and 4096 are "short" (unscaled), 8192 grows the base.
  const auto f0 = model_rope_frequencies(dyn, 0);
  const auto f4k = model_rope_frequencies(dyn, 4096);
  const auto f8k = model_rope_frequencies(dyn, 8192);
  EXPECT_EQ(f0.inv_freq, f4k.inv_freq);
  EXPECT_NEAR(f0.inv_freq[1], std::pow(10000.0, -2.0 / 128.0), 1e-16);
  const double theta = 10000.0 * std::pow(2.0 * 8192 / 4096 - 1.0, 128.0 / 126.0);
  EXPECT_NEAR(f8k.inv_freq[1], std::pow(theta, -2.0 / 128.0), 1e-16);
}

TEST(ModelConfig, Alibi) {
  const ModelConfig bloom = load("bloom-560m.json");
  EXPECT_EQ(bloom.scheme, ModelScheme::kAlibi);
  EXPECT_EQ(bloom.alibi.heads, 16);
  EXPECT_EQ(bloom.alibi.max_bias, 8.0);
  EXPECT_EQ(bloom.hidden_size, 1024);
  EXPECT_EQ(bloom.head_dim, 64);
  EXPECT_EQ(bloom.max_position_embeddings, 0);
  EXPECT_EQ(bloom.effective_context(), 0);

  const ModelConfig mpt = load("mpt-7b.json");
  EXPECT_EQ(mpt.scheme, ModelScheme::kAlibi);
  EXPECT_EQ(mpt.alibi.heads, 32);
  EXPECT_EQ(mpt.alibi.max_bias, 8.0);
  EXPECT_EQ(mpt.hidden_size, 4096);
  EXPECT_EQ(mpt.head_dim, 128);
  EXPECT_EQ(mpt.heads_kv, 32);
  EXPECT_EQ(mpt.max_position_embeddings, 2048);  // max_seq_len

  const ModelConfig falcon = load("falcon-rw-1b.json");
  EXPECT_EQ(falcon.scheme, ModelScheme::kAlibi);
  EXPECT_EQ(falcon.alibi.heads, 32);
  EXPECT_EQ(falcon.head_dim, 64);
  EXPECT_EQ(falcon.heads_kv, 32);  // multi_query false
}

TEST(ModelConfig, T5) {
  const ModelConfig c = load("t5-base.json");
  EXPECT_EQ(c.scheme, ModelScheme::kT5);
  EXPECT_EQ(c.hidden_size, 768);
  EXPECT_EQ(c.heads_q, 12);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.t5.num_buckets, 32);
  EXPECT_EQ(c.t5.max_distance, 128);
  EXPECT_TRUE(c.t5.bidirectional);
  // Defaults when the keys are absent (older T5 configs lack the max distance).
  const ModelConfig d = parse_model_config(
      R"({"model_type": "mt5", "d_model": 512, "d_kv": 64, "num_heads": 6})", "mt5");
  EXPECT_EQ(d.t5.num_buckets, 32);
  EXPECT_EQ(d.t5.max_distance, 128);
  EXPECT_EQ(d.head_dim, 64);
}

TEST(ModelConfig, DebertaV3) {
  const ModelConfig c = load("deberta-v3-base.json");
  EXPECT_EQ(c.scheme, ModelScheme::kDeberta);
  EXPECT_EQ(c.model_type, "deberta-v2");
  EXPECT_EQ(c.heads_q, 12);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.deberta.position_buckets, 256);
  EXPECT_EQ(c.deberta.max_relative_positions, 512);  // -1: max_position_embeddings
  EXPECT_EQ(c.deberta.span(), 256);
  EXPECT_EQ(c.pos_att_type, (std::vector<std::string>{"p2c", "c2p"}));  // "p2c|c2p"
  // DeBERTa v1: a list, no buckets.
  const ModelConfig v1 = parse_model_config(R"({"model_type": "deberta", "hidden_size": 768,
      "num_attention_heads": 12, "max_position_embeddings": 512, "relative_attention": true,
      "max_relative_positions": -1, "pos_att_type": ["c2p", "p2c"]})",
                                            "v1");
  EXPECT_EQ(v1.deberta.position_buckets, 0);
  EXPECT_EQ(v1.deberta.span(), 512);
  EXPECT_EQ(v1.pos_att_type, (std::vector<std::string>{"c2p", "p2c"}));
}

TEST(ModelConfig, Learned) {
  const ModelConfig gpt2 = load("gpt2.json");
  EXPECT_EQ(gpt2.scheme, ModelScheme::kLearned);
  EXPECT_EQ(gpt2.max_position_embeddings, 1024);
  EXPECT_EQ(gpt2.heads_q, 12);
  EXPECT_EQ(gpt2.head_dim, 64);
  const ModelConfig bert = load("bert-base-uncased.json");
  EXPECT_EQ(bert.scheme, ModelScheme::kLearned);
  EXPECT_EQ(bert.max_position_embeddings, 512);
  EXPECT_EQ(bert.effective_context(), 512);
}

TEST(ModelConfig, Describe) {
  const std::string llama = describe(load("llama-3.1-8b.json"));
  for (const char* s :
       {"llama", "rope", "32 q / 8 kv", "head_dim: 128", "128 of 128", "half", "500000", "llama3",
        "factor 8", "original_max_position_embeddings 8192", "low_freq_factor 1",
        "high_freq_factor 4", "attention_factor: 1", "effective_context: 131072"}) {
    EXPECT_TRUE(contains(llama, s)) << "missing '" << s << "' in:\n" << llama;
  }
  const std::string phi = describe(load("phi-3-mini-128k-like.json"));
  for (const char* s : {"longrope", "48 values", "attention_factor: 1.1902", "131072", "4096"}) {
    EXPECT_TRUE(contains(phi, s)) << "missing '" << s << "' in:\n" << phi;
  }
  const std::string gptj = describe(load("gpt-j-6b.json"));
  EXPECT_TRUE(contains(gptj, "64 of 256, style interleaved")) << gptj;
  const std::string vl = describe(load("qwen2-vl-7b.json"));
  EXPECT_TRUE(contains(vl, "sectioned, sections [16, 24, 24]")) << vl;
  const std::string bloom = describe(load("bloom-560m.json"));
  EXPECT_TRUE(contains(bloom, "16 heads, max_bias 8, slopes 0.7071067812 .. 0.00390625")) << bloom;
  const std::string t5 = describe(load("t5-base.json"));
  EXPECT_TRUE(contains(t5, "num_buckets 32, max_distance 128")) << t5;
  const std::string deb = describe(load("deberta-v3-base.json"));
  EXPECT_TRUE(contains(deb, "span 256")) << deb;
  EXPECT_TRUE(contains(deb, "p2c|c2p")) << deb;
  const std::string gpt2 = describe(load("gpt2.json"));
  EXPECT_TRUE(contains(gpt2, "learned")) << gpt2;
  EXPECT_TRUE(contains(gpt2, "1024")) << gpt2;
}

TEST(ModelConfig, Names) {
  EXPECT_STREQ(style_name(RopeStyle::kHalf), "half");
  EXPECT_STREQ(style_name(RopeStyle::kInterleaved), "interleaved");
  EXPECT_STREQ(scaling_name(RopeScalingType::kDefault), "default");
  EXPECT_STREQ(scaling_name(RopeScalingType::kLinear), "linear");
  EXPECT_STREQ(scaling_name(RopeScalingType::kDynamic), "dynamic");
  EXPECT_STREQ(scaling_name(RopeScalingType::kYarn), "yarn");
  EXPECT_STREQ(scaling_name(RopeScalingType::kLlama3), "llama3");
  EXPECT_STREQ(scaling_name(RopeScalingType::kLongRope), "longrope");
}

// ---------------------------------------------------------------------------------------------
// Accepted variants.

TEST(ModelConfig, AcceptedVariants) {
  // rope_parameters (newer HF) with rope_theta inside; an integral float for a count.
  ModelConfig c = parse_model_config(R"({"model_type": "llama", "hidden_size": 256,
      "num_attention_heads": 4.0, "max_position_embeddings": 1024,
      "rope_parameters": {"rope_type": "linear", "factor": 2, "rope_theta": 20000.0}})",
                                     "v5");
  EXPECT_EQ(c.heads_q, 4);
  EXPECT_EQ(c.rope.base, 20000.0);
  EXPECT_EQ(c.rope.scaling.type, RopeScalingType::kLinear);
  EXPECT_EQ(c.rope.scaling.factor, 2.0);
  // Both dicts, agreeing (type / rope_type aliases too); the same theta at the top level.
  c = parse_model_config(R"({"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4,
      "max_position_embeddings": 512,
      "rope_theta": 20000, "rope_scaling": {"type": "dynamic", "factor": 2.0},
      "rope_parameters": {"rope_type": "dynamic", "factor": 2, "rope_theta": 20000,
                          "original_max_position_embeddings": 512}})",
                         "both");
  EXPECT_EQ(c.rope.scaling.type, RopeScalingType::kDynamic);
  EXPECT_EQ(c.rope.scaling.original_max_position_embeddings, 512);
  EXPECT_EQ(c.effective_context(), 1024);
  // Legacy "su" = longrope; "mrope" and "default" name the same kind.
  c = parse_model_config(R"({"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4,
      "max_position_embeddings": 8192, "original_max_position_embeddings": 1024,
      "rope_scaling": {"type": "su", "short_factor": [1, 1, 1, 1, 1, 1, 1, 1],
                       "long_factor": [1, 2, 3, 4, 5, 6, 7, 8]}})",
                         "su");
  EXPECT_EQ(c.rope.scaling.type, RopeScalingType::kLongRope);
  EXPECT_EQ(c.rope.scaling.long_factor.back(), 8.0);
  c = parse_model_config(R"({"model_type": "qwen2_5_vl", "hidden_size": 3584,
      "num_attention_heads": 28, "num_key_value_heads": 4, "rope_theta": 1000000.0,
      "rope_scaling": {"type": "mrope", "rope_type": "default", "mrope_section": [16, 24, 24]}})",
                         "qwen2.5-vl");
  ASSERT_TRUE(c.mrope.has_value());
  EXPECT_EQ(c.mrope->layout, MRopeLayout::kSectioned);
  // Qwen2.5-VL's long-context recipe: yarn together with mrope_section.
  c = parse_model_config(R"({"model_type": "qwen2_5_vl", "hidden_size": 3584,
      "num_attention_heads": 28, "num_key_value_heads": 4, "rope_theta": 1000000.0,
      "max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4,
      "original_max_position_embeddings": 32768, "mrope_section": [16, 24, 24]}})",
                         "qwen2.5-vl-yarn");
  EXPECT_EQ(c.rope.scaling.type, RopeScalingType::kYarn);
  ASSERT_TRUE(c.mrope.has_value());
  EXPECT_EQ(c.mrope->sections, (std::array<int64_t, 3>{16, 24, 24}));
  EXPECT_EQ(c.effective_context(), 131072);
  // Falcon without alibi: RoPE; multi_query (HF default true) gives one kv head.
  c = parse_model_config(R"({"model_type": "falcon", "hidden_size": 4544,
      "num_attention_heads": 71, "alibi": false, "multi_query": true, "rope_theta": 10000})",
                         "falcon-7b");
  EXPECT_EQ(c.scheme, ModelScheme::kRope);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.heads_kv, 1);
  // Falcon new decoder architecture: num_kv_heads.
  c = parse_model_config(R"({"model_type": "falcon", "hidden_size": 8192,
      "num_attention_heads": 128, "new_decoder_architecture": true, "num_kv_heads": 8})",
                         "falcon-40b");
  EXPECT_EQ(c.heads_kv, 8);
  // Yarn with DeepSeek-style mscale: af = mscale(f, m) / mscale(f, m_all) = 1 when equal.
  c = parse_model_config(R"({"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4,
      "max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn", "factor": 40,
      "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0,
      "beta_fast": 32, "beta_slow": 1}})",
                         "yarn-mscale");
  EXPECT_EQ(c.rope.scaling.mscale, 1.0);
  EXPECT_EQ(model_rope_frequencies(c, 1).attention_factor, 1.0);
  EXPECT_EQ(c.effective_context(), 163840);
}

TEST(ModelConfig, ReadModelConfigErrors) {
  try {
    (void)read_model_config(config_path("does-not-exist.json"));
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_TRUE(contains(e.what(), "does-not-exist.json")) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Malformed configs: each an IoError naming the source and the key.

constexpr const char* kLlamaHead =
    R"("model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, )"
    R"("max_position_embeddings": 2048)";

std::string llama_with(const std::string& extra) {
  return std::string("{") + kLlamaHead + (extra.empty() ? "" : ", " + extra) + "}";
}

TEST(ModelConfigErrors, JsonAndTopLevel) {
  expect_error(R"({"model_type": "llama",)", {"invalid JSON", "line 1"});
  expect_error("{\"model_type\": \"llama\",\n \"hidden_size\": 12x}", {"invalid JSON", "line 2"});
  expect_error("[1, 2]", {"top level must be a JSON object"});
  expect_error(R"({"hidden_size": 64})", {"model_type"});
  expect_error(R"({"model_type": 7})", {"model_type must be a string (got 7)"});
  expect_error(R"({"model_type": "foo"})", {"model_type 'foo'", "supported", "llama", "bloom"});
}

TEST(ModelConfigErrors, Dimensions) {
  // Absent dimensions take LlamaConfig's defaults (32 heads, hidden 4096); a division that is
  // not exact is still an error.
  EXPECT_EQ(parse_model_config(R"({"model_type": "llama", "hidden_size": 256})", "x").heads_q, 32);
  EXPECT_EQ(
      parse_model_config(R"({"model_type": "llama", "num_attention_heads": 4})", "x").head_dim,
      1024);
  expect_error(R"({"model_type": "llama", "hidden_size": 100})",
               {"hidden_size (100) is not divisible by num_attention_heads (32)"});
  expect_error(R"({"model_type": "llama", "hidden_size": 100, "num_attention_heads": 3})",
               {"hidden_size (100) is not divisible by num_attention_heads (3)"});
  expect_error(llama_with(R"("num_key_value_heads": 3)"),
               {"num_key_value_heads (3) must divide the query heads (4)"});
  expect_error(llama_with(R"("num_key_value_heads": 0)"),
               {"num_key_value_heads must be an integer in [1, 16777216] (got 0)"});
  expect_error(R"({"model_type": "llama", "hidden_size": 1099511627776, "num_attention_heads": 4})",
               {"hidden_size must be an integer in [1, 16777216]"});
  expect_error(R"({"model_type": "llama", "hidden_size": 256, "num_attention_heads": true})",
               {"num_attention_heads must be an integer (got true)"});
  expect_error(R"({"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4.5})",
               {"num_attention_heads must be an integer (got 4.5)"});
  expect_error(
      R"({"model_type": "bloom", "hidden_size": 256, "n_head": 4, "num_attention_heads": 8})",
      {"num_attention_heads", "n_head", "contradicts"});
  // T5Config's d_kv default (64) fills an absent d_kv.
  EXPECT_EQ(
      parse_model_config(R"({"model_type": "t5", "d_model": 512, "num_heads": 8})", "x").head_dim,
      64);
  expect_error(R"({"model_type": "t5", "d_model": 512, "num_heads": 8, "d_kv": 0})", {"d_kv"});
}

TEST(ModelConfigErrors, ThetaAndRotaryDim) {
  expect_error(llama_with(R"("rope_theta": 10000, "rotary_emb_base": 20000)"),
               {"rotary_emb_base (20000) contradicts rope_theta (10000)"});
  expect_error(llama_with(R"("rope_theta": "1e4")"), {"rope_theta must be a number > 1"});
  expect_error(llama_with(R"("rope_theta": 0.5)"), {"rope_theta must be a number > 1 (got 0.5)"});
  expect_error(llama_with(R"("rope_theta": 10000,
      "rope_parameters": {"rope_type": "default", "rope_theta": 500000})"),
               {"rope_parameters.rope_theta (500000) contradicts rope_theta (10000)"});
  // D = 56 / 4 = 14, int(14 x 0.5) = 7.
  expect_error(R"({"model_type": "phi", "hidden_size": 56, "num_attention_heads": 4,
      "partial_rotary_factor": 0.5})",
               {"rotary dim 7", "partial_rotary_factor", "odd"});
  expect_error(R"({"model_type": "phi", "hidden_size": 256, "num_attention_heads": 4,
      "partial_rotary_factor": 1.5})",
               {"partial_rotary_factor must be a number in (0, 1] (got 1.5)"});
  expect_error(R"({"model_type": "gpt_neox", "hidden_size": 256, "num_attention_heads": 4,
      "rotary_pct": 0.25, "partial_rotary_factor": 0.5})",
               {"rotary dim 16", "rotary dim 32", "rotary_pct", "partial_rotary_factor"});
  expect_error(R"({"model_type": "gptj", "n_embd": 256, "n_head": 4, "rotary_dim": 128})",
               {"rotary_dim (128) exceeds the head dim (64)"});
  expect_error(R"({"model_type": "gptj", "n_embd": 256, "n_head": 4, "rotary_dim": 33})",
               {"rotary dim 33", "rotary_dim", "odd"});
}

TEST(ModelConfigErrors, Scaling) {
  expect_error(llama_with(R"("rope_scaling": {"rope_type": "linear", "factor": "8"})"),
               {R"(rope_scaling.factor must be a number > 0 (got "8"))"});
  expect_error(llama_with(R"("rope_scaling": {"rope_type": "linear", "factor": -2})"),
               {"rope_scaling.factor must be a number > 0 (got -2)"});
  expect_error(llama_with(R"("rope_scaling": {"rope_type": "linear", "factor": 0})"),
               {"rope_scaling.factor must be a number > 0 (got 0)"});
  expect_error(llama_with(R"("rope_scaling": {"rope_type": "linear"})"),
               {"rope_scaling.factor is required", "linear"});
  expect_error(llama_with(R"("rope_scaling": {"rope_type": "linear", "factr": 2})"),
               {"rope_scaling: unknown key 'factr' for rope_type 'linear'"});
  expect_error(llama_with(R"("rope_scaling": {"rope_type": "yarn", "factor": 2,
      "low_freq_factor": 1})"),
               {"unknown key 'low_freq_factor' for rope_type 'yarn'"});
  expect_error(llama_with(R"("rope_scaling": {"rope_type": "linear", "factor": 2,
      "mrope_section": [16, 24, 24]})"),
               {"unknown key 'mrope_section' for rope_type 'linear'"});
  expect_error(llama_with(R"("rope_scaling": {"rope_type": "cubic", "factor": 2})"),
               {"rope_scaling.rope_type: unknown rope_type 'cubic'"});
  expect_error(llama_with(R"("rope_scaling": {"rope_type": 3, "factor": 2})"),
               {"rope_scaling.rope_type must be a string"});
  expect_error(llama_with(R"("rope_scaling": {"factor": 2})"), {"rope_scaling needs 'rope_type'"});
  expect_error(llama_with(R"("rope_scaling": {"rope_type": "dynamic", "type": "linear",
      "factor": 2})"),
               {"rope_scaling: type 'linear' contradicts rope_type 'dynamic'"});
  expect_error(llama_with(R"("rope_scaling": "linear")"),
               {R"(rope_scaling must be an object (got "linear"))"});
  expect_error(llama_with(R"("rope_scaling": {"rope_type": "linear", "factor": 2},
      "rope_parameters": {"rope_type": "linear", "factor": 4})"),
               {"rope_scaling and rope_parameters disagree on 'factor' (2 vs 4)"});
  expect_error(llama_with(R"("rope_scaling": {"rope_type": "linear", "factor": 2},
      "rope_parameters": {"rope_type": "dynamic", "factor": 2})"),
               {"rope_scaling and rope_parameters disagree on 'rope_type'"});
  expect_error(llama_with(R"("rope_scaling": {"rope_type": "yarn", "factor": 4,
      "truncate": "yes"})"),
               {"rope_scaling.truncate must be true or false"});
  expect_error(llama_with(R"("rope_scaling": {"rope_type": "yarn", "factor": 4,
      "beta_fast": -1})"),
               {"rope_scaling.beta_fast must be a number > 0 (got -1)"});
  expect_error(llama_with(R"("original_max_position_embeddings": 1024,
      "rope_scaling": {"rope_type": "yarn", "factor": 4,
                       "original_max_position_embeddings": 512})"),
               {"original_max_position_embeddings (1024) contradicts",
                "rope_scaling.original_max_position_embeddings (512)"});
}

TEST(ModelConfigErrors, Llama3AndLongRope) {
  // Without an original length the configuration class standardises it to
  // max_position_embeddings; with neither it is an error.
  EXPECT_EQ(parse_model_config(llama_with(R"("rope_scaling": {"rope_type": "llama3", "factor": 8,
      "low_freq_factor": 1, "high_freq_factor": 4})"),
                               "x")
                .rope.scaling.original_max_position_embeddings,
            2048);
  expect_error(llama_with(R"("rope_scaling": {"rope_type": "llama3", "factor": 8,
      "original_max_position_embeddings": 8192, "low_freq_factor": 4, "high_freq_factor": 1})"),
               {"high_freq_factor (1) must exceed low_freq_factor (4)"});
  // D = 16: longrope lists need 8 entries.
  const std::string head = R"({"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4,
      "max_position_embeddings": 8192, "original_max_position_embeddings": 1024, )";
  expect_error(head + R"("rope_scaling": {"type": "longrope",
      "short_factor": [1, 1, 1, 1, 1, 1, 1], "long_factor": [1, 1, 1, 1, 1, 1, 1, 1]}})",
               {"rope_scaling.short_factor must have rotary_dim / 2 = 8 entries (got 7)"});
  expect_error(head + R"("rope_scaling": {"type": "longrope",
      "short_factor": [1, 1, 1, 1, 1, 1, 1, 1], "long_factor": [1, 1, 1, 1, 1, 1, 1, 1, 1]}})",
               {"rope_scaling.long_factor must have rotary_dim / 2 = 8 entries (got 9)"});
  expect_error(head + R"("rope_scaling": {"type": "longrope",
      "short_factor": [1, 1, 1, 1, 1, 1, 1, 1], "long_factor": [1, 1, 1, 1, 1, 1, 1, -1]}})",
               {"rope_scaling.long_factor[7] must be a number > 0 (got -1)"});
  expect_error(head + R"("rope_scaling": {"type": "longrope",
      "short_factor": [1, 1, 1, 1, 1, 1, 1, 1]}})",
               {"rope_scaling.long_factor is required"});
  // Phi3Config's original_max_position_embeddings default (4096) fills an absent one; a llama
  // without any length is an error.
  const ModelConfig phi3 = parse_model_config(R"({"model_type": "phi3", "hidden_size": 64,
      "num_attention_heads": 4, "rope_scaling": {"type": "longrope",
      "short_factor": [1, 1, 1, 1, 1, 1, 1, 1], "long_factor": [1, 1, 1, 1, 1, 1, 1, 1]}})",
                                              "x");
  EXPECT_EQ(phi3.rope.scaling.original_max_position_embeddings, 4096);
  EXPECT_EQ(phi3.max_position_embeddings, 4096);
}

TEST(ModelConfigErrors, MRope) {
  expect_error(R"({"model_type": "qwen2_vl", "hidden_size": 3584, "num_attention_heads": 28,
      "num_key_value_heads": 4,
      "rope_scaling": {"type": "mrope", "mrope_section": [16, 24]}})",
               {"rope_scaling.mrope_section must be a list of 3 integers in [0, rotary_dim / 2]"});
  expect_error(R"({"model_type": "qwen2_vl", "hidden_size": 3584, "num_attention_heads": 28,
      "num_key_value_heads": 4,
      "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 20]}})",
               {"rope_scaling.mrope_section: mrope", "add up to rotary_dim / 2 = 64"});
  expect_error(R"({"model_type": "qwen2_vl", "hidden_size": 3584, "num_attention_heads": 28,
      "num_key_value_heads": 4})",
               {"mrope_section is required", "qwen2_vl"});
  expect_error(R"({"model_type": "qwen3_vl", "text_config": {"hidden_size": 4096,
      "num_attention_heads": 32, "head_dim": 128,
      "rope_scaling": {"rope_type": "default", "mrope_interleaved": false}}})",
               {"text_config.rope_scaling.mrope_interleaved is false"});
  expect_error(R"({"model_type": "qwen3_vl", "text_config": 5})",
               {"text_config must be an object"});
}

TEST(ModelConfigErrors, OtherSchemes) {
  expect_error(R"({"model_type": "mpt", "d_model": 4096, "n_heads": 32,
      "attn_config": {"alibi": false}})",
               {"attn_config.alibi is false", "mpt without alibi is not supported"});
  expect_error(R"({"model_type": "mpt", "d_model": 4096, "n_heads": 32, "attn_config": {}})",
               {"attn_config.alibi is absent", "mpt without alibi is not supported"});
  expect_error(R"({"model_type": "mpt", "d_model": 4096, "n_heads": 32,
      "attn_config": {"alibi": true, "alibi_bias_max": 0}})",
               {"attn_config.alibi_bias_max must be a number > 0 (got 0)"});
  expect_error(R"({"model_type": "falcon", "hidden_size": 2048, "num_attention_heads": 32,
      "alibi": "yes"})",
               {"alibi must be true or false"});
  expect_error(R"({"model_type": "deberta-v2", "hidden_size": 768, "num_attention_heads": 12,
      "max_position_embeddings": 512, "relative_attention": false})",
               {"relative_attention is false"});
  expect_error(R"({"model_type": "deberta-v2", "hidden_size": 768, "num_attention_heads": 12,
      "max_position_embeddings": 512, "relative_attention": true, "pos_att_type": "p2c|x2y"})",
               {"pos_att_type", "unknown attention type 'x2y'"});
  expect_error(R"({"model_type": "deberta-v2", "hidden_size": 768, "num_attention_heads": 12,
      "max_position_embeddings": 512, "relative_attention": true, "pos_att_type": 5})",
               {"pos_att_type must be a list of strings"});
  expect_error(R"({"model_type": "deberta-v2", "hidden_size": 768, "num_attention_heads": 12,
      "max_position_embeddings": 512, "relative_attention": true, "position_buckets": 2})",
               {"position_buckets must be 0 or >= 4"});
  expect_error(R"({"model_type": "t5", "d_model": 512, "d_kv": 64, "num_heads": 8,
      "relative_attention_num_buckets": 31})",
               {"num_buckets must be even"});
  expect_error(R"({"model_type": "bert", "hidden_size": 768, "num_attention_heads": 12,
      "max_position_embeddings": 512, "position_embedding_type": "relative_key"})",
               {"position_embedding_type 'relative_key' is not supported"});
  // GPT2Config's n_positions default (1024) sizes an absent table.
  EXPECT_EQ(parse_model_config(R"({"model_type": "gpt2", "n_embd": 768, "n_head": 12})", "x")
                .max_position_embeddings,
            1024);
  expect_error(R"({"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_positions": 0})",
               {"n_positions"});
}

// ---------------------------------------------------------------------------------------------
// Defaults of each model type's configuration class (issue 12 item 1).

// The value of `key` in cfg.defaults, or "" when it was not defaulted.
std::string defaulted(const ModelConfig& c, const std::string& key) {
  for (const auto& [k, v] : c.defaults) {
    if (k == key) return v;
  }
  return "";
}

TEST(ModelConfigDefaults, PartialRotaryFromTheClass) {
  // GPTNeoXConfig rotary_pct 0.25, PhiConfig partial_rotary_factor 0.5, StableLmConfig 0.25.
  const ModelConfig neox = parse_model_config(
      R"({"model_type": "gpt_neox", "hidden_size": 6144, "num_attention_heads": 64})", "x");
  EXPECT_EQ(neox.rope.rotary_dim, 24);
  EXPECT_EQ(defaulted(neox, "rotary_pct"), "0.25");
  const ModelConfig phi = parse_model_config(
      R"({"model_type": "phi", "hidden_size": 2560, "num_attention_heads": 32})", "x");
  EXPECT_EQ(phi.rope.rotary_dim, 40);
  EXPECT_EQ(defaulted(phi, "partial_rotary_factor"), "0.5");
  const ModelConfig st = parse_model_config(
      R"({"model_type": "stablelm", "hidden_size": 2560, "num_attention_heads": 32})", "x");
  EXPECT_EQ(st.rope.rotary_dim, 20);
  // An explicit value wins and is not marked.
  const ModelConfig full = parse_model_config(
      R"({"model_type": "phi", "hidden_size": 2560, "num_attention_heads": 32,
          "partial_rotary_factor": 1.0})",
      "x");
  EXPECT_EQ(full.rope.rotary_dim, 80);
  EXPECT_EQ(defaulted(full, "partial_rotary_factor"), "");
  // The frequencies follow: R = 24 means 12 pairs with theta^(-2i/24).
  const RopeFrequencies f = model_rope_frequencies(neox);
  ASSERT_EQ(f.inv_freq.size(), 12u);
  EXPECT_DOUBLE_EQ(f.inv_freq[1], std::pow(1e4, -2.0 / 24.0));
}

TEST(ModelConfigDefaults, HeadDimThetaAndKvHeads) {
  // Qwen3Config head_dim 128 (not 4096 / 64), Gemma / Gemma2 256, Qwen2-VL theta 1e6.
  const ModelConfig q3 = parse_model_config(
      R"({"model_type": "qwen3", "hidden_size": 4096, "num_attention_heads": 64})", "x");
  EXPECT_EQ(q3.head_dim, 128);
  EXPECT_EQ(defaulted(q3, "head_dim"), "128");
  EXPECT_EQ(q3.heads_kv, 32);  // Qwen3Config num_key_value_heads 32
  for (const char* t : {"gemma", "gemma2"}) {
    const ModelConfig g = parse_model_config(
        std::string(R"({"model_type": ")") + t +
            R"(", "hidden_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 16})",
        "x");
    EXPECT_EQ(g.head_dim, 256) << t;
  }
  const ModelConfig vl = parse_model_config(
      R"({"model_type": "qwen2_vl", "hidden_size": 3584, "num_attention_heads": 28,
          "num_key_value_heads": 4, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}})",
      "x");
  EXPECT_EQ(vl.rope.base, 1e6);
  EXPECT_EQ(defaulted(vl, "rope_theta"), "1000000");
  // null is the class's None, not its default: head_dim null = hidden / heads, kv null = heads,
  // sliding_window null = none.
  const ModelConfig qn = parse_model_config(
      R"({"model_type": "qwen3", "hidden_size": 4096, "num_attention_heads": 64,
          "head_dim": null, "num_key_value_heads": null})",
      "x");
  EXPECT_EQ(qn.head_dim, 64);
  EXPECT_EQ(qn.heads_kv, 64);
  const ModelConfig mi = parse_model_config(
      R"({"model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32})", "x");
  EXPECT_EQ(mi.heads_kv, 8);  // MistralConfig num_key_value_heads 8
  EXPECT_EQ(mi.sliding_window, 4096);
  EXPECT_EQ(mi.max_position_embeddings, 131072);
  const ModelConfig mn = parse_model_config(
      R"({"model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32,
          "sliding_window": null})",
      "x");
  EXPECT_FALSE(mn.sliding_window.has_value());
  // Mixtral's theta default is 1e6, Llama's 1e4.
  EXPECT_EQ(parse_model_config(R"({"model_type": "mixtral"})", "x").rope.base, 1e6);
  EXPECT_EQ(parse_model_config(R"({"model_type": "llama"})", "x").rope.base, 1e4);
}

TEST(ModelConfigDefaults, DescribeMarksDefaults) {
  const ModelConfig g = load("gemma-3-4b-it.json");
  EXPECT_EQ(g.default_source, "Gemma3TextConfig");
  const std::string d = describe(g);
  for (const char* s : {"defaults: (Gemma3TextConfig", "head_dim 256", "num_attention_heads 8",
                        "rope_local_base_freq 10000", "sliding_window_pattern 6"}) {
    EXPECT_TRUE(contains(d, s)) << "missing '" << s << "' in:\n" << d;
  }
  // A config that states everything has no defaults line for those keys.
  EXPECT_EQ(defaulted(load("llama-3.1-8b.json"), "rope_theta"), "");
}

// ---------------------------------------------------------------------------------------------
// New families and per-layer descriptions (issue 12 item 3).

TEST(ModelConfigLayers, DeepseekV3) {
  const ModelConfig c = load("deepseek-v3.json");
  EXPECT_EQ(c.model_type, "deepseek_v3");
  EXPECT_EQ(c.head_dim, 192);  // qk_nope_head_dim 128 + qk_rope_head_dim 64
  EXPECT_EQ(c.rope_offset, 128);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.rope.head_dim, 64);
  EXPECT_EQ(c.rope.rotary_dim, 64);
  EXPECT_EQ(c.rope.style, RopeStyle::kInterleaved);
  EXPECT_TRUE(c.rope_deinterleave);
  EXPECT_EQ(c.rope.scaling.type, RopeScalingType::kYarn);
  EXPECT_EQ(c.rope.scaling.factor, 40.0);
  EXPECT_EQ(c.rope.scaling.mscale, 1.0);
  EXPECT_EQ(c.rope.scaling.mscale_all_dim, 1.0);
  ASSERT_EQ(c.layers.size(), 61u);
  EXPECT_FALSE(c.layers_differ());
  // mscale / mscale_all_dim = 1 on cos / sin; the softmax scale carries mscale(40, 1)^2.
  EXPECT_DOUBLE_EQ(model_rope_frequencies(c).attention_factor, 1.0);
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(c.layers[0].softmax_scale, m * m / std::sqrt(192.0), 1e-15);
  // rope_interleave: false gives the half style without the permutation.
  const ModelConfig h =
      parse_model_config(R"({"model_type": "deepseek_v3", "rope_interleave": false})", "x");
  EXPECT_EQ(h.rope.style, RopeStyle::kHalf);
  EXPECT_FALSE(h.rope_deinterleave);
  EXPECT_NEAR(h.layers[0].softmax_scale, 1.0 / std::sqrt(192.0), 1e-15);  // no scaling
  // The class's head_dim is qk_rope_head_dim: another value contradicts it.
  expect_error(R"({"model_type": "deepseek_v3", "head_dim": 128})",
               {"head_dim (128) contradicts qk_rope_head_dim (64)"});
}

TEST(ModelConfigLayers, DeepseekV2Lite) {
  const ModelConfig c = load("deepseek-v2-lite.json");
  EXPECT_EQ(c.rope.style, RopeStyle::kInterleaved);
  EXPECT_FALSE(c.rope_deinterleave);  // complex multiplication: pairs stay in place
  EXPECT_EQ(c.heads_q, 16);
  EXPECT_DOUBLE_EQ(model_rope_frequencies(c, c.effective_context()).attention_factor, 1.0);
  const double m = 0.1 * 0.707 * std::log(40.0) + 1.0;
  EXPECT_NEAR(c.layers[0].softmax_scale, m * m / std::sqrt(192.0), 1e-15);
}

TEST(ModelConfigLayers, Llama4Scout) {
  const ModelConfig c = load("llama-4-scout-17b-16e-instruct.json");
  EXPECT_EQ(c.model_type, "llama4");
  EXPECT_EQ(c.heads_q, 40);
  EXPECT_EQ(c.heads_kv, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.rope.style, RopeStyle::kInterleaved);
  EXPECT_EQ(c.rope.scaling.type, RopeScalingType::kLlama3);
  EXPECT_EQ(c.rope.scaling.low_freq_factor, c.rope.scaling.high_freq_factor);
  ASSERT_EQ(c.layers.size(), 48u);
  EXPECT_TRUE(c.layers_differ());
  for (const ModelLayer& l : c.layers) {
    const bool nope = l.index % 4 == 3;
    EXPECT_EQ(l.rope, !nope) << l.index;
    EXPECT_EQ(l.attention, nope ? "full_attention" : "chunked_attention") << l.index;
    EXPECT_EQ(l.attention_chunk.has_value(), !nope) << l.index;
    EXPECT_EQ(l.temperature.has_value(), nope) << l.index;
  }
  EXPECT_EQ(*c.layers[0].attention_chunk, 8192);
  EXPECT_THROW((void)layer_rope_frequencies(c, 3), ValueError);
  // layer_rope walks every layer without an error: NoPE layers say so.
  for (const ModelLayer& l : c.layers) {
    const LayerRopeFrequencies lr = layer_rope(c, l.index, 100);
    EXPECT_EQ(lr.layer, l.index);
    EXPECT_EQ(lr.nope, !l.rope) << l.index;
    EXPECT_EQ(lr.style, RopeStyle::kInterleaved) << l.index;
    EXPECT_EQ(lr.temperature.has_value(), !l.rope) << l.index;
    if (l.rope) {
      EXPECT_EQ(lr.inv_freq, layer_rope_frequencies(c, l.index, 100).inv_freq) << l.index;
    } else {
      EXPECT_EQ(lr.rotary_dim(), 0) << l.index;
      EXPECT_EQ(lr.attention_factor, 1.0) << l.index;
      EXPECT_EQ(lr.temperature->floor_scale, l.temperature->floor_scale);
    }
  }
  EXPECT_THROW((void)layer_rope(c, 48), ValueError);
  EXPECT_THROW((void)layer_rope(c, -1), ValueError);
  // Equal low / high factors: every frequency is either unscaled or divided by the factor.
  const RopeFrequencies f = layer_rope_frequencies(c, 0);
  for (std::size_t i = 0; i < f.inv_freq.size(); ++i) {
    const double base = std::pow(5e5, -2.0 * static_cast<double>(i) / 128.0);
    EXPECT_TRUE(f.inv_freq[i] == base || std::fabs(f.inv_freq[i] - base / 16.0) < 1e-18 * base)
        << i;
  }
  // Temperature: log(floor((p + 1) / 8192) + 1) * 0.1 + 1.
  const AttentionTemperature& t = *c.layers[3].temperature;
  EXPECT_DOUBLE_EQ(attention_temperature(t, 0), 1.0);
  EXPECT_DOUBLE_EQ(attention_temperature(t, 8190), 1.0);
  EXPECT_NEAR(attention_temperature(t, 8191), 0.1 * std::log(2.0) + 1.0, 1e-6);
  EXPECT_NEAR(attention_temperature(t, 3 * 8192 - 1), 0.1 * std::log(4.0) + 1.0, 1e-6);
  // The default pattern (no_rope_layers empty): every 4th layer NoPE; bad lists are errors.
  const ModelConfig d = parse_model_config(
      R"({"model_type": "llama4_text", "num_hidden_layers": 8, "no_rope_layers": []})", "x");
  EXPECT_FALSE(d.layers[3].rope);
  EXPECT_FALSE(d.layers[7].rope);
  EXPECT_TRUE(d.layers[4].rope);
  expect_error(R"({"model_type": "llama4_text", "num_hidden_layers": 4,
                   "no_rope_layers": [1, 1, 2, 0]})",
               {"no_rope_layers[2] must be 0 or 1"});
  expect_error(R"({"model_type": "llama4_text", "num_hidden_layers": 4, "no_rope_layers": [1]})",
               {"no_rope_layers must be a list of 0 / 1"});
  // No chunking when the config says null.
  const ModelConfig nc = parse_model_config(
      R"({"model_type": "llama4_text", "num_hidden_layers": 4, "attention_chunk_size": null})",
      "x");
  EXPECT_EQ(nc.layers[0].attention, "full_attention");
  EXPECT_FALSE(nc.layers[0].attention_chunk.has_value());
  expect_error(R"({"model_type": "llama4", "text_config": {"model_type": "llama"}})",
               {"text_config.model_type 'llama' does not belong to model_type 'llama4'"});
}

TEST(ModelConfigLayers, GptOss) {
  const ModelConfig c = load("gpt-oss-20b.json");
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.rope.style, RopeStyle::kHalf);
  EXPECT_EQ(c.rope.scaling.type, RopeScalingType::kYarn);
  EXPECT_FALSE(c.rope.scaling.truncate);
  ASSERT_EQ(c.layers.size(), 24u);
  for (const ModelLayer& l : c.layers) {
    EXPECT_TRUE(l.attention_sinks);
    EXPECT_EQ(l.attention, l.index % 2 == 0 ? "sliding_attention" : "full_attention");
    EXPECT_EQ(l.sliding_window.has_value(), l.index % 2 == 0);
    EXPECT_DOUBLE_EQ(l.softmax_scale, 0.125);
  }
  EXPECT_EQ(*c.layers[0].sliding_window, 128);
  // Without layer_types the class alternates the same way, sliding first.
  const ModelConfig d =
      parse_model_config(R"({"model_type": "gpt_oss", "num_hidden_layers": 4})", "x");
  EXPECT_EQ(d.layers[0].attention, "sliding_attention");
  EXPECT_EQ(d.layers[1].attention, "full_attention");
  EXPECT_EQ(d.rope.base, 150000.0);
  EXPECT_EQ(defaulted(d, "rope_theta"), "150000");
  expect_error(R"({"model_type": "gpt_oss", "num_hidden_layers": 2,
                   "layer_types": ["sliding_attention"]})",
               {"layer_types has 1 entries; num_hidden_layers is 2"});
  expect_error(R"({"model_type": "gpt_oss", "num_hidden_layers": 1,
                   "layer_types": ["local_attention"]})",
               {"layer_types[0]: unknown layer type 'local_attention'"});
}

TEST(ModelConfigLayers, Gemma3LocalAndGlobal) {
  const ModelConfig c = load("gemma-3-4b-it.json");
  ASSERT_EQ(c.layers.size(), 34u);
  EXPECT_TRUE(c.layers_differ());
  for (const ModelLayer& l : c.layers) {
    const bool global = (l.index + 1) % 6 == 0;
    EXPECT_EQ(l.attention, global ? "full_attention" : "sliding_attention") << l.index;
    EXPECT_EQ(l.rope_config.base, global ? 1e6 : 1e4) << l.index;
    EXPECT_EQ(l.rope_config.scaling.type,
              global ? RopeScalingType::kLinear : RopeScalingType::kDefault)
        << l.index;
    EXPECT_EQ(l.sliding_window.has_value(), !global);
    EXPECT_DOUBLE_EQ(l.softmax_scale, 1.0 / 16.0);  // query_pre_attn_scalar 256
  }
  // Layer 5 (global): theta 1e6 and linear 8; layer 0 (local): theta 1e4, unscaled.
  const RopeFrequencies g = layer_rope_frequencies(c, 5);
  const RopeFrequencies l = layer_rope_frequencies(c, 0);
  EXPECT_DOUBLE_EQ(g.inv_freq[1], std::pow(1e6, -2.0 / 256.0) / 8.0);
  EXPECT_DOUBLE_EQ(l.inv_freq[1], std::pow(1e4, -2.0 / 256.0));
  EXPECT_THROW((void)model_layer(c, 34), ValueError);
  EXPECT_THROW((void)model_layer(c, -1), ValueError);
  const ModelConfig t = load("gemma-3-1b-it.json");
  EXPECT_EQ(t.model_type, "gemma3_text");
  EXPECT_EQ(*t.layers[0].sliding_window, 512);
  EXPECT_EQ(t.layers[5].attention, "full_attention");
  // Gemma 2 alternates, sliding first.
  const ModelConfig g2 =
      parse_model_config(R"({"model_type": "gemma2", "num_hidden_layers": 4})", "x");
  EXPECT_EQ(g2.layers[0].attention, "sliding_attention");
  EXPECT_EQ(g2.layers[1].attention, "full_attention");
  EXPECT_EQ(*g2.layers[0].sliding_window, 4096);
}

// transformers 5 writes Gemma 3's RoPE per layer type; both forms give the same layers.
TEST(ModelConfigLayers, Gemma3RopeParametersPerLayerType) {
  const ModelConfig old_form = parse_model_config(
      R"({"model_type": "gemma3_text", "num_hidden_layers": 6, "head_dim": 64,
          "rope_theta": 1000000, "rope_local_base_freq": 20000,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}})",
      "x");
  const ModelConfig new_form = parse_model_config(
      R"({"model_type": "gemma3_text", "num_hidden_layers": 6, "head_dim": 64,
          "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000},
            "sliding_attention": {"rope_type": "default", "rope_theta": 20000}}})",
      "x");
  for (const ModelConfig* c : {&old_form, &new_form}) {
    EXPECT_EQ(c->layers[0].rope_config.base, 20000.0);
    EXPECT_EQ(c->layers[0].rope_config.scaling.type, RopeScalingType::kDefault);
    EXPECT_EQ(c->layers[5].rope_config.base, 1e6);
    EXPECT_EQ(c->layers[5].rope_config.scaling.type, RopeScalingType::kLinear);
    EXPECT_EQ(c->layers[5].rope_config.scaling.factor, 8.0);
  }
  auto fails = [](const char* text, const char* needle) {
    try {
      (void)parse_model_config(text, "x");
      ADD_FAILURE() << "accepted: " << text;
    } catch (const IoError& e) {
      EXPECT_TRUE(contains(e.what(), needle)) << e.what();
    }
  };
  fails(R"({"model_type": "gemma3_text", "rope_local_base_freq": 10000,
            "rope_parameters": {"full_attention": {"rope_type": "default"},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 5000}}})",
        "contradicts");
  fails(R"({"model_type": "gemma3_text",
            "rope_parameters": {"full_attention": {"rope_type": "default"},
                                "sliding_attention": {"rope_type": "linear", "factor": 2}}})",
        "sliding_attention");
  fails(R"({"model_type": "gemma3_text",
            "rope_parameters": {"sliding_attention": {"rope_type": "default"}}})",
        "no 'full_attention'");
  fails(R"({"model_type": "llama",
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}})",
        "rotates every layer alike");
}

TEST(ModelConfigLayers, UniformModelsAndQwenWindows) {
  const ModelConfig l = load("llama-3.1-8b.json");
  EXPECT_EQ(l.layers.size(), 32u);
  EXPECT_FALSE(l.layers_differ());
  EXPECT_DOUBLE_EQ(l.layers[0].softmax_scale, 1.0 / std::sqrt(128.0));
  EXPECT_TRUE(contains(describe(l), "layers: 32, all full_attention"));
  // Qwen2 slides only from max_window_layers on, and only with use_sliding_window.
  const ModelConfig q = parse_model_config(
      R"({"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": true,
          "sliding_window": 64, "max_window_layers": 2})",
      "x");
  EXPECT_EQ(q.layers[1].attention, "full_attention");
  EXPECT_EQ(q.layers[2].attention, "sliding_attention");
  EXPECT_EQ(*q.layers[2].sliding_window, 64);
  EXPECT_TRUE(contains(describe(q), "pattern AABB"));
}

}  // namespace
}  // namespace posenc
