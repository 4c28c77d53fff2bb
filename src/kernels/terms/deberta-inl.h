// src/kernels/terms/deberta-inl.h - the fused kernels' terms for DeBERTa's disentangled
// attention (FusedAttentionParams::deberta_*): the forward's row scores (attention_hwy.cc) and
// the backward's row scores and gradients (attention_backward_hwy.cc).
//
// s_ij += scale (q_i . pos_key[c2p[t]] + k_j . pos_query[p2c[t]]), t = dmax - delta (the
// index tables by distance, monotone in t).
// Forward (DebertaForward, DebertaRow): per item, each row's c2p projections onto the pos_key
// rows its distances use; per (batch row, head) a p2c table kpq[u][j] = scale k_j .
// pos_query[u], formed by the schedule (schedule-inl.h) from the transposed key tiles, with the
// rows inside linear runs stored again along diagonals; a row reads both with broadcasts,
// contiguous loads or gathers depending on the index runs.
// Backward (DebertaBackward): c2p as a row table of terms/row_tables-inl.h; p2c per key tile
// (kpq and its gradient W, with diagonal copies of the linear stretch) when the item's buffers
// fit, else per cell, summed over runs of equal rows.
//
// Included once per target by the kernels' .cc files after hwy/foreach_target.h (the guard
// below re-expands for each target).
#if defined(POSENC_KERNELS_TERMS_DEBERTA_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef POSENC_KERNELS_TERMS_DEBERTA_INL_H_
#undef POSENC_KERNELS_TERMS_DEBERTA_INL_H_
#else
#define POSENC_KERNELS_TERMS_DEBERTA_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "kernels/attention-inl.h"
#include "kernels/attention_kernels.h"
#include "kernels/parallel.h"
#include "kernels/terms/row_tables-inl.h"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// ---- Forward ----

class DebertaForward;

// The terms of one query row. Holds scalars and pointers only.
struct DebertaRow {
  const DebertaForward* t = nullptr;  // nullptr: no DeBERTa term
  const float* prow = nullptr;        // the row's c2p projections
  const float* kpq = nullptr;         // row u0 of the (b, h) p2c table
  const float* diag = nullptr;        // its diagonal copy
  const float* p2 = nullptr;          // set when the tile's terms are constant (c2 + p2 row)
  float c2 = 0.0f;
  int32_t off = 0;  // index table entry of key position 0
  int64_t j0 = 0;   // the tile's first key

  // sv + the terms of keys kp[c .. c + lanes); consec: kp[c + x] = kp[0] + c + x; iota: lane
  // offsets 0 .. lanes - 1.
  HWY_INLINE hn::Vec<DF> Add(DF d, hn::Vec<DF> sv, const int32_t* kp, int64_t c, bool consec,
                             hn::Vec<DI> iota) const;
};

class DebertaForward {
 public:
  // Runs of `lanes` index entries (see the constructor).
  static constexpr int8_t kConst = 0, kLinear = 1, kGather = 2;

  // Per call: pos_key^T tiles per head (for the per-item c2p products), pos_query scaled (the
  // p2c products are formed by the schedule, see FillP2c), the rows of pos_query that visible
  // distances use, and per distance whether the next `lanes` index entries are constant,
  // linear (step +-1) or neither.
  // visible(b): the distances [dlo, dhi] batch row b's queries can see of its keys.
  template <class Visible>
  DebertaForward(const FusedAttentionParams& p, const Visible& visible)
      : p_(p), lanes_(static_cast<int64_t>(hn::Lanes(DF()))), dim_(p.head_dim) {
    const int64_t span2 = 2 * p_.deberta_span;
    tiles_ = (span2 + kTileK - 1) / kTileK;
    pq_rows_ = RoundUp(span2, 4);
    // Row stride of the p2c table: off a power of two (a 2^k-float stride maps the rows a gather
    // touches onto the same cache sets).
    seq_k_pad_ = RoundUp(p_.seq_k, kTileK) + 16;
    pk_t_ = hwy::AllocateAligned<float>(static_cast<size_t>(p_.heads_q * tiles_ * dim_ * kTileK));
    for (int64_t h = 0; h < p_.heads_q; ++h) {
      TransposeTable(p_.deberta_pos_key + h * dim_, span2, p_.heads_q * dim_, dim_, p_.scale,
                     pk_t_.get() + h * tiles_ * dim_ * kTileK);
    }
    pq_ = hwy::AllocateAligned<float>(static_cast<size_t>(p_.heads_q * pq_rows_ * dim_));
    std::fill(pq_.get(), pq_.get() + p_.heads_q * pq_rows_ * dim_, 0.0f);
    for (int64_t h = 0; h < p_.heads_q; ++h) {
      for (int64_t u = 0; u < span2; ++u) {
        for (int64_t x = 0; x < dim_; ++x) {
          pq_[static_cast<size_t>((h * pq_rows_ + u) * dim_ + x)] =
              p_.deberta_pos_query[(u * p_.heads_q + h) * dim_ + x] * p_.scale;
        }
      }
    }
    // Only the pos_query rows that visible distances use (about half under a causal mask).
    int64_t ulo = span2, uhi = 0;
    for (int64_t b = 0; b < p_.batch; ++b) {
      const auto [dlo, dhi] = visible(b);
      const int64_t dmax = p_.deberta_dmax[b];
      // Entries outside the table are distances no key pair has (a row whose queries see no
      // key clips to an empty or shifted range): only the table's own entries are read.
      for (int64_t t = std::max<int64_t>(dmax - dhi, 0);
           t <= std::min<int64_t>(dmax - dlo, p_.deberta_len - 1); ++t) {
        ulo = std::min<int64_t>(ulo, p_.deberta_p2c[t]);
        uhi = std::max<int64_t>(uhi, p_.deberta_p2c[t]);
      }
    }
    u0_ = std::min(ulo, uhi) / 4 * 4;
    nrows_ = RoundUp(uhi + 1 - u0_, 4);
    // Runs of `lanes` index entries: constant, linear (one step of the table's direction per
    // entry) or neither. Both tables are monotone in t; their direction is their sign.
    const int64_t len = p_.deberta_len;
    auto classify = [&](const int32_t* idx, int& sign, std::vector<int8_t>& kind) {
      sign = idx[len - 1] >= idx[0] ? 1 : -1;
      kind.assign(static_cast<size_t>(len), kGather);
      for (int64_t t = 0; t + lanes_ <= len; ++t) {
        if (idx[t] == idx[t + lanes_ - 1]) {
          kind[static_cast<size_t>(t)] = kConst;
          continue;
        }
        bool lin = true;
        for (int64_t x = 1; x < lanes_ && lin; ++x) lin = idx[t + x] == idx[t] + sign * x;
        if (lin) kind[static_cast<size_t>(t)] = kLinear;
      }
    };
    classify(p_.deberta_c2p, c2p_sign_, c2p_kind_);
    classify(p_.deberta_p2c, p2c_sign_, p2c_kind_);
    // The band of p2c rows inside linear runs (|delta| <= position_buckets / 2 for log buckets):
    // stored a second time along diagonals, so that such runs are contiguous loads.
    band_lo_ = u0_ + nrows_, band_hi_ = u0_ - 1;
    for (int64_t t = 0; t + lanes_ <= len; ++t) {
      if (p2c_kind_[static_cast<size_t>(t)] != kLinear) continue;
      const int64_t a = p_.deberta_p2c[t], z = p_.deberta_p2c[t + lanes_ - 1];
      band_lo_ = std::min(band_lo_, std::min(a, z));
      band_hi_ = std::max(band_hi_, std::max(a, z));
    }
    band_lo_ = std::max(band_lo_, u0_);
    band_hi_ = std::min(band_hi_, u0_ + nrows_ - 1);
    band_w_ = std::max<int64_t>(0, band_hi_ - band_lo_ + 1);
    diag_stride_ = RoundUp(band_w_, 16) + 16;
    diag_rows_ = band_w_ > 0 ? p_.seq_k + band_w_ - 1 : 0;
  }

