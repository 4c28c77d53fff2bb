// tests/test_scheme.cc - posenc::build_scheme (settings + model config + named parameter tensors
// -> PositionScheme, shared by the CLI and Python) and the oracle's float64 parameter tables
// (ref::SchemeTables).
//
//   1. A built scheme computes what the hand-built scheme computes (bit for bit), pointing into
//      the caller's float32 tensors without copies (float64 ones under SchemePrecision::kFloat64).
//   2. Float64 tables holding float32 values give the oracle's float32-table results bit for bit.
//   3. Float64 tables off the float32 grid: the oracle's forward agrees with an independent
//      materialized float64 computation written here to ~1e-15 relative (cutting the tables to
//      float32 would show ~1e-8), and its table gradients agree with 5-point finite differences
//      whose steps are not float32-representable.
//   4. Model configs, settings conflicts and bad tensors give errors naming the problem.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "posenc/posenc.h"

namespace {

using namespace posenc;

struct Dims4 {
  int64_t batch = 2, seq_q = 5, seq_k = 7, heads_q = 4, heads_kv = 2, dim = 6;
};

std::vector<double> randn(std::mt19937_64& rng, std::size_t n, double sd = 1.0) {
  std::normal_distribution<double> nd(0.0, sd);
  std::vector<double> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

std::vector<float> to_f32(const std::vector<double>& v) {
  return std::vector<float>(v.begin(), v.end());
}

std::vector<double> widen(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double x : a) m = std::max(m, std::fabs(x));
  return m;
}

double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

// Named float64 parameter tensors of a scheme (random, off the float32 grid) and their shapes.
struct Params {
  std::map<std::string, std::vector<double>> values;
  std::map<std::string, std::vector<int64_t>> shapes;

