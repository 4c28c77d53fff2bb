// src/schemes/xl_term.h - Transformer-XL's attention term (docs/xl.md): scores
// (q + u) · k + (q + v) · r(delta), r(delta) = W_r R(delta) with R the sinusoid of the distance
// delta = pos_q - pos_k, u = r_w_bias, v = r_r_bias, W_r = r_net. The interface: schemes/term.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "kernels/parallel.h"
#include "schemes/term.h"

namespace posenc::attn {

template <class T>
struct XlTerm : NoTerm<T> {
  static constexpr bool kDistanceTables = true;
  View<const T, 2> u, v, rnet;  // u, v [heads_q, head_dim]; W_r [heads_q * head_dim, d_model]
  double base = 1e4;
  // The simple paths: r(delta) [heads_q * head_dim] for every distance that occurs.
  std::unordered_map<int64_t, std::vector<T>> r;
  // The reference backward: dr(delta) per distance, projected onto W_r in finish_grads.
  mutable std::map<int64_t, std::vector<T>> dr;

  void prepare(const TransformerXL& x, TermInputs<T>& in) {
    const Dims& d = in.d;
    u = in.table(x.r_w_bias, &ref::SchemeTables::r_w_bias);
    v = in.table(x.r_r_bias, &ref::SchemeTables::r_r_bias);
    rnet = in.table(x.r_net, &ref::SchemeTables::r_net);
    require_table_shape(u, {d.heads_q, d.head_dim}, "attention: xl: r_w_bias [heads, head_dim]");
    require_table_shape(v, {d.heads_q, d.head_dim}, "attention: xl: r_r_bias [heads, head_dim]");
    const int64_t dm = rnet.shape[1];
    require_table_shape(rnet, {d.heads_q * d.head_dim, dm},
                        "attention: xl: r_net [heads * head_dim, d_model]");
    if (dm < 2 || dm % 2 != 0) {
      fail<ShapeError>("attention: xl: r_net's d_model (" + std::to_string(dm) +
                       ") must be even and >= 2");
    }
    if (!std::isfinite(x.base) || x.base <= 1.0) fail("attention: xl: base must be > 1");
    base = x.base;
    if (!in.simple_path) return;
    // Project R(delta) for every distance that occurs: O(#distances * H * D * Dm). Distances of
    // a batch row lie in [min_q - max_k, max_q - min_k]: O(seq_q + seq_k) of them for contiguous
    // positions; sparse ids with a wide range fall back to visiting the cells.
    const int64_t hd = d.heads_q * d.head_dim;
    auto add = [&](int64_t delta) {
      if (r.count(delta)) return;
      const auto rr = xl_sinusoid(delta, dm, base);
      std::vector<T> proj(static_cast<std::size_t>(hd));
      for (int64_t o = 0; o < hd; ++o) {
        T acc = 0;
        const T* w = rnet.data + o * rnet.stride[0];
        for (int64_t m = 0; m < dm; ++m) {
          acc += w[m * rnet.stride[1]] * static_cast<T>(rr[static_cast<std::size_t>(m)]);
        }
        proj[static_cast<std::size_t>(o)] = acc;
      }
      r.emplace(delta, std::move(proj));
    };
    for (int64_t b = 0; b < d.batch && d.seq_q > 0 && d.seq_k > 0; ++b) {
      const auto [qlo, qhi, klo, khi] = row_span(in.qp, in.kp, b, d.seq_q, d.seq_k);
      if ((qhi - klo) - (qlo - khi) <= 4 * (d.seq_q + d.seq_k)) {
        for (int64_t delta = qlo - khi; delta <= qhi - klo; ++delta) add(delta);
      } else {
        for (int64_t i = 0; i < d.seq_q; ++i) {
          for (int64_t j = 0; j < d.seq_k; ++j) add(in.qp.at(b, i) - in.kp.at(b, j));
        }
      }
    }
  }

  // u · k + (q + v) · r(delta), on top of q · k.
  void score(const Cell<T>& c, T& content, T&) const {
    const T* ur = u.data + c.h * u.stride[0];
    const T* vr = v.data + c.h * v.stride[0];
    const T* rr = r.at(c.pq - c.pk).data() + c.h * c.dim;
    for (int64_t x = 0; x < c.dim; ++x) {
      content += static_cast<T>(ur[x * u.stride[1]]) * c.k(x) +
                 (c.q(x) + static_cast<T>(vr[x * v.stride[1]])) * rr[x];
    }
  }

  T key_query(const Cell<T>& c, int64_t x) const { return c.q(x) + static_cast<T>(u(c.h, x)); }

  void grad(const Cell<T>& c, T, T, T sds, CellGrads<T>& g) const {
    const T* rr = r.at(c.pq - c.pk).data() + c.h * c.dim;
    auto& drow = dr[c.pq - c.pk];
    if (drow.empty()) drow.assign(static_cast<std::size_t>(u.shape[0] * c.dim), T(0));
    for (int64_t x = 0; x < c.dim; ++x) {
      g.dq_row[x] += sds * rr[x];
      if (g.g.dr_w_bias.data) g.g.dr_w_bias(c.h, x) += sds * c.k(x);
      if (g.g.dr_r_bias.data) g.g.dr_r_bias(c.h, x) += sds * rr[x];
      drow[static_cast<std::size_t>(c.h * c.dim + x)] += sds * (c.q(x) + static_cast<T>(v(c.h, x)));
    }
  }

