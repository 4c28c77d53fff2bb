// tests/test_attention.cc - posenc::ref::attention (float64 oracle) against the independent
// textbook implementation, the float32 path against the oracle, and the API's validation.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_cases.h"
#include "attention_textbook.h"
#include "posenc/posenc.h"

namespace {

using namespace posenc;

struct Shape {
  int64_t batch, seq_q, seq_k, heads_q, heads_kv, dim;
};

std::vector<double> randn(std::mt19937_64& rng, int64_t n) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = nd(rng);
  return v;
}

std::vector<float> to_f32(const std::vector<double>& x) { return {x.begin(), x.end()}; }
std::vector<double> to_f64(const std::vector<float>& x) { return {x.begin(), x.end()}; }

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double e = 0;
  for (std::size_t i = 0; i < a.size(); ++i) e = std::max(e, std::abs(a[i] - b[i]));
  return e;
}

// A random problem; float32-representable inputs so the float and double paths see equal data.
struct Inputs {
  Shape s;
  std::vector<double> q, k, v;
};

Inputs make_inputs(const Shape& s, std::mt19937_64& rng) {
  Inputs in{s, {}, {}, {}};
  const int64_t nq = s.batch * s.seq_q * s.heads_q * s.dim;
  const int64_t nk = s.batch * s.seq_k * s.heads_kv * s.dim;
  in.q = to_f64(to_f32(randn(rng, nq)));
  in.k = to_f64(to_f32(randn(rng, nk)));
  in.v = to_f64(to_f32(randn(rng, nk)));
  return in;
}

std::vector<double> run_ref(const Inputs& in, const PositionScheme& scheme,
                            const AttentionOptions& opt, const Positions* qp = nullptr,
                            const Positions* kp = nullptr) {
  const Shape& s = in.s;
  std::vector<double> out(in.q.size());
  ref::attention(
      View<const double, 4>::contiguous(in.q.data(), {s.batch, s.seq_q, s.heads_q, s.dim}),
      View<const double, 4>::contiguous(in.k.data(), {s.batch, s.seq_k, s.heads_kv, s.dim}),
      View<const double, 4>::contiguous(in.v.data(), {s.batch, s.seq_k, s.heads_kv, s.dim}), scheme,
      opt, View<double, 4>::contiguous(out.data(), {s.batch, s.seq_q, s.heads_q, s.dim}), qp, kp);
  return out;
}

std::vector<double> run_f32(const Inputs& in, const PositionScheme& scheme,
                            const AttentionOptions& opt, const Positions* qp = nullptr,
                            const Positions* kp = nullptr) {
  const Shape& s = in.s;
  const auto q = to_f32(in.q), k = to_f32(in.k), v = to_f32(in.v);
  std::vector<float> out(q.size());
  attention(View<const float, 4>::contiguous(q.data(), {s.batch, s.seq_q, s.heads_q, s.dim}),
            View<const float, 4>::contiguous(k.data(), {s.batch, s.seq_k, s.heads_kv, s.dim}),
            View<const float, 4>::contiguous(v.data(), {s.batch, s.seq_k, s.heads_kv, s.dim}),
            scheme, opt,
            View<float, 4>::contiguous(out.data(), {s.batch, s.seq_q, s.heads_q, s.dim}), qp, kp);
  return to_f64(out);
}

textbook::Problem textbook_problem(const Inputs& in, const AttentionOptions& opt,
                                   const Positions& qp, const Positions& kp) {
  const Shape& s = in.s;
  return textbook::Problem{s.batch, s.seq_q, s.seq_k, s.heads_q, s.heads_kv, s.dim,     in.q,
                           in.k,    in.v,    qp,      kp,        opt.causal, opt.scale, opt.window};
}

