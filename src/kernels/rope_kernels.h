// src/kernels/rope_kernels.h - the float32 RoPE kernel's parameters and entry point (rope_hwy.cc).
//
// src/rope.cc validates the views and fills a RopeParams; the kernel assumes valid input. No
// Highway type crosses this header: rope_f32 dispatches once per call to the best SIMD target.
#pragma once

#include <cstdint>

#include "posenc/tensor.h"

namespace posenc::kernels {

// One float32 tensor [batch, seq, heads, head_dim] rotated from x into out (out may equal x; any
// other overlap is undefined). Strides are in elements for the batch, seq and heads dims (stride
// 0 allowed for x); the head_dim dim is unit-stride in both.
struct RopeTensor {
  const float* x = nullptr;
  float* out = nullptr;
  int64_t heads = 0;
  int64_t x_stride[3] = {0, 0, 0};
  int64_t out_stride[3] = {0, 0, 0};
};

// Everything one call rotates: up to two tensors (q and k) that share batch, seq, head_dim,
// positions and therefore the cos/sin of every (token, pair).
struct RopeParams {
  RopeTensor tensors[2];
  int num_tensors = 1;
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t head_dim = 0;
  const double* inv_freq = nullptr;  // `pairs` entries; rotary dim R = 2 * pairs <= head_dim
  int64_t pairs = 0;
  double attention_factor = 1.0;
  bool interleaved = false;              // RopeStyle::kInterleaved, else kHalf
  bool inverse = false;                  // Direction::kInverse: rotate by -angle
  const Positions* positions = nullptr;  // validated for [batch, seq]; never null
  int num_threads = 1;                   // >= 1
};

// Accurate-angle RoPE (SPEC §3, §10) on every tensor of `p`: angles p * inv_freq in double,
// reduced exactly modulo pi/2, cos/sin and the rotation in double, one rounding to float32.
void rope_f32(const RopeParams& p);

}  // namespace posenc::kernels
