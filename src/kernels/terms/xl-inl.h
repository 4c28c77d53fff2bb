// src/kernels/terms/xl-inl.h - the fused kernels' terms for Transformer-XL
// (FusedAttentionParams::xl_sin, xl_rnet, xl_content_bias, xl_position_bias): the forward's
// row scores (attention_hwy.cc) and the backward's row scores and gradients
// (attention_backward_hwy.cc).
//
// s_ij = scale ((q_i + u) . k_j + (q_i + v) . r(delta)), r(delta) = W_r R(delta), delta =
// pos_q - pos_k at table row t = xl_dmax - delta. The kernels put q + u into the main product
// (AddBiases) and add the second product from r(t), which they project themselves.
// Forward (XlForward): r(t)^T tiles per head, and per item the band of scale (q + v) . r(t)
// over the distances its visible keys can have (XlBand), read by each row (XlRow) contiguously
// for consecutive key positions.
// Backward (XlBackward): r(t) as a row table of terms/row_tables-inl.h (row t), the sums of
// scale dS per distance row; du, dv and dr_net = dr^T R from them.
//
// Included once per target by the kernels' .cc files after hwy/foreach_target.h (the guard
// below re-expands for each target).
#if defined(POSENC_KERNELS_TERMS_XL_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef POSENC_KERNELS_TERMS_XL_INL_H_
#undef POSENC_KERNELS_TERMS_XL_INL_H_
#else
#define POSENC_KERNELS_TERMS_XL_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
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

// Row r of query head h (head_dim dim): qv = q + v, then q += u (in place).
inline void XlAddBiases(const FusedAttentionParams& p, int64_t h, int64_t dim, float* q,
                        float* qv) {
  for (int64_t c = 0; c < dim; ++c) {
    qv[c] = q[c] + p.xl_position_bias[h * dim + c];
    q[c] += p.xl_content_bias[h * dim + c];
  }
}

// ---- Forward ----

// An item's band: scale * (q_r + v) . r(t) for t in [t0, t0 + w) (whole tiles), rows ld floats
// apart (off a power of two: rows 2^k floats apart would share their cache sets).
struct XlBand {
  int64_t t0 = 0, w = 0, ld = 0;
};

class XlForward {
 public:
  // The tiles r(t)^T per head, scaled, that the per-item products read:
  //   r_t[h][t / kTileK][x][t % kTileK] = scale * (W_r R(t))[h * head_dim + x].
  // Computed as W_r (rows: features) times the transposed sinusoid tiles, so each product
  // writes its tile in place; the model dimension is split into chunks whose sinusoid block
  // stays in L1 while every feature row of the head passes over it.
  explicit XlForward(const FusedAttentionParams& p) : p_(p), dim_(p.head_dim) {
    const int64_t dm = p_.xl_dmodel;
    const int threads = resolve_threads(p_.num_threads);
    tiles_ = (p_.xl_len + kTileK - 1) / kTileK;
    dim4_ = RoundUp(dim_, 4);
    auto sin_t = hwy::AllocateAligned<float>(static_cast<size_t>(tiles_ * dm * kTileK));
    parallel_for(tiles_, threads, [&](int64_t tt) {
      const int64_t t0 = tt * kTileK, nt = std::min(kTileK, p_.xl_len - t0);
      TransposeTable(p_.xl_sin + t0 * dm, nt, dm, dm, p_.scale, sin_t.get() + tt * dm * kTileK);
    });
    // W_r rows per head, padded to a multiple of 4 rows when head_dim is not.
    const float* w = p_.xl_rnet;
    int64_t w_head = dim_ * dm;
    hwy::AlignedFreeUniquePtr<float[]> w_pad;
    if (dim4_ != dim_) {
      w_pad = hwy::AllocateAligned<float>(static_cast<size_t>(p_.heads_q * dim4_ * dm));
      std::fill(w_pad.get(), w_pad.get() + p_.heads_q * dim4_ * dm, 0.0f);
      for (int64_t h = 0; h < p_.heads_q; ++h) {
        std::memcpy(w_pad.get() + h * dim4_ * dm, w + h * dim_ * dm,
                    static_cast<size_t>(dim_ * dm) * sizeof(float));
      }
      w = w_pad.get();
      w_head = dim4_ * dm;
    }
    r_t_ = hwy::AllocateAligned<float>(static_cast<size_t>(p_.heads_q * tiles_ * Block()));
    constexpr int64_t kChunk = 128;  // model dimensions per pass: 128 x kTileK floats = 32 KiB
    parallel_for(p_.heads_q * tiles_, threads, [&](int64_t task) {
      const int64_t h = task / tiles_, tt = task % tiles_;
      float* out = r_t_.get() + task * Block();
      for (int64_t k0 = 0; k0 < dm; k0 += kChunk) {
        ScoresTile(w + h * w_head + k0, std::min(kChunk, dm - k0),
                   sin_t.get() + (tt * dm + k0) * kTileK, dim4_, out, kTileK, dm, k0 > 0);
      }
    });
  }

