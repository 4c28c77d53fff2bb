// bench/fma_peak.cc - the fma_peak baseline of `posenc bench` (harness.h): the float32 FMA peak
// of this processor, measured by independent FMA chains at the widest vector Highway dispatches
// to (Highway dynamic dispatch, POSENC_SIMD_TARGET honoured as by the kernels). Also
// bf16_dot_peak: the same measurement for AVX512_BF16's vdpbf16ps (kernels/bf16_dot.h).
//
// Each thread runs `chains` accumulator vectors c_i <- c_i * m + a for `iterations` steps. The
// chains are independent, so the processor can keep an FMA of every chain in flight: enough
// chains cover the FMA latency times the FMA ports (AVX2 and AVX-512: 4 cycles x 2 ports = 8).
// AVX-512 (32 vector registers) runs 16 chains; the 16-register targets (AVX2, SSE4) run 12, so
// that the accumulators, the multiplier and the addend all stay in registers. m = 1 - 2^-20,
// a = 2^-20: every accumulator converges toward 1 from its own start, never overflows nor
// becomes subnormal, and the loop cannot be folded (floating-point FMAs do not reassociate);
// the sums are added up and kept in a volatile. Every step is 2 FLOPs per lane.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "harness.h"
#include "hwy/targets.h"
#include "kernels/bf16_dot.h"
#include "kernels/parallel.h"
#include "kernels/simd.h"

#ifndef POSENC_BENCH_FMA_PEAK_ONCE
#define POSENC_BENCH_FMA_PEAK_ONCE
namespace posenc::bench::fma_detail {

// What one run of the chains did: the Highway target (bit), float32 lanes per vector, chains,
// and the sum of the accumulators' lanes.
struct ChainsRun {
  int64_t target = 0;
  int64_t lanes = 0;
  int chains = 0;
  float sum = 0;
};

}  // namespace posenc::bench::fma_detail

// The chains, spelled out as named variables (vectors of scalable targets cannot be array
// elements): X(i) for every chain i.
#define POSENC_FMA_CHAINS_12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define POSENC_FMA_CHAINS_16(X) POSENC_FMA_CHAINS_12(X) X(12) X(13) X(14) X(15)
#define POSENC_FMA_COUNT(i) +1
#define POSENC_FMA_INIT(i) V c##i = hn::Set(d, 1.0f + 0.0625f * static_cast<float>(i));
#define POSENC_FMA_STEP(i) c##i = hn::MulAdd(c##i, m, a);
#define POSENC_FMA_SUM(i) sum = hn::Add(sum, c##i);
#endif  // POSENC_BENCH_FMA_PEAK_ONCE

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "fma_peak.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace posenc::bench::fma_detail {
namespace HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;

// 32 vector registers (AVX-512, AArch64): 16 chains; 16 registers: 12.
#undef POSENC_FMA_CHAINS
#if (HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3) || HWY_ARCH_ARM_A64
#define POSENC_FMA_CHAINS POSENC_FMA_CHAINS_16
#else
#define POSENC_FMA_CHAINS POSENC_FMA_CHAINS_12
#endif

constexpr int kChains = 0 POSENC_FMA_CHAINS(POSENC_FMA_COUNT);

