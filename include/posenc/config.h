// posenc/config.h - a Hugging Face style config.json turned into the positional encoding the model
// uses: typed configs (RopeConfig, AlibiConfig, T5BucketConfig, DebertaBuckets) plus the
// dimensions attention needs.
//
// Read strictly: a key of the positional-encoding part (rope_scaling / rope_parameters and its
// fields, rope_theta, partial rotary keys, ALiBi, T5 and DeBERTa settings) that is unknown, of the
// wrong type, out of range or contradicting another key is an IoError naming the file and the key,
// never a silent default. Keys unrelated to positions are ignored.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "posenc/alibi.h"
#include "posenc/deberta.h"
#include "posenc/rope.h"
#include "posenc/t5.h"

namespace posenc {

enum class ModelScheme { kRope, kAlibi, kT5, kDeberta, kLearned };

struct ModelConfig {
  std::string model_type;  // "llama", "gptj", "bloom", ...
  ModelScheme scheme = ModelScheme::kRope;
  int64_t hidden_size = 0;
  int64_t heads_q = 0;                  // num_attention_heads / n_head / num_heads / n_heads
  int64_t heads_kv = 0;                 // num_key_value_heads (defaults to heads_q)
  int64_t head_dim = 0;                 // head_dim, or hidden_size / heads_q (T5: d_kv)
  int64_t max_position_embeddings = 0;  // 0 when the config has none
  std::optional<int64_t> sliding_window;

  // kRope: head_dim, rotary_dim, base, style and scaling (original_max_position_embeddings read
  // at the top level or inside the scaling dict). M-RoPE models also set mrope.
  RopeConfig rope;
  std::optional<MRope> mrope;
  // kAlibi (bloom, mpt with alibi_bias_max, falcon with alibi: true).
  AlibiConfig alibi;
  // kT5: relative_attention_num_buckets, relative_attention_max_distance; bidirectional = true
  // (the encoder's; the decoder's self-attention uses bidirectional = false).
  T5BucketConfig t5;
  // kDeberta: position_buckets, max_relative_positions (-1 or absent: max_position_embeddings).
  DebertaBuckets deberta;
  std::vector<std::string> pos_att_type;  // e.g. {"p2c", "c2p"}

  // Tokens the encoding was trained or scaled for: for scaled RoPE the larger of
  // original_max_position_embeddings x factor (original: max_position_embeddings when the config
  // has none, as for linear; factor 1 for LongRoPE without one) and max_position_embeddings
  // (Llama 3.1 states 131072 > 8192 x 8); else max_position_embeddings (0 when unknown).
  int64_t effective_context() const;
};

// Parses config.json text; `what` names the source in messages ("<what>: <key> ..."). Throws
// IoError on malformed JSON (with the parser's line and column), a non-object top level, a
// missing or unsupported model_type (the message lists the supported ones) and every bad key.
// Supported model_type values: RoPE half style: llama, mistral, mixtral, qwen2, qwen2_moe, qwen3,
// qwen3_moe, phi, phi3, gpt_neox, gemma, gemma2, stablelm, starcoder2, olmo, falcon (without
// alibi); RoPE + M-RoPE: qwen2_vl, qwen2_5_vl, qwen3_vl (settings read from "text_config" first,
// then the top level); RoPE interleaved: gptj, codegen; ALiBi: bloom, mpt (attn_config.alibi must
// be true), falcon ("alibi": true); T5: t5, mt5; DeBERTa: deberta, deberta-v2 (relative_attention
// must be true); learned absolute: gpt2, bert, roberta.
ModelConfig parse_model_config(const std::string& json_text, const std::string& what);
// read_file(path) (at most 64 MiB) then parse_model_config with `path` as the source name.
ModelConfig read_model_config(const std::string& path);

// RoPE frequencies of a kRope model for a sequence of length seq_len (max position + 1), used as
// given: only dynamic NTK and LongRoPE depend on it, and seq_len 0 (the default) means a short
// sequence (dynamic: the unscaled base; LongRoPE: short_factor). Pass the real length, or
// effective_context() for the long regime. Throws ValueError for other schemes.
RopeFrequencies model_rope_frequencies(const ModelConfig& cfg, int64_t seq_len = 0,
                                       RopeAngles angles = RopeAngles::kAccurate);

// Multi-line text: scheme, dims, base, style, scaling and its parameters, attention factor,
// effective context (what `posenc describe` prints).
std::string describe(const ModelConfig& cfg);

// "half" / "interleaved", "default" / "linear" / ..., for messages and JSON.
const char* style_name(RopeStyle s);
const char* scaling_name(RopeScalingType t);
const char* model_scheme_name(ModelScheme s);  // "rope", "alibi", "t5", "deberta", "learned"

}  // namespace posenc
