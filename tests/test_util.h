// tests/test_util.h - small helpers shared by the GoogleTest suites:
//   * seeded random numbers (POSENC_TEST_SEED overrides the default seed; print seed_trace() in a
//     SCOPED_TRACE so a failure can be replayed),
//   * float comparisons (ulp of a value, ulp distance, all_close with a readable first mismatch),
//   * Strided<T, R>: a tensor carved out of a bigger buffer, with padded and optionally permuted
//     or non-unit-stride dimensions, whose outside is filled with a sentinel so a test can check
//     that nothing outside the view was written.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "posenc/tensor.h"

namespace posenc_test {

// ---------------------------------------------------------------------------------------------
// Random numbers.

// Base seed of every random input: POSENC_TEST_SEED from the environment, else a fixed default.
inline uint64_t test_seed() {
  static const uint64_t seed = [] {
    const char* s = std::getenv("POSENC_TEST_SEED");
    return s != nullptr ? std::strtoull(s, nullptr, 10) : uint64_t{20240607};
  }();
  return seed;
}

// Whether this build runs under AddressSanitizer (the sanitized CI build). Its purpose is memory
// and undefined behaviour: the heaviest value sweeps run a subset there (each memory path kept),
// the full grid in the optimized build.
constexpr bool kSanitized =
#if defined(__SANITIZE_ADDRESS__)
    true;
#else
    false;
#endif

// "POSENC_TEST_SEED=<seed>" for SCOPED_TRACE.
inline std::string seed_trace(uint64_t seed = test_seed()) {
  return "POSENC_TEST_SEED=" + std::to_string(seed);
}

// A seeded generator; `stream` separates the inputs of different tests drawn from one seed.
class Rng {
 public:
  explicit Rng(uint64_t seed = test_seed(), uint64_t stream = 0) {
    std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                      static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)};
    gen_.seed(seq);
  }
  double uniform(double lo = -1.0, double hi = 1.0) {
    return std::uniform_real_distribution<double>(lo, hi)(gen_);
  }
  // Uniform integer in [lo, hi] (inclusive).
  int64_t integer(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(gen_);
  }
  template <class T = float>
  std::vector<T> values(std::size_t n, double lo = -1.0, double hi = 1.0) {
    std::vector<T> v(n);
    for (auto& x : v) x = static_cast<T>(uniform(lo, hi));
    return v;
  }
  std::mt19937_64& engine() { return gen_; }

 private:
  std::mt19937_64 gen_;
};

// ---------------------------------------------------------------------------------------------
// Float comparisons.

// Spacing of float32 at |x| (distance from |float(x)| to the next float away from zero): the
// unit of "within k ulp" bounds. Conservative (the larger neighbour spacing) at powers of two.
inline double ulp_f32(double x) {
  const float f = std::fabs(static_cast<float>(x));
  return static_cast<double>(std::nextafter(f, std::numeric_limits<float>::infinity())) -
         static_cast<double>(f);
}

// Number of float32 values between a and b (0 when equal; +0 and -0 are equal).
inline int64_t ulp_distance(float a, float b) {
  auto key = [](float f) {
    int32_t i;
    std::memcpy(&i, &f, sizeof i);
    return i >= 0 ? int64_t{i} : -int64_t{i & 0x7fffffff};
  };
  const int64_t d = key(a) - key(b);
  return d < 0 ? -d : d;
}

// Bitwise equality (distinguishes -0 from +0 and compares NaN payloads).
template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// |got[i] - want[i]| <= atol + rtol * |want[i]| for every i, with a message naming the count of
// mismatches, the first one and the largest error.
template <class A, class B>
::testing::AssertionResult all_close(const std::vector<A>& got, const std::vector<B>& want,
                                     double atol, double rtol) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure()
           << "size " << got.size() << " != expected size " << want.size();
  }
  std::size_t bad = 0, first = 0, worst = 0;
  double worst_err = -1.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(got[i]), w = static_cast<double>(want[i]);
    const double err = std::fabs(g - w);
    const bool ok = err <= atol + rtol * std::fabs(w) || (std::isnan(g) && std::isnan(w));
    if (!ok) {
      if (bad++ == 0) first = i;
      if (err > worst_err || std::isnan(err)) worst_err = err, worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os.precision(17);
  os << bad << " of " << got.size() << " elements differ (atol " << atol << ", rtol " << rtol
     << "); first at " << first << ": got " << static_cast<double>(got[first]) << ", expected "
     << static_cast<double>(want[first]) << "; largest at " << worst << ": got "
     << static_cast<double>(got[worst]) << ", expected " << static_cast<double>(want[worst]);
  return ::testing::AssertionFailure() << os.str();
}