  ParamMap map64() const {
    ParamMap m;
    for (const auto& [n, v] : values) m[n] = ParamTensor{nullptr, v.data(), shapes.at(n), {}};
    return m;
  }
};

// variant (shaw): 0 shared tables, 1 per-head tables, 2 shared rel_k with per-head rel_v.
Params make_params(const std::string& scheme, const Dims4& d, std::mt19937_64& rng,
                   int variant = 0) {
  Params p;
  auto add = [&](const std::string& n, std::vector<int64_t> shape, double sd) {
    std::size_t count = 1;
    for (int64_t s : shape) count *= static_cast<std::size_t>(s);
    p.values[n] = randn(rng, count, sd);
    p.shapes[n] = std::move(shape);
  };
  if (scheme == "t5") {
    add("relative_attention_bias", {16, d.heads_q}, 1.0);
  } else if (scheme == "shaw") {
    const int64_t rows = 2 * 2 + 1;
    if (variant == 1) {
      add("rel_k", {rows, d.heads_q, d.dim}, 0.5);
      add("rel_v", {rows, d.heads_q, d.dim}, 0.5);
    } else {
      add("rel_k", {rows, d.dim}, 0.5);
      if (variant == 2) {
        add("rel_v", {rows, d.heads_q, d.dim}, 0.5);
      } else {
        add("rel_v", {rows, d.dim}, 0.5);
      }
    }
  } else if (scheme == "xl") {
    add("r_w_bias", {d.heads_q, d.dim}, 0.5);
    add("r_r_bias", {d.heads_q, d.dim}, 0.5);
    add("r_net", {d.heads_q * d.dim, 8}, 0.3);
  } else if (scheme == "deberta") {
    add("pos_key", {2 * 4, d.heads_q, d.dim}, 0.5);
    add("pos_query", {2 * 4, d.heads_q, d.dim}, 0.5);
  }
  return p;
}

SchemeSettings settings_for(const std::string& scheme) {
  SchemeSettings s;
  s.scheme = scheme;
  s.max_distance = 20;
  s.max_relative_positions = 4;
  return s;
}

SchemeDims dims_of(const Dims4& d) {
  return {.heads_q = d.heads_q, .heads_kv = d.heads_kv, .head_dim = d.dim, .seq_len = d.seq_k};
}

// An independent float64 attention with float64 tables for t5, shaw, xl and deberta: full score
// rows from the formulas of docs/, default positions (query i at seq_k - seq_q + i).
std::vector<double> independent(const std::string& scheme, const Dims4& d, const Params& p,
                                const std::vector<double>& q, const std::vector<double>& k,
                                const std::vector<double>& v, bool causal) {
  const int64_t D = d.dim, group = d.heads_q / d.heads_kv;
  auto Q = [&](int64_t b, int64_t i, int64_t h, int64_t c) {
    return q[static_cast<std::size_t>(((b * d.seq_q + i) * d.heads_q + h) * D + c)];
  };
  auto K = [&](const std::vector<double>& x, int64_t b, int64_t j, int64_t h, int64_t c) {
    return x[static_cast<std::size_t>(((b * d.seq_k + j) * d.heads_kv + h) * D + c)];
  };
  // A per-head or shared [rows, (H,) D] table entry.
  auto tab = [&](const std::string& n, int64_t r, int64_t h, int64_t c) {
    const auto& s = p.shapes.at(n);
    const int64_t th = s.size() == 3 ? s[1] : 1;
    return p.values.at(n)[static_cast<std::size_t>((r * th + (th == 1 ? 0 : h)) * D + c)];
  };
  const double scale = 1.0 / std::sqrt((scheme == "deberta" ? 3.0 : 1.0) * static_cast<double>(D));
  std::vector<double> out(q.size(), 0.0);
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.heads_q; ++h)
      for (int64_t i = 0; i < d.seq_q; ++i) {
        const int64_t pq = d.seq_k - d.seq_q + i;
        std::vector<double> s(static_cast<std::size_t>(d.seq_k),
                              -std::numeric_limits<double>::infinity());
        for (int64_t j = 0; j < d.seq_k; ++j) {
          if (causal && j > pq) continue;
          const int64_t rel = j - pq;
          double content = 0, bias = 0;
          for (int64_t c = 0; c < D; ++c) content += Q(b, i, h, c) * K(k, b, j, h / group, c);
          if (scheme == "t5") {
            const int64_t nb = p.shapes.at("relative_attention_bias")[0];
            const int64_t bucket =
                t5_bucket(rel, {.num_buckets = nb, .max_distance = 20, .bidirectional = !causal});
            bias = p.values.at(
                "relative_attention_bias")[static_cast<std::size_t>(bucket * d.heads_q + h)];
          } else if (scheme == "shaw") {
            const int64_t idx = std::clamp<int64_t>(rel, -2, 2) + 2;
            for (int64_t c = 0; c < D; ++c) content += Q(b, i, h, c) * tab("rel_k", idx, h, c);
          } else if (scheme == "xl") {
            const int64_t dm = 8;
            const std::vector<double> R = xl_sinusoid(pq - j, dm);
            const auto& W = p.values.at("r_net");
            for (int64_t c = 0; c < D; ++c) {
              double r = 0;
              for (int64_t m = 0; m < dm; ++m) {
                r += W[static_cast<std::size_t>((h * D + c) * dm + m)] *
                     R[static_cast<std::size_t>(m)];
              }
              const double u = p.values.at("r_w_bias")[static_cast<std::size_t>(h * D + c)];
              const double w = p.values.at("r_r_bias")[static_cast<std::size_t>(h * D + c)];
              content += u * K(k, b, j, h / group, c) + (Q(b, i, h, c) + w) * r;
            }
          } else if (scheme == "deberta") {
            DebertaBuckets db;
            db.max_relative_positions = 4;
            const int64_t c2p = std::clamp<int64_t>(pq - j + 4, 0, 7);
            const int64_t p2c = deberta_p2c_index(pq, j, db);
            for (int64_t c = 0; c < D; ++c) {
              content += Q(b, i, h, c) * tab("pos_key", c2p, h, c) +
                         K(k, b, j, h / group, c) * tab("pos_query", p2c, h, c);
            }
          }
          s[static_cast<std::size_t>(j)] = scale * content + bias;
        }
        const double mx = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (auto& x : s) sum += (x = std::exp(x - mx));
        for (int64_t j = 0; j < d.seq_k; ++j) {
          const double a = s[static_cast<std::size_t>(j)] / sum;
          const int64_t idx = std::clamp<int64_t>(j - pq, -2, 2) + 2;
          for (int64_t c = 0; c < D; ++c) {
            double val = K(v, b, j, h / group, c);
            if (scheme == "shaw") val += tab("rel_v", idx, h, c);
            out[static_cast<std::size_t>(((b * d.seq_q + i) * d.heads_q + h) * D + c)] += a * val;
          }
        }
      }
  return out;
}

struct Inputs {
  std::vector<double> q, k, v;
  View<const double, 4> qv, kv, vv;
};

Inputs make_inputs(const Dims4& d, std::mt19937_64& rng) {
  Inputs in;
  in.q = randn(rng, static_cast<std::size_t>(d.batch * d.seq_q * d.heads_q * d.dim));
  in.k = randn(rng, static_cast<std::size_t>(d.batch * d.seq_k * d.heads_kv * d.dim));
  in.v = randn(rng, in.k.size());
  in.qv = View<const double, 4>::contiguous(in.q.data(), {d.batch, d.seq_q, d.heads_q, d.dim});
  in.kv = View<const double, 4>::contiguous(in.k.data(), {d.batch, d.seq_k, d.heads_kv, d.dim});
  in.vv = View<const double, 4>::contiguous(in.v.data(), {d.batch, d.seq_k, d.heads_kv, d.dim});
  return in;
}

