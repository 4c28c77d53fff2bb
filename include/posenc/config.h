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
#include <utility>
#include <vector>

#include "posenc/alibi.h"
#include "posenc/attention.h"
#include "posenc/deberta.h"
#include "posenc/names.h"
#include "posenc/rope.h"
#include "posenc/t5.h"

namespace posenc {

enum class ModelScheme { kRope, kAlibi, kT5, kDeberta, kLearned };

// One decoder layer's position handling. Models whose layers differ (Gemma 2 / 3 and gpt-oss:
// sliding-window and global layers; Gemma 3: a different theta and scaling on the local layers;
// Llama 4: NoPE layers with temperature tuning between chunked RoPE layers) list one per layer.
struct ModelLayer {
  int64_t index = 0;
  std::string attention = "full_attention";  // the model's label: full_attention,
                                             // sliding_attention or chunked_attention
  bool rope = true;                          // false: no positional encoding (Llama 4 NoPE)
  RopeConfig rope_config;                    // this layer's RoPE (meaningful when rope is true)
  // Sliding window: a key is visible iff pos_q - pos_k < sliding_window (and causal).
  std::optional<int64_t> sliding_window;
  // Chunked local attention: a key is visible iff floor(pos_k / chunk) == floor(pos_q / chunk).
  std::optional<int64_t> attention_chunk;
  double softmax_scale = 0;  // the score scale the model's code uses (1 / sqrt(D) unless noted)
  std::optional<AttentionTemperature> temperature;  // Llama 4 NoPE layers
  bool attention_sinks = false;  // gpt-oss: one learned logit per head in every softmax denominator
  // Logit soft-capping (Gemma 2's attn_logit_softcapping; Gemma 3 when set): scores become
  // softcap * tanh(s / softcap) (AttentionOptions::softcap).
  std::optional<double> softcap;
  // The layer's head dim and key/value heads: the model's, except where its layers differ
  // (Gemma 4's global layers: global_head_dim, num_global_key_value_heads).
  int64_t head_dim = 0;
  int64_t heads_kv = 0;
};

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

  // Where the rotary part of a head lies and how its output is laid out (beyond rope.style):
  //   rope_offset: the first rotated dim. DeepSeek's multi-head latent attention rotates only
  //     the last qk_rope_head_dim dims of each [qk_nope_head_dim | qk_rope_head_dim] head.
  //   rope_deinterleave: DeepSeek-V3 (rope_interleave: true) rotates interleaved pairs
  //     (2i, 2i + 1) and writes them out de-interleaved, pair i at (i, i + R/2), as its code
  //     permutes them before rotate_half. Dot products are those of the interleaved style.
  int64_t rope_offset = 0;
  bool rope_deinterleave = false;
  int64_t v_head_dim = 0;  // value head dim when it differs from head_dim (DeepSeek MLA), else 0

  // The model's layers (num_hidden_layers entries for the RoPE families; empty otherwise).
  // layers_differ() tells whether any two differ in position handling.
  std::vector<ModelLayer> layers;
  bool layers_differ() const;

  // Values taken from the model type's reference configuration class because the file left the
  // key out: {key, value} in the order read ("head_dim", "256"). default_source names the class.
  std::vector<std::pair<std::string, std::string>> defaults;
  std::string default_source;  // e.g. "GemmaConfig"
  // The config.json text it was parsed from and the name of its source (a path, or "config"):
  // parse_model_config(json, source) reads the same config again (in another process too).
  std::string json;
  std::string source;

  // Tokens the encoding was trained or scaled for: for scaled RoPE the larger of
  // original_max_position_embeddings x factor (original: max_position_embeddings when the config
  // has none, as for linear; factor 1 for LongRoPE without one) and max_position_embeddings
  // (Llama 3.1 states 131072 > 8192 x 8); else max_position_embeddings (0 when unknown).
  int64_t effective_context() const;
};

