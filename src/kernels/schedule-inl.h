// src/kernels/schedule-inl.h - the fused kernels' work items and how they are handed to threads.
//
// Forward (ForwardSchedule, the base of attention_hwy.cc's ForwardKernel): one work item =
// (batch row, kv head, block of query positions), or every kv head of a batch row when decoding
// (Item; MakeItem hands later query blocks out first). Run picks one of four schedules from the
// shape and the masks alone, never from the thread count:
//   - enough query blocks per (batch row, kv head): its keys transposed and its values packed
//     once into tiles shared by all its blocks (DeBERTa's p2c products formed from the same
//     tiles), then the blocks in parallel;
//   - DeBERTa otherwise: waves of work units, the p2c tables of a wave first;
//   - block masks (documents) whose blocks each see a few tiles: segments (RunSegments), the
//     next item's rows fetched toward L2 during the current one (FetchQueue);
//   - otherwise every item in one parallel loop, decoding shapes with their keys split into fixed
//     chunks merged exactly afterwards (RunItems).
// Backward (RunWaves): one item per (batch row, kv head), in waves whose partial table gradients
// are reduced in item order.
// Each item is computed by one thread from start to end, so results do not depend on the thread
// count.
//
// Included once per target by the kernels' .cc files after hwy/foreach_target.h (the guard
// below re-expands for each target).
#if defined(POSENC_KERNELS_SCHEDULE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef POSENC_KERNELS_SCHEDULE_INL_H_
#undef POSENC_KERNELS_SCHEDULE_INL_H_
#else
#define POSENC_KERNELS_SCHEDULE_INL_H_
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "kernels/attention-inl.h"
#include "kernels/attention_kernels.h"
#include "kernels/block_mask.h"
#include "kernels/fetch_queue.h"
#include "kernels/parallel.h"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {

// Query rows per work item: about this many (query heads of the group x positions).
constexpr int64_t kRowsPerItem = 128;

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

