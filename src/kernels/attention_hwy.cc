// src/kernels/attention_hwy.cc - fused (flash-style) attention for every positional scheme.
//
// Computes out_i = sum_j softmax_j(s_ij) (v_j + value terms) with
//   s_ij = scale * (q_i . k_j + relative-content terms) + bias(pos_q - pos_k),
// following Dao et al. 2022 ("FlashAttention"): the queries of one block and the keys of one
// tile give a [rows x kTileK] block of scores; each row keeps a running maximum m and sum l, so
// the [seq_q x seq_k] matrix is never formed and memory stays O(rows x head_dim) per thread.
//
// Layout of the work. One work item = (batch row, kv head, block of query positions). Its rows
// are the query heads that share the kv head (GQA/MQA) times the block's positions, so every K/V
// tile is loaded and transposed once for all of them. Per key tile:
//   1. K tile transposed to Kt[d][c] (kTileK columns), so S = Q . Kt is a broadcast-FMA
//      micro-kernel (4 rows x up to 4 vectors of keys);
//   2. the scheme's terms are added per row, vectorized over keys: a bias by distance (ALiBi,
//      T5) loaded contiguously when the tile's key positions are consecutive, gathered
//      otherwise; Shaw's and DeBERTa's per-query projections onto the clipped relative tables,
//      loaded contiguously outside the clipping band; Transformer-XL's (q + v) . r(delta) from a
//      second product against the band of projected distances the tile needs;
//   3. masking (causal, window, tile tail), online softmax with Highway's Exp;
//   4. O += P . V (4 rows x 4 vectors of head_dim micro-kernel), plus Shaw's per-bucket weights.
// Tiles a causal mask hides entirely are skipped; in a tile the diagonal crosses, each block of
// rows computes only the key columns its rows can see. Each item is computed by one thread, so the
// results do not depend on the thread count. Decoding shapes (few items, many keys) split the
// keys of an item into fixed chunks merged exactly afterwards (m, l and O rescaled to a common
// maximum); the chunking depends on the shape only, never on the thread count.
//
// Files: this one holds the tile loop (Process, and ProcessShort for short runs of tiles), the
// row update and the output; the items and their schedule are in schedule-inl.h (ForwardSchedule,
// the kernel's base), the schemes' terms in terms/ (distance_bias, shaw, deberta, xl: -inl.h),
// the decoding micro-kernels in decode-inl.h, and those shared with the backward in
// attention-inl.h and mask-inl.h.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "kernels/attention_kernels.h"
#include "kernels/bf16_dot.h"
#include "kernels/block_mask.h"
#include "kernels/fetch_queue.h"
#include "kernels/simd.h"
#include "posenc/half.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/attention_hwy.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/aligned_allocator.h"
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "kernels/attention-inl.h"
#include "kernels/decode-inl.h"
#include "kernels/mask-inl.h"
#include "kernels/schedule-inl.h"
#include "kernels/terms/deberta-inl.h"
#include "kernels/terms/distance_bias-inl.h"
#include "kernels/terms/shaw-inl.h"
#include "kernels/terms/xl-inl.h"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Per-thread buffers of one work item (aligned, reused across tiles).
struct Scratch {
  FetchQueue fetch;       // rows of the next work item (RunSegments)
  FetchQueue tile_fetch;  // Process: the next key and value tiles
  hwy::AlignedFreeUniquePtr<float[]> qp, kt, vt, s, o, extra, extra2, part;
  // A segment's transposed key tiles and packed value tiles (RunSegments).
  hwy::AlignedFreeUniquePtr<float[]> kseg, vseg;
  size_t kseg_n = 0, vseg_n = 0;
  hwy::AlignedFreeUniquePtr<int32_t[]> kpos;
  // Causal diagonal tiles: per row slot, how many of the tile's leading keys it can see.
  std::vector<int32_t> cols;
  std::vector<int32_t> ends;  // ProcessShort: per row slot, the columns P . V reads
  // ProcessShort: O already divided by the row's sum (normalized), or already in the output
  // (out_done; float32 output).
  bool normalized = false, out_done = false;
  // Block masks: the tile's key documents and open flags, and one row of the dense mask.
  hwy::AlignedFreeUniquePtr<int32_t[]> kdoc, kopen, dense;
  std::vector<float> m, l, wsum;
  // Per row slot of the current item: its query head and position, -1 head for a padding slot.
  std::vector<int64_t> row_head;
  std::vector<int32_t> row_qpos;
  std::vector<uint64_t> seen;                // decoding: SeenKeys
  hwy::AlignedFreeUniquePtr<uint16_t[]> qb;  // vdpbf16ps (decoding, prefill): bf16 query rows
  size_t qb_n = 0;
  hwy::AlignedFreeUniquePtr<uint32_t[]> kt16;  // prefill with vdpbf16ps: the tile's dim pairs
  size_t kt16_n = 0;
  size_t qp_n = 0, kt_n = 0, vt_n = 0, s_n = 0, o_n = 0, extra_n = 0, extra2_n = 0, part_n = 0;

  static void Ensure(hwy::AlignedFreeUniquePtr<float[]>& p, size_t& have, size_t want) {
    if (have < want) {
      p = hwy::AllocateAligned<float>(want);
      have = want;
    }
  }
};

// Per-item layout of the scheme terms that depend on the query rows (in Scratch::extra).
struct RowTables {
  int64_t shaw_w = 0;  // Shaw: the rows' bands (ShawBands), rows of shaw_w floats
  int64_t deb_w = 0;   // DeBERTa: c2p projections scale * q_r . pos_key[u, h], rows of deb_w
  XlBand xl;           // Transformer-XL: scale * (q_r + v) . r(t) over the item's band
};

class ForwardKernel : public ForwardSchedule<ForwardKernel, Scratch> {
 public:
  explicit ForwardKernel(const FusedAttentionParams& p) : ForwardSchedule(p) {
    // Decoding from a bf16 cache with a bf16 query, on a processor with AVX512_BF16: scores by
    // vdpbf16ps on the stored bits (bf16_dot.h). Not with RoPE in the kernel or Transformer-XL,
    // whose query and key rows are float32 by then.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
    bf16dot_ = use_dot_ && p_.q16 != nullptr && p_.k16 != nullptr && p_.q_type == DType::kBF16 &&
               p_.kv_type == DType::kBF16 && p_.rope.cs == nullptr && p_.xl_sin == nullptr &&
               bf16_dot_used(rows_per_kv_) && (p_.pages == nullptr || p_.page_size % 4 == 0);
    // Prefill with a bf16 query and bf16 keys: the score tiles by vdpbf16ps on pairs of dims
    // (bf16_dot.h), the rest as for float32. Not with RoPE in the kernel or Transformer-XL
    // (their query rows are float32 by then).
    // Float32 q and k holding bf16 values (bf16 training) too: the query rows' high halves.
    const bool bf16_qk = (p_.q16 != nullptr && p_.k16 != nullptr && p_.q_type == DType::kBF16 &&
                          p_.kv_type == DType::kBF16) ||
                         (p_.q16 == nullptr && p_.k16 == nullptr && p_.bf16_operands);
    bf16pre_ =
        !use_dot_ && bf16_qk && p_.rope.cs == nullptr && p_.xl_sin == nullptr && bf16_dot_prefill();
#endif
    qb_stride_ = RoundUp(dim_, 32);
    if (p.deberta_pos_key != nullptr) {
      deb_ = std::make_unique<DebertaForward>(p, [&](int64_t b) { return VisibleDeltas(b); });
    }
    if (p.xl_sin != nullptr) xl_ = std::make_unique<XlForward>(p);
  }