  // p2c tables of `slots` (batch row, head) pairs: kpq[u - u0][j] = scale k_j .
  // pos_query[u, h] for the used rows, and the band rows again along diagonals (Diag).
  void AllocateP2c(int64_t slots) {
    p2c_slots_ = slots;
    kpq_ = hwy::AllocateAligned<float>(static_cast<size_t>(slots * nrows_ * seq_k_pad_));
    if (band_w_ > 0) {
      diag_ = hwy::AllocateAligned<float>(static_cast<size_t>(slots * diag_rows_ * diag_stride_));
    }
  }

  // p2c products of key tile t (transposed keys kt) for head h into table slot `slot`.
  void FillP2c(int64_t h, int64_t t, const float* kt, int64_t slot) const {
    ScoresTile(pq_.get() + (h * pq_rows_ + u0_) * dim_, dim_, kt, nrows_,
               kpq_.get() + slot * nrows_ * seq_k_pad_ + t * kTileK, seq_k_pad_);
  }

  // Rows [e0, e1) of the diagonal copy of the band, once the slot's kpq table is complete.
  //
  // Entry (u, j) of the band lives in row e and column w with
  //   direction -1 (the p2c row falls as the key position rises): e = (u - lo) + j, w = hi - u;
  //   direction +1: e = (u - lo) - j + seq_k - 1, w = u - lo,
  // so that the keys of one query row inside a linear run, (u, j), (u + dir, j + 1), ..., are
  // consecutive floats of row e. Along a row, w -> w + 1 moves j by +1 and u by the direction,
  // a fixed stride through kpq, so each vector of a row is one gather with constant offsets.
  // Entries whose key lies outside [0, seq_k) are set to 0 (only masked cells read them).
  void FillDiag(int64_t slot, int64_t e0, int64_t e1) const {
    const DF d;
    const DI di;
    const int64_t n = lanes_;
    const float* kpq = kpq_.get() + slot * nrows_ * seq_k_pad_;
    float* diag = diag_.get() + slot * diag_rows_ * diag_stride_;
    const int64_t step = p2c_sign_ < 0 ? 1 - seq_k_pad_ : 1 + seq_k_pad_;
    const auto offs = hn::Mul(hn::Iota(di, 0), hn::Set(di, static_cast<int32_t>(step)));
    for (int64_t e = e0; e < e1; ++e) {
      // Key and row of column 0: j = w + cj, u = u_at0 + dir * w.
      const int64_t cj = p2c_sign_ < 0 ? e - (band_hi_ - band_lo_) : p_.seq_k - 1 - e;
      const int64_t u_at0 = p2c_sign_ < 0 ? band_hi_ : band_lo_;
      const int64_t wa = std::clamp<int64_t>(-cj, 0, band_w_);
      const int64_t wz = std::clamp<int64_t>(p_.seq_k - cj, wa, band_w_);
      float* row = diag + e * diag_stride_;
      std::fill(row, row + wa, 0.0f);
      int64_t w = wa;
      for (; w + n <= wz; w += n) {
        const float* src = kpq + (u_at0 + p2c_sign_ * w - u0_) * seq_k_pad_ + w + cj;
        hn::StoreU(hn::GatherIndex(d, src, offs), d, row + w);
      }
      for (; w < wz; ++w) row[w] = kpq[(u_at0 + p2c_sign_ * w - u0_) * seq_k_pad_ + w + cj];
      std::fill(row + wz, row + band_w_, 0.0f);
    }
  }

  // Diagonal copies of `slots` tables starting at slot s0, split into blocks of rows.
  void FillDiags(int64_t s0, int64_t slots, int threads) const {
    if (band_w_ == 0) return;
    constexpr int64_t kRowsPerTask = 256;
    const int64_t blocks = (diag_rows_ + kRowsPerTask - 1) / kRowsPerTask;
    parallel_for(slots * blocks, threads, [&](int64_t w) {
      const int64_t e0 = (w % blocks) * kRowsPerTask;
      FillDiag(s0 + w / blocks, e0, std::min(diag_rows_, e0 + kRowsPerTask));
    });
  }

