// tests/test_bench.cc - smoke tests of the benchmark harness (bench/harness.h) on tiny shapes.
//
// No timing assertions: only that every entry runs, reports sane fields, that the suite names
// match the `posenc bench` contract, and that the naive attention baseline computes attention
// (against the float64 reference).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#ifdef POSENC_CLI_PATH
#include "cli_test_util.h"
#endif
#include "harness.h"
#include "hwy/targets.h"
#include "kernels/bf16_dot.h"
#include "kernels/simd.h"
#include "posenc/attention.h"
#include "test_util.h"

namespace {

using posenc::View;
namespace pb = posenc::bench;

pb::TimingOptions tiny_timing() {
  pb::TimingOptions t;
  t.warmup = 0;
  t.min_total_s = 0;
  t.min_reps = 2;
  return t;
}

double extra(const pb::Result& r, const std::string& key) {
  for (const auto& [k, v] : r.extra) {
    if (k == key) return v;
  }
  ADD_FAILURE() << r.name << ": no field " << key;
  return 0;
}

bool has_extra(const pb::Result& r, const std::string& key) {
  return std::any_of(r.extra.begin(), r.extra.end(), [&](const auto& e) { return e.first == key; });
}

TEST(BenchMeasure, RepeatsUntilMinRepsAndReportsMedianAndMin) {
  int calls = 0;
  pb::TimingOptions t;
  t.warmup = 2;
  t.min_total_s = 0;
  t.min_reps = 5;
  const pb::Timing timing = pb::measure([&] { ++calls; }, t);
  EXPECT_EQ(calls, 7);
  EXPECT_EQ(timing.reps, 5);
  EXPECT_GE(timing.median_s, timing.min_s);
  EXPECT_GE(timing.min_s, 0.0);
}

TEST(BenchMeasure, StopsAtMaxReps) {
  int calls = 0;
  pb::TimingOptions t;
  t.warmup = 0;
  t.min_total_s = 1e9;
  t.max_reps = 4;
  EXPECT_EQ(pb::measure([&] { ++calls; }, t).reps, 4);
  EXPECT_EQ(calls, 4);
}

TEST(BenchFlops, UsefulFlopsHalvedWhenCausal) {
  pb::AttentionShape s{
      .seq_q = 4096, .seq_k = 4096, .heads_q = 8, .heads_kv = 8, .head_dim = 128, .causal = false};
  EXPECT_DOUBLE_EQ(pb::attention_flops(s), 4.0 * 4096 * 4096 * 128 * 8);
  s.causal = true;
  EXPECT_DOUBLE_EQ(pb::attention_flops(s), 2.0 * 4096 * 4096 * 128 * 8);
  // Decode: one query sees every key.
  s.seq_q = 1;
  EXPECT_DOUBLE_EQ(pb::attention_flops(s), 4.0 * 4096 * 128 * 8);
  s.heads_kv = 2;
  EXPECT_DOUBLE_EQ(pb::kv_bytes(s), 2.0 * 4 * 4096 * 2 * 128);
}

TEST(BenchBaselines, RunOnSmallBuffers) {
  for (int threads : {1, 2}) {
    const pb::Result copy = pb::bench_copy_bandwidth(threads, 1 << 20, tiny_timing());
    EXPECT_EQ(copy.name, "copy_bandwidth");
    EXPECT_EQ(copy.threads, threads);
    EXPECT_TRUE(copy.is_bandwidth());
    EXPECT_GT(copy.gbps(), 0);
    const pb::Result read = pb::bench_read_bandwidth(threads, 1 << 20, tiny_timing());
    EXPECT_EQ(read.name, "read_bandwidth");
    EXPECT_GT(read.gbps(), 0);
    const pb::Result gemm = pb::bench_sgemm(threads, 64, tiny_timing());
    EXPECT_EQ(gemm.name, "sgemm");
    EXPECT_FALSE(gemm.is_bandwidth());
    EXPECT_DOUBLE_EQ(gemm.flops, 2.0 * 64 * 64 * 64);
    EXPECT_GT(gemm.gflops(), 0);
  }
}

TEST(BenchFmaPeak, FlopCountIsTwoLanesChainsIterationsThreads) {
  EXPECT_DOUBLE_EQ(pb::fma_peak_flops(16, 16, 1000, 1), 2.0 * 16 * 16 * 1000);
  EXPECT_DOUBLE_EQ(pb::fma_peak_flops(8, 12, 1 << 20, 3), 2.0 * 8 * 12 * (1 << 20) * 3);
  // The entry counts what its chains ran.
  const pb::Result r = pb::bench_fma_peak(2, 1000, tiny_timing());
  EXPECT_DOUBLE_EQ(r.flops, 2.0 * extra(r, "lanes") * extra(r, "chains") * 1000 * 2);
  EXPECT_EQ(extra(r, "iterations"), 1000);
}

std::string info(const pb::Result& r, const std::string& key) {
  for (const auto& [k, v] : r.info) {
    if (k == key) return v;
  }
  ADD_FAILURE() << r.name << ": no field " << key;
  return "";
}

// A peak entry (fma_peak, bf16_dot_peak) as run: its name and threads, a positive GFLOP/s rate,
// its chains' shape, no baselines of its own.
void ExpectPeakEntry(const pb::Result& r, const std::string& name, int threads, int64_t lanes,
                     int chains) {
  EXPECT_EQ(r.name, name);
  EXPECT_EQ(r.threads, threads);
  EXPECT_FALSE(r.is_bandwidth());
  EXPECT_GT(r.gflops(), 0);
  EXPECT_EQ(extra(r, "lanes"), static_cast<double>(lanes));
  EXPECT_EQ(extra(r, "chains"), chains);
  EXPECT_TRUE(r.baselines.empty());
}

// On every target compiled in that this CPU supports: the entry runs there and says so, with
// 16 chains where there are 32 vector registers (AVX-512) and 12 otherwise.
TEST(BenchFmaPeak, RunsOnTheDispatchedTargetAndNamesIt) {
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    posenc::kernels::set_simd_target_for_test(target);
    const pb::FmaChains c = pb::fma_chains();
    EXPECT_EQ(c.target, hwy::TargetName(target));
    EXPECT_EQ(c.target, pb::simd_target());
    EXPECT_GE(c.lanes, 1);
    const bool avx512 = c.target.rfind("AVX3", 0) == 0;
    EXPECT_EQ(c.chains, avx512 ? 16 : 12);
    if (avx512) {
      EXPECT_EQ(c.lanes, 16);
    } else if (c.target == "AVX2") {
      EXPECT_EQ(c.lanes, 8);
    }
    for (int threads : {1, 2}) {
      const pb::Result r = pb::bench_fma_peak(threads, 1 << 12, tiny_timing());
      ExpectPeakEntry(r, "fma_peak", threads, c.lanes, c.chains);
      EXPECT_EQ(info(r, "target"), c.target);
    }
  }
  posenc::kernels::set_simd_target_for_test(0);
}