// The forward's items and their schedule, the base of the kernel K (CRTP), whose per-thread
// buffers are Scratch. K computes: TransposeTile and PackValueTile (a key tile's operands),
// InitAccumulators, Process or ProcessShort, and Finish (an item's rows), and holds DeBERTa's
// p2c tables (deb_, see terms/deberta-inl.h), formed here per group or per wave.
template <class K, class Scratch>
class ForwardSchedule {
 public:
  // Runs every item of the call.
  void Run() {
    K& k = Self();
    const int threads = resolve_threads(p_.num_threads);
    // One scratch per thread for the whole call: items reuse its buffers (allocating them per
    // item cost page faults on every large buffer, e.g. XL's distance band).
    scratch_ = std::vector<Scratch>(static_cast<size_t>(threads));
    const int64_t groups = p_.batch * p_.heads_kv;
    const int64_t units = wide_ ? p_.batch : groups;
    if (!use_dot_ && nqb_ * splits_ >= 2 * threads && shared_tiles_) {
      // Enough work inside one (batch row, kv head): transpose its keys once into tiles shared
      // by all query blocks, pack its values likewise (see PackValueTile), then run the blocks in
      // parallel. Memory: seq_k x (head_dim + dpad) floats.
      // DeBERTa's p2c products are formed here from the same tiles, one group at a time.
      auto kt_all = hwy::AllocateAligned<float>(static_cast<size_t>(ntiles_ * dim_ * kTileK));
      auto vt_all = hwy::AllocateAligned<float>(static_cast<size_t>(ntiles_ * kTileK * dpad_));
      auto* deb = k.deb_.get();
      if (deb != nullptr) deb->AllocateP2c(group_);
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t b = g / p_.heads_kv, hk = g % p_.heads_kv;
        if (deb != nullptr) deb->SetSlotBase(g * group_);  // = b * heads_q + hk * group
        parallel_for(ntiles_, threads, [&](int64_t t) {
          float* kt = kt_all.get() + t * dim_ * kTileK;
          k.TransposeTile(b, hk, t * kTileK, kt);
          k.PackValueTile(b, hk, t * kTileK, vt_all.get() + t * kTileK * dpad_);
          for (int64_t h = hk * group_; deb != nullptr && h < (hk + 1) * group_; ++h) {
            deb->FillP2c(h, t, kt, deb->P2cSlot(b, h));
          }
        });
        if (deb != nullptr) deb->FillDiags(0, group_, threads);
        RunItems(g * nqb_, nqb_, threads, kt_all.get(), vt_all.get());
      }
    } else if (k.deb_ != nullptr) {
      // DeBERTa with few query blocks per group: the p2c tables of a wave of work units (enough
      // items to keep every thread busy), then the wave's items; the tables' memory is bounded
      // by the thread count, not by batch x heads.
      auto* deb = k.deb_.get();
      const int64_t unit_heads = (wide_ ? p_.heads_kv : 1) * group_;
      const int64_t per_unit = nqb_ * splits_;
      const int64_t wave =
          std::min(units, std::max<int64_t>(1, (4 * threads + per_unit - 1) / per_unit));
      deb->AllocateP2c(wave * unit_heads);
      for (int64_t u = 0; u < units; u += wave) {
        const int64_t nu = std::min(wave, units - u);
        const int64_t base = u * unit_heads;  // heads b * heads_q + h in unit order
        deb->SetSlotBase(base);
        parallel_for(nu * unit_heads * ntiles_, threads, [&](int64_t w) {
          const int64_t t = w % ntiles_, bh = base + w / ntiles_;
          const int64_t b = bh / p_.heads_q, h = bh % p_.heads_q;
          Scratch& sc = Local();
          Scratch::Ensure(sc.kt, sc.kt_n, static_cast<size_t>(dim_ * kTileK));
          k.TransposeTile(b, h / group_, t * kTileK, sc.kt.get());
          deb->FillP2c(h, t, sc.kt.get(), deb->P2cSlot(b, h));
        });
        deb->FillDiags(0, nu * unit_heads, threads);
        RunItems(u * nqb_, nu * nqb_, threads, nullptr);
      }
    } else if (!(block_major_ && !use_dot_ && !wide_ && RunSegments(threads))) {
      RunItems(0, units * nqb_, threads, nullptr);
    }
  }

 protected:
  explicit ForwardSchedule(const FusedAttentionParams& p) : p_(p) {
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
    // Few query rows per kv head (decoding): dot products against row-major keys instead of
    // transposed tiles, and one item covers every kv head of a batch row so that each key's
    // heads (adjacent in memory) are read together. Decided by the shape alone, so results never
    // depend on the thread count.
    rows_per_kv_ = RoundUp(group_ * std::min(bq_, p_.seq_q), 4);
    use_dot_ = rows_per_kv_ <= 8;
    wide_ = use_dot_;
    const int64_t units = wide_ ? p_.batch : p_.batch * p_.heads_kv;
    // Decoding shapes: few items over many keys. Split each item's keys into fixed chunks
    // (depending on the shape only) and merge; otherwise one item = all keys.
    splits_ = 1;
    if (units * nqb_ < 16 && p_.seq_k >= 4 * 1024) {
      splits_ = std::min<int64_t>(64, (p_.seq_k + 2047) / 2048);
    }
    chunk_ = RoundUp((p_.seq_k + splits_ - 1) / splits_, kTileK);
    splits_ = (p_.seq_k + chunk_ - 1) / chunk_;
    shared_tiles_ = SharedTilesPay();
    block_major_ = !shared_tiles_ && splits_ == 1 && p_.deberta_pos_key == nullptr;
  }

  // Block masks (documents, packed sequences) whose query blocks each see a few key tiles: runs of
  // consecutive query blocks that start at the same tile (a document's blocks) form a segment,
  // and one work unit = (segment, kv head) transposes and packs the segment's tiles once for all
  // its blocks (per block, a causal document of 4 blocks would transpose 1 + 2 + 3 + 4 tiles
  // instead of 4, and read them from memory as often). Segments hold at most kSegmentBlocks
  // blocks and kSegmentTiles tiles (bounded scratch, enough units for the threads); they depend
  // on the masks alone, and every row is computed as in RunItems (thread-count independent).
  static constexpr int64_t kSegmentBlocks = 8, kSegmentTiles = 16;
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
    K& k = Self();
    const std::vector<Segment> segs = Segments();
    if (segs.empty()) return false;
    const int64_t heads = p_.heads_kv, nseg = static_cast<int64_t>(segs.size());
    // An item sees a few tiles here: its products read float32 query rows in place (fetched
    // ahead) rather than after a copy, unless the kernel transforms them (RoPE, Transformer-XL's
    // biases) or a scheme's terms read the packed rows (Shaw, DeBERTa), or the score tiles take
    // them as bf16 (bf16_operands).
    q_in_place_ = !use_dot_ && p_.q16 == nullptr && p_.rope.cs == nullptr && p_.xl_sin == nullptr &&
                  p_.shaw_rel_k == nullptr && p_.deberta_pos_key == nullptr && !p_.bf16_operands;
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
          k.TransposeTile(seg.b, st.hk, t * kTileK, sc.kseg.get() + (t - seg.t0) * dim_ * kTileK);
          k.PackValueTile(seg.b, st.hk, t * kTileK, sc.vseg.get() + (t - seg.t0) * kTileK * dpad_);
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
        if (!k.ProcessShort(it, j_begin, j_end, sc.kseg.get(), sc.vseg.get(), sc, seg.t0)) {
          k.InitAccumulators(it, sc);
          k.Process(it, j_begin, j_end, sc.kseg.get(), sc.vseg.get(), sc, seg.t0);
        }
        k.Finish(it, sc);
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
    K& k = Self();
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    if (splits_ == 1) {
      parallel_for(count, threads, [&](int64_t w) {
        Scratch& sc = Local();
        const Item it = MakeItem(w0 + w);
        k.InitAccumulators(it, sc);
        k.Process(it, 0, p_.seq_k, kt_all, vt_all, sc);
        k.Finish(it, sc);
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
      k.InitAccumulators(it, sc);
      k.Process(it, sp * chunk_, std::min(p_.seq_k, (sp + 1) * chunk_), kt_all, vt_all, sc);
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
      k.InitAccumulators(it, sc);
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
      k.Finish(it, sc);
    });
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
  // The same for every query of batch row b against all its keys.
  std::pair<int64_t, int64_t> VisibleDeltas(int64_t b) const {
    Item all;
    all.b = b;
    all.i0 = 0;
    all.nq = p_.seq_q;
    return VisibleDeltas(all, 0, p_.seq_k);
  }

  const FusedAttentionParams& p_;
  int64_t lanes_ = 1, dim_ = 0, dpad_ = 0, group_ = 1, bq_ = 1, nqb_ = 0, ntiles_ = 0;
  int64_t splits_ = 1, chunk_ = 0;
  int64_t rows_per_kv_ = 0;  // query rows per kv head of an item, rounded up to 4
  bool use_dot_ = false, wide_ = false;
  bool shared_tiles_ = false;  // see SharedTilesPay
  bool block_major_ = false;   // items in query-block order (see MakeItem)
  bool q_in_place_ = false;    // products read the query rows in place (RunSegments)
  std::vector<Scratch> scratch_;
  std::vector<int32_t> tile_min_, tile_max_;
  std::vector<uint8_t> tile_consec_;
  std::unique_ptr<TileMasks> tiles_;  // block masks per tile

 private:
  K& Self() { return static_cast<K&>(*this); }
};

