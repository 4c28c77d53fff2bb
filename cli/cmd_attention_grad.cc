// cli/cmd_attention_grad.cc - `posenc attention-grad`: gradients of attention (SPEC §0-§9).
//
// Reads what `posenc attention` reads (same flags, attention_common.h) plus dout = dLoss/dout
// [B, Lq, Hq, D], runs the forward with the per-row log-sum-exp (posenc::attention, or the
// float64 oracle posenc::ref::attention with --reference), then the backward
// (posenc::attention_backward / ref::attention_backward) and writes one .safetensors file: dq,
// dk, dv, d<name> for each learned parameter given in --params (with the parameter's shape in
// that file; with --reference in float64 with respect to the file's values, float64 ones kept
// exact) and, with --lse, lse [B, Hq, Lq].
#include <CLI/CLI.hpp>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_common.h"
#include "common.h"
#include "posenc/attention.h"
#include "posenc/io.h"
#include "posenc/scheme.h"

namespace posenc::cli {

namespace {

struct AttentionGradArgs {
  AttentionArgs attention;
  std::string dout;
  bool lse = false;
};

std::size_t element_count(const std::vector<int64_t>& shape) {
  std::size_t n = 1;
  for (int64_t s : shape) n *= static_cast<std::size_t>(s);
  return n;
}

template <class T>
Tensor to_tensor(std::vector<int64_t> shape, const std::vector<T>& values, DType dtype) {
  if (dtype == DType::kF64) {
    std::vector<double> v(values.size());
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>(values[i]);
    return Tensor::from_f64(std::move(shape), v);
  }
  std::vector<float> v(values.size());
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(values[i]);
  return Tensor::from_f32(std::move(shape), v);
}

// Forward with lse, then backward, in T (float: the fused path; double: the oracle). Returns the
// output tensors by name, in `dtype`.
template <class T>
SafetensorsFile compute_grads(const AttentionInputs& in, const std::vector<T>& q,
                              const std::vector<T>& k, const std::vector<T>& v,
                              const std::vector<T>& dout, bool with_lse, DType dtype) {
  const auto qd = in.q.dims<4>();
  const auto kd = in.k.dims<4>();
  const std::vector<int64_t> lse_shape = {qd[0], qd[2], qd[1]};
  const View<const T, 4> qv = View<const T, 4>::contiguous(q.data(), qd);
  const View<const T, 4> kv = View<const T, 4>::contiguous(k.data(), kd);
  const View<const T, 4> vv = View<const T, 4>::contiguous(v.data(), kd);
  const View<const T, 4> dov = View<const T, 4>::contiguous(dout.data(), qd);
  const PositionScheme& scheme = in.scheme();
  const std::vector<LearnedParam>& params = in.holder.built.learned;
  const AttentionOptions& opt = in.options;
  const Positions* pq = in.query_positions();
  const Positions* pk = in.key_positions();

  std::vector<T> out(q.size()), lse(element_count(lse_shape));
  const View<T, 4> out_view = View<T, 4>::contiguous(out.data(), qd);
  const View<T, 3> lse_view = View<T, 3>::contiguous(lse.data(), {qd[0], qd[2], qd[1]});
  if constexpr (std::is_same_v<T, double>) {
    ref::attention(qv, kv, vv, scheme, opt, in.holder.built.tables64, out_view, lse_view, pq, pk);
  } else {
    attention(qv, kv, vv, scheme, opt, out_view, lse_view, pq, pk);
  }

  std::vector<T> dq(q.size()), dk(k.size()), dv(v.size());
  AttentionGradsOf<T> g;
  g.dq = View<T, 4>::contiguous(dq.data(), qd);
  g.dk = View<T, 4>::contiguous(dk.data(), kd);
  g.dv = View<T, 4>::contiguous(dv.data(), kd);
  std::vector<std::vector<T>> dparams(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    dparams[i].resize(element_count(params[i].grad_shape));
    bind_param_grad(g, params[i], dparams[i].data());
  }
  if constexpr (std::is_same_v<T, double>) {
    ref::attention_backward(qv, kv, vv, out_view, lse_view, dov, scheme, opt,
                            in.holder.built.tables64, g, pq, pk);
  } else {
    attention_backward(qv, kv, vv, out_view, lse_view, dov, scheme, opt, g, pq, pk);
  }

  in.scale_dq(dq);  // Llama 4 NoPE layers: q was scaled by the attention temperature

  SafetensorsFile file;
  file.metadata["scheme"] = scheme_name(scheme);
  file.tensors["dq"] = to_tensor(in.q.shape, dq, dtype);
  file.tensors["dk"] = to_tensor(in.k.shape, dk, dtype);
  file.tensors["dv"] = to_tensor(in.v.shape, dv, dtype);
  for (std::size_t i = 0; i < params.size(); ++i) {
    file.tensors["d" + params[i].name] =
        to_tensor(params[i].shape, grad_to_given_shape(params[i], dparams[i]), dtype);
  }
  if (with_lse) file.tensors["lse"] = to_tensor(lse_shape, lse, dtype);
  return file;
}

int run_attention_grad(const CLI::App& app, const AttentionGradArgs& args) {
  AttentionInputs in;
  read_attention_inputs(app, args.attention, in);
  const AttentionArgs& a = in.args;

  const Tensor dout_file = read_npy(args.dout);
  require_rank(dout_file, 4, "[batch, seq_q, heads_q, head_dim]", args.dout);
  if (dout_file.shape != in.q.shape) {
    throw ShapeError(args.dout + ": dout " + shape_string(dout_file.shape) +
                     " must have the shape of q " + shape_string(in.q.shape) + " (" + a.q + ")");
  }
  const FloatArray dout = to_float_array(dout_file, args.dout, true);

  // Float64 with --reference unless --out-dtype says otherwise (float64 needs --reference).
  const bool f64 = a.out_dtype.empty() ? a.reference : a.out_dtype == "float64";
  const DType dtype = f64 ? DType::kF64 : DType::kF32;
  SafetensorsFile grads;
  if (a.reference) {
    grads = compute_grads<double>(in, in.q64(), in.k_file.to_f64(a.k), in.v_file.to_f64(a.v),
                                  dout_file.to_f64(args.dout), args.lse, dtype);
  } else {
    grads = compute_grads<float>(in, in.q.data, in.k.data, in.v.data, dout.data, args.lse, dtype);
  }
  write_safetensors(a.out, grads);
  return 0;
}

}  // namespace

Command add_attention_grad_command(CLI::App& parent) {
  auto a = std::make_shared<AttentionGradArgs>();
  a->attention.out_dtype.clear();  // default: float64 with --reference, else float32
  CLI::App* app = parent.add_subcommand(
      "attention-grad",
      "Gradients of attention: dq, dk, dv and d<name> of each learned parameter in --params "
      "(.safetensors), from q, k, v and dout = dLoss/dout [B, Lq, Hq, D] (.npy); the flags of "
      "`posenc attention`");
  add_attention_flags(
      app, a->attention,
      {.out = "Output .safetensors: dq [B, Lq, Hq, D], dk, dv [B, Lk, Hkv, D], d<name> for each "
              "learned parameter in --params (e.g. drelative_attention_bias, dslopes, drel_k, "
              "drel_v, dr_w_bias, dr_r_bias, dr_net, dpos_key, dpos_query, dsinks [Hq]), lse "
              "with --lse",
       .reference = "Run the float64 reference (posenc::ref::attention and "
                    "ref::attention_backward) instead of the float32 path; writes float64",
       .out_dtype = "float32 or float64 (default: float64 with --reference, else float32; "
                    "float64 needs --reference)"});
  app->add_option("--dout", a->dout,
                  "Gradient of the loss with respect to the output, .npy [batch, seq_q, "
                  "heads_q, head_dim] (q's shape)")
      ->required();
  app->add_flag("--lse", a->lse,
                "Also write the forward's log-sum-exp lse [batch, heads_q, seq_q] (natural log "
                "of each row's softmax denominator; -inf for a row with no visible key)");
  return {app, [a, app] { return run_attention_grad(*app, *a); }};
}

}  // namespace posenc::cli