// fma_peak and sgemm of one quick suite run, selected by the filter's exact names, in that order;
// fma_peak names its target; sgemm's one ratio is vs_fma_peak. (No bound between the two rates:
// timings belong to benchmarks, and under a sanitizer or a loaded machine either may lag.)
TEST(BenchFmaPeak, SelectedBeforeSgemmInTheSameQuickRun) {
  pb::SuiteOptions o;
  o.quick = true;
  o.threads = 1;
  o.filter = "=fma_peak,=sgemm";
  const std::vector<pb::Entry> entries = pb::suite(o);
  ASSERT_EQ(entries.size(), 2u);
  ASSERT_EQ(entries[0].name, "fma_peak");
  ASSERT_EQ(entries[1].name, "sgemm");
  const pb::Result fma = entries[0].run();
  const pb::Result gemm = entries[1].run();
  EXPECT_GT(fma.gflops(), 0);
  EXPECT_GT(gemm.gflops(), 0);
  EXPECT_FALSE(info(fma, "target").empty());
  const std::map<std::string, pb::Result> done{{fma.name, fma}};
  const std::vector<pb::RatioField> f = pb::ratio_fields(gemm, done);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].key, "vs_fma_peak");
  EXPECT_NEAR(f[0].value, gemm.gflops() / fma.gflops(), 1e-9 * gemm.gflops() / fma.gflops());
}