  // Table slot of (batch row b, head h): the tables hold the heads b * heads_q + h in
  // [slot_base_, slot_base_ + p2c_slots_) (one group, or one wave of work units, at a time).
  int64_t P2cSlot(int64_t b, int64_t h) const { return b * p_.heads_q + h - slot_base_; }
  void SetSlotBase(int64_t base) { slot_base_ = base; }

  // Columns of an item's c2p projections (rows this many floats apart).
  int64_t C2pWidth() const { return tiles_ * kTileK; }

  // Range of c2p table rows c2p[dmax - delta] of batch row b over visible distances [dlo, dhi].
  std::pair<int64_t, int64_t> UsedC2pRows(int64_t b, int64_t dlo, int64_t dhi) const {
    const int32_t* index = p_.deberta_c2p;
    const int64_t dmax = p_.deberta_dmax[b];
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
    // Only the table's own entries (distances no key pair has lie outside it).
    for (int64_t t = std::max<int64_t>(dmax - dhi, 0);
         t <= std::min<int64_t>(dmax - dlo, p_.deberta_len - 1); ++t) {
      lo = std::min<int64_t>(lo, index[t]);
      hi = std::max<int64_t>(hi, index[t]);
    }
    return {std::min(lo, hi), hi};
  }

  // The c2p projections of nq4 rows of query head h (q rows dim floats apart) onto the pos_key
  // rows [ulo, uhi] (whole tiles of them): out[r][u] = scale q_r . pos_key[u, h], rows ld floats
  // apart.
  void FillC2p(int64_t h, const float* q, int64_t nq4, int64_t ulo, int64_t uhi, float* out,
               int64_t ld) const {
    for (int64_t tt = ulo / kTileK; tt <= uhi / kTileK; ++tt) {
      ScoresTile(q, dim_, pk_t_.get() + (h * tiles_ + tt) * dim_ * kTileK, nq4, out + tt * kTileK,
                 ld);
    }
  }

  // Row slot r's terms on the tile of keys kp from j0 (consec: consecutive positions), for batch
  // row b, query head h, query position qp; c2p_rows: the item's c2p projections, ld floats
  // apart.
  DebertaRow Row(const float* c2p_rows, int64_t ld, int64_t r, int64_t b, int64_t h, int32_t qp,
                 int64_t j0, const int32_t* kp, bool consec) const {
    DebertaRow row;
    row.t = this;
    row.prow = c2p_rows + r * ld;
    row.j0 = j0;
    row.off = static_cast<int32_t>(p_.deberta_dmax[b] - qp);
    const int64_t slot = P2cSlot(b, h);
    row.kpq = kpq_.get() + slot * nrows_ * seq_k_pad_;
    if (band_w_ > 0) row.diag = diag_.get() + slot * diag_rows_ * diag_stride_;
    if (consec) {
      // Both index tables constant over the whole tile (monotone: compare the ends), as for
      // every distance past the buckets: a scalar c2p term and one p2c row for the tile.
      const int64_t ta = int64_t{row.off} + kp[0], tz = ta + kTileK - 1;
      const int32_t* c2p = p_.deberta_c2p;
      const int32_t* p2c = p_.deberta_p2c;
      if (c2p[ta] == c2p[tz] && p2c[ta] == p2c[tz]) {
        row.c2 = row.prow[c2p[ta]];
        row.p2 =
            row.kpq + (std::clamp<int64_t>(p2c[ta], u0_, u0_ + nrows_ - 1) - u0_) * seq_k_pad_ + j0;
      }
    }
    return row;
  }

  // DeBERTa's c2p + p2c terms of keys c .. c + lanes - 1 of the tile for a row: c2p from the
  // row's projections prow at c2p[t], p2c from kpq[p2c[t]][j], t = dmax - delta = deb_off + kpos.
  // With consecutive key positions a run of index entries that is constant is a broadcast (c2p)
  // and a contiguous load (p2c); a linear run is a contiguous load (c2p, reversed when the
  // table falls) and, inside the band, a contiguous load along a diagonal (p2c). Gathers remain
  // for the log-bucket stretches, where the buckets change every few positions. Indices of
  // masked cells may leave the stored rows: they are clamped (the mask replaces those scores).
  // Row of the diagonal copy holding p2c row u at key j (see FillDiag).
  HWY_INLINE int64_t DiagRow(int64_t u, int64_t j) const {
    return p2c_sign_ < 0 ? u - band_lo_ + j : u - band_lo_ - j + p_.seq_k - 1;
  }

