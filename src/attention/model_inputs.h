// src/attention/model_inputs.h - what model families ask of attention beyond their positional
// scheme, applied in one place for every entry point (float32, half precision, the float64 oracle,
// forward and backward):
//   - the query temperature of Llama 4's NoPE layers (AttentionOptions::query_temperature): q is
//     scaled row by row before the call and dq by the same factors after the backward;
//   - value heads narrower than the query and key heads (DeepSeek's multi-head latent
//     attention): v, and the backward's out and dout, are zero-padded to head_dim, and out and dv
//     cut back to v's width. Zero value dims add only zero output dims, and zero dout dims change
//     neither dP nor D = dout . out, so the padded problem is exact.
// Each entry point calls forward_model_inputs / backward_model_inputs first; they return false
// (doing nothing) for the common call with neither, which then runs as is.
#pragma once

#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"
#include "posenc/attention.h"

namespace posenc::detail {

// A dense row-major 4-d buffer.
template <class T>
struct Buffer4 {
  std::vector<T> data;
  std::array<int64_t, 4> shape{};

  explicit Buffer4(const std::array<int64_t, 4>& s)
      : data(static_cast<std::size_t>(s[0] * s[1] * s[2] * s[3])), shape(s) {}
  View<const T, 4> view() const { return View<const T, 4>::contiguous(data.data(), shape); }
  View<T, 4> mut() { return View<T, 4>::contiguous(data.data(), shape); }
};

// Calls f(a, b, c, d) for every index of `shape`, in row-major order.
template <class F>
void for_each_index(const std::array<int64_t, 4>& shape, F&& f) {
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c)
        for (int64_t d = 0; d < shape[3]; ++d) f(a, b, c, d);
}

// The factor of every query row, f[b * seq_q + i] = attention_temperature(t, pos_q(b, i)), with
// attention's default positions when `query_positions` is null (checked here).
std::vector<double> query_factors(const AttentionTemperature& t, int64_t batch, int64_t seq_q,
                                  int64_t seq_k, const Positions* query_positions);

// x with row (b, i) scaled: T(widened x) * T(factor) (float32 rounding of the factor unless T is
// double).
template <class T, class S>
Buffer4<T> scale_query_rows(const View<const S, 4>& x, const std::vector<double>& factors) {
  require_data(x, "attention: q");
  Buffer4<T> out(x.shape);
  T* o = out.data.data();
  for_each_index(x.shape, [&](int64_t b, int64_t i, int64_t h, int64_t c) {
    const T f = static_cast<T>(factors[static_cast<std::size_t>(b * x.shape[1] + i)]);
    if constexpr (std::is_same_v<S, T>) {
      *o++ = x(b, i, h, c) * f;
    } else {
      *o++ = static_cast<T>(to_float(x(b, i, h, c))) * f;
    }
  });
  return out;
}

// x (any strides) with its last dimension cut or zero-padded to `width`.
template <class T>
Buffer4<T> resize_last_dim(const View<const T, 4>& x, int64_t width, const std::string& name) {
  require_data(x, name);
  Buffer4<T> out({x.shape[0], x.shape[1], x.shape[2], width});
  const int64_t keep = std::min(width, x.shape[3]);
  T* o = out.data.data();
  for_each_index({x.shape[0], x.shape[1], x.shape[2], 1},
                 [&](int64_t a, int64_t b, int64_t c, int64_t) {
                   T* row = o + ((a * x.shape[1] + b) * x.shape[2] + c) * width;
                   for (int64_t d = 0; d < keep; ++d) row[d] = x(a, b, c, d);
                 });
  return out;
}

// dst = the first dst.shape[3] columns of src (same leading shape).
template <class T>
void copy_leading_columns(const View<const T, 4>& src, const View<T, 4>& dst) {
  for_each_index(dst.shape, [&](int64_t a, int64_t b, int64_t c, int64_t d) {
    dst(a, b, c, d) = src(a, b, c, d);
  });
}

// dq row (b, i) times factors[b * seq_q + i] (the chain rule through the query scaling).
template <class T>
void scale_gradient_rows(const View<T, 4>& dq, const std::vector<double>& factors) {
  if (dq.data == nullptr) return;
  for_each_index(dq.shape, [&](int64_t b, int64_t i, int64_t h, int64_t c) {
    T& x = dq(b, i, h, c);
    x = static_cast<T>(static_cast<double>(x) *
                       factors[static_cast<std::size_t>(b * dq.shape[1] + i)]);
  });
}

// Checks a v narrower than q (heads_kv and the leading dims as k's, 1 <= v_dim < head_dim, out
// [batch, seq_q, heads_q, v_dim], no Shaw value table); ShapeError / ValueError otherwise.
// `has_rel_v`: the scheme (or the oracle's float64 tables) has Shaw's rel_v.
void check_narrow_values(const std::array<int64_t, 4>& q, const std::array<int64_t, 4>& k,
                         const std::array<int64_t, 4>& v, const std::array<int64_t, 4>* out,
                         bool has_rel_v);

bool has_shaw_values(const PositionScheme& scheme);

