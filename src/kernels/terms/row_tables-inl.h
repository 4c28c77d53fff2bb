// src/kernels/terms/row_tables-inl.h - what the relative-table terms (Shaw, DeBERTa's c2p,
// Transformer-XL's r(delta); terms/shaw-inl.h, deberta-inl.h, xl-inl.h) share in the fused
// kernels.
//
// Forward (attention_hwy.cc): TransposeTable, a fixed table as ScoresTile's "keys" operand.
// Backward (attention_backward_hwy.cc): per query block, each row's projections onto the table
// rows its cells can reach and the sums of scale dS per table row are kept in row-chunk buffers
// ([nch][rows][kTileK]); RowChunks forms the tables (RowTable), the projections (Project), and
// the gradients they pass on (BackQ, BackTable), and reads and adds to the buffers one vector of
// a row's keys at a time (GatherRows, ScatterAdd; GatherTileRows and ScatterAddTileRows for
// DeBERTa's per-tile p2c products).
//
// Included once per target by the kernels' .cc files after hwy/foreach_target.h (the guard
// below re-expands for each target).
#if defined(POSENC_KERNELS_TERMS_ROW_TABLES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef POSENC_KERNELS_TERMS_ROW_TABLES_INL_H_
#undef POSENC_KERNELS_TERMS_ROW_TABLES_INL_H_
#else
#define POSENC_KERNELS_TERMS_ROW_TABLES_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "kernels/attention-inl.h"
#include "kernels/parallel.h"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Row-major [rows, dim] -> column tiles [tiles][dim][kTileK] scaled by `scale` (zero padded):
// the "keys" operand of ScoresTile for a fixed table (the forward's DeBERTa pos_key, XL's
// r(delta)).
inline void TransposeTable(const float* rows, int64_t n, int64_t row_stride, int64_t dim,
                           float scale, float* out) {
  const int64_t tiles = (n + kTileK - 1) / kTileK;
  std::fill(out, out + tiles * dim * kTileK, 0.0f);
  for (int64_t u = 0; u < n; ++u) {
    float* t = out + (u / kTileK) * dim * kTileK + u % kTileK;
    for (int64_t x = 0; x < dim; ++x) t[x * kTileK] = rows[u * row_stride + x] * scale;
  }
}

// y[0, n) += a * x[0, n).
HWY_INLINE void Axpy(float a, const float* HWY_RESTRICT x, float* HWY_RESTRICT y, int64_t n) {
  const DF d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const auto va = hn::Set(d, a);
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    hn::StoreU(hn::MulAdd(va, hn::LoadU(d, x + i), hn::LoadU(d, y + i)), d, y + i);
  }
  for (; i < n; ++i) y[i] += a * x[i];
}

// A per-row table (Shaw's rel_k, rel_v; DeBERTa's pos_key; XL's r(t)): rows u < n of
// [n, heads, dim], padded to dpad per head (pad[h][u], the rows AccumulateTile reads: a head's
// rows adjacent, not heads x dpad floats apart, which at 8 heads of 128 put every row on the
// same cache sets) and transposed in chunks of kTileK rows times `scale` (the operand ScoresTile
// reads): tr[h][ch][x][u % kTileK].
struct RowTable {
  int64_t n = 0, heads = 1, nch = 0;
  hwy::AlignedFreeUniquePtr<float[]> pad, tr;
};

// Row-chunk buffers ([nch][rs][kTileK], rs rows per chunk) hold one value per (row, table row):
// projections and bucket sums. A block's rows are the group's heads, nq rows each.
struct BlockRows {
  int64_t rows, rp, nq, hk, cs;  // cs = rs * kTileK
  int64_t c0, c1;                // the chunks of table rows the block's cells can use
};

