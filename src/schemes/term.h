// src/schemes/term.h - what a positional scheme's attention term is made of, and what it gets.
//
// Each scheme has one term type, <Scheme>Term<T> in src/schemes/<scheme>_term.h (T = double: the
// float64 oracle; T = float: the simple float32 path and the fused kernels' glue), holding what it
// validated and precomputed for one call. The reference loops (src/attention/reference.cc) and
// the fused glue (src/attention/fused.cc) are written once and call these members:
//
//   static void build(SchemeBuild&, const ModelLayer*)
//                                                    the scheme from settings, named parameter
//                                                    tensors and a model config (build_scheme)
//   void prepare(const Scheme&, TermInputs<T>&)      validate the scheme's settings and tables
//                                                    against the call, precompute O(L) / O(L·K)
//   void score(const Cell<T>&, T& content, T& bias)  the term of one cell: content is scaled
//                                                    with q·k, bias added after the scale
//   T key_query(const Cell<T>&, int64_t c)           what multiplies dS into dk (q, XL: q + u)
//   void value(const Cell<T>&, T p, T* acc)          Shaw's value term: acc += p rel_v[idx]
//   void value_dp(const Cell<T>&, dout, s, T& dp)    ... and its dP part, dp += dout · rel_v[idx]
//   void grad(const Cell<T>&, T p, T ds, T sds, CellGrads<T>&)
//                                                    the cell's gradients: dq, dk, the tables
//   void finish_grads(const Problem<T>&, const AttentionGradsOf<T>&, dq, dk)
//                                                    what accumulates past the cells (XL's
//                                                    dr_net, RoPE's rotation back)
//   static auto grad_fields(AttentionGradsOf<T>&)   its learned tables by name and their gradient
//                                                    fields: tuple of {name, &g.d<name>}
//   void check_grads(const AttentionGradsOf<T>&, GradCheck<T>&)
//                                                    the shapes of its parameter gradients
// and, for T = float, the fused kernels' side:
//   bool fill_kernel(KernelInputs&)                  the kernel's tables and params (false:
//                                                    outside the kernel's domain)
//   void bind_grads(KernelGrads&), fold_grads(KernelGrads&)
//                                                    the kernel's table gradients, and folding
//                                                    them into the parameters' gradients
// NoTerm (no positions) shows the defaults every term starts from.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <tuple>
#include <vector>

#include "core/problem.h"
#include "hwy/aligned_allocator.h"
#include "kernels/attention_kernels.h"
#include "posenc/attention.h"
#include "schemes/build.h"

namespace posenc::attn {

// What prepare() gets: the call, and where to keep widened tables.
template <class T>
struct TermInputs {
  const AttentionOptions& opt;
  const Dims& d;
  const View<const T, 4>& q;
  const View<const T, 4>& k;
  const Positions& qp;
  const Positions& kp;
  bool simple_path;                     // also build what only the simple paths use
  const ref::SchemeTables* tables;      // the oracle's float64 tables (nullable)
  std::deque<std::vector<T>>& widened;  // stable storage for tables widened to T
  // RoPE fills these for the simple paths: q and k rotated (contiguous [B, L, H, D]).
  std::vector<T>& q_rot;
  std::vector<T>& k_rot;

  // The table the path computes with: the float64 one of `member` when given, else the float32
  // view (widened for T = double).
  template <std::size_t R>
  View<const T, R> table(const View<const float, R>& f32,
                         View<const double, R> ref::SchemeTables::*member) const {
    return table_for<T>(f32, tables ? &(tables->*member) : nullptr, widened);
  }
};

// One cell (query i of head h in batch row b, key j) of the reference: its rows (q: rotated for
// RoPE), strides in elements, positions.
template <class T>
struct Cell {
  int64_t b, h, hk, i, j;
  int64_t pq, pk;  // positions; rel = pk - pq
  int64_t dim;
  const T* qr;
  int64_t qs;
  const T* kr;
  int64_t ks;