std::vector<double> ref_out(const BuiltScheme& b, const Inputs& in, const Dims4& d, bool causal) {
  std::vector<double> out(in.q.size());
  ref::attention(in.qv, in.kv, in.vv, b.scheme, b.options({.causal = causal}), b.tables64,
                 View<double, 4>::contiguous(out.data(), {d.batch, d.seq_q, d.heads_q, d.dim}));
  return out;
}

const std::vector<std::string> kTableSchemes = {"t5", "shaw", "xl", "deberta"};

TEST(BuildScheme, MatchesHandBuiltAndPointsIntoTheCallersTensors) {
  std::mt19937_64 rng(1);
  const Dims4 d;
  for (const std::string& name : kTableSchemes) {
    for (int variant = 0; variant < (name == "shaw" ? 3 : 1); ++variant) {
      SCOPED_TRACE(name + " variant " + std::to_string(variant));
      const Params p = make_params(name, d, rng, variant);
      std::map<std::string, std::vector<float>> f32;
      ParamMap m;
      for (const auto& [n, v] : p.values) {
        f32[n] = to_f32(v);
        m[n] = ParamTensor{f32[n].data(), nullptr, p.shapes.at(n), {}};
      }
      const BuiltScheme b = build_scheme(settings_for(name), m, nullptr, dims_of(d));
      EXPECT_EQ(b.name, name);
      // Zero copy: the scheme's views are the caller's float32 tensors.
      PositionScheme hand;
      if (name == "t5") {
        const auto t = std::get<T5Bias>(b.scheme);
        EXPECT_EQ(t.table.data, f32["relative_attention_bias"].data());
        hand = T5Bias{View<const float, 2>::contiguous(f32["relative_attention_bias"].data(),
                                                       {16, d.heads_q}),
                      20, std::nullopt};
      } else if (name == "shaw") {
        const auto s = std::get<Shaw>(b.scheme);
        EXPECT_EQ(s.rel_k.data, f32["rel_k"].data());
        EXPECT_EQ(s.rel_v.data, f32["rel_v"].data());
        auto as3 = [&](const std::string& n) {
          const auto& sh = p.shapes.at(n);
          View<const float, 3> v = View<const float, 3>::contiguous(
              f32[n].data(), {sh[0], sh.size() == 3 ? sh[1] : 1, sh.back()});
          if (variant == 2 && sh.size() == 2) {
            v.shape[1] = d.heads_q;
            v.stride[1] = 0;
          }
          return v;
        };
        hand = Shaw{as3("rel_k"), as3("rel_v")};
        // Learned parameters with their given and gradient shapes.
        ASSERT_EQ(b.learned.size(), 2u);
        EXPECT_EQ(b.learned[0].shape, p.shapes.at("rel_k"));
        EXPECT_EQ(b.learned[0].summed_over_heads, variant == 2);
      } else if (name == "xl") {
        const auto x = std::get<TransformerXL>(b.scheme);
        EXPECT_EQ(x.r_net.data, f32["r_net"].data());
        hand = TransformerXL{
            View<const float, 2>::contiguous(f32["r_w_bias"].data(), {d.heads_q, d.dim}),
            View<const float, 2>::contiguous(f32["r_r_bias"].data(), {d.heads_q, d.dim}),
            View<const float, 2>::contiguous(f32["r_net"].data(), {d.heads_q * d.dim, 8}), 1e4};
      } else {
        const auto db = std::get<DeBERTa>(b.scheme);
        EXPECT_EQ(db.pos_key.data, f32["pos_key"].data());
        DebertaBuckets bk;
        bk.max_relative_positions = 4;
        hand = DeBERTa{
            View<const float, 3>::contiguous(f32["pos_key"].data(), {8, d.heads_q, d.dim}),
            View<const float, 3>::contiguous(f32["pos_query"].data(), {8, d.heads_q, d.dim}), bk};
      }
      // Same results as the hand-built scheme, bit for bit (float32 fused path).
      const std::vector<float> q = to_f32(randn(rng, d.batch * d.seq_q * d.heads_q * d.dim));
      const std::vector<float> k = to_f32(randn(rng, d.batch * d.seq_k * d.heads_kv * d.dim));
      const std::array<int64_t, 4> qs{d.batch, d.seq_q, d.heads_q, d.dim};
      const std::array<int64_t, 4> ks{d.batch, d.seq_k, d.heads_kv, d.dim};
      std::vector<float> o1(q.size()), o2(q.size());
      const auto qv = View<const float, 4>::contiguous(q.data(), qs);
      const auto kv = View<const float, 4>::contiguous(k.data(), ks);
      attention(qv, kv, kv, b.scheme, b.options({.causal = true}),
                View<float, 4>::contiguous(o1.data(), qs));
      attention(qv, kv, kv, hand, {.causal = true}, View<float, 4>::contiguous(o2.data(), qs));
      EXPECT_EQ(o1, o2);
    }
  }
}