// The backward's row tables and row-chunk buffers for head_dim dim (dpad: rows of the
// transposed tile operands, dimr = dim rounded up to 4) and `group` query heads per kv head.
class RowChunks {
 public:
  RowChunks() = default;
  RowChunks(int64_t dim, int64_t dpad, int64_t group)
      : lanes_(static_cast<int64_t>(hn::Lanes(DF()))),
        dim_(dim),
        dpad_(dpad),
        dimr_(RoundUp(dim, 4)),
        group_(group) {}
  // Chunks of the partial table gradients (BackTable, AddTransposed): the table's.
  void SetChunks(int64_t nch) { nch_ = nch; }
  int64_t Chunks() const { return nch_; }
  // Floats of one head's transposed table gradient.
  int64_t ChunkFloats() const { return nch_ * dimr_ * kTileK; }

  void MakeRowTable(RowTable& t, const float* src, int64_t n, int64_t heads, float scale,
                    int64_t src_row_stride = 0, int threads = 1) const {
    if (src_row_stride == 0) src_row_stride = heads * dim_;
    t.n = n, t.heads = heads, t.nch = (n + kTileK - 1) / kTileK;
    t.pad = hwy::AllocateAligned<float>(static_cast<size_t>(n * heads * dpad_));
    t.tr = hwy::AllocateAligned<float>(static_cast<size_t>(heads * t.nch * dim_ * kTileK));
    // One chunk of kTileK rows of one head per work item (XL's table is MBs).
    parallel_for(heads * t.nch, threads, [&](int64_t w) {
      const int64_t h = w / t.nch, ch = w % t.nch;
      float* tr = t.tr.get() + (h * t.nch + ch) * dim_ * kTileK;
      std::fill(tr, tr + dim_ * kTileK, 0.0f);
      for (int64_t u = ch * kTileK; u < std::min(n, (ch + 1) * kTileK); ++u) {
        const float* row = src + u * src_row_stride + h * dim_;
        float* pad = t.pad.get() + (h * n + u) * dpad_;
        std::memcpy(pad, row, static_cast<size_t>(dim_) * sizeof(float));
        std::fill(pad + dim_, pad + dpad_, 0.0f);
        for (int64_t x = 0; x < dim_; ++x) tr[x * kTileK + u % kTileK] = scale * row[x];
      }
    });
  }

  // out[r][u] = x_r . t.tr[u] (scaled table rows) for the block's rows (x rows dpad apart).
  void Project(const RowTable& t, const float* x, float* out, const BlockRows& br) const {
    if (t.heads == 1) {
      for (int64_t ch = br.c0; ch < br.c1; ++ch) {
        ScoresTile(x, dim_, t.tr.get() + ch * dim_ * kTileK, br.rp, out + ch * br.cs, kTileK,
                   dpad_);
      }
      return;
    }
    // Per head: rounding the rows up to 4 spills into the next head's rows (written after) or
    // into the buffers' spare rows.
    for (int64_t g = 0; g < group_; ++g) {
      const int64_t th = br.hk * group_ + g;
      for (int64_t ch = br.c0; ch < br.c1; ++ch) {
        ScoresTile(x + g * br.nq * dpad_, dim_, t.tr.get() + (th * t.nch + ch) * dim_ * kTileK,
                   RoundUp(br.nq, 4), out + ch * br.cs + g * br.nq * kTileK, kTileK, dpad_);
      }
    }
  }

  // dq[r] += sum_u w[r][u] t.pad[u] for the block's rows.
  void BackQ(const RowTable& t, const float* w, float* dq, const BlockRows& br) const {
    auto tile = [&](int64_t th, int64_t r0, int64_t nrows) {
      const int64_t r4 = nrows / 4 * 4;
      for (int64_t ch = br.c0; ch < br.c1; ++ch) {
        const int64_t ncol = std::min(kTileK, t.n - ch * kTileK);
        const float* tab = t.pad.get() + (th * t.n + ch * kTileK) * dpad_;
        const float* wc = w + ch * br.cs + r0 * kTileK;
        if (r4 > 0) {
          AccumulateTile(wc, ncol, tab, dpad_, dpad_, r4, dq + r0 * dpad_, kTileK, dpad_);
        }
        for (int64_t r = r4; r < nrows; ++r)
          for (int64_t u = 0; u < ncol; ++u) {
            const float a = wc[r * kTileK + u];
            if (a != 0.0f) Axpy(a, tab + u * dpad_, dq + (r0 + r) * dpad_, dim_);
          }
      }
    };
    if (t.heads == 1) {
      tile(0, 0, br.rp);
    } else {
      for (int64_t g = 0; g < group_; ++g) tile(br.hk * group_ + g, g * br.nq, br.nq);
    }
  }

