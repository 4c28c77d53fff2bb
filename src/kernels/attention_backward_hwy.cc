// src/kernels/attention_backward_hwy.cc - fused (flash-style) attention backward, every scheme.
//
// For a row i with forward output O_i and log-sum-exp lse_i (Dao 2023, "FlashAttention-2",
// Algorithm 2, recomputation):
//   P_ij  = exp(s_ij - lse_i)                      s_ij rebuilt from q, k and the scheme's terms
//   dP_ij = dO_i . (v_j + rel_v[idx_ij])           (Shaw's value term when present)
//   D_i   = dO_i . O_i,   dS_ij = P_ij (dP_ij - D_i)
//   dV_j += P_ij dO_i,    dQ_i += scale dS_ij k_j,   dK_j += scale dS_ij q_i
// and each positional term passes dS on to its own inputs and tables:
//   bias(delta) (ALiBi, T5)   dbias[delta] += dS              (per batch row, head, distance)
//   Shaw q . rel_k[idx]        dQ_i += scale dS rel_k[idx],    drel_k[idx] += scale dS q_i,
//                              drel_v[idx] += P dO_i
//   DeBERTa q . pk[c2p]        dQ_i += scale dS pk[c2p],       dpos_key[c2p] += scale dS q_i
//           k . pq[p2c]        dK_j += scale dS pq[p2c],       dpos_query[p2c] += scale dS k_j
//   XL (q + u) . k             dK_j += scale dS (q_i + u),     du += scale dS k_j
//      (q + v) . r(delta)      dQ_i += scale dS r(delta),      dv += scale dS r(delta),
//                              dr(delta) += scale dS (q_i + v), dr_net = dr^T R
// Per-row terms (Shaw's and DeBERTa's c2p buckets) are summed per query row over the keys and
// applied once per query block, as the forward's per-row projections are.
//
// Work: one item per (batch row, kv head), run by one thread: its query blocks (the group's
// query heads x up to 128 / group positions) visit the key tiles, so dQ of a block is complete
// when the block ends and dK, dV of the kv head are owned by the item. Table gradients are
// summed per item and reduced in item order: results are bit-identical for any thread count.
//
// Files: this one holds the item's steps (InitItem, PlanItem, LoadBlock, LoadTile,
// TileRowScores / TileRowGrads, FinishTile, FinishBlock, FinishItem) over one ItemState; the
// schemes' terms and gradients are in terms/ (distance_bias, shaw, deberta, xl: -inl.h, the
// row tables and row-chunk buffers the last three share in row_tables-inl.h), the waves of
// items in schedule-inl.h (RunWaves), and the micro-kernels shared with the forward in
// attention-inl.h and mask-inl.h.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "kernels/attention_kernels.h"
#include "kernels/bf16_dot.h"
#include "kernels/block_mask.h"
#include "kernels/float_env.h"
#include "kernels/parallel.h"
#include "kernels/simd.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/attention_backward_hwy.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/aligned_allocator.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "kernels/attention-inl.h"
#include "kernels/mask-inl.h"
#include "kernels/schedule-inl.h"
#include "kernels/terms/deberta-inl.h"
#include "kernels/terms/distance_bias-inl.h"
#include "kernels/terms/row_tables-inl.h"
#include "kernels/terms/shaw-inl.h"
#include "kernels/terms/xl-inl.h"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Query rows per block (of all the group's heads): each key tile's operands are read once per
// block, so a taller block reads them from L3 half as often (the block's own rows stay in L2).
constexpr int64_t kBlockRows = 128;
// Runs of rows a diagonal tile's products take separately (more: one run over every row).
constexpr int64_t kMaxRuns = 8;

class BackwardKernel {
 public:
  explicit BackwardKernel(const FusedBackwardParams& p) : b_(p), p_(p.fwd) {
    const DF d;
    lanes_ = static_cast<int64_t>(hn::Lanes(d));
    dim_ = p_.head_dim;
    // Rows of the transposed tile operands: a multiple of 4 as well (ScoresTile's row blocks write
    // dimr = dim rounded up to 4 rows of dK^T and dV^T; on one-lane targets dim rounded to lanes
    // is less).
    dpad_ = RoundUp(dim_, std::max<int64_t>(lanes_, 4));
    group_ = p_.heads_q / p_.heads_kv;
    nq_ = std::max<int64_t>(1, kBlockRows / group_);
    rp_max_ = RoundUp(group_ * nq_, 4);
    ntiles_ = (p_.seq_k + kTileK - 1) / kTileK;
    tile_min_.resize(static_cast<size_t>(p_.batch * ntiles_));
    tile_max_.resize(tile_min_.size());
    for (int64_t bb = 0; bb < p_.batch; ++bb) {
      const int32_t* kp = p_.kpos + bb * p_.seq_k;
      for (int64_t t = 0; t < ntiles_; ++t) {
        const int64_t j0 = t * kTileK, j1 = std::min(p_.seq_k, j0 + kTileK);
        int32_t lo = kp[j0], hi = kp[j0];
        for (int64_t j = j0 + 1; j < j1; ++j) lo = std::min(lo, kp[j]), hi = std::max(hi, kp[j]);
        tile_min_[static_cast<size_t>(bb * ntiles_ + t)] = lo;
        tile_max_[static_cast<size_t>(bb * ntiles_ + t)] = hi;
      }
    }
    tiles_ = std::make_unique<TileMasks>(p_, kTileK, tile_min_.data(), tile_max_.data());
    shaw_ = p_.shaw_rel_k != nullptr;
    deberta_ = !shaw_ && p_.deberta_pos_key != nullptr;
    xl_ = !shaw_ && !deberta_ && p_.xl_sin != nullptr;
    dimr_ = RoundUp(dim_, 4);
    plain_ = !shaw_ && !deberta_ && !xl_ && p_.bias == nullptr && b_.dbias == nullptr &&
             !(p_.softcap > 0.0f);
    // bf16 operands (bf16 training): S and dP tiles by vdpbf16ps when the switch allows it
    // (bf16_dot.h); Transformer-XL's q + u rows are float32 sums, never bf16.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
    bf16_ = p_.bf16_operands && p_.rope.cs == nullptr && !xl_ && bf16_dot_prefill();
#endif
    qs16_ = RoundUp(dim_, 32);
    np16_ = (dim_ + 1) / 2;
    // The schemes' per-row tables (padded and transposed copies; XL's r(t) is built in Run) and
    // their row-chunk buffers.
    rows_ = RowChunks(dim_, dpad_, group_);
    int64_t nch = 0;
    if (shaw_) {
      shaw_t_ = std::make_unique<ShawBackward>(b_, rows_);
      nch = shaw_t_->Chunks();
    } else if (deberta_) {
      deb_t_ = std::make_unique<DebertaBackward>(b_, rows_, dpad_, group_);
      nch = deb_t_->Chunks();
    } else if (xl_) {
      xl_t_ = std::make_unique<XlBackward>(b_);
      nch = xl_t_->Chunks();
    }
    rows_.SetChunks(nch);
    nch_ = nch;
    // Per-item partial table gradients, in floats. Row-table gradients are kept transposed like
    // the tables ([heads][nch][dimr][64]).
    const int64_t tchunk = rows_.ChunkFloats();
    if (shaw_) {
      part_size_ = shaw_t_->PlanParts(group_, tchunk);
    } else if (deberta_) {
      part_size_ = deb_t_->PlanParts(tchunk);
    } else if (xl_) {
      part_size_ = xl_t_->PlanParts(group_, tchunk);
    }
    if (b_.dsinks != nullptr) {  // dsinks of the group's heads, last
      part_sink_ = part_size_;
      part_size_ += group_;
    }
  }

