// src/schemes/sinusoidal.cc - sinusoidal absolute encodings (Vaswani et al. 2017, "Attention Is All
// You Need", §3.5; docs/sinusoidal.md).
//
// Precision: p * w_i is formed in double (relative error 2^-53: about 1e-8 rad at p = 2^28) and
// sin/cos are evaluated in double, then rounded once to float32.
#include "posenc/sinusoidal.h"

#include <cmath>

#include "common.h"

namespace posenc {
namespace {

// Number of sin/cos pairs actually computed (odd zero-padded dims leave the last column 0).
int64_t half_dim(const SinusoidalConfig& cfg) { return cfg.dim / 2; }

double angle_value(const SinusoidalConfig& cfg, const std::vector<double>& w, int64_t p,
                   int64_t k) {
  const int64_t half = half_dim(cfg);
  if (k >= 2 * half) return 0.0;  // zero-padded odd column
  const double pd = static_cast<double>(p);
  if (cfg.layout == SinLayout::kInterleaved) {
    const double a = pd * w[static_cast<std::size_t>(k / 2)];
    return (k % 2 == 0) ? std::sin(a) : std::cos(a);
  }
  if (k < half) return std::sin(pd * w[static_cast<std::size_t>(k)]);
  return std::cos(pd * w[static_cast<std::size_t>(k - half)]);
}

template <class T>
void write_row(const SinusoidalConfig& cfg, const std::vector<double>& w, int64_t p, T* row,
               int64_t stride) {
  const int64_t half = half_dim(cfg);
  const double pd = static_cast<double>(p);
  for (int64_t i = 0; i < half; ++i) {
    const double a = pd * w[static_cast<std::size_t>(i)];
    const double s = std::sin(a), c = std::cos(a);
    const int64_t ks = cfg.layout == SinLayout::kInterleaved ? 2 * i : i;
    const int64_t kc = cfg.layout == SinLayout::kInterleaved ? 2 * i + 1 : half + i;
    row[ks * stride] = static_cast<T>(s);
    row[kc * stride] = static_cast<T>(c);
  }
  if (cfg.dim % 2 == 1) row[(cfg.dim - 1) * stride] = T(0);
}

}  // namespace

void validate(const SinusoidalConfig& cfg) {
  detail::require_positive(cfg.dim, "sinusoidal: dim");
  if (cfg.dim % 2 == 1 && cfg.odd_dim == SinOddDim::kError) {
    detail::fail("sinusoidal: dim must be even (got " + std::to_string(cfg.dim) +
                 "); odd_dim = kZeroPad (CLI: --odd-dim zero-pad) appends fairseq's zero column");
  }
  if (!std::isfinite(cfg.base) || cfg.base <= 1.0) {
    detail::fail("sinusoidal: base must be finite and > 1 (got " + detail::num(cfg.base) + ")");
  }
  if (cfg.origin < 0 || cfg.origin > kMaxPosition) {
    detail::fail("sinusoidal: origin must be in [0, 2^48] (got " + std::to_string(cfg.origin) +
                 ")");
  }
}

std::vector<double> sinusoidal_frequencies(const SinusoidalConfig& cfg) {
  validate(cfg);
  const int64_t half = half_dim(cfg);
  std::vector<double> w(static_cast<std::size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    double e;
    if (cfg.denominator == SinDenominator::kDim) {
      // Paper: 2i / d. With an odd zero-padded d, fairseq uses the same formula on d - 1.
      e = 2.0 * static_cast<double>(i) / static_cast<double>(2 * half);
    } else {
      const int64_t den = half - 1 > 1 ? half - 1 : 1;
      e = static_cast<double>(i) / static_cast<double>(den);
    }
    w[static_cast<std::size_t>(i)] = std::pow(cfg.base, -e);
  }
  return w;
}

std::vector<float> sinusoidal_table(const SinusoidalConfig& cfg, int64_t length) {
  validate(cfg);
  if (length < 0)
    detail::fail("sinusoidal: length must be >= 0 (got " + std::to_string(length) + ")");
  if (length > 0 && cfg.origin + length - 1 > kMaxPosition) {
    detail::fail("sinusoidal: positions up to origin + length - 1 exceed 2^48");
  }
  const auto w = sinusoidal_frequencies(cfg);
  std::vector<float> out(static_cast<std::size_t>(
      checked_elements("sinusoidal: the table", {{"length", length}, {"dim", cfg.dim}}, 4)));
  for (int64_t r = 0; r < length; ++r) {
    write_row(cfg, w, cfg.origin + r, out.data() + r * cfg.dim, 1);
  }
  return out;
}

void sinusoidal_encode(const SinusoidalConfig& cfg, const std::vector<int64_t>& positions,
                       View<float, 2> out) {
  validate(cfg);
  detail::require_data(out, "sinusoidal_encode: out");
  if (out.shape[0] != static_cast<int64_t>(positions.size()) || out.shape[1] != cfg.dim) {
    detail::fail<ShapeError>("sinusoidal_encode: out has shape " + shape_str(out.shape) +
                             ", expected [" + std::to_string(positions.size()) + ", " +
                             std::to_string(cfg.dim) + "]");
  }
  for (std::size_t r = 0; r < positions.size(); ++r) {
    if (positions[r] < 0 || positions[r] > kMaxPosition) {
      detail::fail("sinusoidal_encode: position " + std::to_string(positions[r]) +
                   " is outside [0, 2^48]");
    }
  }
  const auto w = sinusoidal_frequencies(cfg);
  for (std::size_t r = 0; r < positions.size(); ++r) {
    write_row(cfg, w, positions[r], out.data + static_cast<int64_t>(r) * out.stride[0],
              out.stride[1]);
  }
}

void add_sinusoidal(const SinusoidalConfig& cfg, View<float, 3> x, const Positions* positions) {
  validate(cfg);
  detail::require_data(x, "add_sinusoidal: x");
  if (x.shape[2] != cfg.dim) {
    detail::fail<ShapeError>("add_sinusoidal: x [batch, seq, dim] has dim " +
                             std::to_string(x.shape[2]) + " but the encoding has dim " +
                             std::to_string(cfg.dim));
  }
  const Positions pos = positions ? *positions : Positions::offset(cfg.origin);
  pos.validate(x.shape[0], x.shape[1], "add_sinusoidal: positions");
  const auto w = sinusoidal_frequencies(cfg);
  std::vector<double> row(static_cast<std::size_t>(cfg.dim));
  for (int64_t b = 0; b < x.shape[0]; ++b) {
    for (int64_t i = 0; i < x.shape[1]; ++i) {
      write_row(cfg, w, pos.at(b, i), row.data(), 1);
      float* xr = x.data + b * x.stride[0] + i * x.stride[1];
      // The sum is formed in double and rounded once: x + PE exactly rounded.
      for (int64_t k = 0; k < cfg.dim; ++k) {
        xr[k * x.stride[2]] = static_cast<float>(static_cast<double>(xr[k * x.stride[2]]) +
                                                 row[static_cast<std::size_t>(k)]);
      }
    }
  }
}

namespace ref {

double sinusoidal_value(const SinusoidalConfig& cfg, int64_t p, int64_t k) {
  const auto w = sinusoidal_frequencies(cfg);
  if (k < 0 || k >= cfg.dim) detail::fail("sinusoidal_value: k out of range");
  return angle_value(cfg, w, p, k);
}

std::vector<double> sinusoidal_table(const SinusoidalConfig& cfg, int64_t length) {
  const auto w = sinusoidal_frequencies(cfg);
  if (length < 0) detail::fail("sinusoidal: length must be >= 0");
  std::vector<double> out(static_cast<std::size_t>(
      checked_elements("sinusoidal: the table", {{"length", length}, {"dim", cfg.dim}}, 8)));
  for (int64_t r = 0; r < length; ++r) {
    for (int64_t k = 0; k < cfg.dim; ++k) {
      out[static_cast<std::size_t>(r * cfg.dim + k)] = angle_value(cfg, w, cfg.origin + r, k);
    }
  }
  return out;
}

}  // namespace ref
}  // namespace posenc