  // part_t[g][ch][x][u] += sum_r xt[x][r] w[r][u]: the table's gradient, transposed (xt: the
  // block's rows transposed, [dpad x rp]). part_heads: 1 for a shared table, else the group.
  void BackTable(const float* w, const float* xt, float* part_t, int64_t part_heads,
                 const BlockRows& br) const {
    for (int64_t g = 0; g < part_heads; ++g) {
      const int64_t r0 = part_heads == 1 ? 0 : g * br.nq;
      const int64_t nr = part_heads == 1 ? br.rp : br.nq;
      for (int64_t ch = br.c0; ch < br.c1; ++ch) {
        ScoresTile(xt + r0, nr, w + ch * br.cs + r0 * kTileK, dimr_,
                   part_t + (g * nch_ + ch) * dimr_ * kTileK, kTileK, br.rp, true);
      }
    }
  }

  // A partial table gradient part_t [part_heads][nch][dimr][kTileK] (transposed, of kv head hk's
  // group) added into out [n][heads][dim] (heads: 1 for a shared table).
  void AddTransposed(const float* part_t, float* out, int64_t n, int64_t heads, int64_t part_heads,
                     int64_t hk) const {
    for (int64_t g = 0; g < part_heads; ++g) {
      const int64_t th = heads == 1 ? 0 : hk * group_ + g;
      for (int64_t u = 0; u < n; ++u) {
        const float* src = part_t + ((g * nch_ + u / kTileK) * dimr_) * kTileK + u % kTileK;
        float* dst = out + (u * heads + th) * dim_;
        for (int64_t x = 0; x < dim_; ++x) dst[x] += src[x * kTileK];
      }
    }
  }

  HWY_INLINE bool Consecutive(const int32_t* a) const {
    const DI di;
    return hn::AllTrue(di, hn::Eq(hn::Load(di, a), hn::Iota(di, a[0])));
  }
  // Row-chunk buffers (rel1, w1, ...: [nch][rows][kTileK]): a run of consecutive table rows u
  // that crosses a chunk boundary is two consecutive address runs, lanes [0, k) and [k, n). Sets
  // k and returns true for that case (a[k] >= k, so both runs' full-vector loads stay inside the
  // buffer: a chunk ends with spare rows and the second run starts a row of the next chunk).
  HWY_INLINE bool TwoRuns(const int32_t* a, int64_t& k) const {
    const DI di;
    const auto av = hn::Load(di, a);
    const auto first = hn::Eq(av, hn::Iota(di, a[0]));
    const intptr_t split = hn::FindFirstTrue(di, hn::Not(first));
    if (split <= 0) return false;
    k = split;
    if (a[k] < k) return false;
    const auto second = hn::Eq(av, hn::Iota(di, a[k] - static_cast<int32_t>(k)));
    return hn::AllTrue(di, hn::Or(hn::FirstN(di, static_cast<size_t>(k)), second));
  }
  // Descending addresses a[l] = a[0] - l from a[0] >= lanes - 1 (DeBERTa's c2p rows fall as the
  // key positions rise): one reversed run from a[0] - lanes + 1, every address a lane's own.
  HWY_INLINE bool Descending(hn::Vec<DI> av, int32_t a0) const {
    const DI di;
    return a0 >= lanes_ - 1 &&
           hn::AllTrue(di, hn::Eq(hn::Add(av, hn::Iota(di, 0)), hn::Set(di, a0)));
  }
  // GatherAt for a row-chunk buffer: also one blend of two loads for two runs, and one reversed
  // load for a descending run.
  // rising = false: the addresses never rise (DeBERTa's c2p rows), the rising cases are not tested.
  HWY_INLINE hn::Vec<DF> GatherRows(const float* table, const int32_t* a,
                                    bool rising = true) const {
    const DF d;
    const DI di;
    const auto av = hn::Load(di, a);
    if (rising && hn::AllTrue(di, hn::Eq(av, hn::Iota(di, a[0])))) {
      return hn::LoadU(d, table + a[0]);
    }
    if (hn::AllTrue(di, hn::Eq(av, hn::Set(di, a[0])))) return hn::Set(d, table[a[0]]);
    if (Descending(av, a[0])) return hn::Reverse(d, hn::LoadU(d, table + a[0] - (lanes_ - 1)));
    int64_t k = 0;
    if (rising && TwoRuns(a, k)) {
      return hn::IfThenElse(hn::FirstN(d, static_cast<size_t>(k)), hn::LoadU(d, table + a[0]),
                            hn::LoadU(d, table + a[k] - k));
    }
    return hn::GatherIndex(d, table, av);
  }