// The backward's schedule: items [0, items) in waves of at most kPartBudget bytes of partial
// table gradients (part_size floats per item; at least one item per thread), a multiple of the
// thread count when there is more than one wave so that no wave ends with threads idle (7 + 1
// items of XL's 2 MB partials on 2 threads ran 5 rounds instead of 4). run(w, part) computes
// item w into its zeroed partials, reduce(w, part) adds them into the outputs, in item order
// whatever the waves: the results do not depend on them.
template <class RunItem, class Reduce>
void RunWaves(int64_t items, int64_t part_size, int threads, const RunItem& run,
              const Reduce& reduce) {
  constexpr int64_t kPartBudget = int64_t{4} << 20;
  int64_t wave = part_size == 0 ? items
                                : std::clamp<int64_t>(kPartBudget / part_size, threads,
                                                      std::max<int64_t>(items, threads));
  if (wave < items) wave = std::max<int64_t>(threads, wave / threads * threads);
  wave = std::min(wave, items);
  std::vector<float> part(static_cast<size_t>(std::min(wave, items) * part_size));
  for (int64_t w0 = 0; w0 < items; w0 += wave) {
    const int64_t nw = std::min(wave, items - w0);
    std::fill(part.begin(), part.end(), 0.0f);
    parallel_for(nw, threads, [&](int64_t w) { run(w0 + w, part.data() + w * part_size); });
    for (int64_t w = 0; w < nw; ++w) reduce(w0 + w, part.data() + w * part_size);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#endif  // include guard
