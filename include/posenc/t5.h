// posenc/t5.h - T5 bucketed relative attention bias (Raffel et al. 2020; docs/t5.md).
//
// rel = pos_k - pos_q.
//   bidirectional: NB' = NB/2, b = (rel > 0) NB', n = |rel|;   causal: NB' = NB, b = 0,
//   n = max(-rel, 0);  e = NB'/2;  n < e: b += n;
//   else b += min(NB'-1, e + trunc(log(n/e) / log(MD/e) * (NB'-e)))  with the log in float32, as
//   the reference models evaluate it. For the released 32/128 configuration float32 and double
//   agree for every |rel| <= 1e5; other configurations differ (e.g. 18 buckets / 128 at rel -64).
// Bias: table[bucket, h], table [NB, H]. T5 uses scale 1.
#pragma once

#include <cstdint>
#include <vector>

#include "posenc/tensor.h"

namespace posenc {

struct T5BucketConfig {
  int64_t num_buckets = 32;    // NB >= 2 (even when bidirectional)
  int64_t max_distance = 128;  // MD > NB'/2
  bool bidirectional = true;   // encoder; false for the causal decoder
};

// Throws ValueError naming the field.
void validate(const T5BucketConfig& cfg);

// Bucket of one relative position (key minus query). No validation (hot path).
int64_t t5_bucket(int64_t rel, const T5BucketConfig& cfg);

// Bucket map [seq_q, seq_k] row-major with the default positions (query i at
// seq_k - seq_q + i, key j at j) unless explicit positions are given.
std::vector<int64_t> t5_bucket_map(const T5BucketConfig& cfg, int64_t seq_q, int64_t seq_k,
                                   const Positions* query_positions = nullptr,
                                   const Positions* key_positions = nullptr);

// Gradient of the bias with respect to the table: dtable[bucket(i,j), h] += dscore[h, i, j] over
// every cell. dscore [heads, seq_q, seq_k] (one batch row), dtable [NB, heads] (accumulates).
void t5_bias_backward(const T5BucketConfig& cfg, View<const float, 3> dscore, View<float, 2> dtable,
                      const Positions* query_positions = nullptr,
                      const Positions* key_positions = nullptr);

namespace ref {
// Bucket with the log in double (used to show where float32 moves a boundary).
int64_t t5_bucket_f64(int64_t rel, const T5BucketConfig& cfg);
}  // namespace ref

}  // namespace posenc