 private:
  friend class ForwardSchedule<ForwardKernel, Scratch>;

  // ProcessShort: at most this many tiles, and S of at most this many cells.
  static constexpr int64_t kShortTiles = 8, kShortCells = 64 * 512;

  // A thread's buffer of at least n floats: key rows widened (half precision) or rotated (RoPE)
  // before a tile is transposed, and a half-precision output row before it is rounded.
  static float* RowBuffer(int64_t n) {
    thread_local hwy::AlignedFreeUniquePtr<float[]> buf;
    thread_local int64_t have = 0;
    if (have < n) {
      buf = hwy::AllocateAligned<float>(static_cast<size_t>(n));
      have = n;
    }
    return buf.get();
  }

  // Kt[x][c] = k[j0 + c][x] for the keys of one tile (zeros past the row's keys).
  void TransposeTile(int64_t b, int64_t hk, int64_t j0, float* kt) const {
    const int64_t nk = std::clamp<int64_t>(KeyEnd(b) - j0, 0, kTileK);
    const float* k0 = nullptr;  // key j0's row
    int64_t ks = p_.k_stride[1];
    if (p_.k16 != nullptr || p_.pages != nullptr) {
      // Half precision or a paged cache: the tile's rows widened (gathered) first.
      float* rows = RowBuffer(nk * dim_);
      for (int64_t c = 0; c < nk; ++c) {
        const int64_t at = KeyAt(b, j0 + c, p_.k_stride) + hk * p_.k_stride[2];
        if (p_.k16 != nullptr) {
          WidenRow(p_.kv_type, p_.k16 + at, rows + c * dim_, dim_);
        } else {
          std::memcpy(rows + c * dim_, p_.k + at, static_cast<size_t>(dim_) * sizeof(float));
        }
      }
      k0 = rows;
      ks = dim_;
    } else {
      k0 = p_.k + b * p_.k_stride[0] + hk * p_.k_stride[2] + j0 * ks;
    }
    if (p_.rope.cs != nullptr && nk > 0) {  // RoPE: the tile's rows rotated first
      float* rows = RowBuffer(nk * dim_);
      rope_rotate_rows(p_.rope, p_.kpos + b * p_.seq_k + j0, p_.rope_base[b], nk, k0, ks, rows,
                       dim_);
      k0 = rows;
      ks = dim_;
    }
    TransposeRows(k0, ks, nk, dim_, kt);
    if (nk < kTileK) {
      for (int64_t x = 0; x < dim_; ++x)
        std::fill(kt + x * kTileK + nk, kt + (x + 1) * kTileK, 0.0f);
    }
  }

  // The value rows of keys [j0, j0 + kTileK) of (batch row b, kv head hk), widened from half
  // precision, dpad floats apart with zeros past head_dim and past the last key. Rows read in
  // place from a [seq, heads, dim] tensor are heads * dim floats apart, 4 KB for 8 heads of 128,
  // so the 64 rows of a tile fall on the same L1 sets and evict each other: packing them measured
  // faster for causal prefill on AVX2. Packed once per (batch row, kv head) for all its query
  // blocks (vt_all), the per-tile copy (waiting on rows 4 KB apart, a page each) is gone, and
  // the next tiles are prefetched (figures in docs/performance.md, Measured design choices).
  void PackValueTile(int64_t b, int64_t hk, int64_t j0, float* vt) const {
    const int64_t nk = std::clamp<int64_t>(KeyEnd(b) - j0, 0, kTileK);
    for (int64_t c = 0; c < nk; ++c) {
      const int64_t at = KeyAt(b, j0 + c, p_.v_stride) + hk * p_.v_stride[2];
      if (p_.v16 != nullptr) {
        WidenRow(p_.kv_type, p_.v16 + at, vt + c * dpad_, dim_);
      } else {
        std::memcpy(vt + c * dpad_, p_.v + at, static_cast<size_t>(dim_) * sizeof(float));
      }
      std::fill(vt + c * dpad_ + dim_, vt + (c + 1) * dpad_, 0.0f);
    }
    std::fill(vt + nk * dpad_, vt + kTileK * dpad_, 0.0f);
  }

  // ---- Paged caches (FusedAttentionParams::pages) ----
  // How many of the n keys from key j on lie in j's page (all n in a contiguous cache): the
  // decoding passes address one such run of rows at a time.
  int64_t RunLength(int64_t j, int64_t n) const {
    return p_.pages == nullptr ? n : std::min(n, p_.page_size - j % p_.page_size);
  }
  // Prefetch rows [j, j + n) of K or V (x: elements of `bytes` bytes, strides st) of the item,
  // all its kv heads.
  // No rows (the next tile past the item's last key): nothing to fetch, and no block-table entry
  // is looked up (the one past a row's last page may lie outside the table).
  template <class T>
  PrefetchRows CacheRows(const Item& it, const T* x, int64_t j, int64_t n,
                         const std::array<int64_t, 3>& st) const {
    if (n <= 0) return PrefetchRows{};
    constexpr int64_t kBytes = sizeof(T);
    PrefetchRows r{reinterpret_cast<const char*>(x + KeyAt(it.b, j, st) + it.hk * st[2]),
                   n,
                   st[1] * kBytes,
                   st[2] * kBytes,
                   it.nkv,
                   dim_ * kBytes};
    if (p_.pages != nullptr) {
      r.p = reinterpret_cast<const char*>(x + it.hk * st[2]);
      r.pages = p_.pages + it.b * p_.pages_stride;
      r.first = j;
      r.page_size = p_.page_size;
      r.page_stride = st[0] * kBytes;
    }
    return r;
  }

  void InitAccumulators(const Item& it, Scratch& sc) const {
    Scratch::Ensure(sc.o, sc.o_n, static_cast<size_t>(it.rows_pad * dpad_));
    std::fill(sc.o.get(), sc.o.get() + it.rows_pad * dpad_, 0.0f);
    sc.m.assign(static_cast<size_t>(it.rows_pad), kNegInf);
    sc.l.assign(static_cast<size_t>(it.rows_pad), 0.0f);
    sc.normalized = sc.out_done = false;
  }

