// src/check.cc - the seeds' claims as measurements (`posenc check`). Everything here runs on the
// float64 reference so a failure means the claim (or the library) is wrong, not rounding.
#include "posenc/check.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <random>
#include <string>

#include "posenc/attention.h"
#include "posenc/error.h"
#include "posenc/learned.h"
#include "posenc/rope.h"
#include "posenc/schemes.h"
#include "posenc/sinusoidal.h"
#include "posenc/size.h"

namespace posenc {
namespace {

std::vector<double> randn(std::mt19937_64& rng, int64_t n) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = nd(rng);
  return v;
}

std::vector<float> randn_f(std::mt19937_64& rng, int64_t n, double sd = 1.0) {
  std::normal_distribution<double> nd(0.0, sd);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = static_cast<float>(nd(rng));
  return v;
}

using V4 = View<const double, 4>;

std::vector<double> run_ref(const std::vector<double>& q, const std::vector<double>& k,
                            const std::vector<double>& v, std::array<int64_t, 4> qs,
                            std::array<int64_t, 4> ks, bool causal) {
  std::vector<double> out(q.size());
  ref::attention(V4::contiguous(q.data(), qs), V4::contiguous(k.data(), ks),
                 V4::contiguous(v.data(), ks), NoPositions{}, AttentionOptions{.causal = causal},
                 View<double, 4>::contiguous(out.data(), qs));
  return out;
}

// Permutes token rows of a [1, L, H, D] tensor: out[i] = x[perm[i]].
std::vector<double> permute_rows(const std::vector<double>& x, const std::vector<int64_t>& perm,
                                 int64_t row) {
  std::vector<double> out(x.size());
  for (std::size_t i = 0; i < perm.size(); ++i) {
    std::copy_n(x.begin() + perm[i] * row, row, out.begin() + static_cast<int64_t>(i) * row);
  }
  return out;
}

std::vector<int64_t> random_perm(std::mt19937_64& rng, int64_t n) {
  std::vector<int64_t> p(static_cast<std::size_t>(n));
  std::iota(p.begin(), p.end(), 0);
  std::shuffle(p.begin(), p.end(), rng);
  // Make sure it is not the identity.
  if (n > 1 && std::is_sorted(p.begin(), p.end())) std::swap(p[0], p[1]);
  return p;
}

constexpr int64_t kL = 12, kH = 2, kD = 8;

}  // namespace

namespace {

// Max |attention(permuted inputs) - expected| when the query rows (keys = false) or the key and
// value rows (keys = true) are permuted: without positions, permuting queries permutes the output
// rows the same way and permuting keys changes nothing.
double permutation_error(bool keys, bool causal, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::array<int64_t, 4> s{1, kL, kH, kD};
  const auto q = randn(rng, kL * kH * kD), k = randn(rng, kL * kH * kD),
             v = randn(rng, kL * kH * kD);
  const auto perm = random_perm(rng, kL);
  const auto out = run_ref(q, k, v, s, s, causal);
  const auto out_p = keys ? run_ref(q, permute_rows(k, perm, kH * kD),
                                    permute_rows(v, perm, kH * kD), s, s, causal)
                          : run_ref(permute_rows(q, perm, kH * kD), k, v, s, s, causal);
  const auto expect = keys ? out : permute_rows(out, perm, kH * kD);
  double e = 0;
  for (std::size_t i = 0; i < out.size(); ++i) e = std::max(e, std::abs(out_p[i] - expect[i]));
  return e;
}

}  // namespace

double query_permutation_error(bool causal, uint64_t seed) {
  return permutation_error(false, causal, seed);
}

double key_permutation_error(bool causal, uint64_t seed) {
  return permutation_error(true, causal, seed);
}

double sinusoidal_dot(int64_t dim, int64_t a, int64_t b) {
  const SinusoidalConfig cfg{.dim = dim};
  double s = 0;
  for (int64_t k = 0; k < dim; ++k)
    s += ref::sinusoidal_value(cfg, a, k) * ref::sinusoidal_value(cfg, b, k);
  return s;
}

