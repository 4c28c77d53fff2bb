// src/attention/fused.cc - the float32 attention on the fused kernels (src/kernels/): the public
// float32 forward and backward, and the half-precision storage path (attention/half.h). Validates
// the call, fills the kernels' plain parameter struct (positions as int32 offsets, the scheme's
// tables through its term, src/schemes/*_term.h), runs the kernel, and falls back to the simple
// path (reference.cc) outside the kernels' domain.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <limits>
#include <string>
#include <variant>
#include <vector>

#include "attention/block_mask.h"
#include "attention/half.h"
#include "attention/model_inputs.h"
#include "attention/prepared.h"
#include "attention/reference.h"
#include "common.h"
#include "hwy/aligned_allocator.h"
#include "kernels/attention_kernels.h"
#include "kernels/bf16_dot.h"
#include "kernels/parallel.h"

namespace posenc {
namespace attn {
namespace {

bool all_finite(const View<float, 4>& x) {
  // On the exponent bits (all ones: inf or NaN), an integer OR the compiler vectorizes.
  uint32_t bad = 0;
  for (int64_t b = 0; b < x.shape[0]; ++b)
    for (int64_t i = 0; i < x.shape[1]; ++i)
      for (int64_t h = 0; h < x.shape[2]; ++h) {
        const float* r = &x(b, i, h, 0);
        const int64_t st = x.stride[3];
        for (int64_t c = 0; c < x.shape[3]; ++c) {
          uint32_t u;
          std::memcpy(&u, r + c * st, sizeof u);
          bad |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
        }
      }
  return bad == 0;
}

// ---- the fused float32 path ------------------------------------------------------------------

// Rejects (or, when allowed, leaves to the kernel's zero output) query rows that see no key:
// O((seq_q + seq_k) log seq_k) per batch row with the key positions sorted.
// With block masks the kernel reports such rows (FusedAttentionParams::empty_row) and
// fail_if_fully_masked names the first.
void check_fully_masked(const Problem<float>& pr) {
  const Dims& d = pr.d;
  // With sinks a row without visible keys is well defined (all weight on the sink).
  if (pr.opt.allow_fully_masked || d.seq_q == 0 || pr.opt.sinks.data != nullptr) return;
  if (!pr.opt.block_mask.empty()) return;
  const detail::MaskRule mask = mask_rule(pr.opt);
  for (int64_t b = 0; b < d.batch; ++b) {
    std::vector<int64_t> ks(static_cast<std::size_t>(d.seq_k));
    for (int64_t j = 0; j < d.seq_k; ++j) ks[static_cast<std::size_t>(j)] = pr.kp.at(b, j);
    std::sort(ks.begin(), ks.end());
    for (int64_t i = 0; i < d.seq_q; ++i) {
      const int64_t pq = pr.qp.at(b, i);
      const auto [lo, hi] = mask.key_range(pq);  // the visible key positions
      const auto it = std::lower_bound(ks.begin(), ks.end(), lo);
      if (it == ks.end() || *it > hi) {
        fail("attention: query " + std::to_string(i) + " (batch " + std::to_string(b) +
             ", position " + std::to_string(pq) +
             ") sees no key under the mask; allow_fully_masked gives 0 for such rows");
      }
    }
  }
}

// The kernel found a row whose running maximum never left -inf: the first query row that sees no
// key under the block masks is an error. Returns when every row sees a key: the row's scores were
// all NaN instead (a NaN or an infinity in q, k or v), which the caller reports as such.
void fail_if_fully_masked(const Problem<float>& pr, const TokenMask& mask) {
  const Dims& d = pr.d;
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t i = 0; i < d.seq_q; ++i) {
      const int64_t pq = pr.qp.at(b, i);
      bool any = false;
      for (int64_t j = 0; j < d.seq_k && !any; ++j) any = mask.visible(b, i, j, pq, pr.kp.at(b, j));
      if (!any) {
        fail("attention: query " + std::to_string(i) + " (batch " + std::to_string(b) +
             ", position " + std::to_string(pq) +
             ") sees no key under the mask; allow_fully_masked gives 0 for such rows");
      }
    }
  }
}

// Whether the kernel must report rows without a visible key (block masks: check_fully_masked
// leaves them to it).
bool reports_empty_rows(const Problem<float>& pr) {
  return !pr.opt.block_mask.empty() && !pr.opt.allow_fully_masked && pr.opt.sinks.data == nullptr;
}

// The kernels' view of a call, shared by the fused forward and backward: positions as int32
// offsets from a per-row base, each row's largest distance, the sinks, and the storage of the
// term's tables.
struct FusedTables {
  std::vector<int32_t> qpos, kpos, dmax;
  std::vector<float> sinks;
  TokenMask mask;
  std::deque<std::vector<float>> f32;
  std::deque<std::vector<int32_t>> i32;
  std::deque<hwy::AlignedFreeUniquePtr<double[]>> f64;
  std::deque<std::vector<int64_t>> i64;
};

// Fills kernels::FusedAttentionParams. Returns false when the call is outside the kernels' domain
// (positions too sparse for int32 distance tables; what the term refuses).
bool fill_fused_params(const Problem<float>& pr, const Prepared<float>& p, FusedTables& tab,
                       kernels::FusedAttentionParams& fp, bool allow_rope_copies = true) {
  const Dims& d = pr.d;
  // Positions relative to a per-row base; distance range per row.
  auto& qpos = tab.qpos;
  auto& kpos = tab.kpos;
  auto& dmax = tab.dmax;
  qpos.assign(static_cast<std::size_t>(d.batch * d.seq_q), 0);
  kpos.assign(static_cast<std::size_t>(d.batch * d.seq_k), 0);
  dmax.assign(static_cast<std::size_t>(d.batch), 0);
  int64_t range = 0, gdmin = std::numeric_limits<int64_t>::max(),
          gdmax = std::numeric_limits<int64_t>::min();
  // Per-row bases and the range of absolute positions (RoPE's table).
  std::vector<int64_t> bases(static_cast<std::size_t>(d.batch));
  int64_t plo = std::numeric_limits<int64_t>::max(), phi = std::numeric_limits<int64_t>::min();
  for (int64_t b = 0; b < d.batch; ++b) {
    const auto [qlo, qhi, klo, khi] = row_span(pr.qp, pr.kp, b, d.seq_q, d.seq_k);
    int64_t base = std::min(qlo, klo);
    if (pr.opt.chunk) {
      // Chunk boundaries are absolute: the base is a multiple of the chunk (floor division).
      base = mask_rule(pr.opt).chunk_start(base);
    }
    bases[static_cast<std::size_t>(b)] = base;
    plo = std::min({plo, qlo, klo});
    phi = std::max({phi, qhi, khi});
    if (std::max(qhi, khi) - base >= (int64_t{1} << 30)) return false;
    for (int64_t i = 0; i < d.seq_q; ++i) {
      qpos[static_cast<std::size_t>(b * d.seq_q + i)] = static_cast<int32_t>(pr.qp.at(b, i) - base);
    }
    for (int64_t j = 0; j < d.seq_k; ++j) {
      kpos[static_cast<std::size_t>(b * d.seq_k + j)] = static_cast<int32_t>(pr.kp.at(b, j) - base);
    }
    dmax[static_cast<std::size_t>(b)] = static_cast<int32_t>(qhi - klo);
    range = std::max(range, (qhi - klo) - (qlo - khi) + 1);
    gdmin = std::min(gdmin, qlo - khi);
    gdmax = std::max(gdmax, qhi - klo);
  }
  const bool tables = std::visit([](const auto& term) { return term.kDistanceTables; }, p.term);
  if (tables && range > 4 * (d.seq_q + d.seq_k) + 4096) return false;

  bind_operand(fp.q, fp.q_stride, pr.q);
  bind_operand(fp.k, fp.k_stride, pr.k);
  bind_operand(fp.v, fp.v_stride, pr.v);
  fp.batch = d.batch;
  fp.seq_q = d.seq_q;
  fp.seq_k = d.seq_k;
  fp.heads_q = d.heads_q;
  fp.heads_kv = d.heads_kv;
  fp.head_dim = d.head_dim;
  fp.scale = static_cast<float>(p.scale);
  // A cap outside float32's normal range still caps: below FLT_MIN every capped score lies within
  // FLT_MIN of 0 (and the softmax of such scores is uniform in float32, as it is of the exact
  // ones); a cap above FLT_MAX is FLT_MAX, which differs from it only on scores near float32's
  // limit. 0 would mean "no cap", and a subnormal cap would make the kernel's 1 / cap infinite.
  if (pr.opt.softcap) {
    fp.softcap = static_cast<float>(std::clamp<double>(
        *pr.opt.softcap, std::numeric_limits<float>::min(), std::numeric_limits<float>::max()));
  }
  fp.mask = mask_rule(pr.opt);
  tab.mask = make_token_mask(pr);
  const TokenMask& tm = tab.mask;
  if (!tm.qdoc.empty()) fp.qdoc = tm.qdoc.data(), fp.kdoc = tm.kdoc.data();
  if (!tm.qopen.empty()) fp.qopen = tm.qopen.data();
  if (!tm.kopen.empty()) fp.kopen = tm.kopen.data();
  if (tm.dense.data != nullptr) {
    fp.dense = tm.dense.data;
    fp.dense_stride = {tm.dense_broadcast ? 0 : tm.dense.stride[0], tm.dense.stride[1],
                       tm.dense.stride[2]};
  }
  if (pr.opt.sinks.data != nullptr) {
    tab.sinks.resize(static_cast<std::size_t>(d.heads_q));
    for (int64_t h = 0; h < d.heads_q; ++h) {
      tab.sinks[static_cast<std::size_t>(h)] = pr.opt.sinks(h);
    }
    fp.sinks = tab.sinks.data();
  }
  fp.qpos = qpos.data();
  fp.kpos = kpos.data();
  fp.num_threads = pr.opt.num_threads;
  // The scheme's tables and params.
  KernelInputs in{pr,
                  fp,
                  dmax,
                  bases,
                  range,
                  gdmin,
                  gdmax,
                  plo,
                  phi,
                  kernels::resolve_threads(pr.opt.num_threads),
                  allow_rope_copies,
                  tab.f32,
                  tab.i32,
                  tab.f64,
                  tab.i64};
  return std::visit([&](const auto& term) { return term.fill_kernel(in); }, p.term);
}

// Whether the kernel's float32 q and k (the backward, bp: also v and dout) all hold bf16 values,
// bf16 training's widened tensors, so that its score tiles may use vdpbf16ps. Scanned only when
// POSENC_BF16_DOT lets them (bf16_dot_prefill) and the rows reach the products as they are: not
// with RoPE in the kernel or Transformer-XL (their rows are float32 by then); the rows the kernel
// reads are scanned (a RoPE copy, rotated, is rarely bf16).
bool bf16_operands(const kernels::FusedAttentionParams& f,
                   const kernels::FusedBackwardParams* bp = nullptr) {
  if (!kernels::bf16_dot_prefill() || f.rope.cs != nullptr || f.xl_sin != nullptr ||
      f.q == nullptr || f.k == nullptr || f.v == nullptr) {
    return false;
  }
  const auto exact = [&](const float* x, const std::array<int64_t, 3>& st, int64_t seq,
                         int64_t heads) {
    return detail::bf16_exact(
        View<const float, 4>{x, {f.batch, seq, heads, f.head_dim}, {st[0], st[1], st[2], 1}},
        f.num_threads);
  };
  if (!exact(f.q, f.q_stride, f.seq_q, f.heads_q) || !exact(f.k, f.k_stride, f.seq_k, f.heads_kv))
    return false;
  return bp == nullptr || (exact(f.v, f.v_stride, f.seq_k, f.heads_kv) &&
                           exact(bp->dout, bp->dout_stride, f.seq_q, f.heads_q));
}

bool run_fused(const Problem<float>& pr, const Prepared<float>& p, View<float, 4> out,
               int* nan_score, int* nonfinite_out, const View<float, 3>* lse) {
  const Dims& d = pr.d;
  if (!pr.q.last_dim_contiguous() || !pr.k.last_dim_contiguous() || !pr.v.last_dim_contiguous() ||
      !out.last_dim_contiguous()) {
    return false;
  }
  if (d.batch == 0 || d.seq_q == 0) return true;
  if (d.seq_k == 0) {  // every row fully masked: allowed, or (block masks) an error here
    if (reports_empty_rows(pr)) fail_if_fully_masked(pr, make_token_mask(pr));
    for (int64_t b = 0; b < d.batch; ++b)
      for (int64_t i = 0; i < d.seq_q; ++i)
        for (int64_t h = 0; h < d.heads_q; ++h)
          for (int64_t c = 0; c < d.head_dim; ++c) out(b, i, h, c) = 0.0f;
    return true;
  }
  kernels::FusedAttentionParams fp;
  FusedTables tables;
  if (!fill_fused_params(pr, p, tables, fp)) return false;
  fp.out = out.data;
  fp.out_stride = {out.stride[0], out.stride[1], out.stride[2]};
  fp.nan_score = nan_score;
  fp.nonfinite_out = nonfinite_out;
  if (lse) {
    fp.lse = lse->data;
    fp.lse_stride = {lse->stride[0], lse->stride[1], lse->stride[2]};
  }
  int empty = 0;
  if (reports_empty_rows(pr)) fp.empty_row = &empty;
  fp.bf16_operands = bf16_operands(fp);
  kernels::fused_attention(fp);
  if (empty != 0) {
    fail_if_fully_masked(pr, tables.mask);
    *nan_score = 1;  // every row sees a key: its scores were NaN (reported with the input)
  }
  return true;
}

// The fused backward (kernels::fused_attention_backward). Returns false outside its domain (the
// forward's, plus unit-stride last dimensions of every gradient).
bool run_fused_backward(const Problem<float>& pr, const Prepared<float>& p,
                        const View<const float, 4>& out, const View<const float, 3>& lse,
                        const View<const float, 4>& dout, const AttentionGrads& g) {
  const Dims& d = pr.d;
  if (!pr.q.last_dim_contiguous() || !pr.k.last_dim_contiguous() || !pr.v.last_dim_contiguous() ||
      !out.last_dim_contiguous() || !dout.last_dim_contiguous() || !g.dq.last_dim_contiguous() ||
      !g.dk.last_dim_contiguous() || !g.dv.last_dim_contiguous()) {
    return false;
  }
  if (d.batch == 0 || d.seq_q == 0 || d.seq_k == 0) {  // gradients are zero
    zero_qkv_grads(g);
    return true;
  }
  kernels::FusedBackwardParams bp;
  FusedTables tab;
  if (!fill_fused_params(pr, p, tab, bp.fwd)) return false;
  bp.fwd.out = const_cast<float*>(out.data);
  bp.fwd.out_stride = {out.stride[0], out.stride[1], out.stride[2]};
  bp.fwd.lse = const_cast<float*>(lse.data);
  bp.fwd.lse_stride = {lse.stride[0], lse.stride[1], lse.stride[2]};
  bind_operand(bp.dout, bp.dout_stride, dout);
  bind_operand(bp.dq, bp.dq_stride, g.dq);
  bind_operand(bp.dk, bp.dk_stride, g.dk);
  bind_operand(bp.dv, bp.dv_stride, g.dv);
  std::vector<float> dsinks;
  if (g.dsinks.data != nullptr) {
    dsinks.resize(static_cast<std::size_t>(d.heads_q));
    bp.dsinks = dsinks.data();
  }
  bp.fwd.bf16_operands = bf16_operands(bp.fwd, &bp);
  KernelGrads kg{pr, g, bp, tab.f32};
  std::visit([&](const auto& term) { term.bind_grads(kg); }, p.term);
  kernels::fused_attention_backward(bp);
  // The term's table gradients into its parameters' (in a fixed order); RoPE rotates dq, dk back.
  std::visit([&](const auto& term) { term.fold_grads(kg); }, p.term);
  if (g.dsinks.data != nullptr) copy_dense(dsinks.data(), g.dsinks);
  return true;
}

void attention_impl(View<const float, 4> q, View<const float, 4> k, View<const float, 4> v,
                    const PositionScheme& scheme, const AttentionOptions& options,
                    View<float, 4> out, const View<float, 3>* lse, const Positions* query_positions,
                    const Positions* key_positions) {
  if (detail::forward_model_inputs(q, k, v, scheme, options, out, query_positions,
                                   [&](auto qv, auto vv, const AttentionOptions& o, auto ov) {
                                     attention_impl(qv, k, vv, scheme, o, ov, lse, query_positions,
                                                    key_positions);
                                   })) {
    return;
  }
  detail::require_data(out, "attention: out");
  // Inputs are not scanned for NaN/Inf up front (on a decode step that pass would read the whole
  // KV cache a second time); a non-finite output is traced back to its input below instead.
  auto pr = make_problem<float>(q, k, v, out.shape, options, query_positions, key_positions,
                                /*check_finite=*/false);
  if (lse) {
    require_grad(*lse, {pr.d.batch, pr.d.heads_q, pr.d.seq_q},
                 std::string("attention: lse [batch, heads_q, seq_q]"));
  }
  int nan_score = 0, nonfinite_out = 0;
  bool fused = false;
  {
    const auto p = prepare<float>(scheme, options, pr.d, q, k, pr.qp, pr.kp,
                                  /*simple_path=*/false);
    check_fully_masked(pr);
    fused = run_fused(pr, p, out, &nan_score, &nonfinite_out, lse);
  }
  if (!fused) {
    // Outside the fused kernel's domain (positions too sparse for int32 distance tables, a
    // non-contiguous last dimension): the simple path.
    const auto pn = prepare<float>(scheme, options, pr.d, q, k, pr.qp, pr.kp);
    run<float>(pr, pn, out, lse);
  }
  // The fused kernel checks its output rows as it writes them (in parallel); the simple path's
  // output is checked here.
  if (nan_score != 0 || (fused ? nonfinite_out != 0 : !all_finite(out))) {
    require_finite_inputs(q, k, v);
    fail(
        "attention: the output is not finite although q, k and v are: the scores overflow "
        "float32 (inputs or scale too large)");
  }
}

}  // namespace
}  // namespace attn