  HWY_INLINE hn::Vec<DF> Terms(const float* prow, int64_t j0, int64_t c, bool consec,
                               int32_t deb_off, const int32_t* kp, const float* kpq_bh,
                               const float* diag_bh, hn::Vec<DI> iota) const {
    const DF d;
    const DI di;
    const int64_t n = lanes_;
    const int32_t u0 = static_cast<int32_t>(u0_);
    const int32_t u1 = static_cast<int32_t>(u0_ + nrows_ - 1);
    const int64_t jc = j0 + c;
    auto gather_p2c = [&](hn::Vec<DI> u) {
      const auto row =
          hn::Sub(hn::Min(hn::Max(u, hn::Set(di, u0)), hn::Set(di, u1)), hn::Set(di, u0));
      const auto j = hn::Min(hn::Add(iota, hn::Set(di, static_cast<int32_t>(jc))),
                             hn::Set(di, static_cast<int32_t>(p_.seq_k - 1)));
      return hn::GatherIndex(
          d, kpq_bh, hn::Add(hn::Mul(row, hn::Set(di, static_cast<int32_t>(seq_k_pad_))), j));
    };
    if (!consec) {
      const auto tv = hn::Add(hn::Load(di, kp + c), hn::Set(di, deb_off));
      const auto c2 = hn::GatherIndex(d, prow, hn::GatherIndex(di, p_.deberta_c2p, tv));
      return hn::Add(c2, gather_p2c(hn::GatherIndex(di, p_.deberta_p2c, tv)));
    }
    const int64_t t0 = int64_t{deb_off} + kp[0] + c;
    const int32_t* c2p = p_.deberta_c2p + t0;
    const int32_t* p2c = p_.deberta_p2c + t0;
    hn::Vec<DF> c2;
    switch (c2p_kind_[static_cast<size_t>(t0)]) {
      case kConst:
        c2 = hn::Set(d, prow[c2p[0]]);
        break;
      case kLinear:
        c2 = c2p_sign_ > 0 ? hn::LoadU(d, prow + c2p[0])
                           : hn::Reverse(d, hn::LoadU(d, prow + c2p[n - 1]));
        break;
      default: {
        // Log buckets: the run's rows lie within one vector's reach of its lowest (monotone
        // table): one load and a lane permutation instead of a gather.
        const int32_t lo = std::min(c2p[0], c2p[n - 1]), hi = std::max(c2p[0], c2p[n - 1]);
        if (hi - lo < n) {
          const auto lanes = hn::Sub(hn::LoadU(di, c2p), hn::Set(di, lo));
          c2 = hn::TableLookupLanes(hn::LoadU(d, prow + lo), hn::IndicesFromVec(d, lanes));
        } else {
          c2 = hn::GatherIndex(d, prow, hn::LoadU(di, c2p));
        }
      }
    }
    const int64_t ua = p2c[0], uz = p2c[n - 1];
    const int8_t kind = p2c_kind_[static_cast<size_t>(t0)];
    hn::Vec<DF> p2;
    if (kind == kConst) {
      p2 = hn::LoadU(d, kpq_bh + (std::clamp<int64_t>(ua, u0, u1) - u0) * seq_k_pad_ + jc);
    } else if (kind == kLinear && std::min(ua, uz) >= band_lo_ && std::max(ua, uz) <= band_hi_ &&
               DiagRow(ua, jc) >= 0 && DiagRow(ua, jc) < diag_rows_) {
      // (Past the last key, in the masked columns of a short tile, the row can leave the
      // diagonal copy: those cells take the clamped gather below.)
      const int64_t w = p2c_sign_ < 0 ? band_hi_ - ua : ua - band_lo_;
      p2 = hn::LoadU(d, diag_bh + DiagRow(ua, jc) * diag_stride_ + w);
    } else {
      p2 = gather_p2c(hn::LoadU(di, p2c));
    }
    return hn::Add(c2, p2);
  }

 private:
  const FusedAttentionParams& p_;
  int64_t lanes_ = 1, dim_ = 0;
  int64_t tiles_ = 0, pq_rows_ = 0, seq_k_pad_ = 0;
  int64_t u0_ = 0, nrows_ = 0;  // stored p2c rows [u0, u0 + nrows)
  int64_t band_lo_ = 0, band_hi_ = -1, band_w_ = 0, diag_stride_ = 0, diag_rows_ = 0;
  int64_t p2c_slots_ = 0, slot_base_ = 0;  // tables held: heads [base, base + slots)
  int c2p_sign_ = 1, p2c_sign_ = 1;
  std::vector<int8_t> c2p_kind_, p2c_kind_;
  hwy::AlignedFreeUniquePtr<float[]> pk_t_, pq_, kpq_, diag_;
};

HWY_INLINE hn::Vec<DF> DebertaRow::Add(DF d, hn::Vec<DF> sv, const int32_t* kp, int64_t c,
                                       bool consec, hn::Vec<DI> iota) const {
  if (p2 != nullptr) return hn::Add(sv, hn::Add(hn::Set(d, c2), hn::LoadU(d, p2 + c)));
  return hn::Add(sv, t->Terms(prow, j0, c, consec, off, kp, kpq, diag, iota));
}

// ---- Backward ----

// A p2c cell's contribution to dK, applied after the tile's products (items without the p2c
// tile buffers).
struct PqCell {
  int64_t c, u, h;
  float sds;
};

// An item's p2c state (one kv head of one batch row).
struct DebertaItem {
  // The table rows each key tile's cells can use (hi < lo: no block visits it).
  std::vector<std::pair<int64_t, int64_t>> p2c_rows;
  int64_t n_p2c = 0;   // floats of kpq and of W for all the item's tiles
  int64_t nb = 0;      // rows of the diagonal copies (0: none)
  int64_t n_diag = 0;  // floats of G and of WG
  // With the item buffers (p2c_tiles): kpq[g][t][u][c] = scale k_c . pos_query[u, h] for every
  // table row u and key, W[g][t][u][c] the sum of scale dS over the cells of key c whose p2c row
  // is u, and their diagonal copies G, WG [g][t][nb][kTileK].
  float *kpq_all = nullptr, *wpq_all = nullptr, *gd_all = nullptr, *wgd_all = nullptr;
  bool p2c_tiles = false;
  // Without them, per (key of the tile, head of the group): last bucket and product, and the
  // open run of equal buckets in pq_cells.
  std::vector<int32_t> p2c_u, p2c_run;
  std::vector<float> p2c_val;
  std::vector<PqCell> pq_cells;
  hwy::AlignedFreeUniquePtr<int32_t[]> addr2_buf;
  int32_t* addr2 = nullptr;  // kpq / W address of each key of a row's vector

  // Floats of the item buffers for the tables.
  int64_t Floats() const { return 2 * n_p2c + 2 * n_diag; }
};

// Where block row r's p2c and c2p terms lie on a key tile.
struct DebertaRowAt {
  // Consecutive keys whose distances share one c2p row and one p2c row (far keys: saturated
  // buckets, most cells of a long causal sequence): one broadcast c2p value, one contiguous run
  // of the tile's p2c products.
  bool one = false;
  // Consecutive keys whose p2c rows all lie on the linear stretch: the p2c products from the
  // tile's diagonal copy (one run), W's from its gradient.
  bool diag = false;
  int64_t g = 0;               // diag: the row's run in G / WG
  int64_t a = 0;               // one: the c2p row's address in rel1 / w1
  const float* pq = nullptr;   // one: the p2c row of the tile's kpq
  float* w = nullptr;          // and of its W
  const float* kpq = nullptr;  // p2c tiles: the tile's kpq of the row's head
  float* wpq = nullptr;        // and its W
};

