// cli/cmd_attention_grad.cc - `posenc attention-grad`: gradients of attention
// (docs/attention.md, Backward).
//
// Reads what `posenc attention` reads (same flags, attention_common.h) plus dout = dLoss/dout
// [B, Lq, Hq, D], runs the forward with the per-row log-sum-exp (posenc::attention, or the
// float64 oracle posenc::ref::attention with --reference), then the backward
// (posenc::attention_backward / ref::attention_backward) and writes one .safetensors file: dq,
// dk, dv, d<name> for each learned parameter given in --params (with the parameter's shape in
// that file; with --reference in float64 with respect to the file's values, float64 ones kept
// exact) and, with --lse, lse [B, Hq, Lq].
#include <CLI/CLI.hpp>
#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_common.h"
#include "common.h"
#include "posenc/attention.h"
#include "posenc/half.h"
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

// What the backward produced, in T, and the tensors of the output file by reference to it.
template <class T>
struct Grads {
  std::vector<T> dq, dk, dv, lse;
  std::vector<std::vector<T>> dparams;  // in the parameters' given shapes
};

// Forward with lse, then backward, in T (float: the fused path; double: the oracle), from
// contiguous q [B, Lq, Hq, D], k [B, Lk, Hkv, D], v [B, Lk, Hkv, Dv] and dout [B, Lq, Hq, Dv].
template <class T>
Grads<T> compute_grads(const AttentionInputs& in, const T* q, const T* k, const T* v,
                       const T* dout) {
  const auto qd = in.q.dims<4>();
  const auto kd = in.k.dims<4>();
  const auto vd = in.v.dims<4>();
  const std::array<int64_t, 4> od{qd[0], qd[1], qd[2], vd[3]};
  const View<const T, 4> qv = View<const T, 4>::contiguous(q, qd);
  const View<const T, 4> kv = View<const T, 4>::contiguous(k, kd);
  const View<const T, 4> vv = View<const T, 4>::contiguous(v, vd);
  const View<const T, 4> dov = View<const T, 4>::contiguous(dout, od);
  const PositionScheme& scheme = in.scheme();
  const std::vector<LearnedParam>& params = in.holder.built.learned;
  const AttentionOptions& opt = in.options;
  const Positions* pq = in.query_positions();
  const Positions* pk = in.key_positions();

  Grads<T> r;
  std::vector<T> out(element_count({od.begin(), od.end()}));
  r.lse.resize(static_cast<std::size_t>(qd[0] * qd[2] * qd[1]));
  const View<T, 4> out_view = View<T, 4>::contiguous(out.data(), od);
  const View<T, 3> lse_view = View<T, 3>::contiguous(r.lse.data(), {qd[0], qd[2], qd[1]});
  if constexpr (std::is_same_v<T, double>) {
    ref::attention(qv, kv, vv, scheme, opt, in.holder.built.tables64, out_view, lse_view, pq, pk);
  } else {
    attention(qv, kv, vv, scheme, opt, out_view, lse_view, pq, pk);
  }

  r.dq.resize(in.q.size());
  r.dk.resize(in.k.size());
  r.dv.resize(in.v.size());
  AttentionGradsOf<T> g;
  g.dq = View<T, 4>::contiguous(r.dq.data(), qd);
  g.dk = View<T, 4>::contiguous(r.dk.data(), kd);
  g.dv = View<T, 4>::contiguous(r.dv.data(), vd);
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
  for (std::size_t i = 0; i < params.size(); ++i) {
    r.dparams.push_back(grad_to_given_shape(params[i], dparams[i]));
  }
  return r;
}