  void Run() {
    const int threads = resolve_threads(p_.num_threads);
    scratch_ = std::vector<Scratch>(static_cast<size_t>(threads));
    cache_ = std::vector<Scratch>(static_cast<size_t>(threads));
    if (xl_) xl_t_->Prepare(rows_, threads);
    ZeroTables();
    RunWaves(
        p_.batch * p_.heads_kv, part_size_, threads,
        [&](int64_t w, float* part) {
          const FlushSubnormalResults ftz;  // float_env.h: P and dS below 2^-126
          RunItem(w, Local(), part);
        },
        [&](int64_t w, const float* part) { Reduce(w, part); });
    if (xl_) xl_t_->ProjectGradient(threads);
  }

 private:
  struct Scratch {
    hwy::AlignedFreeUniquePtr<float[]> buf;
    size_t n = 0;
    float* Get(size_t want) {
      if (n < want) {
        buf = hwy::AllocateAligned<float>(want);
        n = want;
      }
      return buf.get();
    }
  };

  Scratch& Local() { return scratch_[static_cast<size_t>(thread_index())]; }
  Scratch& LocalCache() { return cache_[static_cast<size_t>(thread_index())]; }

  // Key rows kp [nk x dpad] (zero padded), K^T and V^T [dim x kTileK] of keys [j0, j0 + nk) of one
  // (batch row, kv head); columns past nk stay as they are (zero-filled by the caller).
  void TileOperands(int64_t bb, const float* kbase, const float* vbase, int64_t j0, int64_t nk,
                    float* kp, float* ktr, float* vtr) const {
    if (p_.rope.cs != nullptr) {  // RoPE: key rows rotated as they are loaded
      rope_rotate_rows(p_.rope, p_.kpos + bb * p_.seq_k + j0, p_.rope_base[bb], nk,
                       kbase + j0 * p_.k_stride[1], p_.k_stride[1], kp, dpad_);
    }
    if (p_.rope.cs == nullptr) {
      for (int64_t c = 0; c < nk; ++c) {
        std::memcpy(kp + c * dpad_, kbase + (j0 + c) * p_.k_stride[1],
                    static_cast<size_t>(dim_) * sizeof(float));
      }
    }
    TransposeRows(kp, dpad_, nk, dim_, ktr);
    TransposeRows(vbase + j0 * p_.v_stride[1], p_.v_stride[1], nk, dim_, vtr);
    for (int64_t x = 0; x < dim_; ++x) {
      std::fill(ktr + x * kTileK + nk, ktr + (x + 1) * kTileK, 0.0f);
      std::fill(vtr + x * kTileK + nk, vtr + (x + 1) * kTileK, 0.0f);
    }
  }

  static float* OutRow(float* base, const std::array<int64_t, 3>& st, int64_t b, int64_t j,
                       int64_t h) {
    return base + b * st[0] + j * st[1] + h * st[2];
  }
  // dst[x] += column c of a transposed [dpad x kTileK] tile, x < dim.
  void AddColumn(const float* tile, int64_t c, float* dst) const {
    for (int64_t x = 0; x < dim_; ++x) dst[x] += tile[x * kTileK + c];
  }
  static void AddRow(const float* src, float* dst, int64_t n) {
    for (int64_t x = 0; x < n; ++x) dst[x] += src[x];
  }

  void ZeroTables() {
    if (b_.dbias != nullptr) std::fill(b_.dbias, b_.dbias + p_.batch * p_.bias_batch_stride, 0.0f);
    if (b_.dsinks != nullptr) std::fill(b_.dsinks, b_.dsinks + p_.heads_q, 0.0f);
    if (shaw_) shaw_t_->ZeroGrads(dim_);
    if (deberta_) deb_t_->ZeroGrads();
    if (xl_) xl_t_->ZeroGrads();
  }

  // Adds item w's partial table gradients into the outputs (called in item order).
  void Reduce(int64_t w, const float* part) {
    const int64_t hk = w % p_.heads_kv;
    if (b_.dsinks != nullptr) {
      for (int64_t g = 0; g < group_; ++g) b_.dsinks[hk * group_ + g] += part[part_sink_ + g];
    }
    if (shaw_) {
      shaw_t_->Reduce(rows_, part, hk);
    } else if (deberta_) {
      deb_t_->Reduce(rows_, part, hk);
    } else if (xl_) {
      xl_t_->Reduce(rows_, part, hk);
    }
  }

  // One work item (batch row, kv head) of RunItem: its scratch layout, per-item buffers, the
  // query position range of each block, and (when they fit the budget) its key tiles formed once.
  struct ItemState {
    int64_t bb, hk, rpm, dp, kt, dimr, cs, nblocks, n_all, n_cache;
    size_t n_rows, n_tile, n_ktile, n_rel, n_rel2;
    float *base, *qb, *qx, *dob, *dqb, *dqr, *s, *dps, *qtr, *dotr, *qxtr, *kp_s, *dkt_s, *dvt_s,
        *dkx, *ktr_s, *vtr_s, *rel1, *rel2, *w1, *w2, *dsum, *lse, *kp_all, *kt_all, *vt_all,
        *dk_all, *dv_all, *part;
    hwy::AlignedFreeUniquePtr<int32_t[]> addr_buf;
    hwy::AlignedFreeUniquePtr<int32_t[]> kpt_buf;
    int32_t *addr, *kpt;
    // bf16 operands (bf16_): the block's q and dout rows as bf16 bits (qs16_ apart, zero
    // padded), and the key and value tiles as pairs of dims (bf16_dot.h; every tile's when the
    // item holds its tiles, else the current one's).
    hwy::AlignedFreeUniquePtr<uint16_t[]> rows16_buf;
    hwy::AlignedFreeUniquePtr<uint32_t[]> tiles16_buf;
    uint16_t *qb16 = nullptr, *dob16 = nullptr;
    uint32_t *kt16 = nullptr, *vt16 = nullptr;
    std::vector<int32_t> cols;  // per block row, the keys of a diagonal tile it can see
    // Block masks: the tile's key documents and open flags, one row of the dense mask, and the
    // current query block.
    hwy::AlignedFreeUniquePtr<int32_t[]> kdoc_buf, kopen_buf, dense_buf;
    int64_t blk_i0 = 0, blk_nq = 0;
    std::vector<int32_t> qpos;
    std::vector<int32_t> bq_min;
    std::vector<int32_t> bq_max;
    std::vector<int64_t> head;
    float scale;
    const int32_t* kposb;
    const float *kbase, *vbase;
    bool cached;
    // Cached items: the next tile's operands and dK^T, dV^T (in L3: an item's tiles outgrow L2),
    // fetched into L2 a few lines between the register blocks of the current tile's products.
    FetchQueue fetch;
    int64_t fetch_n = 0;
    DebertaItem deb;  // DeBERTa's p2c terms
  };
  // A query block of an item: rows [i0, i0 + nq) of each of the group's heads.
  struct Block {
    int64_t i0, nq, rows, rp;
    int32_t qmin, qmax;
    BlockRows br;
  };
  // A key tile of an item: keys [j0, j0 + nk), their operands and dK^T, dV^T tiles.
  struct Tile {
    int64_t t, j0, nk;
    bool consec;
    float *kp, *ktr, *vtr, *dkt, *dvt;
    // A causal tile the diagonal crosses (consecutive key positions): row r sees at most its
    // first cols[r] keys (null: every key), and the rows that see any form the runs
    // [run_lo[i], run_hi[i]) (the products over the block's rows skip the others).
    const int32_t* cols;
    int64_t runs;
    std::array<int64_t, kMaxRuns> run_lo, run_hi;
  };

