// src/attention/half.h - the fused forward on half-precision storage (private; attention/fused.cc
// implements it, src/half_precision_api.cc calls it).
#pragma once

#include "posenc/attention.h"
#include "posenc/dtype.h"

namespace posenc::detail {

// q, k, v and out with their shapes and strides (in elements); for kBF16 / kF16 the data
// pointer addresses the 2-byte storage and is never read as float.
struct StorageViews {
  View<const float, 4> q, k, v;
  View<float, 4> out;
  DType q_type = DType::kF32, kv_type = DType::kF32, out_type = DType::kF32;
};

// Validates the call like attention() and runs the fused kernel on the storage directly (rows
// widened as the kernel loads them, the output rounded once). Returns false, having written
// nothing that matters, when the call is outside that path's domain (a non-unit-stride last
// dimension, positions too sparse, RoPE angles other than the accurate ones) or when a score or
// the output is not finite (the caller's widened path then reports it).
bool attention_fused_storage(const StorageViews& s, const PositionScheme& scheme,
                             const AttentionOptions& options, const Positions* query_positions,
                             const Positions* key_positions);

}  // namespace posenc::detail
