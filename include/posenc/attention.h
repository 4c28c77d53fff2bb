// posenc/attention.h - scaled dot-product attention with any positional scheme
// (docs/attention.md).
//
// Shapes: q [batch, seq_q, heads_q, head_dim], k [batch, seq_k, heads_kv, head_dim],
// v [batch, seq_k, heads_kv, v_dim], out [batch, seq_q, heads_q, v_dim]; heads_kv divides heads_q
// and query head h reads kv head h / (heads_q / heads_kv) (MHA, GQA, MQA). v_dim is head_dim or
// narrower (DeepSeek's multi-head latent attention: 128-dim values under 192-dim queries); a
// narrower v is computed as if zero-padded to head_dim, which adds only zero output dims. Any
// strides.
// Default positions: key j at j, query i at seq_k - seq_q + i (the new queries are the last seq_q
// tokens: the KV-cache convention). rel(i, j) = pos_k(j) - pos_q(i); causal: key visible iff
// rel <= 0 (and, with a window w, iff |rel| < w).
// Scores: s = scale * (q.k + relative-content terms) + bias, masked, softmax over keys, weighted
// sum of values (+ Shaw's value term). Default scale 1/sqrt(head_dim) (DeBERTa 1/sqrt(3 head_dim)).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "posenc/alibi.h"
#include "posenc/deberta.h"
#include "posenc/half.h"
#include "posenc/rope.h"
#include "posenc/shaw.h"
#include "posenc/t5.h"
#include "posenc/tensor.h"
#include "posenc/xl.h"

namespace posenc {

// No positional information: attention is permutation-equivariant (bidirectional).
struct NoPositions {};

// RoPE applied to q (at query positions) and k (at key positions) before the dot product.
// offset: the first rotated dim of each head; dims [offset, offset + rotary_dim) rotate and the
// others pass through (DeepSeek's decoupled RoPE: heads [qk_nope | qk_rope], offset qk_nope).
struct Rope {
  RopeFrequencies freqs;
  RopeStyle style = RopeStyle::kHalf;
  int64_t offset = 0;
};

// ALiBi. Empty slopes: computed for heads_q heads with max_bias (alibi_slopes()).
struct Alibi {
  std::vector<double> slopes;
  double max_bias = 8.0;
};

// T5 bias: table [num_buckets, heads_q]. Bucketing is bidirectional unless the attention is
// causal, or as `bidirectional` says when set.
struct T5Bias {
  View<const float, 2> table;
  int64_t max_distance = 128;
  std::optional<bool> bidirectional;
};

using PositionScheme = std::variant<NoPositions, Rope, Alibi, T5Bias, Shaw, TransformerXL, DeBERTa>;

// Scheme name as the CLI spells it: none, rope, alibi, t5, shaw, xl, deberta.
std::string scheme_name(const PositionScheme& scheme);

// Llama 4's attention-temperature tuning on its NoPE layers: the query at position p is scaled by
// log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1 before the scores.
struct AttentionTemperature {
  double floor_scale = 8192;
  double attn_scale = 0.1;
};
// The factor for a query at position `pos`, evaluated as the reference code does (float32).
double attention_temperature(const AttentionTemperature& t, int64_t pos);

// Block-sparse masks (docs/attention.md, Block masks), on top of causal, window and chunk. The
// fused kernels evaluate them per tile of queries x keys: a tile no query of which sees any key
// is skipped (never computed), a tile every cell of which is visible runs without a mask. Each
// part is optional (an empty view: unset):
//   documents  query i sees key j only when query_documents[b, i] == key_documents[b, j]
//              ([batch, seq_q] and [batch, seq_k], both or neither): packed sequences;
//   prefix     prefix-LM: keys at positions < prefix[...] are seen by every query (of their
//              document), whatever causal, window and chunk say. [batch] (one prefix length per
//              row), or, with documents, [num_documents] indexed by the key's document id (ids
//              then in [0, num_documents));
//   global     global tokens (Longformer, BigBird): a token at one of these positions sees every
//              key and is seen by every query (of its document), whatever causal, window and
//              chunk say;
//   dense      an arbitrary boolean mask [batch or 1, seq_q, seq_k] (nonzero: may attend) ANDed
//              with the rest. It costs one byte read per query-key pair (the mask itself,
//              O(seq_q x seq_k) memory) on top of the attention; tiles it hides entirely are
//              skipped.
// visible(i, j) = same document and dense(i, j) and (global(i) or global(j) or prefix(j) or
//                 causal / window / chunk say so).
struct BlockMask {
  View<const int32_t, 2> query_documents, key_documents;
  View<const int64_t, 1> prefix;
  std::vector<int64_t> global_positions;
  View<const uint8_t, 3> dense;