  // Whether a query block with positions [qmin, qmax] may see a key of tile t by the causal,
  // window and chunk limits (every tile when block masks open some tokens past them).
  bool Visits(const ItemState& st, int32_t qmin, int32_t qmax, int64_t t) const {
    if (tiles_->Opens()) return true;
    const int32_t tmin = tile_min_[static_cast<size_t>(st.bb * ntiles_ + t)];
    const int32_t tmax = tile_max_[static_cast<size_t>(st.bb * ntiles_ + t)];
    return !p_.mask.hides_block(qmin, qmax, tmin, tmax);
  }
  // Widens [dlo, dhi] by the distances pos_q - pos_k between a query block with positions
  // [qmin, qmax] and tile t, when the block sees the tile.
  void AddDistances(const ItemState& st, int32_t qmin, int32_t qmax, int64_t t, int64_t& dlo,
                    int64_t& dhi) const {
    if (!Visits(st, qmin, qmax, t)) return;
    const auto at = static_cast<size_t>(st.bb * ntiles_ + t);
    dlo = std::min<int64_t>(dlo, int64_t{qmin} - tile_max_[at]);
    dhi = std::max<int64_t>(dhi, int64_t{qmax} - tile_min_[at]);
  }

  // The item's scratch layout (one zeroed buffer per thread) and per-item buffers.
  void InitItem(ItemState& st, int64_t w, Scratch& sc, float* part) {
    st.part = part;
    st.bb = w / p_.heads_kv, st.hk = w % p_.heads_kv;
    const int64_t rpm = rp_max_, dp = dpad_, kt = kTileK;
    st.rpm = rpm, st.dp = dp, st.kt = kt, st.dimr = RoundUp(dim_, 4);
    // Scratch layout (floats).
    const size_t n_rows = st.n_rows = static_cast<size_t>(rpm * dp);
    const size_t n_tile = st.n_tile = static_cast<size_t>(rpm * kt);
    const size_t n_ktile = st.n_ktile = static_cast<size_t>(kt * dp);
    // Row-chunk buffers: rpm rows and 4 spare ones (Project's rounding) per chunk.
    st.cs = (rpm + 4) * kt;
    const size_t n_rel = st.n_rel = static_cast<size_t>(nch_ * st.cs);
    const size_t n_rel2 = st.n_rel2 = shaw_ && p_.shaw_rel_v != nullptr ? n_rel : 0;  // rel_v
    const size_t total = 8 * n_rows + 2 * n_tile + 4 * n_ktile +
                         2 * static_cast<size_t>(dim_ * kt) + 2 * n_rel + 2 * n_rel2 +
                         2 * static_cast<size_t>(rpm);
    st.base = sc.Get(total);
    std::fill(st.base, st.base + total, 0.0f);
    st.qb = st.base;                  // q (XL: q + u) rows, dpad wide
    st.qx = st.qb + n_rows;           // XL: q + v
    st.dob = st.qx + n_rows;          // dout rows
    st.dqb = st.dob + n_rows;         // dQ of the block
    st.dqr = st.dqb + n_rows;         // XL: dQ's r(delta) part
    st.s = st.dqr + n_rows;           // scores, then P [rpm x kt]
    st.dps = st.s + n_tile;           // dP, then scale * dS
    st.qtr = st.dps + n_tile;         // Q^T (XL: (q + u)^T) [dpad x rpm]
    st.dotr = st.qtr + n_rows;        // dO^T [dpad x rpm]
    st.qxtr = st.dotr + n_rows;       // XL: (q + v)^T
    st.kp_s = st.qxtr + n_rows;       // key rows [kt x dpad]
    st.dkt_s = st.kp_s + n_ktile;     // dK^T tile [dpad x kt]
    st.dvt_s = st.dkt_s + n_ktile;    // dV^T tile [dpad x kt]
    st.dkx = st.dvt_s + n_ktile;      // DeBERTa p2c's dK rows of the tile (without item buffers)
    st.ktr_s = st.dkx + n_ktile;      // K^T [dim x kt]
    st.vtr_s = st.ktr_s + dim_ * kt;  // V^T
    // Row-chunk buffers: rel1 = scale q . rel_k (Shaw), scale q . pos_key (DeBERTa c2p),
    // scale (q + v) . r(t) (XL), w1 their sums of scale dS per table row; Shaw's rel_v:
    // rel2 = dout . rel_v, w2 the sums of P.
    st.rel1 = st.vtr_s + dim_ * kt;
    st.rel2 = n_rel2 > 0 ? st.rel1 + n_rel : nullptr;
    st.w1 = st.rel1 + n_rel + n_rel2;
    st.w2 = n_rel2 > 0 ? st.w1 + n_rel : nullptr;
    st.dsum = st.w1 + n_rel + n_rel2;
    st.lse = st.dsum + rpm;
    st.addr_buf = hwy::AllocateAligned<int32_t>(static_cast<size_t>(kTileK));
    st.addr = st.addr_buf.get();  // row-chunk address of each key's table row
    st.qpos.assign(static_cast<size_t>(rpm), {});
    st.head.assign(static_cast<size_t>(rpm), {});
    st.kpt_buf = hwy::AllocateAligned<int32_t>(static_cast<size_t>(kTileK));
    st.kpt = st.kpt_buf.get();
    std::fill(st.kpt, st.kpt + kTileK, 0);
    if (bf16_) {
      const size_t n16 = static_cast<size_t>(rpm * qs16_);
      st.rows16_buf = hwy::AllocateAligned<uint16_t>(2 * n16);
      std::fill(st.rows16_buf.get(), st.rows16_buf.get() + 2 * n16, uint16_t{0});
      st.qb16 = st.rows16_buf.get();
      st.dob16 = st.qb16 + n16;
    }

    st.scale = p_.scale;
    st.kposb = p_.kpos + st.bb * p_.seq_k;
    st.kbase = p_.k + st.bb * p_.k_stride[0] + st.hk * p_.k_stride[2];
    st.vbase = p_.v + st.bb * p_.v_stride[0] + st.hk * p_.v_stride[2];
  }

