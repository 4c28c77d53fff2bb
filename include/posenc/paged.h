// posenc/paged.h - attention over a paged KV cache, and RoPE-rotated appends into it
// (docs/attention.md, Paged KV caches).
//
// Inference engines (vLLM, FlashInfer, FlashAttention's block_table) keep keys and values in
// fixed-size pages addressed by a block table: key j of batch row b lives in page
// block_table[b][j / page_size] at slot j % page_size. Pages come in two layouts:
//   kTokenMajor  k_pages, v_pages [num_pages, page_size, heads_kv, head_dim]
//   kHeadMajor   k_pages, v_pages [num_pages, heads_kv, page_size, head_dim]
// Any strides, the last dimension contiguous for the fused kernel (other views take a gathered
// copy). block_table [batch, max_pages] and seq_lens [batch] are int32 (any strides): row b holds
// seq_lens[b] keys, at positions 0 .. seq_lens[b] - 1; only the table entries of pages in use
// (the first ceil(seq_lens[b] / page_size)) are read, and each must lie in [0, num_pages); rows
// may share pages (prefix sharing).
#pragma once

#include <cstdint>
#include <string>

#include "posenc/attention.h"
#include "posenc/half.h"
#include "posenc/tensor.h"

namespace posenc {

enum class PageLayout { kTokenMajor, kHeadMajor };

// Attention of q [batch, seq_q, heads_q, head_dim] over the cached keys of each row, written to
// out [batch, seq_q, heads_q, head_dim]. The result is attention() of the same q over each row's
// keys and values gathered into contiguous tensors (the same scheme, options and query
// positions, key j at position j): bit for bit when the rows have equal lengths (the fused
// kernel reads the pages in place, in the same order, for float32, bf16 and f16 caches alike);
// rows of different lengths may split a long row's keys for the decoding merge at other points,
// within the fused kernel's tolerance. Default query positions: seq_lens[b] - seq_q + i (decoding
// and chunked prefill: the new tokens' keys are already in the cache, so causal = true lets each
// see itself and what precedes it). Every scheme, causal / window / chunk masks, sinks, GQA and
// MQA. RoPE (scheme Rope) rotates q and the cached keys by position inside the kernel, so the
// pages hold UNROTATED keys; pages filled by rope_append hold rotated keys and are attended with
// NoPositions and a q rotated by apply_rope at the query positions instead.
// A row with seq_lens[b] == 0, or a query that sees no key under the mask, is an error unless
// options.allow_fully_masked (out = 0) or options.sinks are given, as in attention().
// Throws ShapeError / ValueError naming the argument: shapes, layouts, heads ratio, dtypes (by
// overload), block-table entries outside [0, num_pages), seq_lens negative or above
// max_pages * page_size, query positions. `out` must not overlap the inputs. Thread-safe for
// distinct outputs; bit-identical for any options.num_threads.
void attention_paged(View<const float, 4> q, View<const float, 4> k_pages,
                     View<const float, 4> v_pages, PageLayout layout,
                     View<const int32_t, 2> block_table, View<const int32_t, 1> seq_lens,
                     const PositionScheme& scheme, const AttentionOptions& options,
                     View<float, 4> out, const Positions* query_positions = nullptr);
// Half-precision caches with a float32 q and out, and all-bf16 / all-f16 calls (q, pages, out);
// the output rounded once, as attention()'s half-precision overloads.
void attention_paged(View<const float, 4> q, View<const bf16, 4> k_pages,
                     View<const bf16, 4> v_pages, PageLayout layout,
                     View<const int32_t, 2> block_table, View<const int32_t, 1> seq_lens,
                     const PositionScheme& scheme, const AttentionOptions& options,
                     View<float, 4> out, const Positions* query_positions = nullptr);
void attention_paged(View<const float, 4> q, View<const f16, 4> k_pages, View<const f16, 4> v_pages,
                     PageLayout layout, View<const int32_t, 2> block_table,
                     View<const int32_t, 1> seq_lens, const PositionScheme& scheme,
                     const AttentionOptions& options, View<float, 4> out,
                     const Positions* query_positions = nullptr);
void attention_paged(View<const bf16, 4> q, View<const bf16, 4> k_pages,
                     View<const bf16, 4> v_pages, PageLayout layout,
                     View<const int32_t, 2> block_table, View<const int32_t, 1> seq_lens,
                     const PositionScheme& scheme, const AttentionOptions& options,
                     View<bf16, 4> out, const Positions* query_positions = nullptr);
void attention_paged(View<const f16, 4> q, View<const f16, 4> k_pages, View<const f16, 4> v_pages,
                     PageLayout layout, View<const int32_t, 2> block_table,
                     View<const int32_t, 1> seq_lens, const PositionScheme& scheme,
                     const AttentionOptions& options, View<f16, 4> out,
                     const Positions* query_positions = nullptr);

// Appends new keys (and values) to a paged cache, the keys rotated by RoPE on the way, in one
// pass. k_new [batch, n_new, heads_kv, head_dim] (v_new likewise, or an empty view: keys only;
// then v_pages may be empty too). seq_lens counts the new tokens already: token i of row b goes
// to cache index j = seq_lens[b] - n_new + i (page block_table[b][j / page_size], slot
// j % page_size), so an engine bumps seq_lens first and calls attention_paged with the same
// seq_lens afterwards. Key positions: j by default, else positions [batch, n_new]. The key is
// rotated exactly as apply_rope(rope.freqs, rope.style) rotates it (dims [rope.offset,
// rope.offset + rotary_dim); accurate angles) and rounded once (to nearest even) to the pages'
// type; values are copied (rounded once from float32). So the pages hold ROTATED keys: attend
// with NoPositions on a q rotated by apply_rope at the query positions (see attention_paged).
// Rows must not write the same slot (shared pages are read-only). Throws ShapeError /
// ValueError naming the argument (shapes, n_new > seq_lens[b], seq_lens above
// max_pages * page_size, block-table entries outside [0, num_pages), positions).
void rope_append(View<const float, 4> k_new, View<const float, 4> v_new, const Rope& rope,
                 View<float, 4> k_pages, View<float, 4> v_pages, PageLayout layout,
                 View<const int32_t, 2> block_table, View<const int32_t, 1> seq_lens,
                 const Positions* positions = nullptr, int num_threads = 0);
void rope_append(View<const float, 4> k_new, View<const float, 4> v_new, const Rope& rope,
                 View<bf16, 4> k_pages, View<bf16, 4> v_pages, PageLayout layout,
                 View<const int32_t, 2> block_table, View<const int32_t, 1> seq_lens,
                 const Positions* positions = nullptr, int num_threads = 0);
void rope_append(View<const float, 4> k_new, View<const float, 4> v_new, const Rope& rope,
                 View<f16, 4> k_pages, View<f16, 4> v_pages, PageLayout layout,
                 View<const int32_t, 2> block_table, View<const int32_t, 1> seq_lens,
                 const Positions* positions = nullptr, int num_threads = 0);
void rope_append(View<const bf16, 4> k_new, View<const bf16, 4> v_new, const Rope& rope,
                 View<bf16, 4> k_pages, View<bf16, 4> v_pages, PageLayout layout,
                 View<const int32_t, 2> block_table, View<const int32_t, 1> seq_lens,
                 const Positions* positions = nullptr, int num_threads = 0);
void rope_append(View<const f16, 4> k_new, View<const f16, 4> v_new, const Rope& rope,
                 View<f16, 4> k_pages, View<f16, 4> v_pages, PageLayout layout,
                 View<const int32_t, 2> block_table, View<const int32_t, 1> seq_lens,
                 const Positions* positions = nullptr, int num_threads = 0);

// "token_major" / "head_major", and back (ValueError naming the accepted names).
const char* page_layout_name(PageLayout layout);
PageLayout parse_page_layout(const std::string& name);

}  // namespace posenc