// Every scheme x causal/bidirectional x MHA/GQA/MQA x Lq != Lk x sizes, default positions:
// oracle == textbook to 1e-12, float32 path == oracle to float32 accuracy.
TEST(Attention, ReferenceMatchesTextbookAndFloat32MatchesReference) {
  const std::vector<Shape> shapes = {
      {1, 1, 1, 1, 1, 1},    {2, 3, 5, 4, 2, 4},   {1, 7, 7, 8, 1, 6}, {2, 4, 9, 3, 3, 2},
      {1, 17, 17, 4, 4, 17}, {1, 2, 33, 8, 2, 16}, {3, 5, 6, 2, 1, 3},
  };
  uint64_t seed = 1;
  for (const auto& s : shapes) {
    for (const auto& name : cases::kSchemes) {
      for (int variant = 0; variant < 4; ++variant) {
        for (bool causal : {false, true}) {
          ++seed;
          SCOPED_TRACE("seed " + std::to_string(seed) + " scheme " + name + " variant " +
                       std::to_string(variant) + (causal ? " causal" : " bidirectional") +
                       " shape B" + std::to_string(s.batch) + " Lq" + std::to_string(s.seq_q) +
                       " Lk" + std::to_string(s.seq_k) + " Hq" + std::to_string(s.heads_q) +
                       " Hkv" + std::to_string(s.heads_kv) + " D" + std::to_string(s.dim));
          std::mt19937_64 rng(seed);
          if (name == "rope" && s.dim < 2) continue;
          const auto box = cases::make_scheme(name, s.heads_q, s.dim, rng, variant);
          const auto in = make_inputs(s, rng);
          const AttentionOptions opt{.causal = causal};
          const auto ref_out = run_ref(in, box->scheme, opt);
          const auto tb = textbook::attention(
              textbook_problem(in, opt, Positions::offset(s.seq_k - s.seq_q), Positions::offset(0)),
              box->scheme);
          ASSERT_LE(max_abs_diff(ref_out, tb), 1e-12);
          const auto f = run_f32(in, box->scheme, opt);
          // Float32 accumulation over at most 33 keys and 17 dims of unit-scale data: a few
          // hundred ulps of 1 at most.
          EXPECT_LE(max_abs_diff(f, ref_out), 2e-5);
        }
      }
    }
  }
}

// Explicit per-row position ids (left padding, gaps) and sliding windows.
TEST(Attention, ExplicitPositionsAndWindow) {
  const Shape s{2, 4, 6, 4, 2, 8};
  std::mt19937_64 rng(99);
  const auto qp = Positions::per_row({10, 11, 12, 20, 3, 4, 5, 6}, 2, 4);
  const auto kp = Positions::per_row({7, 8, 9, 10, 11, 12, 0, 2, 3, 4, 5, 6}, 2, 6);
  for (const auto& name : cases::kSchemes) {
    for (bool causal : {false, true}) {
      for (std::optional<int64_t> window : {std::optional<int64_t>{}, std::optional<int64_t>{3}}) {
        SCOPED_TRACE(name + (causal ? " causal" : "") + (window ? " window 3" : ""));
        const auto box = cases::make_scheme(name, s.heads_q, s.dim, rng, 1);
        const auto in = make_inputs(s, rng);
        const AttentionOptions opt{.causal = causal, .window = window, .allow_fully_masked = true};
        const auto ref_out = run_ref(in, box->scheme, opt, &qp, &kp);
        const auto tb = textbook::attention(textbook_problem(in, opt, qp, kp), box->scheme);
        ASSERT_LE(max_abs_diff(ref_out, tb), 1e-12);
        EXPECT_LE(max_abs_diff(run_f32(in, box->scheme, opt, &qp, &kp), ref_out), 2e-5);
      }
    }
  }
}

// Query 3 of row 0 sits at position 20, beyond every key with window 3: fully masked.
TEST(Attention, FullyMaskedRowIsAnErrorUnlessAllowed) {
  const Shape s{1, 2, 3, 1, 1, 2};
  std::mt19937_64 rng(5);
  const auto in = make_inputs(s, rng);
  const auto qp = Positions::shared({2, 20});
  const auto kp = Positions::shared({0, 1, 2});
  AttentionOptions opt{.causal = true, .window = 3};
  try {
    run_ref(in, NoPositions{}, opt, &qp, &kp);
    FAIL() << "expected an error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("sees no key"), std::string::npos) << e.what();
  }
  EXPECT_THROW(run_f32(in, NoPositions{}, opt, &qp, &kp), ValueError);
  opt.allow_fully_masked = true;
  const auto out = run_f32(in, NoPositions{}, opt, &qp, &kp);
  EXPECT_EQ(out[2], 0.0);
  EXPECT_EQ(out[3], 0.0);
  EXPECT_NE(out[0], 0.0);
}

