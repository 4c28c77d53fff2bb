// src/kernels/attention_kernels.h - the fused attention kernel's plain parameter struct.
//
// src/attention/fused.cc validates the public call, precomputes the per-scheme data that is O(L) or
// O(L*K) (bias-by-distance tables for ALiBi and T5, per-query / per-key projections for Shaw and
// DeBERTa, the projected distance table of Transformer-XL, RoPE's cos/sin by position) and fills
// this struct; the kernel (attention_hwy.cc) never sees views or schemes, only pointers and
// sizes. No Highway types cross this header.
#pragma once

#include <array>
#include <cstdint>

#include "core/mask.h"
#include "kernels/rope_kernels.h"
#include "posenc/dtype.h"

namespace posenc::kernels {

struct FusedAttentionParams {
  // q [batch, seq_q, heads_q, head_dim], k and v [batch, seq_k, heads_kv, head_dim],
  // out [batch, seq_q, heads_q, head_dim]; strides in elements for (batch, seq, head), the last
  // dimension contiguous.
  const float* q = nullptr;
  std::array<int64_t, 3> q_stride{};
  const float* k = nullptr;
  std::array<int64_t, 3> k_stride{};
  const float* v = nullptr;
  std::array<int64_t, 3> v_stride{};
  float* out = nullptr;
  std::array<int64_t, 3> out_stride{};
  int64_t batch = 0, seq_q = 0, seq_k = 0, heads_q = 0, heads_kv = 0, head_dim = 0;

  // Half-precision storage (forward only): q_type for q, kv_type for k and v, out_type for out,
  // each kF32 (the float pointers above) or kBF16 / kF16 (the pointers below, same strides in
  // elements; the float pointer is then null). Rows are widened exactly as they are loaded and
  // the output rounded once (to nearest even).
  DType q_type = DType::kF32, kv_type = DType::kF32, out_type = DType::kF32;
  const uint16_t* q16 = nullptr;
  const uint16_t* k16 = nullptr;
  const uint16_t* v16 = nullptr;
  uint16_t* out16 = nullptr;

  float scale = 1.0f;
  // Logit soft-capping: every score s (scale, terms and bias included) becomes
  // softcap * tanh(s / softcap) before the mask; 0: none.
  float softcap = 0.0f;
  // Causal, window, chunk (core/mask.h). With chunks the positions below are relative to a
  // multiple of the chunk, and non-negative.
  detail::MaskRule mask;
  // Block masks (AttentionOptions::block_mask) per token, nullptr = unset: document ids qdoc
  // [batch, seq_q] and kdoc [batch, seq_k] (a key is visible only to queries of its document);
  // qopen / kopen nonzero: the query sees every key / the key is seen by every query of its
  // document, whatever `mask` says; dense [batch, seq_q, seq_k] bytes (strides in elements, the
  // batch stride 0 when broadcast), nonzero: visible. kernels/block_mask.h skips tiles by them.
  const int32_t* qdoc = nullptr;
  const int32_t* kdoc = nullptr;
  const int32_t* qopen = nullptr;
  const int32_t* kopen = nullptr;
  const uint8_t* dense = nullptr;
  std::array<int64_t, 3> dense_stride{};
  // Set to 1 (by any thread) when a row sees no key (and there is no sink): the API reports it.
  int* empty_row = nullptr;
  // Attention sinks [heads_q] (dense; nullptr = none): an extra logit in each row's softmax
  // denominator, with no value.
  const float* sinks = nullptr;

  // Positions per batch row, relative to a per-row base so they fit int32: qpos [batch, seq_q],
  // kpos [batch, seq_k].
  const int32_t* qpos = nullptr;
  const int32_t* kpos = nullptr;

  // Additive bias as a function of delta = pos_q - pos_k (ALiBi, T5): for batch row b and query
  // head h, bias(delta) = bias[b * bias_batch_stride + h * bias_len + (bias_dmax[b] - delta)].
  // nullptr: no bias.
  const float* bias = nullptr;
  int64_t bias_len = 0;
  int64_t bias_batch_stride = 0;
  const int32_t* bias_dmax = nullptr;  // [batch]

  // Shaw et al.: per-query projections are computed inside the kernel from these tables
  // ([2K+1, table_heads, head_dim], contiguous; table_heads 1 or heads_q). rel_v may be null.
  const float* shaw_rel_k = nullptr;
  const float* shaw_rel_v = nullptr;
  int64_t shaw_k = 0;
  int64_t shaw_rel_k_heads = 1, shaw_rel_v_heads = 1;

  // DeBERTa: pos_key and pos_query [2K, heads_q, head_dim] dense; the kernel forms the c2p
  // products q . pos_key per query block and the p2c products k . pos_query per key. Row indices
  // by distance: deberta_c2p / deberta_p2c [deberta_len] at (deberta_dmax[b] - delta).
  const float* deberta_pos_key = nullptr;
  const float* deberta_pos_query = nullptr;
  int64_t deberta_span = 0;  // K
  const int32_t* deberta_c2p = nullptr;
  const int32_t* deberta_p2c = nullptr;
  int64_t deberta_len = 0;
  const int32_t* deberta_dmax = nullptr;

  // Transformer-XL: the kernel projects r(delta) = W_r R(delta) itself (a GEMM): xl_sin holds
  // R(delta) [xl_len, xl_dmodel] for delta = xl_dmax - t, t < xl_len (the distances a mask can
  // leave visible); xl_rnet is W_r [heads_q * head_dim, xl_dmodel] dense;
  // xl_content_bias = u (r_w_bias) and xl_position_bias = v (r_r_bias) [heads_q, head_dim] dense.
  // Scores: (q + u) . k in the main product, and (q + v) . r(delta) from a per-block product
  // against the band of distances it needs.
  const float* xl_sin = nullptr;
  const float* xl_rnet = nullptr;
  int64_t xl_dmodel = 0;
  int64_t xl_len = 0;
  int64_t xl_dmax = 0;
  const float* xl_content_bias = nullptr;
  const float* xl_position_bias = nullptr;

