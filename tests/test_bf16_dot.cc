// tests/test_bf16_dot.cc - decoding scores by vdpbf16ps (src/kernels/bf16_dot.h).
//
// On a processor with AVX512_BF16 the kernel itself is checked against float64 dot products of
// the same bf16 values (odd head dims, several heads and row blocks, every key count of a tile),
// and decoding attention with a bf16 query and cache against the float64 oracle on the rounded
// inputs for every scheme (the documented bound: half an ulp of bf16 plus the float32 part), with
// 1, 2 and 3 threads bit-identical and a result that stays within the bound of the widening
// path's. Elsewhere those tests skip, and the tests that run everywhere check that the switch
// never turns the path on where it is missing (tests/test_cli_hostile.cc checks that a bad
// POSENC_BF16_DOT is refused).
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "attention_cases.h"
#include "hwy/aligned_allocator.h"
#include "kernels/bf16_dot.h"
#include "kernels/simd.h"
#include "posenc/posenc.h"
#include "test_util.h"

namespace posenc {
namespace {

using posenc_test::Rng;

// Restores the environment's choice when a test ends.
struct Bf16DotMode {
  explicit Bf16DotMode(int mode) { kernels::set_bf16_dot_for_test(mode); }
  ~Bf16DotMode() { kernels::set_bf16_dot_for_test(-1); }
};

TEST(Bf16Dot, PolicyFollowsTheSwitchAndTheProcessor) {
  const bool have = kernels::bf16_dot_supported();
  std::printf("AVX512_BF16 decoding scores: %s\n",
              have ? "supported (the tests below run)" : "not supported");
  Bf16DotMode on(1);
  EXPECT_EQ(kernels::bf16_dot_used(4), have);
  EXPECT_EQ(kernels::bf16_dot_used(8), have);
  kernels::set_bf16_dot_for_test(2);  // automatic: groups of 8 query-row slots
  EXPECT_FALSE(kernels::bf16_dot_used(4));
  EXPECT_EQ(kernels::bf16_dot_used(8), have);
  kernels::set_bf16_dot_for_test(0);
  EXPECT_FALSE(kernels::bf16_dot_used(8));
  EXPECT_EQ(kernels::bf16_dot_policy() == kernels::Bf16Dot::kOff, true);
}

// Scores of the kernel against float64 dot products of the same bf16 values.
// bf16_dot_peak's chains: every step adds both products of every lane (2^-10 squared, twice) to
// each of the 16 chains, which start at 1 + i / 16; all of it exact, so the total is known.
TEST(Bf16Dot, ChainsAddBothProductsOfEveryLaneAtEveryStep) {
  if (!kernels::bf16_dot_supported()) GTEST_SKIP() << "no AVX512_BF16 on this processor";
  constexpr uint16_t kTwoToMinus10 = 0x3A80;
  for (const int64_t steps : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{4096}}) {
    SCOPED_TRACE(steps);
    double want = 0;
    for (int i = 0; i < kernels::kBf16DotChains; ++i) {
      want += kernels::kBf16DotLanes * (1.0 + 0.0625 * i + std::ldexp(2.0 * steps, -20));
    }
    EXPECT_EQ(kernels::bf16_dot_chains(steps, kTwoToMinus10), static_cast<float>(want));
  }
  // A factor of 1: each step adds 2 to every lane.
  EXPECT_EQ(kernels::bf16_dot_chains(5, 0x3F80), 16.0f * (16 + 7.5f + 16 * 10));
}

TEST(Bf16Dot, KernelMatchesFloat64Dots) {
  if (!kernels::bf16_dot_supported()) GTEST_SKIP() << "no AVX512_BF16 on this processor";
  constexpr int64_t kTile = 64;
  int64_t stream = 0;
  for (const int64_t dim : {1, 8, 17, 32, 33, 64, 100, 128, 256}) {
    for (const int64_t heads : {1, 3}) {
      for (const int64_t rows : {4, 8}) {
        for (const int64_t nk : {1, 2, 3, 5, 31, 64}) {
          Rng rng(posenc_test::test_seed(), ++stream);
          SCOPED_TRACE("dim " + std::to_string(dim) + " heads " + std::to_string(heads) + " rows " +
                       std::to_string(rows) + " keys " + std::to_string(nk) + " " +
                       posenc_test::seed_trace());
          const int64_t qstride = (dim + 31) / 32 * 32 + 32;  // with a gap between rows
          // Keys with a gap between heads and rows, and the cache ending right after the last
          // row (a read past a row would leave the buffer: the sanitizers would see it).
          const int64_t hstride = dim + 3, kstride = heads * hstride + 5;
          const auto qf = cases::randn_f(rng.engine(), heads * rows * qstride);
          const auto kf = cases::randn_f(rng.engine(), nk * kstride);
          std::vector<uint16_t> qb(qf.size(), 0), kb(kf.size());
          for (int64_t r = 0; r < heads * rows; ++r)
            for (int64_t x = 0; x < dim; ++x)
              qb[r * qstride + x] = bf16_from_float(qf[r * qstride + x]).bits;
          for (size_t i = 0; i < kf.size(); ++i) kb[i] = bf16_from_float(kf[i]).bits;
          std::vector<float> s(heads * rows * kTile, -7.0f);
          auto part = hwy::AllocateAligned<float>(heads * rows * 16);
          kernels::decode_scores_bf16_dot(qb.data(), qstride, dim, rows, heads, kb.data(), kstride,
                                          hstride, nk, s.data(), kTile, part.get(), {});
          for (int64_t g = 0; g < heads; ++g)
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t c = 0; c < nk; ++c) {
                double want = 0, mag = 0;
                for (int64_t x = 0; x < dim; ++x) {
                  const double a = to_float(bf16{qb[(g * rows + r) * qstride + x]});
                  const double b = to_float(bf16{kb[c * kstride + g * hstride + x]});
                  want += a * b;
                  mag += std::fabs(a * b);
                }
                // Exact products, float32 sums of dim terms: dim 2^-24 of the magnitudes.
                const double bound = static_cast<double>(dim) * 0x1p-24 * mag + 1e-30;
                ASSERT_LE(std::fabs(s[(g * rows + r) * kTile + c] - want), bound)
                    << "head " << g << " row " << r << " key " << c;
              }
          // Columns past RoundUp(nk, 4) are left alone.
          for (int64_t r = 0; r < heads * rows; ++r)
            for (int64_t c = (nk + 3) / 4 * 4; c < kTile; ++c)
              ASSERT_EQ(s[r * kTile + c], -7.0f) << "row " << r << " column " << c;
        }
      }
    }
  }
}