// Parses config.json text; `what` names the source in messages ("<what>: <key> ..."). Throws
// IoError on malformed JSON (with the parser's line and column), a non-object top level, a
// missing or unsupported model_type (the message lists the supported ones) and every bad key.
// A key the file leaves out takes the default of the model type's reference configuration class
// (Hugging Face's <Name>Config; recorded in ModelConfig::defaults, table in
// docs/model-configs.md); a key written as null is the class's None (head_dim: hidden / heads,
// num_key_value_heads: the query heads, sliding_window: none).
// Supported model_type values: RoPE half style: llama, mistral, mixtral, qwen2, qwen2_moe, qwen3,
// qwen3_moe, phi, phi3, gpt_neox, gemma, gemma2, stablelm, starcoder2, olmo, gpt_oss, gemma3
// and gemma3_text (text_config first), gemma4 and gemma4_text (text_config first; proportional
// RoPE on the global layers), falcon (without alibi); RoPE + M-RoPE: qwen2_vl,
// qwen2_5_vl, qwen3_vl (text_config first); RoPE interleaved: gptj, codegen, llama4 (text_config
// first) and llama4_text, deepseek_v2, deepseek_v3 and kimi_k2 (multi-head latent attention:
// rope_offset, rope_deinterleave); ALiBi: bloom, mpt (attn_config.alibi must be true), falcon
// ("alibi": true); T5: t5, mt5; DeBERTa: deberta, deberta-v2 (relative_attention must be true);
// learned absolute: gpt2, bert, roberta.
ModelConfig parse_model_config(const std::string& json_text, const std::string& what);
// read_file(path) (at most 64 MiB) then parse_model_config with `path` as the source name.
ModelConfig read_model_config(const std::string& path);

// Layer `layer` (0-based) of a model: throws ValueError naming the range when out of range or when
// the model lists no layers.
const ModelLayer& model_layer(const ModelConfig& cfg, int64_t layer);

// RoPE frequencies of layer `layer` (its own theta and scaling). Throws ValueError for a layer
// without RoPE (Llama 4 NoPE) and as model_rope_frequencies.
RopeFrequencies layer_rope_frequencies(const ModelConfig& cfg, int64_t layer, int64_t seq_len = 0,
                                       RopeAngles angles = RopeAngles::kAccurate);

// One layer's rotary encoding as a walk over a model's layers needs it, NoPE layers included:
// a RoPE layer gives its frequencies (as layer_rope_frequencies) and style; a layer without
// RoPE (Llama 4's NoPE layers) gives nope = true, no frequencies (rotary_dim() 0, attention
// factor 1) and the model's style. temperature: the layer's attention-temperature tuning, if
// any. Throws ValueError for a model without RoPE or a layer out of range.
struct LayerRopeFrequencies : RopeFrequencies {
  int64_t layer = 0;
  bool nope = false;
  RopeStyle style = RopeStyle::kHalf;
  std::optional<AttentionTemperature> temperature;
};
LayerRopeFrequencies layer_rope(const ModelConfig& cfg, int64_t layer, int64_t seq_len = 0,
                                RopeAngles angles = RopeAngles::kAccurate);

// Applies the model's RoPE to x [batch, seq, heads, head_dim] as its code does: rope_offset and
// rope_deinterleave included (head_dim may be the full head, the rotated part starting at
// rope_offset, or just the rotary part, rotary_dim wide). Dims outside the rotary part are copied.
// Throws ShapeError when head_dim fits neither, ValueError / ShapeError as apply_rope.
void apply_model_rope(const ModelConfig& cfg, const RopeFrequencies& freqs, View<const float, 4> x,
                      View<float, 4> out, const Positions* positions = nullptr,
                      Direction direction = Direction::kForward);

// RoPE frequencies of a kRope model for a sequence of length seq_len (max position + 1), used as
// given: only dynamic NTK and LongRoPE depend on it, and seq_len 0 (the default) means a short
// sequence (dynamic: the unscaled base; LongRoPE: short_factor). Pass the real length, or
// effective_context() for the long regime. Throws ValueError for other schemes.
RopeFrequencies model_rope_frequencies(const ModelConfig& cfg, int64_t seq_len = 0,
                                       RopeAngles angles = RopeAngles::kAccurate);

// Multi-line text: scheme, dims, base, style, scaling and its parameters, attention factor,
// effective context (what `posenc describe` prints).
std::string describe(const ModelConfig& cfg);
// The same as one JSON object (what `posenc describe --json` prints and the Python ModelConfig's
// to_dict() returns): model_type, scheme, dims, the scheme's settings, layers (index, attention,
// rope, nope, rope_theta, rope_scaling, sliding_window, attention_chunk, softmax_scale,
// temperature, attention_sinks), defaults. rope_scaling_json: one scaling as {"type", and the
// parameters that type reads}. The one serializer of these: every JSON or dict form uses it.
std::string describe_json(const ModelConfig& cfg);
std::string rope_scaling_json(const RopeScaling& s);

// "rope", "alibi", ..., for messages and JSON (the other enums' names: posenc/names.h).
const char* model_scheme_name(ModelScheme s);  // "rope", "alibi", "t5", "deberta", "learned"

}  // namespace posenc