// Hand-computed: two keys, one query, D = 1, ALiBi slope 1/2 for a single head... with H = 1 the
// slope is 2^-8. Scores: q.k / 1 - m |rel|.
TEST(Attention, HandComputedAlibi) {
  const Inputs in{{1, 1, 2, 1, 1, 1}, {1.0}, {2.0, 0.5}, {10.0, -4.0}};
  const auto out = run_ref(in, Alibi{}, {});
  const double m = std::exp2(-8.0);
  const double s0 = 2.0 - m * 1, s1 = 0.5 - 0;  // query at position 1, keys at 0 and 1
  const double w0 = std::exp(s0) / (std::exp(s0) + std::exp(s1));
  EXPECT_NEAR(out[0], w0 * 10.0 + (1 - w0) * -4.0, 1e-14);
}

// Hand-computed Shaw value term: one query, two keys, equal scores -> average of v + rel_v.
TEST(Attention, HandComputedShawValueTerm) {
  const Inputs in{{1, 1, 2, 1, 1, 1}, {0.0}, {0.0, 0.0}, {1.0, 3.0}};
  const std::vector<float> rk = {0, 0, 0}, rv = {100, 10, 1};  // K = 1: rel -1, 0, +1
  const Shaw shaw{shaw_table(View<const float, 2>::contiguous(rk.data(), {3, 1})),
                  shaw_table(View<const float, 2>::contiguous(rv.data(), {3, 1}))};
  // Query at position 1: key 0 has rel -1 (rel_v 100), key 1 rel 0 (rel_v 10).
  EXPECT_NEAR(run_ref(in, shaw, {})[0], 0.5 * (1 + 100) + 0.5 * (3 + 10), 1e-12);
}

TEST(Attention, T5UsesScaleOneWhenAsked) {
  const Inputs in{
      {1, 1, 2, 1, 1, 4}, {1, 1, 1, 1}, {1, 1, 1, 1, 0, 0, 0, 0}, {1, 0, 0, 0, 0, 0, 0, 0}};
  std::vector<float> table(32, 0.0f);
  const T5Bias t5{View<const float, 2>::contiguous(table.data(), {32, 1})};
  // Scores 4 * scale vs 0: with scale 1 the weight of key 0 is e^4 / (e^4 + 1).
  const auto out = run_ref(in, t5, {.scale = 1.0});
  EXPECT_NEAR(out[0], std::exp(4.0) / (std::exp(4.0) + 1.0), 1e-14);
  const auto out_default = run_ref(in, t5, {});
  EXPECT_NEAR(out_default[0], std::exp(2.0) / (std::exp(2.0) + 1.0), 1e-14);
}

TEST(Attention, NonContiguousViewsGiveTheSameResult) {
  const Shape s{2, 3, 5, 4, 2, 6};
  std::mt19937_64 rng(17);
  const auto in = make_inputs(s, rng);
  const auto box = cases::make_scheme("t5", s.heads_q, s.dim, rng);
  const AttentionOptions opt{.causal = true};
  const auto expect = run_f32(in, box->scheme, opt);
  // Store q as [B, H, L, D] (transposed heads/seq) and k, v with padding in the last-but-one dim.
  std::vector<float> q(in.q.size()), k(2 * in.k.size()), v(2 * in.v.size());
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t i = 0; i < s.seq_q; ++i)
      for (int64_t h = 0; h < s.heads_q; ++h)
        for (int64_t c = 0; c < s.dim; ++c)
          q[((b * s.heads_q + h) * s.seq_q + i) * s.dim + c] =
              static_cast<float>(in.q[((b * s.seq_q + i) * s.heads_q + h) * s.dim + c]);
  for (std::size_t t = 0; t < in.k.size(); ++t) {
    const std::size_t row = t / s.dim, c = t % s.dim;
    k[row * 2 * s.dim + c] = static_cast<float>(in.k[t]);
    v[row * 2 * s.dim + c] = static_cast<float>(in.v[t]);
  }
  std::vector<float> out(2 * in.q.size(), -1.0f);
  View<const float, 4> qv{q.data(),
                          {s.batch, s.seq_q, s.heads_q, s.dim},
                          {s.heads_q * s.seq_q * s.dim, s.dim, s.seq_q * s.dim, 1}};
  View<const float, 4> kv{k.data(),
                          {s.batch, s.seq_k, s.heads_kv, s.dim},
                          {s.seq_k * s.heads_kv * 2 * s.dim, s.heads_kv * 2 * s.dim, 2 * s.dim, 1}};
  View<const float, 4> vv{v.data(), kv.shape, kv.stride};
  View<float, 4> ov{out.data(),
                    {s.batch, s.seq_q, s.heads_q, s.dim},
                    {s.seq_q * s.heads_q * 2 * s.dim, s.heads_q * 2 * s.dim, 2 * s.dim, 1}};
  attention(qv, kv, vv, box->scheme, opt, ov);
  for (int64_t r = 0; r < s.batch * s.seq_q * s.heads_q; ++r) {
    for (int64_t c = 0; c < s.dim; ++c) {
      EXPECT_EQ(out[r * 2 * s.dim + c], static_cast<float>(expect[r * s.dim + c]));
      EXPECT_EQ(out[r * 2 * s.dim + s.dim + c], -1.0f) << "padding written";
    }
  }
}