class DebertaBackward {
 public:
  DebertaBackward(const FusedBackwardParams& b, const RowChunks& rc, int64_t dpad, int64_t group)
      : b_(b), p_(b.fwd), dim_(p_.head_dim), dpad_(dpad), dimr_(RoundUp(dim_, 4)), group_(group) {
    span2_ = 2 * p_.deberta_span;
    rc.MakeRowTable(pos_key_, p_.deberta_pos_key, span2_, p_.heads_q, p_.scale);
    // run_end_[t]: the end of the run of distance indices from t on whose c2p and p2c rows both
    // stay the same (clipped or saturated distances).
    const int64_t len = p_.deberta_len;
    run_end_.assign(static_cast<size_t>(len), static_cast<int32_t>(len));
    for (int64_t t = len - 2; t >= 0; --t) {
      const bool same =
          p_.deberta_c2p[t] == p_.deberta_c2p[t + 1] && p_.deberta_p2c[t] == p_.deberta_p2c[t + 1];
      run_end_[static_cast<size_t>(t)] =
          same ? run_end_[static_cast<size_t>(t + 1)] : static_cast<int32_t>(t + 1);
    }
    // The p2c rows' linear stretch (distances inside the log buckets' exact band): they step
    // by step_ (-1 for the model form, +1 for the paper's) per key position, so a tile row's
    // p2c products kpq[u0 + step c][c] lie on a diagonal of the tile's kpq. Rows whose 64 keys
    // all lie in the stretch read a skewed copy, G[b][c] = kpq[b + step c][c] with b = u0, as
    // one contiguous run (see RowAt); b_lo_ .. b_hi_: the b they use.
    int64_t up = 0, down = 0;
    for (int64_t t = 0; t + 1 < len; ++t) {
      up += p_.deberta_p2c[t + 1] - p_.deberta_p2c[t] == 1;
      down += p_.deberta_p2c[t + 1] - p_.deberta_p2c[t] == -1;
    }
    step_ = up > down ? 1 : -1;
    std::vector<int32_t> lin_end(static_cast<size_t>(len), static_cast<int32_t>(len));
    for (int64_t t = len - 2; t >= 0; --t) {
      lin_end[static_cast<size_t>(t)] = p_.deberta_p2c[t + 1] - p_.deberta_p2c[t] == step_
                                            ? lin_end[static_cast<size_t>(t + 1)]
                                            : static_cast<int32_t>(t + 1);
    }
    lin_.assign(static_cast<size_t>(len), 0);
    for (int64_t t = 0; t + kTileK <= len; ++t) {
      if (lin_end[static_cast<size_t>(t)] < t + kTileK) continue;
      lin_[static_cast<size_t>(t)] = 1;
      b_lo_ = std::min<int64_t>(b_lo_, p_.deberta_p2c[t]);
      b_hi_ = std::max<int64_t>(b_hi_, p_.deberta_p2c[t]);
    }
    // pos_query padded ([span2r][heads][dpad], kpq's rows) and transposed per head
    // ([heads][dimr][span2r], dK's operand).
    span2r_ = RoundUp(span2_, 4);
    span2s_ = span2r_ + 4;  // rows of a tile's kpq and W: a used range rounded up to 4 fits
    pq_pad_ = hwy::AllocateAligned<float>(static_cast<size_t>(span2s_ * p_.heads_q * dpad_));
    pq_t_ = hwy::AllocateAligned<float>(static_cast<size_t>(p_.heads_q * dimr_ * span2r_));
    std::fill(pq_pad_.get(), pq_pad_.get() + span2s_ * p_.heads_q * dpad_, 0.0f);
    std::fill(pq_t_.get(), pq_t_.get() + p_.heads_q * dimr_ * span2r_, 0.0f);
    for (int64_t u = 0; u < span2_; ++u)
      for (int64_t h = 0; h < p_.heads_q; ++h)
        for (int64_t x = 0; x < dim_; ++x) {
          const float val = p_.deberta_pos_query[(u * p_.heads_q + h) * dim_ + x];
          pq_pad_[static_cast<size_t>((u * p_.heads_q + h) * dpad_ + x)] = val;
          pq_t_[static_cast<size_t>((h * dimr_ + x) * span2r_ + u)] = val;
        }
  }
  // Row-chunk buffers of the c2p table: its chunks.
  int64_t Chunks() const { return pos_key_.nch; }

  // The layout of an item's partial gradients from offset 0 (tchunk: floats of one head's
  // transposed table gradient): dpos_key (transposed), then dpos_query (rows); returns their
  // size.
  int64_t PlanParts(int64_t tchunk) {
    part_pq_ = group_ * tchunk;
    return part_pq_ + group_ * span2s_ * dpad_;
  }

  void ZeroGrads() const {
    const int64_t n = span2_ * p_.heads_q * dim_;
    if (b_.deberta_dpos_key != nullptr)
      std::fill(b_.deberta_dpos_key, b_.deberta_dpos_key + n, 0.0f);
    if (b_.deberta_dpos_query != nullptr) {
      std::fill(b_.deberta_dpos_query, b_.deberta_dpos_query + n, 0.0f);
    }
  }

  // Item (kv head hk)'s partial gradients added into dpos_key, dpos_query.
  void Reduce(const RowChunks& rc, const float* part, int64_t hk) const {
    rc.AddTransposed(part, b_.deberta_dpos_key, span2_, p_.heads_q, group_, hk);
    for (int64_t g = 0; g < group_; ++g) {
      const int64_t h = hk * group_ + g;
      for (int64_t u = 0; u < span2_; ++u) {
        const float* src = part + part_pq_ + (g * span2s_ + u) * dpad_;
        float* dst = b_.deberta_dpos_query + (u * p_.heads_q + h) * dim_;
        for (int64_t x = 0; x < dim_; ++x) dst[x] += src[x];
      }
    }
  }

