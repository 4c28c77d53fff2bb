// src/kernels/mask-inl.h - the mask of core/mask.h on a vector of key positions, shared by
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

#include "core/mask.h"
#include "hwy/highway.h"
#include "kernels/block_mask.h"

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

  // Block masks (kernels/block_mask.h): the row's document and open flag, and the tile's lanes
  // (keys' documents, open keys, the dense mask's row), read at the tile offset given to
  // VisibleAt.
  void SetBlock(int32_t qdoc, bool qopen, const TileMaskLanes& lanes) {
    qdoc_ = qdoc;
    qopen_ = qopen;
    lanes_ = lanes;
    block_ = lanes.kdoc != nullptr || lanes.kopen != nullptr || lanes.dense != nullptr || qopen;
  }

  // The visible lanes among keys at positions kpos, as a mask over `d`'s lanes.
  template <class DF, class DI = hn::RebindToSigned<DF>>
  HWY_INLINE hn::Mask<DF> Visible(DF d, hn::Vec<DI> kpos) const {
    return hn::RebindMask(d, Rule(DI(), kpos));
  }

  // The same for the keys at lanes [c, c + N) of the tile, block masks included.
  template <class DF, class DI = hn::RebindToSigned<DF>>
  HWY_INLINE hn::Mask<DF> VisibleAt(DF d, hn::Vec<DI> kpos, int64_t c) const {
    const DI di;
    if (!block_) return hn::RebindMask(d, Rule(di, kpos));
    auto vis = qopen_ ? hn::Eq(kpos, kpos) : Rule(di, kpos);
    if (lanes_.kopen != nullptr)
      vis = hn::Or(vis, hn::Ne(hn::Load(di, lanes_.kopen + c), hn::Zero(di)));
    if (lanes_.kdoc != nullptr)
      vis = hn::And(vis, hn::Eq(hn::Load(di, lanes_.kdoc + c), hn::Set(di, qdoc_)));
    if (lanes_.dense != nullptr)
      vis = hn::And(vis, hn::Ne(hn::Load(di, lanes_.dense + c), hn::Zero(di)));
    return hn::RebindMask(d, vis);
  }

 private:
  template <class DI>
  HWY_INLINE hn::Mask<DI> Rule(DI di, hn::Vec<DI> kpos) const {
    const auto pq = hn::Set(di, pq_);
    auto vis = causal_ ? hn::Not(hn::Gt(kpos, pq)) : hn::Eq(kpos, kpos);
    if (window_) vis = hn::And(vis, hn::Lt(hn::Abs(hn::Sub(pq, kpos)), hn::Set(di, win_)));
    if (chunk_) {
      vis = hn::And(
          vis, hn::And(hn::Not(hn::Lt(kpos, hn::Set(di, c0_))), hn::Lt(kpos, hn::Set(di, c1_))));
    }
    return vis;
  }

  bool causal_, window_, chunk_;
  int32_t pq_, win_, c0_ = 0, c1_ = 0;
  bool block_ = false, qopen_ = false;
  int32_t qdoc_ = 0;
  TileMaskLanes lanes_;
};

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#endif  // POSENC_KERNELS_MASK_INL_H_
