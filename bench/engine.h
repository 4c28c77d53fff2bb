// bench/engine.h - `posenc bench` entries for what engines feed attention: packed
// variable-length sequences, soft-capping and block (document) masks, each with its same-run
// ratio to the call it replaces (timed in alternation, measure_pair).
#pragma once

#include <cstdint>

#include "harness.h"

namespace posenc::bench {

// Packed sequences: `docs` causal documents of `len` tokens each, heads_q = heads_kv = 8,
// head_dim 128, scheme none, one posenc::attention call on the packed layout (documents,
// restarting positions): "varlen_causal_<docs>x<len>_H8_D128". flops: the documents' causal
// attention. Extra fields: vs_separate (its time over the summed time of `docs` separate calls,
// one per document; target <= 1.1), vs_dense (its time over dense causal attention over all
// docs x len tokens; target <= 0.1) and their medians.
Result bench_varlen(int64_t docs, int64_t len, int threads, const TimingOptions& options);

// Causal attention with logit soft-capping (cap 50, Gemma 2's), scheme none, [1, seq, 8, 128]:
// "attention_softcap_causal_L<seq>_H8_D128", flops as bench_attention. Extra: vs_no_cap (its
// time over the same call without the cap; target <= 1.1) and no_cap_median_s.
Result bench_softcap(int64_t seq, int threads, const TimingOptions& options);

// A document mask (AttentionOptions::block_mask documents) over `docs` bidirectional documents
// of `len` tokens in one row, heads 2, head_dim 128, scheme none:
// "document_mask_<docs>x<len>_H2_D128". flops: the documents' attention. Extra: vs_dense (its
// time over dense bidirectional attention over the row; the tiles between documents are
// skipped, so about 1 / docs) and dense_median_s.
Result bench_document_mask(int64_t docs, int64_t len, int threads, const TimingOptions& options);

}  // namespace posenc::bench