  // Rows [lo, hi] of an index table at dmax - delta, for delta in [dlo, dhi] (narrowed by the
  // caller to the distances a mask can leave visible: masked cells still read their table rows,
  // which then hold finite values from earlier blocks or zeros, and add their dS = 0). Only the
  // table's own entries [0, len) are read: distances outside it belong to no key pair.
  static std::pair<int64_t, int64_t> UsedRows(const int32_t* table, int64_t len, int64_t dmax,
                                              int64_t dlo, int64_t dhi) {
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
    for (int64_t at = std::max<int64_t>(dmax - dhi, 0);
         at <= std::min<int64_t>(dmax - dlo, len - 1); ++at) {
      lo = std::min<int64_t>(lo, table[at]);
      hi = std::max<int64_t>(hi, table[at]);
    }
    return {lo, hi};
  }

  // The chunks of c2p rows batch row bb's distances [dlo, dhi] use.
  void BlockChunks(int64_t bb, int64_t dlo, int64_t dhi, BlockRows& br) const {
    const auto [ulo, uhi] = UsedRows(p_.deberta_c2p, p_.deberta_len, p_.deberta_dmax[bb], dlo, dhi);
    br.c0 = uhi < ulo ? 0 : ulo / kTileK, br.c1 = uhi < ulo ? 0 : uhi / kTileK + 1;  // none: empty
  }

  // The block's c2p projections: rel1 = scale q . pos_key.
  void Project(const RowChunks& rc, const float* qb, float* rel1, const BlockRows& br) const {
    rc.Project(pos_key_, qb, rel1, br);
  }

  // The item's plan for batch row bb: the p2c rows of each of its ntiles key tiles (deltas(t):
  // the distances [dlo, dhi] its blocks can see on tile t), the sizes of its tile tables, and
  // the diagonal copies when the item buffers (n_fixed floats without the tables) still fit the
  // budget with them.
  template <class Deltas>
  void PlanItem(DebertaItem& it, int64_t bb, int64_t ntiles, int64_t n_fixed, int64_t budget,
                const Deltas& deltas) const {
    it.p2c_u.assign(static_cast<size_t>(kTileK * group_), -1);
    it.p2c_val.assign(it.p2c_u.size(), {});
    it.p2c_run.assign(it.p2c_u.size(), -1);
    it.addr2_buf = hwy::AllocateAligned<int32_t>(static_cast<size_t>(kTileK));
    it.addr2 = it.addr2_buf.get();
    it.p2c_rows.assign(static_cast<size_t>(ntiles), {});
    for (int64_t t = 0; t < ntiles; ++t) {
      const auto [dlo, dhi] = deltas(t);
      it.p2c_rows[static_cast<size_t>(t)] =
          dlo > dhi ? std::pair<int64_t, int64_t>{0, -1}
                    : UsedRows(p_.deberta_p2c, p_.deberta_len, p_.deberta_dmax[bb], dlo, dhi);
    }
    it.n_p2c = group_ * ntiles * span2s_ * kTileK;
    it.nb = b_hi_ >= b_lo_ ? b_hi_ - b_lo_ + 1 : 0;
    it.n_diag = group_ * ntiles * it.nb * kTileK;
    if ((n_fixed + 2 * it.n_p2c + 2 * it.n_diag) * static_cast<int64_t>(sizeof(float)) > budget) {
      it.nb = 0, it.n_diag = 0;
    }
  }

  // The tile tables in the item buffers from `at` (Floats() floats, zeroed), or none.
  void SetBuffers(DebertaItem& it, float* at) const {
    it.p2c_tiles = at != nullptr;
    if (at == nullptr) return;
    it.kpq_all = at;
    it.wpq_all = it.kpq_all + it.n_p2c;
    it.gd_all = it.wpq_all + it.n_p2c;
    it.wgd_all = it.gd_all + it.n_diag;
  }

  // The p2c products of key tile t of kv head hk (ktr: its K^T) for every head of the group,
  // and their diagonal copy.
  void FillTile(DebertaItem& it, int64_t t, int64_t hk, int64_t ntiles, const float* ktr) const {
    const DF d;
    const int64_t kt = kTileK, lanes = static_cast<int64_t>(hn::Lanes(d));
    const auto [ulo, uhi] = it.p2c_rows[static_cast<size_t>(t)];
    for (int64_t g = 0; g < group_ && ulo <= uhi; ++g) {
      // Rows [ulo, ulo + RoundUp(n, 4)): within the tile's span2s_ rows.
      float* kpq = it.kpq_all + (g * ntiles + t) * span2s_ * kt + ulo * kt;
      const int64_t nr = RoundUp(uhi - ulo + 1, 4);
      ScoresTile(pq_pad_.get() + (ulo * p_.heads_q + hk * group_ + g) * dpad_, dim_, ktr, nr, kpq,
                 kt, p_.heads_q * dpad_);
      const auto vs = hn::Set(d, p_.scale);
      for (int64_t x = 0; x < nr * kt; x += lanes) {
        hn::Store(hn::Mul(hn::Load(d, kpq + x), vs), d, kpq + x);
      }
      // The diagonal copy G[b][c] = kpq[b + step c][c] (rows the tile computed).
      const float* kq = it.kpq_all + (g * ntiles + t) * span2s_ * kt;
      float* gd = it.gd_all + (g * ntiles + t) * it.nb * kt;
      for (int64_t b = 0; b < it.nb; ++b)
        for (int64_t c = 0; c < kt; ++c) {
          const int64_t u = b_lo_ + b + step_ * c;
          if (u >= ulo && u <= uhi) gd[b * kt + c] = kq[u * kt + c];
        }
    }
  }

  // A new key tile: no product or run of the per-cell path is current.
  void BeginTile(DebertaItem& it) const {
    std::fill(it.p2c_u.begin(), it.p2c_u.end(), -1);
    std::fill(it.p2c_run.begin(), it.p2c_run.end(), -1);
  }