// bf16_dot_peak: in the suite exactly where the processor has AVX512_BF16; there it counts four
// FLOPs per lane of every chain and step, names its instruction and, run after fma_peak, has
// one ratio, vs_fma_peak. Elsewhere the entry function refuses to run.
TEST(BenchBf16DotPeak, ListedAndCountedWhereTheProcessorHasIt) {
  const bool have = posenc::kernels::bf16_dot_supported();
  EXPECT_EQ(pb::bf16_dot_peak_available(), have);
  pb::SuiteOptions o;
  o.quick = true;
  o.threads = 1;
  o.filter = "=fma_peak,=bf16_dot_peak";
  const std::vector<pb::Entry> entries = pb::suite(o);
  ASSERT_EQ(entries.size(), have ? 2u : 1u);
  EXPECT_EQ(entries[0].name, "fma_peak");
  EXPECT_DOUBLE_EQ(pb::bf16_dot_peak_flops(1000, 3), 4.0 * 16 * 16 * 1000 * 3);
  // Right after the four baselines, in the full and the quick suite alike.
  for (const bool quick : {false, true}) {
    pb::SuiteOptions all;
    all.quick = quick;
    const std::vector<pb::Entry> suite = pb::suite(all);
    ASSERT_GE(suite.size(), 5u);
    EXPECT_EQ(suite[3].name, "sgemm");
    EXPECT_EQ(suite[4].name == "bf16_dot_peak", have);
    EXPECT_EQ(std::count_if(suite.begin(), suite.end(),
                            [](const pb::Entry& e) { return e.name == "bf16_dot_peak"; }),
              have ? 1 : 0);
  }
  if (!have) {
    EXPECT_THROW(pb::bench_bf16_dot_peak(1, 1000, tiny_timing()), posenc::ValueError);
    return;
  }
  EXPECT_EQ(entries[1].name, "bf16_dot_peak");
  for (int threads : {1, 2}) {
    const pb::Result r = pb::bench_bf16_dot_peak(threads, 1 << 12, tiny_timing());
    ExpectPeakEntry(r, "bf16_dot_peak", threads, 16, 16);
    EXPECT_DOUBLE_EQ(r.flops, 4.0 * 16 * 16 * (1 << 12) * threads);
    EXPECT_EQ(extra(r, "iterations"), 1 << 12);
    EXPECT_EQ(info(r, "instruction"), "vdpbf16ps");
  }
  const pb::Result fma = entries[0].run();
  const pb::Result dot = entries[1].run();
  const std::map<std::string, pb::Result> done{{fma.name, fma}};
  const std::vector<pb::RatioField> f = pb::ratio_fields(dot, done);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].key, "vs_fma_peak");
  EXPECT_NEAR(f[0].value, dot.gflops() / fma.gflops(), 1e-9 * dot.gflops() / fma.gflops());
}

#ifdef POSENC_CLI_PATH
// `posenc bench` prints the entry as documented: in JSON its rate, vs_fma_peak and shape fields,
// in the table the instruction and chains; where the processor lacks AVX512_BF16 the filter
// selects fma_peak alone.
class BenchCli : public posenc::cli_test::CliFixture {};

TEST_F(BenchCli, Bf16DotPeakLinesWhereTheProcessorHasIt) {
  const bool have = posenc::kernels::bf16_dot_supported();
  const auto json = run("bench --quick --threads 1 --json --filter =fma_peak,=bf16_dot_peak");
  ASSERT_EQ(json.status, 0) << json.err;
  std::vector<std::string> lines;
  std::istringstream in(json.out);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line[0] == '{') lines.push_back(line);
  }
  ASSERT_EQ(lines.size(), have ? 2u : 1u) << json.out;
  EXPECT_NE(lines[0].find("\"name\": \"fma_peak\""), std::string::npos) << lines[0];
  if (!have) return;
  const std::string& dot = lines[1];
  for (const char* field :
       {"\"name\": \"bf16_dot_peak\"", "\"gflops\": ", "\"vs_fma_peak\": ", "\"lanes\": 16",
        "\"chains\": 16", "\"iterations\": ", "\"instruction\": \"vdpbf16ps\""}) {
    EXPECT_NE(dot.find(field), std::string::npos) << field << " in " << dot;
  }
  const auto table = run("bench --quick --threads 1 --filter =fma_peak,=bf16_dot_peak");
  ASSERT_EQ(table.status, 0) << table.err;
  EXPECT_NE(table.out.find("x fma_peak  vdpbf16ps, 16 chains x 16 lanes"), std::string::npos)
      << table.out;
}
#endif

