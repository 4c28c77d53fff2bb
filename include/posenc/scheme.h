// posenc/scheme.h - a PositionScheme built from settings, an optional model config.json and named
// parameter tensors (docs/attention.md, Parameter names): what `posenc attention`,
// `posenc attention-grad` and the Python bindings share, so that a scheme means the same thing
// everywhere.
//
//   SchemeSettings s{.scheme = "t5", .max_distance = 128};
//   ParamMap params{{"relative_attention_bias", ParamTensor::of(table_view)}};
//   BuiltScheme b = build_scheme(s, params, nullptr, {.heads_q = 8, .heads_kv = 8, .head_dim = 64,
//                                                     .seq_len = 512});
//   attention(q, k, v, b.scheme, b.options({.causal = true}), out);
//
// Parameter tensors are not copied when their dtype is the one the path computes in (float32 for
// the fused kernel, float64 for the oracle); the other dtype is converted once into storage the
// BuiltScheme owns. Views into the caller's tensors must outlive the BuiltScheme.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "posenc/attention.h"
#include "posenc/config.h"

namespace posenc {

// One named parameter tensor, not owned: float32 or float64 (exactly one of f32, f64 set), any
// strides in elements (empty stride: row-major).
struct ParamTensor {
  const float* f32 = nullptr;
  const double* f64 = nullptr;
  std::vector<int64_t> shape;
  std::vector<int64_t> stride;

  template <class T, std::size_t R>
  static ParamTensor of(const View<T, R>& v) {
    ParamTensor p;
    if constexpr (std::is_same_v<std::remove_const_t<T>, double>) {
      p.f64 = v.data;
    } else {
      p.f32 = v.data;
    }
    p.shape.assign(v.shape.begin(), v.shape.end());
    p.stride.assign(v.stride.begin(), v.stride.end());
    return p;
  }
};
using ParamMap = std::map<std::string, ParamTensor>;

// The scheme's settings; unset optionals take the model config's value, else the default shown.
// With a model config, a setting the config determines is a conflict when given (ValueError).
struct SchemeSettings {
  // none, rope, alibi, t5, shaw, xl, deberta; empty: the model config's scheme (required then).
  std::string scheme;
  // rope: theta (default 1e4); xl: the sinusoid base (default 1e4).
  std::optional<double> base;
  std::optional<int64_t> rotary_dim;  // rope: R (default head_dim)
  std::optional<RopeStyle> style;     // rope: default half
  RopeAngles angles = RopeAngles::kAccurate;
  // rope: frequencies given directly (an injected inv_freq table); replaces base, rotary_dim,
  // scaling and the model's frequencies. The style still comes from `style` or the model.
  std::optional<RopeFrequencies> freqs;
  // rope: a frequency scaling (Hugging Face rope_scaling: linear, dynamic NTK, YaRN, Llama 3,
  // LongRoPE), evaluated at the sequence's length (SchemeDims::seq_len).
  std::optional<RopeScaling> scaling;
  std::optional<double> max_bias;                 // alibi: B when slopes are computed (default 8)
  std::optional<int64_t> num_buckets;             // t5: must equal the table's rows when given
  std::optional<int64_t> max_distance;            // t5: default 128
  std::optional<bool> bidirectional;              // t5: default: !causal
  std::optional<int64_t> position_buckets;        // deberta: default 0 (no log bucketing)
  std::optional<int64_t> max_relative_positions;  // deberta: default 512
  std::optional<DebertaP2c> deberta_p2c;          // deberta: default DebertaBuckets{}.p2c
  std::optional<bool> deberta_float64_log;        // deberta: default false
  // With a model config: the decoder layer (0-based) whose attention to build: its RoPE
  // (layer_rope_frequencies; a NoPE layer gives scheme none), sliding window, chunk, softmax
  // scale, query temperature and sinks requirement (BuiltScheme). Required when the model's
  // layers differ (ModelConfig::layers_differ); without it a model whose layers agree is built as
  // before (the model-wide RoPE, no window, chunk or layer scale).
  std::optional<int64_t> layer;

  // How messages name the parameter source, the config and the query / key tensors (the CLI
  // passes file names), and the settings (by keyword; the CLI passes its flags: "--num-buckets").
  std::string params_name = "params";
  std::string config_name = "config";
  std::string q_name = "q";
  std::string k_name = "k";
  std::map<std::string, std::string> setting_names;

