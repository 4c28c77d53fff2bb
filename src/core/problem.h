// src/core/problem.h - an attention call as the implementation sees it: the validated
// shapes (Dims), inputs, positions and options (Problem), the mask rule, and the argument checks
// and table helpers that the reference (reference.cc), the fused glue (fused.cc) and the schemes'
// terms (src/schemes/*_term.h) share.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "common.h"
#include "core/mask.h"
#include "posenc/attention.h"
#include "posenc/size.h"

namespace posenc::attn {

using detail::fail;

struct Dims {
  int64_t batch, seq_q, seq_k, heads_q, heads_kv, head_dim, group;
};

template <class T>
Dims validate_shapes(const View<const T, 4>& q, const View<const T, 4>& k,
                     const View<const T, 4>& v, const std::array<int64_t, 4>& out_shape) {
  detail::require_data(q, "attention: q");
  detail::require_data(k, "attention: k");
  detail::require_data(v, "attention: v");
  const std::string qs = shape_str(q.shape), ks = shape_str(k.shape), vs = shape_str(v.shape);
  if (k.shape != v.shape) {
    fail<ShapeError>("attention: k " + ks + " and v " + vs +
                     " must have the same shape [batch, seq_k, heads_kv, head_dim]");
  }
  if (q.shape[0] != k.shape[0]) {
    fail<ShapeError>("attention: q " + qs + " and k " + ks + " differ in batch");
  }
  if (q.shape[3] != k.shape[3]) {
    fail<ShapeError>("attention: q " + qs + " and k " + ks + " differ in head_dim");
  }
  if (q.shape[3] < 1) fail<ShapeError>("attention: head_dim must be >= 1 (q " + qs + ")");
  if (k.shape[2] < 1 || q.shape[2] < 1) {
    fail<ShapeError>("attention: heads must be >= 1 (q " + qs + ", k " + ks + ")");
  }
  if (q.shape[2] % k.shape[2] != 0) {
    fail<ShapeError>("attention: k: kv heads (" + std::to_string(k.shape[2]) +
                     ") must divide q heads (" + std::to_string(q.shape[2]) + ")");
  }
  if (out_shape != q.shape) {
    fail<ShapeError>("attention: out " + shape_str(out_shape) + " must have q's shape " + qs);
  }
  return Dims{q.shape[0],
              q.shape[1],
              k.shape[1],
              q.shape[2],
              k.shape[2],
              q.shape[3],
              q.shape[2] / k.shape[2]};
}

template <class V>
void require_table_shape(const V& t, const std::array<int64_t, V{}.shape.size()>& want,
                         const std::string& name) {
  detail::require_data(t, name);
  if (t.data == nullptr) fail<ShapeError>(name + " is missing");
  if (t.shape != want) {
    fail<ShapeError>(name + " has shape " + shape_str(t.shape) + ", expected " + shape_str(want));
  }
  detail::require_all_finite(t, name);
}

// RoPE on dims [r.offset, r.offset + rotary_dim) of each head of x into out (which may be x
// itself), the other dims copied: DeepSeek's decoupled RoPE, forward or inverse.
template <class T>
void rotate_heads(const Rope& r, View<const T, 4> x, View<T, 4> out, const Positions* pos,
                  Direction dir, int threads) {
  if (out.data != x.data) {
    for (int64_t b = 0; b < x.shape[0]; ++b)
      for (int64_t i = 0; i < x.shape[1]; ++i)
        for (int64_t h = 0; h < x.shape[2]; ++h)
          for (int64_t c = 0; c < x.shape[3]; ++c) out(b, i, h, c) = x(b, i, h, c);
  }
  View<T, 4> part = out;
  part.data = out.data + r.offset * out.stride[3];
  part.shape[3] = out.shape[3] - r.offset;
  if constexpr (std::is_same_v<T, double>) {
    ref::apply_rope(r.freqs, r.style, View<const T, 4>(part), part, pos, dir);
  } else {
    apply_rope(r.freqs, r.style, View<const T, 4>(part), part, pos, dir, threads);
  }
}

// q and k rotated by RoPE into contiguous copies.
template <class T>
void rotated_copies(const Rope& r, const View<const T, 4>& q, const View<const T, 4>& k,
                    const Positions& qp, const Positions& kp, int threads, std::vector<T>& q_rot,
                    std::vector<T>& k_rot) {
  q_rot.resize(static_cast<std::size_t>(q.numel()));
  k_rot.resize(static_cast<std::size_t>(k.numel()));
  auto qo = View<T, 4>::contiguous(q_rot.data(), q.shape);
  auto ko = View<T, 4>::contiguous(k_rot.data(), k.shape);
  if (r.offset > 0) {
    rotate_heads<T>(r, q, qo, &qp, Direction::kForward, threads);
    rotate_heads<T>(r, k, ko, &kp, Direction::kForward, threads);
  } else if constexpr (std::is_same_v<T, double>) {
    ref::apply_rope(r.freqs, r.style, q, qo, &qp);
    ref::apply_rope(r.freqs, r.style, k, ko, &kp);
  } else {
    apply_rope(r.freqs, r.style, q, qo, &qp, Direction::kForward, threads);
    apply_rope(r.freqs, r.style, k, ko, &kp, Direction::kForward, threads);
  }
}

// The table the T path computes with: for T = float the scheme's float32 view; for T = double
// the float64 view when it has data, else the float32 view widened (row-major copy of the same
// shape), else an empty view of the float32 view's shape (the callers report it missing).
template <class T, std::size_t R>
View<const T, R> table_for(const View<const float, R>& f32, const View<const double, R>* f64,
                           std::deque<std::vector<T>>& widened) {
  if constexpr (std::is_same_v<T, float>) {
    return f32;
  } else {
    if (f64 != nullptr && f64->data != nullptr) return *f64;
    View<const T, R> out{nullptr, f32.shape, {}};
    if (f32.data == nullptr) return out;
    detail::require_data(f32, "attention: table");
    std::vector<T>& buf = widened.emplace_back(static_cast<std::size_t>(f32.numel()));
    std::array<int64_t, R> idx{};
    for (std::size_t n = 0; n < buf.size(); ++n) {
      int64_t off = 0;
      for (std::size_t d = 0; d < R; ++d) off += idx[d] * f32.stride[d];
      buf[n] = static_cast<T>(f32.data[off]);
      for (std::size_t d = R; d-- > 0;) {
        if (++idx[d] < f32.shape[d]) break;
        idx[d] = 0;
      }
    }
    return View<const T, R>::contiguous(buf.data(), f32.shape);
  }
}

// threads: the call's num_threads (0: all), for scans of large tensors.
template <class T>
void require_finite_inputs(const View<const T, 4>& q, const View<const T, 4>& k,
                           const View<const T, 4>& v, int threads = 1) {
  detail::require_all_finite(q, "attention: q", threads);
  detail::require_all_finite(k, "attention: k", threads);
  detail::require_all_finite(v, "attention: v", threads);
}

template <class T>
struct Problem {
  View<const T, 4> q, k, v;
  Dims d;
  Positions qp, kp;
  AttentionOptions opt;
};

template <class T>
Problem<T> make_problem(View<const T, 4> q, View<const T, 4> k, View<const T, 4> v,
                        const std::array<int64_t, 4>& out_shape, const AttentionOptions& opt,
                        const Positions* query_positions, const Positions* key_positions,
                        bool check_finite = true) {
  Problem<T> pr{q, k, v, validate_shapes(q, k, v, out_shape), {}, {}, opt};
  const Dims& d = pr.d;
  // The per-token buffers every path makes (positions, document ids, the kernels' offsets),
  // checked before any is made: views with stride 0 can describe far more tokens than memory.
  checked_elements("attention: the per-token positions and masks [batch, seq_q + seq_k]",
                   {{"batch", d.batch}, {"seq_q + seq_k", d.seq_q + d.seq_k}}, 32);
  if (opt.scale) detail::require_finite(*opt.scale, "attention: scale");
  if (opt.window && *opt.window < 1) {
    fail("attention: window must be >= 1 (got " + std::to_string(*opt.window) + ")");
  }
  if (opt.chunk && *opt.chunk < 1) {
    fail("attention: chunk must be >= 1 (got " + std::to_string(*opt.chunk) + ")");
  }
  if (opt.num_threads < 0) fail("attention: num_threads must be >= 0");
  if (opt.softcap && !(std::isfinite(*opt.softcap) && *opt.softcap > 0)) {
    fail("attention: softcap must be a finite number > 0 (got " + std::to_string(*opt.softcap) +
         ")");
  }
  if (!query_positions && d.seq_q > d.seq_k) {
    fail("attention: query length (" + std::to_string(d.seq_q) + ") exceeds key length (" +
         std::to_string(d.seq_k) +
         "): the default positions put queries last in the key sequence; pass "
         "query_positions and key_positions");
  }
  pr.qp = query_positions ? *query_positions : Positions::offset(d.seq_k - d.seq_q);
  pr.kp = key_positions ? *key_positions : Positions::offset(0);
  pr.qp.validate(d.batch, d.seq_q, "attention: query positions");
  pr.kp.validate(d.batch, d.seq_k, "attention: key positions");
  if (check_finite) require_finite_inputs(q, k, v, opt.num_threads);
  return pr;
}

// The positions of batch row b: queries in [qlo, qhi], keys in [klo, khi] (seq_q, seq_k >= 1).
struct RowSpan {
  int64_t qlo, qhi, klo, khi;
};
inline RowSpan row_span(const Positions& qp, const Positions& kp, int64_t b, int64_t seq_q,
                        int64_t seq_k) {
  RowSpan r{qp.at(b, 0), qp.at(b, 0), kp.at(b, 0), kp.at(b, 0)};
  for (int64_t i = 1; i < seq_q; ++i) {
    r.qlo = std::min(r.qlo, qp.at(b, i));
    r.qhi = std::max(r.qhi, qp.at(b, i));
  }
  for (int64_t j = 1; j < seq_k; ++j) {
    r.klo = std::min(r.klo, kp.at(b, j));
    r.khi = std::max(r.khi, kp.at(b, j));
  }
  return r;
}

inline detail::MaskRule mask_rule(const AttentionOptions& opt) {
  return {
      .causal = opt.causal,
      .window = opt.window.value_or(0),
      .chunk = opt.chunk.value_or(0),
      .opens = opt.block_mask.prefix.data != nullptr || !opt.block_mask.global_positions.empty()};
}

template <class T, std::size_t R>
void require_grad(const View<T, R>& g, const std::array<int64_t, R>& want,
                  const std::string& name) {
  detail::require_data(g, name);
  if (g.shape != want) {
    fail<ShapeError>(name + " has shape " + shape_str(g.shape) + ", expected " + shape_str(want));
  }
  if (g.data == nullptr && g.numel() > 0) fail<ShapeError>(name + " is missing");
}

// Copies a dense row-major float buffer into a strided gradient view of the same shape.
template <std::size_t R>
void copy_dense(const float* src, const View<float, R>& dst) {
  if (dst.data == nullptr) return;
  std::array<int64_t, R> idx{};
  for (int64_t n = 0; n < dst.numel(); ++n) {
    int64_t off = 0;
    for (std::size_t d = 0; d < R; ++d) off += idx[d] * dst.stride[d];
    dst.data[off] = src[n];
    for (std::size_t d = R; d-- > 0;) {
      if (++idx[d] < dst.shape[d]) break;
      idx[d] = 0;
    }
  }
}

// A kernel operand: its pointer and its batch, sequence and head strides (elements) from a view
// whose last dimension is contiguous.
template <class P, class T>
void bind_operand(P*& ptr, std::array<int64_t, 3>& stride, const View<T, 4>& v) {
  ptr = v.data;
  stride = {v.stride[0], v.stride[1], v.stride[2]};
}

// A strided 3-d view copied into a dense row-major vector.
template <class T>
std::vector<T> dense3(const View<const T, 3>& x) {
  std::vector<T> o(static_cast<std::size_t>(x.numel()));
  std::size_t at = 0;
  for (int64_t a = 0; a < x.shape[0]; ++a)
    for (int64_t b = 0; b < x.shape[1]; ++b)
      for (int64_t c = 0; c < x.shape[2]; ++c) o[at++] = x(a, b, c);
  return o;
}

}  // namespace posenc::attn