TEST(BuildScheme, Float64PrecisionViewsTheCallersFloat64Tensors) {
  std::mt19937_64 rng(2);
  const Dims4 d;
  for (const std::string& name : kTableSchemes) {
    SCOPED_TRACE(name);
    const Params p = make_params(name, d, rng);
    const BuiltScheme b =
        build_scheme(settings_for(name), p.map64(), nullptr, dims_of(d), SchemePrecision::kFloat64);
    const ref::SchemeTables& t = b.tables64;
    const void* want = p.values.begin()->second.data();  // the first table by name
    const void* got = name == "t5"     ? t.relative_attention_bias.data
                      : name == "shaw" ? static_cast<const void*>(t.rel_k.data)
                      : name == "xl"   ? static_cast<const void*>(t.r_net.data)
                                       : static_cast<const void*>(t.pos_key.data);
    EXPECT_EQ(got, want);
    EXPECT_TRUE(b.storage32.empty() && b.storage64.empty());  // nothing converted
  }
}

TEST(RefFloat64Tables, Float32ValuedTablesGiveTheFloat32TableResultsBitForBit) {
  std::mt19937_64 rng(3);
  const Dims4 d;
  for (const std::string& name : kTableSchemes) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE(name + (causal ? " causal" : " bidirectional"));
      Params p = make_params(name, d, rng);
      std::map<std::string, std::vector<float>> f32;
      ParamMap m32;
      for (auto& [n, v] : p.values) {
        f32[n] = to_f32(v);
        v = widen(f32[n]);  // float64 tables holding float32 values
        m32[n] = ParamTensor{f32[n].data(), nullptr, p.shapes.at(n), {}};
      }
      const Inputs in = make_inputs(d, rng);
      const BuiltScheme b32 = build_scheme(settings_for(name), m32, nullptr, dims_of(d));
      const BuiltScheme b64 = build_scheme(settings_for(name), p.map64(), nullptr, dims_of(d),
                                           SchemePrecision::kFloat64);
      // The float32-table oracle (tables64 empty) and the float64-table one.
      const std::vector<double> o32 = ref_out(b32, in, d, causal);
      const std::vector<double> o64 = ref_out(b64, in, d, causal);
      EXPECT_EQ(o32, o64);
    }
  }
}

TEST(RefFloat64Tables, ForwardMatchesAnIndependentFloat64Computation) {
  std::mt19937_64 rng(4);
  const Dims4 d;
  for (const std::string& name : kTableSchemes) {
    for (int variant = 0; variant < (name == "shaw" ? 3 : 1); ++variant) {
      for (bool causal : {false, true}) {
        SCOPED_TRACE(name + " variant " + std::to_string(variant) +
                     (causal ? " causal" : " bidirectional"));
        const Params p = make_params(name, d, rng, variant);
        const Inputs in = make_inputs(d, rng);
        const BuiltScheme b = build_scheme(settings_for(name), p.map64(), nullptr, dims_of(d),
                                           SchemePrecision::kFloat64);
        const std::vector<double> got = ref_out(b, in, d, causal);
        const std::vector<double> want = independent(name, d, p, in.q, in.k, in.v, causal);
        const double err = max_diff(got, want) / max_abs(want);
        EXPECT_LE(err, 1e-14);
        // The same tables cut to float32 are ~1e-8 away: the check above sees truncation.
        std::map<std::string, std::vector<float>> f32;
        ParamMap m32;
        for (const auto& [n, v] : p.values) {
          f32[n] = to_f32(v);
          m32[n] = ParamTensor{f32[n].data(), nullptr, p.shapes.at(n), {}};
        }
        const BuiltScheme cut = build_scheme(settings_for(name), m32, nullptr, dims_of(d));
        EXPECT_GE(max_diff(ref_out(cut, in, d, causal), want) / max_abs(want), 1e-10);
      }
    }
  }
}