  // Packs the item's query rows (XL: q + u) and the per-row scheme tables for keys
  // [j_begin, j_end). Row buffers keep 4 spare zero rows so that per-head products over
  // rows [g nq, g nq + RoundUp(nq, 4)) stay inside them.
  void PackQueries(const Item& it, int64_t j_begin, int64_t j_end, Scratch& sc,
                   RowTables& rt) const {
    const int64_t alloc_rows = it.rows_pad + 4;
    Scratch::Ensure(sc.qp, sc.qp_n, static_cast<size_t>(alloc_rows * dim_));
    float* qp = sc.qp.get();
    // Zeros in the padding slots and the spare rows; every other row is written below.
    for (int64_t r = 0; r < it.rows; ++r) {
      if (!Valid(it, r)) std::fill(qp + r * dim_, qp + (r + 1) * dim_, 0.0f);
    }
    std::fill(qp + it.rows * dim_, qp + alloc_rows * dim_, 0.0f);
    if (bf16dot_ || bf16pre_) {
      const size_t want = static_cast<size_t>(alloc_rows * qb_stride_);
      if (sc.qb_n < want) {
        sc.qb = hwy::AllocateAligned<uint16_t>(want);
        sc.qb_n = want;
      }
      std::fill(sc.qb.get(), sc.qb.get() + want, uint16_t{0});
    }
    for (int64_t r = 0; r < it.rows; ++r) {
      if (!Valid(it, r)) continue;
      const int64_t h = HeadOf(it, r), i = QueryOf(it, r);
      const int64_t at = it.b * p_.q_stride[0] + i * p_.q_stride[1] + h * p_.q_stride[2];
      const float* src = qp + r * dim_;
      if (p_.q16 != nullptr) {
        WidenRow(p_.q_type, p_.q16 + at, qp + r * dim_, dim_);
        if (bf16dot_ || bf16pre_) std::memcpy(sc.qb.get() + r * qb_stride_, p_.q16 + at, 2 * dim_);
      } else {
        src = p_.q + at;
        if (bf16pre_) {  // bf16 values exactly: their high halves
          uint16_t* qb = sc.qb.get() + r * qb_stride_;
          for (int64_t x = 0; x < dim_; ++x) {
            uint32_t u;
            std::memcpy(&u, src + x, sizeof u);
            qb[x] = static_cast<uint16_t>(u >> 16);
          }
        }
      }
      if (p_.rope.cs != nullptr) {
        rope_rotate_rows(p_.rope, p_.qpos + it.b * p_.seq_q + i, p_.rope_base[it.b], 1, src, 0,
                         qp + r * dim_, 0);
      } else if (src != qp + r * dim_) {
        std::memcpy(qp + r * dim_, src, static_cast<size_t>(dim_) * sizeof(float));
      }
    }
    const int64_t nq4 = RoundUp(it.nq, 4);
    if (xl_ != nullptr) {
      // (q + v) rows in extra2, then G[r][t] = scale (q_r + v) . r(t) over the distances the
      // item's visible keys can have; the main product uses q + u.
      Scratch::Ensure(sc.extra2, sc.extra2_n, static_cast<size_t>(alloc_rows * dim_));
      float* qv = sc.extra2.get();
      std::fill(qv, qv + alloc_rows * dim_, 0.0f);
      for (int64_t r = 0; r < it.rows; ++r) {
        if (Valid(it, r)) XlAddBiases(p_, HeadOf(it, r), dim_, qp + r * dim_, qv + r * dim_);
      }
      const auto [dlo, dhi] = VisibleDeltas(it, j_begin, j_end);
      rt.xl = xl_->Band(dlo, dhi);
      const int64_t ld = rt.xl.ld;
      Scratch::Ensure(sc.extra, sc.extra_n, static_cast<size_t>((alloc_rows + 1) * ld));
      float* g = sc.extra.get();
      std::fill(g + it.rows * ld, g + (alloc_rows + 1) * ld, 0.0f);
      for (int64_t hh = 0; hh < it.nkv * group_; ++hh) {
        const int64_t row0 = HeadRow(it, hh);
        xl_->FillBand(it.hk * group_ + hh, qv + row0 * dim_, nq4, rt.xl, g + row0 * ld);
      }
    }
    if (p_.shaw_rel_k != nullptr) {
      rt.shaw_w = ShawBands::Width(p_);
      Scratch::Ensure(sc.extra, sc.extra_n, static_cast<size_t>(it.rows * rt.shaw_w));
      ShawBands::Fill(p_, it.rows, qp, dim_, sc.extra.get(),
                      [&](int64_t r) { return Valid(it, r) ? HeadOf(it, r) : int64_t{-1}; });
      sc.wsum.assign(static_cast<size_t>(it.rows * (2 * p_.shaw_k + 1)), 0.0f);
    }
    if (deb_ != nullptr) {
      rt.deb_w = deb_->C2pWidth();
      Scratch::Ensure(sc.extra, sc.extra_n, static_cast<size_t>(alloc_rows * rt.deb_w));
      // Only the pos_key rows the item's visible distances use (about half under a causal
      // mask); masked cells may read other columns, whose scores the mask replaces anyway.
      const auto [dlo, dhi] = VisibleDeltas(it, j_begin, j_end);
      const auto [ulo, uhi] = deb_->UsedC2pRows(it.b, dlo, dhi);
      for (int64_t hh = 0; hh < it.nkv * group_; ++hh) {
        const int64_t row0 = HeadRow(it, hh);
        deb_->FillC2p(it.hk * group_ + hh, qp + row0 * dim_, nq4, ulo, uhi,
                      sc.extra.get() + row0 * rt.deb_w, rt.deb_w);
      }
    }
  }

  // Decoding scores of keys [j, j + n) (one run: rows evenly spaced, see RunLength) into columns
  // s[r * kTileK + c], c < n, for every row of the item; sets the prefetches of the run (vahead,
  // kstream) and, for the tile's first run (first), the next tile's keys (kahead).
  void DecodeScores(const Item& it, int64_t j, int64_t n, int64_t j_end, bool first, float* s,
                    Scratch& sc, PrefetchRows& vahead, PrefetchRows& kahead,
                    PrefetchRows& kstream) const {
    const int64_t kat = KeyAt(it.b, j, p_.k_stride) + it.hk * p_.k_stride[2];
    const int64_t ks1 = p_.k_stride[1], ks2 = p_.k_stride[2];
    if (p_.k16 != nullptr && p_.v16 != nullptr && kStreamHalfDecode) {
      // A half-precision cache on AVX2: each pass fetches its own rows ahead (see
      // kStreamHalfDecode), over the item's keys from this run on.
      kstream = CacheRows(it, p_.k16, j, j_end - j, p_.k_stride);
    } else if (p_.k != nullptr && HeadsOuter(ks1, ks2)) {
      // A head-major float32 cache: each head's rows fetched ahead (see HeadsOuter).
      kstream = CacheRows(it, p_.k, j, j_end - j, p_.k_stride);
    } else if (p_.k16 != nullptr && p_.v16 != nullptr && (!bf16dot_ || bf16_dot_prefetch())) {
      // A half-precision cache: the run's values fetched during its dot products, the next
      // tile's keys during its values. (A float32 cache, twice the bytes per key, read slower
      // with them: measured. The vdpbf16ps scores on Intel too: bf16_dot.h.)
      vahead = CacheRows(it, p_.v16, j, n, p_.v_stride);
      if (first) {
        const int64_t next = j - j % kTileK + kTileK;
        kahead =
            CacheRows(it, p_.k16, next, std::clamp<int64_t>(j_end - next, 0, kTileK), p_.k_stride);
      }
    }
    if (p_.rope.cs != nullptr) {
      // RoPE: the run's rows of every kv head widened (half precision) and rotated first.
      float* rows = RowBuffer(n * it.nkv * dim_);
      const float* krows = p_.k == nullptr ? nullptr : p_.k + kat;
      int64_t rs1 = ks1, rs2 = ks2;
      if (p_.k16 != nullptr) {
        for (int64_t c = 0; c < n; ++c)
          for (int64_t g = 0; g < it.nkv; ++g) {
            WidenRow(p_.kv_type, p_.k16 + kat + c * ks1 + g * ks2, rows + (c * it.nkv + g) * dim_,
                     dim_);
          }
        krows = rows, rs1 = it.nkv * dim_, rs2 = dim_;
      }
      for (int64_t g = 0; g < it.nkv; ++g) {
        rope_rotate_rows(p_.rope, p_.kpos + it.b * p_.seq_k + j, p_.rope_base[it.b], n,
                         krows + g * rs2, rs1, rows + g * dim_, it.nkv * dim_);
      }
      DotScoresWide(sc.qp.get(), dim_, it.gstride, it.nkv, static_cast<const float*>(rows),
                    it.nkv * dim_, dim_, n, s, sc.part.get(), vahead, kstream, false);
    } else if (p_.k16 == nullptr) {
      DotScoresWide(sc.qp.get(), dim_, it.gstride, it.nkv, p_.k + kat, ks1, ks2, n, s,
                    sc.part.get(), vahead, kstream, false);
    } else if (bf16dot_) {
      // Writes columns [n, RoundUp(n, 4)) too: the next run's, or the tile's tail (paged caches
      // take this path only with pages of a multiple of 4 keys).
      decode_scores_bf16_dot(sc.qb.get(), qb_stride_, dim_, it.gstride, it.nkv, p_.k16 + kat, ks1,
                             ks2, n, s, kTileK, sc.part.get(), vahead);
    } else if (p_.kv_type == DType::kBF16) {
      DotScoresWide(sc.qp.get(), dim_, it.gstride, it.nkv,
                    reinterpret_cast<const bf16*>(p_.k16 + kat), ks1, ks2, n, s, sc.part.get(),
                    vahead, kstream, false);
    } else {
      DotScoresWide(sc.qp.get(), dim_, it.gstride, it.nkv,
                    reinterpret_cast<const f16*>(p_.k16 + kat), ks1, ks2, n, s, sc.part.get(),
                    vahead, kstream, false);
    }
  }