  bool empty() const {
    return query_documents.data == nullptr && key_documents.data == nullptr &&
           prefix.data == nullptr && global_positions.empty() && dense.data == nullptr;
  }
};

struct AttentionOptions {
  bool causal = false;
  std::optional<double> scale;      // default 1/sqrt(D) (DeBERTa 1/sqrt(3D))
  std::optional<int64_t> window;    // sliding window w >= 1: visible iff |rel| < w
  bool allow_fully_masked = false;  // a row with no visible key: output 0 instead of error
  int num_threads = 0;              // 0 = all available
  // Chunked local attention (Llama 4): key visible only within the query's chunk,
  // floor(pos_k / c) == floor(pos_q / c) (positions >= 0), on top of the other masks.
  std::optional<int64_t> chunk;
  // Attention sinks (gpt-oss): one learned logit per query head [heads_q], an extra entry in each
  // row's softmax denominator with no value vector, added unscaled and never masked. Empty: none.
  // With sinks a row with no visible key is well defined (out = 0, lse = sink) and not an error.
  View<const float, 1> sinks;
  // Query temperature (Llama 4's NoPE layers): query row i is multiplied by
  // attention_temperature(*query_temperature, pos_q(i)) before anything else (in float32 on the
  // float32 and half-precision paths, the widened query times the factor rounded to float32; in
  // float64 in the oracle). The backward's dq is with respect to the unscaled q.
  std::optional<AttentionTemperature> query_temperature;
  // Logit soft-capping (Gemma 2, Grok): each score s = scale * (q.k + relative-content terms) +
  // bias becomes softcap * tanh(s / softcap) before the mask and the softmax (sinks are not
  // capped). softcap > 0; unset: no cap.
  std::optional<double> softcap;
  // Document, prefix-LM, global-token and dense masks (BlockMask).
  BlockMask block_mask;
};

// Float32 attention, fused: a flash-attention kernel (Highway SIMD, OpenMP threads over
// (batch, kv head, query block)) that computes every scheme inside its tiles and never forms the
// [seq_q, seq_k] score matrix; memory O(threads x block) beyond the inputs and O(L) or O(L x K)
// scheme tables. Results are bit-identical for any options.num_threads. Positions: nullptr = the
// defaults (key j at j, query i at seq_k - seq_q + i). Throws ShapeError / ValueError naming the
// argument (shapes, heads ratio, scheme tables, positions, fully masked rows). `out` must not
// overlap the inputs. Thread-safe for distinct outputs. Views whose last dimension is strided, and
// positions too sparse for int32 distance tables, take the simple path (attention_naive).
void attention(View<const float, 4> q, View<const float, 4> k, View<const float, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options, View<float, 4> out,
               const Positions* query_positions = nullptr,
               const Positions* key_positions = nullptr);

// Half precision (posenc/half.h): q, k, v and out all bf16 or all f16, or float32 q and out with
// a bf16 / f16 KV cache (k, v), as decoding engines keep it. Inputs widen exactly to float32, the
// attention is the float32 attention() of the widened values, and out is rounded once to its
// type (docs/precision.md gives the error against the float64 oracle on the same inputs).
// Same contract, validation and positions as the float32 function.
void attention(View<const bf16, 4> q, View<const bf16, 4> k, View<const bf16, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options, View<bf16, 4> out,
               const Positions* query_positions = nullptr,
               const Positions* key_positions = nullptr);
void attention(View<const f16, 4> q, View<const f16, 4> k, View<const f16, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options, View<f16, 4> out,
               const Positions* query_positions = nullptr,
               const Positions* key_positions = nullptr);
void attention(View<const float, 4> q, View<const bf16, 4> k, View<const bf16, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options, View<float, 4> out,
               const Positions* query_positions = nullptr,
               const Positions* key_positions = nullptr);
void attention(View<const float, 4> q, View<const f16, 4> k, View<const f16, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options, View<float, 4> out,
               const Positions* query_positions = nullptr,
               const Positions* key_positions = nullptr);

// The simple float32 path: one row of scores at a time, float accumulation, single thread.
// The yardstick of the fused kernel's tolerance (twice its error against the float64 oracle).
void attention_naive(View<const float, 4> q, View<const float, 4> k, View<const float, 4> v,
                     const PositionScheme& scheme, const AttentionOptions& options,
                     View<float, 4> out, const Positions* query_positions = nullptr,
                     const Positions* key_positions = nullptr);

// The forward with the per-row log-sum-exp: lse [batch, heads_q, seq_q] (any strides) receives
// the natural log of each row's softmax denominator, row maximum included:
// lse = log(sum_j exp(s_ij)) over the visible keys; -inf for a row with no visible key (when
// allowed). What the backward needs, and what merges partial attentions over disjoint key sets
// exactly (attention_merge).
void attention(View<const float, 4> q, View<const float, 4> k, View<const float, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options, View<float, 4> out,
               View<float, 3> lse, const Positions* query_positions = nullptr,
               const Positions* key_positions = nullptr);

// Merges two partial attentions over disjoint key sets (positions kept global) into the attention
// over their union: out = (exp(lse_a - m) out_a + exp(lse_b - m) out_b) / (exp(lse_a - m) +
// exp(lse_b - m)), lse = m + log(...), m = max(lse_a, lse_b). out_a/out_b [batch, seq_q, heads_q,
// head_dim], lse_a/lse_b [batch, heads_q, seq_q]; out and lse may alias the `a` inputs. A side
// whose lse is -inf (no visible key) contributes nothing; both -inf give out = 0, lse = -inf.
void attention_merge(View<const float, 4> out_a, View<const float, 3> lse_a,
                     View<const float, 4> out_b, View<const float, 3> lse_b, View<float, 4> out,
                     View<float, 3> lse);

// Gradients of attention, written (not accumulated) into the views given. dq, dk, dv have the
// shapes of q, k, v and are required. The gradient of each learned parameter of the scheme,
// named as the parameter (docs/attention.md, Parameter names) with a leading `d`, is computed
// when its view has data and must then have the parameter's shape:
//   T5      drelative_attention_bias [num_buckets, heads_q]
//   ALiBi   dslopes [heads_q]  (the slopes as a parameter; with or without Alibi::slopes given)
//   Shaw    drel_k, drel_v     like rel_k, rel_v ([2K+1, 1 or heads_q, head_dim])
//   XL      dr_w_bias, dr_r_bias [heads_q, head_dim], dr_net [heads_q * head_dim, d_model]
//   DeBERTa dpos_key, dpos_query [2K, heads_q, head_dim]  (for the p2c form in force)
// RoPE has no learned parameter: dq and dk are with respect to the unrotated q and k. A
// parameter gradient the scheme does not have is an error (a view for it that has data).
template <class T>
struct AttentionGradsOf {
  View<T, 4> dq, dk, dv;
  View<T, 2> drelative_attention_bias;
  View<T, 1> dslopes;
  View<T, 3> drel_k, drel_v;
  View<T, 2> dr_w_bias, dr_r_bias, dr_net;
  View<T, 3> dpos_key, dpos_query;
  View<T, 1> dsinks;  // [heads_q], when AttentionOptions::sinks is given
};
using AttentionGrads = AttentionGradsOf<float>;

// Backward of attention() (FlashAttention-2's recomputation): given q, k, v, the forward's out
// and lse, and dout = dLoss/dout [batch, seq_q, heads_q, head_dim], writes dq, dk, dv and the
// scheme's parameter gradients. The scheme, options and positions must be the forward's. Scores
// are rebuilt tile by tile from q, k and lse, never as a [seq_q, seq_k] matrix; table gradients
// are reduced in a fixed order, so results are bit-identical for any options.num_threads.
// Memory: the gradients plus O(threads x tile) plus the scheme's O(L) or O(L x K) tables. Rows
// with lse = -inf (no visible key) contribute nothing. Throws ShapeError / ValueError naming the
// argument. Gradients must not overlap the inputs or each other.
void attention_backward(View<const float, 4> q, View<const float, 4> k, View<const float, 4> v,
                        View<const float, 4> out, View<const float, 3> lse,
                        View<const float, 4> dout, const PositionScheme& scheme,
                        const AttentionOptions& options, const AttentionGrads& grads,
                        const Positions* query_positions = nullptr,
                        const Positions* key_positions = nullptr);

// The simple float32 backward: materialized score rows, float accumulation, single thread. The
// yardstick of the fused backward's tolerance.
void attention_backward_naive(View<const float, 4> q, View<const float, 4> k,
                              View<const float, 4> v, View<const float, 4> out,
                              View<const float, 3> lse, View<const float, 4> dout,
                              const PositionScheme& scheme, const AttentionOptions& options,
                              const AttentionGrads& grads,
                              const Positions* query_positions = nullptr,
                              const Positions* key_positions = nullptr);

// Packed variable-length sequences (FlashAttention's varlen layout): q [total_q, heads_q, D],
// k and v [total_k, heads_kv, D], sequence s holding queries [cu_seqlens_q[s], cu_seqlens_q[s+1])
// and keys [cu_seqlens_k[s], cu_seqlens_k[s+1]) (cu_seqlens: num_seqs + 1 offsets, 0 first,
// non-decreasing, the total last). No token attends across sequences. Positions restart in each
// sequence: key j of a sequence at j, query i at len_k - len_q + i (the KV-cache convention), or
// per token as given ([total] ids). A sequence with queries and no keys has fully masked rows
// (an error unless allowed or with sinks); one with more queries than keys needs positions.
//
// PackedSequences turns the layout into one batch row with document ids (BlockMask), so every
// attention function runs it: attention(as_batch(q), ..., packed.options(opt), as_batch(out),
// &packed.query_positions, &packed.key_positions) (float32, half, the backward, lse
// [1, heads_q, total_q]); the fused kernels skip the tiles between sequences, and the scheme's
// table gradients are summed over all sequences.
struct PackedSequences {
  std::vector<int64_t> cu_seqlens_q, cu_seqlens_k;
  Positions query_positions, key_positions;             // per token, [1, total]
  std::vector<int32_t> query_documents, key_documents;  // sequence index per token
  int64_t total_q = 0, total_k = 0;

