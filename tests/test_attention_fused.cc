// tests/test_attention_fused.cc - the fused float32 kernel against the float64 oracle.
//
// Tolerance (STYLE.md, after FlashAttention's tests): max |fused - ref| <= 2 * max |naive - ref|
// + 1e-6, where naive is the simple float32 path (attention_naive) on the same inputs: the fused
// kernel may be no worse than twice the error that float32 arithmetic itself costs.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "attention_cases.h"
#include "hwy/targets.h"
#include "kernels/attention_kernels.h"
#include "kernels/simd.h"
#include "posenc/posenc.h"

namespace {

using namespace posenc;

struct Shape {
  int64_t batch, seq_q, seq_k, heads_q, heads_kv, dim;
};

std::string str(const Shape& s) {
  return "B" + std::to_string(s.batch) + " Lq" + std::to_string(s.seq_q) + " Lk" +
         std::to_string(s.seq_k) + " Hq" + std::to_string(s.heads_q) + " Hkv" +
         std::to_string(s.heads_kv) + " D" + std::to_string(s.dim);
}

struct Case {
  Shape s;
  std::vector<float> q, k, v;
  std::vector<double> qd, kd, vd;
};

Case make_case(const Shape& s, std::mt19937_64& rng) {
  Case c{s, {}, {}, {}, {}, {}, {}};
  std::normal_distribution<float> nd(0.0f, 1.0f);
  c.q.resize(static_cast<size_t>(s.batch * s.seq_q * s.heads_q * s.dim));
  c.k.resize(static_cast<size_t>(s.batch * s.seq_k * s.heads_kv * s.dim));
  c.v.resize(c.k.size());
  for (auto* x : {&c.q, &c.k, &c.v})
    for (auto& e : *x) e = nd(rng);
  c.qd.assign(c.q.begin(), c.q.end());
  c.kd.assign(c.k.begin(), c.k.end());
  c.vd.assign(c.v.begin(), c.v.end());
  return c;
}

using Fn = void (*)(View<const float, 4>, View<const float, 4>, View<const float, 4>,
                    const PositionScheme&, const AttentionOptions&, View<float, 4>,
                    const Positions*, const Positions*);

std::vector<float> run(Fn fn, const Case& c, const PositionScheme& scheme,
                       const AttentionOptions& opt, const Positions* qp = nullptr,
                       const Positions* kp = nullptr) {
  const Shape& s = c.s;
  std::vector<float> out(c.q.size(), -7.0f);
  fn(View<const float, 4>::contiguous(c.q.data(), {s.batch, s.seq_q, s.heads_q, s.dim}),
     View<const float, 4>::contiguous(c.k.data(), {s.batch, s.seq_k, s.heads_kv, s.dim}),
     View<const float, 4>::contiguous(c.v.data(), {s.batch, s.seq_k, s.heads_kv, s.dim}), scheme,
     opt, View<float, 4>::contiguous(out.data(), {s.batch, s.seq_q, s.heads_q, s.dim}), qp, kp);
  return out;
}

std::vector<double> run_ref(const Case& c, const PositionScheme& scheme,
                            const AttentionOptions& opt, const Positions* qp = nullptr,
                            const Positions* kp = nullptr) {
  const Shape& s = c.s;
  std::vector<double> out(c.q.size());
  ref::attention(
      View<const double, 4>::contiguous(c.qd.data(), {s.batch, s.seq_q, s.heads_q, s.dim}),
      View<const double, 4>::contiguous(c.kd.data(), {s.batch, s.seq_k, s.heads_kv, s.dim}),
      View<const double, 4>::contiguous(c.vd.data(), {s.batch, s.seq_k, s.heads_kv, s.dim}), scheme,
      opt, View<double, 4>::contiguous(out.data(), {s.batch, s.seq_q, s.heads_q, s.dim}), qp, kp);
  return out;
}

double max_err(const std::vector<float>& a, const std::vector<double>& ref) {
  double e = 0;
  for (size_t i = 0; i < a.size(); ++i)
    e = std::max(e, std::abs(static_cast<double>(a[i]) - ref[i]));
  return e;
}

void check(const Case& c, const PositionScheme& scheme, const AttentionOptions& opt,
           const Positions* qp = nullptr, const Positions* kp = nullptr) {
  const auto ref = run_ref(c, scheme, opt, qp, kp);
  const auto naive = run(&attention_naive, c, scheme, opt, qp, kp);
  const auto fused = run(&attention, c, scheme, opt, qp, kp);
  const double en = max_err(naive, ref), ef = max_err(fused, ref);
  EXPECT_LE(ef, 2 * en + 1e-6) << "fused error " << ef << " vs naive " << en;
}

// Every scheme, causal and not, MHA / GQA 4 / GQA 8, sizes around the lane counts (1, 2, 15, 16,
// 17, 63, 64, 65, 130) and Lq != Lk.
TEST(FusedAttention, MatchesReferenceWithinTwiceNaiveError) {
  const std::vector<Shape> shapes = {
      {1, 1, 1, 1, 1, 1},    {1, 2, 2, 2, 2, 2},      {2, 15, 17, 4, 1, 16}, {1, 16, 65, 8, 2, 17},
      {1, 63, 130, 8, 1, 8}, {1, 130, 130, 4, 4, 32}, {2, 3, 129, 8, 8, 15}, {1, 64, 64, 2, 2, 64},
  };
  uint64_t seed = 100;
  for (const auto& s : shapes) {
    for (const auto& name : cases::kSchemes) {
      for (bool causal : {false, true}) {
        ++seed;
        if (name == "rope" && s.dim < 2) continue;
        SCOPED_TRACE(name + (causal ? " causal " : " bidirectional ") + str(s) + " seed " +
                     std::to_string(seed));
        std::mt19937_64 rng(seed);
        const auto box =
            cases::make_scheme(name, s.heads_q, s.dim, rng, static_cast<int>(seed % 4));
        const auto c = make_case(s, rng);
        check(c, box->scheme, {.causal = causal});
      }
    }
  }
}

// Explicit, non-contiguous and per-row positions, windows, fully masked rows allowed.
TEST(FusedAttention, PositionsWindowsAndMaskedRows) {
  const Shape s{2, 5, 70, 4, 2, 16};
  std::mt19937_64 rng(7);
  std::vector<int64_t> kids(static_cast<size_t>(2 * 70));
  for (int64_t j = 0; j < 70; ++j) {
    kids[static_cast<size_t>(j)] = 3 * j;        // gaps
    kids[static_cast<size_t>(70 + j)] = 69 - j;  // descending
  }
  const auto kp = Positions::per_row(kids, 2, 70);
  const auto qp = Positions::per_row({0, 50, 100, 150, 400, 10, 20, 30, 40, 500}, 2, 5);
  for (const auto& name : cases::kSchemes) {
    for (bool causal : {false, true}) {
      for (int64_t window : {0, 9}) {
        SCOPED_TRACE(name + (causal ? " causal" : "") + " window " + std::to_string(window));
        const auto box = cases::make_scheme(name, s.heads_q, s.dim, rng, 1);
        const auto c = make_case(s, rng);
        AttentionOptions opt{.causal = causal, .allow_fully_masked = true};
        if (window) opt.window = window;
        check(c, box->scheme, opt, &qp, &kp);
      }
    }
  }
}

// Decoding: few items and many keys take the split-and-merge path.
TEST(FusedAttention, DecodeSplitPath) {
  const Shape s{1, 1, 5000, 8, 2, 32};
  std::mt19937_64 rng(9);
  const auto c = make_case(s, rng);
  for (const auto& name : cases::kSchemes) {
    SCOPED_TRACE(name);
    const auto box = cases::make_scheme(name, s.heads_q, s.dim, rng, 3);
    check(c, box->scheme, {.causal = true});
    check(c, box->scheme, {.causal = false});
  }
}

// Bit-identical for 1, 2 and 3 threads, on the prefill and the split path.
TEST(FusedAttention, ThreadCountDoesNotChangeResults) {
  for (const Shape s : {Shape{2, 70, 90, 4, 2, 16}, Shape{1, 1, 4200, 4, 1, 16}}) {
    for (const auto& name : cases::kSchemes) {
      std::mt19937_64 rng(11);
      const auto c = make_case(s, rng);
      const auto box = cases::make_scheme(name, s.heads_q, s.dim, rng, 3);
      std::vector<float> first;
      for (int threads : {1, 2, 3}) {
        const auto out = run(&attention, c, box->scheme, {.causal = true, .num_threads = threads});
        if (first.empty()) {
          first = out;
        } else {
          EXPECT_EQ(out, first) << name << ", " << threads << " threads, " << str(s);
        }
      }
    }
  }
}

// Every Highway target compiled into the library and supported here.
TEST(FusedAttention, EveryCompiledSimdTarget) {
  const Shape s{1, 33, 77, 4, 2, 24};
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    kernels::set_simd_target_for_test(target);
    std::mt19937_64 rng(13);
    for (const auto& name : cases::kSchemes) {
      const auto box = cases::make_scheme(name, s.heads_q, s.dim, rng, 1);
      const auto c = make_case(s, rng);
      check(c, box->scheme, {.causal = true});
    }
  }
  kernels::set_simd_target_for_test(0);
}