double half_ulp_bf16(double v) {
  const double a = std::max(std::fabs(v), 0x1p-126);
  return std::exp2(std::floor(std::log2(a)) - 8);
}

struct Shape {
  int64_t batch, seq_k, heads_q, heads_kv, dim;
};

// Random bf16 q [qs], k and v [ks] and the float64 oracle's output on their values; run(threads)
// gives the fused kernel's bf16 output bits.
struct Bf16Problem {
  std::array<int64_t, 4> qs, ks;
  std::vector<bf16> q, k, v;
  std::vector<double> want;

  Bf16Problem(std::mt19937_64& engine, std::array<int64_t, 4> q_shape,
              std::array<int64_t, 4> k_shape, const PositionScheme& scheme,
              const AttentionOptions& opt)
      : qs(q_shape), ks(k_shape) {
    const auto size = [](const std::array<int64_t, 4>& a) { return a[0] * a[1] * a[2] * a[3]; };
    const auto qf = cases::randn_f(engine, size(qs));
    const auto kf = cases::randn_f(engine, size(ks));
    const auto vf = cases::randn_f(engine, size(ks));
    std::vector<double> qd(qf.size()), kd(kf.size()), vd(vf.size());
    for (const auto& [from, to, wide] :
         {std::tie(qf, q, qd), std::tie(kf, k, kd), std::tie(vf, v, vd)}) {
      to.resize(from.size());
      for (size_t i = 0; i < from.size(); ++i) {
        to[i] = bf16_from_float(from[i]);
        wide[i] = to_float(to[i]);
      }
    }
    want.resize(q.size());
    ref::attention(View<const double, 4>::contiguous(qd.data(), qs),
                   View<const double, 4>::contiguous(kd.data(), ks),
                   View<const double, 4>::contiguous(vd.data(), ks), scheme, opt,
                   View<double, 4>::contiguous(want.data(), qs));
  }