  // r(delta) = W_r R(delta): dW_r[o][m] = sum_delta dr(delta)[o] R(delta)[m].
  void finish_grads(const Problem<T>&, const AttentionGradsOf<T>& g, View<const T, 4>,
                    View<const T, 4>) const {
    if (g.dr_net.data == nullptr) return;
    const int64_t dm = rnet.shape[1];
    for (const auto& [delta, row] : dr) {
      const auto rr = xl_sinusoid(delta, dm, base);
      for (int64_t o = 0; o < rnet.shape[0]; ++o) {
        const T x = row[static_cast<std::size_t>(o)];
        if (x == T(0)) continue;
        for (int64_t m = 0; m < dm; ++m)
          g.dr_net(o, m) += x * static_cast<T>(rr[static_cast<std::size_t>(m)]);
      }
    }
  }

  // Its learned tables by parameter name, and their gradient fields (bind_param_grad).
  static auto grad_fields(AttentionGradsOf<T>& g) {
    return std::make_tuple(std::pair{"r_w_bias", &g.dr_w_bias}, std::pair{"r_r_bias", &g.dr_r_bias},
                           std::pair{"r_net", &g.dr_net});
  }
  void check_grads(const AttentionGradsOf<T>& g, GradCheck<T>& chk) const {
    chk.own(g.dr_w_bias, u.shape, "dr_w_bias");
    chk.own(g.dr_r_bias, v.shape, "dr_r_bias");
    chk.own(g.dr_net, rnet.shape, "dr_net");
  }

  // The kernel: the sinusoid rows R(delta) for the distances a mask can leave visible (the
  // kernel projects them with W_r itself), u, v and W_r dense.
  bool fill_kernel(KernelInputs& in) const {
    const Dims& d = in.pr.d;
    int64_t dlo = in.gdmin, dhi = in.gdmax;
    mask_rule(in.pr.opt).clip_distances(dlo, dhi);
    dhi = std::max(dhi, dlo);
    const int64_t len = dhi - dlo + 1;
    const int64_t dm = rnet.shape[1];
    std::vector<float>& sin = in.f32.emplace_back(static_cast<std::size_t>(len * dm));
    // R(delta) for delta = dhi - t: exact sin/cos at the start of each block of 32 distances,
    // then rotations by -w (delta decreases by 1 per row) in double; 31 steps add ~1e-14.
    const int64_t half = dm / 2;
    std::vector<double> w(static_cast<std::size_t>(half)), cw(w.size()), sw(w.size());
    for (int64_t i = 0; i < half; ++i) {
      const auto ui = static_cast<std::size_t>(i);
      w[ui] = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(dm));
      cw[ui] = std::cos(w[ui]);
      sw[ui] = std::sin(w[ui]);
    }
    constexpr int64_t kBlock = 32;
    kernels::parallel_for((len + kBlock - 1) / kBlock, in.threads, [&](int64_t blk) {
      const int64_t t0 = blk * kBlock, t1 = std::min(len, t0 + kBlock);
      for (int64_t i = 0; i < half; ++i) {
        const auto ui = static_cast<std::size_t>(i);
        const double a = static_cast<double>(dhi - t0) * w[ui];
        double sn = std::sin(a), cs = std::cos(a);
        for (int64_t t = t0; t < t1; ++t) {
          sin[static_cast<std::size_t>(t * dm + i)] = static_cast<float>(sn);
          sin[static_cast<std::size_t>(t * dm + half + i)] = static_cast<float>(cs);
          const double ns = sn * cw[ui] - cs * sw[ui];
          cs = cs * cw[ui] + sn * sw[ui];
          sn = ns;
        }
      }
    });
    std::vector<float>& w_r =
        in.f32.emplace_back(static_cast<std::size_t>(d.heads_q * d.head_dim * dm));
    for (int64_t o = 0; o < d.heads_q * d.head_dim; ++o)
      for (int64_t m = 0; m < dm; ++m) w_r[static_cast<std::size_t>(o * dm + m)] = rnet(o, m);
    std::vector<float>& ud = in.f32.emplace_back(static_cast<std::size_t>(d.heads_q * d.head_dim));
    std::vector<float>& vd = in.f32.emplace_back(ud.size());
    for (int64_t h = 0; h < d.heads_q; ++h) {
      for (int64_t c = 0; c < d.head_dim; ++c) {
        ud[static_cast<std::size_t>(h * d.head_dim + c)] = u(h, c);
        vd[static_cast<std::size_t>(h * d.head_dim + c)] = v(h, c);
      }
    }
    in.fp.xl_sin = sin.data();
    in.fp.xl_rnet = w_r.data();
    in.fp.xl_dmodel = dm;
    in.fp.xl_len = len;
    in.fp.xl_dmax = dhi;
    in.fp.xl_content_bias = ud.data();
    in.fp.xl_position_bias = vd.data();
    return true;
  }
  void bind_grads(KernelGrads& kg) const {
    const auto n = static_cast<std::size_t>(u.numel());
    kg.bp.xl_du = kg.f32.emplace_back(n).data();
    kg.bp.xl_dv = kg.f32.emplace_back(n).data();
    if (kg.g.dr_net.data != nullptr) {
      kg.bp.xl_drnet = kg.f32.emplace_back(static_cast<std::size_t>(rnet.numel())).data();
    }
  }
  void fold_grads(KernelGrads& kg) const {
    copy_dense(kg.bp.xl_du, kg.g.dr_w_bias);
    copy_dense(kg.bp.xl_dv, kg.g.dr_r_bias);
    if (kg.bp.xl_drnet != nullptr) copy_dense(kg.bp.xl_drnet, kg.g.dr_net);
  }

  // The scheme from settings, parameter tensors and a model config (schemes/xl.cc).
  static void build(detail::SchemeBuild& b, const ModelLayer* layer);
};

}  // namespace posenc::attn
