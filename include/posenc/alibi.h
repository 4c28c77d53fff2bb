// posenc/alibi.h - attention with linear biases (ALiBi, Press et al. 2022; docs/alibi.md).
//
// Slopes for H heads, max bias B (8 in the paper, MPT's `alibi_bias_max`):
//   H a power of two:  m_h = 2^(-B h / H),  h = 1..H
//   otherwise, n = 2^floor(log2 H): the n power-of-two slopes, then every other slope of the
//   2n-head set (indices 0, 2, 4, ...) until H slopes in all (BLOOM, MPT, Falcon).
// Bias added to the scaled score: -m_h |pos_q - pos_k| (equal to the causal -m_h (pos_q - pos_k)
// on every visible cell). BLOOM's m_h pos_k and MPT's m_h (pos_k - (Lk-1)) differ from it by a
// per-row constant: the same softmax, different logits.
#pragma once

#include <cstdint>
#include <vector>

namespace posenc {

struct AlibiConfig {
  int64_t heads = 0;      // H >= 1
  double max_bias = 8.0;  // B > 0
};

// Slopes in double, head order. Throws ValueError on heads < 1 or max_bias <= 0 / non-finite.
std::vector<double> alibi_slopes(const AlibiConfig& cfg);

// Bias for one (query, key) pair.
inline double alibi_bias(double slope, int64_t pos_q, int64_t pos_k) {
  const int64_t d = pos_q - pos_k;
  return -slope * static_cast<double>(d < 0 ? -d : d);
}

}  // namespace posenc
