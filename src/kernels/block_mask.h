// src/kernels/block_mask.h - the block masks (AttentionOptions::block_mask) at tile granularity,
// shared by the fused forward (attention_hwy.cc) and backward (attention_backward_hwy.cc): which
// tiles of queries x keys no query sees (skipped), which have every cell visible (no mask
// applied), per (batch row, key tile) summaries of the keys' documents and open keys. The per-cell
// test is RowMask (mask-inl.h). Scalar code: no Highway types.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/attention_kernels.h"

namespace posenc::kernels {

// A block of queries: its position range, document range and whether any of its queries is open
// (sees every key of its document).
struct QueryBlockInfo {
  int32_t plo, phi, dlo, dhi;
  bool open;
};

enum class TileKind { kHidden, kPartial, kFull };

class TileMasks {
 public:
  // tile_min / tile_max: the key positions' range per (batch row, tile of `tile` keys).
  TileMasks(const FusedAttentionParams& p, int64_t tile, const int32_t* tile_min,
            const int32_t* tile_max)
      : p_(p), tile_(tile), tmin_(tile_min), tmax_(tile_max) {
    ntiles_ = (p.seq_k + tile - 1) / tile;
    if (p.kdoc == nullptr && p.kopen == nullptr) return;
    const auto n = static_cast<size_t>(p.batch * ntiles_);
    dlo_.assign(n, 0), dhi_.assign(n, 0), open_.assign(n, 0);
    for (int64_t b = 0; b < p.batch; ++b) {
      for (int64_t t = 0; t < ntiles_; ++t) {
        int32_t lo = std::numeric_limits<int32_t>::max(), hi = std::numeric_limits<int32_t>::min();
        uint8_t open = 0;
        for (int64_t j = t * tile; j < std::min(p.seq_k, (t + 1) * tile); ++j) {
          if (p.kdoc != nullptr) {
            lo = std::min(lo, p.kdoc[b * p.seq_k + j]);
            hi = std::max(hi, p.kdoc[b * p.seq_k + j]);
          }
          if (p.kopen != nullptr) open |= p.kopen[b * p.seq_k + j] != 0;
        }
        const auto at = static_cast<size_t>(b * ntiles_ + t);
        dlo_[at] = lo, dhi_[at] = hi, open_[at] = open;
      }
    }
  }

  QueryBlockInfo Queries(int64_t b, int64_t i0, int64_t nq) const {
    QueryBlockInfo q{std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min(),
                     std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min(),
                     false};
    for (int64_t i = i0; i < i0 + nq; ++i) {
      const int64_t at = b * p_.seq_q + i;
      q.plo = std::min(q.plo, p_.qpos[at]);
      q.phi = std::max(q.phi, p_.qpos[at]);
      if (p_.qdoc != nullptr) {
        q.dlo = std::min(q.dlo, p_.qdoc[at]);
        q.dhi = std::max(q.dhi, p_.qdoc[at]);
      }
      if (p_.qopen != nullptr) q.open = q.open || p_.qopen[at] != 0;
    }
    return q;
  }

  // Tile t of batch row b against queries [i0, i0 + nq) summarized by q.
  TileKind Classify(const QueryBlockInfo& q, int64_t b, int64_t t, int64_t i0, int64_t nq) const {
    const auto at = static_cast<size_t>(b * ntiles_ + t);
    const int32_t klo = tmin_[at], khi = tmax_[at];
    const int64_t j0 = t * tile_, nk = std::min(tile_, p_.seq_k - j0);
    const bool docs = p_.kdoc != nullptr;
    if (docs && (dhi_[at] < q.dlo || dlo_[at] > q.dhi)) return TileKind::kHidden;
    const bool open = q.open || (!open_.empty() && open_[at] != 0);
    if (!open && p_.mask.hides_block(q.plo, q.phi, klo, khi)) return TileKind::kHidden;
    if (p_.dense != nullptr && !DenseAny(b, i0, nq, j0, nk)) return TileKind::kHidden;
    const bool one_doc = !docs || (dlo_[at] == dhi_[at] && q.dlo == q.dhi && q.dlo == dlo_[at]);
    if (nk == tile_ && p_.dense == nullptr && one_doc &&
        p_.mask.shows_block(q.plo, q.phi, klo, khi)) {
      return TileKind::kFull;
    }
    return TileKind::kPartial;
  }

  // Whether any block mask is set (rows then test their cells with RowMask::SetBlock).
  bool Any() const {
    return p_.qdoc != nullptr || p_.kdoc != nullptr || p_.qopen != nullptr || p_.kopen != nullptr ||
           p_.dense != nullptr;
  }

  // Whether the key tiles' distance summaries may ignore the causal / window / chunk limits
  // (open tokens see past them).
  bool Opens() const { return p_.qopen != nullptr || p_.kopen != nullptr; }

 private:
  bool DenseAny(int64_t b, int64_t i0, int64_t nq, int64_t j0, int64_t nk) const {
    for (int64_t i = i0; i < i0 + nq; ++i) {
      const uint8_t* row = p_.dense + b * p_.dense_stride[0] + i * p_.dense_stride[1];
      for (int64_t j = j0; j < j0 + nk; ++j) {
        if (row[j * p_.dense_stride[2]] != 0) return true;
      }
    }
    return false;
  }

  const FusedAttentionParams& p_;
  int64_t tile_, ntiles_ = 0;
  const int32_t *tmin_, *tmax_;
  std::vector<int32_t> dlo_, dhi_;
  std::vector<uint8_t> open_;
};

// The block-mask lanes of one query row on a tile, as int32 arrays of kTileK lanes for RowMask:
// the keys' documents and open flags, and the dense mask's row (0 / 1). Filled per tile (keys)
// and per row (dense).
struct TileMaskLanes {
  const int32_t* kdoc = nullptr;
  const int32_t* kopen = nullptr;
  const int32_t* dense = nullptr;
};

// Copies keys [j0, j0 + nk) of batch row b's documents / open flags into kdoc / kopen (tile
// lanes; lanes past nk repeat the last key: they are masked by the caller).
inline void FillKeyLanes(const FusedAttentionParams& p, int64_t b, int64_t j0, int64_t nk,
                         int64_t lanes, int32_t* kdoc, int32_t* kopen) {
  for (int64_t c = 0; c < lanes; ++c) {
    const int64_t j = b * p.seq_k + j0 + std::min(c, nk - 1);
    if (p.kdoc != nullptr) kdoc[c] = p.kdoc[j];
    if (p.kopen != nullptr) kopen[c] = p.kopen[j];
  }
}

// The dense mask's row of query (b, i) over keys [j0, j0 + nk) as 0 / 1 lanes (0 past nk).
inline void FillDenseLanes(const FusedAttentionParams& p, int64_t b, int64_t i, int64_t j0,
                           int64_t nk, int64_t lanes, int32_t* out) {
  const uint8_t* row = p.dense + b * p.dense_stride[0] + i * p.dense_stride[1];
  for (int64_t c = 0; c < lanes; ++c) {
    out[c] = c < nk && row[(j0 + c) * p.dense_stride[2]] != 0 ? 1 : 0;
  }
}

}  // namespace posenc::kernels
