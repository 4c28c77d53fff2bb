// src/kernels/terms/shaw-inl.h - the fused kernels' terms for Shaw's relative keys and values
// (FusedAttentionParams::shaw_rel_k, shaw_rel_v): the forward's row scores and value term
// (attention_hwy.cc) and the backward's row scores and gradients (attention_backward_hwy.cc).
//
// Key term: s_ij += scale * q_i . rel_k[u], value term: out_i += sum_j P_ij rel_v[u], for the
// bucket u = clamp(pos_k - pos_q, -K, K) + K of 2K + 1.
// Forward: per item, each row's projections onto the 2K + 1 rows of rel_k, stored as a band
// (ShawBands) so that a tile of consecutive key positions reads a contiguous run; the value
// term as per-bucket sums of P (ShawWeights), applied once the row is done.
// Backward (ShawBackward): the row tables of terms/row_tables-inl.h, one row per bucket.
//
// Included once per target by the kernels' .cc files after hwy/foreach_target.h (the guard
// below re-expands for each target).
#if defined(POSENC_KERNELS_TERMS_SHAW_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef POSENC_KERNELS_TERMS_SHAW_INL_H_
#undef POSENC_KERNELS_TERMS_SHAW_INL_H_
#else
#define POSENC_KERNELS_TERMS_SHAW_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

#include "hwy/highway.h"
#include "kernels/attention-inl.h"
#include "kernels/attention_kernels.h"
#include "kernels/terms/row_tables-inl.h"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// ---- Forward ----

// Per item, row r's band: band[r][u] = scale * q_r . rel_k[clamp(u - kTileK - K) + K] for
// u < 2K + 1 + 2 kTileK (Width), so that for a tile whose first relative position is rel0 the
// values are a contiguous run from u = rel0 + K + kTileK whenever the whole tile lies in
// [-K - kTileK, K + kTileK].
struct ShawBands {
  static int64_t Width(const FusedAttentionParams& p) { return 2 * p.shaw_k + 1 + 2 * kTileK; }

  // The bands of `rows` row slots (q rows dim floats apart, bands w = Width floats apart);
  // head_of(r): row r's query head, or -1 for a padding slot (skipped).
  template <class HeadOf>
  static void Fill(const FusedAttentionParams& p, int64_t rows, const float* q, int64_t dim,
                   float* band, const HeadOf& head_of) {
    const int64_t kk = p.shaw_k, w = Width(p);
    std::vector<float> proj(static_cast<size_t>(2 * kk + 1));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t hr = head_of(r);
      if (hr < 0) continue;
      const int64_t h = p.shaw_rel_k_heads == 1 ? 0 : hr;
      for (int64_t u = 0; u <= 2 * kk; ++u) {
        const float* rk = p.shaw_rel_k + (u * p.shaw_rel_k_heads + h) * dim;
        proj[static_cast<size_t>(u)] = Dot(q + r * dim, rk, dim) * p.scale;
      }
      float* row = band + r * w;
      for (int64_t u = 0; u < w; ++u) {
        const int64_t rel = std::clamp<int64_t>(u - kTileK - kk, -kk, kk);
        row[u] = proj[static_cast<size_t>(rel + kk)];
      }
    }
  }
};

// The key term of one query row (query position qp) from its band. Holds scalars and pointers
// only.
struct ShawRow {
  const float* row = nullptr;  // nullptr: no Shaw term
  int64_t kk = 0, w = 0;
  int32_t qp = 0;

  // band: the item's bands (nullptr: none), r: the row slot.
  ShawRow(const FusedAttentionParams& p, const float* band, int64_t r, int32_t pos_q) {
    if (band == nullptr) return;
    kk = p.shaw_k;
    w = ShawBands::Width(p);
    row = band + r * w;
    qp = pos_q;
  }

  // sv + the term of keys kp[c .. c + lanes); consec: kp[c + x] = kp[0] + c + x.
  template <class D>
  HWY_INLINE hn::Vec<D> Add(D d, hn::Vec<D> sv, const int32_t* kp, int64_t c, bool consec) const {
    const int64_t n = static_cast<int64_t>(hn::Lanes(d));
    if (consec) {
      const int64_t rel0 = int64_t{kp[0]} - qp + c;
      const int64_t u = std::clamp<int64_t>(rel0 + kk + kTileK, 0, w - n);
      if (rel0 >= kk) return hn::Add(sv, hn::Set(d, row[w - 1]));
      if (rel0 + n - 1 <= -kk) return hn::Add(sv, hn::Set(d, row[0]));
      return hn::Add(sv, hn::LoadU(d, row + u));
    }
    alignas(64) float extra[16];
    for (int64_t x = 0; x < n; ++x) {
      const int64_t rel = std::clamp<int64_t>(int64_t{kp[c + x]} - qp, -kk, kk);
      extra[x] = row[rel + kk + kTileK];
    }
    return hn::Add(sv, hn::Load(d, extra));
  }
};