// Forward: when options ask for a query temperature or v is narrower than q, calls
// run(q', v', options', out') with q' scaled (float32, or float64 for the oracle), v' padded and
// out' a padded buffer copied into out afterwards, options' without the temperature; returns
// true. Otherwise returns false and does nothing. `extra_rel_v`: the oracle's float64 rel_v.
template <class Q, class KV, class O, class Run>
bool forward_model_inputs(const View<const Q, 4>& q, const View<const KV, 4>& k,
                          const View<const KV, 4>& v, const PositionScheme& scheme,
                          const AttentionOptions& options, const View<O, 4>& out,
                          const Positions* query_positions, Run&& run, bool extra_rel_v = false) {
  const bool narrow = v.shape[3] != q.shape[3];
  if (!options.query_temperature && !narrow) return false;
  if (narrow) {
    check_narrow_values(q.shape, k.shape, v.shape, &out.shape,
                        extra_rel_v || has_shaw_values(scheme));
  }
  AttentionOptions plain = options;
  plain.query_temperature.reset();
  const auto with_query = [&](const auto& qv) {
    if (!narrow) {
      run(qv, v, plain, out);
      return;
    }
    require_data(out, "attention: out");
    const Buffer4<KV> vp = resize_last_dim(v, q.shape[3], "attention: v");
    Buffer4<O> op({out.shape[0], out.shape[1], out.shape[2], q.shape[3]});
    run(qv, vp.view(), plain, op.mut());
    copy_leading_columns(op.view(), out);
  };
  if (options.query_temperature) {
    using QT = std::conditional_t<std::is_same_v<Q, double>, double, float>;
    const Buffer4<QT> qs =
        scale_query_rows<QT>(q, query_factors(*options.query_temperature, q.shape[0], q.shape[1],
                                              k.shape[1], query_positions));
    with_query(qs.view());
  } else {
    with_query(q);
  }
  return true;
}

// Backward: the same for attention_backward; out, dout and dv are [.., v_dim] when v is narrower.
// run(q', v', out', dout', options', grads').
template <class T, class Run>
bool backward_model_inputs(const View<const T, 4>& q, const View<const T, 4>& k,
                           const View<const T, 4>& v, const View<const T, 4>& out,
                           const View<const T, 4>& dout, const PositionScheme& scheme,
                           const AttentionOptions& options, const AttentionGradsOf<T>& grads,
                           const Positions* query_positions, Run&& run, bool extra_rel_v = false) {
  const bool narrow = v.shape[3] != q.shape[3];
  if (!options.query_temperature && !narrow) return false;
  AttentionOptions plain = options;
  plain.query_temperature.reset();
  std::vector<double> factors;
  std::optional<Buffer4<T>> qs;
  View<const T, 4> qv = q;
  if (options.query_temperature) {
    factors = query_factors(*options.query_temperature, q.shape[0], q.shape[1], k.shape[1],
                            query_positions);
    qs.emplace(scale_query_rows<T>(q, factors));
    qv = qs->view();
  }
  if (!narrow) {
    run(qv, v, out, dout, plain, grads);
  } else {
    check_narrow_values(q.shape, k.shape, v.shape, &out.shape,
                        extra_rel_v || has_shaw_values(scheme));
    if (dout.shape != out.shape) {
      fail<ShapeError>("attention_backward: dout " + shape_str(dout.shape) +
                       " must have out's shape " + shape_str(out.shape));
    }
    if (grads.dv.data != nullptr && grads.dv.shape != v.shape) {
      fail<ShapeError>("attention_backward: dv " + shape_str(grads.dv.shape) +
                       " must have v's shape " + shape_str(v.shape));
    }
    const int64_t width = q.shape[3];
    const Buffer4<T> vp = resize_last_dim(v, width, "attention_backward: v");
    const Buffer4<T> op = resize_last_dim(out, width, "attention_backward: out");
    const Buffer4<T> dop = resize_last_dim(dout, width, "attention_backward: dout");
    std::optional<Buffer4<T>> dvp;
    AttentionGradsOf<T> padded = grads;
    if (grads.dv.data != nullptr) {
      dvp.emplace(std::array<int64_t, 4>{v.shape[0], v.shape[1], v.shape[2], width});
      padded.dv = dvp->mut();
    }
    run(qv, vp.view(), op.view(), dop.view(), plain, padded);
    if (dvp) copy_leading_columns(dvp->view(), grads.dv);
  }
  if (!factors.empty()) scale_gradient_rows(grads.dq, factors);
  return true;
}

// backward_model_inputs for a backward with attention_backward's signature: `backward` is
// called as backward(q', k, v', out', lse, dout', scheme, options', grads', query_positions,
// key_positions).
template <class T, class Backward>
bool backward_model_inputs(Backward&& backward, const View<const T, 4>& q,
                           const View<const T, 4>& k, const View<const T, 4>& v,
                           const View<const T, 4>& out, const View<const T, 3>& lse,
                           const View<const T, 4>& dout, const PositionScheme& scheme,
                           const AttentionOptions& options, const AttentionGradsOf<T>& grads,
                           const Positions* query_positions, const Positions* key_positions) {
  return backward_model_inputs(
      q, k, v, out, dout, scheme, options, grads, query_positions,
      [&](auto qv, auto vv, auto ov, auto dov, const AttentionOptions& o, const auto& g) {
        backward(qv, k, vv, ov, lse, dov, scheme, o, g, query_positions, key_positions);
      });
}

}  // namespace posenc::detail