  T q(int64_t c) const { return qr[c * qs]; }
  T k(int64_t c) const { return kr[c * ks]; }
};

// Where a cell's gradients go: dq of the row (dense, accumulated over the row's keys), dk of the
// key (with respect to the rotated k for RoPE) and the parameters' gradients.
template <class T>
struct CellGrads {
  T* dq_row;
  T* dk_row;
  int64_t dk_stride;  // of the last dim
  const T* dout_row;  // the row's dout
  int64_t dout_stride;
  const AttentionGradsOf<T>& g;

  T& dk(int64_t c) const { return dk_row[c * dk_stride]; }
  T dout(int64_t c) const { return dout_row[c * dout_stride]; }
};

// Checks the parameter gradients a term owns (shape as the call computes with) and records
// them; reference.cc then rejects any other gradient given.
template <class T>
struct GradCheck {
  std::string where;  // "attention_backward: "
  std::vector<const void*> owned;

  template <std::size_t R>
  void own(const View<T, R>& g, const std::array<int64_t, R>& want, const std::string& name) {
    if (g.data == nullptr) return;
    require_grad(g, want, where + name);
    owned.push_back(g.data);
  }
};

// The fused kernels' tables of one call, shared by the forward and the backward: positions as
// int32 offsets from a per-row base (a multiple of the chunk), each row's largest distance, and
// storage for the terms' tables.
struct KernelInputs {
  const Problem<float>& pr;
  kernels::FusedAttentionParams& fp;
  std::vector<int32_t>& dmax;         // [batch] largest pos_q - pos_k of each row
  const std::vector<int64_t>& bases;  // [batch] the rows' position bases
  int64_t range;                      // distances per row (largest over rows)
  int64_t gdmin, gdmax;               // distances over every row
  int64_t plo, phi;                   // absolute positions over every row
  int threads;
  bool allow_rope_copies;  // RoPE may fall back to rotated copies (not on half storage)
  std::deque<std::vector<float>>& f32;
  std::deque<std::vector<int32_t>>& i32;
  std::deque<hwy::AlignedFreeUniquePtr<double[]>>& f64;
  std::deque<std::vector<int64_t>>& i64;

  static constexpr int64_t kPad = 64;  // the kernel's key tile: tables padded by one tile
};

// The fused backward's view of a term's gradients: the call, the gradients asked for, the
// kernel's parameters and storage for the kernel-side gradients.
struct KernelGrads {
  const Problem<float>& pr;
  const AttentionGrads& g;
  kernels::FusedBackwardParams& bp;
  std::deque<std::vector<float>>& f32;
};

// No positions: every member a no-op. The other terms start from this.
template <class T>
struct NoTerm {
  static constexpr bool kDistanceTables = false;  // kernel tables indexed by distance
  // Dot products of head_dim summed in a score: the default scale is 1 / sqrt(terms head_dim).
  static constexpr int kScoreTerms = 1;
  // The scheme's PositionScheme alternative from the settings, parameters and model config
  // (src/schemes/build.h; layer: the model layer chosen, nullable).
  static void build(detail::SchemeBuild& b, const ModelLayer*) { b.out.scheme = NoPositions{}; }
  void prepare(const NoPositions&, TermInputs<T>&) {}
  void score(const Cell<T>&, T&, T&) const {}
  T key_query(const Cell<T>& c, int64_t x) const { return c.q(x); }
  static constexpr bool kValues = false;
  void value(const Cell<T>&, T, T*) const {}
  void value_dp(const Cell<T>&, const T*, int64_t, T&) const {}
  void grad(const Cell<T>&, T, T, T, CellGrads<T>&) const {}
  void finish_grads(const Problem<T>&, const AttentionGradsOf<T>&, View<const T, 4>,
                    View<const T, 4>) const {}
  static auto grad_fields(AttentionGradsOf<T>&) { return std::tuple<>{}; }
  void check_grads(const AttentionGradsOf<T>&, GradCheck<T>&) const {}
  bool fill_kernel(KernelInputs&) const { return true; }
  void bind_grads(KernelGrads&) const {}
  void fold_grads(KernelGrads&) const {}
};

}  // namespace posenc::attn