double rope_norm_error(uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t l = 16, h = 2, d = 64;
  const auto x = randn(rng, l * h * d);
  std::vector<int64_t> ids(static_cast<std::size_t>(l));
  std::uniform_int_distribution<int64_t> ud(0, int64_t{1} << 20);
  for (auto& p : ids) p = ud(rng);
  const auto pos = Positions::shared(ids);
  std::vector<double> y(x.size());
  double e = 0;
  for (RopeStyle style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    ref::apply_rope(rope_frequencies(RopeConfig{.head_dim = d}), style,
                    V4::contiguous(x.data(), {1, l, h, d}),
                    View<double, 4>::contiguous(y.data(), {1, l, h, d}), &pos);
    for (int64_t r = 0; r < l * h; ++r) {
      double nx = 0, ny = 0;
      for (int64_t c = 0; c < d; ++c) {
        nx += x[static_cast<std::size_t>(r * d + c)] * x[static_cast<std::size_t>(r * d + c)];
        ny += y[static_cast<std::size_t>(r * d + c)] * y[static_cast<std::size_t>(r * d + c)];
      }
      e = std::max(e, std::abs(std::sqrt(ny) - std::sqrt(nx)) / std::sqrt(nx));
    }
  }
  return e;
}

namespace {

// Scores s_ij for constant content (q_i = q0, k_j = k0): whatever varies over (i, j) with the
// same offset j - i comes from positions alone. Returns the max spread within an offset class.
double offset_spread(const PositionScheme& scheme, const std::vector<double>& q0,
                     const std::vector<double>& k0, int64_t heads, int64_t dim, int64_t len,
                     int64_t shift) {
  std::vector<double> q(static_cast<std::size_t>(len * heads * dim)), k(q.size());
  for (int64_t i = 0; i < len; ++i) {
    std::copy(q0.begin(), q0.end(), q.begin() + i * heads * dim);
    std::copy(k0.begin(), k0.end(), k.begin() + i * heads * dim);
  }
  const auto qv = V4::contiguous(q.data(), {1, len, heads, dim});
  const auto kv = V4::contiguous(k.data(), {1, len, heads, dim});
  double spread = 0;
  for (int64_t h = 0; h < heads; ++h) {
    // Two placements of the same tokens, `shift` apart: scores must agree per offset.
    const auto p0 = Positions::offset(0), p1 = Positions::offset(shift);
    const auto s0 = ref::attention_scores(qv, kv, scheme, {}, 0, h, &p0, &p0);
    const auto s1 = ref::attention_scores(qv, kv, scheme, {}, 0, h, &p1, &p1);
    std::map<int64_t, std::pair<double, double>> range;
    for (int64_t i = 0; i < len; ++i) {
      for (int64_t j = 0; j < len; ++j) {
        for (double s : {s0[static_cast<std::size_t>(i * len + j)],
                         s1[static_cast<std::size_t>(i * len + j)]}) {
          auto [it, fresh] = range.try_emplace(j - i, s, s);
          if (!fresh) {
            it->second.first = std::min(it->second.first, s);
            it->second.second = std::max(it->second.second, s);
          }
        }
      }
    }
    for (const auto& [off, mm] : range) spread = std::max(spread, mm.second - mm.first);
  }
  return spread;
}

}  // namespace

double rope_offset_spread(uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t h = 2, d = 16;
  const auto q0 = randn(rng, h * d), k0 = randn(rng, h * d);
  return offset_spread(Rope{rope_frequencies(RopeConfig{.head_dim = d})}, q0, k0, h, d, 24,
                       1000003);
}