  // The item's plan: the query position range of each block, the table rows of DeBERTa's p2c per
  // key tile, and its key tiles formed once when they fit the budget.
  //
  // When they fit the per-thread budget, the item's key rows, K^T and V^T tiles are formed once
  // and dK^T, dV^T accumulate in item buffers written out at the end; otherwise every (query
  // block, key tile) step forms its tiles and adds its dK, dV into the outputs. dK and dV are
  // kept transposed ([dpad x kTileK] per tile) so that their products, dV^T += dO^T P and
  // dK^T += Q^T dS, read P and dS as they are formed, with no per-step transposes.
  // DeBERTa's p2c tables join them (DebertaItem); without the buffers, its p2c terms go per
  // cell.
  void PlanItem(ItemState& st) {
    const int64_t bb = st.bb, hk = st.hk, dp = st.dp, kt = st.kt;
    const int64_t nblocks = st.nblocks = (p_.seq_q + nq_ - 1) / nq_;
    st.bq_min.assign(static_cast<size_t>(nblocks), 0);
    st.bq_max.assign(st.bq_min.size(), 0);
    for (int64_t bi = 0; bi < nblocks; ++bi) {
      int32_t lo = std::numeric_limits<int32_t>::max(), hi = std::numeric_limits<int32_t>::min();
      for (int64_t i = bi * nq_; i < std::min(p_.seq_q, (bi + 1) * nq_); ++i) {
        lo = std::min(lo, p_.qpos[bb * p_.seq_q + i]);
        hi = std::max(hi, p_.qpos[bb * p_.seq_q + i]);
      }
      st.bq_min[static_cast<size_t>(bi)] = lo, st.bq_max[static_cast<size_t>(bi)] = hi;
    }
    const int64_t n_all = st.n_all = ntiles_ * kt * dp;
    const int64_t budget = backward_item_budget();
    if (deberta_) {
      // The distances the item's blocks can see on each key tile (the bucket tables are monotone
      // in the distance, but scanned anyway: the range is at most the sequence).
      deb_t_->PlanItem(st.deb, bb, ntiles_, 5 * n_all, budget, [&](int64_t t) {
        int64_t dlo = std::numeric_limits<int64_t>::max();
        int64_t dhi = std::numeric_limits<int64_t>::min();
        for (int64_t bi = 0; bi < nblocks; ++bi) {
          AddDistances(st, st.bq_min[static_cast<size_t>(bi)], st.bq_max[static_cast<size_t>(bi)],
                       t, dlo, dhi);
        }
        p_.mask.clip_distances(dlo, dhi);
        return std::pair<int64_t, int64_t>{dlo, dhi};
      });
    }
    st.cached = (5 * n_all + 2 * st.deb.n_p2c) * static_cast<int64_t>(sizeof(float)) <= budget;
    st.n_cache = 5 * n_all + st.deb.Floats();
    st.kp_all = nullptr, st.kt_all = nullptr, st.vt_all = nullptr, st.dk_all = nullptr,
    st.dv_all = nullptr;
    if (st.cached) {
      st.kp_all = LocalCache().Get(static_cast<size_t>(st.n_cache));
      st.kt_all = st.kp_all + n_all;
      st.vt_all = st.kt_all + n_all;
      st.dk_all = st.vt_all + n_all;
      st.dv_all = st.dk_all + n_all;
      // Zero what TileOperands leaves unwritten: the key rows' padding columns and the rows past
      // seq_k (K^T and V^T are written whole), and every accumulator from dK^T on.
      if (dp > dim_) {
        for (int64_t j = 0; j < p_.seq_k; ++j) {
          std::fill(st.kp_all + j * dp + dim_, st.kp_all + (j + 1) * dp, 0.0f);
        }
      }
      std::fill(st.kp_all + p_.seq_k * dp, st.kp_all + n_all, 0.0f);
      std::fill(st.dk_all, st.kp_all + st.n_cache, 0.0f);
      if (deberta_) deb_t_->SetBuffers(st.deb, st.dv_all + n_all);
      for (int64_t t = 0; t < ntiles_; ++t) {
        const int64_t j0 = t * kt, nk = std::min(kt, p_.seq_k - j0);
        TileOperands(bb, st.kbase, st.vbase, j0, nk, st.kp_all + j0 * dp, st.kt_all + t * dim_ * kt,
                     st.vt_all + t * dim_ * kt);
        if (deberta_) deb_t_->FillTile(st.deb, t, hk, ntiles_, st.kt_all + t * dim_ * kt);
      }
    }
    if (bf16_) {
      const int64_t n16 = np16_ * kt, tiles = st.cached ? ntiles_ : 1;
      st.tiles16_buf = hwy::AllocateAligned<uint32_t>(static_cast<size_t>(2 * tiles * n16));
      st.kt16 = st.tiles16_buf.get();
      st.vt16 = st.kt16 + tiles * n16;
      for (int64_t t = 0; st.cached && t < ntiles_; ++t) {
        pack_bf16_pairs(st.kt_all + t * dim_ * kt, dim_, st.kt16 + t * n16);
        pack_bf16_pairs(st.vt_all + t * dim_ * kt, dim_, st.vt16 + t * n16);
      }
    }
    // Without the item buffers dK, dV accumulate tile by tile in the outputs: start from zero.
    for (int64_t j = 0; !st.cached && j < p_.seq_k; ++j) {
      std::fill(OutRow(b_.dk, b_.dk_stride, bb, j, hk),
                OutRow(b_.dk, b_.dk_stride, bb, j, hk) + dim_, 0.0f);
      std::fill(OutRow(b_.dv, b_.dv_stride, bb, j, hk),
                OutRow(b_.dv, b_.dv_stride, bb, j, hk) + dim_, 0.0f);
    }
  }

  // A query block's rows: q (rotated for RoPE; XL: q + u and q + v), dout, D = dout . out, lse,
  // their transposes, and the per-row table projections of the rows its cells can reach.
  Block LoadBlock(ItemState& st, int64_t i0) {
    const auto base = st.base;
    const auto n_rows = st.n_rows;
    const auto lse = st.lse;
    const auto dsum = st.dsum;
    const auto hk = st.hk;
    const auto bb = st.bb;
    const auto qb = st.qb;
    const auto dp = st.dp;
    const auto dob = st.dob;
    const auto qx = st.qx;
    const auto part = st.part;
    const auto qtr = st.qtr;
    const auto dotr = st.dotr;
    const auto qxtr = st.qxtr;
    const auto cs = st.cs;
    const auto w1 = st.w1;
    const auto w2 = st.w2;
    const auto rel1 = st.rel1;
    const auto rel2 = st.rel2;
    const int64_t nq = std::min(nq_, p_.seq_q - i0);
    const int64_t rows = group_ * nq, rp = RoundUp(rows, 4);
    int32_t qmin = std::numeric_limits<int32_t>::max(), qmax = std::numeric_limits<int32_t>::min();
    std::fill(base, base + 5 * n_rows, 0.0f);
    for (int64_t r = 0; r < rp; ++r) {
      lse[r] = -std::numeric_limits<float>::infinity();
      dsum[r] = 0.0f;
      if (r >= rows) continue;
      const int64_t g = r / nq, i = i0 + r % nq, h = hk * group_ + g;
      st.head[static_cast<size_t>(r)] = h;
      st.qpos[static_cast<size_t>(r)] = p_.qpos[bb * p_.seq_q + i];
      qmin = std::min(qmin, st.qpos[static_cast<size_t>(r)]);
      qmax = std::max(qmax, st.qpos[static_cast<size_t>(r)]);
      const float* qr = p_.q + bb * p_.q_stride[0] + i * p_.q_stride[1] + h * p_.q_stride[2];
      const float* orow =
          p_.out + bb * p_.out_stride[0] + i * p_.out_stride[1] + h * p_.out_stride[2];
      const float* dor =
          b_.dout + bb * b_.dout_stride[0] + i * b_.dout_stride[1] + h * b_.dout_stride[2];
      if (p_.rope.cs != nullptr) {
        rope_rotate_rows(p_.rope, p_.qpos + bb * p_.seq_q + i, p_.rope_base[bb], 1, qr, 0,
                         qb + r * dp, 0);
      } else {
        std::memcpy(qb + r * dp, qr, static_cast<size_t>(dim_) * sizeof(float));
      }
      std::memcpy(dob + r * dp, dor, static_cast<size_t>(dim_) * sizeof(float));
      if (xl_) XlAddBiases(p_, h, dim_, qb + r * dp, qx + r * dp);  // q + u, q + v
      dsum[r] = Dot(dor, orow, dim_);
      lse[r] = p_.lse[bb * p_.lse_stride[0] + h * p_.lse_stride[1] + i * p_.lse_stride[2]];
      if (b_.dsinks != nullptr && lse[r] != kNegInf) {
        // The sink's probability exp(sink - lse) times dP - D with dP = 0 (it has no value).
        part[part_sink_ + (h - hk * group_)] -= std::exp(p_.sinks[h] - lse[r]) * dsum[r];
      }
    }
    TransposeRows(qb, dp, rp, dim_, qtr, rp);
    TransposeRows(dob, dp, rp, dim_, dotr, rp);
    if (bf16_) {  // bf16 values exactly: their high halves (rows past `rows` are zero)
      for (int64_t r = 0; r < rp; ++r) {
        for (int64_t x = 0; x < dim_; ++x) {
          uint32_t uq, ud;
          std::memcpy(&uq, qb + r * dp + x, sizeof uq);
          std::memcpy(&ud, dob + r * dp + x, sizeof ud);
          st.qb16[r * qs16_ + x] = static_cast<uint16_t>(uq >> 16);
          st.dob16[r * qs16_ + x] = static_cast<uint16_t>(ud >> 16);
        }
      }
    }
    if (xl_) TransposeRows(qx, dp, rp, dim_, qxtr, rp);
    // Per-row tables and bucket sums.
    BlockRows br{rows, rp, nq, hk, cs, 0, nch_};
    if (shaw_ || deberta_ || xl_) {
      // Only the chunks of table rows this block's cells can reach.
      int64_t dlo = std::numeric_limits<int64_t>::max(), dhi = std::numeric_limits<int64_t>::min();
      for (int64_t t = 0; t < ntiles_; ++t) {
        AddDistances(st, qmin, qmax, t, dlo, dhi);
      }
      p_.mask.clip_distances(dlo, dhi);
      if (dlo > dhi) {
        br.c1 = 0;
      } else if (shaw_) {
        shaw_t_->BlockChunks(dlo, dhi, br);
      } else if (xl_) {
        xl_t_->BlockChunks(dlo, dhi, br);
      } else {
        deb_t_->BlockChunks(bb, dlo, dhi, br);
      }
      std::fill(w1 + br.c0 * cs, w1 + br.c1 * cs, 0.0f);
      if (w2 != nullptr) std::fill(w2 + br.c0 * cs, w2 + br.c1 * cs, 0.0f);
      if (shaw_) {
        shaw_t_->Project(rows_, qb, dob, rel1, rel2, br);
      } else if (deberta_) {
        deb_t_->Project(rows_, qb, rel1, br);
      } else {
        xl_t_->Project(rows_, qx, rel1, br);
      }
    }
    return Block{i0, nq, rows, rp, qmin, qmax, br};
  }

