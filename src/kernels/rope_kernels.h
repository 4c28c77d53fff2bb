// src/kernels/rope_kernels.h - the float32 RoPE kernel's parameters and entry point (rope_hwy.cc).
//
// src/schemes/rope.cc validates the views and fills a RopeParams; the kernel assumes valid input.
// No Highway type crosses this header: rope_f32 dispatches once per call to the best SIMD target.
#pragma once

#include <cstdint>

#include "posenc/dtype.h"
#include "posenc/tensor.h"

namespace posenc::kernels {

// A RopeTensor's element type (posenc::DType): kF32, or kBF16 / kF16 (the bits of posenc::bf16 /
// posenc::f16).

// One tensor [batch, seq, heads, head_dim] rotated from x into out (out may equal x; any other
// overlap is undefined). Strides are in elements for the batch, seq and heads dims (stride 0
// allowed for x); the head_dim dim is unit-stride in both. float32 tensors use x / out, bf16 and
// f16 tensors x_half / out_half: each row is widened exactly to float32, rotated by the float32
// kernel's own instructions and rounded once to nearest even, bit-identical to widening the
// tensor, rope_f32, and from_float<T> of every element (dims >= R included).
struct RopeTensor {
  const float* x = nullptr;
  float* out = nullptr;
  const uint16_t* x_half = nullptr;
  uint16_t* out_half = nullptr;
  DType dtype = DType::kF32;
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

// Accurate-angle RoPE (docs/rope.md, Precision) on every tensor of `p`: angles p * inv_freq in
// double, reduced exactly modulo pi/2, cos/sin and the rotation in double, one rounding to
// float32.
void rope_f32(const RopeParams& p);

// dst[i] = to_float(src[i]) (posenc/half.h; exact) and dst[i] = from_float<T>(src[i]) (round to
// nearest even, NaN quiet, f16 overflow to infinity and subnormals) for i < n, T = bf16 or f16
// (`t` != kFloat32), SIMD on the dispatched target.
void half_to_float(DType t, const uint16_t* src, float* dst, int64_t n);
void float_to_half(DType t, const float* src, uint16_t* dst, int64_t n);

// cos/sin per position for kernels that rotate rows as they load them (the fused attention
// kernels with RoPE, instead of rotated copies of q and k): row t of `cs` holds c[0, padded)
// then s[0, padded) for position pos0 + t, the values rope_f32 forms for that position, so a
// row rotated from the table is bit-identical to rope_f32's output for it.
struct RopeRowTable {
  const double* cs = nullptr;  // [n, 2 * padded]
  int64_t padded = 0;          // rope_table_padded(pairs)
  int64_t pairs = 0;           // rotary dim R = 2 * pairs
  int64_t offset = 0;          // rotated dims [offset, offset + R) of each row; others copied
  int64_t head_dim = 0;
  bool interleaved = false;
};

// Pairs rounded up to a multiple of every target's double lane count.
inline int64_t rope_table_padded(int64_t pairs) { return (pairs + 15) / 16 * 16; }

// Fills `cs` [n, 2 * rope_table_padded(pairs)] for positions pos0 .. pos0 + n - 1 (forward
// direction, attention factor included), `num_threads` threads (>= 1).
void rope_fill_table(const double* inv_freq, int64_t pairs, double attention_factor, int64_t pos0,
                     int64_t n, double* cs, int num_threads);

// out + r * os = x + r * xs rotated by table row idx[r] + add, for r < n (rows of head_dim
// floats; out may equal x, other overlap is undefined).
void rope_rotate_rows(const RopeRowTable& t, const int32_t* idx, int64_t add, int64_t n,
                      const float* x, int64_t xs, float* out, int64_t os);

}  // namespace posenc::kernels