  // Per row slot, how many leading keys of the tile at j0 (nk keys, consecutive positions) the
  // causal mask leaves visible: those at positions up to the row's query position, every key
  // for the open rows of a prefix-LM (the other masks only hide more). Padding slots see none and
  // their score rows are zeroed, so that a block's products read only defined scores.
  const int32_t* TileColumns(const Item& it, int64_t j0, int64_t nk, float* s, int64_t ss,
                             Scratch& sc) const {
    sc.cols.resize(static_cast<size_t>(it.rows_pad));
    const int64_t k0 = p_.kpos[it.b * p_.seq_k + j0];
    for (int64_t r = 0; r < it.rows_pad; ++r) {
      int64_t c = 0;
      if (r < it.rows && Valid(it, r)) {
        const int64_t qat = it.b * p_.seq_q + QueryOf(it, r);
        const bool open = p_.qopen != nullptr && p_.qopen[qat] != 0;
        c = open ? nk : std::clamp<int64_t>(int64_t{QPos(it, r)} - k0 + 1, 0, nk);
      } else {
        std::fill(s + r * ss, s + r * ss + kTileK, 0.0f);
      }
      sc.cols[static_cast<size_t>(r)] = static_cast<int32_t>(c);
    }
    return sc.cols.data();
  }

  // What Process and ProcessShort share over an item's tiles.
  struct ItemPass {
    RowTables rt;
    QueryBlockInfo qinfo{};
    bool q_in_place = false;  // the products read the query rows in place
    bool key_lanes = false;   // block masks with per-key documents or open flags
    int64_t j_end = 0;        // the keys' end (a paged cache's row length)
    FetchQueue* fetch = nullptr;
    int64_t fetch_n = 0;  // lines fetched per register block
  };

  // The item's query rows (packed, unless read in place), scratch for S of s_cols columns, the
  // block's tile tests, and the spread of the fetch queue over the products' register blocks
  // (one_pass_tiles: ProcessShort's visible tiles, 0 for Process).
  void BeginItem(const Item& it, int64_t j_begin, int64_t j_end, const float* vt_all,
                 int64_t s_cols, int64_t one_pass_tiles, Scratch& sc, ItemPass& ps) const {
    // Query rows read in place (RunSegments): one product per query head, over rows that need no
    // padding.
    // (A row stride below head_dim, e.g. 0 for a broadcast q, is not a layout ScoresTile reads:
    // its stride 0 means packed rows.)
    ps.q_in_place = q_in_place_ && it.nkv == 1 && it.nq % 4 == 0 && it.gstride == group_ * it.nq &&
                    p_.q_stride[1] >= dim_;
    if (!ps.q_in_place) PackQueries(it, j_begin, j_end, sc, ps.rt);
    Scratch::Ensure(sc.kt, sc.kt_n, static_cast<size_t>(dim_ * kTileK));
    Scratch::Ensure(sc.s, sc.s_n, static_cast<size_t>(it.rows_pad * s_cols));
    sc.row_head.resize(static_cast<size_t>(it.rows_pad));
    sc.row_qpos.resize(static_cast<size_t>(it.rows_pad));
    for (int64_t r = 0; r < it.rows_pad; ++r) {
      const bool valid = r < it.rows && Valid(it, r);
      sc.row_head[static_cast<size_t>(r)] = valid ? HeadOf(it, r) : -1;
      sc.row_qpos[static_cast<size_t>(r)] = valid ? QPos(it, r) : 0;
    }
    // Prefill reads the tile's values packed (PackValueTile): from vt_all when the group's
    // tiles were packed once for all its query blocks, else packed here per tile.
    if (vt_all == nullptr) Scratch::Ensure(sc.vt, sc.vt_n, static_cast<size_t>(kTileK * dpad_));
    if (!sc.kpos) sc.kpos = hwy::AllocateAligned<int32_t>(static_cast<size_t>(kTileK));

    // The block's queries: the tile tests (causal, window, chunk, block masks).
    ps.qinfo = tiles_->Queries(it.b, it.i0, it.nq);
    ps.key_lanes = p_.kdoc != nullptr || p_.kopen != nullptr;
    if (ps.key_lanes && !sc.kdoc) {
      sc.kdoc = hwy::AllocateAligned<int32_t>(static_cast<size_t>(kTileK));
      sc.kopen = hwy::AllocateAligned<int32_t>(static_cast<size_t>(kTileK));
    }
    if (p_.dense != nullptr && !sc.dense) {
      sc.dense = hwy::AllocateAligned<int32_t>(static_cast<size_t>(kTileK));
    }
    // A paged cache: the row's keys end at kv_len[b] (past it the block table holds no page).
    ps.j_end = std::min(j_end, KeyEnd(it.b));
    // The next item's rows (RunSegments), spread over the register blocks of the visible tiles'
    // products.
    ps.fetch = nullptr;
    ps.fetch_n = 0;
    if (sc.fetch.Pending() > 0) {
      // One P . V pass per tile, or one in all (ProcessShort, which knows its tiles).
      int64_t tiles = one_pass_tiles;
      for (int64_t j0 = j_begin; one_pass_tiles == 0 && j0 < ps.j_end; j0 += kTileK) {
        tiles += tiles_->Classify(ps.qinfo, it.b, j0 / kTileK, it.i0, it.nq) != TileKind::kHidden;
      }
      const int64_t steps =
          ProductBlocks(it.rows_pad, dpad_, tiles, one_pass_tiles > 0 ? 1 : tiles);
      ps.fetch = &sc.fetch;
      ps.fetch_n = (sc.fetch.Pending() + steps - 1) / std::max<int64_t>(1, steps);
    }
  }