  // Queues the item's buffers of the tile the block visits after t (the next block's first
  // tile after its last) for the products of tile t to fetch; none unless the item holds its
  // tiles. Returns the queue, or null.
  FetchQueue* QueueNextTile(ItemState& st, const Block& blk, int64_t t) {
    st.fetch.Clear();
    if (!st.cached) return nullptr;
    int64_t u = t + 1;
    while (u < ntiles_ && !Visits(st, blk.qmin, blk.qmax, u)) ++u;
    if (u == ntiles_) u = 0;
    const int64_t kt = st.kt, dp = st.dp, nk = std::min(kt, p_.seq_k - u * kt);
    const auto bytes = [](int64_t floats) { return floats * static_cast<int64_t>(sizeof(float)); };
    st.fetch.Add(st.kp_all + u * kt * dp, bytes(nk * dp));
    st.fetch.Add(st.kt_all + u * dim_ * kt, bytes(dim_ * kt));
    st.fetch.Add(st.vt_all + u * dim_ * kt, bytes(dim_ * kt));
    st.fetch.Add(st.dk_all + u * dp * kt, bytes(dim_ * kt));
    st.fetch.Add(st.dv_all + u * dp * kt, bytes(dim_ * kt));
    // Spread over the register blocks of the tile's five products (two score-like products of
    // the block's rows, two of the dims, one P.V-like over the block's rows).
    const int64_t blocks = ProductBlocks(blk.rp, 0, 2, 0) + ProductBlocks(dimr_, 0, 2, 0) +
                           ProductBlocks(blk.rp, dpad_, 0, 1);
    st.fetch_n = (st.fetch.Pending() + blocks - 1) / std::max<int64_t>(1, blocks);
    return &st.fetch;
  }

  // Tile t's key positions and operands (formed here unless the item holds them), and the
  // block's scores S = Q K^T and dP = dO V^T on it.
  Tile LoadTile(ItemState& st, const Block& blk, int64_t t, bool full) {
    const auto kt = st.kt;
    const auto kpt = st.kpt;
    const auto kposb = st.kposb;
    const auto kp_s = st.kp_s;
    const auto ktr_s = st.ktr_s;
    const auto vtr_s = st.vtr_s;
    const auto dkt_s = st.dkt_s;
    const auto dvt_s = st.dvt_s;
    const auto cached = st.cached;
    const auto kp_all = st.kp_all;
    const auto dp = st.dp;
    const auto kt_all = st.kt_all;
    const auto vt_all = st.vt_all;
    const auto dk_all = st.dk_all;
    const auto dv_all = st.dv_all;
    const auto n_ktile = st.n_ktile;
    const auto bb = st.bb;
    const auto kbase = st.kbase;
    const auto vbase = st.vbase;
    const auto qb = st.qb;
    const auto s = st.s;
    const auto dob = st.dob;
    const auto dps = st.dps;
    const int64_t rp = blk.rp;
    const int64_t j0 = t * kt, nk = std::min(kt, p_.seq_k - j0);
    bool consec = true;
    for (int64_t c = 0; c < nk; ++c) {
      kpt[c] = kposb[j0 + c];
      consec = consec && kpt[c] == kpt[0] + c;
    }
    // Keys past the tile's end: a position of the tile (masked, but table indices stay valid).
    for (int64_t c = nk; c < kt; ++c) kpt[c] = kpt[0];
    float *kp = kp_s, *ktr = ktr_s, *vtr = vtr_s, *dkt = dkt_s, *dvt = dvt_s;
    if (cached) {
      kp = kp_all + j0 * dp;
      ktr = kt_all + t * dim_ * kt;
      vtr = vt_all + t * dim_ * kt;
      dkt = dk_all + t * dp * kt;
      dvt = dv_all + t * dp * kt;
    } else {
      std::fill(kp, kp + n_ktile, 0.0f);
      TileOperands(bb, kbase, vbase, j0, nk, kp, ktr, vtr);
      std::fill(dkt, dkt + n_ktile, 0.0f);
      std::fill(dvt, dvt + n_ktile, 0.0f);
    }
    Tile tile{t, j0, nk, consec, kp, ktr, vtr, dkt, dvt, nullptr, 1, {}, {}};
    tile.run_lo[0] = 0, tile.run_hi[0] = rp;
    if (!full && consec && p_.mask.causal && p_.kopen == nullptr) TileColumns(st, blk, tile);
    FetchQueue* fetch = QueueNextTile(st, blk, t);
    if (bf16_) {
      // The same products by vdpbf16ps on the tiles as pairs of bf16 dims (bf16_dot.h).
      const int64_t n16 = np16_ * kt;
      uint32_t *k16 = st.kt16, *v16 = st.vt16;
      if (cached) {
        k16 += t * n16, v16 += t * n16;
      } else {
        pack_bf16_pairs(ktr, dim_, k16);
        pack_bf16_pairs(vtr, dim_, v16);
      }
      prefill_scores_bf16_dot(st.qb16, qs16_, dim_, k16, rp, s, kt, tile.cols);
      prefill_scores_bf16_dot(st.dob16, qs16_, dim_, v16, rp, dps, kt, tile.cols);
    } else {
      ScoresTile(qb, dim_, ktr, rp, s, kt, dp, false, tile.cols, fetch, st.fetch_n);
      ScoresTile(dob, dim_, vtr, rp, dps, kt, dp, false, tile.cols, fetch, st.fetch_n);
    }
    if (deberta_) deb_t_->BeginTile(st.deb);
    return tile;
  }

