// posenc/half.h - half-precision storage types: IEEE binary16 (f16) and bfloat16 (bf16).
//
// Two bytes each, no arithmetic: kernels widen them to float32 (exactly) and narrow results back
// once (round to nearest, ties to even; overflow gives infinity; NaN stays NaN, quiet). The
// layouts are the ones PyTorch, NumPy (float16), ggml and safetensors (F16, BF16) store.
#pragma once

#include <cstdint>

namespace posenc {

struct f16 {
  uint16_t bits = 0;
};
struct bf16 {
  uint16_t bits = 0;
};
static_assert(sizeof(f16) == 2 && sizeof(bf16) == 2);

// Exact widening.
float to_float(f16 x);
float to_float(bf16 x);
inline float to_float(float x) { return x; }

// Rounding to nearest even (subnormals included for f16).
f16 f16_from_float(float x);
bf16 bf16_from_float(float x);

// from_float<T>(x) for T in {float, f16, bf16}: generic code's narrowing.
template <class T>
T from_float(float x);
template <>
inline float from_float<float>(float x) {
  return x;
}
template <>
inline f16 from_float<f16>(float x) {
  return f16_from_float(x);
}
template <>
inline bf16 from_float<bf16>(float x) {
  return bf16_from_float(x);
}

}  // namespace posenc
