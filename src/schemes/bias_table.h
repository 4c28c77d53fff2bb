// src/schemes/bias_table.h - the fused kernels' form of a bias that depends on the distance
// delta = pos_q - pos_k and the head only (ALiBi, T5): one row per (batch row, head), indexed by
// dmax[b] - delta; the backward sums dS into the same layout, folded per scheme in a fixed order.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/parallel.h"
#include "schemes/term.h"

namespace posenc::attn {

// bias(h, delta) for every head and every distance of every row.
template <class F>
void fill_bias_table(KernelInputs& in, F&& bias) {
  const Dims& d = in.pr.d;
  const int64_t len = in.range + KernelInputs::kPad;
  std::vector<float>& table =
      in.f32.emplace_back(static_cast<std::size_t>(d.batch * d.heads_q * len), 0.0f);
  kernels::parallel_for(d.batch * d.heads_q, in.threads, [&](int64_t bh) {
    const int64_t b = bh / d.heads_q, h = bh % d.heads_q;
    float* row = table.data() + bh * len;
    for (int64_t t = 0; t < in.range; ++t) {
      row[t] = bias(h, in.dmax[static_cast<std::size_t>(b)] - t);
    }
  });
  in.fp.bias = table.data();
  in.fp.bias_len = len;
  in.fp.bias_batch_stride = d.heads_q * len;
  in.fp.bias_dmax = in.dmax.data();
}

// The kernel's dbias buffer, laid out as the bias table.
inline void bind_bias_grads(KernelGrads& kg) {
  std::vector<float>& dbias = kg.f32.emplace_back(
      static_cast<std::size_t>(kg.pr.d.batch * kg.bp.fwd.bias_batch_stride), 0.0f);
  kg.bp.dbias = dbias.data();
}

// The kernel's per-distance sums of dS folded into a parameter gradient out [n, heads_q], in a
// fixed order (rows, then distances): slot(delta) = {row of out, weight}, out[row][h] = sum of
// weight * dS over the distances (summed in double).
template <class Slot>
void fold_bias_grads(KernelGrads& kg, int64_t n, Slot&& slot, const View<float, 2>& out) {
  const Dims& d = kg.pr.d;
  const auto& fwd = kg.bp.fwd;
  const int64_t len = fwd.bias_len;
  for (int64_t h = 0; h < d.heads_q; ++h) {
    std::vector<double> acc(static_cast<std::size_t>(n), 0.0);
    for (int64_t b = 0; b < d.batch; ++b) {
      const float* row = kg.bp.dbias + b * fwd.bias_batch_stride + h * len;
      const int64_t dmax = fwd.bias_dmax[b];
      for (int64_t t = 0; t < len; ++t) {
        if (row[t] == 0.0f) continue;
        const auto [u, weight] = slot(dmax - t);
        acc[static_cast<std::size_t>(u)] += weight * static_cast<double>(row[t]);
      }
    }
    for (int64_t u = 0; u < n; ++u)
      out(u, h) = static_cast<float>(acc[static_cast<std::size_t>(u)]);
  }
}

}  // namespace posenc::attn
