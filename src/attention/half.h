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
// A paged cache (attention/paged.cc): StorageViews' k and v are then [batch, seq_k, heads_kv,
// head_dim] views of the page pools whose batch stride is the stride between pages; row b reads
// keys j < kv_len[b] from page block_table[b * table_stride + j / page_size] (dense, validated).
// The caller has checked fully masked rows.
struct PagedKeys {
  const int32_t* block_table = nullptr;
  int64_t table_stride = 0;
  int64_t page_size = 0;
  const int32_t* kv_len = nullptr;
};

bool attention_fused_storage(const StorageViews& s, const PositionScheme& scheme,
                             const AttentionOptions& options, const Positions* query_positions,
                             const Positions* key_positions, const PagedKeys* paged = nullptr);

}  // namespace posenc::detail
