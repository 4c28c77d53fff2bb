// bench/shapes.h - attention and RoPE shapes of real models, for the bench_* binaries.
//
// Head counts and sizes from each model's released config.json; `scheme` is a name accepted by
// posenc::bench::AttentionWorkload (its tables are random: only the sizes matter for timing).
#pragma once

#include <array>
#include <cstdint>

namespace posenc::bench {

struct ModelShape {
  const char* name;
  const char* scheme;  // none, rope, alibi, t5, shaw, deberta, xl
  int64_t heads_q;
  int64_t heads_kv;
  int64_t head_dim;
  bool causal;  // decoder (causal) or encoder (bidirectional)
};

// Llama-3-8B: 32 query heads sharing 8 kv heads (GQA 4), head_dim 128, RoPE (theta 5e5).
inline constexpr ModelShape kLlama3_8B = {"llama3_8b", "rope", 32, 8, 128, true};
// BLOOM-560m: 16 heads of 64 (hidden 1024), ALiBi, causal.
inline constexpr ModelShape kBloom560m = {"bloom_560m", "alibi", 16, 16, 64, true};
// T5-base encoder: 12 heads of 64, bucketed relative bias (32 buckets, max distance 128).
inline constexpr ModelShape kT5Base = {"t5_base", "t5", 12, 12, 64, false};
// DeBERTa-v3-base: 12 heads of 64, disentangled attention (256 buckets, span 512), encoder.
inline constexpr ModelShape kDebertaV3Base = {"deberta_v3_base", "deberta", 12, 12, 64, false};

inline constexpr std::array<ModelShape, 4> kModelShapes = {kLlama3_8B, kBloom560m, kT5Base,
                                                           kDebertaV3Base};

// Llama-3-8B RoPE: rope_theta 500000 on q [.., 32, 128] and k [.., 8, 128].
inline constexpr double kLlama3RopeTheta = 5e5;

}  // namespace posenc::bench
