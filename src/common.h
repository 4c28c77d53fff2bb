// src/common.h - private helpers shared by the implementation files: argument checks that throw
// posenc errors with readable messages.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "posenc/error.h"
#include "posenc/size.h"
#include "posenc/tensor.h"

namespace posenc::detail {

template <class E = ValueError>
[[noreturn]] inline void fail(const std::string& msg) {
  throw E(msg);
}

inline std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

inline void require_positive(int64_t v, const std::string& name) {
  if (v < 1) fail(name + " must be >= 1 (got " + std::to_string(v) + ")");
}

inline void require_finite(double v, const std::string& name) {
  if (!std::isfinite(v)) fail(name + " must be finite (got " + num(v) + ")");
}

template <class T, std::size_t R>
void require_data(const View<T, R>& v, const std::string& name) {
  for (std::size_t d = 0; d < R; ++d) {
    if (v.shape[d] < 0) {
      fail<ShapeError>(name + ": negative dimension in shape " + shape_str(v.shape));
    }
  }
  if (v.data == nullptr && v.numel() > 0) fail<ShapeError>(name + ": null data pointer");
}

// Sets every element of a (strided) view to `value`.
template <class T, std::size_t R>
void fill_view(const View<T, R>& v, T value) {
  if (v.numel() == 0) return;
  static_assert(R >= 1);
  std::array<int64_t, R> idx{};
  const int64_t inner = v.shape[R - 1], outer = v.numel() / inner;
  for (int64_t o = 0; o < outer; ++o) {
    int64_t off = 0;
    for (std::size_t d = 0; d + 1 < R; ++d) off += idx[d] * v.stride[d];
    for (int64_t i = 0; i < inner; ++i) v.data[off + i * v.stride[R - 1]] = value;
    for (std::size_t d = R - 1; d-- > 0;) {
      if (++idx[d] < v.shape[d]) break;
      idx[d] = 0;
    }
  }
}

// Every element finite (NaN/Inf in an input is an error, not a silent NaN output). The inner
// loop runs over the last dimension with a plain stride so the scan costs ~1 cycle per element.
template <class T, std::size_t R>
void require_all_finite(const View<T, R>& v, const std::string& name) {
  if (v.numel() == 0) return;
  static_assert(R >= 1);
  const int64_t inner = v.shape[R - 1], inner_stride = v.stride[R - 1];
  std::array<int64_t, R> idx{};
  const int64_t outer = v.numel() / inner;
  for (int64_t o = 0; o < outer; ++o) {
    int64_t off = 0;
    for (std::size_t d = 0; d + 1 < R; ++d) off += idx[d] * v.stride[d];
    const T* p = v.data + off;
    bool ok = true;
    for (int64_t i = 0; i < inner; ++i)
      ok &= std::isfinite(static_cast<double>(p[i * inner_stride]));
    if (!ok) {
      for (int64_t i = 0; i < inner; ++i) {
        const double x = static_cast<double>(p[i * inner_stride]);
        if (std::isfinite(x)) continue;
        idx[R - 1] = i;
        std::string at;
        for (std::size_t d = 0; d < R; ++d) at += (d ? ", " : "") + std::to_string(idx[d]);
        fail(name + ": non-finite value " + num(x) + " at [" + at + "]");
      }
    }
    for (std::size_t d = R - 1; d-- > 0;) {
      if (++idx[d] < v.shape[d]) break;
      idx[d] = 0;
    }
  }
}

}  // namespace posenc::detail
