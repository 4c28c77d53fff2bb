// tests/attention_textbook.h - a second, independent float64 attention written straight from
// docs/ (every scheme's page) with full [seq_q, seq_k] matrices per (batch, head) and contiguous
// inputs. It shares no code with src/attention/reference.cc (RoPE is a complex rotation here), so
// agreement between the two is evidence that both read the docs/ the same way.
#pragma once

#include <cmath>
#include <complex>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "posenc/posenc.h"

namespace textbook {

struct Problem {
  int64_t batch, seq_q, seq_k, heads_q, heads_kv, dim;
  std::vector<double> q, k, v;  // contiguous [B, L, H, D]
  posenc::Positions qpos, kpos;
  bool causal = false;
  std::optional<double> scale;
  std::optional<int64_t> window;
};

inline double at4(const std::vector<double>& x, int64_t l, int64_t h, int64_t d, int64_t b,
                  int64_t i, int64_t hh, int64_t c) {
  return x[static_cast<std::size_t>(((b * l + i) * h + hh) * d + c)];
}

// RoPE of one head vector at position p as complex multiplication, in double.
inline std::vector<double> rope_vec(const std::vector<double>& x, int64_t p,
                                    const posenc::Rope& r) {
  std::vector<double> y = x;
  const int64_t pairs = static_cast<int64_t>(r.freqs.inv_freq.size());
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t a = r.style == posenc::RopeStyle::kHalf ? i : 2 * i;
    const int64_t b = r.style == posenc::RopeStyle::kHalf ? i + pairs : 2 * i + 1;
    const std::complex<double> z(x[a], x[b]);
    const std::complex<double> w =
        std::polar(r.freqs.attention_factor,
                   static_cast<double>(p) * r.freqs.inv_freq[static_cast<std::size_t>(i)]);
    const auto zw = z * w;
    y[a] = zw.real();
    y[b] = zw.imag();
  }
  return y;
}

inline int64_t t5_bucket_spec(int64_t rel, int64_t nb, int64_t md, bool bidirectional) {
  int64_t b = 0, n;
  if (bidirectional) {
    nb /= 2;
    b = rel > 0 ? nb : 0;
    n = std::abs(rel);
  } else {
    n = std::max<int64_t>(-rel, 0);
  }
  const int64_t e = nb / 2;
  if (n < e) return b + n;
  const float f = std::log(static_cast<float>(n) / static_cast<float>(e)) /
                  static_cast<float>(std::log(static_cast<double>(md) / static_cast<double>(e))) *
                  static_cast<float>(nb - e);
  return b + std::min(nb - 1, e + static_cast<int64_t>(f));
}