// Writes the gradients straight from memory when they are in `dtype`, else converted.
template <class T>
void write_grads(const std::string& path, const AttentionInputs& in, const Grads<T>& r,
                 bool with_lse, DType dtype) {
  const std::vector<LearnedParam>& params = in.holder.built.learned;
  std::deque<std::vector<float>> f32;  // conversions (stable addresses)
  std::deque<std::vector<double>> f64;
  std::deque<std::vector<uint16_t>> f16s;
  auto ref = [&](std::vector<int64_t> shape, const std::vector<T>& values) {
    const void* data = values.data();
    if (dtype == DType::kF32 && !std::is_same_v<T, float>) {
      data = f32.emplace_back(values.begin(), values.end()).data();
    } else if (dtype == DType::kF64 && !std::is_same_v<T, double>) {
      data = f64.emplace_back(values.begin(), values.end()).data();
    } else if (dtype == DType::kF16 || dtype == DType::kBF16) {
      std::vector<uint16_t>& h = f16s.emplace_back(values.size());
      for (std::size_t i = 0; i < values.size(); ++i) {
        const auto x = static_cast<float>(values[i]);
        h[i] = dtype == DType::kF16 ? f16_from_float(x).bits : bf16_from_float(x).bits;
      }
      data = h.data();
    }
    return TensorRef{dtype, std::move(shape), data};
  };
  std::map<std::string, TensorRef> tensors;
  tensors["dq"] = ref(in.caller_shape(in.q.shape), r.dq);
  tensors["dk"] = ref(in.caller_shape(in.k.shape), r.dk);
  tensors["dv"] = ref(in.caller_shape(in.v.shape), r.dv);
  for (std::size_t i = 0; i < params.size(); ++i) {
    tensors["d" + params[i].name] = ref(params[i].shape, r.dparams[i]);
  }
  if (with_lse) {
    const auto qd = in.q.dims<4>();
    tensors["lse"] = ref(in.caller_shape({qd[0], qd[2], qd[1]}), r.lse);
  }
  write_safetensors(path, tensors, {{"scheme", scheme_name(in.scheme())}});
}

int run_attention_grad(const CLI::App& app, const AttentionGradArgs& args) {
  AttentionInputs in;
  read_attention_inputs(app, args.attention, in);
  const AttentionArgs& a = in.args;

  const NpyView dout_file = map_tensor_input(args.dout, "dout");
  require_rank(dout_file, in.packed ? 3 : 4,
               in.packed ? "[total_q, heads_q, head_dim]" : "[batch, seq_q, heads_q, head_dim]",
               args.dout);
  std::vector<int64_t> out_shape = in.q.shape;  // the output's: v's head dim
  out_shape[3] = in.v_dim;
  if (dout_file.shape != in.caller_shape(out_shape)) {
    throw ShapeError(args.dout + ": dout " + shape_string(dout_file.shape) +
                     (in.v_dim == in.q.shape[3]
                          ? " must have the shape of q " +
                                shape_string(in.caller_shape(in.q.shape)) + " (" + a.q + ")"
                          : " must have the shape of the output " +
                                shape_string(in.caller_shape(out_shape)) + " (" + a.q +
                                " with the head_dim of " + a.v + ")"));
  }
  // Float64 with --reference, else float32, unless --out-dtype says otherwise (float64 needs
  // --reference).
  const DType dtype = a.out_dtype.empty() ? (a.reference ? DType::kF64 : DType::kF32)
                                          : output_dtype(a.out_dtype, DType::kF32, a.out);
  if (a.reference) {
    std::vector<double> d64 = dout_file.to_f64(args.dout);
    check_finite(d64, dout_file.shape, args.dout);
    const std::vector<double> q64 = in.q_file.to_f64(a.q), k64 = in.k_file.to_f64(a.k),
                              v64 = in.v_file.to_f64(a.v);
    const Grads<double> g =
        compute_grads<double>(in, q64.data(), k64.data(), v64.data(), d64.data());
    write_grads(a.out, in, g, args.lse, dtype);
  } else {
    const FloatInput dout = to_float_input(dout_file, args.dout, true);
    const Grads<float> g =
        compute_grads<float>(in, in.q.data(), in.k.data(), in.v.data(), dout.data());
    write_grads(a.out, in, g, args.lse, dtype);
  }
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
       .out_dtype = "float32, float16, bfloat16 or float64 (default: float64 with --reference, "
                    "else float32; float64 needs --reference)"});
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