double relative_score_spread(const std::string& scheme, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t h = 2, d = 8, len = 24, shift = 777;
  const auto q0 = randn(rng, h * d), k0 = randn(rng, h * d);
  if (scheme == "alibi") return offset_spread(Alibi{}, q0, k0, h, d, len, shift);
  if (scheme == "rope") return rope_offset_spread(seed);
  if (scheme == "t5") {
    const auto t = randn_f(rng, 32 * h);
    return offset_spread(T5Bias{View<const float, 2>::contiguous(t.data(), {32, h})}, q0, k0, h, d,
                         len, shift);
  }
  if (scheme == "shaw") {
    const int64_t kk = 4;
    const auto rk = randn_f(rng, (2 * kk + 1) * d);
    return offset_spread(
        Shaw{shaw_table(View<const float, 2>::contiguous(rk.data(), {2 * kk + 1, d})), {}}, q0, k0,
        h, d, len, shift);
  }
  if (scheme == "xl") {
    const int64_t dm = 16;
    const auto u = randn_f(rng, h * d), v = randn_f(rng, h * d), w = randn_f(rng, h * d * dm);
    return offset_spread(TransformerXL{View<const float, 2>::contiguous(u.data(), {h, d}),
                                       View<const float, 2>::contiguous(v.data(), {h, d}),
                                       View<const float, 2>::contiguous(w.data(), {h * d, dm})},
                         q0, k0, h, d, len, shift);
  }
  if (scheme == "deberta") {
    const DebertaBuckets b{.max_relative_positions = 64, .position_buckets = 16};
    const int64_t span = b.span();
    const auto pk = randn_f(rng, 2 * span * h * d), pq = randn_f(rng, 2 * span * h * d);
    return offset_spread(DeBERTa{View<const float, 3>::contiguous(pk.data(), {2 * span, h, d}),
                                 View<const float, 3>::contiguous(pq.data(), {2 * span, h, d}), b},
                         q0, k0, h, d, len, shift);
  }
  throw ValueError("relative_score_spread: unknown scheme '" + scheme + "'");
}

std::vector<CheckResult> run_checks(const CheckOptions& options) {
  const uint64_t seed = options.seed;
  std::vector<CheckResult> r;
  auto add = [&](std::string prop, std::string scheme, double m, double t, const char* op) {
    char b[32];
    std::snprintf(b, sizeof b, "%s %.0e", op, t);
    const bool pass = op[0] == '<' ? m <= t : m >= t;
    r.push_back({std::move(prop), std::move(scheme), m, t, b, pass});
  };
  auto le = [&](std::string prop, std::string scheme, double m, double t) {
    add(std::move(prop), std::move(scheme), m, t, "<=");
  };
  auto ge = [&](std::string prop, std::string scheme, double m, double t) {
    add(std::move(prop), std::move(scheme), m, t, ">=");
  };
  le("no positions: permuting queries permutes outputs", "none",
     query_permutation_error(false, seed), 1e-12);
  le("no positions: permuting keys with values leaves outputs unchanged", "none",
     key_permutation_error(false, seed), 1e-12);
  ge("causal mask breaks query-permutation equivariance", "none",
     query_permutation_error(true, seed), 1e-3);
  ge("causal mask breaks key-permutation invariance", "none", key_permutation_error(true, seed),
     1e-3);
  auto eq4 = [&](std::string prop, double m, double want) {
    char b[48];
    std::snprintf(b, sizeof b, "== %.4f (4 dp)", want);
    r.push_back({std::move(prop), "sinusoidal", m, want, b,
                 std::abs(std::round(m * 1e4) / 1e4 - want) < 1e-9});
  };
  eq4("d=16: PE(105).PE(106)", sinusoidal_dot(16, 105, 106), 7.4852);
  eq4("d=16: PE(5).PE(6)", sinusoidal_dot(16, 5, 6), 7.4852);
  eq4("d=16: PE(5).PE(10)", sinusoidal_dot(16, 5, 10), 6.1370);
  {
    double spread = 0;
    for (int64_t off : {1, 5, 37}) {
      const double ref = sinusoidal_dot(64, 0, off);
      for (int64_t p : {1, 100, 4096, 1000000}) {
        spread = std::max(spread, std::abs(sinusoidal_dot(64, p, p + off) - ref));
      }
    }
    le("PE(p).PE(p+k) depends only on k (d=64, p up to 1e6)", "sinusoidal", spread, 1e-9);
  }
  le("rope preserves norms (positions up to 2^20)", "rope", rope_norm_error(seed), 1e-12);
  le("<rope(q,m), rope(k,n)> depends only on n-m", "rope", rope_offset_spread(seed), 1e-9);
  for (const SchemeInfo& s : attention_schemes()) {
    if (!s.relative) continue;
    le("scores depend only on the offset (constant content, shifted positions)", s.name.c_str(),
       relative_score_spread(s.name, seed), 1e-9);
  }
  {
    std::vector<float> table(4 * 2, 0.5f), x(2, 0.0f);
    bool refused = false;
    try {
      const auto p = Positions::shared({4});
      add_learned(View<const float, 2>::contiguous(table.data(), {4, 2}),
                  View<float, 3>::contiguous(x.data(), {1, 1, 2}), &p);
    } catch (const ValueError&) {
      refused = true;
    }
    r.push_back({"position beyond the table (4 of 4) is refused, not clamped", "learned",
                 refused ? 1.0 : 0.0, 1.0, "error raised", refused});
  }
  return r;
}