// The forward's softmax exponential, exp(s - max) with s <= max, against exp in double on every
// compiled target: within one ulp where the result is a normal float (1.25 without FMA), exactly 1
// at 0 and exactly 0 for -inf and below -127 ln 2 (a hidden score adds nothing), and below 2^-126
// off by less than 2^-126. Random arguments over the whole range, near 0 and in the tail, and every
// float in stretches around the reduction's seam at -ln(2) / 2 and the subnormal range.
TEST(FusedAttention, SoftmaxExponentialEveryCompiledSimdTarget) {
  std::mt19937_64 rng(29);
  std::vector<float> x = {0.0f,
                          -0.0f,
                          -1e-30f,
                          -1e-7f,
                          -0.6931472f,
                          -87.33654f,
                          -87.3366f,
                          -87.68f,
                          -88.0f,
                          -88.02969f,
                          -88.0297f,
                          -100.0f,
                          -1e30f,
                          -std::numeric_limits<float>::max(),
                          -std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::denorm_min()};
  std::uniform_real_distribution<float> wide(-90.0f, 0.0f), narrow(-1.0f, 0.0f);
  std::exponential_distribution<float> tail(0.5f);
  for (int i = 0; i < 300000; ++i) {
    x.push_back(wide(rng));
    x.push_back(narrow(rng));
    x.push_back(-tail(rng));
  }
  for (float v = -0.3468f; v < -0.3464f; v = std::nextafter(v, 0.0f)) x.push_back(v);
  for (float v = -88.05f; v < -87.3f; v = std::nextafter(v, 0.0f)) x.push_back(v);
  const double tiny = std::ldexp(1.0, -126);
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    kernels::set_simd_target_for_test(target);
    std::vector<float> y(x.size());
    kernels::softmax_exp_for_test(x.data(), y.data(), static_cast<int64_t>(x.size()));
    // Targets without fused multiply-adds round each step of the polynomial twice: 1.17 ulp
    // measured there.
    const bool fma = (target & (HWY_SSE4 | HWY_SSSE3 | HWY_SCALAR | HWY_EMU128)) == 0;
    const double bound = fma ? 1.0 : 1.25;
    double worst = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const double e = std::exp(static_cast<double>(x[i]));
      ASSERT_GE(y[i], 0.0f) << "x = " << x[i];
      if (e >= tiny) {
        const float ef = static_cast<float>(e);
        const double ulp = std::nextafter(ef, 2.0f * ef) - ef;
        worst = std::max(worst, std::abs(y[i] - e) / ulp);
        ASSERT_LE(std::abs(y[i] - e), bound * ulp) << "x = " << x[i];
      } else {
        ASSERT_LT(std::abs(y[i] - e), tiny) << "x = " << x[i];
      }
      if (x[i] <= -87.7f) {
        ASSERT_EQ(y[i], 0.0f) << "x = " << x[i];
      }
    }
    EXPECT_EQ(y[0], 1.0f);
    EXPECT_EQ(y[1], 1.0f);
    std::cout << "  " << hwy::TargetName(target) << ": worst " << worst << " ulp over " << x.size()
              << " arguments\n";
  }
  kernels::set_simd_target_for_test(0);
}

