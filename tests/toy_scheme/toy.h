// posenc/toy.h - a toy scheme for the "How to add a scheme" check (docs/architecture.md): a bias
// -slope |pos_q - pos_k| with one slope for every head, set by the `toy_slope` setting.
#pragma once

#include <cstdint>

namespace posenc {

struct Toy {
  double slope = 0.5;  // > 0
};

// Its bias for one (query, key) pair.
inline double toy_bias(double slope, int64_t pos_q, int64_t pos_k) {
  const int64_t d = pos_q - pos_k;
  return -slope * static_cast<double>(d < 0 ? -d : d);
}

}  // namespace posenc