  // Block row r (query head h of kv head hk's group, position pq, batch row bb) on key tile t of
  // ntiles (key positions kpt, consec: consecutive); cs: the row-chunk buffers' chunk stride.
  DebertaRowAt RowAt(const DebertaItem& it, int64_t bb, int64_t hk, int64_t h, int64_t r,
                     int32_t pq, int64_t t, int64_t ntiles, const int32_t* kpt, bool consec,
                     int64_t cs) const {
    const int64_t kt = kTileK;
    DebertaRowAt at;
    const int64_t at0 = int64_t{p_.deberta_dmax[bb]} - pq + kpt[0];
    const bool in_table = it.p2c_tiles && consec && at0 >= 0 && at0 + kt <= p_.deberta_len;
    at.one = in_table && run_end_[static_cast<size_t>(at0)] >= at0 + kt;
    at.diag = in_table && !at.one && it.nb > 0 && lin_[static_cast<size_t>(at0)] != 0;
    if (at.diag) {
      at.g = ((h - hk * group_) * ntiles + t) * it.nb * kt + (p_.deberta_p2c[at0] - b_lo_) * kt;
    }
    if (it.p2c_tiles) {
      const int64_t tile = ((h - hk * group_) * ntiles + t) * span2s_ * kt;
      at.kpq = it.kpq_all + tile;
      at.wpq = it.wpq_all + tile;
    }
    if (at.one) {
      const int64_t u = p_.deberta_c2p[at0], u2 = p_.deberta_p2c[at0];
      at.a = (u / kt) * cs + r * kt + u % kt;
      at.pq = at.kpq + u2 * kt;
      at.w = at.wpq + u2 * kt;
    }
    return at;
  }

  // Row r's scores (srow, batch row bb, query position pq) plus its c2p projections at each
  // key's c2p row and, with the tile tables, its p2c products; addr (c2p) and it.addr2 (p2c):
  // their addresses, for AddGrads.
  HWY_INLINE void AddScores(const RowChunks& rc, const DebertaItem& it, const DebertaRowAt& at,
                            int64_t bb, int32_t pq, int64_t r, int64_t cs, const int32_t* kpt,
                            bool consec, const float* rel1, int32_t* addr, float* srow) const {
    const DF d;
    const int64_t n = static_cast<int64_t>(hn::Lanes(d));
    if (at.one) {
      // The same arithmetic as the general path below.
      const auto vc = hn::Set(d, rel1[at.a]);
      for (int64_t c = 0; c < kTileK; c += n) {
        const auto x = hn::Add(hn::Load(d, srow + c), hn::LoadU(d, at.pq + c));
        hn::Store(hn::Add(x, vc), d, srow + c);
      }
      return;
    }
    const DI di;
    const int32_t off = static_cast<int32_t>(p_.deberta_dmax[bb] - pq);
    const float* gd = it.gd_all + at.g;
    int32_t* addr2 = it.addr2;
    rc.AddRowScores(
        kpt, r, cs, rel1, nullptr, false, addr, srow, nullptr, [&](int64_t c, hn::Vec<DI> kpv) {
          const auto ta = hn::Add(kpv, hn::Set(di, off));
          // Consecutive key positions read the index tables contiguously (past the
          // tile's last key too: the tables have a tile of padding, and those keys
          // are masked).
          const int64_t at0 = int64_t{p_.deberta_dmax[bb]} - pq + kpt[0] + c;
          const auto u = consec ? hn::LoadU(di, p_.deberta_c2p + at0)
                                : hn::GatherIndex(di, p_.deberta_c2p, ta);
          if (at.diag) {
            hn::Store(hn::Add(hn::Load(d, srow + c), hn::LoadU(d, gd + c)), d, srow + c);
          } else if (it.p2c_tiles) {
            // p2c: kpq[u2][c], address u2 * kTileK + c.
            const auto u2 = consec ? hn::LoadU(di, p_.deberta_p2c + at0)
                                   : hn::GatherIndex(di, p_.deberta_p2c, ta);
            const auto a2 = hn::Add(hn::ShiftLeft<6>(u2), hn::Iota(di, static_cast<int32_t>(c)));
            hn::Store(a2, di, addr2 + c);
            hn::Store(hn::Add(hn::Load(d, srow + c), rc.GatherTileRows(at.kpq, addr2 + c)), d,
                      srow + c);
          }
          return u;
        });
  }

  // Without the tile tables: the p2c term of each visible cell of row slot r's scores (srow,
  // query head h, position pq) on the tile of keys [j0, j0 + nk) (kp: their rows, dpad floats
  // apart; kposb: batch row bb's key positions). Consecutive rows of a column often share the
  // p2c row (clipped or log-bucketed distances), so the last product per (key, head) is kept.
  void AddCellScores(DebertaItem& it, int64_t bb, int64_t hk, int64_t h, int32_t pq, int64_t j0,
                     int64_t nk, const float* kp, const int32_t* kposb, float* srow) const {
    const float scale = p_.scale;
    for (int64_t c = 0; c < nk; ++c) {
      if (srow[c] == -std::numeric_limits<float>::infinity()) continue;
      const int32_t pk = kposb[j0 + c];
      const int64_t delta = int64_t{pq} - pk;
      float x = srow[c];
      {
        const int64_t at = p_.deberta_dmax[bb] - delta;
        // k_c . pos_query[u, h]
        const int32_t u = p_.deberta_p2c[at];
        const size_t key = static_cast<size_t>(c * group_ + (h - hk * group_));
        if (it.p2c_u[key] != u) {
          it.p2c_u[key] = u;
          it.p2c_val[key] =
              scale * Dot(kp + c * dpad_, p_.deberta_pos_query + (u * p_.heads_q + h) * dim_, dim_);
        }
        x += it.p2c_val[key];
      }
      srow[c] = x;
    }
  }