  // A [rows][kTileK] tile (DeBERTa's kpq and W) at the addresses a[l] = u_l kTileK + c0 + l of
  // one vector of a tile row's keys (c0 = a[0] mod kTileK). Over consecutive keys the rows u_l
  // run monotonically from u_0 to u_last; when they span at most kMaxRows rows, one masked load
  // (or read-modify-write) per row replaces the gather (scatter), the rows independent of one
  // another. Otherwise a gather / scatter.
  static constexpr int32_t kMaxRows = 16;
  HWY_INLINE bool FewRows(hn::Vec<DI> u, const int32_t* a, int32_t& lo, int32_t& hi) const {
    const DI di;
    lo = std::min(a[0], a[lanes_ - 1]) >> 6;
    hi = std::max(a[0], a[lanes_ - 1]) >> 6;
    return hi - lo < kMaxRows && hn::AllTrue(di, hn::And(hn::Not(hn::Lt(u, hn::Set(di, lo))),
                                                         hn::Not(hn::Gt(u, hn::Set(di, hi)))));
  }
  HWY_INLINE hn::Vec<DF> GatherTileRows(const float* tile, const int32_t* a) const {
    const DF d;
    const DI di;
    const auto av = hn::Load(di, a);
    const auto u = hn::ShiftRight<6>(av);
    int32_t lo = 0, hi = 0;
    if (!FewRows(u, a, lo, hi)) return hn::GatherIndex(d, tile, av);
    const int64_t c0 = a[0] & (kTileK - 1);
    auto out = hn::LoadU(d, tile + lo * kTileK + c0);
    for (int32_t ul = lo + 1; ul <= hi; ++ul) {
      out = hn::IfThenElse(hn::RebindMask(d, hn::Eq(u, hn::Set(di, ul))),
                           hn::LoadU(d, tile + ul * kTileK + c0), out);
    }
    return out;
  }
  // tile[a[l]] += v[l] for the same addresses (distinct: each element gets one addition).
  HWY_INLINE void ScatterAddTileRows(float* tile, const int32_t* a, hn::Vec<DF> v) const {
    const DF d;
    const DI di;
    const auto av = hn::Load(di, a);
    const auto u = hn::ShiftRight<6>(av);
    int32_t lo = 0, hi = 0;
    if (!FewRows(u, a, lo, hi)) {
      hn::ScatterIndex(hn::Add(hn::GatherIndex(d, tile, av), v), d, tile, av);
      return;
    }
    const int64_t c0 = a[0] & (kTileK - 1);
    for (int32_t ul = lo; ul <= hi; ++ul) {
      float* p = tile + ul * kTileK + c0;
      hn::BlendedStore(hn::Add(hn::LoadU(d, p), v), hn::RebindMask(d, hn::Eq(u, hn::Set(di, ul))),
                       d, p);
    }
  }