  std::vector<uint16_t> run(const PositionScheme& scheme, AttentionOptions opt, int threads) const {
    std::vector<bf16> out(q.size());
    opt.num_threads = threads;
    attention(View<const bf16, 4>::contiguous(q.data(), qs),
              View<const bf16, 4>::contiguous(k.data(), ks),
              View<const bf16, 4>::contiguous(v.data(), ks), scheme, opt,
              View<bf16, 4>::contiguous(out.data(), qs));
    std::vector<uint16_t> bits(out.size());
    for (size_t i = 0; i < out.size(); ++i) bits[i] = out[i].bits;
    return bits;
  }

  // Both paths (vdpbf16ps, then widening): the same bits on 1, 2 and 3 threads, every element
  // within half a bf16 ulp of the oracle plus 2e-5 (1 + |want|). worst: per path its largest
  // |error| and, over |want| >= 0.05, its largest error in output ulps.
  void check_paths(const PositionScheme& scheme, const AttentionOptions& opt,
                   std::array<double, 4>& worst) const {
    for (int mode : {1, 0}) {
      Bf16DotMode m(mode);
      const auto first = run(scheme, opt, 1);
      ASSERT_EQ(run(scheme, opt, 2), first) << "path " << mode << ", 2 threads";
      ASSERT_EQ(run(scheme, opt, 3), first) << "path " << mode << ", 3 threads";
      double* w = &worst[static_cast<size_t>(2 * (1 - mode))];
      for (size_t i = 0; i < first.size(); ++i) {
        const double got = to_float(bf16{first[i]});
        const double err = std::fabs(got - want[i]);
        ASSERT_LE(err, half_ulp_bf16(want[i]) + 2e-5 * (1 + std::fabs(want[i])))
            << "path " << mode << ", element " << i << ": " << got << " vs " << want[i];
        w[0] = std::max(w[0], err);
        if (std::fabs(want[i]) >= 0.05) w[1] = std::max(w[1], err / (2 * half_ulp_bf16(want[i])));
      }
    }
  }
};

// Decoding attention, bf16 q, k, v and out, every scheme: the oracle's bound with the path on,
// threads bit-identical, and the path off gives the same bound (the widening kernel).
TEST(Bf16Dot, DecodingEverySchemeAgainstTheOracle) {
  if (!kernels::bf16_dot_supported()) GTEST_SKIP() << "no AVX512_BF16 on this processor";
  const std::vector<Shape> shapes = {
      {1, 130, 8, 1, 8},     // GQA 8, two tiles, a partial one
      {2, 3000, 8, 2, 64},   // split keys, batch 2
      {1, 97, 4, 4, 17},     // MHA, odd head dim (masked key tails)
      {1, 300, 32, 8, 128},  // the bench's GQA shape, short
      {1, 64, 2, 1, 100},    // one full tile
  };
  uint64_t stream = 900;
  // Max |error| and max error in ulps of the output (over |value| >= 0.05) per scheme and path,
  // printed at the end (docs/precision.md quotes them).
  std::map<std::string, std::array<double, 4>> worst;
  for (const Shape& sh : shapes) {
    const std::array<int64_t, 4> qs{sh.batch, 1, sh.heads_q, sh.dim},
        ks{sh.batch, sh.seq_k, sh.heads_kv, sh.dim};
    for (const auto& name : cases::kSchemes) {
      Rng rng(posenc_test::test_seed(), ++stream);
      SCOPED_TRACE(name + " dim " + std::to_string(sh.dim) + " keys " + std::to_string(sh.seq_k) +
                   " " + posenc_test::seed_trace());
      const auto box =
          cases::make_scheme(name, sh.heads_q, sh.dim, rng.engine(), static_cast<int>(stream % 4));
      AttentionOptions opt{.causal = true};
      const Bf16Problem pb(rng.engine(), qs, ks, box->scheme, opt);
      pb.check_paths(box->scheme, opt, worst[name]);
      if (HasFatalFailure()) return;
    }
  }
  std::printf("scheme    vdpbf16ps: max|err|  ulps    widening: max|err|  ulps\n");
  for (const auto& [name, w] : worst) {
    std::printf("%-9s %18.3e %6.3f %18.3e %6.3f\n", name.c_str(), w[0], w[1], w[2], w[3]);
  }
}