  // Tile keys [j0, j0 + nk): their documents and open flags (block masks) and positions.
  void TileLanes(const Item& it, int64_t j0, int64_t nk, const ItemPass& ps, Scratch& sc) const {
    if (ps.key_lanes) FillKeyLanes(p_, it.b, j0, nk, kTileK, sc.kdoc.get(), sc.kopen.get());
    int32_t* kp = sc.kpos.get();
    for (int64_t c = 0; c < kTileK; ++c) {
      kp[c] = p_.kpos[it.b * p_.seq_k + std::min(j0 + c, p_.seq_k - 1)];
    }
  }

  // S = Q . Kt for the tile of keys [j0, j0 + nk) (kt transposed), into s with rows ss floats
  // apart. A causal tile the diagonal crosses, with consecutive key positions: row r sees at most
  // its first cols[r] keys, and the products skip the column chunks no row of a block needs
  // (about half of a diagonal tile); returns cols then, else nullptr.
  const int32_t* TileProducts(const Item& it, int64_t j0, int64_t nk, bool full, bool consec,
                              const float* kt, const ItemPass& ps, float* s, int64_t ss,
                              Scratch& sc) const {
    const int32_t* cols = nullptr;
    if (!full && consec && p_.mask.causal && p_.kopen == nullptr) {
      cols = TileColumns(it, j0, nk, s, ss, sc);
    }
    if (bf16pre_) {
      // The tile's keys as pairs of bf16 dims, then S by vdpbf16ps (bf16_dot.h).
      if (sc.kt16_n < static_cast<size_t>(RoundUp(dim_, 2) * kTileK / 2)) {
        sc.kt16_n = static_cast<size_t>(RoundUp(dim_, 2) * kTileK / 2);
        sc.kt16 = hwy::AllocateAligned<uint32_t>(sc.kt16_n);
      }
      pack_bf16_pairs(kt, dim_, sc.kt16.get());
      prefill_scores_bf16_dot(sc.qb.get(), qb_stride_, dim_, sc.kt16.get(), it.rows_pad, s, ss,
                              cols);
      if (ps.fetch != nullptr) ps.fetch->Issue(ps.fetch_n * (it.rows_pad / 4));
      return cols;
    }
    if (ps.q_in_place) {
      for (int64_t g = 0; g < group_; ++g) {
        const float* q0 = p_.q + it.b * p_.q_stride[0] + it.i0 * p_.q_stride[1] +
                          (it.hk * group_ + g) * p_.q_stride[2];
        ScoresTile(q0, dim_, kt, it.nq, s + g * it.nq * ss, ss, p_.q_stride[1], false,
                   cols == nullptr ? nullptr : cols + g * it.nq, ps.fetch, ps.fetch_n);
      }
    } else {
      ScoresTile(sc.qp.get(), dim_, kt, it.rows_pad, s, ss, 0, false, cols, ps.fetch, ps.fetch_n);
    }
    return cols;
  }

  // Processes keys [j_begin, j_end) (multiples of kTileK except at seq_k) for the item.
  // kt_all / vt_all hold tiles tile0, tile0 + 1, ... (a segment's, or a group's from 0).
  void Process(const Item& it, int64_t j_begin, int64_t j_end, const float* kt_all,
               const float* vt_all, Scratch& sc, int64_t tile0 = 0) const {
    ItemPass ps;
    BeginItem(it, j_begin, j_end, vt_all, kTileK, 0, sc, ps);
    const RowTables& rt = ps.rt;
    const QueryBlockInfo& qinfo = ps.qinfo;
    j_end = ps.j_end;
    // The item's own queue (RunSegments), or none: then each tile's products fetch the next
    // tiles, spread over about this many register blocks.
    FetchQueue* const item_fetch = ps.fetch;
    const int64_t tile_blocks = std::max<int64_t>(1, ProductBlocks(it.rows_pad, dpad_, 1, 1));
    for (int64_t j0 = j_begin; j0 < j_end; j0 += kTileK) {
      if (item_fetch == nullptr && ps.fetch != nullptr) {
        ps.fetch->Issue(-1);  // what the last tile's products left
        ps.fetch = nullptr;
      }
      const int64_t t = j0 / kTileK;
      const size_t ta = static_cast<size_t>(it.b * ntiles_ + t);
      // Skip tiles the masks hide for every row of the block.
      const TileKind kind = tiles_->Classify(qinfo, it.b, t, it.i0, it.nq);
      if (kind == TileKind::kHidden) continue;
      const int64_t nk = std::min(kTileK, j_end - j0);
      if (vt_all != nullptr && j0 + kTileK < j_end) {
        // The group's next key and value tiles toward L2 while this one is computed (measured
        // faster for causal prefill, whose tiles come from L3; docs/performance.md): a few lines
        // between the products' register blocks (in one burst, the 1024 prefetches of a
        // 128-dim tile pair stalled the thread for about 8 % of the forward), or all at once
        // when the item's queue is spread over them already (RunSegments).
        const float* knext = kt_all + (t + 1 - tile0) * dim_ * kTileK;
        const float* vnext = vt_all + (t + 1 - tile0) * kTileK * dpad_;
        const int64_t kbytes = dim_ * kTileK * sizeof(float), vbytes = kTileK * dpad_ * 4;
        if (item_fetch == nullptr) {
          sc.tile_fetch.Clear();
          sc.tile_fetch.Add(knext, kbytes);
          sc.tile_fetch.Add(vnext, vbytes);
          ps.fetch = &sc.tile_fetch;
          ps.fetch_n = (sc.tile_fetch.Pending() + tile_blocks - 1) / tile_blocks;
        } else {
          prefetch_l2(knext, kbytes);
          prefetch_l2(vnext, vbytes);
        }
      }
      // A full tile: every cell visible, no mask to apply.
      const bool full = nk == kTileK && kind == TileKind::kFull;
      // Few rows (decoding): dot products against the key rows beat transposing the tile.
      const bool dot = use_dot_;
      const float* kt = kt_all != nullptr ? kt_all + (t - tile0) * dim_ * kTileK : sc.kt.get();
      if (kt_all == nullptr && !dot) TransposeTile(it.b, it.hk, j0, sc.kt.get());
      TileLanes(it, j0, nk, ps, sc);
      PrefetchRows vahead, kahead, kstream, vstream;  // decoding: see bf16_dot.h
      if (dot) {
        Scratch::Ensure(sc.part, sc.part_n,
                        static_cast<size_t>(it.nkv * it.gstride * std::max<int64_t>(lanes_, 16)));
        // The tile's keys in runs of rows with one addressing each: the whole tile in a
        // contiguous cache, the keys of one page in a paged one (its scores into columns
        // [c0, c0 + run) of S).
        for (int64_t c0 = 0, run = 0; c0 < nk; c0 += run) {
          run = RunLength(j0 + c0, nk - c0);
          DecodeScores(it, j0 + c0, run, j_end, c0 == 0, sc.s.get() + c0, sc, vahead, kahead,
                       kstream);
        }
        for (int64_t r = 0; r < it.nkv * it.gstride; ++r) {
          std::fill(sc.s.get() + r * kTileK + nk, sc.s.get() + (r + 1) * kTileK, 0.0f);
        }
      }
      const bool consec = tile_consec_[ta] != 0;
      const int32_t* cols =
          dot ? nullptr : TileProducts(it, j0, nk, full, consec, kt, ps, sc.s.get(), kTileK, sc);
      for (int64_t r = 0; r < it.rows; ++r) {
        if (sc.row_head[static_cast<size_t>(r)] >= 0) {
          RowUpdate(it, r, j0, nk, full, consec, rt, sc, cols == nullptr ? kTileK : cols[r]);
        }
      }
      if (dot) {
        const int64_t vs1 = p_.v_stride[1], vs2 = p_.v_stride[2];
        const bool columns = p_.v16 != nullptr && !kStreamHalfDecode;
        const int64_t blocks = it.rows / 4;
        if (columns) {
          // Which keys each 4-row block sees; a run's bits shifted into [blocks, 2 blocks).
          sc.seen.resize(static_cast<size_t>(2 * blocks));
          SeenKeys(sc.s.get(), it.rows, nk, sc.seen.data());
        }
        for (int64_t c0 = 0, run = 0; c0 < nk; c0 += run) {
          run = RunLength(j0 + c0, nk - c0);
          const float* pm = sc.s.get() + c0;
          const int64_t vat = KeyAt(it.b, j0 + c0, p_.v_stride) + it.hk * vs2;
          if (p_.v16 == nullptr) {
            // A head-major float32 cache: each head's rows fetched ahead (see HeadsOuter).
            vstream = HeadsOuter(vs1, vs2)
                          ? CacheRows(it, p_.v, j0 + c0, j_end - j0 - c0, p_.v_stride)
                          : PrefetchRows{};
            AccumulateWide(pm, run, p_.v + vat, vs1, vs2, it.nkv, it.gstride, dim_, dpad_,
                           sc.o.get(), vstream);
            continue;
          }
          const uint16_t* v16 = p_.v16 + vat;
          if (kStreamHalfDecode) {
            // Key blocks across heads, as for float32 (the same bits as AccumulateWideColumns).
            vstream = CacheRows(it, p_.v16, j0 + c0, j_end - j0 - c0, p_.v_stride);
            if (p_.kv_type == DType::kBF16) {
              AccumulateWide(pm, run, reinterpret_cast<const bf16*>(v16), vs1, vs2, it.nkv,
                             it.gstride, dim_, dpad_, sc.o.get(), vstream);
            } else {
              AccumulateWide(pm, run, reinterpret_cast<const f16*>(v16), vs1, vs2, it.nkv,
                             it.gstride, dim_, dpad_, sc.o.get(), vstream);
            }
            continue;
          }
          uint64_t* seen = sc.seen.data() + blocks;
          for (int64_t blk = 0; blk < blocks; ++blk) {
            seen[blk] = sc.seen[static_cast<size_t>(blk)] >> c0;
          }
          // The next tile's keys are fetched once, during the first run.
          const PrefetchRows& ahead = c0 == 0 ? kahead : PrefetchRows{};
          if (p_.kv_type == DType::kBF16) {
            AccumulateWideColumns(pm, run, reinterpret_cast<const bf16*>(v16), vs1, vs2, it.nkv,
                                  it.gstride, dim_, dpad_, sc.o.get(), seen, ahead);
          } else {
            AccumulateWideColumns(pm, run, reinterpret_cast<const f16*>(v16), vs1, vs2, it.nkv,
                                  it.gstride, dim_, dpad_, sc.o.get(), seen, ahead);
          }
        }
        continue;
      }
      for (int64_t g2 = 0; g2 < it.nkv; ++g2) {
        // The tile's values packed dpad floats apart (vt_all: one kv head per item).
        const float* vt = sc.vt.get();
        if (vt_all != nullptr) {
          vt = vt_all + (t - tile0) * kTileK * dpad_;
        } else {
          PackValueTile(it.b, it.hk + g2, j0, sc.vt.get());
        }
        AccumulateTile(sc.s.get() + g2 * it.gstride * kTileK, nk, vt, dpad_, dpad_, it.gstride,
                       sc.o.get() + g2 * it.gstride * dpad_, kTileK, 0,
                       cols == nullptr ? nullptr : cols + g2 * it.gstride, ps.fetch, ps.fetch_n);
      }
    }
    if (ps.fetch != nullptr) ps.fetch->Issue(-1);  // what the estimate left
  }