// The backward on bf16 values: its name, FLOPs and time against the float32 backward, and
// bf16_dot saying whether POSENC_BF16_DOT let its score tiles use vdpbf16ps (never where the
// processor lacks AVX512_BF16).
TEST(BenchBackward, Bf16ValuesAgainstFloat32) {
  const pb::AttentionShape s{
      .seq_q = 70, .seq_k = 70, .heads_q = 4, .heads_kv = 2, .head_dim = 32, .causal = true};
  struct Restore {
    ~Restore() { posenc::kernels::set_bf16_dot_for_test(-1); }
  } restore;
  for (const int mode : {0, 1}) {
    posenc::kernels::set_bf16_dot_for_test(mode);
    const pb::Result r = pb::bench_attention_backward_bf16(s, 1, tiny_timing());
    EXPECT_EQ(r.name, "attention_backward_none_causal_L70_H4_D32_bf16");
    EXPECT_DOUBLE_EQ(r.flops, 2.5 * pb::attention_flops(s));
    EXPECT_GT(extra(r, "vs_float32"), 0);
    EXPECT_GT(extra(r, "float32_median_s"), 0);
    const bool dot = mode == 1 && posenc::kernels::bf16_dot_supported();
    EXPECT_EQ(extra(r, "bf16_dot"), dot ? 1.0 : 0.0);
  }
}

// vs_fma_peak_paired: the no-position attention entry timed in alternation with fma_peak's
// chains (given their steps) reports its GFLOP/s over theirs, from the median of the pairs'
// time ratios, and the chains' median time; other schemes and calls without steps do not. (The
// field's consistency is checked, not its size: timings belong to benchmarks.)
TEST(BenchFmaPeak, NoPositionAttentionPairedWithTheChains) {
  const pb::AttentionShape s{
      .seq_q = 40, .seq_k = 40, .heads_q = 2, .heads_kv = 2, .head_dim = 16, .causal = true};
  const int64_t steps = 1 << 12;
  const pb::FmaCall fma = pb::fma_peak_call(1, steps);
  EXPECT_EQ(fma.flops, pb::fma_peak_flops(fma.lanes, fma.chains, steps, 1));
  EXPECT_GT(fma.flops, 0);
  const pb::Result r = pb::bench_attention("none", s, 1, tiny_timing(), steps);
  const double paired = extra(r, "vs_fma_peak_paired");
  const double fma_s = extra(r, "fma_peak_median_s");
  EXPECT_GT(paired, 0);
  EXPECT_GT(fma_s, 0);
  // The median of the pairs' ratios and the ratio of the two medians agree loosely (within 10 x
  // either way even on a loaded machine), while a ratio taken the wrong way round, time over
  // time instead of rate over rate, would be off by the square of the two calls' time ratio.
  const double of_medians = r.gflops() / (fma.flops / fma_s / 1e9);
  EXPECT_GT(paired, 0.1 * of_medians);
  EXPECT_LT(paired, 10 * of_medians);
  for (const pb::Result& other : {pb::bench_attention("none", s, 1, tiny_timing()),
                                  pb::bench_attention("alibi", s, 1, tiny_timing(), steps)}) {
    SCOPED_TRACE(other.name);
    EXPECT_FALSE(has_extra(other, "vs_fma_peak_paired"));
    EXPECT_FALSE(has_extra(other, "fma_peak_median_s"));
  }
}