// A bf16 query and cache in strided views (every other head of larger buffers): the same bits as
// the contiguous copies.
TEST(Bf16Dot, StridedViewsEqualContiguous) {
  if (!kernels::bf16_dot_supported()) GTEST_SKIP() << "no AVX512_BF16 on this processor";
  Bf16DotMode on(1);
  Rng rng(posenc_test::test_seed(), 990);
  const int64_t L = 333, hq = 8, hk = 2, dim = 48;
  const auto kf = cases::randn_f(rng.engine(), L * 2 * hk * dim);
  const auto vf = cases::randn_f(rng.engine(), L * 2 * hk * dim);
  const auto qf = cases::randn_f(rng.engine(), 2 * hq * dim);
  std::vector<bf16> kbig(kf.size()), vbig(vf.size()), qbig(qf.size());
  for (size_t i = 0; i < kf.size(); ++i) kbig[i] = bf16_from_float(kf[i]);
  for (size_t i = 0; i < vf.size(); ++i) vbig[i] = bf16_from_float(vf[i]);
  for (size_t i = 0; i < qf.size(); ++i) qbig[i] = bf16_from_float(qf[i]);
  const View<const bf16, 4> ks{
      kbig.data(), {1, L, hk, dim}, {L * 2 * hk * dim, 2 * hk * dim, 2 * dim, 1}};
  const View<const bf16, 4> vs{
      vbig.data(), {1, L, hk, dim}, {L * 2 * hk * dim, 2 * hk * dim, 2 * dim, 1}};
  const View<const bf16, 4> qsv{
      qbig.data(), {1, 1, hq, dim}, {2 * hq * dim, 2 * hq * dim, 2 * dim, 1}};
  std::vector<bf16> kc(L * hk * dim), vc(kc.size()), qc(hq * dim);
  for (int64_t j = 0; j < L; ++j)
    for (int64_t h = 0; h < hk; ++h)
      for (int64_t x = 0; x < dim; ++x) {
        kc[(j * hk + h) * dim + x] = ks(0, j, h, x);
        vc[(j * hk + h) * dim + x] = vs(0, j, h, x);
      }
  for (int64_t h = 0; h < hq; ++h)
    for (int64_t x = 0; x < dim; ++x) qc[h * dim + x] = qsv(0, 0, h, x);
  const auto alibi = Alibi{};
  std::vector<bf16> o1(hq * dim), o2(hq * dim);
  attention(qsv, ks, vs, alibi, {.causal = true},
            View<bf16, 4>::contiguous(o1.data(), {1, 1, hq, dim}));
  attention(View<const bf16, 4>::contiguous(qc.data(), {1, 1, hq, dim}),
            View<const bf16, 4>::contiguous(kc.data(), {1, L, hk, dim}),
            View<const bf16, 4>::contiguous(vc.data(), {1, L, hk, dim}), alibi, {.causal = true},
            View<bf16, 4>::contiguous(o2.data(), {1, 1, hq, dim}));
  for (int64_t i = 0; i < hq * dim; ++i) ASSERT_EQ(o1[i].bits, o2[i].bits) << i;
}

