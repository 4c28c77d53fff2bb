// src/kernels/terms/distance_bias-inl.h - the fused kernels' term for a bias that depends on the
// distance and the head (ALiBi, T5; FusedAttentionParams::bias), shared by the forward's row
// update (attention_hwy.cc) and the backward's row scores and gradients
// (attention_backward_hwy.cc).
//
// For batch row b, query head h and query position pos_q, key position pos_k reads
// bias[b * bias_batch_stride + h * bias_len + bias_dmax[b] - pos_q + pos_k]: one row per
// (b, h), indexed by the key position plus a per-query offset. Consecutive key positions read a
// contiguous run (the table has a tile of padding past its last distance); others gather.
//
// Included once per target by the kernels' .cc files after hwy/foreach_target.h (the guard
// below re-expands for each target).
#if defined(POSENC_KERNELS_TERMS_DISTANCE_BIAS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef POSENC_KERNELS_TERMS_DISTANCE_BIAS_INL_H_
#undef POSENC_KERNELS_TERMS_DISTANCE_BIAS_INL_H_
#else
#define POSENC_KERNELS_TERMS_DISTANCE_BIAS_INL_H_
#endif

#include <cstdint>

#include "hwy/highway.h"
#include "kernels/attention_kernels.h"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The bias row of one query (F = const float: the biases; F = float: their gradient, the same
// layout): key position k reads row[off + k]. Holds scalars and pointers only.
template <class F>
struct DistanceBiasRow {
  F* row = nullptr;  // nullptr: the scheme has no distance bias (or its gradient is not wanted)
  int32_t off = 0;

  // table: FusedAttentionParams::bias or FusedBackwardParams::dbias.
  DistanceBiasRow(const FusedAttentionParams& p, F* table, int64_t b, int64_t h, int32_t pos_q) {
    if (table == nullptr) return;
    row = table + b * p.bias_batch_stride + h * p.bias_len;
    off = static_cast<int32_t>(p.bias_dmax[b] - pos_q);
  }

  // sv + the biases of keys kp[c .. c + lanes); consec: kp[c + x] = kp[0] + c + x.
  template <class D>
  HWY_INLINE hn::Vec<D> Add(D d, hn::Vec<D> sv, const int32_t* kp, int64_t c, bool consec) const {
    if (consec) return hn::Add(sv, hn::LoadU(d, row + off + kp[0] + c));
    const hn::RebindToSigned<D> di;
    const auto idx = hn::Add(hn::Load(di, kp + c), hn::Set(di, off));
    return hn::Add(sv, hn::GatherIndex(d, row, idx));
  }

  // The gradient row (F = float) += ds[c] for keys c < nk (ds: dS unscaled, the bias being added
  // after the scale; zero past nk up to kt). Keys at one distance add to one entry.
  template <class D>
  HWY_INLINE void AddGrads(D d, const float* ds, const int32_t* kp, int64_t nk, int64_t kt,
                           bool consec) const {
    float* g = row + off;
    if (consec) {
      g += kp[0];
      for (int64_t c = 0; c < kt; c += static_cast<int64_t>(hn::Lanes(d))) {
        hn::StoreU(hn::Add(hn::LoadU(d, g + c), hn::Load(d, ds + c)), d, g + c);
      }
      return;
    }
    for (int64_t c = 0; c < nk; ++c) {
      if (ds[c] != 0.0f) g[kp[c]] += ds[c];
    }
  }
};

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#endif  // include guard
