// posenc/half.h - half-precision storage types: IEEE binary16 (f16) and bfloat16 (bf16).
//
// Two bytes each, no arithmetic: kernels widen them to float32 (exactly) and narrow results back
// once (round to nearest, ties to even; overflow gives infinity; NaN stays NaN, quiet). The
// layouts are the ones PyTorch, NumPy (float16), ggml and safetensors (F16, BF16) store.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace posenc {

struct f16 {
  uint16_t bits = 0;
};
struct bf16 {
  uint16_t bits = 0;
};
static_assert(sizeof(f16) == 2 && sizeof(bf16) == 2);

// Exact widening (inline: the conversion loops vectorize).
inline float to_float(f16 x) {
  const uint16_t h = x.bits;
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float32
    const float mag = static_cast<float>(mant) * 0x1p-24f;
    return sign ? -mag : mag;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));  // inf, NaN
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}
inline float to_float(bf16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.bits) << 16); }
inline float to_float(float x) { return x; }

// Rounding to nearest even (subnormals included for f16).
f16 f16_from_float(float x);
inline bf16 bf16_from_float(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  if (std::isnan(x)) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};  // NaN: quiet
  // Round to nearest even on the dropped 16 bits (carries into the exponent: overflow -> inf).
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(rounded >> 16)};
}

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