TEST(RefFloat64Tables, TableGradientsMatchFiniteDifferencesOffTheFloat32Grid) {
  std::mt19937_64 rng(5);
  const Dims4 d;
  for (const std::string& name : kTableSchemes) {
    for (int variant = 0; variant < (name == "shaw" ? 3 : 1); ++variant) {
      for (bool causal : {false, true}) {
        SCOPED_TRACE(name + " variant " + std::to_string(variant) +
                     (causal ? " causal" : " bidirectional"));
        Params p = make_params(name, d, rng, variant);
        const Inputs in = make_inputs(d, rng);
        const std::vector<double> dout = randn(rng, in.q.size());
        const std::array<int64_t, 4> qs{d.batch, d.seq_q, d.heads_q, d.dim};
        auto loss = [&]() {
          const BuiltScheme b = build_scheme(settings_for(name), p.map64(), nullptr, dims_of(d),
                                             SchemePrecision::kFloat64);
          const std::vector<double> o = ref_out(b, in, d, causal);
          double l = 0;
          for (std::size_t i = 0; i < o.size(); ++i) l += o[i] * dout[i];
          return l;
        };
        // Analytic gradients.
        const BuiltScheme b = build_scheme(settings_for(name), p.map64(), nullptr, dims_of(d),
                                           SchemePrecision::kFloat64);
        std::vector<double> out(in.q.size()),
            lse(static_cast<std::size_t>(d.batch * d.heads_q * d.seq_q));
        const AttentionOptions opt = b.options({.causal = causal});
        const auto ov = View<double, 4>::contiguous(out.data(), qs);
        const auto lv = View<double, 3>::contiguous(lse.data(), {d.batch, d.heads_q, d.seq_q});
        ref::attention(in.qv, in.kv, in.vv, b.scheme, opt, b.tables64, ov, lv);
        std::vector<double> dq(in.q.size()), dk(in.k.size()), dv(in.v.size());
        AttentionGradsOf<double> g;
        g.dq = View<double, 4>::contiguous(dq.data(), qs);
        g.dk = View<double, 4>::contiguous(dk.data(), in.kv.shape);
        g.dv = View<double, 4>::contiguous(dv.data(), in.vv.shape);
        std::vector<std::vector<double>> grads;
        grads.reserve(b.learned.size());
        for (const LearnedParam& lp : b.learned) {
          std::size_t n = 1;
          for (int64_t s : lp.grad_shape) n *= static_cast<std::size_t>(s);
          bind_param_grad(g, lp, grads.emplace_back(n).data());
        }
        ref::attention_backward(in.qv, in.kv, in.vv, ov, lv,
                                View<const double, 4>::contiguous(dout.data(), qs), b.scheme, opt,
                                b.tables64, g);
        ASSERT_EQ(b.learned.size(), p.values.size());
        for (std::size_t t = 0; t < b.learned.size(); ++t) {
          const LearnedParam& lp = b.learned[t];
          SCOPED_TRACE("d" + lp.name);
          const std::vector<double> analytic = grad_to_given_shape(lp, grads[t]);
          std::vector<double>& x = p.values.at(lp.name);
          ASSERT_EQ(analytic.size(), x.size());
          // Steps of (1 + 1/3) 2^-9: x +- h is off the float32 grid.
          const double h = (1.0 + 1.0 / 3.0) / 512.0;
          double err = 0, scale = 0;
          for (std::size_t e = 0; e < x.size(); ++e) {
            const double x0 = x[e];
            double f[4];
            const double steps[4] = {-2 * h, -h, h, 2 * h};
            for (int s = 0; s < 4; ++s) {
              x[e] = x0 + steps[s];
              f[s] = loss();
            }
            x[e] = x0;
            const double fd = (f[0] - 8 * f[1] + 8 * f[2] - f[3]) / (12 * h);
            err = std::max(err, std::fabs(fd - analytic[e]));
            scale = std::max(scale, std::fabs(analytic[e]));
          }
          EXPECT_LE(err / std::max(scale, 1e-300), 1e-7) << "max |grad| " << scale;
          EXPECT_GT(scale, 0.0);
        }
      }
    }
  }
}

TEST(RefFloat64Tables, TablesOfAnotherSchemeAreErrors) {
  std::mt19937_64 rng(6);
  const Dims4 d;
  const Inputs in = make_inputs(d, rng);
  std::vector<double> t(16 * 4, 0.0), out(in.q.size());
  ref::SchemeTables tables;
  tables.relative_attention_bias = View<const double, 2>::contiguous(t.data(), {16, 4});
  try {
    ref::attention(in.qv, in.kv, in.vv, Alibi{}, {}, tables,
                   View<double, 4>::contiguous(out.data(), {d.batch, d.seq_q, d.heads_q, d.dim}));
    FAIL() << "no exception";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("relative_attention_bias"), std::string::npos) << e.what();
  }
}