// Returns out [B, Lq, Hq, D].
inline std::vector<double> attention(const Problem& p, const posenc::PositionScheme& scheme) {
  using namespace posenc;
  const int64_t group = p.heads_q / p.heads_kv;
  const bool deb = std::holds_alternative<DeBERTa>(scheme);
  const double scale =
      p.scale.value_or(1.0 / std::sqrt((deb ? 3.0 : 1.0) * static_cast<double>(p.dim)));
  std::vector<double> out(static_cast<std::size_t>(p.batch * p.seq_q * p.heads_q * p.dim));
  std::vector<double> alibi;
  if (auto* a = std::get_if<Alibi>(&scheme)) {
    alibi =
        a->slopes.empty() ? alibi_slopes({.heads = p.heads_q, .max_bias = a->max_bias}) : a->slopes;
  }
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.heads_q; ++h) {
      const int64_t hk = h / group;
      std::vector<std::vector<double>> s(static_cast<std::size_t>(p.seq_q),
                                         std::vector<double>(static_cast<std::size_t>(p.seq_k)));
      for (int64_t i = 0; i < p.seq_q; ++i) {
        const int64_t pq = p.qpos.at(b, i);
        std::vector<double> qi(static_cast<std::size_t>(p.dim));
        for (int64_t c = 0; c < p.dim; ++c) qi[c] = at4(p.q, p.seq_q, p.heads_q, p.dim, b, i, h, c);
        for (int64_t j = 0; j < p.seq_k; ++j) {
          const int64_t pk = p.kpos.at(b, j);
          std::vector<double> kj(static_cast<std::size_t>(p.dim));
          for (int64_t c = 0; c < p.dim; ++c) {
            kj[c] = at4(p.k, p.seq_k, p.heads_kv, p.dim, b, j, hk, c);
          }
          std::vector<double> qq = qi, kk = kj;
          if (auto* r = std::get_if<Rope>(&scheme)) {
            qq = rope_vec(qi, pq, *r);
            kk = rope_vec(kj, pk, *r);
          }
          double content = 0, bias = 0;
          for (int64_t c = 0; c < p.dim; ++c) content += qq[c] * kk[c];
          const int64_t rel = pk - pq;
          if (!alibi.empty()) bias = -alibi[static_cast<std::size_t>(h)] * std::abs(rel);
          if (auto* t = std::get_if<T5Bias>(&scheme)) {
            const bool bi = t->bidirectional.value_or(!p.causal);
            bias = t->table(t5_bucket_spec(rel, t->table.shape[0], t->max_distance, bi), h);
          }
          if (auto* sh = std::get_if<Shaw>(&scheme)) {
            const int64_t kmax = (sh->rel_k.shape[0] - 1) / 2;
            const int64_t idx = std::clamp(rel, -kmax, kmax) + kmax;
            const int64_t th = sh->rel_k.shape[1] == 1 ? 0 : h;
            for (int64_t c = 0; c < p.dim; ++c) content += qi[c] * sh->rel_k(idx, th, c);
          }
          if (auto* x = std::get_if<TransformerXL>(&scheme)) {
            const int64_t delta = pq - pk, dm = x->r_net.shape[1];
            // R(delta) concat sinusoid, projected by r_net rows of head h.
            std::vector<double> big_r(static_cast<std::size_t>(dm));
            for (int64_t m = 0; m < dm / 2; ++m) {
              const double w = std::pow(x->base, -2.0 * static_cast<double>(m) / dm);
              big_r[m] = std::sin(delta * w);
              big_r[m + dm / 2] = std::cos(delta * w);
            }
            for (int64_t c = 0; c < p.dim; ++c) {
              double r = 0;
              for (int64_t m = 0; m < dm; ++m) r += x->r_net(h * p.dim + c, m) * big_r[m];
              content += x->r_w_bias(h, c) * kj[c] + (qi[c] + x->r_r_bias(h, c)) * r;
            }
          }
          if (auto* d = std::get_if<DeBERTa>(&scheme)) {
            const int64_t kspan = d->buckets.span();
            const int64_t rho = deberta_bucket(pq - pk, d->buckets);
            const int64_t c2p = std::clamp<int64_t>(rho + kspan, 0, 2 * kspan - 1);
            const int64_t p2c = std::clamp<int64_t>(
                (d->buckets.p2c == DebertaP2c::kModel ? rho : -rho) + kspan, 0, 2 * kspan - 1);
            for (int64_t c = 0; c < p.dim; ++c) {
              content += qi[c] * d->pos_key(c2p, h, c) + kj[c] * d->pos_query(p2c, h, c);
            }
          }
          double sc = scale * content + bias;
          const bool vis = (!p.causal || rel <= 0) && (!p.window || std::abs(rel) < *p.window);
          s[i][j] = vis ? sc : -std::numeric_limits<double>::infinity();
        }
      }
      for (int64_t i = 0; i < p.seq_q; ++i) {
        double mx = -std::numeric_limits<double>::infinity();
        for (double x : s[i]) mx = std::max(mx, x);
        std::vector<double> w(static_cast<std::size_t>(p.seq_k), 0.0);
        double sum = 0;
        if (std::isfinite(mx)) {
          for (int64_t j = 0; j < p.seq_k; ++j) sum += (w[j] = std::exp(s[i][j] - mx));
        }
        for (int64_t c = 0; c < p.dim; ++c) {
          double acc = 0;
          for (int64_t j = 0; j < p.seq_k; ++j) {
            if (w[j] == 0) continue;
            double val = at4(p.v, p.seq_k, p.heads_kv, p.dim, b, j, hk, c);
            if (auto* sh = std::get_if<Shaw>(&scheme); sh && sh->rel_v.data) {
              const int64_t kmax = (sh->rel_v.shape[0] - 1) / 2;
              const int64_t rel = p.kpos.at(b, j) - p.qpos.at(b, i);
              const int64_t th = sh->rel_v.shape[1] == 1 ? 0 : h;
              val += sh->rel_v(std::clamp(rel, -kmax, kmax) + kmax, th, c);
            }
            acc += w[j] / sum * val;
          }
          out[static_cast<std::size_t>(((b * p.seq_q + i) * p.heads_q + h) * p.dim + c)] = acc;
        }
      }
    }
  }
  return out;
}

}  // namespace textbook