// ---------------------------------------------------------------------------------------------
// Multi-indices and strided views.

// Calls f(idx) for every index of `shape` in row-major order.
template <std::size_t R, class F>
void for_each_index(const std::array<int64_t, R>& shape, F&& f) {
  for (auto s : shape) {
    if (s <= 0) return;
  }
  std::array<int64_t, R> idx{};
  while (true) {
    f(static_cast<const std::array<int64_t, R>&>(idx));
    std::size_t d = R;
    while (d-- > 0) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
    if (d == static_cast<std::size_t>(-1)) return;
  }
}

// Element offset of `idx` in a view.
template <class T, std::size_t R>
int64_t offset_of(const posenc::View<T, R>& v, const std::array<int64_t, R>& idx) {
  int64_t off = 0;
  for (std::size_t d = 0; d < R; ++d) off += idx[d] * v.stride[d];
  return off;
}

// Row-major copy of any view.
template <class T, std::size_t R>
std::vector<std::remove_const_t<T>> to_vector(const posenc::View<T, R>& v) {
  std::vector<std::remove_const_t<T>> out;
  out.reserve(static_cast<std::size_t>(v.numel()));
  for_each_index(v.shape,
                 [&](const std::array<int64_t, R>& i) { out.push_back(v.data[offset_of(v, i)]); });
  return out;
}

// A rank-R tensor inside a bigger buffer. Every dimension gets `pad` extra slots, dimensions are
// laid out in memory in `order` (outermost first; default identity), and the innermost memory
// dimension advances by `inner_step` elements (1 keeps it unit-stride, 2 skips every other
// element). Everything outside the tensor holds kSentinel. Movable, not copyable (the view points
// into the owned buffer, which a move keeps in place).
template <class T, std::size_t R>
class Strided {
 public:
  static constexpr T kSentinel = static_cast<T>(-7777.25);

  explicit Strided(const std::array<int64_t, R>& shape, int64_t pad = 3,
                   std::array<std::size_t, R> order = identity(), int64_t inner_step = 1) {
    view_.shape = shape;
    int64_t s = inner_step;
    for (std::size_t k = R; k-- > 0;) {
      const std::size_t d = order[k];
      view_.stride[d] = s;
      s *= shape[d] + pad;
    }
    // Start past a few sentinels so an underflowing write is also caught.
    buf_.assign(static_cast<std::size_t>(s + 2 * kGuard), kSentinel);
    view_.data = buf_.data() + kGuard;
    inside_.assign(buf_.size(), false);
    for_each_index(shape, [&](const std::array<int64_t, R>& i) {
      inside_[static_cast<std::size_t>(kGuard + offset_of(view_, i))] = true;
    });
  }
  // Same as above with values copied in (row-major).
  Strided(const std::array<int64_t, R>& shape, const std::vector<T>& values, int64_t pad = 3,
          std::array<std::size_t, R> order = identity(), int64_t inner_step = 1)
      : Strided(shape, pad, order, inner_step) {
    set(values);
  }
  Strided(const Strided&) = delete;
  Strided& operator=(const Strided&) = delete;
  Strided(Strided&&) = default;
  Strided& operator=(Strided&&) = default;

  static std::array<std::size_t, R> identity() {
    std::array<std::size_t, R> o{};
    std::iota(o.begin(), o.end(), std::size_t{0});
    return o;
  }

  posenc::View<T, R> view() const { return view_; }
  posenc::View<const T, R> cview() const { return view_; }
  // Row-major values.
  std::vector<T> values() const { return to_vector(view_); }
  void set(const std::vector<T>& values) {
    std::size_t k = 0;
    for_each_index(view_.shape, [&](const std::array<int64_t, R>& i) {
      view_.data[offset_of(view_, i)] = values.at(k++);
    });
  }
  // True when every slot outside the tensor still holds kSentinel.
  bool outside_untouched() const {
    for (std::size_t i = 0; i < buf_.size(); ++i) {
      if (!inside_[i] && !same_bits(buf_[i], kSentinel)) return false;
    }
    return true;
  }
  std::string describe() const {
    return "shape " + posenc::shape_str(view_.shape) + " strides " +
           posenc::shape_str(view_.stride);
  }

 private:
  static constexpr int64_t kGuard = 8;
  std::vector<T> buf_;
  std::vector<bool> inside_;
  posenc::View<T, R> view_;
};

}  // namespace posenc_test
