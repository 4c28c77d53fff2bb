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
// query heads x up to 64 / group positions) visit the key tiles, so dQ of a block is complete
// when the block ends and dK, dV of the kv head are owned by the item. Table gradients are
// summed per item and reduced in item order: results are bit-identical for any thread count.
//
// Size: one kernel class per Highway target (about 1,600 lines), kept in one file because
// foreach_target compiles the file once per target and the class's steps (InitItem, PlanItem,
// LoadBlock, LoadTile, TileRowScores / TileRowGrads, FinishTile, FinishBlock, FinishItem) share
// one ItemState and the row-chunk tables of the schemes; the micro-kernels it shares with the
// forward are in attention-inl.h and mask-inl.h.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "kernels/attention_kernels.h"
#include "kernels/block_mask.h"
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
#include "kernels/terms/distance_bias-inl.h"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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
    nq_ = std::max<int64_t>(1, kTileK / group_);
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
    nrel_ = shaw_ ? 2 * p_.shaw_k + 1 : 0;
    deberta_ = p_.deberta_pos_key != nullptr;
    span2_ = deberta_ ? 2 * p_.deberta_span : 0;
    xl_ = p_.xl_sin != nullptr;
    has_cell_terms_ = deberta_;  // per-cell terms past the vector ones: DeBERTa's p2c
    has_cell_grads_ = deberta_;
    hd_ = p_.heads_q * dim_;
    dimr_ = RoundUp(dim_, 4);
    hdp_ = RoundUp(hd_, kTileK);
    // Per-row tables: padded and transposed copies.
    if (shaw_) {
      MakeRowTable(relk_, p_.shaw_rel_k, nrel_, p_.shaw_rel_k_heads, p_.scale);
      if (p_.shaw_rel_v != nullptr)
        MakeRowTable(relv_, p_.shaw_rel_v, nrel_, p_.shaw_rel_v_heads, 1);
    } else if (deberta_) {
      MakeRowTable(relk_, p_.deberta_pos_key, span2_, p_.heads_q, p_.scale);
      // deb_run_end_[t]: the end of the run of distance indices from t on whose c2p and p2c rows
      // both stay the same (clipped or saturated distances).
      const int64_t len = p_.deberta_len;
      deb_run_end_.assign(static_cast<size_t>(len), static_cast<int32_t>(len));
      for (int64_t t = len - 2; t >= 0; --t) {
        const bool same = p_.deberta_c2p[t] == p_.deberta_c2p[t + 1] &&
                          p_.deberta_p2c[t] == p_.deberta_p2c[t + 1];
        deb_run_end_[static_cast<size_t>(t)] =
            same ? deb_run_end_[static_cast<size_t>(t + 1)] : static_cast<int32_t>(t + 1);
      }
      // The p2c rows' linear stretch (distances inside the log buckets' exact band): they step
      // by deb_step_ (-1 for the model form, +1 for the paper's) per key position, so a tile
      // row's p2c products kpq[u0 + step c][c] lie on a diagonal of the tile's kpq. Rows whose 64
      // keys all lie in the stretch read a skewed copy, G[b][c] = kpq[b + step c][c] with b =
      // u0, as one contiguous run (see RunItem); deb_b_lo_ .. deb_b_hi_: the b they use.
      int64_t up = 0, down = 0;
      for (int64_t t = 0; t + 1 < len; ++t) {
        up += p_.deberta_p2c[t + 1] - p_.deberta_p2c[t] == 1;
        down += p_.deberta_p2c[t + 1] - p_.deberta_p2c[t] == -1;
      }
      deb_step_ = up > down ? 1 : -1;
      std::vector<int32_t> lin_end(static_cast<size_t>(len), static_cast<int32_t>(len));
      for (int64_t t = len - 2; t >= 0; --t) {
        lin_end[static_cast<size_t>(t)] = p_.deberta_p2c[t + 1] - p_.deberta_p2c[t] == deb_step_
                                              ? lin_end[static_cast<size_t>(t + 1)]
                                              : static_cast<int32_t>(t + 1);
      }
      deb_lin_.assign(static_cast<size_t>(len), 0);
      for (int64_t t = 0; t + kTileK <= len; ++t) {
        if (lin_end[static_cast<size_t>(t)] < t + kTileK) continue;
        deb_lin_[static_cast<size_t>(t)] = 1;
        deb_b_lo_ = std::min<int64_t>(deb_b_lo_, p_.deberta_p2c[t]);
        deb_b_hi_ = std::max<int64_t>(deb_b_hi_, p_.deberta_p2c[t]);
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
    nch_ = xl_ ? (p_.xl_len + kTileK - 1) / kTileK : relk_.nch;  // XL: r(t), built in Run
    // Per-item partial table gradients, in floats. Row-table gradients are kept transposed like
    // the tables ([heads][nch][dimr][64]).
    const int64_t tchunk = nch_ * dimr_ * kTileK;
    if (shaw_) {
      shaw_k_heads_ = p_.shaw_rel_k_heads == 1 ? 1 : group_;
      part_relk_ = 0;
      part_size_ = shaw_k_heads_ * tchunk;
      if (b_.shaw_drel_v != nullptr) {
        shaw_v_heads_ = p_.shaw_rel_v_heads == 1 ? 1 : group_;
        part_relv_ = part_size_;
        part_size_ += shaw_v_heads_ * tchunk;
      }
    } else if (deberta_) {
      part_pq_ = group_ * tchunk;  // dpos_key (transposed), then dpos_query (rows)
      part_size_ = part_pq_ + group_ * span2s_ * dpad_;
    } else if (xl_) {
      part_size_ = 2 * group_ * dim_ + group_ * tchunk;  // du, dv, then dr(t) (transposed)
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
    if (xl_) {
      // The projected distances r(t) as a per-row table (row t = xl_dmax - delta), scaled for
      // the (q + v) . r(delta) products.
      ProjectXl(threads);
      MakeRowTable(relk_, r_.get(), p_.xl_len, p_.heads_q, p_.scale, hdp_, threads);
      r_.reset();
    }
    const int64_t items = p_.batch * p_.heads_kv;
    // Items per wave: bounded partial-gradient memory (about 16 MB, at least one item per
    // thread), a multiple of the thread count when there is more than one wave so that no wave
    // ends with threads idle (7 + 1 items of XL's 2 MB partials on 2 threads ran 5 rounds instead
    // of 4). Partials are reduced in item order whatever the waves: the results do not depend on
    // them.
    constexpr int64_t kPartBudget = int64_t{4} << 20;
    int64_t wave = part_size_ == 0 ? items
                                   : std::clamp<int64_t>(kPartBudget / part_size_, threads,
                                                         std::max<int64_t>(items, threads));
    if (wave < items) wave = std::max<int64_t>(threads, wave / threads * threads);
    wave = std::min(wave, items);
    std::vector<float> part(static_cast<size_t>(std::min(wave, items) * part_size_));
    ZeroTables();
    for (int64_t w0 = 0; w0 < items; w0 += wave) {
      const int64_t nw = std::min(wave, items - w0);
      std::fill(part.begin(), part.end(), 0.0f);
      parallel_for(nw, threads,
                   [&](int64_t w) { RunItem(w0 + w, Local(), part.data() + w * part_size_); });
      for (int64_t w = 0; w < nw; ++w) Reduce(w0 + w, part.data() + w * part_size_);
    }
    if (xl_) ProjectXlGradient(threads);
  }

 private:
  // A DeBERTa p2c cell's contribution to dK, applied after the tile's products.
  struct PqCell {
    int64_t c, u, h;
    float sds;
  };

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
    for (int64_t c = 0; c < nk; ++c) {
      const float* kr = kbase + (j0 + c) * p_.k_stride[1];
      const float* vr = vbase + (j0 + c) * p_.v_stride[1];
      if (p_.rope.cs != nullptr) {
        kr = kp + c * dpad_;
      } else {
        std::memcpy(kp + c * dpad_, kr, static_cast<size_t>(dim_) * sizeof(float));
      }
      for (int64_t x = 0; x < dim_; ++x) {
        ktr[x * kTileK + c] = kr[x];
        vtr[x * kTileK + c] = vr[x];
      }
    }
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
    auto zero = [](float* x, int64_t n) {
      if (x != nullptr) std::fill(x, x + n, 0.0f);
    };
    if (b_.dbias != nullptr) zero(b_.dbias, p_.batch * p_.bias_batch_stride);
    if (b_.dsinks != nullptr) zero(b_.dsinks, p_.heads_q);
    if (shaw_) {
      zero(b_.shaw_drel_k, nrel_ * p_.shaw_rel_k_heads * dim_);
      zero(b_.shaw_drel_v, nrel_ * p_.shaw_rel_v_heads * dim_);
    }
    if (deberta_) {
      zero(b_.deberta_dpos_key, span2_ * hd_);
      zero(b_.deberta_dpos_query, span2_ * hd_);
    }
    if (xl_) {
      zero(b_.xl_du, hd_);
      zero(b_.xl_dv, hd_);
      xl_dr_.assign(static_cast<size_t>(RoundUp(hd_, 4) * p_.xl_len), 0.0f);
    }
  }

  // Adds item w's partial table gradients into the outputs (called in item order).
  void Reduce(int64_t w, const float* part) {
    const int64_t hk = w % p_.heads_kv;
    auto add = [](const float* src, float* dst, int64_t n) {
      for (int64_t x = 0; x < n; ++x) dst[x] += src[x];
    };
    if (b_.dsinks != nullptr) add(part + part_sink_, b_.dsinks + hk * group_, group_);
    // part [g][nch][dimr][64] (transposed) into out [n][heads][dim].
    auto add_transposed = [&](const float* part_t, float* out, int64_t n, int64_t heads,
                              int64_t part_heads) {
      for (int64_t g = 0; g < part_heads; ++g) {
        const int64_t th = heads == 1 ? 0 : hk * group_ + g;
        for (int64_t u = 0; u < n; ++u) {
          const float* src = part_t + ((g * nch_ + u / kTileK) * dimr_) * kTileK + u % kTileK;
          float* dst = out + (u * heads + th) * dim_;
          for (int64_t x = 0; x < dim_; ++x) dst[x] += src[x * kTileK];
        }
      }
    };
    if (shaw_) {
      add_transposed(part + part_relk_, b_.shaw_drel_k, nrel_, p_.shaw_rel_k_heads, shaw_k_heads_);
      if (b_.shaw_drel_v != nullptr) {
        add_transposed(part + part_relv_, b_.shaw_drel_v, nrel_, p_.shaw_rel_v_heads,
                       shaw_v_heads_);
      }
    } else if (deberta_) {
      add_transposed(part, b_.deberta_dpos_key, span2_, p_.heads_q, group_);
      for (int64_t g = 0; g < group_; ++g) {
        const int64_t h = hk * group_ + g;
        for (int64_t u = 0; u < span2_; ++u) {
          add(part + part_pq_ + (g * span2s_ + u) * dpad_,
              b_.deberta_dpos_query + (u * p_.heads_q + h) * dim_, dim_);
        }
      }
    } else if (xl_) {
      const int64_t gd = group_ * dim_;
      add(part, b_.xl_du + hk * gd, gd);
      add(part + gd, b_.xl_dv + hk * gd, gd);
      // dr(t) kept transposed, [heads * dim][len]: the partials' [ch][x][64] runs add as they
      // are, and it is the operand of ProjectXlGradient's product.
      const float* part_t = part + 2 * gd;
      for (int64_t g = 0; g < group_; ++g) {
        const int64_t th = hk * group_ + g;
        for (int64_t ch = 0; ch < nch_; ++ch) {
          const int64_t n = std::min(kTileK, p_.xl_len - ch * kTileK);
          for (int64_t x = 0; x < dim_; ++x) {
            add(part_t + ((g * nch_ + ch) * dimr_ + x) * kTileK,
                xl_dr_.data() + (th * dim_ + x) * p_.xl_len + ch * kTileK, n);
          }
        }
      }
    }
  }

  // A per-row table (Shaw's rel_k, rel_v; DeBERTa's pos_key): rows u < n of [n, heads, dim],
  // padded to dpad per head (pad[h][u], the rows AccumulateTile reads: a head's rows adjacent,
  // not heads x dpad floats apart, which at 8 heads of 128 put every row on the same cache
  // sets) and transposed in chunks of kTileK rows times `scale` (the operand ScoresTile reads):
  // tr[h][ch][x][u % kTileK].
  struct RowTable {
    int64_t n = 0, heads = 1, nch = 0;
    hwy::AlignedFreeUniquePtr<float[]> pad, tr;
  };
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

  // Row-chunk buffers ([nch][rs][kTileK], rs rows per chunk) hold one value per (row, table row):
  // projections and bucket sums. A block's rows are the group's heads, nq rows each.
  struct BlockRows {
    int64_t rows, rp, nq, hk, cs;  // cs = rs * kTileK
    int64_t c0, c1;                // the chunks of table rows the block's cells can use
  };

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

  // XL, table rows u .. u + lanes - 1 of block row r in the row-chunk buffers: the address of u,
  // the address of the next chunk's row r, and how many lanes lie in u's chunk.
  struct XlRun {
    int64_t a0, a1, k;
  };
  static HWY_INLINE XlRun XlRuns(int64_t u, int64_t r, int64_t cs) {
    const int64_t ch = u / kTileK, off = u % kTileK;
    return {ch * cs + r * kTileK + off, (ch + 1) * cs + r * kTileK, kTileK - off};
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

  // Reduction chunk of the projections' products (64 KiB of a 64-column operand).
  static constexpr int64_t kReduceChunk = 256;

  // XL: r(t) = W_r R(t) for every distance row t, [xl_len, hdp] (ScoresTile: sinusoid rows x
  // tiles of W_r^T).
  void ProjectXl(int threads) {
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

  // XL: dr_net[o][m] = sum_t dr(t)[o] R(t)[m] (ScoresTile: dr^T rows x tiles of R).
  void ProjectXlGradient(int threads) {
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
    const float* dr_t = xl_dr_.data();  // [hd4][len]
    auto out = hwy::AllocateAligned<float>(static_cast<size_t>(hd4 * dmp));
    const int64_t blocks = (hd4 + kTileK - 1) / kTileK;
    parallel_for(blocks * mtiles, threads, [&](int64_t w) {
      const int64_t o0 = (w / mtiles) * kTileK, mt = w % mtiles;
      const int64_t rows = std::min(kTileK, hd4 - o0);
      for (int64_t t0 = 0; t0 < len; t0 += kReduceChunk) {  // as in ProjectXl
        ScoresTile(dr_t + o0 * len + t0, std::min(kReduceChunk, len - t0),
                   sin_t.get() + (mt * len + t0) * kTileK, rows, out.get() + o0 * dmp + mt * kTileK,
                   dmp, len, t0 > 0);
      }
    });
    for (int64_t o = 0; o < hd_; ++o)
      std::memcpy(b_.xl_drnet + o * dm, out.get() + o * dmp, static_cast<size_t>(dm) * 4);
  }

  // One work item (batch row, kv head) of RunItem: its scratch layout, per-item buffers, the
  // query position range of each block, and (when they fit the budget) its key tiles formed once.
  struct ItemState {
    int64_t bb, hk, rpm, dp, kt, dimr, cs, nblocks, n_all, n_p2c, nb, n_diag, n_cache;
    size_t n_rows, n_tile, n_ktile, n_rel, n_rel2;
    float *base, *qb, *qx, *dob, *dqb, *dqr, *s, *dps, *qtr, *dotr, *qxtr, *kp_s, *dkt_s, *dvt_s,
        *dkx, *ktr_s, *vtr_s, *rel1, *rel2, *w1, *w2, *dsum, *lse, *kp_all, *kt_all, *vt_all,
        *dk_all, *dv_all, *kpq_all, *wpq_all, *gd_all, *wgd_all, *part;
    hwy::AlignedFreeUniquePtr<int32_t[]> addr_buf;
    hwy::AlignedFreeUniquePtr<int32_t[]> addr2_buf;
    hwy::AlignedFreeUniquePtr<int32_t[]> kpt_buf;
    int32_t *addr, *addr2, *kpt;
    // Block masks: the tile's key documents and open flags, one row of the dense mask, and the
    // current query block.
    hwy::AlignedFreeUniquePtr<int32_t[]> kdoc_buf, kopen_buf, dense_buf;
    int64_t blk_i0 = 0, blk_nq = 0;
    std::vector<int32_t> qpos;
    std::vector<int32_t> p2c_u;
    std::vector<int32_t> p2c_run;
    std::vector<int32_t> bq_min;
    std::vector<int32_t> bq_max;
    std::vector<int64_t> head;
    std::vector<PqCell> pq_cells;
    std::vector<float> p2c_val;
    float scale;
    const int32_t* kposb;
    const float *kbase, *vbase;
    std::vector<std::pair<int64_t, int64_t>> p2c_rows;
    bool cached, p2c_tiles, cell_terms, cell_grads;
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
  // Rows [lo, hi] of a bucket table indexed at dmax - delta, for delta in [dlo, dhi] (narrowed
  // by the caller to the distances a mask can leave visible: masked cells still read their table
  // rows, which then hold finite values from earlier blocks or zeros, and add their dS = 0).
  // Only the table's own entries [0, len) are read: distances outside it belong to no key pair.
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

  // The item's scratch layout (one zeroed buffer per thread) and per-item buffers.
  void InitItem(ItemState& st, int64_t w, Scratch& sc, float* part) {
    st.part = part;
    auto& bb = st.bb;
    auto& hk = st.hk;
    auto& rpm = st.rpm;
    auto& dp = st.dp;
    auto& kt = st.kt;
    auto& dimr = st.dimr;
    auto& n_rows = st.n_rows;
    auto& n_tile = st.n_tile;
    auto& n_ktile = st.n_ktile;
    auto& cs = st.cs;
    auto& n_rel = st.n_rel;
    auto& n_rel2 = st.n_rel2;
    auto& base = st.base;
    auto& qb = st.qb;
    auto& qx = st.qx;
    auto& dob = st.dob;
    auto& dqb = st.dqb;
    auto& dqr = st.dqr;
    auto& s = st.s;
    auto& dps = st.dps;
    auto& qtr = st.qtr;
    auto& dotr = st.dotr;
    auto& qxtr = st.qxtr;
    auto& kp_s = st.kp_s;
    auto& dkt_s = st.dkt_s;
    auto& dvt_s = st.dvt_s;
    auto& dkx = st.dkx;
    auto& ktr_s = st.ktr_s;
    auto& vtr_s = st.vtr_s;
    auto& rel1 = st.rel1;
    auto& rel2 = st.rel2;
    auto& w1 = st.w1;
    auto& w2 = st.w2;
    auto& dsum = st.dsum;
    auto& lse = st.lse;
    auto& addr_buf = st.addr_buf;
    auto& addr = st.addr;
    auto& addr2_buf = st.addr2_buf;
    auto& addr2 = st.addr2;
    auto& qpos = st.qpos;
    auto& head = st.head;
    auto& p2c_u = st.p2c_u;
    auto& p2c_val = st.p2c_val;
    auto& p2c_run = st.p2c_run;
    auto& kpt_buf = st.kpt_buf;
    auto& kpt = st.kpt;
    auto& scale = st.scale;
    auto& kposb = st.kposb;
    auto& kbase = st.kbase;
    auto& vbase = st.vbase;
    bb = w / p_.heads_kv, hk = w % p_.heads_kv;
    rpm = rp_max_, dp = dpad_, kt = kTileK, dimr = RoundUp(dim_, 4);
    // Scratch layout (floats).
    n_rows = static_cast<size_t>(rpm * dp);
    n_tile = static_cast<size_t>(rpm * kt);
    n_ktile = static_cast<size_t>(kt * dp);
    // Row-chunk buffers: rpm rows and 4 spare ones (Project's rounding) per chunk.
    cs = (rpm + 4) * kt;
    n_rel = static_cast<size_t>(nch_ * cs);
    n_rel2 = shaw_ && p_.shaw_rel_v != nullptr ? n_rel : 0;  // Shaw's rel_v
    const size_t total = 8 * n_rows + 2 * n_tile + 4 * n_ktile +
                         2 * static_cast<size_t>(dim_ * kt) + 2 * n_rel + 2 * n_rel2 +
                         2 * static_cast<size_t>(rpm);
    base = sc.Get(total);
    std::fill(base, base + total, 0.0f);
    qb = base;                  // q (XL: q + u) rows, dpad wide
    qx = qb + n_rows;           // XL: q + v
    dob = qx + n_rows;          // dout rows
    dqb = dob + n_rows;         // dQ of the block
    dqr = dqb + n_rows;         // XL: dQ's r(delta) part
    s = dqr + n_rows;           // scores, then P [rpm x kt]
    dps = s + n_tile;           // dP, then scale * dS
    qtr = dps + n_tile;         // Q^T (XL: (q + u)^T) [dpad x rpm]
    dotr = qtr + n_rows;        // dO^T [dpad x rpm]
    qxtr = dotr + n_rows;       // XL: (q + v)^T
    kp_s = qxtr + n_rows;       // key rows [kt x dpad]
    dkt_s = kp_s + n_ktile;     // dK^T tile [dpad x kt]
    dvt_s = dkt_s + n_ktile;    // dV^T tile [dpad x kt]
    dkx = dvt_s + n_ktile;      // DeBERTa p2c's dK rows of the tile (without item buffers)
    ktr_s = dkx + n_ktile;      // K^T [dim x kt]
    vtr_s = ktr_s + dim_ * kt;  // V^T
    // Row-chunk buffers: rel1 = scale q . rel_k (Shaw), scale q . pos_key (DeBERTa c2p),
    // scale (q + v) . r(t) (XL), w1 their sums of scale dS per table row; Shaw's rel_v:
    // rel2 = dout . rel_v, w2 the sums of P.
    rel1 = vtr_s + dim_ * kt;
    rel2 = n_rel2 > 0 ? rel1 + n_rel : nullptr;
    w1 = rel1 + n_rel + n_rel2;
    w2 = n_rel2 > 0 ? w1 + n_rel : nullptr;
    dsum = w1 + n_rel + n_rel2;
    lse = dsum + rpm;
    addr_buf = hwy::AllocateAligned<int32_t>(static_cast<size_t>(kTileK));
    addr = addr_buf.get();  // row-chunk address of each key's table row
    addr2_buf = hwy::AllocateAligned<int32_t>(static_cast<size_t>(kTileK));
    addr2 = addr2_buf.get();  // DeBERTa p2c: kpq / W address of each key
    qpos.assign(static_cast<size_t>(rpm), {});
    head.assign(static_cast<size_t>(rpm), {});
    // DeBERTa p2c per (key of the tile, head of the group): last bucket and product, and the
    // open run of equal buckets in pq_cells.
    p2c_u.assign(static_cast<size_t>(deberta_ ? kTileK * group_ : 0), -1);
    p2c_val.assign(p2c_u.size(), {});
    p2c_run.assign(p2c_u.size(), -1);
    kpt_buf = hwy::AllocateAligned<int32_t>(static_cast<size_t>(kTileK));
    kpt = kpt_buf.get();
    std::fill(kpt, kpt + kTileK, 0);

    scale = p_.scale;
    kposb = p_.kpos + bb * p_.seq_k;
    kbase = p_.k + bb * p_.k_stride[0] + hk * p_.k_stride[2];
    vbase = p_.v + bb * p_.v_stride[0] + hk * p_.v_stride[2];
    // When they fit the per-thread budget, the item's key rows, K^T and V^T tiles are formed once
    // and dK^T, dV^T accumulate in item buffers written out at the end; otherwise every (query
    // block, key tile) step forms its tiles and adds its dK, dV into the outputs. dK and dV are
    // kept transposed ([dpad x kTileK] per tile) so that their products, dV^T += dO^T P and
    // dK^T += Q^T dS, read P and dS as they are formed, with no per-step transposes.
    // DeBERTa's p2c term joins them: kpq[g][t][u][c] = scale k_c . pos_query[u, h] for every
    // table row u and key, and W[g][t][u][c], the sum of scale dS over the cells of key c whose
    // p2c row is u; after the last query block, dK^T += pos_query^T W and dpos_query += W K,
    // tile products once per key tile. Without the buffers, runs of equal rows per key (PqCell).
    // Query position range of every block, which key tiles it visits, and the table rows a set
    // of distances [dlo, dhi] can reach (the bucket tables are monotone in the distance, but
    // scanned anyway: the range is at most the sequence).
  }

  // The item's plan: the query position range of each block, the table rows of DeBERTa's p2c per
  // key tile, and its key tiles formed once when they fit the budget.
  void PlanItem(ItemState& st) {
    auto& nblocks = st.nblocks;
    auto& bq_min = st.bq_min;
    auto& bq_max = st.bq_max;
    auto& p2c_rows = st.p2c_rows;
    auto& n_all = st.n_all;
    auto& n_p2c = st.n_p2c;
    auto& cached = st.cached;
    auto& nb = st.nb;
    auto& n_diag = st.n_diag;
    auto& n_cache = st.n_cache;
    auto& kp_all = st.kp_all;
    auto& kt_all = st.kt_all;
    auto& vt_all = st.vt_all;
    auto& dk_all = st.dk_all;
    auto& dv_all = st.dv_all;
    auto& kpq_all = st.kpq_all;
    auto& wpq_all = st.wpq_all;
    auto& gd_all = st.gd_all;
    auto& wgd_all = st.wgd_all;
    auto& p2c_tiles = st.p2c_tiles;
    auto& cell_terms = st.cell_terms;
    auto& cell_grads = st.cell_grads;
    const DF d;
    [[maybe_unused]] auto& dp = st.dp;
    [[maybe_unused]] auto& kt = st.kt;
    [[maybe_unused]] auto& scale = st.scale;
    [[maybe_unused]] auto& kbase = st.kbase;
    [[maybe_unused]] auto& vbase = st.vbase;
    [[maybe_unused]] auto& bb = st.bb;
    [[maybe_unused]] auto& hk = st.hk;
    nblocks = (p_.seq_q + nq_ - 1) / nq_;
    bq_min.assign(static_cast<size_t>(nblocks), 0);
    bq_max.assign(bq_min.size(), 0);
    for (int64_t bi = 0; bi < nblocks; ++bi) {
      int32_t lo = std::numeric_limits<int32_t>::max(), hi = std::numeric_limits<int32_t>::min();
      for (int64_t i = bi * nq_; i < std::min(p_.seq_q, (bi + 1) * nq_); ++i) {
        lo = std::min(lo, p_.qpos[bb * p_.seq_q + i]);
        hi = std::max(hi, p_.qpos[bb * p_.seq_q + i]);
      }
      bq_min[static_cast<size_t>(bi)] = lo, bq_max[static_cast<size_t>(bi)] = hi;
    }
    // DeBERTa p2c: the table rows each key tile's cells can use (hi < lo: no block visits it).
    p2c_rows.assign(static_cast<size_t>(deberta_ ? ntiles_ : 0), {});
    for (int64_t t = 0; deberta_ && t < ntiles_; ++t) {
      int64_t dlo = std::numeric_limits<int64_t>::max(), dhi = std::numeric_limits<int64_t>::min();
      for (int64_t bi = 0; bi < nblocks; ++bi) {
        const int32_t qmin = bq_min[static_cast<size_t>(bi)],
                      qmax = bq_max[static_cast<size_t>(bi)];
        AddDistances(st, qmin, qmax, t, dlo, dhi);
      }
      p_.mask.clip_distances(dlo, dhi);
      p2c_rows[static_cast<size_t>(t)] =
          dlo > dhi ? std::pair<int64_t, int64_t>{0, -1}
                    : UsedRows(p_.deberta_p2c, p_.deberta_len, p_.deberta_dmax[bb], dlo, dhi);
    }
    n_all = ntiles_ * kt * dp;
    n_p2c = deberta_ ? group_ * ntiles_ * span2s_ * kt : 0;
    cached =
        (5 * n_all + 2 * n_p2c) * static_cast<int64_t>(sizeof(float)) <= backward_item_budget();
    // DeBERTa's diagonal p2c copies G and their gradients WG, [group][tiles][nb][kTileK], when
    // they fit too.
    nb = deberta_ && deb_b_hi_ >= deb_b_lo_ ? deb_b_hi_ - deb_b_lo_ + 1 : 0;
    n_diag = group_ * ntiles_ * nb * kt;
    if ((5 * n_all + 2 * n_p2c + 2 * n_diag) * static_cast<int64_t>(sizeof(float)) >
        backward_item_budget()) {
      nb = 0, n_diag = 0;
    }
    n_cache = 5 * n_all + 2 * n_p2c + 2 * n_diag;
    kp_all = nullptr, kt_all = nullptr, vt_all = nullptr, dk_all = nullptr, dv_all = nullptr,
    kpq_all = nullptr, wpq_all = nullptr, gd_all = nullptr, wgd_all = nullptr;
    if (cached) {
      kp_all = LocalCache().Get(static_cast<size_t>(n_cache));
      kt_all = kp_all + n_all;
      vt_all = kt_all + n_all;
      dk_all = vt_all + n_all;
      dv_all = dk_all + n_all;
      kpq_all = dv_all + n_all;
      wpq_all = kpq_all + n_p2c;
      gd_all = wpq_all + n_p2c;
      wgd_all = gd_all + n_diag;
      std::fill(kp_all, kp_all + n_cache, 0.0f);
      for (int64_t t = 0; t < ntiles_; ++t) {
        const int64_t j0 = t * kt, nk = std::min(kt, p_.seq_k - j0);
        TileOperands(bb, kbase, vbase, j0, nk, kp_all + j0 * dp, kt_all + t * dim_ * kt,
                     vt_all + t * dim_ * kt);
        const auto [ulo, uhi] =
            deberta_ ? p2c_rows[static_cast<size_t>(t)] : std::pair<int64_t, int64_t>{0, -1};
        for (int64_t g = 0; g < group_ && ulo <= uhi; ++g) {
          // Rows [ulo, ulo + RoundUp(n, 4)): within the tile's span2s_ rows.
          float* kpq = kpq_all + (g * ntiles_ + t) * span2s_ * kt + ulo * kt;
          const int64_t nr = RoundUp(uhi - ulo + 1, 4);
          ScoresTile(pq_pad_.get() + (ulo * p_.heads_q + hk * group_ + g) * dp, dim_,
                     kt_all + t * dim_ * kt, nr, kpq, kt, p_.heads_q * dp);
          const auto vs = hn::Set(d, scale);
          for (int64_t x = 0; x < nr * kt; x += lanes_) {
            hn::Store(hn::Mul(hn::Load(d, kpq + x), vs), d, kpq + x);
          }
          // The diagonal copy G[b][c] = kpq[b + step c][c] (rows the tile computed).
          const float* kq = kpq_all + (g * ntiles_ + t) * span2s_ * kt;
          float* gd = gd_all + (g * ntiles_ + t) * nb * kt;
          for (int64_t b = 0; b < nb; ++b)
            for (int64_t c = 0; c < kt; ++c) {
              const int64_t u = deb_b_lo_ + b + deb_step_ * c;
              if (u >= ulo && u <= uhi) gd[b * kt + c] = kq[u * kt + c];
            }
        }
      }
    }
    p2c_tiles = deberta_ && cached;
    cell_terms = has_cell_terms_ && !p2c_tiles;
    cell_grads = has_cell_grads_ && !p2c_tiles;
    // Without the item buffers dK, dV accumulate tile by tile in the outputs: start from zero.
    for (int64_t j = 0; !cached && j < p_.seq_k; ++j) {
      std::fill(b_.dk + bb * b_.dk_stride[0] + j * b_.dk_stride[1] + hk * b_.dk_stride[2],
                b_.dk + bb * b_.dk_stride[0] + j * b_.dk_stride[1] + hk * b_.dk_stride[2] + dim_,
                0.0f);
      std::fill(b_.dv + bb * b_.dv_stride[0] + j * b_.dv_stride[1] + hk * b_.dv_stride[2],
                b_.dv + bb * b_.dv_stride[0] + j * b_.dv_stride[1] + hk * b_.dv_stride[2] + dim_,
                0.0f);
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
    const auto kt = st.kt;
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
      if (xl_) {
        for (int64_t x = 0; x < dim_; ++x) {
          qb[r * dp + x] = qr[x] + p_.xl_content_bias[h * dim_ + x];
          qx[r * dp + x] = qr[x] + p_.xl_position_bias[h * dim_ + x];
        }
      }
      dsum[r] = Dot(dor, orow, dim_);
      lse[r] = p_.lse[bb * p_.lse_stride[0] + h * p_.lse_stride[1] + i * p_.lse_stride[2]];
      if (b_.dsinks != nullptr && lse[r] != kNegInf) {
        // The sink's probability exp(sink - lse) times dP - D with dP = 0 (it has no value).
        part[part_sink_ + (h - hk * group_)] -= std::exp(p_.sinks[h] - lse[r]) * dsum[r];
      }
    }
    for (int64_t r = 0; r < rp; ++r)
      for (int64_t x = 0; x < dim_; ++x) {
        qtr[x * rp + r] = qb[r * dp + x];
        dotr[x * rp + r] = dob[r * dp + x];
        if (xl_) qxtr[x * rp + r] = qx[r * dp + x];
      }
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
        // u = clamp(-delta, -K, K) + K
        const int64_t k = p_.shaw_k;
        br.c0 = (std::clamp<int64_t>(-dhi, -k, k) + k) / kt;
        br.c1 = (std::clamp<int64_t>(-dlo, -k, k) + k) / kt + 1;
      } else if (xl_) {
        br.c0 = std::clamp<int64_t>(p_.xl_dmax - dhi, 0, p_.xl_len - 1) / kt;
        br.c1 = std::clamp<int64_t>(p_.xl_dmax - dlo, 0, p_.xl_len - 1) / kt + 1;
      } else {
        const auto [ulo, uhi] =
            UsedRows(p_.deberta_c2p, p_.deberta_len, p_.deberta_dmax[bb], dlo, dhi);
        br.c0 = uhi < ulo ? 0 : ulo / kt, br.c1 = uhi < ulo ? 0 : uhi / kt + 1;  // none: empty
      }
      std::fill(w1 + br.c0 * cs, w1 + br.c1 * cs, 0.0f);
      if (w2 != nullptr) std::fill(w2 + br.c0 * cs, w2 + br.c1 * cs, 0.0f);
      Project(relk_, xl_ ? qx : qb, rel1, br);
      if (shaw_ && p_.shaw_rel_v != nullptr) Project(relv_, dob, rel2, br);
    }
    return Block{i0, nq, rows, rp, qmin, qmax, br};
  }

  // Tile t's key positions and operands (formed here unless the item holds them), and the
  // block's scores S = Q K^T and dP = dO V^T on it.
  Tile LoadTile(ItemState& st, const Block& blk, int64_t t) {
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
    ScoresTile(qb, dim_, ktr, rp, s, kt, dp);
    ScoresTile(dob, dim_, vtr, rp, dps, kt, dp);
    if (deberta_) {
      std::fill(st.p2c_u.begin(), st.p2c_u.end(), -1);
      std::fill(st.p2c_run.begin(), st.p2c_run.end(), -1);
    }
    return Tile{t, j0, nk, consec, kp, ktr, vtr, dkt, dvt};
  }

  // What TileRowScores leaves for TileRowGrads: the row's score and dP rows and where its terms
  // were read.
  struct RowAt {
    float* srow;
    float* drow;
    int64_t h;
    int32_t pq;
    int64_t xl_u0;
    bool xl_fast;
    bool deb_one;
    bool deb_diag;
    int64_t deb_g;
    int64_t deb_a;
    float* deb_w;
  };

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
    const auto p2c_tiles = st.p2c_tiles;
    const auto nb = st.nb;
    const auto hk = st.hk;
    const auto cs = st.cs;
    const auto kpq_all = st.kpq_all;
    const auto wpq_all = st.wpq_all;
    const auto rel1 = st.rel1;
    const auto gd_all = st.gd_all;
    const auto addr2 = st.addr2;
    const auto addr = st.addr;
    const auto rel2 = st.rel2;
    const auto cell_terms = st.cell_terms;
    const auto kposb = st.kposb;
    const auto dp = st.dp;
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
      RowMask row_mask(p_.mask, pq);
      if (tiles_->Any()) {
        const int64_t i = st.blk_i0 + r % st.blk_nq, qat = bb * p_.seq_q + i;
        if (p_.dense != nullptr) {
          if (!st.dense_buf) st.dense_buf = hwy::AllocateAligned<int32_t>(static_cast<size_t>(kt));
          FillDenseLanes(p_, bb, i, tile.j0, tile.nk, kt, st.dense_buf.get());
        }
        row_mask.SetBlock(p_.qdoc != nullptr ? p_.qdoc[qat] : 0,
                          p_.qopen != nullptr && p_.qopen[qat] != 0,
                          {p_.kdoc != nullptr ? st.kdoc_buf.get() : nullptr,
                           p_.kopen != nullptr ? st.kopen_buf.get() : nullptr,
                           p_.dense != nullptr ? st.dense_buf.get() : nullptr});
      }
      for (int64_t c = 0; c < kt; c += lanes_) {
        const auto vis = row_mask.VisibleAt(d, hn::Load(di, kpt + c), c);
        const auto x = hn::Mul(hn::Load(d, srow + c), vs);
        hn::Store(hn::IfThenElse(vis, x, vninf), d, srow + c);
      }
      for (int64_t c = tile.nk; c < kt; ++c) srow[c] = kNegInf;
    }
    // XL over consecutive keys whose distances all lie in the table (no clamping): the
    // row's table rows are u0 + c, so each vector's addresses are known without index
    // vectors: one run, or two across a row-chunk boundary.
    const int64_t xl_u0 = xl_ ? int64_t{p_.xl_dmax} - pq + kpt[0] : 0;
    const bool xl_fast = xl_ && tile.consec && xl_u0 >= 0 && xl_u0 + kt <= p_.xl_len;
    // DeBERTa over consecutive keys whose distances share one c2p row and one p2c row (far
    // keys: saturated buckets, most cells of a long causal sequence): one broadcast c2p
    // value, one contiguous run of the tile's p2c products, no index vectors. The same
    // arithmetic as the general path below.
    const int64_t deb_at0 = deberta_ ? int64_t{p_.deberta_dmax[bb]} - pq + kpt[0] : 0;
    const bool deb_one = p2c_tiles && tile.consec && deb_at0 >= 0 &&
                         deb_at0 + kt <= p_.deberta_len &&
                         deb_run_end_[static_cast<size_t>(deb_at0)] >= deb_at0 + kt;
    // DeBERTa over consecutive keys whose p2c rows all lie on the linear stretch: the p2c
    // products from the tile's diagonal copy (one run), W's from its gradient.
    const bool deb_diag = p2c_tiles && tile.consec && !deb_one && nb > 0 && deb_at0 >= 0 &&
                          deb_at0 + kt <= p_.deberta_len &&
                          deb_lin_[static_cast<size_t>(deb_at0)] != 0;
    const int64_t deb_g = deb_diag ? ((h - hk * group_) * ntiles_ + tile.t) * nb * kt +
                                         (p_.deberta_p2c[deb_at0] - deb_b_lo_) * kt
                                   : 0;
    int64_t deb_a = 0;              // the c2p row's address in rel1 / w1
    const float* deb_pq = nullptr;  // the p2c row of the tile's kpq
    float* deb_w = nullptr;         // and of its W
    if (deb_one) {
      const int64_t u = p_.deberta_c2p[deb_at0], u2 = p_.deberta_p2c[deb_at0];
      deb_a = (u / kt) * cs + r * kt + u % kt;
      const int64_t at = ((h - hk * group_) * ntiles_ + tile.t) * span2s_ * kt + u2 * kt;
      deb_pq = kpq_all + at;
      deb_w = wpq_all + at;
      const auto vc = hn::Set(d, rel1[deb_a]);
      for (int64_t c = 0; c < kt; c += lanes_) {
        const auto x = hn::Add(hn::Load(d, srow + c), hn::LoadU(d, deb_pq + c));
        hn::Store(hn::Add(x, vc), d, srow + c);
      }
    }
    if (xl_fast) {
      for (int64_t c = 0; c < kt; c += lanes_) {
        const auto [a0, a1, k] = XlRuns(xl_u0 + c, r, cs);
        auto v = hn::LoadU(d, rel1 + a0);
        if (k < lanes_) {
          v = hn::IfThenElse(hn::FirstN(d, static_cast<size_t>(k)), v, hn::LoadU(d, rel1 + a1 - k));
        }
        hn::Store(hn::Add(hn::Load(d, srow + c), v), d, srow + c);
      }
    }
    // Shaw's and DeBERTa's c2p term: the row's projection at each key's table row.
    if (shaw_ || (deberta_ && !deb_one) || (xl_ && !xl_fast)) {
      const DI di;
      const auto vpq = hn::Set(di, pq);
      const float* kpq =
          p2c_tiles ? kpq_all + ((h - hk * group_) * ntiles_ + tile.t) * span2s_ * kt : nullptr;
      const auto vrow = hn::Set(di, static_cast<int32_t>(r * kt));
      const auto vcs = hn::Set(di, static_cast<int32_t>(cs));
      const auto v63 = hn::Set(di, static_cast<int32_t>(kt - 1));
      for (int64_t c = 0; c < kt; c += lanes_) {
        const auto kpv = hn::Load(di, kpt + c);
        hn::Vec<DI> u;
        if (shaw_) {
          const auto k = hn::Set(di, static_cast<int32_t>(p_.shaw_k));
          u = hn::Min(hn::Max(hn::Add(hn::Sub(kpv, vpq), k), hn::Zero(di)), hn::Add(k, k));
        } else if (xl_) {
          // r(t) covers the distances a mask leaves visible: masked cells (P = 0, dS = 0)
          // read and add to a clamped row.
          u = hn::Min(hn::Max(hn::Add(kpv, hn::Set(di, static_cast<int32_t>(p_.xl_dmax - pq))),
                              hn::Zero(di)),
                      hn::Set(di, static_cast<int32_t>(p_.xl_len - 1)));
        } else {
          const auto at = hn::Add(kpv, hn::Set(di, static_cast<int32_t>(p_.deberta_dmax[bb] - pq)));
          // Consecutive key positions read the index tables contiguously (past the tile's
          // last key too: the tables have a tile of padding, and those keys are masked).
          const int64_t at0 = int64_t{p_.deberta_dmax[bb]} - pq + kpt[0] + c;
          u = tile.consec ? hn::LoadU(di, p_.deberta_c2p + at0)
                          : hn::GatherIndex(di, p_.deberta_c2p, at);
          if (deb_diag) {
            hn::Store(hn::Add(hn::Load(d, srow + c), hn::LoadU(d, gd_all + deb_g + c)), d,
                      srow + c);
          } else if (p2c_tiles) {
            // p2c: kpq[u2][c], address u2 * kTileK + c.
            const auto u2 = tile.consec ? hn::LoadU(di, p_.deberta_p2c + at0)
                                        : hn::GatherIndex(di, p_.deberta_p2c, at);
            const auto a2 = hn::Add(hn::ShiftLeft<6>(u2), hn::Iota(di, static_cast<int32_t>(c)));
            hn::Store(a2, di, addr2 + c);
            hn::Store(hn::Add(hn::Load(d, srow + c), GatherTileRows(kpq, addr2 + c)), d, srow + c);
          }
        }
        static_assert(kTileK == 64, "row-chunk addresses: u >> 6, u & 63");
        const auto a = hn::Add(hn::Add(hn::Mul(hn::ShiftRight<6>(u), vcs), vrow), hn::And(u, v63));
        hn::Store(a, di, addr + c);
        hn::Store(hn::Add(hn::Load(d, srow + c), GatherRows(rel1, addr + c, !deberta_)), d,
                  srow + c);
        if (shaw_ && p_.shaw_rel_v != nullptr) {
          hn::Store(hn::Add(hn::Load(d, drow + c), GatherRows(rel2, addr + c)), d, drow + c);
        }
      }
    }
    // ALiBi / T5 (masked cells stay -inf).
    const DistanceBiasRow<const float> bias(p_, p_.bias, bb, h, pq);
    if (bias.row != nullptr) {
      for (int64_t c = 0; c < kt; c += lanes_) {
        hn::Store(bias.Add(d, hn::Load(d, srow + c), kpt, c, tile.consec), d, srow + c);
      }
    }
    for (int64_t c = 0; cell_terms && c < tile.nk; ++c) {
      if (srow[c] == kNegInf) continue;
      const int32_t pk = kposb[tile.j0 + c];
      const int64_t delta = int64_t{pq} - pk;
      float x = srow[c];
      {
        const int64_t at = p_.deberta_dmax[bb] - delta;
        // k_c . pos_query[u, h]: consecutive rows of a column often share u (clipped or
        // log-bucketed distances), so the last product per (key, head) is kept.
        const int32_t u = p_.deberta_p2c[at];
        const size_t key = static_cast<size_t>(c * group_ + (h - hk * group_));
        if (st.p2c_u[key] != u) {
          st.p2c_u[key] = u;
          st.p2c_val[key] = scale * Dot(tile.kp + c * dp,
                                        p_.deberta_pos_query + (u * p_.heads_q + h) * dim_, dim_);
        }
        x += st.p2c_val[key];
      }
      srow[c] = x;
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
    at = RowAt{srow, drow, h, pq, xl_u0, xl_fast, deb_one, deb_diag, deb_g, deb_a, deb_w};
    return true;
  }

  // P = exp(S - lse) and dS = P (dP - D) of row r, the per-cell and per-bucket gradients of the
  // scheme's terms; scale * dS left in the dP row.
  void TileRowGrads(ItemState& st, const Tile& tile, int64_t r, const RowAt& at) {
    const auto lse = st.lse;
    const auto dsum = st.dsum;
    const auto kt = st.kt;
    const auto cell_grads = st.cell_grads;
    const auto kposb = st.kposb;
    const auto scale = st.scale;
    const auto bb = st.bb;
    const auto hk = st.hk;
    const auto cs = st.cs;
    const auto w1 = st.w1;
    const auto addr = st.addr;
    const auto w2 = st.w2;
    const auto wgd_all = st.wgd_all;
    const auto p2c_tiles = st.p2c_tiles;
    const auto wpq_all = st.wpq_all;
    const auto addr2 = st.addr2;
    const DF d;
    const auto srow = at.srow;
    const auto drow = at.drow;
    const auto h = at.h;
    const auto pq = at.pq;
    const auto xl_u0 = at.xl_u0;
    const auto xl_fast = at.xl_fast;
    const auto deb_one = at.deb_one;
    const auto deb_diag = at.deb_diag;
    const auto deb_g = at.deb_g;
    const auto deb_a = at.deb_a;
    const auto deb_w = at.deb_w;
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
    for (int64_t c = 0; cell_grads && c < tile.nk; ++c) {
      const float ds = drow[c];
      const float pr = srow[c];
      if (ds == 0.0f && pr == 0.0f) continue;
      const int32_t pk = kposb[tile.j0 + c];
      const int64_t delta = int64_t{pq} - pk;
      const float sds = scale * ds;
      {
        const int64_t at = p_.deberta_dmax[bb] - delta;
        // dK_j += scale dS pos_query[p2c] and dpos_query[p2c] += scale dS k_j: summed
        // over runs of equal u per (key, head) first, applied after the tile's products.
        const int64_t u = p_.deberta_p2c[at];
        const size_t key = static_cast<size_t>(c * group_ + (h - hk * group_));
        int32_t& run = st.p2c_run[key];
        if (run >= 0 && st.pq_cells[static_cast<size_t>(run)].u == u) {
          st.pq_cells[static_cast<size_t>(run)].sds += sds;
        } else {
          run = static_cast<int32_t>(st.pq_cells.size());
          st.pq_cells.push_back({c, u, h, sds});
        }
      }
    }
    // scale * dS from here on; Shaw's and DeBERTa's c2p bucket sums.
    const auto vs = hn::Set(d, scale);
    for (int64_t c = 0; c < kt; c += lanes_) {
      const auto sds = hn::Mul(hn::Load(d, drow + c), vs);
      hn::Store(sds, d, drow + c);
      if (xl_fast) {
        const auto [a0, a1, k] = XlRuns(xl_u0 + c, r, cs);
        if (k >= lanes_) {
          hn::StoreU(hn::Add(hn::LoadU(d, w1 + a0), sds), d, w1 + a0);
        } else {  // each element gets the same single addition
          const auto m = hn::FirstN(d, static_cast<size_t>(k));
          hn::BlendedStore(hn::Add(hn::LoadU(d, w1 + a0), sds), m, d, w1 + a0);
          float* t2 = w1 + a1 - k;
          hn::BlendedStore(hn::Add(hn::LoadU(d, t2), sds), hn::Not(m), d, t2);
        }
      } else if (deb_one) {  // ScatterAdd's single-address case
        w1[deb_a] += hn::GetLane(hn::SumOfLanes(d, sds));
        hn::StoreU(hn::Add(hn::LoadU(d, deb_w + c), sds), d, deb_w + c);
      } else if (shaw_ || deberta_ || xl_) {
        ScatterAdd(w1, addr + c, sds, xl_, /*rising=*/!deberta_);
      }
      if (shaw_ && b_.shaw_drel_v != nullptr) ScatterAdd(w2, addr + c, hn::Load(d, srow + c), true);
      if (deb_diag) {
        float* at = wgd_all + deb_g + c;
        hn::StoreU(hn::Add(hn::LoadU(d, at), sds), d, at);
      } else if (p2c_tiles && !deb_one) {
        // The tile's keys are distinct lanes: no two lanes share an address.
        float* wpq = wpq_all + ((h - hk * group_) * ntiles_ + tile.t) * span2s_ * kt;
        ScatterAddTileRows(wpq, addr2 + c, sds);
      }
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
    ScoresTile(dotr, rp, s, dimr, dvt, kt, rp, true);   // dV^T += dO^T P
    ScoresTile(qtr, rp, dps, dimr, dkt, kt, rp, true);  // dK^T += Q^T (scale dS)
    AccumulateTile(dps, nk, kp, dp, dp, rp, dqb);       // dQ += scale dS K
    for (const auto& cell : st.pq_cells) {              // DeBERTa p2c
      const int64_t g = cell.h - hk * group_;
      Axpy(cell.sds, p_.deberta_pos_query + (cell.u * p_.heads_q + cell.h) * dim_,
           dkx + cell.c * dp, dim_);
      Axpy(cell.sds, kp + cell.c * dp, part + part_pq_ + (g * span2s_ + cell.u) * dp, dim_);
    }
    st.pq_cells.clear();
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
      BackQ(relk_, w1, dqb, br);
      BackTable(w1, qtr, part + part_relk_, shaw_k_heads_, br);
      if (b_.shaw_drel_v != nullptr) BackTable(w2, dotr, part + part_relv_, shaw_v_heads_, br);
    } else if (deberta_) {
      BackQ(relk_, w1, dqb, br);
      BackTable(w1, qtr, part, group_, br);
    } else if (xl_) {
      BackQ(relk_, w1, dqr, br);  // dQ's r(delta) part
      BackTable(w1, qxtr, part + 2 * group_ * dim_, group_, br);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t h = st.head[static_cast<size_t>(r)], g = h - hk * group_;
      float* dq_r = dqb + r * dp;
      if (xl_) {
        Axpy(1.0f, dq_r, part + g * dim_, dim_);                          // du: the k part
        Axpy(1.0f, dqr + r * dp, part + group_ * dim_ + g * dim_, dim_);  // dv: the r part
        Axpy(1.0f, dqr + r * dp, dq_r, dim_);
      }
      const int64_t i = i0 + r % nq;
      std::memcpy(b_.dq + bb * b_.dq_stride[0] + i * b_.dq_stride[1] + h * b_.dq_stride[2], dq_r,
                  static_cast<size_t>(dim_) * sizeof(float));
    }
  }

  // DeBERTa's p2c products once per key tile, and the item's dK, dV written out.
  void FinishItem(ItemState& st) {
    const auto p2c_tiles = st.p2c_tiles;
    const auto kt = st.kt;
    const auto wpq_all = st.wpq_all;
    const auto wgd_all = st.wgd_all;
    const auto nb = st.nb;
    const auto hk = st.hk;
    const auto dk_all = st.dk_all;
    const auto dp = st.dp;
    const auto kp_all = st.kp_all;
    const auto part = st.part;
    const auto cached = st.cached;
    const auto bb = st.bb;
    const auto dv_all = st.dv_all;
    // DeBERTa p2c, once per key tile: dK^T += pos_query^T W, dpos_query += W K.
    for (int64_t t = 0; p2c_tiles && t < ntiles_; ++t) {
      const int64_t nk = std::min(kt, p_.seq_k - t * kt);
      const auto [ulo, uhi] = st.p2c_rows[static_cast<size_t>(t)];
      if (ulo > uhi) continue;
      for (int64_t g = 0; g < group_; ++g) {
        // The diagonal gradients folded back: W[b + step c][c] += WG[b][c].
        float* wq = wpq_all + (g * ntiles_ + t) * span2s_ * kt;
        const float* wgd = wgd_all + (g * ntiles_ + t) * nb * kt;
        for (int64_t b = 0; b < nb; ++b)
          for (int64_t c = 0; c < kt; ++c) {
            const int64_t u = deb_b_lo_ + b + deb_step_ * c;
            if (u >= ulo && u <= uhi) wq[u * kt + c] += wgd[b * kt + c];
          }
        // W's rows past uhi are zero: rounding the rows up to 4 adds nothing.
        const float* wpq = wpq_all + (g * ntiles_ + t) * span2s_ * kt + ulo * kt;
        ScoresTile(pq_t_.get() + (hk * group_ + g) * dimr_ * span2r_ + ulo, uhi - ulo + 1, wpq,
                   dimr_, dk_all + t * dp * kt, kt, span2r_, true);
        AccumulateTile(wpq, nk, kp_all + t * kt * dp, dp, dp, RoundUp(uhi - ulo + 1, 4),
                       part + part_pq_ + (g * span2s_ + ulo) * dp);
      }
    }
    for (int64_t j = 0; cached && j < p_.seq_k; ++j) {
      const int64_t t = j / kt, c = j % kt;
      float* dkr = OutRow(b_.dk, b_.dk_stride, bb, j, hk);
      float* dvr = OutRow(b_.dv, b_.dv_stride, bb, j, hk);
      for (int64_t x = 0; x < dim_; ++x) {
        dkr[x] = dk_all[(t * dp + x) * kt + c];
        dvr[x] = dv_all[(t * dp + x) * kt + c];
      }
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
        if (tiles_->Classify(qinfo, st.bb, t, i0, blk.nq) == TileKind::kHidden) continue;
        const Tile tile = LoadTile(st, blk, t);
        if (p_.kdoc != nullptr || p_.kopen != nullptr) {
          if (!st.kdoc_buf) {
            st.kdoc_buf = hwy::AllocateAligned<int32_t>(static_cast<size_t>(kTileK));
            st.kopen_buf = hwy::AllocateAligned<int32_t>(static_cast<size_t>(kTileK));
          }
          FillKeyLanes(p_, st.bb, tile.j0, tile.nk, kTileK, st.kdoc_buf.get(), st.kopen_buf.get());
        }
        for (int64_t r = 0; r < blk.rp; ++r) {
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
  std::vector<int32_t> deb_run_end_;  // DeBERTa: see the constructor
  std::vector<uint8_t> deb_lin_;
  int64_t deb_step_ = -1, deb_b_lo_ = std::numeric_limits<int64_t>::max(), deb_b_hi_ = -1;
  bool shaw_ = false, deberta_ = false, xl_ = false;
  bool has_cell_terms_ = false;  // a per-cell positional term (bias, DeBERTa p2c, XL r)
  bool has_cell_grads_ = false;  // its gradient per cell
  int64_t nrel_ = 0, span2_ = 0, hd_ = 0, hdp_ = 0, dimr_ = 4, nch_ = 0, part_pq_ = 0;
  RowTable relk_, relv_;  // Shaw rel_k (scaled), rel_v; DeBERTa pos_key (scaled)
  int64_t span2r_ = 0, span2s_ = 0, part_sink_ = 0;
  hwy::AlignedFreeUniquePtr<float[]> pq_pad_, pq_t_;  // DeBERTa pos_query, padded / transposed
  int64_t shaw_k_heads_ = 1, shaw_v_heads_ = 1, part_relk_ = 0, part_relv_ = 0, part_size_ = 0;
  std::vector<Scratch> scratch_, cache_;
  std::vector<float> xl_dr_;
  hwy::AlignedFreeUniquePtr<float[]> rnet_t_, sin_pad_, r_;
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