// ---- validation --------------------------------------------------------------------------------

struct Bad {
  std::vector<float> q, k, v, out;
};

void call(const Shape& s, const PositionScheme& scheme = NoPositions{},
          const AttentionOptions& opt = {}, const Positions* qp = nullptr,
          const Positions* kp = nullptr, int64_t v_dim = -1, int64_t out_heads = -1) {
  const int64_t vd = v_dim < 0 ? s.dim : v_dim;
  const int64_t oh = out_heads < 0 ? s.heads_q : out_heads;
  std::vector<float> q(s.batch * s.seq_q * s.heads_q * s.dim, 0.5f),
      k(s.batch * s.seq_k * s.heads_kv * s.dim, 0.25f),
      v(s.batch * s.seq_k * s.heads_kv * vd, 1.0f), out(s.batch * s.seq_q * oh * s.dim);
  attention(View<const float, 4>::contiguous(q.data(), {s.batch, s.seq_q, s.heads_q, s.dim}),
            View<const float, 4>::contiguous(k.data(), {s.batch, s.seq_k, s.heads_kv, s.dim}),
            View<const float, 4>::contiguous(v.data(), {s.batch, s.seq_k, s.heads_kv, vd}), scheme,
            opt, View<float, 4>::contiguous(out.data(), {s.batch, s.seq_q, oh, s.dim}), qp, kp);
}

template <class E>
void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << needle << "'";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(AttentionValidation, ShapesAndHeads) {
  expect_error<ShapeError>(
      [] {
        call({1, 2, 2, 8, 3, 4});
      },
      "kv heads (3) must divide q heads (8)");
  expect_error<ShapeError>(
      [] {
        call({1, 2, 2, 2, 2, 4}, NoPositions{}, {}, nullptr, nullptr, 5);
      },
      "same shape");
  expect_error<ShapeError>(
      [] {
        call({1, 2, 2, 2, 2, 4}, NoPositions{}, {}, nullptr, nullptr, -1, 1);
      },
      "out");
  expect_error<ValueError>(
      [] {
        call({1, 3, 2, 1, 1, 4});
      },
      "query length (3) exceeds key length (2)");
  // Lq > Lk is fine with explicit positions.
  const auto qp = Positions::offset(0), kp = Positions::offset(0);
  EXPECT_NO_THROW(call({1, 3, 2, 1, 1, 4}, NoPositions{}, {.allow_fully_masked = true}, &qp, &kp));
}

TEST(AttentionValidation, EmptyAndSingleToken) {
  EXPECT_NO_THROW(call({0, 2, 2, 1, 1, 4}));
  EXPECT_NO_THROW(call({1, 0, 2, 1, 1, 4}));
  EXPECT_NO_THROW(call({1, 1, 1, 1, 1, 1}, NoPositions{}, {.causal = true}));
  // Queries but no keys: every row is fully masked.
  const auto qp = Positions::offset(0);
  expect_error<ValueError>(
      [&] {
        call({1, 1, 0, 1, 1, 4}, NoPositions{}, {}, &qp);
      },
      "sees no key");
}