// DeBERTa with spans wide enough for every fast path of the kernel: constant and linear runs of
// the index tables (broadcasts, contiguous and reversed loads, the diagonal p2c band), the
// log-bucket gathers, both p2c forms (the table rising or falling with the key position),
// queries offset from the keys, windows, the per-group tables (long sequences at 1 and 2
// threads) and the all-heads tables (3 threads), and every compiled SIMD target.
TEST(FusedAttention, DebertaWideSpans) {
  const std::vector<DebertaBuckets> configs = {
      {.max_relative_positions = 256, .position_buckets = 64, .p2c = DebertaP2c::kPaper},
      {.max_relative_positions = 256, .position_buckets = 64, .p2c = DebertaP2c::kModel},
      {.max_relative_positions = 40, .p2c = DebertaP2c::kPaper},
      {.max_relative_positions = 40, .p2c = DebertaP2c::kModel},
  };
  const std::vector<Shape> shapes = {{1, 520, 530, 2, 2, 16}, {2, 100, 300, 4, 2, 8}};
  uint64_t seed = 500;
  for (const auto& cfg : configs) {
    for (const auto& s : shapes) {
      for (bool causal : {false, true}) {
        ++seed;
        std::mt19937_64 rng(seed);
        const int64_t k = cfg.span();
        const auto pk = cases::randn_f(rng, 2 * k * s.heads_q * s.dim, 0.5);
        const auto pq = cases::randn_f(rng, 2 * k * s.heads_q * s.dim, 0.5);
        const DeBERTa scheme{View<const float, 3>::contiguous(pk.data(), {2 * k, s.heads_q, s.dim}),
                             View<const float, 3>::contiguous(pq.data(), {2 * k, s.heads_q, s.dim}),
                             cfg};
        const auto c = make_case(s, rng);
        SCOPED_TRACE(str(s) + (causal ? " causal" : " bidirectional") + " K " + std::to_string(k) +
                     (cfg.p2c == DebertaP2c::kModel ? " model p2c" : " paper p2c"));
        std::vector<float> first;
        for (int threads : {1, 2, 3}) {
          const AttentionOptions opt{.causal = causal, .num_threads = threads};
          if (threads == 1) check(c, scheme, opt);
          const auto out = run(&attention, c, scheme, opt);
          if (first.empty()) {
            first = out;
          } else {
            EXPECT_EQ(out, first) << threads << " threads";
          }
        }
        if (s.batch == 2) {
          check(c, scheme, {.causal = causal, .window = 45});
          // Queries at the end of the keys (docs/attention.md default positions for Lq != Lk).
          const auto qpos = Positions::shared([&] {
            std::vector<int64_t> ids(static_cast<size_t>(s.seq_q));
            for (int64_t i = 0; i < s.seq_q; ++i) ids[static_cast<size_t>(i)] = 1000 + 2 * i;
            return ids;
          }());
          check(c, scheme, {.causal = false}, &qpos);
        }
      }
    }
  }
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    kernels::set_simd_target_for_test(target);
    std::mt19937_64 rng(600);
    const Shape s{1, 150, 200, 2, 1, 12};
    const DebertaBuckets cfg{.max_relative_positions = 128, .position_buckets = 48};
    const auto pk = cases::randn_f(rng, 2 * cfg.span() * s.heads_q * s.dim, 0.5);
    const auto pq = cases::randn_f(rng, 2 * cfg.span() * s.heads_q * s.dim, 0.5);
    const DeBERTa scheme{
        View<const float, 3>::contiguous(pk.data(), {2 * cfg.span(), s.heads_q, s.dim}),
        View<const float, 3>::contiguous(pq.data(), {2 * cfg.span(), s.heads_q, s.dim}), cfg};
    const auto c = make_case(s, rng);
    check(c, scheme, {.causal = true});
    check(c, scheme, {.causal = false});
  }
  kernels::set_simd_target_for_test(0);
}