  // The band of an item whose visible distances are [dlo, dhi].
  XlBand Band(int64_t dlo, int64_t dhi) const {
    const int64_t t_lo = p_.xl_dmax - dhi, t_hi = p_.xl_dmax - dlo;
    const int64_t tile0 = std::clamp<int64_t>(t_lo / kTileK, 0, tiles_ - 1);
    const int64_t tile1 = std::clamp<int64_t>(t_hi / kTileK, tile0, tiles_ - 1);
    XlBand band;
    band.t0 = tile0 * kTileK;
    band.w = (tile1 - tile0 + 1) * kTileK;
    band.ld = band.w + 16;
    return band;
  }

  // The band of nq4 rows of query head h: g[r][t - t0] = scale * qv_r . r(t) (qv: q + v rows,
  // dim floats apart).
  void FillBand(int64_t h, const float* qv, int64_t nq4, const XlBand& band, float* g) const {
    const int64_t tile0 = band.t0 / kTileK, tile1 = tile0 + band.w / kTileK - 1;
    for (int64_t tt = tile0; tt <= tile1; ++tt) {
      ScoresTile(qv, dim_, r_t_.get() + (h * tiles_ + tt) * Block(), nq4, g + (tt - tile0) * kTileK,
                 band.ld);
    }
  }

 private:
  // Floats per (head, distance tile) block of r_t_: head_dim rows (padded to 4) of kTileK.
  int64_t Block() const { return dim4_ * kTileK; }

  const FusedAttentionParams& p_;
  int64_t dim_ = 0, tiles_ = 0, dim4_ = 0;
  hwy::AlignedFreeUniquePtr<float[]> r_t_;
};

// The term of one query row (query position qp) from its item's band. Holds scalars and
// pointers only.
struct XlRow {
  const float* g = nullptr;  // nullptr: no XL term
  int64_t off = 0;           // band column of key position 0
  int64_t w = 0;

  // band_g: the item's band (nullptr: none), r: the row slot.
  XlRow(const FusedAttentionParams& p, const float* band_g, const XlBand& band, int64_t r,
        int32_t qp) {
    if (band_g == nullptr) return;
    g = band_g + r * band.ld;
    off = p.xl_dmax - qp - band.t0;
    w = band.w;
  }

  // sv + scale * (q + v) . r(delta) of keys kp[c .. c + lanes); consec: kp[c + x] = kp[0] + c + x.
  template <class D>
  HWY_INLINE hn::Vec<D> Add(D d, hn::Vec<D> sv, const int32_t* kp, int64_t c, bool consec) const {
    const int64_t n = static_cast<int64_t>(hn::Lanes(d));
    const int64_t first = off + kp[c];
    if (consec && first >= 0 && first + n <= w) return hn::Add(sv, hn::LoadU(d, g + first));
    // Masked cells may fall outside the band: clamp (their score becomes -inf anyway).
    const hn::RebindToSigned<D> di;
    auto idx = hn::Add(hn::Load(di, kp + c), hn::Set(di, static_cast<int32_t>(off)));
    idx = hn::Min(hn::Max(idx, hn::Zero(di)), hn::Set(di, static_cast<int32_t>(w - 1)));
    return hn::Add(sv, hn::GatherIndex(d, g, idx));
  }
};

// ---- Backward ----

// Where block row r's terms lie on a key tile: table rows u0 + c of consecutive keys, fast when
// they all lie in the table (no clamping).
struct XlRowAt {
  int64_t u0 = 0;
  bool fast = false;
};

