// src/common.h - private helpers shared by the implementation files: argument checks that throw
// posenc errors with readable messages.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>

#include "kernels/parallel.h"
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
// Whether v's elements lie back to back in row-major order (dimensions of size 1 aside): then
// the helpers below run one flat loop the compiler vectorizes.
template <class T, std::size_t R>
bool compact(const View<T, R>& v) {
  int64_t want = 1;
  for (std::size_t d = R; d-- > 0;) {
    if (v.shape[d] == 1) continue;
    if (v.stride[d] != want) return false;
    want *= v.shape[d];
  }
  return true;
}

template <class T, std::size_t R>
void fill_view(const View<T, R>& v, T value) {
  if (v.numel() == 0) return;
  static_assert(R >= 1);
  if (compact(v)) {
    std::fill(v.data, v.data + v.numel(), value);
    return;
  }
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

// Whether n values from p, `stride` apart, are all finite. Float32 rows of unit stride test the
// exponent bits (all ones: inf or NaN) with integer operations the compiler vectorizes (a
// 16 MB tensor: about 5 ms through std::isfinite in double, well under 1 ms this way).
template <class T>
bool all_finite_run(const T* p, int64_t n, int64_t stride) {
  if constexpr (std::is_same_v<std::remove_const_t<T>, float>) {
    if (stride == 1) {
      uint32_t bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        uint32_t u;
        std::memcpy(&u, p + i, sizeof u);
        bad |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
      }
      return bad == 0;
    }
  }
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) ok &= std::isfinite(static_cast<double>(p[i * stride]));
  return ok;
}

template <class T, std::size_t R>
void require_all_finite(const View<T, R>& v, const std::string& name) {
  if (v.numel() == 0) return;
  static_assert(R >= 1);
  const int64_t inner = v.shape[R - 1], inner_stride = v.stride[R - 1];
  std::array<int64_t, R> idx{};
  const int64_t outer = v.numel() / inner;
  if (compact(v) && all_finite_run(v.data, v.numel(), 1)) return;  // the common case at once
  for (int64_t o = 0; o < outer; ++o) {
    int64_t off = 0;
    for (std::size_t d = 0; d + 1 < R; ++d) off += idx[d] * v.stride[d];
    const T* p = v.data + off;
    if (!all_finite_run(p, inner, inner_stride)) {
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

// require_all_finite with the scan of a large compact float32 tensor split over `threads`
// threads (0: all, as kernels::resolve_threads), the message from the serial scan when a value
// is not finite. The backward reads five [batch, seq, heads, dim] tensors so before its kernel
// starts: on one thread they took about 4 % of its time at 4096 x 8 x 128.
template <class T, std::size_t R>
void require_all_finite(const View<T, R>& v, const std::string& name, int threads) {
  if constexpr (std::is_same_v<std::remove_const_t<T>, float>) {
    const int64_t n = v.numel();
    const int t = kernels::resolve_threads(threads);
    if (t > 1 && n >= (int64_t{1} << 20) && compact(v)) {
      const int64_t parts = 4 * static_cast<int64_t>(t);
      std::atomic<bool> bad{false};
      kernels::parallel_for(parts, t, [&](int64_t i) {
        const int64_t lo = n * i / parts, hi = n * (i + 1) / parts;
        if (!all_finite_run(v.data + lo, hi - lo, 1)) bad.store(true, std::memory_order_relaxed);
      });
      if (!bad.load()) return;
    }
  }
  require_all_finite(v, name);
}

// Whether n float32 values from p (unit stride) are all bf16 values exactly: low 16 bits zero and
// none subnormal (a zero exponent with a nonzero fraction), so that vdpbf16ps reads each of them
// as it is.
inline bool bf16_exact_run(const float* p, int64_t n) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, p + i, sizeof u);
    bad |= static_cast<uint32_t>((u & 0xffffu) != 0 ||
                                 ((u & 0x7f800000u) == 0 && (u & 0x007f0000u) != 0));
  }
  return bad == 0;
}

// bf16_exact_run over a view whose last dimension has unit stride; a large compact one is
// scanned over `threads` threads (0: all).
template <std::size_t R>
bool bf16_exact(const View<const float, R>& v, int threads) {
  static_assert(R >= 1);
  const int64_t n = v.numel();
  if (n == 0) return true;
  if (compact(v)) {
    const int t = kernels::resolve_threads(threads);
    if (t <= 1 || n < (int64_t{1} << 20)) return bf16_exact_run(v.data, n);
    const int64_t parts = 4 * static_cast<int64_t>(t);
    std::atomic<bool> bad{false};
    kernels::parallel_for(parts, t, [&](int64_t i) {
      const int64_t lo = n * i / parts, hi = n * (i + 1) / parts;
      if (!bf16_exact_run(v.data + lo, hi - lo)) bad.store(true, std::memory_order_relaxed);
    });
    return !bad.load();
  }
  std::array<int64_t, R> idx{};
  const int64_t inner = v.shape[R - 1], outer = n / inner;
  for (int64_t o = 0; o < outer; ++o) {
    int64_t off = 0;
    for (std::size_t d = 0; d + 1 < R; ++d) off += idx[d] * v.stride[d];
    if (!bf16_exact_run(v.data + off, inner)) return false;
    for (std::size_t d = R - 1; d-- > 0;) {
      if (++idx[d] < v.shape[d]) break;
      idx[d] = 0;
    }
  }
  return true;
}

}  // namespace posenc::detail
