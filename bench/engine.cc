// bench/engine.cc - the varlen, soft-capping and document-mask entries of `posenc bench`
// (engine.h).
#include "engine.h"

#include <functional>
#include <random>
#include <string>
#include <vector>

namespace posenc::bench {

namespace {

Buffer uniform(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Buffer x(n);
  for (int64_t i = 0; i < n; ++i) x.data()[i] = u(rng);
  return x;
}

// q, k, v, out of [1, tokens, heads, 128].
struct Packed {
  int64_t tokens, heads;
  Buffer q, k, v, out;
  Packed(int64_t t, int64_t h)
      : tokens(t),
        heads(h),
        q(uniform(t * h * 128, 1)),
        k(uniform(q.size(), 2)),
        v(uniform(q.size(), 3)),
        out(uniform(q.size(), 4)) {}
  std::array<int64_t, 4> shape(int64_t n) const { return {1, n, heads, 128}; }
  // Rows [at, at + n) of the packed row as their own batch row.
  View<const float, 4> in(const Buffer& x, int64_t at, int64_t n) const {
    return View<const float, 4>::contiguous(x.data() + at * heads * 128, shape(n));
  }
  View<float, 4> o(int64_t at, int64_t n) {
    return View<float, 4>::contiguous(out.data() + at * heads * 128, shape(n));
  }
  // A workload: attention over the whole row (scheme none) with options `o` (kept by reference).
  std::function<void()> whole(const AttentionOptions& o) {
    return [this, &o] {
      attention(in(q, 0, tokens), in(k, 0, tokens), in(v, 0, tokens), NoPositions{}, o,
                this->o(0, tokens));
    };
  }
};

}  // namespace

Result bench_varlen(int64_t docs, int64_t len, int threads, const TimingOptions& options) {
  threads = resolve_threads(threads);
  const int64_t total = docs * len;
  Packed p(total, 8);
  std::vector<int64_t> cu(static_cast<std::size_t>(docs + 1));
  for (int64_t s = 0; s <= docs; ++s) cu[static_cast<std::size_t>(s)] = s * len;
  const PackedSequences packed = pack_sequences(cu, cu, total, total);
  const AttentionOptions base{.causal = true, .num_threads = threads};
  const AttentionOptions opt = packed.options(base);
  const auto varlen = [&] {
    attention(p.in(p.q, 0, total), p.in(p.k, 0, total), p.in(p.v, 0, total), NoPositions{}, opt,
              p.o(0, total), &packed.query_positions, &packed.key_positions);
  };
  const auto separate = [&] {
    for (int64_t s = 0; s < docs; ++s) {
      attention(p.in(p.q, s * len, len), p.in(p.k, s * len, len), p.in(p.v, s * len, len),
                NoPositions{}, base, p.o(s * len, len));
    }
  };
  const auto dense = [&] {
    attention(p.in(p.q, 0, total), p.in(p.k, 0, total), p.in(p.v, 0, total), NoPositions{}, base,
              p.o(0, total));
  };
  Result r;
  r.name = "varlen_causal_" + std::to_string(docs) + "x" + std::to_string(len) + "_H8_D128";
  r.threads = threads;
  AttentionShape doc{.seq_q = len, .seq_k = len, .heads_q = 8, .heads_kv = 8, .head_dim = 128};
  r.flops = static_cast<double>(docs) * attention_flops(doc);
  r.baselines = {"sgemm"};
  const PairTiming vs_sep = measure_pair(separate, varlen, options);
  const PairTiming vs_dense = measure_pair(dense, varlen, options);
  r.timing = vs_sep.b;
  r.extra.emplace_back("vs_separate", vs_sep.ratio);
  r.extra.emplace_back("separate_median_s", vs_sep.a.median_s);
  r.extra.emplace_back("vs_dense", vs_dense.ratio);
  r.extra.emplace_back("dense_median_s", vs_dense.a.median_s);
  return r;
}

Result bench_softcap(int64_t seq, int threads, const TimingOptions& options) {
  threads = resolve_threads(threads);
  Packed p(seq, 8);
  const AttentionOptions plain{.causal = true, .num_threads = threads};
  AttentionOptions capped = plain;
  capped.softcap = 50.0;
  Result r;
  r.name = "attention_softcap_causal_L" + std::to_string(seq) + "_H8_D128";
  r.threads = threads;
  r.flops =
      attention_flops({.seq_q = seq, .seq_k = seq, .heads_q = 8, .heads_kv = 8, .head_dim = 128});
  r.baselines = {"sgemm"};
  const PairTiming pt = measure_pair(p.whole(plain), p.whole(capped), options);
  r.timing = pt.b;
  r.extra.emplace_back("vs_no_cap", pt.ratio);
  r.extra.emplace_back("no_cap_median_s", pt.a.median_s);
  return r;
}

Result bench_document_mask(int64_t docs, int64_t len, int threads, const TimingOptions& options) {
  threads = resolve_threads(threads);
  const int64_t total = docs * len;
  Packed p(total, 2);
  std::vector<int32_t> ids(static_cast<std::size_t>(total));
  for (int64_t t = 0; t < total; ++t)
    ids[static_cast<std::size_t>(t)] = static_cast<int32_t>(t / len);
  const AttentionOptions plain{.num_threads = threads};
  AttentionOptions masked = plain;
  masked.block_mask.query_documents = View<const int32_t, 2>::contiguous(ids.data(), {1, total});
  masked.block_mask.key_documents = masked.block_mask.query_documents;
  Result r;
  r.name = "document_mask_" + std::to_string(docs) + "x" + std::to_string(len) + "_H2_D128";
  r.threads = threads;
  AttentionShape doc{
      .seq_q = len, .seq_k = len, .heads_q = 2, .heads_kv = 2, .head_dim = 128, .causal = false};
  r.flops = static_cast<double>(docs) * attention_flops(doc);
  r.baselines = {"sgemm"};
  const PairTiming pt = measure_pair(p.whole(plain), p.whole(masked), options);
  r.timing = pt.b;
  r.extra.emplace_back("vs_dense", pt.ratio);
  r.extra.emplace_back("dense_median_s", pt.a.median_s);
  return r;
}

}  // namespace posenc::bench