  // A causal tile the diagonal crosses: per block row how many leading keys it can see (those
  // at positions up to its own; every key for the open rows of a prefix-LM; the other masks
  // only hide more), and the runs of rows that see any.
  void TileColumns(ItemState& st, const Block& blk, Tile& tile) const {
    st.cols.resize(static_cast<size_t>(blk.rp));
    const int64_t k0 = st.kposb[tile.j0];
    int64_t runs = 0;
    for (int64_t r = 0; r < blk.rp; ++r) {
      int64_t c = 0;
      if (r < blk.rows && st.lse[r] != kNegInf) {
        const int64_t i = blk.i0 + r % blk.nq;
        const bool open = p_.qopen != nullptr && p_.qopen[st.bb * p_.seq_q + i] != 0;
        c = open ? tile.nk
                 : std::clamp<int64_t>(int64_t{st.qpos[static_cast<size_t>(r)]} - k0 + 1, 0,
                                       tile.nk);
      }
      st.cols[static_cast<size_t>(r)] = static_cast<int32_t>(c);
      if (c == 0 || runs > kMaxRuns) continue;
      if (runs > 0 && tile.run_hi[static_cast<size_t>(runs - 1)] == r) {
        tile.run_hi[static_cast<size_t>(runs - 1)] = r + 1;
      } else if (runs < kMaxRuns) {
        tile.run_lo[static_cast<size_t>(runs)] = r, tile.run_hi[static_cast<size_t>(runs)] = r + 1;
        ++runs;
      } else {
        runs = kMaxRuns + 1;  // too scattered: one run over every row (no more run bookkeeping)
      }
    }
    tile.cols = st.cols.data();
    if (runs > kMaxRuns) {
      tile.runs = 1, tile.run_lo[0] = 0, tile.run_hi[0] = blk.rp;
    } else {
      tile.runs = runs;
    }
  }

  // What TileRowScores leaves for TileRowGrads: the row's score and dP rows and where its terms
  // were read.
  struct RowAt {
    float* srow;
    float* drow;
    int64_t h;
    int32_t pq;
    XlRowAt xl;
    DebertaRowAt deb;
  };

  // The mask of block row r (query position pq) on a tile: the rule's limits and the block
  // masks' lanes.
  RowMask MaskOfRow(ItemState& st, const Tile& tile, int64_t r, int32_t pq) const {
    RowMask row_mask(p_.mask, pq);
    if (tiles_->Any()) {
      const int64_t i = st.blk_i0 + r % st.blk_nq, qat = st.bb * p_.seq_q + i;
      if (p_.dense != nullptr) {
        if (!st.dense_buf) st.dense_buf = hwy::AllocateAligned<int32_t>(static_cast<size_t>(st.kt));
        FillDenseLanes(p_, st.bb, i, tile.j0, tile.nk, st.kt, st.dense_buf.get());
      }
      row_mask.SetBlock(p_.qdoc != nullptr ? p_.qdoc[qat] : 0,
                        p_.qopen != nullptr && p_.qopen[qat] != 0,
                        {p_.kdoc != nullptr ? st.kdoc_buf.get() : nullptr,
                         p_.kopen != nullptr ? st.kopen_buf.get() : nullptr,
                         p_.dense != nullptr ? st.dense_buf.get() : nullptr});
    }
    return row_mask;
  }

  // Row r of the block on a tile when the call has no positional terms, soft-capping or bias
  // (plain_): TileRowScores and TileRowGrads in one pass over the row, by the same operations
  // in the same order (S scaled and masked, P = exp(S - lse), dS = P (dP - D), scale * dS), so
  // that each element is read and written once. A full tile (every key visible) skips the mask.
  void PlainRow(ItemState& st, const Tile& tile, int64_t r, bool full) {
    const auto kt = st.kt;
    float* HWY_RESTRICT srow = st.s + r * kt;
    float* HWY_RESTRICT drow = st.dps + r * kt;
    const float lse = st.lse[r];
    if (lse == kNegInf) {
      std::fill(srow, srow + kt, 0.0f);
      std::fill(drow, drow + kt, 0.0f);
      return;
    }
    const DF d;
    const auto vs = hn::Set(d, st.scale), vl = hn::Set(d, lse), vd = hn::Set(d, st.dsum[r]);
    const auto grads = [&](int64_t c, hn::Vec<DF> x) {
      const auto pv = hn::Exp(d, hn::Sub(x, vl));  // exp(-inf) = 0
      hn::Store(pv, d, srow + c);
      const auto ds = hn::Mul(pv, hn::Sub(hn::Load(d, drow + c), vd));
      hn::Store(hn::Mul(ds, vs), d, drow + c);
    };
    if (full) {
      for (int64_t c = 0; c < kt; c += lanes_) grads(c, hn::Mul(hn::Load(d, srow + c), vs));
      return;
    }
    const DI di;
    const auto vninf = hn::Set(d, kNegInf);
    const RowMask row_mask = MaskOfRow(st, tile, r, st.qpos[static_cast<size_t>(r)]);
    const int64_t nk = tile.nk;
    for (int64_t c = 0; c < kt; c += lanes_) {
      auto vis = row_mask.VisibleAt(d, hn::Load(di, st.kpt + c), c);
      if (c + lanes_ > nk) {  // keys past the tile's end
        vis = hn::And(vis, hn::RebindMask(d, hn::Lt(hn::Iota(di, c), hn::Set(di, nk))));
      }
      grads(c, hn::IfThenElse(vis, hn::Mul(hn::Load(d, srow + c), vs), vninf));
    }
  }

  // Row r of the block on a tile: the scheme's terms added to its scores, and the mask. Returns
  // false for a row that sees no key (its P and dS rows zeroed).
  bool TileRowScores(ItemState& st, const Tile& tile, int64_t r, RowAt& at) {
    // The item's scalars and pointers as locals: vector stores may alias any memory, so
    // values read through `st` would be reloaded after each one.
    const auto s = st.s;
    const auto kt = st.kt;
    const auto dps = st.dps;
    const auto lse = st.lse;
    const auto scale = st.scale;
    const auto kpt = st.kpt;
    const auto bb = st.bb;
    const auto hk = st.hk;
    const auto cs = st.cs;
    const auto rel1 = st.rel1;
    const auto rel2 = st.rel2;
    const auto addr = st.addr;
    const DF d;
    float* srow = s + r * kt;
    float* drow = dps + r * kt;
    if (lse[r] == -std::numeric_limits<float>::infinity()) {
      std::fill(srow, srow + kt, 0.0f);
      std::fill(drow, drow + kt, 0.0f);
      return false;
    }
    const int64_t h = st.head[static_cast<size_t>(r)];
    const int32_t pq = st.qpos[static_cast<size_t>(r)];
    // Scale and mask, vectorized over the tile's keys (kpt: their positions).
    {
      const DI di;
      const auto vs = hn::Set(d, scale), vninf = hn::Set(d, kNegInf);
      const RowMask row_mask = MaskOfRow(st, tile, r, pq);
      for (int64_t c = 0; c < kt; c += lanes_) {
        const auto vis = row_mask.VisibleAt(d, hn::Load(di, kpt + c), c);
        const auto x = hn::Mul(hn::Load(d, srow + c), vs);
        hn::Store(hn::IfThenElse(vis, x, vninf), d, srow + c);
      }
      for (int64_t c = tile.nk; c < kt; ++c) srow[c] = kNegInf;
    }
    // The row-table terms (Shaw's, DeBERTa's c2p, XL's r(delta)): the row's projection at each
    // key's table row; DeBERTa's p2c from the tile tables.
    XlRowAt xl;
    DebertaRowAt deb;
    if (shaw_) {
      shaw_t_->AddScores(rows_, kpt, pq, r, cs, rel1, rel2, addr, srow, drow);
    } else if (deberta_) {
      deb = deb_t_->RowAt(st.deb, bb, hk, h, r, pq, tile.t, ntiles_, kpt, tile.consec, cs);
      deb_t_->AddScores(rows_, st.deb, deb, bb, pq, r, cs, kpt, tile.consec, rel1, addr, srow);
    } else if (xl_) {
      xl = xl_t_->RowAt(pq, kpt, tile.consec);
      xl_t_->AddScores(rows_, xl, kpt, pq, r, cs, rel1, addr, srow);
    }
    // ALiBi / T5 (masked cells stay -inf).
    const DistanceBiasRow<const float> bias(p_, p_.bias, bb, h, pq);
    if (bias.row != nullptr) {
      for (int64_t c = 0; c < kt; c += lanes_) {
        hn::Store(bias.Add(d, hn::Load(d, srow + c), kpt, c, tile.consec), d, srow + c);
      }
    }
    if (deberta_ && !st.deb.p2c_tiles) {  // DeBERTa's p2c per cell
      deb_t_->AddCellScores(st.deb, bb, hk, h, pq, tile.j0, tile.nk, tile.kp, st.kposb, srow);
    }
    if (p_.softcap > 0.0f) {
      // Soft-capping of the finished scores; masked cells stay -inf.
      // Where |x / cap| < 2^-12, tanh(y) = y to float32's precision (y - y^3/3): the score x
      // itself, also for caps near FLT_MAX whose quotients are subnormal (Tanh may flush them).
      const auto vcap = hn::Set(d, p_.softcap), vninf = hn::Set(d, kNegInf);
      const auto small = hn::Set(d, 1.0f / 4096.0f);
      for (int64_t c = 0; c < kt; c += lanes_) {
        const auto x = hn::Load(d, srow + c);
        const auto y = hn::Div(x, vcap);
        const auto capped =
            hn::IfThenElse(hn::Lt(hn::Abs(y), small), x, hn::Mul(vcap, hn::Tanh(d, y)));
        hn::Store(hn::IfThenElse(hn::Eq(x, vninf), x, capped), d, srow + c);
      }
    }
    at = RowAt{srow, drow, h, pq, xl, deb};
    return true;
  }