using attn::all_finite;
using attn::attention_impl;
using attn::check_fully_masked;
using attn::Dims;
using attn::fill_fused_params;
using attn::FusedTables;
using attn::make_problem;
using attn::prepare;

bool detail::attention_fused_storage(const StorageViews& s, const PositionScheme& scheme,
                                     const AttentionOptions& options,
                                     const Positions* query_positions,
                                     const Positions* key_positions, const PagedKeys* paged) {
  detail::require_data(s.out, "attention: out");
  auto pr = make_problem<float>(s.q, s.k, s.v, s.out.shape, options, query_positions, key_positions,
                                /*check_finite=*/false);
  const Dims& d = pr.d;
  if (!s.q.last_dim_contiguous() || !s.k.last_dim_contiguous() || !s.v.last_dim_contiguous() ||
      !s.out.last_dim_contiguous() || d.batch == 0 || d.seq_q == 0 || d.seq_k == 0) {
    return false;
  }
  const auto p = prepare<float>(scheme, options, d, s.q, s.k, pr.qp, pr.kp,
                                /*simple_path=*/false);
  if (paged == nullptr) check_fully_masked(pr);
  kernels::FusedAttentionParams fp;
  FusedTables tables;
  if (!fill_fused_params(pr, p, tables, fp, /*allow_rope_copies=*/false)) return false;
  if (paged != nullptr) {
    fp.pages = paged->block_table;
    fp.pages_stride = paged->table_stride;
    fp.page_size = paged->page_size;
    fp.kv_len = paged->kv_len;
  }
  auto bits = [](const float* x) { return reinterpret_cast<const uint16_t*>(x); };
  fp.q_type = s.q_type;
  fp.kv_type = s.kv_type;
  fp.out_type = s.out_type;
  if (fp.q_type != DType::kF32) fp.q16 = bits(fp.q), fp.q = nullptr;
  if (fp.kv_type != DType::kF32) {
    fp.k16 = bits(fp.k), fp.k = nullptr;
    fp.v16 = bits(fp.v), fp.v = nullptr;
  }
  fp.out = s.out.data;
  fp.out_stride = {s.out.stride[0], s.out.stride[1], s.out.stride[2]};
  if (fp.out_type != DType::kF32) {
    fp.out16 = reinterpret_cast<uint16_t*>(fp.out);
    fp.out = nullptr;
  }
  int nan_score = 0;
  fp.nan_score = &nan_score;
  int empty = 0;
  if (attn::reports_empty_rows(pr)) fp.empty_row = &empty;
  kernels::fused_attention(fp);
  if (empty != 0) {
    // Every row sees a key: the row's scores were NaN, which the widened path reports by input.
    attn::fail_if_fully_masked(pr, tables.mask);
    return false;
  }
  if (nan_score != 0) return false;
  if (fp.out_type == DType::kF32) return all_finite(s.out);
  // Half output: an infinity or NaN may come from the float32 result (the widened path reports
  // it) or from rounding a finite result past the type's range (the widened path gives the same).
  const uint16_t exp_mask = fp.out_type == DType::kBF16 ? 0x7f80 : 0x7c00;
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t i = 0; i < d.seq_q; ++i)
      for (int64_t h = 0; h < d.heads_q; ++h) {
        const uint16_t* row =
            fp.out16 + b * s.out.stride[0] + i * s.out.stride[1] + h * s.out.stride[2];
        for (int64_t c = 0; c < d.head_dim; ++c) {
          if ((row[c] & exp_mask) == exp_mask) return false;
        }
      }
  return true;
}

