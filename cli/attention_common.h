// cli/attention_common.h - what `posenc attention` and `posenc attention-grad` share: the flags,
// reading q, k, v, positions and the .safetensors --params file (tensor names of
// docs/attention.md), and handing them with a model --config to posenc::build_scheme
// (posenc/scheme.h), which the Python bindings share.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
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
  // The schemes' settings given as flags (the registry's, posenc/schemes.h), by keyword: their
  // text ("true" for a flag without a value). A map: its values stay in place for CLI11.
  std::map<std::string, std::string> settings;
  // positions and options
  std::string positions_q, positions_k;
  std::optional<int64_t> window;
  std::optional<int64_t> chunk;
  std::optional<double> softcap;
  std::string cu_seqlens_q, cu_seqlens_k;  // packed sequences (.npy int32 / int64)
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
  // The head dim of v, which multi-head latent attention (DeepSeek) makes narrower than q's:
  // the output, dout and dv have it (the library pads and cuts, posenc/attention.h).
  int64_t v_dim = 0;
  // Packed sequences (--cu-seqlens-q / --cu-seqlens-k): q, k, v read as [total, heads, D] and
  // held as [1, total, heads, D]; `options` carry the documents, pos_q / pos_k the positions.
  std::optional<PackedSequences> packed;

  // An output's shape in the caller's layout (without the leading 1 of a packed call).
  std::vector<int64_t> caller_shape(std::vector<int64_t> shape) const {
    if (packed && !shape.empty()) shape.erase(shape.begin());
    return shape;
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
