// src/kernels/mask-inl.h - the mask of attention/mask.h on a vector of key positions, shared by
// the fused forward (attention_hwy.cc) and backward (attention_backward_hwy.cc).
//
// Included once per target by the kernels' .cc files after hwy/foreach_target.h (the guard
// below re-expands for each target).
#if defined(POSENC_KERNELS_MASK_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef POSENC_KERNELS_MASK_INL_H_
#undef POSENC_KERNELS_MASK_INL_H_
#else
#define POSENC_KERNELS_MASK_INL_H_
#endif

#include <algorithm>
#include <cstdint>

#include "attention/mask.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// One query row's mask over int32 key positions (kernel positions: non-negative offsets from a
// per-row base that is a multiple of the chunk, so they fit int32). Lane-wise, no lane order.
// Holds scalars only (vectors are formed in Visible, which the callers' loops hoist).
class RowMask {
 public:
  RowMask(const detail::MaskRule& rule, int32_t pos_q)
      : causal_(rule.causal),
        window_(rule.window > 0),
        chunk_(rule.chunk > 0),
        pq_(pos_q),
        win_(static_cast<int32_t>(std::min<int64_t>(rule.window, INT32_MAX))) {
    if (chunk_) {
      const int64_t c0 = rule.chunk_start(pos_q);
      c0_ = static_cast<int32_t>(c0);
      c1_ = static_cast<int32_t>(std::min<int64_t>(c0 + rule.chunk, INT32_MAX));
    }
  }

  // The visible lanes among keys at positions kpos, as a mask over `d`'s lanes.
  template <class DF, class DI = hn::RebindToSigned<DF>>
  HWY_INLINE hn::Mask<DF> Visible(DF d, hn::Vec<DI> kpos) const {
    const DI di;
    const auto pq = hn::Set(di, pq_);
    auto vis = causal_ ? hn::Not(hn::Gt(kpos, pq)) : hn::Eq(kpos, kpos);
    if (window_) vis = hn::And(vis, hn::Lt(hn::Abs(hn::Sub(pq, kpos)), hn::Set(di, win_)));
    if (chunk_) {
      vis = hn::And(
          vis, hn::And(hn::Not(hn::Lt(kpos, hn::Set(di, c0_))), hn::Lt(kpos, hn::Set(di, c1_))));
    }
    return hn::RebindMask(d, vis);
  }

 private:
  bool causal_, window_, chunk_;
  int32_t pq_, win_, c0_ = 0, c1_ = 0;
};

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#endif  // POSENC_KERNELS_MASK_INL_H_