// Transformer-XL with a model dimension over the kernel's chunk of 128 (the projection of the
// sinusoid accumulates over chunks) and head dims that are and are not multiples of 4.
TEST(FusedAttention, XlWideModelDimension) {
  uint64_t seed = 700;
  for (const int64_t dim : {12, 10}) {
    for (const int64_t d_model : {300, 256}) {
      for (bool causal : {false, true}) {
        std::mt19937_64 rng(++seed);
        const Shape s{1, 40, 90, 3, 3, dim};
        const auto uv = cases::randn_f(rng, 2 * s.heads_q * dim, 0.5);
        const auto w = cases::randn_f(rng, s.heads_q * dim * d_model, 0.1);
        const TransformerXL scheme{
            View<const float, 2>::contiguous(uv.data(), {s.heads_q, dim}),
            View<const float, 2>::contiguous(uv.data() + s.heads_q * dim, {s.heads_q, dim}),
            View<const float, 2>::contiguous(w.data(), {s.heads_q * dim, d_model})};
        const auto c = make_case(s, rng);
        SCOPED_TRACE("D " + std::to_string(dim) + " d_model " + std::to_string(d_model) +
                     (causal ? " causal" : ""));
        check(c, scheme, {.causal = causal});
      }
    }
  }
}

// Strided (non-contiguous) views: q as [B, H, L, D] storage, out with padding.
TEST(FusedAttention, NonContiguousViews) {
  const Shape s{2, 9, 70, 4, 2, 16};
  std::mt19937_64 rng(15);
  const auto c = make_case(s, rng);
  const auto box = cases::make_scheme("alibi", s.heads_q, s.dim, rng);
  const auto expect = run(&attention, c, box->scheme, {.causal = true});
  std::vector<float> qt(c.q.size());
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t i = 0; i < s.seq_q; ++i)
      for (int64_t h = 0; h < s.heads_q; ++h)
        for (int64_t x = 0; x < s.dim; ++x)
          qt[static_cast<size_t>(((b * s.heads_q + h) * s.seq_q + i) * s.dim + x)] =
              c.q[static_cast<size_t>(((b * s.seq_q + i) * s.heads_q + h) * s.dim + x)];
  std::vector<float> out(2 * c.q.size(), 5.0f);
  attention(View<const float, 4>{qt.data(),
                                 {s.batch, s.seq_q, s.heads_q, s.dim},
                                 {s.heads_q * s.seq_q * s.dim, s.dim, s.seq_q * s.dim, 1}},
            View<const float, 4>::contiguous(c.k.data(), {s.batch, s.seq_k, s.heads_kv, s.dim}),
            View<const float, 4>::contiguous(c.v.data(), {s.batch, s.seq_k, s.heads_kv, s.dim}),
            box->scheme, {.causal = true},
            View<float, 4>{out.data(),
                           {s.batch, s.seq_q, s.heads_q, s.dim},
                           {s.seq_q * s.heads_q * 2 * s.dim, s.heads_q * 2 * s.dim, 2 * s.dim, 1}});
  for (int64_t r = 0; r < s.batch * s.seq_q * s.heads_q; ++r) {
    for (int64_t x = 0; x < s.dim; ++x) {
      ASSERT_EQ(out[static_cast<size_t>(r * 2 * s.dim + x)],
                expect[static_cast<size_t>(r * s.dim + x)]);
      ASSERT_EQ(out[static_cast<size_t>(r * 2 * s.dim + s.dim + x)], 5.0f);
    }
  }
}

