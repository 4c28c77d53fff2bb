// bench/bench_rope.cc - Google Benchmark: RoPE in place on real-model shapes.
//
// Args: seq, heads, threads. Reports bytes/s as read + write of x (2 x its size), to compare
// with `posenc bench`'s copy_bandwidth.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "harness.h"
#include "posenc/rope.h"
#include "shapes.h"

namespace posenc::bench {
namespace {

void run_rope(benchmark::State& state, RopeStyle style, double theta, int64_t head_dim) {
  const int64_t seq = state.range(0), heads = state.range(1);
  const int threads = resolve_threads(static_cast<int>(state.range(2)));
  std::vector<float> x(static_cast<std::size_t>(seq * heads * head_dim));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 17) * 0.1f - 0.8f;
  RopeConfig cfg;
  cfg.head_dim = head_dim;
  cfg.base = theta;
  cfg.style = style;
  const RopeFrequencies freqs = rope_frequencies(cfg, seq);
  const Positions pos = Positions::offset(0);
  const auto xv = View<float, 4>::contiguous(x.data(), {1, seq, heads, head_dim});
  for (auto _ : state) {
    apply_rope(freqs, style, xv, &pos, Direction::kForward, threads);
    benchmark::DoNotOptimize(x.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * 2 * seq * heads * head_dim *
                          static_cast<int64_t>(sizeof(float)));
  state.counters["threads"] = threads;
}

// Llama-3-8B q (32 heads) and k (8 heads), head_dim 128, theta 5e5, half style (HF layout).
void BM_RopeLlama3(benchmark::State& state) {
  run_rope(state, RopeStyle::kHalf, kLlama3RopeTheta, kLlama3_8B.head_dim);
}
// The same, interleaved pairs (Meta's Llama layout, GPT-J).
void BM_RopeLlama3Interleaved(benchmark::State& state) {
  run_rope(state, RopeStyle::kInterleaved, kLlama3RopeTheta, kLlama3_8B.head_dim);
}

void rope_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"seq", "heads", "threads"});
  for (int64_t seq : {1, 512, 4096}) {
    for (int64_t heads : {kLlama3_8B.heads_q, kLlama3_8B.heads_kv}) {
      b->Args({seq, heads, 1});
      b->Args({seq, heads, 0});  // 0 = all threads
    }
  }
  b->UseRealTime();
}

BENCHMARK(BM_RopeLlama3)->Apply(rope_args);
BENCHMARK(BM_RopeLlama3Interleaved)->Apply(rope_args);

}  // namespace
}  // namespace posenc::bench
