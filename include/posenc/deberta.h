// posenc/deberta.h - DeBERTa disentangled attention (He et al. 2021; SPEC §8).
//
//   rho = pos_q - pos_k, optionally log-bucketed (DeBERTa-v2/v3, position_buckets > 0)
//   c2p = clamp(rho + K, 0, 2K-1),  K = position_buckets > 0 ? position_buckets
//                                                             : max_relative_positions
//   s_ij = (q_i.k_j + q_i.pos_key[c2p_ij, h] + k_j.pos_query[p2c_ij, h]) / sqrt(3 D)
//
// The p2c index. SPEC §8 and the paper write the position-to-content term with delta(j, i),
// p2c = clamp(-rho + K): the default (DebertaP2c::kSpec). The released model code (original and
// HF) gathers k.pos_query with clamp(-rho + K) along the *key* axis and then transposes, so the
// index trained models see is clamp(rho + K), the same as c2p: DebertaP2c::kModel, which is what
// checkpoints need (CLI: --deberta-p2c model).
#pragma once

#include <cstdint>

#include "posenc/tensor.h"

namespace posenc {

enum class DebertaP2c { kSpec, kModel };

struct DebertaBuckets {
  int64_t max_relative_positions = 512;  // `max_relative_positions` (>= 1)
  int64_t position_buckets = 0;          // `position_buckets`; 0 = no log bucketing
  bool float64_log = false;  // evaluate the log bucketing in double (the authors' code) instead
                             // of float32 (HF); they first differ at |rho| = 1643 for 512/4096
  DebertaP2c p2c = DebertaP2c::kSpec;
  // K, the attention span: the table has 2K rows.
  int64_t span() const { return position_buckets > 0 ? position_buckets : max_relative_positions; }
};

// Throws ValueError naming the field.
void validate(const DebertaBuckets& cfg);

// rho after the optional log bucketing of DeBERTa-v2 (SPEC §8).
int64_t deberta_bucket(int64_t rho, const DebertaBuckets& cfg);
// Rows of pos_key / pos_query used for (query position, key position).
int64_t deberta_c2p_index(int64_t pos_q, int64_t pos_k, const DebertaBuckets& cfg);
int64_t deberta_p2c_index(int64_t pos_q, int64_t pos_k, const DebertaBuckets& cfg);

// DeBERTa scheme parameters (non-owning): projected relative tables [2K, heads_q, head_dim].
struct DeBERTa {
  View<const float, 3> pos_key;
  View<const float, 3> pos_query;
  DebertaBuckets buckets = {};
};

}  // namespace posenc