template <class E = Error>
void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no exception (expected one naming '" << needle << "')";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(BuildScheme, BadParametersAndSettingsAreErrorsNamingThem) {
  const Dims4 d;
  const SchemeDims sd = dims_of(d);
  std::vector<float> buf(1024, 0.5f);
  auto tensor = [&](std::vector<int64_t> shape) {
    return ParamTensor{buf.data(), nullptr, shape, {}};
  };
  expect_error([&] { build_scheme({.scheme = "t5"}, {}, nullptr, sd); }, "relative_attention_bias");
  expect_error(
      [&] {
        build_scheme({.scheme = "t5"}, {{"relative_attention_bias", tensor({16})}}, nullptr, sd);
      },
      "relative_attention_bias has shape [16]");
  expect_error(
      [&] {
        build_scheme({.scheme = "rope"}, {{"rel_k", tensor({5, 6})}}, nullptr, sd);
      },
      "rel_k is not a parameter of scheme rope");
  expect_error(
      [&] {
        build_scheme({.scheme = "t5"},
                     {{"relative_attention_bias", tensor({16, 4})}, {"slopes", tensor({4})}},
                     nullptr, sd);
      },
      "slopes is not a parameter of scheme t5");
  expect_error([&] { build_scheme({.scheme = "sinusoidal"}, {}, nullptr, sd); }, "unknown scheme");
  expect_error([&] { build_scheme({}, {}, nullptr, sd); }, "scheme name is required");
  SchemeSettings nb;
  nb.scheme = "t5";
  nb.num_buckets = 32;
  expect_error(
      [&] {
        build_scheme(nb, {{"relative_attention_bias", tensor({16, 4})}}, nullptr, sd);
      },
      "num_buckets 32");
  SchemeSettings deb;
  deb.scheme = "deberta";
  deb.max_relative_positions = 4;
  expect_error(
      [&] {
        build_scheme(deb, {{"pos_key", tensor({10, 4, 6})}, {"pos_query", tensor({8, 4, 6})}},
                     nullptr, sd);
      },
      "pos_key has 10 rows, expected 2K = 8");
  ParamTensor both = tensor({16, 4});
  both.f64 = reinterpret_cast<const double*>(buf.data());
  expect_error(
      [&] {
        build_scheme({.scheme = "t5"}, {{"relative_attention_bias", both}}, nullptr, sd);
      },
      "exactly one");
  // A bad table shape against the heads is the attention call's to report.
  const BuiltScheme b =
      build_scheme({.scheme = "t5"}, {{"relative_attention_bias", tensor({16, 3})}}, nullptr, sd);
  std::vector<float> q(static_cast<std::size_t>(d.batch * d.seq_q * d.heads_q * d.dim)),
      k(static_cast<std::size_t>(d.batch * d.seq_k * d.heads_kv * d.dim));
  const std::array<int64_t, 4> qs{d.batch, d.seq_q, d.heads_q, d.dim};
  const std::array<int64_t, 4> ks{d.batch, d.seq_k, d.heads_kv, d.dim};
  expect_error<ShapeError>(
      [&] {
        attention(View<const float, 4>::contiguous(q.data(), qs),
                  View<const float, 4>::contiguous(k.data(), ks),
                  View<const float, 4>::contiguous(k.data(), ks), b.scheme, {},
                  View<float, 4>::contiguous(q.data(), qs));
      },
      "relative_attention_bias");
}

ModelConfig config(const std::string& name) {
  return read_model_config(std::string(POSENC_TEST_CONFIGS_DIR) + "/" + name);
}