  // An item whose visible tiles are a run of at most kShortTiles consecutive tiles of kt_all /
  // vt_all (one kv head: a short document's, RunSegments): the scores of all of them first, then
  // one softmax over each row (its maximum known before any exponential: no running rescale)
  // and one P . V over all the row's keys, written into O rather than added to it. Sets every
  // row's O, m and l. False, with nothing done, for an item that does not qualify.
  bool ProcessShort(const Item& it, int64_t j_begin, int64_t j_end, const float* kt_all,
                    const float* vt_all, Scratch& sc, int64_t tile0) const {
    if (use_dot_ || p_.shaw_rel_v != nullptr || it.nkv != 1) return false;
    const int64_t je = std::min(j_end, KeyEnd(it.b));
    const QueryBlockInfo qinfo = tiles_->Queries(it.b, it.i0, it.nq);
    int64_t tf = -1, tl = -1;
    for (int64_t j0 = j_begin; j0 < je; j0 += kTileK) {
      const int64_t t = j0 / kTileK;
      if (tiles_->Classify(qinfo, it.b, t, it.i0, it.nq) == TileKind::kHidden) continue;
      if (tl >= 0 && t != tl + 1) return false;  // a hidden tile between two visible ones
      if (tf < 0) tf = t;
      tl = t;
    }
    const int64_t w = (tl - tf + 1) * kTileK;  // S's columns
    if (tf < 0 || w > kShortTiles * kTileK || it.rows_pad * w > kShortCells) return false;
    ItemPass ps;
    BeginItem(it, j_begin, j_end, vt_all, w, tl - tf + 1, sc, ps);
    const DF d;
    const int64_t n = lanes_;
    float* s = sc.s.get();
    sc.m.assign(static_cast<size_t>(it.rows_pad), kNegInf);
    sc.l.assign(static_cast<size_t>(it.rows_pad), 0.0f);
    // Per row: its columns up to the last one computed (what P . V reads).
    sc.ends.assign(static_cast<size_t>(it.rows_pad), 0);
    Scratch::Ensure(sc.o, sc.o_n, static_cast<size_t>(it.rows_pad * dpad_));
    int64_t nk_all = 0;  // keys [tf * kTileK, + nk_all)
    for (int64_t t = tf; t <= tl; ++t) {
      const int64_t j0 = t * kTileK, off = j0 - tf * kTileK;
      const TileKind kind = tiles_->Classify(qinfo, it.b, t, it.i0, it.nq);
      const int64_t nk = std::min(kTileK, ps.j_end - j0);
      nk_all = off + nk;
      const bool full = nk == kTileK && kind == TileKind::kFull;
      const bool consec = tile_consec_[static_cast<size_t>(it.b * ntiles_ + t)] != 0;
      TileLanes(it, j0, nk, ps, sc);
      const float* kt = kt_all + (t - tile0) * dim_ * kTileK;
      const int32_t* cols = TileProducts(it, j0, nk, full, consec, kt, ps, s + off, w, sc);
      for (int64_t r = 0; r < it.rows; ++r) {
        if (!Valid(it, r)) continue;
        const int64_t cend = cols == nullptr ? kTileK : cols[r];
        const int64_t cn = RoundUp(cend, n);
        float* row = s + r * w + off;
        float& m = sc.m[static_cast<size_t>(r)];
        m = std::max(m, RowScores(it, r, j0, nk, full, consec, ps.rt, sc, cend, row));
        // Columns the products left out are hidden.
        std::fill(row + cn, row + kTileK, kNegInf);
        if (cn > 0) sc.ends[static_cast<size_t>(r)] = static_cast<int32_t>(off + cn);
      }
    }
    for (int64_t r = 0; r < it.rows_pad; ++r) {
      float* row = s + r * w;
      const float m = sc.m[static_cast<size_t>(r)];
      int32_t& end = sc.ends[static_cast<size_t>(r)];
      if (r >= it.rows || !Valid(it, r) || m == kNegInf) end = 0;
      const float l = ExpRow(row, end, w, m);
      if (end == 0) continue;
      sc.l[static_cast<size_t>(r)] = l;
      // P divided by the row's sum (with a sink's share), so that P . V is the output.
      float m2 = m, l2 = l;
      const float o_scale = SinkScale(HeadOf(it, r), m2, l2);
      const auto f = hn::Set(d, o_scale / l2);
      for (int64_t c = 0; c < end; c += n) hn::Store(hn::Mul(hn::Load(d, row + c), f), d, row + c);
    }
    sc.normalized = true;
    const float* v = vt_all + (tf - tile0) * kTileK * dpad_;
    // Float32 output rows that P . V can write directly: one query head's rows evenly apart,
    // no padding slots or columns.
    const int64_t os1 = p_.out_stride[1];
    sc.out_done = p_.out16 == nullptr && ps.q_in_place && dpad_ == dim_ && os1 >= dim_;
    if (sc.out_done) {
      for (int64_t g = 0; g < group_; ++g) {
        float* out = p_.out + it.b * p_.out_stride[0] + it.i0 * os1 +
                     (it.hk * group_ + g) * p_.out_stride[2];
        AccumulateTile(s + g * it.nq * w, nk_all, v, dpad_, dpad_, it.nq, out, w, os1,
                       sc.ends.data() + g * it.nq, ps.fetch, ps.fetch_n, false);
      }
    } else {
      AccumulateTile(s, nk_all, v, dpad_, dpad_, it.rows_pad, sc.o.get(), w, 0, sc.ends.data(),
                     ps.fetch, ps.fetch_n, false);
    }
    if (ps.fetch != nullptr) ps.fetch->Issue(-1);  // what the estimate left
    return true;
  }