TEST(AttentionValidation, PositionsAndOptions) {
  const auto bad = Positions::shared({0, -1});
  expect_error<ValueError>([&] { call({1, 2, 2, 1, 1, 4}, NoPositions{}, {}, &bad); }, "-1");
  const auto short_ids = Positions::shared({0});
  expect_error<ShapeError>(
      [&] {
        call({1, 2, 2, 1, 1, 4}, NoPositions{}, {}, &short_ids);
      },
      "1 position ids given for a sequence of 2");
  expect_error<ValueError>(
      [] {
        call({1, 2, 2, 1, 1, 4}, NoPositions{}, {.window = 0});
      },
      "window");
  expect_error<ValueError>(
      [] {
        call({1, 2, 2, 1, 1, 4}, NoPositions{}, {.scale = NAN});
      },
      "scale");
}

TEST(AttentionValidation, NonFiniteInputs) {
  std::vector<float> q(4, 1.0f), k(4, 1.0f), v(4, 1.0f), out(4);
  k[2] = NAN;
  expect_error<ValueError>(
      [&] {
        attention(View<const float, 4>::contiguous(q.data(), {1, 1, 1, 4}),
                  View<const float, 4>::contiguous(k.data(), {1, 1, 1, 4}),
                  View<const float, 4>::contiguous(v.data(), {1, 1, 1, 4}), NoPositions{}, {},
                  View<float, 4>::contiguous(out.data(), {1, 1, 1, 4}));
      },
      "attention: k: non-finite value nan at [0, 0, 0, 2]");
}

// The backward's up-front checks of out and dout (compact views: one vectorized pass over the
// exponent bits; strided views: row by row) find every kind of non-finite value anywhere,
// including the vector loop's tail, and name its index; nothing is written to dq, dk, dv.
TEST(AttentionValidation, NonFiniteBackwardInputsAnywhere) {
  const std::array<int64_t, 4> sh{1, 37, 3, 5};  // 555 elements: not a multiple of any vector
  const int64_t n = 555;
  std::vector<float> q(n, 0.5f), k(n, 0.25f), v(n, 1.0f), out(n, 1.0f), lse(111, 1.0f);
  const uint32_t patterns[] = {0x7f800000u, 0xff800000u, 0x7fc00000u,
                               0xffc00000u, 0x7f800001u, 0xffffffffu};
  const auto cv = [](const std::vector<float>& x, const std::array<int64_t, 4>& s) {
    return View<const float, 4>::contiguous(x.data(), s);
  };
  for (const bool strided : {false, true}) {
    for (const int64_t at : {int64_t{0}, int64_t{17}, int64_t{553}, int64_t{554}}) {
      for (const uint32_t bits : patterns) {
        // Strided: dout is every other float of a buffer twice the size (not compact).
        std::vector<float> buf(strided ? 2 * n : n, 1.0f);
        float bad;
        std::memcpy(&bad, &bits, sizeof bad);
        buf[static_cast<size_t>(strided ? 2 * at : at)] = bad;
        View<const float, 4> dout = cv(buf, sh);
        if (strided) dout.stride = {2 * n, 2 * 15, 2 * 5, 2};
        std::vector<float> dq(n, 3.0f), dk(n, 3.0f), dv(n, 3.0f);
        AttentionGrads g;
        g.dq = View<float, 4>::contiguous(dq.data(), sh);
        g.dk = View<float, 4>::contiguous(dk.data(), sh);
        g.dv = View<float, 4>::contiguous(dv.data(), sh);
        const int64_t i = at / 15, h = at % 15 / 5, x = at % 5;
        expect_error<ValueError>(
            [&] {
              attention_backward(cv(q, sh), cv(k, sh), cv(v, sh), cv(out, sh),
                                 View<const float, 3>::contiguous(lse.data(), {1, 3, 37}), dout,
                                 NoPositions{}, {}, g);
            },
            "attention_backward: dout: non-finite value " +
                std::string(std::signbit(bad) ? "-" : "") + (std::isnan(bad) ? "nan" : "inf") +
                " at [0, " + std::to_string(i) + ", " + std::to_string(h) + ", " +
                std::to_string(x) + "]");
        EXPECT_EQ(dq, std::vector<float>(n, 3.0f));
        EXPECT_EQ(dk, std::vector<float>(n, 3.0f));
      }
    }
  }
}

