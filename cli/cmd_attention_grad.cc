// cli/cmd_attention_grad.cc - `posenc attention-grad`: gradients of attention (SPEC §0-§9).
//
// Reads what `posenc attention` reads (same flags, attention_common.h) plus dout = dLoss/dout
// [B, Lq, Hq, D], runs the forward with the per-row log-sum-exp (posenc::attention, or the
// float64 oracle posenc::ref::attention with --reference), then the backward
// (posenc::attention_backward / ref::attention_backward) and writes one .safetensors file: dq,
// dk, dv, d<name> for each learned parameter given in --params (with the parameter's shape in
// that file) and, with --lse, lse [B, Hq, Lq].
#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "attention_common.h"
#include "common.h"
#include "posenc/attention.h"
#include "posenc/io.h"

namespace posenc::cli {

namespace {

struct AttentionGradArgs {
  AttentionArgs attention;
  std::string dout;
  bool lse = false;
};

// A learned parameter of the scheme, given in --params, whose gradient d<name> is written.
struct ParamGrad {
  std::string name;                 // the --params tensor, e.g. "rel_k"
  std::vector<int64_t> grad_shape;  // what the library writes: the scheme's view of it
  std::vector<int64_t> file_shape;  // the tensor's shape in --params: what is written
};

template <std::size_t R>
std::vector<int64_t> to_vector(const std::array<int64_t, R>& a) {
  return {a.begin(), a.end()};
}

std::size_t element_count(const std::vector<int64_t>& shape) {
  std::size_t n = 1;
  for (int64_t s : shape) n *= static_cast<std::size_t>(s);
  return n;
}

// The scheme's learned parameters that --params holds (the ALiBi slopes only when given there,
// Shaw's rel_v only with rel_v), in the order they are written.
std::vector<ParamGrad> learned_params(const AttentionInputs& in) {
  const SchemeHolder& h = in.holder;
  std::vector<ParamGrad> params;
  auto add = [&](const std::string& name, std::vector<int64_t> grad_shape) {
    if (const Tensor* t = find_tensor(h.file, name)) {
      params.push_back({name, std::move(grad_shape), t->shape});
    }
  };
  if (std::holds_alternative<Alibi>(h.scheme)) {
    add("slopes", {in.q.shape[2]});
  } else if (const auto* t5 = std::get_if<T5Bias>(&h.scheme)) {
    add("relative_attention_bias", to_vector(t5->table.shape));
  } else if (const auto* shaw = std::get_if<Shaw>(&h.scheme)) {
    add("rel_k", to_vector(shaw->rel_k.shape));
    if (shaw->rel_v.data != nullptr) add("rel_v", to_vector(shaw->rel_v.shape));
  } else if (const auto* xl = std::get_if<TransformerXL>(&h.scheme)) {
    add("r_w_bias", to_vector(xl->r_w_bias.shape));
    add("r_r_bias", to_vector(xl->r_r_bias.shape));
    add("r_net", to_vector(xl->r_net.shape));
  } else if (const auto* deberta = std::get_if<DeBERTa>(&h.scheme)) {
    add("pos_key", to_vector(deberta->pos_key.shape));
    add("pos_query", to_vector(deberta->pos_query.shape));
  }
  return params;
}

template <class T, std::size_t R>
View<T, R> grad_view(std::vector<T>& buffer, const std::vector<int64_t>& shape) {
  std::array<int64_t, R> dims{};
  std::copy(shape.begin(), shape.end(), dims.begin());
  return View<T, R>::contiguous(buffer.data(), dims);
}

// Points the gradient field of parameter `name` at `buffer`.
template <class T>
void bind_grad(AttentionGradsOf<T>& g, const std::string& name, std::vector<T>& buffer,
               const std::vector<int64_t>& shape) {
  if (name == "relative_attention_bias") {
    g.drelative_attention_bias = grad_view<T, 2>(buffer, shape);
  } else if (name == "slopes") {
    g.dslopes = grad_view<T, 1>(buffer, shape);
  } else if (name == "rel_k") {
    g.drel_k = grad_view<T, 3>(buffer, shape);
  } else if (name == "rel_v") {
    g.drel_v = grad_view<T, 3>(buffer, shape);
  } else if (name == "r_w_bias") {
    g.dr_w_bias = grad_view<T, 2>(buffer, shape);
  } else if (name == "r_r_bias") {
    g.dr_r_bias = grad_view<T, 2>(buffer, shape);
  } else if (name == "r_net") {
    g.dr_net = grad_view<T, 2>(buffer, shape);
  } else if (name == "pos_key") {
    g.dpos_key = grad_view<T, 3>(buffer, shape);
  } else if (name == "pos_query") {
    g.dpos_query = grad_view<T, 3>(buffer, shape);
  }
}

// The gradient of the file's tensor from the gradient of the scheme's view of it: the same
// elements in another shape ([2K+1, D] viewed as [2K+1, 1, D]), or, for a shared Shaw table the
// CLI broadcast over the heads (stride 0) to pair it with a per-head one, the sum over the heads
// (in float64, heads in order).
template <class T>
std::vector<T> to_file_shape(const std::vector<T>& grad, const ParamGrad& p) {
  if (element_count(p.file_shape) == grad.size()) return grad;
  const auto rows = static_cast<std::size_t>(p.grad_shape[0]);
  const auto heads = static_cast<std::size_t>(p.grad_shape[1]);
  const auto dim = static_cast<std::size_t>(p.grad_shape[2]);
  std::vector<T> out(rows * dim);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t c = 0; c < dim; ++c) {
      double sum = 0;
      for (std::size_t h = 0; h < heads; ++h) {
        sum += static_cast<double>(grad[(r * heads + h) * dim + c]);
      }
      out[r * dim + c] = static_cast<T>(sum);
    }
  }
  return out;
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
                              const std::vector<T>& dout, const std::vector<ParamGrad>& params,
                              bool with_lse, DType dtype) {
  const auto qd = in.q.dims<4>();
  const auto kd = in.k.dims<4>();
  const std::vector<int64_t> lse_shape = {qd[0], qd[2], qd[1]};
  const View<const T, 4> qv = View<const T, 4>::contiguous(q.data(), qd);
  const View<const T, 4> kv = View<const T, 4>::contiguous(k.data(), kd);
  const View<const T, 4> vv = View<const T, 4>::contiguous(v.data(), kd);
  const View<const T, 4> dov = View<const T, 4>::contiguous(dout.data(), qd);
  const PositionScheme& scheme = in.holder.scheme;
  const AttentionOptions& opt = in.options;
  const Positions* pq = in.query_positions();
  const Positions* pk = in.key_positions();

  std::vector<T> out(q.size()), lse(element_count(lse_shape));
  const View<T, 4> out_view = View<T, 4>::contiguous(out.data(), qd);
  const View<T, 3> lse_view = grad_view<T, 3>(lse, lse_shape);
  if constexpr (std::is_same_v<T, double>) {
    ref::attention(qv, kv, vv, scheme, opt, out_view, lse_view, pq, pk);
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
    bind_grad(g, params[i].name, dparams[i], params[i].grad_shape);
  }
  if constexpr (std::is_same_v<T, double>) {
    ref::attention_backward(qv, kv, vv, out_view, lse_view, dov, scheme, opt, g, pq, pk);
  } else {
    attention_backward(qv, kv, vv, out_view, lse_view, dov, scheme, opt, g, pq, pk);
  }

  SafetensorsFile file;
  file.metadata["scheme"] = scheme_name(scheme);
  file.tensors["dq"] = to_tensor(in.q.shape, dq, dtype);
  file.tensors["dk"] = to_tensor(in.k.shape, dk, dtype);
  file.tensors["dv"] = to_tensor(in.v.shape, dv, dtype);
  for (std::size_t i = 0; i < params.size(); ++i) {
    file.tensors["d" + params[i].name] =
        to_tensor(params[i].file_shape, to_file_shape(dparams[i], params[i]), dtype);
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
  const std::vector<ParamGrad> params = learned_params(in);
  SafetensorsFile grads;
  if (a.reference) {
    grads = compute_grads<double>(in, in.q_file.to_f64(a.q), in.k_file.to_f64(a.k),
                                  in.v_file.to_f64(a.v), dout_file.to_f64(args.dout), params,
                                  args.lse, dtype);
  } else {
    grads = compute_grads<float>(in, in.q.data, in.k.data, in.v.data, dout.data, params, args.lse,
                                 dtype);
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
              "drel_v, dr_w_bias, dr_r_bias, dr_net, dpos_key, dpos_query), lse with --lse",
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
