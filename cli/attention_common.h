// cli/attention_common.h - what `posenc attention` and `posenc attention-grad` share: the flags,
// reading q, k, v, positions and the .safetensors --params file (tensor names of
// docs/attention.md), and handing them with a model --config to posenc::build_scheme
// (posenc/scheme.h), which the Python bindings share.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "common.h"
#include "posenc/attention.h"
#include "posenc/config.h"
#include "posenc/io.h"
#include "posenc/scheme.h"

namespace CLI {
class App;
}  // namespace CLI

namespace posenc::cli {

// The flags of `posenc attention` (and of every command that runs attention).
struct AttentionArgs {
  std::string q, k, v, out;
  std::string scheme;
  std::string config;            // HF config.json: scheme settings and dims from the model
  std::optional<int64_t> layer;  // with config: the decoder layer whose attention to use
  bool causal = false;
  std::optional<double> scale;
  std::string params;
  // rope (base also serves xl)
  double base = 1e4;
  int64_t rotary_dim = 0;
  std::string style = "half";
  std::string angles = "accurate";
  std::optional<int64_t> seq_len;
  // alibi
  double max_bias = 8.0;
  // t5
  std::optional<int64_t> num_buckets;
  int64_t max_distance = 128;
  // deberta
  int64_t position_buckets = 0;
  int64_t max_relative_positions = 512;
  std::string deberta_p2c = "model";  // model or paper
  bool deberta_float64_log = false;
  // positions and options
  std::string positions_q, positions_k;
  std::optional<int64_t> window;
  std::optional<int64_t> chunk;
  bool allow_fully_masked = false;
  bool reference = false;
  std::string out_dtype = "float32";  // empty: no default (the command decides)
  int threads = 0;
};

// Help texts of the flags whose meaning differs between the commands.
struct AttentionFlagHelp {
  std::string out;        // --out
  std::string reference;  // --reference
  std::string out_dtype;  // --out-dtype
};

// Registers the attention flags on `app`, in `posenc attention`'s order, bound to `a` (which must
// outlive `app`'s parsing). --out-dtype shows `a.out_dtype` as its default unless it is empty.
void add_attention_flags(CLI::App* app, AttentionArgs& a, const AttentionFlagHelp& help);

// The scheme (built by posenc::build_scheme) and the parameter arrays its views point into
// (deque: stable addresses): float32 for the fused path, float64 with --reference.
struct SchemeHolder {
  SafetensorsFile file;  // the --params file (empty without one)
  std::deque<FloatArray> arrays;
  std::deque<std::vector<double>> arrays64;
  BuiltScheme built;
};

// Everything an attention command computes from: the inputs read and checked, the scheme built.
struct AttentionInputs {
  AttentionArgs args;  // the flags resolved: the scheme from --config filled in
  std::optional<ModelConfig> model;
  // The inputs mapped, not copied (the float64 reference reads them at their precision), and as
  // float32: the mapped bytes themselves when a file holds float32, else a converted copy.
  NpyView q_file, k_file, v_file;
  FloatInput q, k, v;  // finite
  std::optional<Positions> pos_q, pos_k;
  SchemeHolder holder;  // built for the float64 reference with --reference
  AttentionOptions options;
  // Llama 4 NoPE layers (--layer): query row (b, i) is scaled by query_factor[b * seq_q + i]
  // (attention_temperature), already applied to q; empty when none.
  std::vector<double> query_factor;

  // The head dim of v as given. Multi-head latent attention (DeepSeek) gives v narrower heads
  // than q and k: v is zero-padded to q's head dim for the kernels (zero value dims only add
  // zero output dims) and the output, dout and dv are cut to / padded from v_dim.
  int64_t v_dim = 0;

  // q as float64 for the reference: q_file's values, scaled by query_factor.
  std::vector<double> q64() const;
  // v as float64 for the reference, padded like v.
  std::vector<double> v64() const;
  // The last dim of rows of width `from` resized to `to` (cut, or zero-padded).
  template <class T>
  static std::vector<T> resize_heads(const T* x, std::size_t n, int64_t from, int64_t to) {
    const auto f = static_cast<std::size_t>(from), t = static_cast<std::size_t>(to);
    const std::size_t rows = f == 0 ? 0 : n / f;
    std::vector<T> out(rows * t, T(0));
    const std::size_t w = std::min(f, t);
    for (std::size_t r = 0; r < rows; ++r) {
      for (std::size_t c = 0; c < w; ++c) out[r * t + c] = x[r * f + c];
    }
    return out;
  }
  // Chain rule through the query scaling: dq row (b, i) times query_factor[b * seq_q + i].
  template <class T>
  void scale_dq(std::vector<T>& dq) const {
    if (query_factor.empty()) return;
    const std::size_t row = dq.size() / query_factor.size();
    for (std::size_t r = 0; r < query_factor.size(); ++r) {
      for (std::size_t c = 0; c < row; ++c) {
        dq[r * row + c] = static_cast<T>(static_cast<double>(dq[r * row + c]) * query_factor[r]);
      }
    }
  }

  const PositionScheme& scheme() const { return holder.built.scheme; }
  const Positions* query_positions() const { return pos_q ? &*pos_q : nullptr; }
  const Positions* key_positions() const { return pos_k ? &*pos_k : nullptr; }
};

// Resolves --config, checks the flags, reads q, k, v and the positions, checks their shapes and
// builds the scheme and the options (posenc::Error on any usage or input problem). `app` is the
// command's parsed CLI11 app (to see which flags were given). `in` is filled in place.
void read_attention_inputs(const CLI::App& app, const AttentionArgs& args, AttentionInputs& in);

}  // namespace posenc::cli