  // How messages name the setting `keyword`.
  std::string name_of(const std::string& keyword) const {
    const auto it = setting_names.find(keyword);
    return it == setting_names.end() ? keyword : it->second;
  }
};

// What the inputs say: heads, head_dim and the sequence length that length-dependent RoPE
// scaling (dynamic NTK, LongRoPE) uses: the largest position + 1 (attention_seq_len).
struct SchemeDims {
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;
  int64_t seq_len = 0;
};

// The largest position + 1 over the queries and keys of an attention call (the default
// positions when they are nullptr: keys 0 .. seq_k - 1, queries last).
int64_t attention_seq_len(int64_t batch, int64_t seq_q, int64_t seq_k,
                          const Positions* query_positions, const Positions* key_positions);

// Which path the scheme is built for: the float32 kernels (attention, attention_backward) or the
// float64 oracle (ref::attention with BuiltScheme::tables64).
enum class SchemePrecision { kFloat32, kFloat64 };

// A learned parameter of the built scheme that was given: its gradient is "d" + name.
struct LearnedParam {
  std::string name;                 // parameter name, e.g. "rel_k"
  std::vector<int64_t> shape;       // as given
  std::vector<int64_t> grad_shape;  // as the scheme views it: what AttentionGrads' field wants
  // True when a shared Shaw table [2K+1, D] was broadcast over the heads (stride 0) to pair with
  // a per-head one: the gradient in the given shape is then the sum over grad_shape's axis 1.
  bool summed_over_heads = false;
};

// A built scheme and the storage its views may point into. Movable (views point into heap
// buffers that moves keep in place); not copyable.
struct BuiltScheme {
  PositionScheme scheme;              // float32 tables (empty views under kFloat64)
  ref::SchemeTables tables64;         // float64 tables (kFloat64 only)
  std::string name;                   // none, rope, ...
  std::optional<double> scale;        // the model's score scale when it fixes one (T5: 1)
  std::vector<LearnedParam> learned;  // in scheme_param_names order
  // Attention sinks [heads_q] from the `sinks` parameter (float32 view; kFloat64: in tables64).
  View<const float, 1> sinks;
  // The model layer's masks (SchemeSettings::layer): sliding window and chunk.
  std::optional<int64_t> window, chunk;
  // Llama 4 NoPE layers: the queries' attention temperature (AttentionOptions::query_temperature).
  std::optional<AttentionTemperature> query_temperature;
  // The model layer's logit soft-capping (Gemma 2).
  std::optional<double> softcap;

  // `base` with the model's scale, window, chunk, sinks, query temperature and soft-capping
  // filled in where base leaves them unset.
  AttentionOptions options(AttentionOptions base) const {
    if (!base.scale) base.scale = scale;
    if (!base.window) base.window = window;
    if (!base.chunk) base.chunk = chunk;
    if (base.sinks.data == nullptr) base.sinks = sinks;
    if (!base.query_temperature) base.query_temperature = query_temperature;
    if (!base.softcap) base.softcap = softcap;
    return base;
  }

  BuiltScheme() = default;
  BuiltScheme(BuiltScheme&&) = default;
  BuiltScheme& operator=(BuiltScheme&&) = default;
  BuiltScheme(const BuiltScheme&) = delete;
  BuiltScheme& operator=(const BuiltScheme&) = delete;

  std::deque<std::vector<float>> storage32;
  std::deque<std::vector<double>> storage64;
};

// The parameter tensors scheme `name` reads, required ones first: t5 relative_attention_bias;
// alibi slopes (optional); shaw rel_k, rel_v (optional); xl r_w_bias, r_r_bias, r_net; deberta
// pos_key, pos_query; then, for every scheme, sinks [heads_q] (optional: attention sinks, required
// by a model layer that has them). ValueError for an unknown scheme name.
std::vector<std::string> scheme_param_names(const std::string& name);
// The required ones only.
std::vector<std::string> scheme_required_params(const std::string& name);

// The attention scheme a model config implies, as SchemeSettings::scheme spells it. ValueError
// for models with learned absolute positions (added to the input, not applied in attention);
// `config_name` names the config in the message.
std::string model_attention_scheme(const ModelConfig& model, const std::string& config_name);

// Builds the scheme. `model` (nullable): the model's settings replace the defaults and must
// agree with dims (head_dim, heads) and with the settings given. Every parameter named in
// `params` must belong to the scheme (ValueError otherwise); ranks, shapes (against dims) and
// finiteness are checked here or by the attention call, naming the tensor. Throws ValueError /
// ShapeError naming the setting or tensor.
BuiltScheme build_scheme(const SchemeSettings& settings, const ParamMap& params,
                         const ModelConfig* model, const SchemeDims& dims,
                         SchemePrecision precision = SchemePrecision::kFloat32);

// Points the gradient field of `p` (g.d<name>) at `data`, a row-major buffer of p.grad_shape.
template <class T>
void bind_param_grad(AttentionGradsOf<T>& g, const LearnedParam& p, T* data);

// A gradient computed in p.grad_shape (row-major) reshaped to p.shape: the same elements, or the
// sum over the heads for a shared table that was broadcast (summed in double, heads in order).
template <class T>
std::vector<T> grad_to_given_shape(const LearnedParam& p, const std::vector<T>& grad);

}  // namespace posenc