// vs_fma_peak: every compute-bound entry's GFLOP/s over fma_peak's, after its other ratios; never
// on bandwidth-bound entries nor on fma_peak itself; left out when fma_peak did not run.
TEST(BenchFmaPeak, RatioFieldsOfComputeAndBandwidthEntries) {
  const pb::AttentionShape s{.seq_q = 32, .seq_k = 32, .heads_q = 2, .heads_kv = 2, .head_dim = 16};
  pb::AttentionShape d = s;
  d.seq_q = 1;
  d.heads_q = 8;
  std::map<std::string, pb::Result> done;
  for (pb::Result r :
       {pb::bench_copy_bandwidth(1, 1 << 20, tiny_timing()),
        pb::bench_read_bandwidth(1, 1 << 20, tiny_timing()),
        pb::bench_fma_peak(1, 1 << 12, tiny_timing()), pb::bench_sgemm(1, 64, tiny_timing())}) {
    done.emplace(r.name, std::move(r));
  }
  const pb::Result& fma = done.at("fma_peak");
  const auto field = [](const std::vector<pb::RatioField>& f, const std::string& key) {
    const auto it =
        std::find_if(f.begin(), f.end(), [&](const pb::RatioField& x) { return x.key == key; });
    return it == f.end() ? nullptr : &*it;
  };
  const pb::Result compute[] = {
      pb::bench_attention("none", s, 1, tiny_timing()),
      pb::bench_attention("rope", s, 1, tiny_timing()),
      pb::bench_naive_attention(s, 1, tiny_timing()),
      pb::bench_attention_backward("none", s, 1, tiny_timing()),
      pb::bench_attention_backward_bf16(s, 1, tiny_timing()),
      pb::bench_attention_half("bf16", s, 1, tiny_timing()),
  };
  for (const pb::Result& r : compute) {
    SCOPED_TRACE(r.name);
    const std::vector<pb::RatioField> f = pb::ratio_fields(r, done);
    ASSERT_EQ(f.size(), 2u);
    EXPECT_EQ(f[0].key, "ratio");
    EXPECT_EQ(f[0].baseline, "sgemm");
    EXPECT_EQ(f[1].key, "vs_fma_peak");
    EXPECT_EQ(f[1].baseline, "fma_peak");
    const double want = r.gflops() / fma.gflops();
    EXPECT_GT(want, 0);
    EXPECT_NEAR(f[1].value, want, 1e-9 * want);
    // Without fma_peak in the run, the field is left out (as a ratio to sgemm is without sgemm).
    std::map<std::string, pb::Result> no_peak = done;
    no_peak.erase("fma_peak");
    EXPECT_EQ(field(pb::ratio_fields(r, no_peak), "vs_fma_peak"), nullptr);
    EXPECT_TRUE(pb::compares_with_fma_peak(r));
  }
  const pb::Result bandwidth[] = {
      done.at("copy_bandwidth"),
      done.at("read_bandwidth"),
      pb::bench_decode(d, 1, tiny_timing()),
      pb::bench_decode_half("bf16", d, 1, tiny_timing()),
      pb::bench_rope(8, 4, 16, 1, tiny_timing()),
  };
  for (const pb::Result& r : bandwidth) {
    SCOPED_TRACE(r.name);
    EXPECT_FALSE(pb::compares_with_fma_peak(r));
    EXPECT_EQ(field(pb::ratio_fields(r, done), "vs_fma_peak"), nullptr);
  }
  EXPECT_FALSE(pb::compares_with_fma_peak(fma));
  EXPECT_TRUE(pb::ratio_fields(fma, done).empty());
  // Decode: both bandwidth baselines, read first.
  const std::vector<pb::RatioField> dec = pb::ratio_fields(bandwidth[2], done);
  ASSERT_EQ(dec.size(), 2u);
  EXPECT_EQ(dec[0].key, "ratio");
  EXPECT_EQ(dec[1].key, "ratio_copy_bandwidth");
  EXPECT_DOUBLE_EQ(dec[1].value, pb::ratio(bandwidth[2], done.at("copy_bandwidth")));
}

// naive_attention against the float64 reference: causal and not, MHA and GQA, seq_q < seq_k
// (KV cache), odd sizes.
TEST(BenchNaiveAttention, MatchesReference) {
  struct Case {
    int64_t batch, seq_q, seq_k, heads_q, heads_kv, head_dim;
  };
  const Case cases[] = {{1, 5, 5, 2, 2, 8},
                        {2, 7, 7, 4, 1, 16},
                        {1, 3, 11, 8, 2, 5},
                        {1, 130, 130, 2, 1, 4},
                        {1, 1, 33, 4, 2, 32}};
  posenc_test::Rng rng(posenc_test::test_seed(), 77);
  for (const Case& c : cases) {
    for (bool causal : {false, true}) {
      for (int threads : {1, 3}) {
        SCOPED_TRACE(posenc_test::seed_trace() + " shape " + std::to_string(c.seq_q) + "x" +
                     std::to_string(c.seq_k) + " heads " + std::to_string(c.heads_q) + "/" +
                     std::to_string(c.heads_kv) + " D " + std::to_string(c.head_dim) +
                     (causal ? " causal" : "") + " threads " + std::to_string(threads));
        const std::array<int64_t, 4> qs = {c.batch, c.seq_q, c.heads_q, c.head_dim};
        const std::array<int64_t, 4> ks = {c.batch, c.seq_k, c.heads_kv, c.head_dim};
        const auto q =
            rng.values<float>(static_cast<std::size_t>(c.batch * c.seq_q * c.heads_q * c.head_dim));
        const auto k = rng.values<float>(
            static_cast<std::size_t>(c.batch * c.seq_k * c.heads_kv * c.head_dim));
        const auto v = rng.values<float>(k.size());
        std::vector<float> out(q.size(), -7.0f);
        const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
        pb::naive_attention(View<const float, 4>::contiguous(q.data(), qs),
                            View<const float, 4>::contiguous(k.data(), ks),
                            View<const float, 4>::contiguous(v.data(), ks), causal, scale,
                            View<float, 4>::contiguous(out.data(), qs), threads);

        const std::vector<double> qd(q.begin(), q.end()), kd(k.begin(), k.end()),
            vd(v.begin(), v.end());
        std::vector<double> want(q.size());
        posenc::AttentionOptions opt;
        opt.causal = causal;
        posenc::ref::attention(View<const double, 4>::contiguous(qd.data(), qs),
                               View<const double, 4>::contiguous(kd.data(), ks),
                               View<const double, 4>::contiguous(vd.data(), ks),
                               posenc::NoPositions{}, opt,
                               View<double, 4>::contiguous(want.data(), qs));
        double max_err = 0;
        for (std::size_t i = 0; i < out.size(); ++i) {
          max_err = std::max(max_err, std::fabs(out[i] - want[i]));
        }
        EXPECT_LT(max_err, 2e-5);
      }
    }
  }
}