TEST(BuildScheme, ModelConfigs) {
  // T5: the model's max_distance and scale 1; buckets must match the table; conflicts.
  const ModelConfig t5 = config("t5-base.json");
  const SchemeDims sd{
      .heads_q = t5.heads_q, .heads_kv = t5.heads_kv, .head_dim = t5.head_dim, .seq_len = 8};
  std::vector<float> table(static_cast<std::size_t>(t5.t5.num_buckets * t5.heads_q), 0.25f);
  const ParamMap pm{
      {"relative_attention_bias", {table.data(), nullptr, {t5.t5.num_buckets, t5.heads_q}, {}}}};
  const BuiltScheme b = build_scheme({}, pm, &t5, sd);
  EXPECT_EQ(b.name, "t5");
  EXPECT_EQ(b.scale, 1.0);
  EXPECT_EQ(b.options({}).scale, 1.0);
  EXPECT_EQ(b.options({.scale = 0.5}).scale, 0.5);
  EXPECT_EQ(std::get<T5Bias>(b.scheme).max_distance, t5.t5.max_distance);
  SchemeSettings md;
  md.max_distance = 64;
  expect_error([&] { build_scheme(md, pm, &t5, sd); }, "max_distance conflicts with config");
  const ParamMap wrong{{"relative_attention_bias", {table.data(), nullptr, {16, t5.heads_q}, {}}}};
  expect_error([&] { build_scheme({}, wrong, &t5, sd); }, "relative_attention_num_buckets");
  SchemeDims bad_heads = sd;
  bad_heads.heads_q = 3;
  expect_error([&] { build_scheme({}, pm, &t5, bad_heads); }, "heads_q 3 does not match");
  expect_error([&] { build_scheme({.scheme = "alibi"}, pm, &t5, sd); }, "conflicts with config");

  // RoPE: the model's frequencies at seq_len; base / style conflict.
  const ModelConfig llama = config("llama-3.1-8b.json");
  const SchemeDims ld{.heads_q = llama.heads_q,
                      .heads_kv = llama.heads_kv,
                      .head_dim = llama.head_dim,
                      .seq_len = 200000};
  const BuiltScheme r = build_scheme({}, {}, &llama, ld);
  const Rope& rope = std::get<Rope>(r.scheme);
  EXPECT_EQ(rope.freqs.inv_freq, model_rope_frequencies(llama, 200000).inv_freq);
  EXPECT_EQ(rope.style, llama.rope.style);
  SchemeSettings base;
  base.base = 1e4;
  expect_error([&] { build_scheme(base, {}, &llama, ld); }, "base conflicts");
  // Learned positions are not an attention scheme.
  const ModelConfig gpt2 = config("gpt2.json");
  expect_error([&] { build_scheme({}, {}, &gpt2, {}); }, "gpt2");
  // ALiBi: the model's slopes; slopes given conflict.
  const ModelConfig bloom = config("bloom-560m.json");
  const SchemeDims bd{.heads_q = bloom.heads_q,
                      .heads_kv = bloom.heads_kv,
                      .head_dim = bloom.head_dim,
                      .seq_len = 4};
  const BuiltScheme a = build_scheme({}, {}, &bloom, bd);
  EXPECT_EQ(std::get<Alibi>(a.scheme).slopes, alibi_slopes(bloom.alibi));
  EXPECT_TRUE(a.learned.empty());
}

TEST(BuildScheme, AlibiSlopesAndRopeSettings) {
  const Dims4 d;
  std::vector<double> slopes = {0.5, 0.25, 0.125, 0.0625};
  const BuiltScheme a = build_scheme(
      {.scheme = "alibi"}, {{"slopes", {nullptr, slopes.data(), {4}, {}}}}, nullptr, dims_of(d));
  EXPECT_EQ(std::get<Alibi>(a.scheme).slopes, slopes);
  ASSERT_EQ(a.learned.size(), 1u);
  EXPECT_EQ(a.learned[0].grad_shape, std::vector<int64_t>{4});
  // Strided slopes (every other element).
  std::vector<double> wide = {0.5, 9, 0.25, 9, 0.125, 9, 0.0625, 9};
  const BuiltScheme s = build_scheme(
      {.scheme = "alibi"}, {{"slopes", {nullptr, wide.data(), {4}, {2}}}}, nullptr, dims_of(d));
  EXPECT_EQ(std::get<Alibi>(s.scheme).slopes, slopes);
  SchemeSettings rs;
  rs.scheme = "rope";
  rs.rotary_dim = 4;
  rs.base = 500.0;
  rs.style = RopeStyle::kInterleaved;
  const BuiltScheme r = build_scheme(rs, {}, nullptr, dims_of(d));
  const Rope& rope = std::get<Rope>(r.scheme);
  EXPECT_EQ(rope.freqs.inv_freq,
            rope_frequencies({.head_dim = 6, .rotary_dim = 4, .base = 500.0}).inv_freq);
  EXPECT_EQ(rope.style, RopeStyle::kInterleaved);
  EXPECT_EQ(attention_seq_len(1, 3, 7, nullptr, nullptr), 7);
  const Positions far = Positions::shared({0, 100, 5});
  EXPECT_EQ(attention_seq_len(1, 3, 7, &far, nullptr), 101);
}

}  // namespace