// Prefill score tiles: pairs packed from a float32 tile of widened bf16 keys, against float64
// dot products; cols limits each block of 4 rows to the vectors of 16 keys its rows need.
TEST(Bf16Dot, PrefillKernelMatchesFloat64Dots) {
  if (!kernels::bf16_dot_supported()) GTEST_SKIP() << "no AVX512_BF16 on this processor";
  constexpr int64_t kTile = 64;
  int64_t stream = 500;
  for (const int64_t dim : {1, 2, 8, 17, 32, 33, 64, 100, 128, 256}) {
    for (const int64_t rows : {4, 12}) {
      for (const bool limited : {false, true}) {
        Rng rng(posenc_test::test_seed(), ++stream);
        SCOPED_TRACE("dim " + std::to_string(dim) + " rows " + std::to_string(rows) +
                     (limited ? " cols" : "") + " " + posenc_test::seed_trace());
        const int64_t qstride = (dim + 31) / 32 * 32;
        const auto qf = cases::randn_f(rng.engine(), rows * qstride);
        const auto kf = cases::randn_f(rng.engine(), kTile * dim);
        std::vector<uint16_t> qb(qf.size(), 0);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t x = 0; x < dim; ++x)
            qb[r * qstride + x] = bf16_from_float(qf[r * qstride + x]).bits;
        // kt32[x][c]: key c's dim x, a bf16 value widened.
        auto kt32 = hwy::AllocateAligned<float>(dim * kTile);
        for (int64_t c = 0; c < kTile; ++c)
          for (int64_t x = 0; x < dim; ++x)
            kt32[x * kTile + c] = to_float(bf16_from_float(kf[c * dim + x]));
        auto kt = hwy::AllocateAligned<uint32_t>((dim + 1) / 2 * kTile);
        kernels::pack_bf16_pairs(kt32.get(), dim, kt.get());
        std::vector<int32_t> cols(rows);
        for (int64_t r = 0; r < rows; ++r) cols[r] = static_cast<int32_t>((r * 7 + 1) % 65);
        std::vector<float> s(rows * kTile, -7.0f);
        kernels::prefill_scores_bf16_dot(qb.data(), qstride, dim, kt.get(), rows, s.data(), kTile,
                                         limited ? cols.data() : nullptr);
        for (int64_t r = 0; r < rows; ++r) {
          int64_t need = kTile;
          if (limited) {
            need = 0;
            for (int64_t i = r / 4 * 4; i < r / 4 * 4 + 4; ++i)
              need = std::max<int64_t>(need, cols[i]);
          }
          const int64_t written = (need + 15) / 16 * 16;
          for (int64_t c = 0; c < kTile; ++c) {
            if (c >= written) {
              ASSERT_EQ(s[r * kTile + c], -7.0f) << "row " << r << " key " << c;
              continue;
            }
            double want = 0, mag = 0;
            for (int64_t x = 0; x < dim; ++x) {
              const double a = to_float(bf16{qb[r * qstride + x]});
              const double b = kt32[x * kTile + c];
              want += a * b;
              mag += std::fabs(a * b);
            }
            const double bound = static_cast<double>(dim) * 0x1p-24 * mag + 1e-30;
            ASSERT_LE(std::fabs(s[r * kTile + c] - want), bound) << "row " << r << " key " << c;
          }
        }
      }
    }
  }
}

// Prefill attention, bf16 q, k, v and out, every scheme: the oracle's bound with the path on and
// off, threads bit-identical; GQA, an odd head dim, several tiles with a causal diagonal, a
// window, and queries fewer than keys.
TEST(Bf16Dot, PrefillEverySchemeAgainstTheOracle) {
  if (!kernels::bf16_dot_supported()) GTEST_SKIP() << "no AVX512_BF16 on this processor";
  struct PrefillShape {
    int64_t batch, seq_q, seq_k, heads_q, heads_kv, dim;
    bool causal;
    std::optional<int64_t> window;
  };
  const std::vector<PrefillShape> shapes = {
      {1, 130, 130, 4, 2, 32, true, std::nullopt},  // GQA, three tiles, the diagonal
      {2, 70, 200, 2, 2, 17, true, 90},             // odd head dim, a window, queries last
      {1, 96, 96, 2, 1, 128, false, std::nullopt},  // MQA, bidirectional
  };
  uint64_t stream = 1900;
  std::map<std::string, std::array<double, 4>> worst;
  for (const PrefillShape& sh : shapes) {
    const std::array<int64_t, 4> qs{sh.batch, sh.seq_q, sh.heads_q, sh.dim},
        ks{sh.batch, sh.seq_k, sh.heads_kv, sh.dim};
    for (const auto& name : cases::kSchemes) {
      Rng rng(posenc_test::test_seed(), ++stream);
      SCOPED_TRACE(name + " dim " + std::to_string(sh.dim) + " queries " +
                   std::to_string(sh.seq_q) + " " + posenc_test::seed_trace());
      const auto box =
          cases::make_scheme(name, sh.heads_q, sh.dim, rng.engine(), static_cast<int>(stream % 4));
      AttentionOptions opt{.causal = sh.causal, .window = sh.window};
      const Bf16Problem pb(rng.engine(), qs, ks, box->scheme, opt);
      pb.check_paths(box->scheme, opt, worst[name]);
      if (HasFatalFailure()) return;
    }
  }
  std::printf("prefill   vdpbf16ps: max|err|  ulps    widening: max|err|  ulps\n");
  for (const auto& [name, w] : worst) {
    std::printf("%-9s %18.3e %6.3f %18.3e %6.3f\n", name.c_str(), w[0], w[1], w[2], w[3]);
  }
}

}  // namespace
}  // namespace posenc