// Tensors of a million floats and more are scanned by several threads (num_threads): a value
// that is not finite in any part, q's or dout's, is still named at its index, and nothing is
// written.
TEST(AttentionValidation, NonFiniteLargeInputsScannedInParallel) {
  const std::array<int64_t, 4> sh{1, 2048, 4, 129};  // 1,056,768 floats
  const int64_t n = 2048 * 4 * 129;
  std::vector<float> q(n, 0.5f), k(n, 0.25f), v(n, 1.0f), out(n, 1.0f), dout(n, 1.0f);
  std::vector<float> lse(4 * 2048, 1.0f);
  const auto cv = [&](const std::vector<float>& x) {
    return View<const float, 4>::contiguous(x.data(), sh);
  };
  for (const char* which : {"q", "dout"}) {
    for (const int64_t at : {int64_t{1}, n / 3 + 7, n - 1}) {
      for (const int threads : {2, 3}) {
        std::vector<float>& t = which[0] == 'q' ? q : dout;
        t[static_cast<size_t>(at)] = -std::numeric_limits<float>::infinity();
        std::vector<float> dq(n, 3.0f), dk(n, 3.0f), dv(n, 3.0f);
        AttentionGrads g;
        g.dq = View<float, 4>::contiguous(dq.data(), sh);
        g.dk = View<float, 4>::contiguous(dk.data(), sh);
        g.dv = View<float, 4>::contiguous(dv.data(), sh);
        AttentionOptions opt;
        opt.num_threads = threads;
        const int64_t i = at / (4 * 129), h = at % (4 * 129) / 129, x = at % 129;
        const std::string prefix = which[0] == 'q' ? "attention: q" : "attention_backward: dout";
        expect_error<ValueError>(
            [&] {
              attention_backward(cv(q), cv(k), cv(v), cv(out),
                                 View<const float, 3>::contiguous(lse.data(), {1, 4, 2048}),
                                 cv(dout), NoPositions{}, opt, g);
            },
            prefix + ": non-finite value -inf at [0, " + std::to_string(i) + ", " +
                std::to_string(h) + ", " + std::to_string(x) + "]");
        EXPECT_EQ(dq[static_cast<size_t>(at)], 3.0f);
        EXPECT_EQ(dv[static_cast<size_t>(n - 1)], 3.0f);
        t[static_cast<size_t>(at)] = which[0] == 'q' ? 0.5f : 1.0f;
      }
    }
  }
}

TEST(AttentionValidation, SchemeTables) {
  const Shape s{1, 2, 2, 2, 2, 4};
  std::vector<float> t(32 * 3, 0.0f);
  expect_error<ValueError>(
      [&] {
        call(s, T5Bias{View<const float, 2>::contiguous(t.data(), {31, 2})});
      },
      "num_buckets must be even");
  expect_error<ShapeError>(
      [&] {
        call(s, T5Bias{View<const float, 2>::contiguous(t.data(), {30, 1})});
      },
      "relative_attention_bias");
  expect_error<ShapeError>([&] { call(s, Alibi{.slopes = {0.5}}); }, "1 slopes given for 2");
  expect_error<ShapeError>(
      [&] {
        call(s, Shaw{View<const float, 3>::contiguous(t.data(), {4, 1, 4}), {}});
      },
      "odd");
  expect_error<ShapeError>(
      [&] {
        call(s, Shaw{View<const float, 3>::contiguous(t.data(), {3, 3, 4}), {}});
      },
      "must be 1 (shared) or heads_q");
  expect_error<ShapeError>(
      [&] {
        call(s, DeBERTa{View<const float, 3>::contiguous(t.data(), {6, 2, 4}),
                        View<const float, 3>::contiguous(t.data(), {6, 2, 4}),
                        {.max_relative_positions = 4}});
      },
      "pos_key [2K, heads, head_dim] (K = 4)");
  expect_error<ShapeError>([&] { call(s, Rope{rope_frequencies({.head_dim = 8})}); },
                           "rotary_dim (8) exceeds head_dim (4)");
  t[0] = INFINITY;
  expect_error<ValueError>(
      [&] {
        call(s, T5Bias{View<const float, 2>::contiguous(t.data(), {32, 2})});
      },
      "non-finite");
}

}  // namespace