class XlBackward {
 public:
  explicit XlBackward(const FusedBackwardParams& b) : b_(b), p_(b.fwd), dim_(p_.head_dim) {
    hd_ = p_.heads_q * dim_;
    hdp_ = RoundUp(hd_, kTileK);
  }
  // Row-chunk buffers of the table: its chunks (one per kTileK distance rows).
  int64_t Chunks() const { return (p_.xl_len + kTileK - 1) / kTileK; }

  // The projected distances r(t) as a per-row table (row t = xl_dmax - delta), scaled for the
  // (q + v) . r(delta) products.
  void Prepare(const RowChunks& rc, int threads) {
    Project(threads);
    rc.MakeRowTable(r_tab_, r_.get(), p_.xl_len, p_.heads_q, p_.scale, hdp_, threads);
    r_.reset();
  }

  // The layout of an item's partial gradients from offset 0: du, dv of the group's heads, then
  // dr(t) (transposed, tchunk floats per head); returns their size.
  int64_t PlanParts(int64_t group, int64_t tchunk) {
    group_ = group;
    return 2 * group * dim_ + group * tchunk;
  }

  void ZeroGrads() {
    if (b_.xl_du != nullptr) std::fill(b_.xl_du, b_.xl_du + hd_, 0.0f);
    if (b_.xl_dv != nullptr) std::fill(b_.xl_dv, b_.xl_dv + hd_, 0.0f);
    dr_.assign(static_cast<size_t>(RoundUp(hd_, 4) * p_.xl_len), 0.0f);
  }

  // Item (kv head hk)'s partial gradients added into du, dv and dr(t).
  void Reduce(const RowChunks& rc, const float* part, int64_t hk) {
    auto add = [](const float* src, float* dst, int64_t n) {
      for (int64_t x = 0; x < n; ++x) dst[x] += src[x];
    };
    const int64_t gd = group_ * dim_, dimr = RoundUp(dim_, 4), nch = rc.Chunks();
    add(part, b_.xl_du + hk * gd, gd);
    add(part + gd, b_.xl_dv + hk * gd, gd);
    // dr(t) kept transposed, [heads * dim][len]: the partials' [ch][x][64] runs add as they
    // are, and it is the operand of ProjectGradient's product.
    const float* part_t = part + 2 * gd;
    for (int64_t g = 0; g < group_; ++g) {
      const int64_t th = hk * group_ + g;
      for (int64_t ch = 0; ch < nch; ++ch) {
        const int64_t n = std::min(kTileK, p_.xl_len - ch * kTileK);
        for (int64_t x = 0; x < dim_; ++x) {
          add(part_t + ((g * nch + ch) * dimr + x) * kTileK,
              dr_.data() + (th * dim_ + x) * p_.xl_len + ch * kTileK, n);
        }
      }
    }
  }

  // The chunks of distance rows the distances [dlo, dhi] use: t = xl_dmax - delta.
  void BlockChunks(int64_t dlo, int64_t dhi, BlockRows& br) const {
    br.c0 = std::clamp<int64_t>(p_.xl_dmax - dhi, 0, p_.xl_len - 1) / kTileK;
    br.c1 = std::clamp<int64_t>(p_.xl_dmax - dlo, 0, p_.xl_len - 1) / kTileK + 1;
  }

  // The block's projections: rel1 = scale (q + v) . r(t) (qx: the q + v rows).
  void Project(const RowChunks& rc, const float* qx, float* rel1, const BlockRows& br) const {
    rc.Project(r_tab_, qx, rel1, br);
  }

  // Row r (query position pq) on a tile of keys kpt (consec: consecutive positions).
  XlRowAt RowAt(int32_t pq, const int32_t* kpt, bool consec) const {
    XlRowAt at;
    at.u0 = int64_t{p_.xl_dmax} - pq + kpt[0];
    at.fast = consec && at.u0 >= 0 && at.u0 + kTileK <= p_.xl_len;
    return at;
  }

