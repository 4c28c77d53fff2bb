// bench/bench_attention.cc - Google Benchmark: posenc::attention on real-model shapes.
//
// Prefill (seq_q = seq_k, Arg = seq) for each model of shapes.h with its own scheme, the naive
// materialized float32 path on the Llama-3-8B shape, and Llama-3-8B decode steps (seq_q = 1,
// Arg = cached tokens). Counters: useful GFLOP/s (4 Lq Lk D H, halved when causal) and, for
// decode, GB/s of k and v read. Args: seq, threads (0 = all). Pick entries with
// --benchmark_filter, e.g. --benchmark_filter='Prefill/llama3_8b/seq:512/'.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>

#include "harness.h"
#include "shapes.h"

namespace posenc::bench {
namespace {

AttentionShape prefill_shape(const ModelShape& m, int64_t seq) {
  AttentionShape s;
  s.seq_q = s.seq_k = seq;
  s.heads_q = m.heads_q;
  s.heads_kv = m.heads_kv;
  s.head_dim = m.head_dim;
  s.causal = m.causal;
  return s;
}

void report(benchmark::State& state, const AttentionShape& shape, int threads) {
  // Useful FLOPs per second of wall time, shown as FLOPS=<n>G/s.
  state.counters["FLOPS"] =
      benchmark::Counter(attention_flops(shape) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
  state.counters["threads"] = threads;
}

// Args: seq, threads (0 = all).
void BM_Prefill(benchmark::State& state, const ModelShape& model) {
  const AttentionShape shape = prefill_shape(model, state.range(0));
  const int threads = resolve_threads(static_cast<int>(state.range(1)));
  AttentionWorkload w(shape, model.scheme);
  for (auto _ : state) {
    w.run(threads);
    benchmark::ClobberMemory();
  }
  report(state, shape, threads);
}

// The naive materialized float32 path (scores [seq, seq] per head through OpenBLAS).
void BM_PrefillNaive(benchmark::State& state, const ModelShape& model) {
  const AttentionShape shape = prefill_shape(model, state.range(0));
  const int threads = resolve_threads(static_cast<int>(state.range(1)));
  AttentionWorkload w(shape, "none");
  for (auto _ : state) {
    w.run_naive(threads);
    benchmark::ClobberMemory();
  }
  report(state, shape, threads);
}

// One decode step: q [1, 1, Hq, D] against seq cached keys and values, scheme none.
void BM_Decode(benchmark::State& state, const ModelShape& model) {
  AttentionShape shape = prefill_shape(model, state.range(0));
  shape.seq_q = 1;
  const int threads = resolve_threads(static_cast<int>(state.range(1)));
  AttentionWorkload w(shape, "none");
  for (auto _ : state) {
    w.run(threads);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(kv_bytes(shape)));
  state.counters["threads"] = threads;
}

void prefill_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"seq", "threads"});
  for (int64_t seq : {512, 2048, 4096}) b->Args({seq, 0});
  b->Args({512, 1});
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

void decode_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"seq", "threads"});
  for (int64_t seq : {4096, 32768}) b->Args({seq, 0});
  b->Args({4096, 1});
  b->UseRealTime()->Unit(benchmark::kMicrosecond);
}

BENCHMARK_CAPTURE(BM_Prefill, llama3_8b, kLlama3_8B)->Apply(prefill_args);
BENCHMARK_CAPTURE(BM_Prefill, bloom_560m, kBloom560m)->Apply(prefill_args);
BENCHMARK_CAPTURE(BM_Prefill, t5_base, kT5Base)->Apply(prefill_args);
BENCHMARK_CAPTURE(BM_Prefill, deberta_v3_base, kDebertaV3Base)->Apply(prefill_args);
BENCHMARK_CAPTURE(BM_PrefillNaive, llama3_8b, kLlama3_8B)->Apply(prefill_args);
BENCHMARK_CAPTURE(BM_Decode, llama3_8b, kLlama3_8B)->Apply(decode_args);

}  // namespace
}  // namespace posenc::bench