  // P = exp(S - lse) and dS = P (dP - D) of row r, the per-cell and per-bucket gradients of the
  // scheme's terms; scale * dS left in the dP row.
  void TileRowGrads(ItemState& st, const Tile& tile, int64_t r, const RowAt& at) {
    const auto lse = st.lse;
    const auto dsum = st.dsum;
    const auto kt = st.kt;
    const auto scale = st.scale;
    const auto bb = st.bb;
    const auto hk = st.hk;
    const auto cs = st.cs;
    const auto w1 = st.w1;
    const auto w2 = st.w2;
    const auto addr = st.addr;
    const DF d;
    const auto srow = at.srow;
    const auto drow = at.drow;
    const auto h = at.h;
    const auto pq = at.pq;
    const auto vl = hn::Set(d, lse[r]), vd = hn::Set(d, dsum[r]);
    const bool capped = p_.softcap > 0.0f;
    const auto inv_cap = hn::Set(d, capped ? 1.0f / p_.softcap : 0.0f), vone = hn::Set(d, 1.0f);
    for (int64_t c = 0; c < kt; c += lanes_) {
      const auto x = hn::Load(d, srow + c);
      const auto pv = hn::Exp(d, hn::Sub(x, vl));  // exp(-inf) = 0
      hn::Store(pv, d, srow + c);
      auto ds = hn::Mul(pv, hn::Sub(hn::Load(d, drow + c), vd));
      if (capped) {
        // Through the cap: d(cap tanh(y / cap)) / dy = 1 - t^2, t = x / cap from the capped
        // score x (clamped: a masked cell, x = -inf, gets 0).
        const auto t = hn::Min(hn::Max(hn::Mul(x, inv_cap), hn::Neg(vone)), vone);
        ds = hn::Mul(ds, hn::NegMulAdd(t, t, vone));
      }
      hn::Store(ds, d, drow + c);
    }
    // Per-cell gradients of the scheme's terms (dS unscaled for biases, scaled below).
    if (b_.dbias != nullptr) {
      DistanceBiasRow<float>(p_, b_.dbias, bb, h, pq)
          .AddGrads(d, drow, st.kpt, tile.nk, kt, tile.consec);
    }
    if (deberta_ && !st.deb.p2c_tiles) {  // DeBERTa's p2c per cell
      deb_t_->AddCellGrads(st.deb, bb, hk, h, pq, tile.j0, tile.nk, st.kposb, srow, drow);
    }
    // scale * dS from here on; the row-table terms' sums per table row.
    if (shaw_) {
      ScaleGrads(drow, scale, [&](int64_t c, hn::Vec<DF> sds) {
        shaw_t_->AddGrads(rows_, addr, c, sds, srow, w1, w2);
      });
    } else if (deberta_) {
      ScaleGrads(drow, scale, [&](int64_t c, hn::Vec<DF> sds) {
        deb_t_->AddGrads(rows_, st.deb, at.deb, addr, c, sds, w1);
      });
    } else if (xl_) {
      ScaleGrads(drow, scale, [&](int64_t c, hn::Vec<DF> sds) {
        xl_t_->AddGrads(rows_, at.xl, addr, r, cs, c, sds, w1);
      });
    } else {
      ScaleGrads(drow, scale, [](int64_t, hn::Vec<DF>) {});
    }
  }

  // The tile's products: dV^T += dO^T P, dK^T += Q^T (scale dS), dQ += (scale dS) K; DeBERTa's
  // p2c cells; dK, dV added to the outputs unless the item holds them.
  void FinishTile(ItemState& st, const Block& blk, const Tile& tile) {
    const auto dotr = st.dotr;
    const auto s = st.s;
    const auto dimr = st.dimr;
    const auto kt = st.kt;
    const auto qtr = st.qtr;
    const auto dps = st.dps;
    const auto dp = st.dp;
    const auto dqb = st.dqb;
    const auto hk = st.hk;
    const auto dkx = st.dkx;
    const auto part = st.part;
    const auto cached = st.cached;
    const auto bb = st.bb;
    const auto n_ktile = st.n_ktile;
    const int64_t rp = blk.rp;
    const int64_t j0 = tile.j0, nk = tile.nk;
    const float* kp = tile.kp;
    float *dkt = tile.dkt, *dvt = tile.dvt;
    FetchQueue* const fetch = st.fetch.Pending() > 0 ? &st.fetch : nullptr;
    // dV^T += dO^T P and dK^T += Q^T (scale dS) over the rows that see a key of the tile (rows
    // that see none have P = dS = 0), dQ += scale dS K.
    for (int64_t i = 0; i < tile.runs; ++i) {
      const int64_t lo = tile.run_lo[static_cast<size_t>(i)];
      const int64_t n = tile.run_hi[static_cast<size_t>(i)] - lo;
      ScoresTile(dotr + lo, n, s + lo * kt, dimr, dvt, kt, rp, true, nullptr, fetch, st.fetch_n);
      ScoresTile(qtr + lo, n, dps + lo * kt, dimr, dkt, kt, rp, true, nullptr, fetch, st.fetch_n);
    }
    AccumulateTile(dps, nk, kp, dp, dp, rp, dqb, kTileK, 0, tile.cols, fetch, st.fetch_n);
    if (fetch != nullptr) fetch->Issue(-1);                       // what the products left
    if (deberta_) deb_t_->FinishTile(st.deb, hk, kp, dkx, part);  // p2c cells
    for (int64_t c = 0; !cached && c < nk; ++c) {
      AddColumn(dkt, c, OutRow(b_.dk, b_.dk_stride, bb, j0 + c, hk));
      AddColumn(dvt, c, OutRow(b_.dv, b_.dv_stride, bb, j0 + c, hk));
      if (deberta_) AddRow(dkx + c * dp, OutRow(b_.dk, b_.dk_stride, bb, j0 + c, hk), dim_);
    }
    if (deberta_ && !cached) std::fill(dkx, dkx + n_ktile, 0.0f);
  }

