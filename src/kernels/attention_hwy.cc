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
// Size: one kernel class per Highway target (about 1,400 lines), kept in one file because
// foreach_target compiles the file once per target and the prefill and decoding paths are one
// tile loop (Process) over one item state; the decoding micro-kernels are in decode-inl.h, those
// shared with the backward in attention-inl.h and mask-inl.h.
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
#include "kernels/parallel.h"
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
#include "kernels/terms/distance_bias-inl.h"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Query rows per work item: about this many (query heads of the group x positions).
constexpr int64_t kRowsPerItem = 128;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Runs of DeBERTa index entries (see PrepareDeberta).
constexpr int8_t kConst = 0, kLinear = 1, kGather = 2;

// Per-thread buffers of one work item (aligned, reused across tiles).
struct Scratch {
  FetchQueue fetch;  // rows of the next work item (RunSegments)
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
  std::vector<uint64_t> seen;                // decoding: SeenKeys
  hwy::AlignedFreeUniquePtr<uint16_t[]> qb;  // decoding with vdpbf16ps: bf16 query rows
  size_t qb_n = 0;
  size_t qp_n = 0, kt_n = 0, vt_n = 0, s_n = 0, o_n = 0, extra_n = 0, extra2_n = 0, part_n = 0;

  static void Ensure(hwy::AlignedFreeUniquePtr<float[]>& p, size_t& have, size_t want) {
    if (have < want) {
      p = hwy::AllocateAligned<float>(want);
      have = want;
    }
  }
};

// Geometry of one work item.
struct Item {
  int64_t b = 0, hk = 0;
  int64_t i0 = 0, nq = 0;  // query positions [i0, i0 + nq)
  int64_t nkv = 1;         // kv heads covered: hk .. hk + nkv - 1 (all of them when decoding)
  int64_t gstride = 0;     // row slots per kv head: group * nq rounded up to 4
  // Row slot r <-> kv head hk + r / gstride, query head (that) * group + (r % gstride) / nq,
  // query i0 + (r % gstride) % nq; slots with r % gstride >= group * nq are padding (zero q).
  int64_t rows = 0;
  int64_t rows_pad = 0;  // = rows = nkv * gstride (a multiple of 4)
};

// Per-item layout of the scheme terms that depend on the query rows.
struct RowTables {
  // Shaw: qr[r][u], u in [0, 2K + 1 + 2 kTileK): q_r . rel_k[clamp(u - kTileK - K) + K] * scale,
  // so that for a tile whose first relative position is rel0 the values are a contiguous run
  // from u = rel0 + K + kTileK whenever the whole tile lies in [-K - kTileK, K + kTileK].
  int64_t shaw_w = 0;
  // DeBERTa: c2p projections scale * q_r . pos_key[u, h], u < 2K, rows of deb_w floats.
  int64_t deb_w = 0;
  // Transformer-XL: scale * (q_r + v) . r(t) for t in [xl_t0, xl_t0 + xl_w), rows xl_ld floats
  // apart (off a power of two: rows 2^k floats apart would share their cache sets).
  int64_t xl_t0 = 0, xl_w = 0, xl_ld = 0;
};

class ForwardKernel {
 public:
  explicit ForwardKernel(const FusedAttentionParams& p) : p_(p) {
    const DF d;
    lanes_ = static_cast<int64_t>(hn::Lanes(d));
    dim_ = p.head_dim;
    dpad_ = RoundUp(dim_, lanes_);
    group_ = p.heads_q / p.heads_kv;
    // Causal document masks (packed sequences): half the rows per item, so that a document's
    // diagonal tiles waste less (a row's result does not depend on its block).
    const bool causal_docs = p.qdoc != nullptr && p.mask.causal;
    bq_ = std::max<int64_t>(1, (causal_docs ? kRowsPerItem / 2 : kRowsPerItem) / group_);
    nqb_ = (p.seq_q + bq_ - 1) / bq_;
    ntiles_ = (p.seq_k + kTileK - 1) / kTileK;
    // Per batch row, per key tile: min / max position and whether positions are consecutive.
    tile_min_.resize(static_cast<size_t>(p.batch * ntiles_));
    tile_max_.resize(tile_min_.size());
    tile_consec_.resize(tile_min_.size());
    for (int64_t b = 0; b < p.batch; ++b) {
      const int32_t* kp = p.kpos + b * p.seq_k;
      for (int64_t t = 0; t < ntiles_; ++t) {
        const int64_t j0 = t * kTileK, j1 = std::min(p.seq_k, j0 + kTileK);
        int32_t lo = kp[j0], hi = kp[j0];
        bool consec = true;
        for (int64_t j = j0 + 1; j < j1; ++j) {
          lo = std::min(lo, kp[j]);
          hi = std::max(hi, kp[j]);
          consec = consec && kp[j] == kp[j - 1] + 1;
        }
        const size_t at = static_cast<size_t>(b * ntiles_ + t);
        tile_min_[at] = lo;
        tile_max_[at] = hi;
        tile_consec_[at] = consec;
      }
    }
    tiles_ = std::make_unique<TileMasks>(p, kTileK, tile_min_.data(), tile_max_.data());
    if (p.deberta_pos_key != nullptr) PrepareDeberta();
    if (p.xl_sin != nullptr) PrepareXl();
  }

