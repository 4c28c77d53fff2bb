// cli/cmd_attention.cc - `posenc attention`: attention with any positional scheme
// (docs/attention.md).
//
// Reads q [B, Lq, Hq, D], k and v [B, Lk, Hkv, D] (.npy, any float dtype; v's head dim may be
// smaller: multi-head latent attention), builds the posenc::PositionScheme from flags and a
// .safetensors parameter file (tensor names of docs/attention.md, Parameter names; see
// attention_common.h), runs posenc::attention (or the float64 oracle posenc::ref::attention with
// --reference, parameters in their file's precision) and writes out [B, Lq, Hq, D].
#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <vector>

#include "attention_common.h"
#include "common.h"
#include "posenc/attention.h"

namespace posenc::cli {

namespace {

int run_attention(const CLI::App& app, const AttentionArgs& args) {
  AttentionInputs in;
  read_attention_inputs(app, args, in);
  const AttentionArgs& a = in.args;
  const FloatInput &q = in.q, &k = in.k, &v = in.v;
  const NpyView& tk = in.k_file;
  // The output's head dim: v's (narrower than q's for multi-head latent attention).
  std::vector<int64_t> out_shape = q.shape;
  out_shape[3] = in.v_dim;
  // q's half type unless --out-dtype says otherwise (bfloat16 goes to .safetensors).
  const DType dtype = output_dtype(a.out_dtype, in.q_file.dtype, a.out);
  const PositionScheme& scheme = in.scheme();
  const AttentionOptions& opt = in.options;
  const Positions* pq = in.query_positions();
  const Positions* pk = in.key_positions();

  if (a.reference) {
    const std::vector<double> q64 = in.q_file.to_f64(a.q), k64 = tk.to_f64(a.k),
                              v64 = in.v_file.to_f64(a.v);
    std::vector<double> out(q64.size() / static_cast<std::size_t>(q.shape[3]) *
                            static_cast<std::size_t>(in.v_dim));
    ref::attention(View<const double, 4>::contiguous(q64.data(), q.dims<4>()),
                   View<const double, 4>::contiguous(k64.data(), k.dims<4>()),
                   View<const double, 4>::contiguous(v64.data(), v.dims<4>()), scheme, opt,
                   in.holder.built.tables64,
                   View<double, 4>::contiguous(
                       out.data(), {out_shape[0], out_shape[1], out_shape[2], out_shape[3]}),
                   pq, pk);
    write_output(a.out, dtype, in.caller_shape(out_shape), out);
    return 0;
  }
  FloatArray out;
  out.shape = out_shape;
  out.data.resize(q.size() / static_cast<std::size_t>(q.shape[3]) *
                  static_cast<std::size_t>(in.v_dim));
  attention(q.view<4>(), k.view<4>(), v.view<4>(), scheme, opt, out.mutable_view<4>(), pq, pk);
  write_output(a.out, dtype, in.caller_shape(out_shape), out.data);
  return 0;
}

}  // namespace

Command add_attention_command(CLI::App& parent) {
  auto a = std::make_shared<AttentionArgs>();
  a->out_dtype.clear();  // default: q's type when it is float16 / bfloat16, else float32
  CLI::App* app = parent.add_subcommand(
      "attention",
      "Attention out [B, Lq, Hq, D] from q [B, Lq, Hq, D], k and v [B, Lk, Hkv, D] (.npy) with a "
      "positional scheme; parameters from a .safetensors file, named as in docs/attention.md "
      "(Parameter names)");
  add_attention_flags(
      app, *a,
      {.out = "Output [batch, seq_q, heads_q, head_dim]: .npy, or .safetensors (one tensor "
              "'out'; needed for bfloat16)",
       .reference =
           "Run the float64 reference (posenc::ref::attention) instead of the float32 path",
       .out_dtype = "float32, float16, bfloat16, or float64 with --reference (default: q's type "
                    "when q is float16 / bfloat16, else float32)"});
  return {app, [a, app] { return run_attention(*app, *a); }};
}

}  // namespace posenc::cli