  // The block's per-row terms (Shaw, DeBERTa c2p, XL's r part) and its dQ rows written out.
  void FinishBlock(ItemState& st, const Block& blk) {
    const auto w1 = st.w1;
    const auto dqb = st.dqb;
    const auto qtr = st.qtr;
    const auto part = st.part;
    const auto w2 = st.w2;
    const auto dotr = st.dotr;
    const auto dqr = st.dqr;
    const auto qxtr = st.qxtr;
    const auto hk = st.hk;
    const auto dp = st.dp;
    const auto bb = st.bb;
    const int64_t i0 = blk.i0, nq = blk.nq, rows = blk.rows;
    const BlockRows& br = blk.br;
    // Per-row terms, once per block.
    if (shaw_) {
      shaw_t_->FinishBlock(rows_, w1, w2, qtr, dotr, dqb, part, br);
    } else if (deberta_) {
      deb_t_->FinishBlock(rows_, w1, qtr, dqb, part, br);
    } else if (xl_) {
      xl_t_->FinishBlock(rows_, w1, qxtr, dqr, part, br);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t h = st.head[static_cast<size_t>(r)], g = h - hk * group_;
      float* dq_r = dqb + r * dp;
      if (xl_) xl_t_->FinishRow(g, dqr + r * dp, dq_r, part);
      const int64_t i = i0 + r % nq;
      std::memcpy(b_.dq + bb * b_.dq_stride[0] + i * b_.dq_stride[1] + h * b_.dq_stride[2], dq_r,
                  static_cast<size_t>(dim_) * sizeof(float));
    }
  }

  // DeBERTa's p2c products once per key tile, and the item's dK, dV written out.
  void FinishItem(ItemState& st) {
    const auto kt = st.kt;
    const auto hk = st.hk;
    const auto dk_all = st.dk_all;
    const auto dp = st.dp;
    const auto kp_all = st.kp_all;
    const auto part = st.part;
    const auto cached = st.cached;
    const auto bb = st.bb;
    const auto dv_all = st.dv_all;
    if (deberta_) deb_t_->FinishItem(st.deb, hk, ntiles_, kp_all, dk_all, part);
    // Tile by tile, the transposed [dpad x kTileK] buffers back to rows in 4 x 4 blocks (one
    // column at a time read each element from another cache line).
    for (int64_t t = 0; cached && t < ntiles_; ++t) {
      const int64_t j0 = t * kt, nk = std::min(kt, p_.seq_k - j0);
      TransposeRows(dk_all + t * dp * kt, kt, dim_, nk, OutRow(b_.dk, b_.dk_stride, bb, j0, hk),
                    b_.dk_stride[1]);
      TransposeRows(dv_all + t * dp * kt, kt, dim_, nk, OutRow(b_.dv, b_.dv_stride, bb, j0, hk),
                    b_.dv_stride[1]);
    }
  }

  // One (batch row, kv head): every query block against every key tile it can see.
  void RunItem(int64_t w, Scratch& sc, float* part) {
    ItemState st;
    InitItem(st, w, sc, part);
    PlanItem(st);
    for (int64_t i0 = 0; i0 < p_.seq_q; i0 += nq_) {
      const Block blk = LoadBlock(st, i0);
      const QueryBlockInfo qinfo = tiles_->Queries(st.bb, i0, blk.nq);
      st.blk_i0 = i0, st.blk_nq = blk.nq;
      for (int64_t t = 0; t < ntiles_; ++t) {
        const TileKind kind = tiles_->Classify(qinfo, st.bb, t, i0, blk.nq);
        if (kind == TileKind::kHidden) continue;
        const Tile tile = LoadTile(st, blk, t, kind == TileKind::kFull);
        if (p_.kdoc != nullptr || p_.kopen != nullptr) {
          if (!st.kdoc_buf) {
            st.kdoc_buf = hwy::AllocateAligned<int32_t>(static_cast<size_t>(kTileK));
            st.kopen_buf = hwy::AllocateAligned<int32_t>(static_cast<size_t>(kTileK));
          }
          FillKeyLanes(p_, st.bb, tile.j0, tile.nk, kTileK, st.kdoc_buf.get(), st.kopen_buf.get());
        }
        for (int64_t r = 0; r < blk.rp; ++r) {
          if (tile.cols != nullptr && tile.cols[r] == 0) {  // sees no key of the tile
            std::fill(st.s + r * kTileK, st.s + (r + 1) * kTileK, 0.0f);
            std::fill(st.dps + r * kTileK, st.dps + (r + 1) * kTileK, 0.0f);
            continue;
          }
          if (plain_) {
            PlainRow(st, tile, r, kind == TileKind::kFull);
            continue;
          }
          RowAt at;
          if (TileRowScores(st, tile, r, at)) TileRowGrads(st, tile, r, at);
        }
        FinishTile(st, blk, tile);
      }
      FinishBlock(st, blk);
    }
    FinishItem(st);
  }

  const FusedBackwardParams& b_;
  const FusedAttentionParams& p_;
  int64_t lanes_ = 0, dim_ = 0, dpad_ = 0, group_ = 1, nq_ = 1, rp_max_ = 4, ntiles_ = 0;
  std::vector<int32_t> tile_min_, tile_max_;
  std::unique_ptr<TileMasks> tiles_;  // block masks per tile
  // The scheme (one per call): its flag and its terms (terms/shaw-inl.h, deberta-inl.h,
  // xl-inl.h), on the row tables and row-chunk buffers of row_tables-inl.h.
  bool shaw_ = false, deberta_ = false, xl_ = false;
  bool plain_ = false;           // no positional terms, soft-capping or bias: PlainRow
  bool bf16_ = false;            // S and dP tiles by vdpbf16ps (bf16 operands)
  int64_t qs16_ = 0, np16_ = 0;  // bf16 row stride; dim pairs of a packed tile
  std::unique_ptr<ShawBackward> shaw_t_;
  std::unique_ptr<DebertaBackward> deb_t_;
  std::unique_ptr<XlBackward> xl_t_;
  RowChunks rows_;
  int64_t dimr_ = 4, nch_ = 0, part_sink_ = 0, part_size_ = 0;
  std::vector<Scratch> scratch_, cache_;
};

void FusedAttentionBackward(const FusedBackwardParams& p) {
  BackwardKernel k(p);
  k.Run();
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::kernels {

HWY_EXPORT(FusedAttentionBackward);

namespace {
// Per-thread budget of an item's key operands and dK, dV buffers (5 x seq_k x head_dim floats;
// DeBERTa adds its p2c tables, 2 x group x seq_k x 2K): up to about 13000 keys at head_dim 128,
// DeBERTa with 2K = 512 up to about 4600.
constexpr int64_t kItemBudgetBytes = int64_t{32} << 20;
int64_t g_item_budget = kItemBudgetBytes;
}  // namespace

void set_backward_item_budget_for_test(int64_t bytes) {
  g_item_budget = bytes < 0 ? kItemBudgetBytes : bytes;
}
int64_t backward_item_budget() { return g_item_budget; }

void fused_attention_backward(const FusedBackwardParams& p) {
  apply_simd_target_env();  // POSENC_SIMD_TARGET, before the first dispatch
  HWY_DYNAMIC_DISPATCH(FusedAttentionBackward)(p);
}

}  // namespace posenc::kernels
#endif  // HWY_ONCE