  // table[a[l]] += v[l] for the lanes of one vector: one sum when every lane has the same index.
  // Consecutive ascending addresses (a linear stretch of a bucket table, or XL's distances) are
  // one vector load and store.
  // rows: `table` is a row-chunk buffer (two-run addresses allowed, see TwoRuns). rising = false:
  // the addresses never rise (DeBERTa's c2p rows), the rising cases are not tested.
  HWY_INLINE void ScatterAdd(float* table, const int32_t* a, hn::Vec<DF> v, bool rows = false,
                             bool rising = true) const {
    const DF d;
    const DI di;
    const auto av = hn::Load(di, a);
    if (hn::AllTrue(di, hn::Eq(av, hn::Set(di, a[0])))) {
      table[a[0]] += hn::GetLane(hn::SumOfLanes(d, v));
      return;
    }
    if (rising && Consecutive(a)) {
      hn::StoreU(hn::Add(hn::LoadU(d, table + a[0]), v), d, table + a[0]);
      return;
    }
    if (Descending(av, a[0])) {
      float* t0 = table + a[0] - (lanes_ - 1);
      hn::StoreU(hn::Add(hn::LoadU(d, t0), hn::Reverse(d, v)), d, t0);
      return;
    }
    int64_t k = 0;
    if (rising && rows && TwoRuns(a, k)) {  // each element gets the same single addition
      const auto m = hn::FirstN(d, static_cast<size_t>(k));
      hn::BlendedStore(hn::Add(hn::LoadU(d, table + a[0]), v), m, d, table + a[0]);
      float* t2 = table + a[k] - k;
      hn::BlendedStore(hn::Add(hn::LoadU(d, t2), v), hn::Not(m), d, t2);
      return;
    }
    HWY_ALIGN float tmp[HWY_MAX_BYTES / sizeof(float)];
    hn::Store(v, d, tmp);
    for (int64_t l = 0; l < lanes_; ++l) table[a[l]] += tmp[l];
  }

  // Scores of block row r (srow; drow: its dP) plus the row's projections at each key's table
  // row, u = rows_of(c, key positions of c .. c + lanes), vector by vector (addresses into addr):
  // srow += rel1[u] (and drow += rel2[u] for Shaw's value term when rel2 is set). rows_of may add
  // terms of its own to srow first (DeBERTa's p2c).
  template <class RowsOf>
  HWY_INLINE void AddRowScores(const int32_t* kpt, int64_t r, int64_t cs, const float* rel1,
                               const float* rel2, bool rising, int32_t* addr, float* srow,
                               float* drow, const RowsOf& rows_of) const {
    const DF d;
    const DI di;
    const auto vrow = hn::Set(di, static_cast<int32_t>(r * kTileK));
    const auto vcs = hn::Set(di, static_cast<int32_t>(cs));
    const auto v63 = hn::Set(di, static_cast<int32_t>(kTileK - 1));
    for (int64_t c = 0; c < kTileK; c += lanes_) {
      const hn::Vec<DI> u = rows_of(c, hn::Load(di, kpt + c));
      static_assert(kTileK == 64, "row-chunk addresses: u >> 6, u & 63");
      const auto a = hn::Add(hn::Add(hn::Mul(hn::ShiftRight<6>(u), vcs), vrow), hn::And(u, v63));
      hn::Store(a, di, addr + c);
      hn::Store(hn::Add(hn::Load(d, srow + c), GatherRows(rel1, addr + c, rising)), d, srow + c);
      if (rel2 != nullptr) {
        hn::Store(hn::Add(hn::Load(d, drow + c), GatherRows(rel2, addr + c)), d, drow + c);
      }
    }
  }

 private:
  int64_t lanes_ = 1, dim_ = 0, dpad_ = 0, dimr_ = 4, group_ = 1, nch_ = 0;
};

// drow[c] = scale * drow[c] (dS to scale * dS), vector by vector, then grad(c, scale * dS) (a
// term's sums of scale dS per table row).
template <class Grad>
HWY_INLINE void ScaleGrads(float* drow, float scale, const Grad& grad) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  const auto vs = hn::Set(d, scale);
  for (int64_t c = 0; c < kTileK; c += n) {
    const auto sds = hn::Mul(hn::Load(d, drow + c), vs);
    hn::Store(sds, d, drow + c);
    grad(c, sds);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#endif  // include guard
