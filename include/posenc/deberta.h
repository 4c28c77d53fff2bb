// posenc/deberta.h - DeBERTa disentangled attention (He et al. 2021; docs/deberta.md).
//
//   rho = pos_q - pos_k, optionally log-bucketed (DeBERTa-v2/v3, position_buckets > 0)
//   c2p = clamp(rho + K, 0, 2K-1),  K = position_buckets > 0 ? position_buckets
//                                                             : max_relative_positions
//   s_ij = (q_i.k_j + q_i.pos_key[c2p_ij, h] + k_j.pos_query[p2c_ij, h]) / sqrt(3 D)
//
// The p2c index (docs/deberta.md, "The p2c index"). The released model code (the authors' and
// Hugging Face's DebertaV2 attention) gathers k.pos_query with clamp(-rho + K) along the *key* axis
// and then transposes, so the index every trained checkpoint saw is clamp(rho + K, 0, 2K-1), the
// same as c2p: DebertaP2c::kModel, the default (CLI: --deberta-p2c model). The paper writes the
// term with delta(j, i), p2c = clamp(-rho + K, 0, 2K-1): DebertaP2c::kPaper (--deberta-p2c paper),
// for comparison with the paper only; no released checkpoint computes it.
#pragma once

#include <cstdint>

#include "posenc/tensor.h"

namespace posenc {

enum class DebertaP2c {
  kModel,          // clamp(rho + K): the released code and every trained checkpoint (default)
  kPaper,          // clamp(-rho + K): the paper's delta(j, i)
  kSpec = kPaper,  // deprecated spelling of kPaper, kept for source compatibility
};

struct DebertaBuckets {
  int64_t max_relative_positions = 512;  // `max_relative_positions` (>= 1)
  int64_t position_buckets = 0;          // `position_buckets`; 0 = no log bucketing
  bool float64_log = false;  // evaluate the log bucketing in double (the authors' code) instead
                             // of float32 (HF); they first differ at |rho| = 1643 for 512/4096
  DebertaP2c p2c = DebertaP2c::kModel;
  // K, the attention span: the table has 2K rows.
  int64_t span() const { return position_buckets > 0 ? position_buckets : max_relative_positions; }
};

// Throws ValueError naming the field.
void validate(const DebertaBuckets& cfg);

// rho after the optional log bucketing of DeBERTa-v2 (docs/deberta.md).
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