  // `base` with the documents set (views into this object, which must outlive the call).
  AttentionOptions options(AttentionOptions base) const;
};

// Validates cu_seqlens (ValueError naming cu_seqlens_q / cu_seqlens_k and the entry) against the
// totals and builds the packed layout. query_positions / key_positions: per-token positions
// ([total] ids, Positions::shared) replacing the restarting defaults, or null.
PackedSequences pack_sequences(std::vector<int64_t> cu_seqlens_q, std::vector<int64_t> cu_seqlens_k,
                               int64_t total_q, int64_t total_k,
                               const Positions* query_positions = nullptr,
                               const Positions* key_positions = nullptr);

// [total, heads, D] as [1, total, heads, D] (the same memory).
template <class T>
View<T, 4> as_batch(const View<T, 3>& x) {
  return View<T, 4>{x.data,
                    {1, x.shape[0], x.shape[1], x.shape[2]},
                    {x.shape[0] * x.stride[0], x.stride[0], x.stride[1], x.stride[2]}};
}

// Float32 varlen attention (the packed layout above): out [total_q, heads_q, D], and lse
// [heads_q, total_q] when it has data.
void attention_varlen(View<const float, 3> q, View<const float, 3> k, View<const float, 3> v,
                      const PackedSequences& packed, const PositionScheme& scheme,
                      const AttentionOptions& options, View<float, 3> out, View<float, 2> lse = {});

namespace ref {
// Float64 parameter tables for the oracle, by parameter name (docs/attention.md, Parameter names).
// A view with data replaces the scheme's float32 table of the same name (which may then be empty,
// data == nullptr): the oracle computes with float64 parameters end to end, and
// ref::attention_backward's table gradients are with respect to these tables. Same shapes and rules
// as the scheme's views (any strides); a table the scheme does not have is a ValueError.
struct SchemeTables {
  View<const double, 2> relative_attention_bias;  // T5 [num_buckets, heads_q]
  View<const double, 3> rel_k, rel_v;             // Shaw [2K+1, 1 or heads_q, head_dim]
  View<const double, 2> r_w_bias, r_r_bias;       // Transformer-XL u, v [heads_q, head_dim]
  View<const double, 2> r_net;                    // Transformer-XL [heads_q * head_dim, d_model]
  View<const double, 3> pos_key, pos_query;       // DeBERTa [2K, heads_q, head_dim]
  View<const double, 1> sinks;                    // replaces AttentionOptions::sinks [heads_q]
};

// The float64 oracle: materialized scores, straight from the formulas of docs/attention.md. Same
// contract and validation; scheme tables are float32 (exactly promoted) unless float64 `tables`
// replace them.
void attention(View<const double, 4> q, View<const double, 4> k, View<const double, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options, View<double, 4> out,
               const Positions* query_positions = nullptr,
               const Positions* key_positions = nullptr);

// The oracle with the per-row log-sum-exp lse [batch, heads_q, seq_q] (float64).
void attention(View<const double, 4> q, View<const double, 4> k, View<const double, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options, View<double, 4> out,
               View<double, 3> lse, const Positions* query_positions = nullptr,
               const Positions* key_positions = nullptr);

// The float64 backward, materialized and written from the formulas (docs/attention.md): for
// P = exp(s - lse), dP_ij = dout_i . (v_j + rel_v[idx_ij]), D_i = dout_i . out_i,
// dS = P (dP - D); then each scheme's term passes dS to its inputs and tables.
void attention_backward(View<const double, 4> q, View<const double, 4> k, View<const double, 4> v,
                        View<const double, 4> out, View<const double, 3> lse,
                        View<const double, 4> dout, const PositionScheme& scheme,
                        const AttentionOptions& options, const AttentionGradsOf<double>& grads,
                        const Positions* query_positions = nullptr,
                        const Positions* key_positions = nullptr);

// Scores of one (batch row, query head) before masking and softmax, [seq_q, seq_k] row-major,
// including scale and every positional term. For property checks and plots.
std::vector<double> attention_scores(View<const double, 4> q, View<const double, 4> k,
                                     const PositionScheme& scheme, const AttentionOptions& options,
                                     int64_t batch_index, int64_t head,
                                     const Positions* query_positions = nullptr,
                                     const Positions* key_positions = nullptr);

// The same four functions with float64 parameter tables (SchemeTables) replacing the scheme's.
void attention(View<const double, 4> q, View<const double, 4> k, View<const double, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options,
               const SchemeTables& tables, View<double, 4> out,
               const Positions* query_positions = nullptr,
               const Positions* key_positions = nullptr);
void attention(View<const double, 4> q, View<const double, 4> k, View<const double, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options,
               const SchemeTables& tables, View<double, 4> out, View<double, 3> lse,
               const Positions* query_positions = nullptr,
               const Positions* key_positions = nullptr);
void attention_backward(View<const double, 4> q, View<const double, 4> k, View<const double, 4> v,
                        View<const double, 4> out, View<const double, 3> lse,
                        View<const double, 4> dout, const PositionScheme& scheme,
                        const AttentionOptions& options, const SchemeTables& tables,
                        const AttentionGradsOf<double>& grads,
                        const Positions* query_positions = nullptr,
                        const Positions* key_positions = nullptr);
std::vector<double> attention_scores(View<const double, 4> q, View<const double, 4> k,
                                     const PositionScheme& scheme, const AttentionOptions& options,
                                     const SchemeTables& tables, int64_t batch_index, int64_t head,
                                     const Positions* query_positions = nullptr,
                                     const Positions* key_positions = nullptr);

// The float64 varlen oracle, by definition: each sequence's attention on its own ([1, len, H, D]
// slices, its positions), concatenated. out [total_q, heads_q, D], lse [heads_q, total_q] when
// it has data. options.block_mask must be empty (prefix: one per sequence, `prefix` here).
void attention_varlen(View<const double, 3> q, View<const double, 3> k, View<const double, 3> v,
                      const PackedSequences& packed, const PositionScheme& scheme,
                      const AttentionOptions& options, const SchemeTables& tables,
                      View<double, 3> out, View<double, 2> lse = {});
}  // namespace ref

}  // namespace posenc