TEST(BenchNaiveAttention, RejectsMismatchedShapes) {
  std::vector<float> x(2 * 3 * 4, 0.0f), out(x.size());
  const auto q = View<const float, 4>::contiguous(x.data(), {1, 2, 3, 4});
  const auto kv = View<const float, 4>::contiguous(x.data(), {1, 3, 2, 4});  // 2 does not divide 3
  EXPECT_THROW(pb::naive_attention(q, kv, kv, false, 1.0,
                                   View<float, 4>::contiguous(out.data(), {1, 2, 3, 4}), 1),
               posenc::ShapeError);
}

TEST(BenchWorkload, EverySchemeRuns) {
  pb::AttentionShape s{.seq_q = 17, .seq_k = 17, .heads_q = 4, .heads_kv = 4, .head_dim = 8};
  for (bool causal : {true, false}) {
    s.causal = causal;
    for (const std::string& scheme : pb::scheme_names()) {
      SCOPED_TRACE(scheme + (causal ? " causal" : ""));
      pb::AttentionWorkload w(s, scheme);
      EXPECT_EQ(posenc::scheme_name(w.scheme()), scheme);
      w.run(2);
      const View<float, 4> out = w.out();
      for (int64_t i = 0; i < out.numel(); ++i) ASSERT_TRUE(std::isfinite(out.data[i]));
    }
  }
  EXPECT_THROW(pb::AttentionWorkload(s, "sinusoidal"), posenc::ValueError);
}

// The fast path and the naive baseline agree on scheme none (both float32).
TEST(BenchWorkload, NaiveMatchesAttention) {
  const pb::AttentionShape s{.seq_q = 40, .seq_k = 40, .heads_q = 8, .heads_kv = 2, .head_dim = 16};
  pb::AttentionWorkload w(s, "none");
  w.run(1);
  const View<float, 4> out = w.out();
  const std::vector<float> fast(out.data, out.data + out.numel());
  w.run_naive(2);
  for (int64_t i = 0; i < out.numel(); ++i) {
    ASSERT_NEAR(out.data[i], fast[static_cast<std::size_t>(i)], 1e-5) << "element " << i;
  }
}