// The value term of one query row: per bucket, the sum of the row's (unnormalized) P, kept
// relative to the row's running maximum like O.
struct ShawWeights {
  float* w;  // 2K + 1 floats
  int64_t kk;

  ShawWeights(const FusedAttentionParams& p, float* wsum, int64_t r)
      : w(wsum + r * (2 * p.shaw_k + 1)), kk(p.shaw_k) {}

  // The running maximum rose: the sums scaled by corr like O.
  void Rescale(float corr) const {
    for (int64_t u = 0; u <= 2 * kk; ++u) w[u] *= corr;
  }

  // P of the tile's keys kp[c], c < nk (s: the row's exponentials, their sum tile_sum) added to
  // their buckets; a tile of consecutive positions wholly past the clipping adds to one bucket.
  void Add(const int32_t* kp, int32_t qp, int64_t nk, bool consec, float tile_sum,
           const float* s) const {
    const int64_t rel_lo = int64_t{kp[0]} - qp, rel_hi = int64_t{kp[nk - 1]} - qp;
    if (consec && (rel_lo >= kk || rel_hi <= -kk)) {
      w[rel_lo >= kk ? 2 * kk : 0] += tile_sum;
    } else {
      for (int64_t c = 0; c < nk; ++c) {
        const int64_t rel = std::clamp<int64_t>(int64_t{kp[c]} - qp, -kk, kk);
        w[rel + kk] += s[c];
      }
    }
  }

  // O += sum_u w[u] rel_v[u] of query head h, vectorized over head_dim (O's row dpad wide).
  void AddValues(const FusedAttentionParams& p, int64_t h, int64_t dim, float* orow) const {
    const int64_t th = p.shaw_rel_v_heads == 1 ? 0 : h;
    const DF d;
    const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
    const int64_t dv = dim / lanes * lanes;
    for (int64_t u = 0; u <= 2 * kk; ++u) {
      if (w[u] == 0.0f) continue;
      const float* rv = p.shaw_rel_v + (u * p.shaw_rel_v_heads + th) * dim;
      const auto wv = hn::Set(d, w[u]);
      for (int64_t x = 0; x < dv; x += lanes) {
        hn::Store(hn::MulAdd(wv, hn::LoadU(d, rv + x), hn::Load(d, orow + x)), d, orow + x);
      }
      for (int64_t x = dv; x < dim; ++x) orow[x] += w[u] * rv[x];
    }
  }
};

// ---- Backward ----

// Per query block, the rows' projections onto rel_k (scaled) and, with the value term, dout's
// onto rel_v; per bucket, the sums of scale dS (and of P) the row's cells add. After the block:
// dQ += sums . rel_k, drel_k += sums^T Q, drel_v += P-sums^T dO.
class ShawBackward {
 public:
  ShawBackward(const FusedBackwardParams& b, const RowChunks& rc) : b_(b), p_(b.fwd) {
    nrel_ = 2 * p_.shaw_k + 1;
    rc.MakeRowTable(relk_, p_.shaw_rel_k, nrel_, p_.shaw_rel_k_heads, p_.scale);
    if (p_.shaw_rel_v != nullptr) {
      rc.MakeRowTable(relv_, p_.shaw_rel_v, nrel_, p_.shaw_rel_v_heads, 1);
    }
  }
  // Row-chunk buffers of the table: its chunks.
  int64_t Chunks() const { return relk_.nch; }

  // The layout of an item's partial gradients from offset 0 (tchunk: floats of one head's
  // transposed table gradient): drel_k's, then drel_v's; returns their size.
  int64_t PlanParts(int64_t group, int64_t tchunk) {
    k_heads_ = p_.shaw_rel_k_heads == 1 ? 1 : group;
    part_relk_ = 0;
    int64_t size = k_heads_ * tchunk;
    if (b_.shaw_drel_v != nullptr) {
      v_heads_ = p_.shaw_rel_v_heads == 1 ? 1 : group;
      part_relv_ = size;
      size += v_heads_ * tchunk;
    }
    return size;
  }