  // s[c] = exp(s[c] - m) for c < end (a multiple of the lanes; exp(-inf) = 0), s[c] = 0 for
  // end <= c < width; returns the sum of the exponentials.
  HWY_INLINE float ExpRow(float* HWY_RESTRICT s, int64_t end, int64_t width, float m) const {
    const DF d;
    const auto vm = hn::Set(d, m);
    auto vsum = hn::Zero(d);
    for (int64_t c = 0; c < end; c += lanes_) {
      const auto e = ExpSoftmax(d, hn::Sub(hn::Load(d, s + c), vm));
      hn::Store(e, d, s + c);
      vsum = hn::Add(vsum, e);
    }
    std::fill(s + end, s + width, 0.0f);
    return hn::GetLane(hn::SumOfLanes(d, vsum));
  }

  // Adds the scheme's terms to row r of a score tile at s, masks it and checks it: afterwards
  // s[0, cn) (cend rounded up to whole vectors) holds the row's scores, -inf where hidden; the
  // rest is neither read nor written (a causal diagonal tile's columns past the row's, see
  // TileColumns). Returns the largest.
  HWY_INLINE float RowScores(const Item& it, int64_t r, int64_t j0, int64_t nk, bool full,
                             bool consec, const RowTables& rt, Scratch& sc, int64_t cend,
                             float* HWY_RESTRICT s) const {
    const DF d;
    const DI di;
    const int64_t n = lanes_;
    const int64_t cn = RoundUp(cend, n);
    const int64_t h = sc.row_head[static_cast<size_t>(r)];
    const int32_t qp = sc.row_qpos[static_cast<size_t>(r)];
    const auto vscale = hn::Set(d, p_.scale);
    const bool capped = p_.softcap > 0.0f;
    const auto vcap = hn::Set(d, p_.softcap);
    const auto inv_cap = hn::Set(d, capped ? 1.0f / p_.softcap : 0.0f);
    const int32_t* kp = sc.kpos.get();
    const DistanceBiasRow<const float> bias(p_, p_.bias, it.b, h, qp);
    const XlRow xl(p_, xl_ != nullptr ? sc.extra.get() : nullptr, rt.xl, r, qp);
    const ShawRow shaw(p_, p_.shaw_rel_k != nullptr ? sc.extra.get() : nullptr, r, qp);
    const DebertaRow deb = deb_ != nullptr
                               ? deb_->Row(sc.extra.get(), rt.deb_w, r, it.b, h, qp, j0, kp, consec)
                               : DebertaRow{};
    auto vmax = hn::Set(d, kNegInf);
    auto nan = hn::Zero(d);
    RowMask row_mask(p_.mask, qp);
    if (!full && tiles_->Any()) {
      const int64_t qat = it.b * p_.seq_q + QueryOf(it, r);
      if (p_.dense != nullptr) {
        FillDenseLanes(p_, it.b, QueryOf(it, r), j0, nk, kTileK, sc.dense.get());
      }
      row_mask.SetBlock(p_.qdoc != nullptr ? p_.qdoc[qat] : 0,
                        p_.qopen != nullptr && p_.qopen[qat] != 0,
                        {p_.kdoc != nullptr ? sc.kdoc.get() : nullptr,
                         p_.kopen != nullptr ? sc.kopen.get() : nullptr,
                         p_.dense != nullptr ? sc.dense.get() : nullptr});
    }
    // Lane offsets 0..n-1, built once per row (Iota may go through memory).
    const auto lane_iota = hn::Iota(di, 0);
    for (int64_t c = 0; c < cn; c += n) {
      auto sv = hn::Mul(hn::Load(d, s + c), vscale);
      if (bias.row != nullptr) sv = bias.Add(d, sv, kp, c, consec);
      // XL: scale * (q + v) . r(delta) from the item's band, (q + u) . k is already in sv.
      if (xl.g != nullptr) sv = xl.Add(d, sv, kp, c, consec);
      if (shaw.row != nullptr) sv = shaw.Add(d, sv, kp, c, consec);
      if (deb.t != nullptr) sv = deb.Add(d, sv, kp, c, consec, lane_iota);
      if (capped) sv = SoftCap(d, sv, vcap, inv_cap);
      // Visible scores must be finite: NaN or an overflow to +-inf would otherwise turn into a
      // silent 0 (exp of NaN is 0 here) instead of an error.
      auto bad = hn::Not(hn::IsFinite(sv));
      if (!full) {
        const auto vis = hn::And(hn::FirstN(d, static_cast<size_t>(std::max<int64_t>(0, nk - c))),
                                 row_mask.VisibleAt(d, hn::Load(di, kp + c), c));
        bad = hn::And(bad, vis);
        sv = hn::IfThenElse(vis, sv, hn::Set(d, kNegInf));
      }
      hn::Store(sv, d, s + c);
      vmax = hn::Max(vmax, sv);
      nan = hn::Or(nan, hn::VecFromMask(d, bad));
    }
    if (!hn::AllFalse(d, hn::MaskFromVec(nan)) && p_.nan_score != nullptr) {
      __atomic_store_n(p_.nan_score, 1, __ATOMIC_RELAXED);
    }
    return hn::GetLane(hn::MaxOfLanes(d, vmax));
  }