void attention(View<const float, 4> q, View<const float, 4> k, View<const float, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options, View<float, 4> out,
               const Positions* query_positions, const Positions* key_positions) {
  attention_impl(q, k, v, scheme, options, out, nullptr, query_positions, key_positions);
}

void attention(View<const float, 4> q, View<const float, 4> k, View<const float, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options, View<float, 4> out,
               View<float, 3> lse, const Positions* query_positions,
               const Positions* key_positions) {
  attention_impl(q, k, v, scheme, options, out, &lse, query_positions, key_positions);
}

void attention_backward(View<const float, 4> q, View<const float, 4> k, View<const float, 4> v,
                        View<const float, 4> out, View<const float, 3> lse,
                        View<const float, 4> dout, const PositionScheme& scheme,
                        const AttentionOptions& options, const AttentionGrads& grads,
                        const Positions* query_positions, const Positions* key_positions) {
  const auto self = [](auto&&... a) { attention_backward(a...); };
  if (detail::backward_model_inputs(self, q, k, v, out, lse, dout, scheme, options, grads,
                                    query_positions, key_positions)) {
    return;
  }
  auto pr = make_problem<float>(q, k, v, q.shape, options, query_positions, key_positions);
  const auto p = prepare<float>(scheme, options, pr.d, q, k, pr.qp, pr.kp,
                                /*simple_path=*/false);
  // dq, dk, dv are zeroed only for the simple path: the fused kernel writes each element.
  attn::check_backward_args(pr, scheme, p, out, lse, dout, grads, /*zero_qkv=*/false);
  if (!attn::run_fused_backward(pr, p, out, lse, dout, grads)) {
    // Outside the fused kernel's domain: the simple path.
    attn::zero_qkv_grads(grads);
    const auto pn = prepare<float>(scheme, options, pr.d, q, k, pr.qp, pr.kp);
    attn::run_backward<float>(pr, pn, out, lse, dout, grads);
  }
}

}  // namespace posenc