// The scheme registry: one table in PositionScheme's order, the source of every front end's
// list (names, parameters, settings).
TEST(SchemeRegistry, OrderNamesParamsAndSettings) {
  const std::vector<SchemeInfo>& all = attention_schemes();
  ASSERT_EQ(all.size(), std::variant_size_v<PositionScheme>);
  const PositionScheme variants[] = {NoPositions{}, Rope{},          Alibi{},  T5Bias{},
                                     Shaw{},        TransformerXL{}, DeBERTa{}};
  for (std::size_t i = 0; i < all.size(); ++i) {
    EXPECT_EQ(scheme_name(variants[i]), all[i].name);
    EXPECT_EQ(&scheme_info(all[i].name), &all[i]);
    EXPECT_EQ(&scheme_info(i), &all[i]);
    EXPECT_FALSE(all[i].title.empty());
    EXPECT_FALSE(all[i].summary.empty());
    // Its documentation page exists in the repository.
    EXPECT_TRUE(
        std::filesystem::exists(std::string(POSENC_TEST_CONFIGS_DIR) + "/../../" + all[i].doc))
        << all[i].doc;
  }
  EXPECT_EQ(scheme_names(),
            (std::vector<std::string>{"none", "rope", "alibi", "t5", "shaw", "xl", "deberta"}));
  EXPECT_EQ(scheme_names_text(), "none, rope, alibi, t5, shaw, xl or deberta");
  // The parameters build_scheme reads, required ones first, then the optional, then sinks.
  EXPECT_EQ(scheme_param_names("t5"),
            (std::vector<std::string>{"relative_attention_bias", "sinks"}));
  EXPECT_EQ(scheme_param_names("alibi"), (std::vector<std::string>{"slopes", "sinks"}));
  EXPECT_EQ(scheme_param_names("shaw"), (std::vector<std::string>{"rel_k", "rel_v", "sinks"}));
  EXPECT_EQ(scheme_required_params("xl"),
            (std::vector<std::string>{"r_w_bias", "r_r_bias", "r_net"}));
  EXPECT_EQ(scheme_required_params("deberta"), (std::vector<std::string>{"pos_key", "pos_query"}));
  EXPECT_TRUE(scheme_required_params("rope").empty());
  // Settings shared by schemes are listed once with every scheme they serve.
  bool base_found = false;
  for (const SchemeSettingUse& u : scheme_settings()) {
    if (u.setting.keyword == "base") {
      base_found = true;
      EXPECT_EQ(u.schemes, (std::vector<std::string>{"rope", "xl"}));
    }
    EXPECT_FALSE(u.schemes.empty());
  }
  EXPECT_TRUE(base_found);
  // Unknown names: ValueError naming the known ones.
  try {
    (void)scheme_info("sinusoidal");
    ADD_FAILURE() << "no error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("'sinusoidal'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("xl or deberta"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)scheme_param_names("ALiBi"), ValueError);
}

// Every enum's names, both ways, from posenc/names.h.
TEST(EnumNames, RoundTripAndErrorsNameTheChoices) {
  for (RopeStyle s : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    EXPECT_EQ(parse_rope_style(style_name(s)), s);
  }
  for (RopeAngles a : {RopeAngles::kAccurate, RopeAngles::kFloat32}) {
    EXPECT_EQ(parse_rope_angles(angles_name(a)), a);
  }
  for (SinLayout l : {SinLayout::kInterleaved, SinLayout::kConcat}) {
    EXPECT_EQ(parse_sin_layout(layout_name(l)), l);
  }
  for (SinDenominator d : {SinDenominator::kDim, SinDenominator::kHalfMinusOne}) {
    EXPECT_EQ(parse_sin_denominator(denominator_name(d)), d);
  }
  for (SinOddDim o : {SinOddDim::kError, SinOddDim::kZeroPad}) {
    EXPECT_EQ(parse_sin_odd_dim(odd_dim_name(o)), o);
  }
  for (DebertaP2c p : {DebertaP2c::kModel, DebertaP2c::kPaper}) {
    EXPECT_EQ(parse_deberta_p2c(p2c_name(p)), p);
  }
  // Python's keyword spelling is the same name.
  EXPECT_EQ(parse_sin_denominator("half_minus_one"), SinDenominator::kHalfMinusOne);
  EXPECT_EQ(parse_sin_odd_dim("zero_pad"), SinOddDim::kZeroPad);
  EXPECT_STREQ(scaling_name(RopeScalingType::kYarn), "yarn");
  try {
    (void)parse_rope_style("neox", "--style");
    ADD_FAILURE() << "no error";
  } catch (const ValueError& e) {
    EXPECT_STREQ(e.what(), "--style: 'neox' (half or interleaved)");
  }
  EXPECT_THROW((void)parse_sin_layout("Concat"), ValueError);
  EXPECT_THROW((void)parse_deberta_p2c(""), ValueError);
}
