// src/half_convert.cc - f16 / bf16 conversions (posenc/half.h).
#include <bit>
#include <cmath>
#include <cstdint>

#include "posenc/half.h"

namespace posenc {

f16 f16_from_float(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const auto sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) {  // NaN: keep the top payload bits, quiet
    return f16{static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu))};
  }
  if (abs >= 0x477ff000u) {  // >= 65520 rounds to infinity (and infinity itself)
    return f16{static_cast<uint16_t>(sign | 0x7c00u)};
  }
  if (abs < 0x38800000u) {
    // Below the smallest normal 2^-14: a subnormal m * 2^-24, m = round(|x| * 2^24) (exact
    // scaling; nearbyint rounds to nearest even in the default mode).
    const float m = std::nearbyint(std::bit_cast<float>(abs) * 0x1p24f);
    return f16{static_cast<uint16_t>(sign | static_cast<uint16_t>(m))};
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  const uint32_t rebias = abs - (112u << 23);
  const uint32_t rounded = rebias + 0xfffu + ((rebias >> 13) & 1u);
  return f16{static_cast<uint16_t>(sign | (rounded >> 13))};
}

}  // namespace posenc