TEST(FusedAttention, FullyMaskedRowsAreRejectedUnlessAllowed) {
  const Shape s{1, 2, 3, 1, 1, 4};
  std::mt19937_64 rng(17);
  const auto c = make_case(s, rng);
  const auto qp = Positions::shared({2, 20}), kp = Positions::shared({0, 1, 2});
  EXPECT_THROW(run(&attention, c, NoPositions{}, {.causal = true, .window = 3}, &qp, &kp),
               ValueError);
  const auto out = run(&attention, c, NoPositions{},
                       {.causal = true, .window = 3, .allow_fully_masked = true}, &qp, &kp);
  for (int x = 4; x < 8; ++x) EXPECT_EQ(out[static_cast<size_t>(x)], 0.0f);
}

// NaN/Inf inputs are reported (naming the tensor and the element) without a scan up front:
// the kernel flags NaN scores and the API traces non-finite results back to their input.
TEST(FusedAttention, NonFiniteInputsAreReported) {
  const Shape s{1, 70, 70, 2, 1, 16};
  for (const char* which : {"q", "k", "v"}) {
    std::mt19937_64 rng(19);
    auto c = make_case(s, rng);
    std::vector<float>& t = which[0] == 'q' ? c.q : (which[0] == 'k' ? c.k : c.v);
    t[t.size() - 3] = std::numeric_limits<float>::quiet_NaN();
    try {
      run(&attention, c, NoPositions{}, {.causal = true});
      ADD_FAILURE() << which << ": expected an error";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("attention: ") + which + ": non-finite"),
                std::string::npos)
          << e.what();
    }
  }
  // Finite inputs whose scores overflow float32.
  std::mt19937_64 rng(21);
  auto c = make_case(s, rng);
  for (auto& x : c.q) x *= 3e20f;  // q . k ~ 1e41 > FLT_MAX
  for (auto& x : c.k) x *= 3e20f;
  EXPECT_THROW(run(&attention, c, NoPositions{}, {.causal = true}), ValueError);
}

}  // namespace