ChainsRun RunChains(int64_t iterations, float mul, float add) {
  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  const V m = hn::Set(d, mul);
  const V a = hn::Set(d, add);
  POSENC_FMA_CHAINS(POSENC_FMA_INIT)
  for (int64_t it = 0; it < iterations; ++it) {
    POSENC_FMA_CHAINS(POSENC_FMA_STEP)
  }
  V sum = hn::Zero(d);
  POSENC_FMA_CHAINS(POSENC_FMA_SUM)
  ChainsRun r;
  r.target = HWY_TARGET;
  r.lanes = static_cast<int64_t>(hn::Lanes(d));
  r.chains = kChains;
  r.sum = hn::GetLane(hn::SumOfLanes(d, sum));
  return r;
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace posenc::bench::fma_detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::bench {
namespace fma_detail {

HWY_EXPORT(RunChains);

// The step's constants, read at run time.
volatile float g_mul = 1.0f - 0x1p-20f;
volatile float g_add = 0x1p-20f;
// Keeps the chains' sums alive.
volatile float g_sink = 0;
// bf16_dot_peak's factor, 2^-10 as bf16 bits: each step adds 2^-19 to every lane, which stays
// exact (a multiple of the lane's ulp) while the lane is below 32: for 2^23 steps.
volatile uint16_t g_bf16_factor = 0x3A80;

ChainsRun run_chains(int64_t iterations) {
  return HWY_DYNAMIC_DISPATCH(RunChains)(iterations, g_mul, g_add);
}

// Thread t's run in (*runs)[t * kRunPad]: one slot per 64 bytes.
constexpr std::size_t kRunPad = 64 / sizeof(ChainsRun) + 1;

// The call a peak entry times: `chains` on every thread, all started at the start of one
// parallel region (the call ends when the slowest thread has finished), each thread's run left
// in *runs, the sums kept in g_sink.
std::function<void()> every_thread(int threads, const std::shared_ptr<std::vector<ChainsRun>>& runs,
                                   std::function<ChainsRun()> chains) {
  runs->assign(static_cast<std::size_t>(threads) * kRunPad, ChainsRun{});
  return [runs, threads, chains = std::move(chains)] {
    kernels::for_each_thread(
        threads, [&](int t) { (*runs)[static_cast<std::size_t>(t) * kRunPad] = chains(); });
    float s = 0;
    for (int t = 0; t < threads; ++t) s += (*runs)[static_cast<std::size_t>(t) * kRunPad].sum;
    g_sink = s;
  };
}

}  // namespace fma_detail

FmaChains fma_chains() {
  kernels::apply_simd_target_env();
  const fma_detail::ChainsRun r = fma_detail::run_chains(1);
  return {hwy::TargetName(r.target), r.lanes, r.chains};
}

double fma_peak_flops(int64_t lanes, int chains, int64_t iterations, int threads) {
  return 2.0 * static_cast<double>(lanes) * chains * static_cast<double>(iterations) * threads;
}

FmaCall fma_peak_call(int threads, int64_t iterations) {
  threads = resolve_threads(threads);
  iterations = std::max<int64_t>(iterations, 1);
  kernels::apply_simd_target_env();
  auto runs = std::make_shared<std::vector<fma_detail::ChainsRun>>();
  FmaCall c;
  c.run = fma_detail::every_thread(threads, runs,
                                   [iterations] { return fma_detail::run_chains(iterations); });
  c.run();  // the chains' shape, from a first call
  const fma_detail::ChainsRun& ran = runs->front();
  c.lanes = ran.lanes;
  c.chains = ran.chains;
  c.target = ran.target;
  c.flops = fma_peak_flops(ran.lanes, ran.chains, iterations, threads);
  return c;
}

bool bf16_dot_peak_available() { return kernels::bf16_dot_supported(); }

double bf16_dot_peak_flops(int64_t iterations, int threads) {
  // Per lane and step: two products and two additions.
  return 4.0 * kernels::kBf16DotLanes * kernels::kBf16DotChains * static_cast<double>(iterations) *
         threads;
}

Result bench_bf16_dot_peak(int threads, int64_t iterations, const TimingOptions& options) {
  if (!bf16_dot_peak_available()) {
    throw ValueError("bf16_dot_peak: this processor (or this build) has no AVX512_BF16");
  }
  threads = resolve_threads(threads);
  iterations = std::max<int64_t>(iterations, 1);
  const auto run = fma_detail::every_thread(
      threads, std::make_shared<std::vector<fma_detail::ChainsRun>>(), [iterations] {
        fma_detail::ChainsRun ran;
        ran.sum = kernels::bf16_dot_chains(iterations, fma_detail::g_bf16_factor);
        return ran;
      });
  Result r;
  r.name = "bf16_dot_peak";
  r.threads = threads;
  r.timing = measure(run, options);
  r.flops = bf16_dot_peak_flops(iterations, threads);
  r.extra.emplace_back("lanes", static_cast<double>(kernels::kBf16DotLanes));
  r.extra.emplace_back("chains", static_cast<double>(kernels::kBf16DotChains));
  r.extra.emplace_back("iterations", static_cast<double>(iterations));
  r.info.emplace_back("instruction", "vdpbf16ps");
  return r;
}

Result bench_fma_peak(int threads, int64_t iterations, const TimingOptions& options) {
  threads = resolve_threads(threads);
  iterations = std::max<int64_t>(iterations, 1);
  const FmaCall c = fma_peak_call(threads, iterations);
  Result r;
  r.name = "fma_peak";
  r.threads = threads;
  r.timing = measure(c.run, options);
  r.flops = c.flops;
  r.extra.emplace_back("lanes", static_cast<double>(c.lanes));
  r.extra.emplace_back("chains", static_cast<double>(c.chains));
  r.extra.emplace_back("iterations", static_cast<double>(iterations));
  r.info.emplace_back("target", hwy::TargetName(c.target));
  return r;
}

}  // namespace posenc::bench
#endif  // HWY_ONCE