  // Adds the scheme's terms to row r of the score tile, masks it, and folds it into the
  // running softmax: afterwards S[r][:] holds the probabilities (unnormalized, relative to the
  // new running maximum) and O[r], l[r] are rescaled.
  // Only the row's first `cend` columns can be visible (a causal diagonal tile, TileColumns):
  // the rest of S is neither read nor computed, and is set to 0.
  HWY_INLINE void RowUpdate(const Item& it, int64_t r, int64_t j0, int64_t nk, bool full,
                            bool consec, const RowTables& rt, Scratch& sc, int64_t cend) const {
    const DF d;
    const int64_t n = lanes_;
    const int64_t cn = RoundUp(cend, n);
    float* s = sc.s.get() + r * kTileK;
    const float tile_max = RowScores(it, r, j0, nk, full, consec, rt, sc, cend, s);
    float& m = sc.m[static_cast<size_t>(r)];
    float& l = sc.l[static_cast<size_t>(r)];
    const float m_new = std::max(m, tile_max);
    if (m_new == kNegInf) {
      std::fill(s, s + kTileK, 0.0f);
      return;
    }
    const float corr = m == m_new ? 1.0f : std::exp(m - m_new);  // 0 when m was -inf
    const float tile_sum = ExpRow(s, cn, kTileK, m_new);
    if (corr != 1.0f) {
      float* o = sc.o.get() + r * dpad_;
      const auto vc = hn::Set(d, corr);
      for (int64_t x = 0; x < dpad_; x += n) hn::Store(hn::Mul(hn::Load(d, o + x), vc), d, o + x);
      if (!sc.wsum.empty()) ShawWeights(p_, sc.wsum.data(), r).Rescale(corr);
    }
    l = l * corr + tile_sum;
    m = m_new;
    if (p_.shaw_rel_v != nullptr) {  // Shaw's value term: per-bucket weights
      ShawWeights(p_, sc.wsum.data(), r).Add(sc.kpos.get(), QPos(it, r), nk, consec, tile_sum, s);
    }
  }

  // out = O / l (+ Shaw's value term), or 0 for rows that saw no key.
  void Finish(const Item& it, Scratch& sc) const {
    for (int64_t r = 0; r < it.rows; ++r) {
      if (!Valid(it, r)) continue;
      const int64_t h = HeadOf(it, r), i = QueryOf(it, r);
      const int64_t oat = it.b * p_.out_stride[0] + i * p_.out_stride[1] + h * p_.out_stride[2];
      // Half-precision output: the row in float32 first, rounded once below.
      float* dst = p_.out16 != nullptr ? RowBuffer(dim_) : p_.out + oat;
      FinishRow(it, r, h, i, dst, sc);
      if (p_.nonfinite_out != nullptr && p_.out16 == nullptr) {
        // Exponent bits all ones: inf or NaN (an integer OR the compiler vectorizes).
        uint32_t bad = 0;
        for (int64_t x = 0; x < dim_; ++x) {
          uint32_t u;
          std::memcpy(&u, dst + x, sizeof u);
          bad |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
        }
        if (bad != 0) __atomic_store_n(p_.nonfinite_out, 1, __ATOMIC_RELAXED);
      }
      if (p_.out16 != nullptr) {
        uint16_t* o16 = p_.out16 + oat;
        if (p_.out_type == DType::kBF16) {
          for (int64_t x = 0; x < dim_; ++x) o16[x] = bf16_from_float(dst[x]).bits;
        } else {
          for (int64_t x = 0; x < dim_; ++x) o16[x] = f16_from_float(dst[x]).bits;
        }
      }
    }
  }

  // An attention sink joins the denominator only: O (relative to m) is rescaled to the new
  // maximum and divided by the larger sum. Updates m and l (the row's maximum and sum with the
  // sink of query head h) and returns O's factor.
  float SinkScale(int64_t h, float& m, float& l) const {
    if (p_.sinks == nullptr) return 1.0f;
    const float sink = p_.sinks[h];
    const float m_new = std::max(m, sink);
    const float o_scale = l == 0.0f ? 0.0f : std::exp(m - m_new);
    l = l * o_scale + std::exp(sink - m_new);
    m = m_new;
    return o_scale;
  }

  // Row r's output (query head h, query i) into dst, and its log-sum-exp.
  void FinishRow(const Item& it, int64_t r, int64_t h, int64_t i, float* dst, Scratch& sc) const {
    {
      float l = sc.l[static_cast<size_t>(r)];
      float m = sc.m[static_cast<size_t>(r)];
      const float* o = sc.o.get() + r * dpad_;
      if (l == 0.0f && p_.empty_row != nullptr) {
        __atomic_store_n(p_.empty_row, 1, __ATOMIC_RELAXED);
      }
      const float o_scale = SinkScale(h, m, l);
      if (p_.lse != nullptr) {
        p_.lse[it.b * p_.lse_stride[0] + h * p_.lse_stride[1] + i * p_.lse_stride[2]] =
            l == 0.0f ? kNegInf : m + std::log(l);
      }
      if (l == 0.0f || o_scale == 0.0f) {
        std::fill(dst, dst + dim_, 0.0f);
        return;
      }
      if (sc.out_done) return;  // written by ProcessShort
      const float inv = sc.normalized ? 1.0f : o_scale / l;
      if (p_.shaw_rel_v != nullptr && !sc.wsum.empty()) {
        // O += sum_u w[u] rel_v[u], vectorized over head_dim (O rows are dpad wide).
        float* orow = sc.o.get() + r * dpad_;
        ShawWeights(p_, sc.wsum.data(), r).AddValues(p_, h, dim_, orow);
        for (int64_t x = 0; x < dim_; ++x) dst[x] = orow[x] * inv;
      } else {
        for (int64_t x = 0; x < dim_; ++x) dst[x] = o[x] * inv;
      }
    }
  }

  bool bf16dot_ = false;   // decoding scores by vdpbf16ps (bf16_dot.h)
  bool bf16pre_ = false;   // prefill score tiles by vdpbf16ps (bf16_dot.h)
  int64_t qb_stride_ = 0;  // bf16 query rows (bf16dot_): dim rounded up to 32
  // The schemes' per-call tables (terms/deberta-inl.h, terms/xl-inl.h), when present.
  std::unique_ptr<DebertaForward> deb_;
  std::unique_ptr<XlForward> xl_;
};

void FusedAttention(const FusedAttentionParams& p) {
  ForwardKernel k(p);
  k.Run();
}

void SoftmaxExp(const float* x, float* y, int64_t n) {
  const DF d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  HWY_ALIGN float buf[hn::MaxLanes(DF())];
  for (int64_t i = 0; i < n; i += lanes) {
    const int64_t m = std::min(lanes, n - i);
    std::fill(buf, buf + lanes, 0.0f);
    std::copy(x + i, x + i + m, buf);
    const auto v = hn::Load(d, buf);
    hn::Store(ExpSoftmax(d, v), d, buf);
    std::copy(buf, buf + m, y + i);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::kernels {

HWY_EXPORT(FusedAttention);
HWY_EXPORT(SoftmaxExp);

void fused_attention(const FusedAttentionParams& p) {
  apply_simd_target_env();  // POSENC_SIMD_TARGET, before the first dispatch
  HWY_DYNAMIC_DISPATCH(FusedAttention)(p);
}

void softmax_exp_for_test(const float* x, float* y, int64_t n) {
  apply_simd_target_env();
  HWY_DYNAMIC_DISPATCH(SoftmaxExp)(x, y, n);
}

}  // namespace posenc::kernels
#endif  // HWY_ONCE