  // Without the tile tables: the p2c gradients of row slot r's cells (P in srow, dS in drow),
  // dK_j += scale dS pos_query[p2c] and dpos_query[p2c] += scale dS k_j, summed over runs of
  // equal rows per (key, head) first and applied after the tile's products (FinishTile).
  void AddCellGrads(DebertaItem& it, int64_t bb, int64_t hk, int64_t h, int32_t pq, int64_t j0,
                    int64_t nk, const int32_t* kposb, const float* srow, const float* drow) const {
    const float scale = p_.scale;
    for (int64_t c = 0; c < nk; ++c) {
      const float ds = drow[c];
      const float pr = srow[c];
      if (ds == 0.0f && pr == 0.0f) continue;
      const int32_t pk = kposb[j0 + c];
      const int64_t delta = int64_t{pq} - pk;
      const float sds = scale * ds;
      {
        const int64_t at = p_.deberta_dmax[bb] - delta;
        const int64_t u = p_.deberta_p2c[at];
        const size_t key = static_cast<size_t>(c * group_ + (h - hk * group_));
        int32_t& run = it.p2c_run[key];
        if (run >= 0 && it.pq_cells[static_cast<size_t>(run)].u == u) {
          it.pq_cells[static_cast<size_t>(run)].sds += sds;
        } else {
          run = static_cast<int32_t>(it.pq_cells.size());
          it.pq_cells.push_back({c, u, h, sds});
        }
      }
    }
  }

  // Keys c .. c + lanes of the row: scale dS (sds) added to their c2p rows' sums w1 and, with
  // the tile tables, to W (or its diagonal copy).
  HWY_INLINE void AddGrads(const RowChunks& rc, const DebertaItem& it, const DebertaRowAt& at,
                           const int32_t* addr, int64_t c, hn::Vec<DF> sds, float* w1) const {
    const DF d;
    if (at.one) {  // ScatterAdd's single-address case
      w1[at.a] += hn::GetLane(hn::SumOfLanes(d, sds));
      hn::StoreU(hn::Add(hn::LoadU(d, at.w + c), sds), d, at.w + c);
    } else {
      rc.ScatterAdd(w1, addr + c, sds, false, /*rising=*/false);
    }
    if (at.diag) {
      float* wg = it.wgd_all + at.g + c;
      hn::StoreU(hn::Add(hn::LoadU(d, wg), sds), d, wg);
    } else if (it.p2c_tiles && !at.one) {
      // The tile's keys are distinct lanes: no two lanes share an address.
      rc.ScatterAddTileRows(at.wpq, it.addr2 + c, sds);
    }
  }

  // After the tile's products, without the tile tables: the per-cell sums into the tile's dK
  // rows dkx and dpos_query's partial (kp: the tile's key rows, dpad floats apart).
  void FinishTile(DebertaItem& it, int64_t hk, const float* kp, float* dkx, float* part) const {
    for (const PqCell& cell : it.pq_cells) {
      const int64_t g = cell.h - hk * group_;
      Axpy(cell.sds, p_.deberta_pos_query + (cell.u * p_.heads_q + cell.h) * dim_,
           dkx + cell.c * dpad_, dim_);
      Axpy(cell.sds, kp + cell.c * dpad_, part + part_pq_ + (g * span2s_ + cell.u) * dpad_, dim_);
    }
    it.pq_cells.clear();
  }

  // After the block: dQ += w1 . pos_key, dpos_key += w1^T Q.
  void FinishBlock(const RowChunks& rc, const float* w1, const float* qtr, float* dqb, float* part,
                   const BlockRows& br) const {
    rc.BackQ(pos_key_, w1, dqb, br);
    rc.BackTable(w1, qtr, part, group_, br);
  }

  // After the item, with the tile tables: the p2c products once per key tile, dK^T +=
  // pos_query^T W (dk_all: the item's dK^T tiles), dpos_query += W K (kp_all: its key rows).
  void FinishItem(DebertaItem& it, int64_t hk, int64_t ntiles, const float* kp_all, float* dk_all,
                  float* part) const {
    const int64_t kt = kTileK, dp = dpad_;
    for (int64_t t = 0; it.p2c_tiles && t < ntiles; ++t) {
      const int64_t nk = std::min(kt, p_.seq_k - t * kt);
      const auto [ulo, uhi] = it.p2c_rows[static_cast<size_t>(t)];
      if (ulo > uhi) continue;
      for (int64_t g = 0; g < group_; ++g) {
        // The diagonal gradients folded back: W[b + step c][c] += WG[b][c].
        float* wq = it.wpq_all + (g * ntiles + t) * span2s_ * kt;
        const float* wgd = it.wgd_all + (g * ntiles + t) * it.nb * kt;
        for (int64_t b = 0; b < it.nb; ++b)
          for (int64_t c = 0; c < kt; ++c) {
            const int64_t u = b_lo_ + b + step_ * c;
            if (u >= ulo && u <= uhi) wq[u * kt + c] += wgd[b * kt + c];
          }
        // W's rows past uhi are zero: rounding the rows up to 4 adds nothing.
        const float* wpq = it.wpq_all + (g * ntiles + t) * span2s_ * kt + ulo * kt;
        ScoresTile(pq_t_.get() + (hk * group_ + g) * dimr_ * span2r_ + ulo, uhi - ulo + 1, wpq,
                   dimr_, dk_all + t * dp * kt, kt, span2r_, true);
        AccumulateTile(wpq, nk, kp_all + t * kt * dp, dp, dp, RoundUp(uhi - ulo + 1, 4),
                       part + part_pq_ + (g * span2s_ + ulo) * dp);
      }
    }
  }

 private:
  const FusedBackwardParams& b_;
  const FusedAttentionParams& p_;
  int64_t dim_ = 0, dpad_ = 0, dimr_ = 4, group_ = 1;
  int64_t span2_ = 0, span2r_ = 0, span2s_ = 0, part_pq_ = 0;
  RowTable pos_key_;  // scaled
  std::vector<int32_t> run_end_;
  std::vector<uint8_t> lin_;
  int64_t step_ = -1, b_lo_ = std::numeric_limits<int64_t>::max(), b_hi_ = -1;
  hwy::AlignedFreeUniquePtr<float[]> pq_pad_, pq_t_;  // pos_query, padded / transposed
};

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#endif  // include guard