  // RoPE, rotated by the kernels as they load rows (rope.cs != nullptr; q and k above are then
  // the unrotated inputs): query row (b, i) by table row qpos[b, i] + rope_base[b], key row
  // (b, j) by kpos[b, j] + rope_base[b]. The rotated rows equal apply_rope's bit for bit.
  RopeRowTable rope;
  const int64_t* rope_base = nullptr;  // [batch]

  int num_threads = 0;

  // Optional: the per-row log-sum-exp, lse[b * s0 + h * s1 + i * s2] = m + log(l) (-inf for a
  // row with no visible key).
  float* lse = nullptr;
  std::array<int64_t, 3> lse_stride{};

  // Set to 1 (by any thread) when a visible score is not finite; the API then finds and reports
  // the offending input. Such scores would otherwise vanish: exp(NaN) is 0 in the kernel.
  int* nan_score = nullptr;
  // Set to 1 (by any thread) when a float32 output element is not finite (null: not checked).
  int* nonfinite_out = nullptr;
  // Float32 q and k hold bf16 values exactly (low 16 bits zero, none subnormal: bf16 training's
  // widened tensors; the backward: v and dout too), set only when bf16_dot_prefill()
  // (bf16_dot.h): the score tiles then come from vdpbf16ps, as for a bf16 query and keys.
  bool bf16_operands = false;

  // ---- Paged KV cache (attention_paged, posenc/paged.h; forward only) -------------------------
  // pages == nullptr: k and v are the contiguous tensors above. Otherwise k and v (k16, v16) are
  // page pools and key j of batch row b, kv head g, sits at
  //   k + pages[b * pages_stride + j / page_size] * k_stride[0] + (j % page_size) * k_stride[1]
  //     + g * k_stride[2]
  // (k_stride[0]: elements between pages; v alike), read page by page inside the key loop.
  const int32_t* pages = nullptr;  // block table [batch, pages_stride]
  int64_t pages_stride = 0;
  int64_t page_size = 0;
  // Keys of each batch row [batch] (nullptr: seq_k for every row): row b reads keys
  // [0, kv_len[b]) only; seq_k is the longest row's.
  const int32_t* kv_len = nullptr;
};

// The backward's parameters: the forward's (inputs, positions, scheme tables; out and lse as the
// forward wrote them) plus dout and the gradients. Every gradient is overwritten.
struct FusedBackwardParams {
  FusedAttentionParams fwd;  // fwd.out: the forward's output; fwd.lse: its log-sum-exp
  const float* dout = nullptr;
  std::array<int64_t, 3> dout_stride{};
  // dq like q, dk and dv like k and v (strides for batch, seq, head; last dimension contiguous).
  // With RoPE, dq and dk are with respect to the rotated q and k (the API rotates them back).
  float* dq = nullptr;
  std::array<int64_t, 3> dq_stride{};
  float* dk = nullptr;
  std::array<int64_t, 3> dk_stride{};
  float* dv = nullptr;
  std::array<int64_t, 3> dv_stride{};
  // ALiBi, T5: sum of dS per (batch row, query head, distance), laid out as fwd.bias.
  float* dbias = nullptr;
  // Attention sinks: dsink_h = -sum_i exp(sink_h - lse_i) dout_i . out_i [heads_q] (dense).
  float* dsinks = nullptr;
  // Shaw: drel_k, drel_v dense like fwd.shaw_rel_k / shaw_rel_v (drel_v null: not wanted).
  float* shaw_drel_k = nullptr;
  float* shaw_drel_v = nullptr;
  // DeBERTa: dense [2K, heads_q, head_dim].
  float* deberta_dpos_key = nullptr;
  float* deberta_dpos_query = nullptr;
  // Transformer-XL: dr_w_bias, dr_r_bias [heads_q, head_dim] and dr_net [heads_q * head_dim,
  // d_model], dense.
  float* xl_du = nullptr;
  float* xl_dv = nullptr;
  float* xl_drnet = nullptr;
  // fwd.bf16_operands: here q, k, v and dout hold bf16 values, and the score tiles S = Q K^T and
  // dP = dO V^T come from vdpbf16ps (the same exact products, summed in another order).
};

// FlashAttention-2's backward with recomputation: scores rebuilt tile by tile from q, k and lse.
// One work item per (batch row, kv head), run by one thread; table gradients are summed per item
// and reduced in item order, so results do not depend on the thread count.
void fused_attention_backward(const FusedBackwardParams& p);

// The per-thread budget (bytes) under which an item of the backward forms its key operands once
// and keeps dK, dV in item buffers (default 32 MiB). Tests set it to 0 to run the tile-by-tile
// path on small shapes; a negative value restores the default. Not thread-safe with running calls.
void set_backward_item_budget_for_test(int64_t bytes);
int64_t backward_item_budget();

// Flash-attention forward: tiles of queries x keys with a running max and sum, float32
// accumulation, never materializing seq_q x seq_k. Rows with no visible key get 0 (the API has
// already rejected them unless allowed).
void fused_attention(const FusedAttentionParams& p);

// For tests: y[i] = the forward's softmax exponential of x[i] <= 0 (ExpSoftmax in
// attention-inl.h), on the dispatched target.
void softmax_exp_for_test(const float* x, float* y, int64_t n);

}  // namespace posenc::kernels