std::vector<RopePrecisionRow> rope_precision(const std::vector<int64_t>& positions,
                                             int64_t head_dim, double base, uint64_t seed) {
  constexpr int64_t kTokens = 8, kHeads = 4;
  constexpr int64_t kMaxPosition = (int64_t{1} << 53) - kTokens;
  RopeConfig cfg;
  cfg.head_dim = head_dim;
  cfg.base = base;
  validate(cfg);
  checked_elements("rope_precision: inputs", {{"head_dim", head_dim}}, 8 * kTokens * kHeads * 4);
  const RopeFrequencies accurate = rope_frequencies(cfg, 0, RopeAngles::kAccurate);
  const RopeFrequencies f32 = rope_frequencies(cfg, 0, RopeAngles::kFloat32);
  RopeFrequencies f32_ref = f32;  // the same float32-rounded table, accurate angles
  f32_ref.angles = RopeAngles::kAccurate;

  std::mt19937_64 rng(seed);
  const std::array<int64_t, 4> shape{1, kTokens, kHeads, head_dim};
  const std::vector<float> x = randn_f(rng, kTokens * kHeads * head_dim);
  const std::vector<double> x64(x.begin(), x.end());
  const auto x_view = View<const float, 4>::contiguous(x.data(), shape);
  const auto x64_view = View<const double, 4>::contiguous(x64.data(), shape);
  std::vector<float> out(x.size());
  std::vector<double> ref_out(x.size());
  auto max_error = [&](const RopeFrequencies& f, const RopeFrequencies& ref_f,
                       const Positions& pos) {
    apply_rope(f, RopeStyle::kHalf, x_view, View<float, 4>::contiguous(out.data(), shape), &pos);
    ref::apply_rope(ref_f, RopeStyle::kHalf, x64_view,
                    View<double, 4>::contiguous(ref_out.data(), shape), &pos);
    double e = 0;
    for (std::size_t i = 0; i < out.size(); ++i) {
      e = std::max(e, std::abs(static_cast<double>(out[i]) - ref_out[i]));
    }
    return e;
  };

  const double two_pi = 2.0 * std::acos(-1.0);
  std::vector<RopePrecisionRow> rows;
  rows.reserve(positions.size());
  for (const int64_t p : positions) {
    if (p < 0 || p > kMaxPosition) {
      throw ValueError("rope_precision: position " + std::to_string(p) + " outside [0, " +
                       std::to_string(kMaxPosition) + "]");
    }
    const Positions pos = Positions::offset(p);
    RopePrecisionRow row;
    row.position = p;
    row.accurate_error = max_error(accurate, accurate, pos);
    row.float32_error = max_error(f32, f32_ref, pos);
    for (int64_t t = 0; t < kTokens; ++t) {
      const auto q = static_cast<double>(p + t);  // exact below 2^53
      for (const double inv : f32.inv_freq) {
        const float a32 = static_cast<float>(q) * static_cast<float>(inv);
        // q * inv exactly as hi + lo (fma), so the comparison adds no rounding of its own.
        const double hi = q * inv;
        const double lo = std::fma(q, inv, -hi);
        const double d = (static_cast<double>(a32) - hi) - lo;
        row.float32_angle_error =
            std::max(row.float32_angle_error, std::abs(std::remainder(d, two_pi)));
      }
    }
    rows.push_back(row);
  }
  return rows;
}

}  // namespace posenc