TEST(BenchEntries, AttentionDecodeRopeAndPeakMemoryReportTheirFields) {
  const pb::AttentionShape s{.seq_q = 32, .seq_k = 32, .heads_q = 2, .heads_kv = 2, .head_dim = 16};
  const pb::Result a = pb::bench_attention("alibi", s, 1, tiny_timing());
  EXPECT_EQ(a.name, "attention_alibi_causal_L32_H2_D16");
  EXPECT_EQ(a.baselines, std::vector<std::string>{"sgemm"});
  EXPECT_GT(a.gflops(), 0);
  const pb::Result naive = pb::bench_naive_attention(s, 1, tiny_timing());
  EXPECT_EQ(naive.name, "attention_naive_causal_L32_H2_D16");

  pb::AttentionShape d = s;
  d.seq_q = 1;
  d.heads_q = 8;
  const pb::Result dec = pb::bench_decode(d, 1, tiny_timing());
  EXPECT_EQ(dec.name, "decode_gqa_8x2_L32_D16");
  EXPECT_TRUE(dec.is_bandwidth());
  EXPECT_DOUBLE_EQ(dec.bytes, 2.0 * 4 * 32 * 2 * 16);

  const pb::Result rope = pb::bench_rope(8, 4, 16, 1, tiny_timing());
  EXPECT_EQ(rope.name, "rope_neox_8x4x16");
  EXPECT_DOUBLE_EQ(rope.bytes, 2.0 * 4 * 8 * 4 * 16);

  // Half precision: names with the dtype, half the bytes, a positive vs_float32.
  const pb::Result hdec = pb::bench_decode_half("bf16", d, 1, tiny_timing());
  EXPECT_EQ(hdec.name, "decode_gqa_8x2_L32_D16_bf16");
  EXPECT_DOUBLE_EQ(hdec.bytes, 2.0 * 2 * 32 * 2 * 16);
  EXPECT_GT(extra(hdec, "vs_float32"), 0);
  // Which score path ran, and with vdpbf16ps its paired ratio to the widening kernel.
  const bool dot = posenc::kernels::bf16_dot_used(4) && pb::simd_target().rfind("AVX3", 0) == 0;
  EXPECT_EQ(extra(hdec, "bf16_dot"), dot ? 1.0 : 0.0);
  if (dot) {
    EXPECT_GT(extra(hdec, "vs_widening"), 0);
  }
  pb::AttentionShape d8 = d;  // 8 query rows per kv head
  d8.heads_q = 16;
  const pb::Result hdec8 = pb::bench_decode_half("bf16", d8, 1, tiny_timing());
  EXPECT_EQ(hdec8.name, "decode_gqa_16x2_L32_D16_bf16");
  EXPECT_EQ(
      extra(hdec8, "bf16_dot"),
      posenc::kernels::bf16_dot_used(8) && pb::simd_target().rfind("AVX3", 0) == 0 ? 1.0 : 0.0);
  const pb::Result fdec = pb::bench_decode_half("f16", d, 1, tiny_timing());
  EXPECT_FALSE(has_extra(fdec, "bf16_dot"));
  // Paged and head-major caches, each against its contiguous token-major decode.
  const pb::Result pdec = pb::bench_decode_paged("bf16", d, 16, true, 1, tiny_timing());
  EXPECT_EQ(pdec.name, "decode_paged_gqa_8x2_L32_D16_bf16_head_major_page16");
  EXPECT_DOUBLE_EQ(pdec.bytes, hdec.bytes);
  EXPECT_GT(extra(pdec, "vs_contiguous"), 0);
  const pb::Result hm = pb::bench_decode_head_major(d, 1, tiny_timing());
  EXPECT_EQ(hm.name, "decode_head_major_gqa_8x2_L32_D16");
  EXPECT_GT(extra(hm, "vs_token_major"), 0);
  const pb::Result hatt = pb::bench_attention_half("f16", s, 1, tiny_timing());
  EXPECT_EQ(hatt.name, "attention_none_causal_L32_H2_D16_f16");
  EXPECT_GT(extra(hatt, "vs_float32"), 0);
  const pb::Result hrope = pb::bench_rope_half("bf16", 8, 4, 16, 1, tiny_timing());
  EXPECT_EQ(hrope.name, "rope_neox_8x4x16_bf16");
  EXPECT_DOUBLE_EQ(hrope.bytes, 2.0 * 2 * 8 * 4 * 16);
  EXPECT_GT(extra(hrope, "vs_float32"), 0);
  EXPECT_THROW(pb::bench_rope_half("f8", 8, 4, 16, 1, tiny_timing()), posenc::Error);

  const pb::Result peak = pb::bench_peak_memory_attention(s, 1);
  EXPECT_EQ(peak.name, "peak_memory_attention_none_causal_L32_H2_D16");
  EXPECT_EQ(peak.timing.reps, 1);
  EXPECT_DOUBLE_EQ(extra(peak, "inputs_outputs_mb"), 4.0 * 4 * 32 * 2 * 16 / (1 << 20));
  EXPECT_GE(extra(peak, "peak_mb"), 0);
  EXPECT_DOUBLE_EQ(extra(peak, "naive_scores_mb"), 4.0 * 2 * 32 * 32 / (1 << 20));
}