  // Row r's scores (srow) plus its projections at each key's distance row; addr: their
  // row-chunk addresses, for AddGrads (not set on the fast path).
  HWY_INLINE void AddScores(const RowChunks& rc, const XlRowAt& at, const int32_t* kpt, int32_t pq,
                            int64_t r, int64_t cs, const float* rel1, int32_t* addr,
                            float* srow) const {
    const DF d;
    const int64_t n = static_cast<int64_t>(hn::Lanes(d));
    if (at.fast) {
      // Consecutive keys whose distances all lie in the table (no clamping): the row's table
      // rows are u0 + c, so each vector's addresses are known without index vectors: one run,
      // or two across a row-chunk boundary.
      for (int64_t c = 0; c < kTileK; c += n) {
        const auto [a0, a1, k] = Runs(at.u0 + c, r, cs);
        auto v = hn::LoadU(d, rel1 + a0);
        if (k < n) {
          v = hn::IfThenElse(hn::FirstN(d, static_cast<size_t>(k)), v, hn::LoadU(d, rel1 + a1 - k));
        }
        hn::Store(hn::Add(hn::Load(d, srow + c), v), d, srow + c);
      }
      return;
    }
    const DI di;
    // r(t) covers the distances a mask leaves visible: masked cells (P = 0, dS = 0) read and
    // add to a clamped row.
    const auto off = hn::Set(di, static_cast<int32_t>(p_.xl_dmax - pq));
    const auto last = hn::Set(di, static_cast<int32_t>(p_.xl_len - 1));
    rc.AddRowScores(kpt, r, cs, rel1, nullptr, true, addr, srow, nullptr,
                    [&](int64_t, hn::Vec<DI> kpv) {
                      return hn::Min(hn::Max(hn::Add(kpv, off), hn::Zero(di)), last);
                    });
  }

  // Keys c .. c + lanes of the row: scale dS (sds) added to their distance rows' sums w1.
  HWY_INLINE void AddGrads(const RowChunks& rc, const XlRowAt& at, const int32_t* addr, int64_t r,
                           int64_t cs, int64_t c, hn::Vec<DF> sds, float* w1) const {
    const DF d;
    if (!at.fast) {
      rc.ScatterAdd(w1, addr + c, sds, true, true);
      return;
    }
    const auto [a0, a1, k] = Runs(at.u0 + c, r, cs);
    if (k >= static_cast<int64_t>(hn::Lanes(d))) {
      hn::StoreU(hn::Add(hn::LoadU(d, w1 + a0), sds), d, w1 + a0);
    } else {  // each element gets the same single addition
      const auto m = hn::FirstN(d, static_cast<size_t>(k));
      hn::BlendedStore(hn::Add(hn::LoadU(d, w1 + a0), sds), m, d, w1 + a0);
      float* t2 = w1 + a1 - k;
      hn::BlendedStore(hn::Add(hn::LoadU(d, t2), sds), hn::Not(m), d, t2);
    }
  }

  // After the block: dQ's r(delta) part dqr = w1 . r(t), dr(t) += w1^T (q + v) (qxtr: the q + v
  // rows transposed).
  void FinishBlock(const RowChunks& rc, const float* w1, const float* qxtr, float* dqr, float* part,
                   const BlockRows& br) const {
    rc.BackQ(r_tab_, w1, dqr, br);
    rc.BackTable(w1, qxtr, part + 2 * group_ * dim_, group_, br);
  }
  // Block row of group head g: du += its dQ (the k part), dv += dqr (the r part), dQ += dqr.
  void FinishRow(int64_t g, const float* dqr, float* dq, float* part) const {
    Axpy(1.0f, dq, part + g * dim_, dim_);                   // du: the k part
    Axpy(1.0f, dqr, part + group_ * dim_ + g * dim_, dim_);  // dv: the r part
    Axpy(1.0f, dqr, dq, dim_);
  }

  // dr_net[o][m] = sum_t dr(t)[o] R(t)[m] (ScoresTile: dr^T rows x tiles of R).
  void ProjectGradient(int threads) const {
    if (b_.xl_drnet == nullptr) return;
    const int64_t dm = p_.xl_dmodel, len = p_.xl_len;
    const int64_t mtiles = (dm + kTileK - 1) / kTileK, dmp = mtiles * kTileK;
    auto sin_t = hwy::AllocateAligned<float>(static_cast<size_t>(mtiles * len * kTileK));
    parallel_for(mtiles, threads, [&](int64_t mt) {
      float* dst = sin_t.get() + mt * len * kTileK;
      const int64_t m0 = mt * kTileK, nm = std::min(kTileK, dm - m0);
      for (int64_t t = 0; t < len; ++t) {
        std::memcpy(dst + t * kTileK, p_.xl_sin + t * dm + m0, static_cast<size_t>(nm) * 4);
        std::fill(dst + t * kTileK + nm, dst + (t + 1) * kTileK, 0.0f);
      }
    });
    const int64_t hd4 = RoundUp(hd_, 4);
    const float* dr_t = dr_.data();  // [hd4][len]
    auto out = hwy::AllocateAligned<float>(static_cast<size_t>(hd4 * dmp));
    const int64_t blocks = (hd4 + kTileK - 1) / kTileK;
    parallel_for(blocks * mtiles, threads, [&](int64_t w) {
      const int64_t o0 = (w / mtiles) * kTileK, mt = w % mtiles;
      const int64_t rows = std::min(kTileK, hd4 - o0);
      for (int64_t t0 = 0; t0 < len; t0 += kReduceChunk) {  // as in Project
        ScoresTile(dr_t + o0 * len + t0, std::min(kReduceChunk, len - t0),
                   sin_t.get() + (mt * len + t0) * kTileK, rows, out.get() + o0 * dmp + mt * kTileK,
                   dmp, len, t0 > 0);
      }
    });
    for (int64_t o = 0; o < hd_; ++o)
      std::memcpy(b_.xl_drnet + o * dm, out.get() + o * dmp, static_cast<size_t>(dm) * 4);
  }