  void Run() {
    const int threads = resolve_threads(p_.num_threads);
    // One scratch per thread for the whole call: items reuse its buffers (allocating them per
    // item cost page faults on every large buffer, e.g. XL's distance band).
    scratch_ = std::vector<Scratch>(static_cast<size_t>(threads));
    const int64_t groups = p_.batch * p_.heads_kv;
    // Few query rows per kv head (decoding): dot products against row-major keys instead of
    // transposed tiles, and one item covers every kv head of a batch row so that each key's
    // heads (adjacent in memory) are read together. Decided by the shape alone, so results never
    // depend on the thread count.
    const int64_t rows_per_kv = RoundUp(group_ * std::min(bq_, p_.seq_q), 4);
    use_dot_ = rows_per_kv <= 8;
    wide_ = use_dot_;
    // Decoding from a bf16 cache with a bf16 query, on a processor with AVX512_BF16: scores by
    // vdpbf16ps on the stored bits (bf16_dot.h). Not with RoPE in the kernel or Transformer-XL,
    // whose query and key rows are float32 by then.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
    bf16dot_ = use_dot_ && p_.q16 != nullptr && p_.k16 != nullptr && p_.q_type == DType::kBF16 &&
               p_.kv_type == DType::kBF16 && p_.rope.cs == nullptr && p_.xl_sin == nullptr &&
               bf16_dot_used(rows_per_kv) && (p_.pages == nullptr || p_.page_size % 4 == 0);
#endif
    qb_stride_ = RoundUp(dim_, 32);
    const int64_t units = wide_ ? p_.batch : groups;
    // Decoding shapes: few items over many keys. Split each item's keys into fixed chunks
    // (depending on the shape only) and merge; otherwise one item = all keys.
    splits_ = 1;
    if (units * nqb_ < 16 && p_.seq_k >= 4 * 1024) {
      splits_ = std::min<int64_t>(64, (p_.seq_k + 2047) / 2048);
    }
    chunk_ = RoundUp((p_.seq_k + splits_ - 1) / splits_, kTileK);
    splits_ = (p_.seq_k + chunk_ - 1) / chunk_;
    const bool shared_tiles = SharedTilesPay();
    block_major_ = !shared_tiles && splits_ == 1 && p_.deberta_pos_key == nullptr;
    if (!use_dot_ && nqb_ * splits_ >= 2 * threads && shared_tiles) {
      // Enough work inside one (batch row, kv head): transpose its keys once into tiles shared
      // by all query blocks, pack its values likewise (see PackValueTile), then run the blocks in
      // parallel. Memory: seq_k x (head_dim + dpad) floats.
      // DeBERTa's p2c products are formed here from the same tiles, one group at a time.
      auto kt_all = hwy::AllocateAligned<float>(static_cast<size_t>(ntiles_ * dim_ * kTileK));
      auto vt_all = hwy::AllocateAligned<float>(static_cast<size_t>(ntiles_ * kTileK * dpad_));
      if (p_.deberta_pos_key != nullptr) AllocateP2c(group_);
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t b = g / p_.heads_kv, hk = g % p_.heads_kv;
        const bool deberta = p_.deberta_pos_key != nullptr;
        if (deberta) slot_base_ = g * group_;  // = b * heads_q + hk * group
        parallel_for(ntiles_, threads, [&](int64_t t) {
          float* kt = kt_all.get() + t * dim_ * kTileK;
          TransposeTile(b, hk, t * kTileK, kt);
          PackValueTile(b, hk, t * kTileK, vt_all.get() + t * kTileK * dpad_);
          for (int64_t h = hk * group_; deberta && h < (hk + 1) * group_; ++h) {
            FillP2c(h, t, kt, P2cSlot(b, h));
          }
        });
        if (deberta) FillDiags(0, group_, threads);
        RunItems(g * nqb_, nqb_, threads, kt_all.get(), vt_all.get());
      }
    } else if (p_.deberta_pos_key != nullptr) {
      // DeBERTa with few query blocks per group: the p2c tables of a wave of work units (enough
      // items to keep every thread busy), then the wave's items; the tables' memory is bounded
      // by the thread count, not by batch x heads.
      const int64_t unit_heads = (wide_ ? p_.heads_kv : 1) * group_;
      const int64_t per_unit = nqb_ * splits_;
      const int64_t wave =
          std::min(units, std::max<int64_t>(1, (4 * threads + per_unit - 1) / per_unit));
      AllocateP2c(wave * unit_heads);
      for (int64_t u = 0; u < units; u += wave) {
        const int64_t nu = std::min(wave, units - u);
        slot_base_ = u * unit_heads;  // heads b * heads_q + h in unit order
        parallel_for(nu * unit_heads * ntiles_, threads, [&](int64_t w) {
          const int64_t t = w % ntiles_, bh = slot_base_ + w / ntiles_;
          const int64_t b = bh / p_.heads_q, h = bh % p_.heads_q;
          Scratch& sc = Local();
          Scratch::Ensure(sc.kt, sc.kt_n, static_cast<size_t>(dim_ * kTileK));
          TransposeTile(b, h / group_, t * kTileK, sc.kt.get());
          FillP2c(h, t, sc.kt.get(), P2cSlot(b, h));
        });
        FillDiags(0, nu * unit_heads, threads);
        RunItems(u * nqb_, nu * nqb_, threads, nullptr);
      }
    } else if (!(block_major_ && !use_dot_ && !wide_ && RunSegments(threads))) {
      RunItems(0, units * nqb_, threads, nullptr);
    }
  }

  // Block masks (documents, packed sequences) whose query blocks each see a few key tiles: runs of
  // consecutive query blocks that start at the same tile (a document's blocks) form a segment,
  // and one work unit = (segment, kv head) transposes and packs the segment's tiles once for all
  // its blocks (per block, a causal document of 4 blocks would transpose 1 + 2 + 3 + 4 tiles
  // instead of 4, and read them from memory as often). Segments hold at most kSegmentBlocks
  // blocks and kSegmentTiles tiles (bounded scratch, enough units for the threads); they depend
  // on the masks alone, and every row is computed as in RunItems (thread-count independent).
  static constexpr int64_t kSegmentBlocks = 8, kSegmentTiles = 16;
  // ProcessShort: at most this many tiles, and S of at most this many cells.
  static constexpr int64_t kShortTiles = 8, kShortCells = 64 * 512;
  struct Segment {
    int64_t b, qb0, qb1;  // query blocks [qb0, qb1) of batch row b
    int64_t t0, t1;       // key tiles [t0, t1) visible to at least one of them
  };

  std::vector<Segment> Segments() const {
    std::vector<Segment> segs;
    for (int64_t b = 0; b < p_.batch; ++b) {
      for (int64_t qb = 0; qb < nqb_; ++qb) {
        const int64_t i0 = qb * bq_, nq = std::min(bq_, p_.seq_q - i0);
        const QueryBlockInfo q = tiles_->Queries(b, i0, nq);
        int64_t first = -1, last = -1;
        for (int64_t t = 0; t < ntiles_; ++t) {
          if (tiles_->Classify(q, b, t, i0, nq) == TileKind::kHidden) continue;
          if (first < 0) first = t;
          last = t;
        }
        const int64_t t0 = first < 0 ? 0 : first, t1 = first < 0 ? 0 : last + 1;
        // A block spread over many tiles (global tokens, long documents): per-block packing.
        if (t1 - t0 > kSegmentTiles) return {};
        if (!segs.empty()) {
          Segment& s = segs.back();
          const bool empty = t0 == t1, seg_empty = s.t0 == s.t1;
          const int64_t lo = std::min(seg_empty ? t0 : s.t0, t0);
          const int64_t hi = std::max(s.t1, t1);
          if (s.b == b && s.qb1 - s.qb0 < kSegmentBlocks && (empty || seg_empty || s.t0 == t0) &&
              hi - lo <= kSegmentTiles) {
            if (!empty) {
              s.t0 = lo;
              s.t1 = hi;
            }
            s.qb1 = qb + 1;
            continue;
          }
        }
        segs.push_back({b, qb, qb + 1, t0, t1});
      }
    }
    return segs;
  }

  // False (nothing run) when the masks give no segments.
  //
  // One work unit = (segment, a run of kv heads): a thread reads a document's rows of every head
  // (adjacent in memory) in turn, and no two threads write the same output cache lines. Each item
  // packs the tiles no earlier block of its head saw. Units are handed out one at a time and a
  // thread claims its next unit when it starts one (parallel_for_ahead), so threads finish
  // within about a unit of each other, and while one item computes, the rows the thread's next
  // item reads (its queries, the tiles it will pack) are fetched toward L2 a few cache lines at a
  // time (FetchQueue): rows heads x head_dim elements apart, a page apart for 8 heads of 128
  // floats, which the processor's own prefetchers (they stay within a page) do not follow. The
  // item's own output rows are not fetched: measured slower, they take L2 room from those rows.
  bool RunSegments(int threads) {
    const std::vector<Segment> segs = Segments();
    if (segs.empty()) return false;
    const int64_t heads = p_.heads_kv, nseg = static_cast<int64_t>(segs.size());
    // An item sees a few tiles here: its products read float32 query rows in place (fetched
    // ahead) rather than after a copy, unless the kernel transforms them (RoPE, Transformer-XL's
    // biases) or a scheme's terms read the packed rows (Shaw, DeBERTa).
    q_in_place_ = !use_dot_ && p_.q16 == nullptr && p_.rope.cs == nullptr && p_.xl_sin == nullptr &&
                  p_.shaw_rel_k == nullptr && p_.deberta_pos_key == nullptr;
    // Kv heads per unit: all, unless that leaves fewer than 4 units per thread.
    int64_t per_unit = heads;
    while (per_unit > 1 && nseg * ((heads + per_unit - 1) / per_unit) < 4 * threads) {
      per_unit = (per_unit + 1) / 2;
    }
    const int64_t chunks = (heads + per_unit - 1) / per_unit, units = nseg * chunks;
    // Per segment, per tile: the first of its blocks that sees the tile (none: the block count);
    // the same for every head.
    std::vector<std::vector<int64_t>> first(static_cast<size_t>(nseg));
    parallel_for(nseg, threads, [&](int64_t g) {
      const Segment& seg = segs[static_cast<size_t>(g)];
      const int64_t nb = seg.qb1 - seg.qb0;
      std::vector<int64_t>& f = first[static_cast<size_t>(g)];
      f.assign(static_cast<size_t>(seg.t1 - seg.t0), nb);
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t i0 = (seg.qb0 + k) * bq_, nq = std::min(bq_, p_.seq_q - i0);
        const QueryBlockInfo q = tiles_->Queries(seg.b, i0, nq);
        for (int64_t t = seg.t0; t < seg.t1; ++t) {
          int64_t& ft = f[static_cast<size_t>(t - seg.t0)];
          if (ft == nb && tiles_->Classify(q, seg.b, t, i0, nq) != TileKind::kHidden) ft = k;
        }
      }
    });
    // Item x of unit u: blocks of the unit's first head, then of the next, ...
    struct Step {
      int64_t g, hk, k;  // segment, kv head, block of the segment
    };
    auto steps = [&](int64_t u) {
      const int64_t h0 = (u % chunks) * per_unit;
      const Segment& seg = segs[static_cast<size_t>(u / chunks)];
      return (std::min(heads, h0 + per_unit) - h0) * (seg.qb1 - seg.qb0);
    };
    auto step = [&](int64_t u, int64_t x) {
      const int64_t g = u / chunks;
      const int64_t nb = segs[static_cast<size_t>(g)].qb1 - segs[static_cast<size_t>(g)].qb0;
      return Step{g, (u % chunks) * per_unit + x / nb, x % nb};
    };
    auto item = [&](const Step& st) {
      const Segment& seg = segs[static_cast<size_t>(st.g)];
      return MakeItem((seg.qb0 + st.k) * p_.batch * heads + seg.b * heads + st.hk);
    };
    // Unit u, then the first item of unit un (-1: none) fetched during its last item.
    auto run_unit = [&](Scratch& sc, int64_t u, int64_t un) {
      const Segment& seg = segs[static_cast<size_t>(u / chunks)];
      const std::vector<int64_t>& f = first[static_cast<size_t>(u / chunks)];
      const int64_t span = seg.t1 - seg.t0;
      Scratch::Ensure(sc.kseg, sc.kseg_n,
                      static_cast<size_t>(std::max<int64_t>(1, span) * dim_ * kTileK));
      Scratch::Ensure(sc.vseg, sc.vseg_n,
                      static_cast<size_t>(std::max<int64_t>(1, span) * kTileK * dpad_));
      for (int64_t x = 0, nx = steps(u); x < nx; ++x) {
        const Step st = step(u, x);
        const Item it = item(st);
        for (int64_t t = seg.t0; t < seg.t1; ++t) {
          if (f[static_cast<size_t>(t - seg.t0)] != st.k) continue;
          TransposeTile(seg.b, st.hk, t * kTileK, sc.kseg.get() + (t - seg.t0) * dim_ * kTileK);
          PackValueTile(seg.b, st.hk, t * kTileK, sc.vseg.get() + (t - seg.t0) * kTileK * dpad_);
        }
        sc.fetch.Clear();
        if (x + 1 < nx || un >= 0) {  // the thread's next item
          const Step nst = x + 1 < nx ? step(u, x + 1) : step(un, 0);
          const Segment& ns = segs[static_cast<size_t>(nst.g)];
          QueueQueryRows(item(nst), sc.fetch);
          for (int64_t t = ns.t0; t < ns.t1; ++t) {
            if (first[static_cast<size_t>(nst.g)][static_cast<size_t>(t - ns.t0)] == nst.k) {
              QueueKeyRows(ns.b, nst.hk, t * kTileK, sc.fetch);
            }
          }
        }
        // The pages of those rows walked now, so that the fetches between the products find
        // them in the TLB (measured 1.5-2.5 % faster).
        sc.fetch.TouchPages();
        const int64_t j_begin = seg.t0 * kTileK, j_end = std::min(p_.seq_k, seg.t1 * kTileK);
        if (!ProcessShort(it, j_begin, j_end, sc.kseg.get(), sc.vseg.get(), sc, seg.t0)) {
          InitAccumulators(it, sc);
          Process(it, j_begin, j_end, sc.kseg.get(), sc.vseg.get(), sc, seg.t0);
        }
        Finish(it, sc);
      }
    };
    parallel_for_ahead(units, threads, [&](int64_t u, int64_t un) {
      Scratch& sc = Local();
      run_unit(sc, u, un);
      if (un < 0) sc.fetch.Clear();
    });
    q_in_place_ = false;
    return true;
  }

  // Queues the key and value rows of keys [j0, j0 + kTileK) of (batch row b, kv head hk), or the
  // query rows of an item, for fetching (RunSegments).
  void QueueKeyRows(int64_t b, int64_t hk, int64_t j0, FetchQueue& q) const {
    const int64_t nk = std::clamp<int64_t>(KeyEnd(b) - j0, 0, kTileK);
    const int64_t kbytes = dim_ * (p_.k16 != nullptr ? 2 : 4);
    const int64_t vbytes = dim_ * (p_.v16 != nullptr ? 2 : 4);
    for (int64_t c = 0; c < nk; ++c) {
      const int64_t ka = KeyAt(b, j0 + c, p_.k_stride) + hk * p_.k_stride[2];
      q.Add(p_.k16 != nullptr ? static_cast<const void*>(p_.k16 + ka) : p_.k + ka, kbytes);
    }
    for (int64_t c = 0; c < nk; ++c) {
      const int64_t va = KeyAt(b, j0 + c, p_.v_stride) + hk * p_.v_stride[2];
      q.Add(p_.v16 != nullptr ? static_cast<const void*>(p_.v16 + va) : p_.v + va, vbytes);
    }
  }
  void QueueQueryRows(const Item& it, FetchQueue& q) const {
    const int64_t bytes = dim_ * (p_.q16 != nullptr ? 2 : 4);
    for (int64_t r = 0; r < it.rows; ++r) {
      if (!Valid(it, r)) continue;
      const int64_t at =
          it.b * p_.q_stride[0] + QueryOf(it, r) * p_.q_stride[1] + HeadOf(it, r) * p_.q_stride[2];
      q.Add(p_.q16 != nullptr ? static_cast<const void*>(p_.q16 + at) : p_.q + at, bytes);
    }
  }

  // Whether transposing and packing every key tile of a group once (shared by its query blocks)
  // costs less than each block packing the tiles it visits: block masks (documents) can leave
  // each tile to a block or two, and per-block packing then also runs every group's items in one
  // parallel loop. Decided from the shape and the masks alone (thread-count independent).
  bool SharedTilesPay() const {
    if (!tiles_->Any()) return true;
    int64_t visits = 0;
    for (int64_t b = 0; b < p_.batch; ++b) {
      for (int64_t qb = 0; qb < nqb_; ++qb) {
        const int64_t i0 = qb * bq_, nq = std::min(bq_, p_.seq_q - i0);
        const QueryBlockInfo q = tiles_->Queries(b, i0, nq);
        for (int64_t t = 0; t < ntiles_; ++t) {
          visits += tiles_->Classify(q, b, t, i0, nq) != TileKind::kHidden;
        }
      }
    }
    return visits >= 4 * p_.batch * ntiles_;
  }

  // Runs items [w0, w0 + count): directly, or with their keys split and merged.
  // kt_all / vt_all: the group's transposed key tiles and packed value tiles, or nullptr (each
  // item then transposes and packs its own).
  void RunItems(int64_t w0, int64_t count, int threads, const float* kt_all,
                const float* vt_all = nullptr) {
    if (splits_ == 1) {
      parallel_for(count, threads, [&](int64_t w) {
        Scratch& sc = Local();
        const Item it = MakeItem(w0 + w);
        InitAccumulators(it, sc);
        Process(it, 0, p_.seq_k, kt_all, vt_all, sc);
        Finish(it, sc);
      });
      return;
    }
    const int64_t rows_max = (wide_ ? p_.heads_kv : 1) * RoundUp(group_ * bq_, 4);
    const int64_t splits = splits_;
    std::vector<float> part_o(static_cast<size_t>(count * splits * rows_max * dpad_));
    std::vector<float> part_m(static_cast<size_t>(count * splits * rows_max));
    std::vector<float> part_l(part_m.size());
    // Shaw's value term: the per-bucket weights are partial sums too.
    const int64_t nw = p_.shaw_rel_v != nullptr ? 2 * p_.shaw_k + 1 : 0;
    std::vector<float> part_w(part_m.size() * static_cast<size_t>(nw));
    parallel_for(count * splits, threads, [&](int64_t ws) {
      const int64_t w = ws / splits, sp = ws % splits;
      Scratch& sc = Local();
      const Item it = MakeItem(w0 + w);
      InitAccumulators(it, sc);
      Process(it, sp * chunk_, std::min(p_.seq_k, (sp + 1) * chunk_), kt_all, vt_all, sc);
      const size_t base = static_cast<size_t>(ws * rows_max);
      for (int64_t r = 0; r < it.rows; ++r) {
        if (!Valid(it, r)) continue;
        part_m[base + static_cast<size_t>(r)] = sc.m[static_cast<size_t>(r)];
        part_l[base + static_cast<size_t>(r)] = sc.l[static_cast<size_t>(r)];
        std::memcpy(&part_o[(base + static_cast<size_t>(r)) * static_cast<size_t>(dpad_)],
                    sc.o.get() + r * dpad_, static_cast<size_t>(dpad_) * sizeof(float));
        if (nw > 0) {
          std::memcpy(&part_w[(base + static_cast<size_t>(r)) * static_cast<size_t>(nw)],
                      sc.wsum.data() + r * nw, static_cast<size_t>(nw) * sizeof(float));
        }
      }
    });
    parallel_for(count, threads, [&](int64_t w) {
      Scratch& sc = Local();
      const Item it = MakeItem(w0 + w);
      InitAccumulators(it, sc);
      sc.wsum.assign(static_cast<size_t>(it.rows * nw), 0.0f);
      for (int64_t r = 0; r < it.rows; ++r) {
        if (!Valid(it, r)) continue;
        float mx = kNegInf;
        for (int64_t sp = 0; sp < splits; ++sp) {
          mx = std::max(mx, part_m[static_cast<size_t>((w * splits + sp) * rows_max + r)]);
        }
        sc.m[static_cast<size_t>(r)] = mx;
        if (mx == kNegInf) continue;
        float l = 0;
        float* o = sc.o.get() + r * dpad_;
        for (int64_t sp = 0; sp < splits; ++sp) {
          const size_t at = static_cast<size_t>((w * splits + sp) * rows_max + r);
          if (part_m[at] == kNegInf) continue;
          const float f = std::exp(part_m[at] - mx);
          l += part_l[at] * f;
          const float* po = &part_o[at * static_cast<size_t>(dpad_)];
          for (int64_t x = 0; x < dpad_; ++x) o[x] += po[x] * f;
          const float* pw = part_w.data() + at * static_cast<size_t>(nw);
          for (int64_t u = 0; u < nw; ++u) sc.wsum[static_cast<size_t>(r * nw + u)] += pw[u] * f;
        }
        sc.l[static_cast<size_t>(r)] = l;
      }
      Finish(it, sc);
    });
  }

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

  // Row-major [rows, dim] -> column tiles [tiles][dim][kTileK] scaled by `scale` (zero padded):
  // the "keys" operand of ScoresTile for a fixed table (DeBERTa's pos_key, XL's r(delta)).
  static void TransposeTable(const float* rows, int64_t n, int64_t row_stride, int64_t dim,
                             float scale, float* out) {
    const int64_t tiles = (n + kTileK - 1) / kTileK;
    std::fill(out, out + tiles * dim * kTileK, 0.0f);
    for (int64_t u = 0; u < n; ++u) {
      float* t = out + (u / kTileK) * dim * kTileK + u % kTileK;
      for (int64_t x = 0; x < dim; ++x) t[x * kTileK] = rows[u * row_stride + x] * scale;
    }
  }

  // DeBERTa, per call: pos_key^T tiles per head (for the per-item c2p products), pos_query
  // scaled (the p2c products are formed in Run, see FillP2c), the rows of pos_query that visible
  // distances use, and per distance whether the next `lanes` index entries are constant,
  // linear (step +-1) or neither.
  void PrepareDeberta() {
    const int64_t span2 = 2 * p_.deberta_span;
    deb_tiles_ = (span2 + kTileK - 1) / kTileK;
    deb_rows_ = RoundUp(span2, 4);
    // Row stride of the p2c table: off a power of two (a 2^k-float stride maps the rows a gather
    // touches onto the same cache sets).
    seq_k_pad_ = RoundUp(p_.seq_k, kTileK) + 16;
    pk_t_ =
        hwy::AllocateAligned<float>(static_cast<size_t>(p_.heads_q * deb_tiles_ * dim_ * kTileK));
    for (int64_t h = 0; h < p_.heads_q; ++h) {
      TransposeTable(p_.deberta_pos_key + h * dim_, span2, p_.heads_q * dim_, dim_, p_.scale,
                     pk_t_.get() + h * deb_tiles_ * dim_ * kTileK);
    }
    pq_ = hwy::AllocateAligned<float>(static_cast<size_t>(p_.heads_q * deb_rows_ * dim_));
    std::fill(pq_.get(), pq_.get() + p_.heads_q * deb_rows_ * dim_, 0.0f);
    for (int64_t h = 0; h < p_.heads_q; ++h) {
      for (int64_t u = 0; u < span2; ++u) {
        for (int64_t x = 0; x < dim_; ++x) {
          pq_[static_cast<size_t>((h * deb_rows_ + u) * dim_ + x)] =
              p_.deberta_pos_query[(u * p_.heads_q + h) * dim_ + x] * p_.scale;
        }
      }
    }
    // Only the pos_query rows that visible distances use (about half under a causal mask).
    int64_t ulo = span2, uhi = 0;
    for (int64_t b = 0; b < p_.batch; ++b) {
      Item all;
      all.b = b;
      all.i0 = 0;
      all.nq = p_.seq_q;
      const auto [dlo, dhi] = VisibleDeltas(all, 0, p_.seq_k);
      const int64_t dmax = p_.deberta_dmax[b];
      // Entries outside the table are distances no key pair has (a row whose queries see no
      // key clips to an empty or shifted range): only the table's own entries are read.
      for (int64_t t = std::max<int64_t>(dmax - dhi, 0);
           t <= std::min<int64_t>(dmax - dlo, p_.deberta_len - 1); ++t) {
        ulo = std::min<int64_t>(ulo, p_.deberta_p2c[t]);
        uhi = std::max<int64_t>(uhi, p_.deberta_p2c[t]);
      }
    }
    deb_u0_ = std::min(ulo, uhi) / 4 * 4;
    deb_nrows_ = RoundUp(uhi + 1 - deb_u0_, 4);
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
    band_lo_ = deb_u0_ + deb_nrows_, band_hi_ = deb_u0_ - 1;
    for (int64_t t = 0; t + lanes_ <= len; ++t) {
      if (p2c_kind_[static_cast<size_t>(t)] != kLinear) continue;
      const int64_t a = p_.deberta_p2c[t], z = p_.deberta_p2c[t + lanes_ - 1];
      band_lo_ = std::min(band_lo_, std::min(a, z));
      band_hi_ = std::max(band_hi_, std::max(a, z));
    }
    band_lo_ = std::max(band_lo_, deb_u0_);
    band_hi_ = std::min(band_hi_, deb_u0_ + deb_nrows_ - 1);
    band_w_ = std::max<int64_t>(0, band_hi_ - band_lo_ + 1);
    diag_stride_ = RoundUp(band_w_, 16) + 16;
    diag_rows_ = band_w_ > 0 ? p_.seq_k + band_w_ - 1 : 0;
  }

  // DeBERTa p2c tables of `slots` (batch row, head) pairs: kpq[u - u0][j] = scale k_j .
  // pos_query[u, h] for the used rows, and the band rows again along diagonals (Diag).
  void AllocateP2c(int64_t slots) {
    p2c_slots_ = slots;
    kpq_ = hwy::AllocateAligned<float>(static_cast<size_t>(slots * deb_nrows_ * seq_k_pad_));
    if (band_w_ > 0) {
      diag_ = hwy::AllocateAligned<float>(static_cast<size_t>(slots * diag_rows_ * diag_stride_));
    }
  }

  // p2c products of key tile t (transposed keys kt) for head h into table slot `slot`.
  void FillP2c(int64_t h, int64_t t, const float* kt, int64_t slot) const {
    ScoresTile(pq_.get() + (h * deb_rows_ + deb_u0_) * dim_, dim_, kt, deb_nrows_,
               kpq_.get() + slot * deb_nrows_ * seq_k_pad_ + t * kTileK, seq_k_pad_);
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
    const float* kpq = kpq_.get() + slot * deb_nrows_ * seq_k_pad_;
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
        const float* src = kpq + (u_at0 + p2c_sign_ * w - deb_u0_) * seq_k_pad_ + w + cj;
        hn::StoreU(hn::GatherIndex(d, src, offs), d, row + w);
      }
      for (; w < wz; ++w) row[w] = kpq[(u_at0 + p2c_sign_ * w - deb_u0_) * seq_k_pad_ + w + cj];
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

  // Transformer-XL: the tiles r(t)^T per head, scaled, that the per-item products read:
  //   r_t[h][t / kTileK][x][t % kTileK] = scale * (W_r R(t))[h * head_dim + x].
  // Computed as W_r (rows: features) times the transposed sinusoid tiles, so each product
  // writes its tile in place; the model dimension is split into chunks whose sinusoid block
  // stays in L1 while every feature row of the head passes over it.
  void PrepareXl() {
    const int64_t dm = p_.xl_dmodel;
    const int threads = resolve_threads(p_.num_threads);
    xl_tiles_ = (p_.xl_len + kTileK - 1) / kTileK;
    dim4_ = RoundUp(dim_, 4);
    auto sin_t = hwy::AllocateAligned<float>(static_cast<size_t>(xl_tiles_ * dm * kTileK));
    parallel_for(xl_tiles_, threads, [&](int64_t tt) {
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
    r_t_ = hwy::AllocateAligned<float>(static_cast<size_t>(p_.heads_q * xl_tiles_ * XlBlock()));
    constexpr int64_t kChunk = 128;  // model dimensions per pass: 128 x kTileK floats = 32 KiB
    parallel_for(p_.heads_q * xl_tiles_, threads, [&](int64_t task) {
      const int64_t h = task / xl_tiles_, tt = task % xl_tiles_;
      float* out = r_t_.get() + task * XlBlock();
      for (int64_t k0 = 0; k0 < dm; k0 += kChunk) {
        ScoresTile(w + h * w_head + k0, std::min(kChunk, dm - k0),
                   sin_t.get() + (tt * dm + k0) * kTileK, dim4_, out, kTileK, dm, k0 > 0);
      }
    });
  }

  // Floats per (head, distance tile) block of r_t_: head_dim rows (padded to 4) of kTileK.
  int64_t XlBlock() const { return dim4_ * kTileK; }

 private:
  // ---- Paged caches (FusedAttentionParams::pages) ----
  // Offset (elements) of key j of batch row b, kv head 0, in k (st = k_stride) or v (v_stride):
  // through the block table when paged.
  HWY_INLINE int64_t KeyAt(int64_t b, int64_t j, const std::array<int64_t, 3>& st) const {
    if (p_.pages == nullptr) return b * st[0] + j * st[1];
    return int64_t{p_.pages[b * p_.pages_stride + j / p_.page_size]} * st[0] +
           (j % p_.page_size) * st[1];
  }
  // Keys of batch row b (all seq_k unless kv_len says fewer).
  int64_t KeyEnd(int64_t b) const { return p_.kv_len == nullptr ? p_.seq_k : p_.kv_len[b]; }
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

  Scratch& Local() { return scratch_[static_cast<size_t>(thread_index()) % scratch_.size()]; }

  Item MakeItem(int64_t w) const {
    Item it;
    // Later query blocks see more keys under a causal mask: hand them out first (dynamic
    // schedule, largest first) so no thread is left with a big block at the end.
    int64_t qb = nqb_ - 1 - w % nqb_;
    int64_t bh = w / nqb_;
    if (block_major_) {
      // Block masks that keep each query block to its own documents: the blocks in order, every
      // kv head of a block in turn, so that a document's keys and values (every head's rows
      // share their cache lines) are read while they are in cache.
      const int64_t units = wide_ ? p_.batch : p_.batch * p_.heads_kv;
      qb = w / units;
      bh = w % units;
    }
    if (wide_) {
      it.b = bh;
      it.hk = 0;
      it.nkv = p_.heads_kv;
    } else {
      it.hk = bh % p_.heads_kv;
      it.b = bh / p_.heads_kv;
    }
    it.i0 = qb * bq_;
    it.nq = std::min(bq_, p_.seq_q - it.i0);
    it.gstride = RoundUp(group_ * it.nq, 4);
    it.rows = it.rows_pad = it.nkv * it.gstride;
    return it;
  }

  bool Valid(const Item& it, int64_t r) const { return r % it.gstride < group_ * it.nq; }
  int64_t HeadOf(const Item& it, int64_t r) const {
    return (it.hk + r / it.gstride) * group_ + (r % it.gstride) / it.nq;
  }
  int64_t QueryOf(const Item& it, int64_t r) const { return it.i0 + (r % it.gstride) % it.nq; }
  int32_t QPos(const Item& it, int64_t r) const {
    return p_.qpos[it.b * p_.seq_q + QueryOf(it, r)];
  }
  // First row slot of query head `hh` (0 <= hh < nkv * group) of the item.
  int64_t HeadRow(const Item& it, int64_t hh) const {
    return (hh / group_) * it.gstride + (hh % group_) * it.nq;
  }

  void InitAccumulators(const Item& it, Scratch& sc) const {
    Scratch::Ensure(sc.o, sc.o_n, static_cast<size_t>(it.rows_pad * dpad_));
    std::fill(sc.o.get(), sc.o.get() + it.rows_pad * dpad_, 0.0f);
    sc.m.assign(static_cast<size_t>(it.rows_pad), kNegInf);
    sc.l.assign(static_cast<size_t>(it.rows_pad), 0.0f);
    sc.normalized = sc.out_done = false;
  }

  // Visible distance range of the item's queries against keys [j_begin, j_end), after the
  // causal / window limits: [dlo, dhi].
  std::pair<int64_t, int64_t> VisibleDeltas(const Item& it, int64_t j_begin, int64_t j_end) const {
    int32_t qlo = std::numeric_limits<int32_t>::max(), qhi = std::numeric_limits<int32_t>::min();
    for (int64_t i = it.i0; i < it.i0 + it.nq; ++i) {
      qlo = std::min(qlo, p_.qpos[it.b * p_.seq_q + i]);
      qhi = std::max(qhi, p_.qpos[it.b * p_.seq_q + i]);
    }
    int32_t klo = std::numeric_limits<int32_t>::max(), khi = std::numeric_limits<int32_t>::min();
    for (int64_t t = j_begin / kTileK; t * kTileK < j_end; ++t) {
      klo = std::min(klo, tile_min_[static_cast<size_t>(it.b * ntiles_ + t)]);
      khi = std::max(khi, tile_max_[static_cast<size_t>(it.b * ntiles_ + t)]);
    }
    int64_t dlo = int64_t{qlo} - khi, dhi = int64_t{qhi} - klo;
    p_.mask.clip_distances(dlo, dhi);
    return {dlo, std::max(dhi, dlo)};
  }

  // Range of table rows index[dmax - delta] over the item's visible distances.
  std::pair<int64_t, int64_t> UsedRows(const Item& it, int64_t j_begin, int64_t j_end,
                                       const int32_t* index, int64_t dmax) const {
    const auto [dlo, dhi] = VisibleDeltas(it, j_begin, j_end);
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
    // Only the table's own entries (distances no key pair has lie outside it).
    for (int64_t t = std::max<int64_t>(dmax - dhi, 0);
         t <= std::min<int64_t>(dmax - dlo, p_.deberta_len - 1); ++t) {
      lo = std::min<int64_t>(lo, index[t]);
      hi = std::max<int64_t>(hi, index[t]);
    }
    return {std::min(lo, hi), hi};
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
    if (bf16dot_) {
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
        if (bf16dot_) std::memcpy(sc.qb.get() + r * qb_stride_, p_.q16 + at, 2 * dim_);
      } else {
        src = p_.q + at;
      }
      if (p_.rope.cs != nullptr) {
        rope_rotate_rows(p_.rope, p_.qpos + it.b * p_.seq_q + i, p_.rope_base[it.b], 1, src, 0,
                         qp + r * dim_, 0);
      } else if (src != qp + r * dim_) {
        std::memcpy(qp + r * dim_, src, static_cast<size_t>(dim_) * sizeof(float));
      }
    }
    const int64_t nq4 = RoundUp(it.nq, 4);
    if (p_.xl_sin != nullptr) {
      // (q + v) rows in extra2, then G[r][t] = scale (q_r + v) . r(t) over the distances the
      // item's visible keys can have; the main product uses q + u.
      Scratch::Ensure(sc.extra2, sc.extra2_n, static_cast<size_t>(alloc_rows * dim_));
      float* qv = sc.extra2.get();
      std::fill(qv, qv + alloc_rows * dim_, 0.0f);
      for (int64_t r = 0; r < it.rows; ++r) {
        if (!Valid(it, r)) continue;
        const int64_t h = HeadOf(it, r);
        for (int64_t c = 0; c < dim_; ++c) {
          qv[r * dim_ + c] = qp[r * dim_ + c] + p_.xl_position_bias[h * dim_ + c];
          qp[r * dim_ + c] += p_.xl_content_bias[h * dim_ + c];
        }
      }
      const auto [dlo, dhi] = VisibleDeltas(it, j_begin, j_end);
      const int64_t t_lo = p_.xl_dmax - dhi, t_hi = p_.xl_dmax - dlo;
      const int64_t tile0 = std::clamp<int64_t>(t_lo / kTileK, 0, xl_tiles_ - 1);
      const int64_t tile1 = std::clamp<int64_t>(t_hi / kTileK, tile0, xl_tiles_ - 1);
      rt.xl_t0 = tile0 * kTileK;
      rt.xl_w = (tile1 - tile0 + 1) * kTileK;
      rt.xl_ld = rt.xl_w + 16;
      Scratch::Ensure(sc.extra, sc.extra_n, static_cast<size_t>((alloc_rows + 1) * rt.xl_ld));
      float* g = sc.extra.get();
      std::fill(g + it.rows * rt.xl_ld, g + (alloc_rows + 1) * rt.xl_ld, 0.0f);
      for (int64_t hh = 0; hh < it.nkv * group_; ++hh) {
        const int64_t h = it.hk * group_ + hh, row0 = HeadRow(it, hh);
        for (int64_t tt = tile0; tt <= tile1; ++tt) {
          ScoresTile(qv + row0 * dim_, dim_, r_t_.get() + (h * xl_tiles_ + tt) * XlBlock(), nq4,
                     g + row0 * rt.xl_ld + (tt - tile0) * kTileK, rt.xl_ld);
        }
      }
    }
    if (p_.shaw_rel_k != nullptr) {
      const int64_t kk = p_.shaw_k;
      rt.shaw_w = 2 * kk + 1 + 2 * kTileK;
      Scratch::Ensure(sc.extra, sc.extra_n, static_cast<size_t>(it.rows * rt.shaw_w));
      std::vector<float> proj(static_cast<size_t>(2 * kk + 1));
      for (int64_t r = 0; r < it.rows; ++r) {
        if (!Valid(it, r)) continue;
        const int64_t h = p_.shaw_rel_k_heads == 1 ? 0 : HeadOf(it, r);
        for (int64_t u = 0; u <= 2 * kk; ++u) {
          const float* rk = p_.shaw_rel_k + (u * p_.shaw_rel_k_heads + h) * dim_;
          proj[static_cast<size_t>(u)] = Dot(qp + r * dim_, rk, dim_) * p_.scale;
        }
        float* row = sc.extra.get() + r * rt.shaw_w;
        for (int64_t u = 0; u < rt.shaw_w; ++u) {
          const int64_t rel = std::clamp<int64_t>(u - kTileK - kk, -kk, kk);
          row[u] = proj[static_cast<size_t>(rel + kk)];
        }
      }
      sc.wsum.assign(static_cast<size_t>(it.rows * (2 * kk + 1)), 0.0f);
    }
    if (p_.deberta_pos_key != nullptr) {
      rt.deb_w = deb_tiles_ * kTileK;
      Scratch::Ensure(sc.extra, sc.extra_n, static_cast<size_t>(alloc_rows * rt.deb_w));
      // Only the pos_key rows the item's visible distances use (about half under a causal
      // mask); masked cells may read other columns, whose scores the mask replaces anyway.
      const auto [ulo, uhi] = UsedRows(it, j_begin, j_end, p_.deberta_c2p, p_.deberta_dmax[it.b]);
      for (int64_t hh = 0; hh < it.nkv * group_; ++hh) {
        const int64_t h = it.hk * group_ + hh, row0 = HeadRow(it, hh);
        for (int64_t tt = ulo / kTileK; tt <= uhi / kTileK; ++tt) {
          ScoresTile(qp + row0 * dim_, dim_, pk_t_.get() + (h * deb_tiles_ + tt) * dim_ * kTileK,
                     nq4, sc.extra.get() + row0 * rt.deb_w + tt * kTileK, rt.deb_w);
        }
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
    for (int64_t j0 = j_begin; j0 < j_end; j0 += kTileK) {
      const int64_t t = j0 / kTileK;
      const size_t ta = static_cast<size_t>(it.b * ntiles_ + t);
      // Skip tiles the masks hide for every row of the block.
      const TileKind kind = tiles_->Classify(qinfo, it.b, t, it.i0, it.nq);
      if (kind == TileKind::kHidden) continue;
      const int64_t nk = std::min(kTileK, j_end - j0);
      if (vt_all != nullptr && j0 + kTileK < j_end) {
        // The group's next key and value tiles toward L2 while this one is computed (measured
        // faster for causal prefill, whose tiles come from L3; docs/performance.md).
        prefetch_l2(kt_all + (t + 1 - tile0) * dim_ * kTileK, dim_ * kTileK * sizeof(float));
        prefetch_l2(vt_all + (t + 1 - tile0) * kTileK * dpad_, kTileK * dpad_ * sizeof(float));
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
        if (Valid(it, r)) {
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

  // DeBERTa's c2p + p2c terms of keys c .. c + lanes - 1 of the tile for row r: c2p from the
  // row's projections at c2p[t], p2c from kpq[p2c[t]][j], t = dmax - delta = deb_off + kpos.
  // With consecutive key positions a run of index entries that is constant is a broadcast (c2p)
  // and a contiguous load (p2c); a linear run is a contiguous load (c2p, reversed when the
  // table falls) and, inside the band, a contiguous load along a diagonal (p2c). Gathers remain
  // for the log-bucket stretches, where the buckets change every few positions. Indices of
  // masked cells may leave the stored rows: they are clamped (the mask replaces those scores).
  // Row of the diagonal copy holding p2c row u at key j (see FillDiag).
  HWY_INLINE int64_t DiagRow(int64_t u, int64_t j) const {
    return p2c_sign_ < 0 ? u - band_lo_ + j : u - band_lo_ - j + p_.seq_k - 1;
  }

  HWY_INLINE hn::Vec<DF> DebertaTerms(int64_t r, int64_t j0, int64_t c, bool consec,
                                      int32_t deb_off, const int32_t* kp, const float* kpq_bh,
                                      const float* diag_bh, hn::Vec<DI> iota, const RowTables& rt,
                                      const Scratch& sc) const {
    const DF d;
    const DI di;
    const int64_t n = lanes_;
    const float* prow = sc.extra.get() + r * rt.deb_w;
    const int32_t u0 = static_cast<int32_t>(deb_u0_);
    const int32_t u1 = static_cast<int32_t>(deb_u0_ + deb_nrows_ - 1);
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

  // s[c] = exp(s[c] - m) for c < end (a multiple of the lanes; exp(-inf) = 0), s[c] = 0 for
  // end <= c < width; returns the sum of the exponentials.
  HWY_INLINE float ExpRow(float* HWY_RESTRICT s, int64_t end, int64_t width, float m) const {
    const DF d;
    const auto vm = hn::Set(d, m);
    auto vsum = hn::Zero(d);
    for (int64_t c = 0; c < end; c += lanes_) {
      const auto e = hn::Exp(d, hn::Sub(hn::Load(d, s + c), vm));
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
    const int64_t h = HeadOf(it, r);
    const int32_t qp = QPos(it, r);
    const auto vscale = hn::Set(d, p_.scale);
    const bool capped = p_.softcap > 0.0f;
    const auto vcap = hn::Set(d, p_.softcap);
    const auto inv_cap = hn::Set(d, capped ? 1.0f / p_.softcap : 0.0f);
    const int32_t* kp = sc.kpos.get();
    const DistanceBiasRow<const float> bias(p_, p_.bias, it.b, h, qp);
    int32_t deb_off = 0;
    const float* kpq_bh = nullptr;  // row u0 of the (b, h) p2c table
    const float* diag_bh = nullptr;
    const float* deb_p2 = nullptr;  // set when the tile's terms are constant (deb_c2 + row)
    float deb_c2 = 0.0f;
    if (p_.deberta_pos_key != nullptr) {
      deb_off = static_cast<int32_t>(p_.deberta_dmax[it.b] - qp);
      const int64_t slot = P2cSlot(it.b, h);
      kpq_bh = kpq_.get() + slot * deb_nrows_ * seq_k_pad_;
      if (band_w_ > 0) diag_bh = diag_.get() + slot * diag_rows_ * diag_stride_;
      if (consec) {
        // Both index tables constant over the whole tile (monotone: compare the ends), as for
        // every distance past the buckets: a scalar c2p term and one p2c row for the tile.
        const int64_t ta = int64_t{deb_off} + kp[0], tz = ta + kTileK - 1;
        const int32_t* c2p = p_.deberta_c2p;
        const int32_t* p2c = p_.deberta_p2c;
        if (c2p[ta] == c2p[tz] && p2c[ta] == p2c[tz]) {
          deb_c2 = sc.extra.get()[r * rt.deb_w + c2p[ta]];
          deb_p2 = kpq_bh +
                   (std::clamp<int64_t>(p2c[ta], deb_u0_, deb_u0_ + deb_nrows_ - 1) - deb_u0_) *
                       seq_k_pad_ +
                   j0;
        }
      }
    }
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
      if (p_.xl_sin != nullptr) {
        // XL: scale * (q + v) . r(delta) from the item's band, (q + u) . k is already in sv.
        const float* g = sc.extra.get() + r * rt.xl_ld;
        const int64_t first = p_.xl_dmax - qp + kp[c] - rt.xl_t0;
        if (consec && first >= 0 && first + n <= rt.xl_w) {
          sv = hn::Add(sv, hn::LoadU(d, g + first));
        } else {
          // Masked cells may fall outside the band: clamp (their score becomes -inf anyway).
          auto idx = hn::Add(hn::Load(di, kp + c),
                             hn::Set(di, static_cast<int32_t>(p_.xl_dmax - qp - rt.xl_t0)));
          idx = hn::Min(hn::Max(idx, hn::Zero(di)), hn::Set(di, static_cast<int32_t>(rt.xl_w - 1)));
          sv = hn::Add(sv, hn::GatherIndex(d, g, idx));
        }
      }
      if (p_.shaw_rel_k != nullptr) {
        const float* row = sc.extra.get() + r * rt.shaw_w;
        const int64_t kk = p_.shaw_k;
        if (consec) {
          const int64_t rel0 = int64_t{kp[0]} - qp + c;
          const int64_t u = std::clamp<int64_t>(rel0 + kk + kTileK, 0, rt.shaw_w - n);
          if (rel0 >= kk) {
            sv = hn::Add(sv, hn::Set(d, row[rt.shaw_w - 1]));
          } else if (rel0 + n - 1 <= -kk) {
            sv = hn::Add(sv, hn::Set(d, row[0]));
          } else {
            sv = hn::Add(sv, hn::LoadU(d, row + u));
          }
        } else {
          alignas(64) float extra[16];
          for (int64_t x = 0; x < n; ++x) {
            const int64_t rel = std::clamp<int64_t>(int64_t{kp[c + x]} - qp, -kk, kk);
            extra[x] = row[rel + kk + kTileK];
          }
          sv = hn::Add(sv, hn::Load(d, extra));
        }
      }
      if (deb_p2 != nullptr) {
        sv = hn::Add(sv, hn::Add(hn::Set(d, deb_c2), hn::LoadU(d, deb_p2 + c)));
      } else if (p_.deberta_pos_key != nullptr) {
        sv = hn::Add(
            sv, DebertaTerms(r, j0, c, consec, deb_off, kp, kpq_bh, diag_bh, lane_iota, rt, sc));
      }
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
    const int32_t* kp = sc.kpos.get();
    const int32_t qp = QPos(it, r);
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
      if (!sc.wsum.empty()) {
        float* w = sc.wsum.data() + r * (2 * p_.shaw_k + 1);
        for (int64_t u = 0; u <= 2 * p_.shaw_k; ++u) w[u] *= corr;
      }
    }
    l = l * corr + tile_sum;
    m = m_new;
    if (p_.shaw_rel_v != nullptr) {
      // Per-bucket weights for Shaw's value term.
      float* w = sc.wsum.data() + r * (2 * p_.shaw_k + 1);
      const int64_t kk = p_.shaw_k;
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
        const int64_t kk = p_.shaw_k;
        const float* w = sc.wsum.data() + r * (2 * kk + 1);
        const int64_t th = p_.shaw_rel_v_heads == 1 ? 0 : h;
        float* orow = sc.o.get() + r * dpad_;
        const DF d;
        const int64_t dv = dim_ / lanes_ * lanes_;
        for (int64_t u = 0; u <= 2 * kk; ++u) {
          if (w[u] == 0.0f) continue;
          const float* rv = p_.shaw_rel_v + (u * p_.shaw_rel_v_heads + th) * dim_;
          const auto wv = hn::Set(d, w[u]);
          for (int64_t x = 0; x < dv; x += lanes_) {
            hn::Store(hn::MulAdd(wv, hn::LoadU(d, rv + x), hn::Load(d, orow + x)), d, orow + x);
          }
          for (int64_t x = dv; x < dim_; ++x) orow[x] += w[u] * rv[x];
        }
        for (int64_t x = 0; x < dim_; ++x) dst[x] = orow[x] * inv;
      } else {
        for (int64_t x = 0; x < dim_; ++x) dst[x] = o[x] * inv;
      }
    }
  }

  const FusedAttentionParams& p_;
  int64_t lanes_ = 1, dim_ = 0, dpad_ = 0, group_ = 1, bq_ = 1, nqb_ = 0, ntiles_ = 0;
  int64_t splits_ = 1, chunk_ = 0;
  bool use_dot_ = false, wide_ = false, bf16dot_ = false;
  bool block_major_ = false;  // items in query-block order (see MakeItem)
  bool q_in_place_ = false;   // products read the query rows in place (RunSegments)
  int64_t qb_stride_ = 0;     // bf16 query rows (bf16dot_): dim rounded up to 32
  std::vector<Scratch> scratch_;
  // DeBERTa and XL tables (see PrepareDeberta / PrepareXl).
  int64_t deb_tiles_ = 0, deb_rows_ = 0, seq_k_pad_ = 0, xl_tiles_ = 0, dim4_ = 0;
  int64_t deb_u0_ = 0, deb_nrows_ = 0;  // stored p2c rows [u0, u0 + nrows)
  int64_t band_lo_ = 0, band_hi_ = -1, band_w_ = 0, diag_stride_ = 0, diag_rows_ = 0;
  int64_t p2c_slots_ = 0, slot_base_ = 0;  // tables held: heads [base, base + slots)
  int c2p_sign_ = 1, p2c_sign_ = 1;
  std::vector<int8_t> c2p_kind_, p2c_kind_;
  hwy::AlignedFreeUniquePtr<float[]> pk_t_, pq_, kpq_, diag_, r_t_;
  std::vector<int32_t> tile_min_, tile_max_;
  std::vector<uint8_t> tile_consec_;
  std::unique_ptr<TileMasks> tiles_;  // block masks per tile
};

void FusedAttention(const FusedAttentionParams& p) {
  ForwardKernel k(p);
  k.Run();
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::kernels {

HWY_EXPORT(FusedAttention);

void fused_attention(const FusedAttentionParams& p) {
  apply_simd_target_env();  // POSENC_SIMD_TARGET, before the first dispatch
  HWY_DYNAMIC_DISPATCH(FusedAttention)(p);
}

}  // namespace posenc::kernels
#endif  // HWY_ONCE