// The `posenc bench` contract names, full and quick (without running anything).
TEST(BenchSuite, NamesFollowTheContract) {
  auto names = [](bool quick, const std::string& filter = "") {
    pb::SuiteOptions o;
    o.quick = quick;
    o.filter = filter;
    std::vector<std::string> n;
    for (const auto& e : pb::suite(o)) n.push_back(e.name);
    return n;
  };
  const std::vector<std::string> full = names(false);
  for (const char* want :
       {"copy_bandwidth", "read_bandwidth", "sgemm", "rope_neox_4096x32x128",
        "attention_none_causal_L4096_H8_D128", "attention_alibi_causal_L4096_H8_D128",
        "attention_t5_causal_L4096_H8_D128", "attention_shaw_causal_L4096_H8_D128",
        "attention_deberta_causal_L4096_H8_D128", "attention_xl_causal_L4096_H8_D128",
        "attention_naive_causal_L4096_H8_D128", "decode_gqa_32x8_L32768_D128",
        "peak_memory_attention_none_causal_L32768_H8_D128", "decode_gqa_32x8_L32768_D128_bf16",
        "decode_gqa_32x8_L32768_D128_f16", "attention_none_causal_L4096_H8_D128_bf16",
        "rope_neox_4096x32x128_bf16", "peak_memory_attention_backward_none_causal_L32768_H8_D128",
        "peak_memory_attention_backward_rope_causal_L32768_H8_D128"}) {
    EXPECT_NE(std::find(full.begin(), full.end(), want), full.end()) << want;
  }
  // Baselines come first, fma_peak before sgemm (so that sgemm has its vs_fma_peak).
  const std::vector<std::string> baselines = {"copy_bandwidth", "read_bandwidth", "fma_peak",
                                              "sgemm"};
  ASSERT_GE(full.size(), 4u);
  EXPECT_EQ(std::vector<std::string>(full.begin(), full.begin() + 4), baselines);
  const std::vector<std::string> quick = names(true);
  EXPECT_NE(std::find(quick.begin(), quick.end(), "attention_none_causal_L512_H8_D128"),
            quick.end());
  ASSERT_GE(quick.size(), 4u);
  EXPECT_EQ(std::vector<std::string>(quick.begin(), quick.begin() + 4), baselines);
  for (const auto* n : {&full, &quick}) {
    EXPECT_EQ(std::count(n->begin(), n->end(), "fma_peak"), 1);
    const auto attention = std::find_if(n->begin(), n->end(), [](const std::string& x) {
      return x.find("attention") != std::string::npos;
    });
    EXPECT_LT(std::find(n->begin(), n->end(), "fma_peak"), attention);
  }
  EXPECT_EQ(names(false, "fma_peak"), std::vector<std::string>{"fma_peak"});
  EXPECT_EQ(names(true, "fma_peak"), std::vector<std::string>{"fma_peak"});
  // Comma-separated alternatives, "=NAME" for that name only, in suite order.
  EXPECT_EQ(names(false, "attention_none_causal_L4096_H8_D128,sgemm,fma_peak"),
            (std::vector<std::string>{"fma_peak", "sgemm", "attention_none_causal_L4096_H8_D128",
                                      "attention_none_causal_L4096_H8_D128_bf16"}));
  EXPECT_EQ(names(false, "fma_peak,sgemm,=attention_none_causal_L4096_H8_D128"),
            (std::vector<std::string>{"fma_peak", "sgemm", "attention_none_causal_L4096_H8_D128"}));
  EXPECT_EQ(names(true, "=fma_peak,,=rope_neox_1024x32x128"),
            (std::vector<std::string>{"fma_peak", "rope_neox_1024x32x128"}));
  EXPECT_TRUE(names(false, "=attention_none").empty());
  EXPECT_TRUE(names(false, ",").empty());
  EXPECT_EQ(names(false, "decode"),
            (std::vector<std::string>{
                "decode_gqa_32x8_L32768_D128", "decode_gqa_32x8_L32768_D128_bf16",
                "decode_gqa_32x8_L32768_D128_f16", "decode_gqa_64x8_L32768_D128_bf16",
                "decode_paged_gqa_32x8_L32768_D128_bf16_head_major_page16",
                "decode_head_major_gqa_32x8_L32768_D128"}));
  EXPECT_TRUE(names(false, "no such entry").empty());
}

}  // namespace