  void ZeroGrads(int64_t dim) const {
    if (b_.shaw_drel_k != nullptr) {
      std::fill(b_.shaw_drel_k, b_.shaw_drel_k + nrel_ * p_.shaw_rel_k_heads * dim, 0.0f);
    }
    if (b_.shaw_drel_v != nullptr) {
      std::fill(b_.shaw_drel_v, b_.shaw_drel_v + nrel_ * p_.shaw_rel_v_heads * dim, 0.0f);
    }
  }

  // Item (kv head hk)'s partial gradients added into drel_k, drel_v.
  void Reduce(const RowChunks& rc, const float* part, int64_t hk) const {
    rc.AddTransposed(part + part_relk_, b_.shaw_drel_k, nrel_, p_.shaw_rel_k_heads, k_heads_, hk);
    if (b_.shaw_drel_v != nullptr) {
      rc.AddTransposed(part + part_relv_, b_.shaw_drel_v, nrel_, p_.shaw_rel_v_heads, v_heads_, hk);
    }
  }

  // The chunks of buckets the distances [dlo, dhi] use: u = clamp(-delta, -K, K) + K.
  void BlockChunks(int64_t dlo, int64_t dhi, BlockRows& br) const {
    const int64_t k = p_.shaw_k;
    br.c0 = (std::clamp<int64_t>(-dhi, -k, k) + k) / kTileK;
    br.c1 = (std::clamp<int64_t>(-dlo, -k, k) + k) / kTileK + 1;
  }

  // The block's projections: rel1 = scale q . rel_k, rel2 = dout . rel_v.
  void Project(const RowChunks& rc, const float* qb, const float* dob, float* rel1, float* rel2,
               const BlockRows& br) const {
    rc.Project(relk_, qb, rel1, br);
    if (p_.shaw_rel_v != nullptr) rc.Project(relv_, dob, rel2, br);
  }

  // Row r's scores (srow) and dP (drow) plus its projections at each key's bucket (query
  // position pq); addr: the buckets' row-chunk addresses, for Grads.
  HWY_INLINE void AddScores(const RowChunks& rc, const int32_t* kpt, int32_t pq, int64_t r,
                            int64_t cs, const float* rel1, const float* rel2, int32_t* addr,
                            float* srow, float* drow) const {
    const DI di;
    const auto vpq = hn::Set(di, pq);
    const auto k = hn::Set(di, static_cast<int32_t>(p_.shaw_k));
    rc.AddRowScores(kpt, r, cs, rel1, p_.shaw_rel_v != nullptr ? rel2 : nullptr, true, addr, srow,
                    drow, [&](int64_t, hn::Vec<DI> kpv) {
                      return hn::Min(hn::Max(hn::Add(hn::Sub(kpv, vpq), k), hn::Zero(di)),
                                     hn::Add(k, k));
                    });
  }

  // Keys c .. c + lanes of the row: scale dS (sds) and P (srow) added to their buckets' sums
  // w1, w2.
  HWY_INLINE void AddGrads(const RowChunks& rc, const int32_t* addr, int64_t c, hn::Vec<DF> sds,
                           const float* srow, float* w1, float* w2) const {
    rc.ScatterAdd(w1, addr + c, sds, false, true);
    if (b_.shaw_drel_v != nullptr) rc.ScatterAdd(w2, addr + c, hn::Load(DF(), srow + c), true);
  }

  // After the block: dQ += w1 . rel_k, and the tables' gradients from the bucket sums.
  void FinishBlock(const RowChunks& rc, const float* w1, const float* w2, const float* qtr,
                   const float* dotr, float* dqb, float* part, const BlockRows& br) const {
    rc.BackQ(relk_, w1, dqb, br);
    rc.BackTable(w1, qtr, part + part_relk_, k_heads_, br);
    if (b_.shaw_drel_v != nullptr) rc.BackTable(w2, dotr, part + part_relv_, v_heads_, br);
  }

 private:
  const FusedBackwardParams& b_;
  const FusedAttentionParams& p_;
  int64_t nrel_ = 0;
  RowTable relk_, relv_;  // rel_k (scaled), rel_v
  int64_t k_heads_ = 1, v_heads_ = 1, part_relk_ = 0, part_relv_ = 0;
};

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#endif  // include guard