 private:
  // Reduction chunk of the projections' products (64 KiB of a 64-column operand).
  static constexpr int64_t kReduceChunk = 256;

  // Table rows u .. u + lanes - 1 of block row r in the row-chunk buffers: the address of u, the
  // address of the next chunk's row r, and how many lanes lie in u's chunk.
  struct Run {
    int64_t a0, a1, k;
  };
  static HWY_INLINE Run Runs(int64_t u, int64_t r, int64_t cs) {
    const int64_t ch = u / kTileK, off = u % kTileK;
    return {ch * cs + r * kTileK + off, (ch + 1) * cs + r * kTileK, kTileK - off};
  }

  // r(t) = W_r R(t) for every distance row t, [xl_len, hdp] (ScoresTile: sinusoid rows x tiles
  // of W_r^T).
  void Project(int threads) {
    const int64_t dm = p_.xl_dmodel, len = p_.xl_len;
    const int64_t otiles = hdp_ / kTileK;
    rnet_t_ = hwy::AllocateAligned<float>(static_cast<size_t>(otiles * dm * kTileK));
    parallel_for(otiles, threads, [&](int64_t ot) {
      float* dst = rnet_t_.get() + ot * dm * kTileK;
      std::fill(dst, dst + dm * kTileK, 0.0f);
      for (int64_t o = ot * kTileK; o < std::min(hd_, (ot + 1) * kTileK); ++o)
        for (int64_t m = 0; m < dm; ++m) dst[m * kTileK + o % kTileK] = p_.xl_rnet[o * dm + m];
    });
    const int64_t lenp = RoundUp(len, 4);
    sin_pad_ = hwy::AllocateAligned<float>(static_cast<size_t>(lenp * dm));
    std::memcpy(sin_pad_.get(), p_.xl_sin, static_cast<size_t>(len * dm) * sizeof(float));
    std::fill(sin_pad_.get() + len * dm, sin_pad_.get() + lenp * dm, 0.0f);
    r_ = hwy::AllocateAligned<float>(static_cast<size_t>(lenp * hdp_));
    const int64_t blocks = (lenp + kTileK - 1) / kTileK;
    parallel_for(blocks * otiles, threads, [&](int64_t w) {
      const int64_t t0 = (w / otiles) * kTileK, ot = w % otiles;
      const int64_t rows = std::min(kTileK, lenp - t0);
      // The reduction in chunks (accumulating: the same sums in the same order) so that the
      // chunk of W_r^T every 4-row strip reads stays in cache.
      for (int64_t m0 = 0; m0 < dm; m0 += kReduceChunk) {
        ScoresTile(sin_pad_.get() + t0 * dm + m0, std::min(kReduceChunk, dm - m0),
                   rnet_t_.get() + (ot * dm + m0) * kTileK, rows,
                   r_.get() + t0 * hdp_ + ot * kTileK, hdp_, dm, m0 > 0);
      }
    });
  }

  const FusedBackwardParams& b_;
  const FusedAttentionParams& p_;
  int64_t dim_ = 0, group_ = 1, hd_ = 0, hdp_ = 0;
  RowTable r_tab_;  // r(t), scaled
  std::vector<float> dr_;
  hwy::AlignedFreeUniquePtr<float[]> rnet_t_, sin_pad_, r_;
};

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#endif  // include guard
