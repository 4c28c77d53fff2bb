// src/schemes/rope.cc - rotary position embedding applied (Su et al. 2021, "RoFormer";
// docs/rope.md): rotation, its inverse, re-rotation and M-RoPE; the frequencies are in
// rope_frequencies.cc.
//
// Precision: inverse frequencies are double; p * inv_freq, cos and sin are double; the rotated
// pair is formed in double from the float inputs and rounded once. The float32 output is thus
// the float64 result rounded once (up to an ulp), at any position. float32 views with accurate
// angles and a unit-stride head_dim go to the SIMD kernel (kernels/rope_hwy.cc: same math, cos/sin
// once per token shared by all heads, threads); the scalar `rotate` below serves the float64
// reference, float32 angles, M-RoPE, re-rotation and strided head_dims.
#include "posenc/rope.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <numbers>
#include <utility>
#include <vector>

#include "common.h"
#include "kernels/parallel.h"
#include "kernels/rope_kernels.h"
#include "posenc/half.h"

namespace posenc {

namespace {

void validate_freqs(const RopeFrequencies& freqs, const std::string& f) {
  if (freqs.inv_freq.empty()) detail::fail(f + ": freqs.inv_freq is empty");
  for (double v : freqs.inv_freq) {
    if (!std::isfinite(v)) detail::fail(f + ": freqs.inv_freq has a non-finite entry");
  }
  if (!std::isfinite(freqs.attention_factor) || freqs.attention_factor <= 0) {
    detail::fail(f + ": attention_factor must be finite and > 0");
  }
}

template <class T>
void validate_apply(const RopeFrequencies& freqs, const View<const T, 4>& x, const View<T, 4>& out,
                    const std::string& f) {
  detail::require_data(x, f + ": x");
  detail::require_data(out, f + ": out");
  validate_freqs(freqs, f);
  if (x.shape != out.shape) {
    detail::fail<ShapeError>(f + ": out shape " + shape_str(out.shape) + " differs from x shape " +
                             shape_str(x.shape));
  }
  if (freqs.rotary_dim() > x.shape[3]) {
    detail::fail<ShapeError>(f + ": rotary_dim (" + std::to_string(freqs.rotary_dim()) +
                             ") exceeds head_dim (" + std::to_string(x.shape[3]) +
                             ") of x [batch, seq, heads, head_dim]");
  }
}

// Rotates every (batch, token) of x into out. `fill(b, i, cs)` writes c_k at cs[2k] and s_k at
// cs[2k + 1] (attention factor and direction included) for every pair k. Accurate mode forms the
// pair in double and rounds once; float32 mode multiplies and subtracts in float32 as the
// frameworks do.
template <class T, class Fill>
void rotate(int64_t pairs, RopeStyle style, bool float32_math, const View<const T, 4>& x,
            const View<T, 4>& out, Fill&& fill) {
  const int64_t batch = x.shape[0], seq = x.shape[1], heads = x.shape[2], dim = x.shape[3];
  std::vector<double> cs(static_cast<std::size_t>(2 * pairs));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < seq; ++i) {
      fill(b, i, cs.data());
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x.data + b * x.stride[0] + i * x.stride[1] + h * x.stride[2];
        T* orow = out.data + b * out.stride[0] + i * out.stride[1] + h * out.stride[2];
        const int64_t xs = x.stride[3], ost = out.stride[3];
        for (int64_t k = 0; k < pairs; ++k) {
          const int64_t i0 = style == RopeStyle::kHalf ? k : 2 * k;
          const int64_t i1 = style == RopeStyle::kHalf ? k + pairs : 2 * k + 1;
          const double c = cs[static_cast<std::size_t>(2 * k)];
          const double s = cs[static_cast<std::size_t>(2 * k + 1)];
          if (float32_math) {
            const float x0 = static_cast<float>(xr[i0 * xs]), x1 = static_cast<float>(xr[i1 * xs]);
            const float cf = static_cast<float>(c), sf = static_cast<float>(s);
            const float a = x0 * cf, bb = x1 * sf, e = x1 * cf, g = x0 * sf;
            orow[i0 * ost] = static_cast<T>(a - bb);
            orow[i1 * ost] = static_cast<T>(e + g);
          } else {
            const double x0 = static_cast<double>(xr[i0 * xs]);
            const double x1 = static_cast<double>(xr[i1 * xs]);
            orow[i0 * ost] = static_cast<T>(x0 * c - x1 * s);
            orow[i1 * ost] = static_cast<T>(x1 * c + x0 * s);
          }
        }
        if (static_cast<const void*>(orow) != static_cast<const void*>(xr) || ost != xs) {
          for (int64_t d = 2 * pairs; d < dim; ++d) orow[d * ost] = xr[d * xs];
        }
      }
    }
  }
}

// cos/sin of p * inv_freq[k] for the pairs whose position component is `pos_of(k)`.
template <class PosOf>
void fill_angles(const RopeFrequencies& freqs, Direction dir, PosOf&& pos_of, double* cs) {
  const double af = freqs.attention_factor;
  const double sign = dir == Direction::kForward ? 1.0 : -1.0;
  const std::size_t pairs = freqs.inv_freq.size();
  for (std::size_t k = 0; k < pairs; ++k) {
    const int64_t p = pos_of(k);
    if (freqs.angles == RopeAngles::kFloat32) {
      const float a = static_cast<float>(p) * static_cast<float>(freqs.inv_freq[k]);
      const float aff = static_cast<float>(af);
      cs[2 * k] = static_cast<double>(std::cos(a) * aff);
      cs[2 * k + 1] = static_cast<double>(static_cast<float>(sign) * (std::sin(a) * aff));
    } else {
      const double a = static_cast<double>(p) * freqs.inv_freq[k];
      cs[2 * k] = std::cos(a) * af;
      cs[2 * k + 1] = sign * std::sin(a) * af;
    }
  }
}

void require_threads(int num_threads, const std::string& fn) {
  if (num_threads < 0) {
    detail::fail(fn + ": num_threads must be >= 0 (0 = all; got " + std::to_string(num_threads) +
                 ")");
  }
}

// The SIMD kernel (src/kernels/rope_hwy.cc) takes accurate angles on views whose head_dim is
// unit-stride; everything else (float32 angles, strided head_dim) runs the scalar `rotate`.
bool kernel_applies(const RopeFrequencies& freqs, const View<const float, 4>& x,
                    const View<float, 4>& out) {
  return freqs.angles == RopeAngles::kAccurate && x.last_dim_contiguous() &&
         out.last_dim_contiguous() && x.numel() > 0;
}

kernels::RopeTensor kernel_tensor(const View<const float, 4>& x, const View<float, 4>& out) {
  kernels::RopeTensor t;
  t.x = x.data;
  t.out = out.data;
  t.heads = x.shape[2];
  for (std::size_t d = 0; d < 3; ++d) {
    t.x_stride[d] = x.stride[d];
    t.out_stride[d] = out.stride[d];
  }
  return t;
}

template <class T>
kernels::RopeParams kernel_params(const RopeFrequencies& freqs, RopeStyle style,
                                  const View<const T, 4>& x, const Positions& pos, Direction dir,
                                  int num_threads) {
  kernels::RopeParams p;
  p.batch = x.shape[0];
  p.seq = x.shape[1];
  p.head_dim = x.shape[3];
  p.inv_freq = freqs.inv_freq.data();
  p.pairs = static_cast<int64_t>(freqs.inv_freq.size());
  p.attention_factor = freqs.attention_factor;
  p.interleaved = style == RopeStyle::kInterleaved;
  p.inverse = dir == Direction::kInverse;
  p.positions = &pos;
  p.num_threads = kernels::resolve_threads(num_threads);
  return p;
}

template <class T>
void apply_checked(const RopeFrequencies& freqs, RopeStyle style, View<const T, 4> x,
                   View<T, 4> out, const Positions* positions, Direction dir, const char* fn,
                   int num_threads = 1) {
  validate_apply(freqs, x, out, fn);
  require_threads(num_threads, fn);
  const Positions pos = positions ? *positions : Positions::offset(0);
  pos.validate(x.shape[0], x.shape[1], std::string(fn) + ": positions");
  if constexpr (std::is_same_v<T, float>) {
    if (kernel_applies(freqs, x, out)) {
      kernels::RopeParams p = kernel_params(freqs, style, x, pos, dir, num_threads);
      p.tensors[0] = kernel_tensor(x, out);
      kernels::rope_f32(p);
      return;
    }
  }
  const bool f32 = freqs.angles == RopeAngles::kFloat32 && std::is_same_v<T, float>;
  rotate<T>(static_cast<int64_t>(freqs.inv_freq.size()), style, f32, x, out,
            [&](int64_t b, int64_t i, double* cs) {
              const int64_t p = pos.at(b, i);
              fill_angles(
                  freqs, dir, [p](std::size_t) { return p; }, cs);
            });
}

template <class T>
void apply_mrope_checked(const RopeFrequencies& freqs, RopeStyle style, const MRope& m,
                         View<const T, 4> x, View<T, 4> out,
                         const std::array<Positions, 3>& positions, Direction dir, const char* fn) {
  validate_apply(freqs, x, out, fn);
  const int64_t pairs = static_cast<int64_t>(freqs.inv_freq.size());
  validate(m, pairs);
  static const char* kNames[] = {"t", "h", "w"};
  for (int c = 0; c < 3; ++c) {
    positions[static_cast<std::size_t>(c)].validate(
        x.shape[0], x.shape[1], std::string(fn) + ": positions (" + kNames[c] + ")");
  }
  std::vector<int> comp(static_cast<std::size_t>(pairs));
  for (int64_t k = 0; k < pairs; ++k) comp[static_cast<std::size_t>(k)] = mrope_component(m, k);
  const bool f32 = freqs.angles == RopeAngles::kFloat32 && std::is_same_v<T, float>;
  rotate<T>(pairs, style, f32, x, out, [&](int64_t b, int64_t i, double* cs) {
    fill_angles(
        freqs, dir,
        [&](std::size_t k) { return positions[static_cast<std::size_t>(comp[k])].at(b, i); }, cs);
  });
}

}  // namespace

void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<const float, 4> x,
                View<float, 4> out, const Positions* positions, Direction direction,
                int num_threads) {
  apply_checked<float>(freqs, style, x, out, positions, direction, "apply_rope", num_threads);
}

void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<float, 4> x,
                const Positions* positions, Direction direction, int num_threads) {
  apply_checked<float>(freqs, style, x, x, positions, direction, "apply_rope", num_threads);
}

void apply_rope_qk(const RopeFrequencies& freqs, RopeStyle style, View<float, 4> q,
                   View<float, 4> k, const Positions* positions, Direction direction,
                   int num_threads) {
  const std::string fn = "apply_rope_qk";
  validate_apply<float>(freqs, q, q, fn + ": q");
  validate_apply<float>(freqs, k, k, fn + ": k");
  require_threads(num_threads, fn);
  if (q.shape[0] != k.shape[0] || q.shape[1] != k.shape[1] || q.shape[3] != k.shape[3]) {
    detail::fail<ShapeError>(fn + ": q " + shape_str(q.shape) + " and k " + shape_str(k.shape) +
                             " [batch, seq, heads, head_dim] need the same batch, seq and "
                             "head_dim");
  }
  const Positions pos = positions ? *positions : Positions::offset(0);
  pos.validate(q.shape[0], q.shape[1], fn + ": positions");
  if (kernel_applies(freqs, q, q) && kernel_applies(freqs, k, k)) {
    // One pass: each token's cos/sin rotate the heads of q, then those of k.
    kernels::RopeParams p = kernel_params<float>(freqs, style, q, pos, direction, num_threads);
    p.tensors[0] = kernel_tensor(q, q);
    p.tensors[1] = kernel_tensor(k, k);
    p.num_tensors = 2;
    kernels::rope_f32(p);
    return;
  }
  apply_checked<float>(freqs, style, q, q, &pos, direction, "apply_rope_qk: q", num_threads);
  apply_checked<float>(freqs, style, k, k, &pos, direction, "apply_rope_qk: k", num_threads);
}

namespace {

// rerotate_rope's checks on k (any element type); returns the positions.
template <class T>
Positions validate_rerotate(const RopeFrequencies& from, const RopeFrequencies& to,
                            const View<T, 4>& k, const Positions* positions) {
  const std::string fn = "rerotate_rope";
  validate_apply<T>(to, k, k, fn);
  validate_freqs(from, fn + ": from");
  if (from.inv_freq.size() != to.inv_freq.size()) {
    detail::fail<ShapeError>(fn + ": from and to have different rotary dims (" +
                             std::to_string(from.rotary_dim()) + " vs " +
                             std::to_string(to.rotary_dim()) + ")");
  }
  if (from.angles != RopeAngles::kAccurate || to.angles != RopeAngles::kAccurate) {
    detail::fail(fn + ": needs accurate angles");
  }
  const Positions pos = positions ? *positions : Positions::offset(0);
  pos.validate(k.shape[0], k.shape[1], fn + ": positions");
  return pos;
}

// cos/sin of the re-rotation at position p (cs[2j], cs[2j + 1]).
void rerotate_angles(const RopeFrequencies& from, const RopeFrequencies& to, int64_t pos,
                     double* cs) {
  const double scale = to.attention_factor / from.attention_factor;
  const std::size_t pairs = to.inv_freq.size();
  const double p = static_cast<double>(pos);
  for (std::size_t j = 0; j < pairs; ++j) {
    const double a = p * to.inv_freq[j] - p * from.inv_freq[j];
    cs[2 * j] = std::cos(a) * scale;
    cs[2 * j + 1] = std::sin(a) * scale;
  }
}

// True when no two elements of v share an address.
template <class T>
bool distinct_elements(const View<T, 4>& v) {
  std::array<std::pair<int64_t, int64_t>, 4> dims{};  // (|stride|, shape)
  for (std::size_t d = 0; d < 4; ++d) dims[d] = {std::abs(v.stride[d]), v.shape[d]};
  std::sort(dims.begin(), dims.end());
  int64_t extent = 1;
  for (const auto& [stride, n] : dims) {
    if (n <= 1) continue;
    if (stride < extent) return false;
    extent += stride * (n - 1);
  }
  return true;
}

// The bytes [lo, hi) that v's elements span.
template <class T>
std::pair<uintptr_t, uintptr_t> byte_range(const View<T, 4>& v) {
  int64_t lo = 0, hi = 0;
  for (std::size_t d = 0; d < 4; ++d) {
    const int64_t span = v.stride[d] * (v.shape[d] - 1);
    (span < 0 ? lo : hi) += span;
  }
  const auto base = reinterpret_cast<uintptr_t>(v.data);
  return {base + static_cast<uintptr_t>(lo * static_cast<int64_t>(sizeof(T))),
          base + static_cast<uintptr_t>((hi + 1) * static_cast<int64_t>(sizeof(T)))};
}

// The kernel writes rows of out as it reads the same rows of x, in parallel: out's elements must
// be distinct and x either the same view (in place) or elsewhere.
template <class T>
bool rows_independent(const View<const T, 4>& x, const View<T, 4>& out) {
  if (!distinct_elements(out)) return false;
  if (static_cast<const void*>(x.data) == static_cast<const void*>(out.data) &&
      x.stride == out.stride) {
    return true;
  }
  const auto [xlo, xhi] = byte_range(x);
  const auto [olo, ohi] = byte_range(out);
  return xhi <= olo || ohi <= xlo;
}

template <class T>
constexpr DType half_dtype() {
  return std::is_same_v<T, bf16> ? DType::kBF16 : DType::kF16;
}

}  // namespace

void rerotate_rope(const RopeFrequencies& from, const RopeFrequencies& to, RopeStyle style,
                   View<float, 4> k, const Positions* positions) {
  const Positions pos = validate_rerotate(from, to, k, positions);
  rotate<float>(
      static_cast<int64_t>(to.inv_freq.size()), style, false, k, k,
      [&](int64_t b, int64_t i, double* cs) { rerotate_angles(from, to, pos.at(b, i), cs); });
}

namespace detail {

template <class T>
bool apply_rope_half(const RopeFrequencies& freqs, RopeStyle style, View<const T, 4> x,
                     View<T, 4> out, const Positions* positions, Direction direction,
                     int num_threads) {
  const char* fn = "apply_rope";
  validate_apply(freqs, x, out, fn);
  require_threads(num_threads, fn);
  const Positions pos = positions ? *positions : Positions::offset(0);
  pos.validate(x.shape[0], x.shape[1], std::string(fn) + ": positions");
  if (freqs.angles != RopeAngles::kAccurate || !x.last_dim_contiguous() ||
      !out.last_dim_contiguous() || x.numel() == 0 || !rows_independent(x, out)) {
    return false;
  }
  kernels::RopeParams p = kernel_params<T>(freqs, style, x, pos, direction, num_threads);
  kernels::RopeTensor& t = p.tensors[0];
  t.x_half = reinterpret_cast<const uint16_t*>(x.data);
  t.out_half = reinterpret_cast<uint16_t*>(out.data);
  t.dtype = half_dtype<T>();
  t.heads = x.shape[2];
  for (std::size_t d = 0; d < 3; ++d) {
    t.x_stride[d] = x.stride[d];
    t.out_stride[d] = out.stride[d];
  }
  kernels::rope_f32(p);
  return true;
}

template <class T>
bool rerotate_rope_half(const RopeFrequencies& from, const RopeFrequencies& to, RopeStyle style,
                        View<T, 4> k, const Positions* positions) {
  const Positions pos = validate_rerotate(from, to, k, positions);
  if (!k.last_dim_contiguous() || k.numel() == 0 || !distinct_elements(k)) return false;
  // Token by token: its rows widened into `row`, re-rotated there by rerotate_rope's float32
  // code, rounded back once.
  const int64_t heads = k.shape[2], dim = k.shape[3];
  const DType dt = half_dtype<T>();
  std::vector<float> row(static_cast<std::size_t>(heads * dim));
  const auto rv = View<float, 4>::contiguous(row.data(), {1, 1, heads, dim});
  for (int64_t b = 0; b < k.shape[0]; ++b) {
    for (int64_t i = 0; i < k.shape[1]; ++i) {
      T* base = k.data + b * k.stride[0] + i * k.stride[1];
      for (int64_t h = 0; h < heads; ++h) {
        kernels::half_to_float(dt, reinterpret_cast<const uint16_t*>(base + h * k.stride[2]),
                               row.data() + h * dim, dim);
      }
      const int64_t p = pos.at(b, i);
      rotate<float>(static_cast<int64_t>(to.inv_freq.size()), style, false, rv, rv,
                    [&](int64_t, int64_t, double* cs) { rerotate_angles(from, to, p, cs); });
      for (int64_t h = 0; h < heads; ++h) {
        kernels::float_to_half(dt, row.data() + h * dim,
                               reinterpret_cast<uint16_t*>(base + h * k.stride[2]), dim);
      }
    }
  }
  return true;
}

template bool apply_rope_half(const RopeFrequencies&, RopeStyle, View<const bf16, 4>, View<bf16, 4>,
                              const Positions*, Direction, int);
template bool apply_rope_half(const RopeFrequencies&, RopeStyle, View<const f16, 4>, View<f16, 4>,
                              const Positions*, Direction, int);
template bool rerotate_rope_half(const RopeFrequencies&, const RopeFrequencies&, RopeStyle,
                                 View<bf16, 4>, const Positions*);
template bool rerotate_rope_half(const RopeFrequencies&, const RopeFrequencies&, RopeStyle,
                                 View<f16, 4>, const Positions*);

}  // namespace detail

int mrope_component(const MRope& m, int64_t pair) {
  const auto& s = m.sections;
  if (m.layout == MRopeLayout::kSectioned) {
    if (pair < s[0]) return 0;
    if (pair < s[0] + s[1]) return 1;
    return 2;
  }
  if (pair % 3 == 1 && pair < 3 * s[1]) return 1;
  if (pair % 3 == 2 && pair < 3 * s[2]) return 2;
  return 0;
}

void validate(const MRope& m, int64_t pairs) {
  const auto& s = m.sections;
  if (s[0] < 0 || s[1] < 0 || s[2] < 0 || s[0] + s[1] + s[2] != pairs) {
    detail::fail("mrope: sections [" + std::to_string(s[0]) + ", " + std::to_string(s[1]) + ", " +
                 std::to_string(s[2]) +
                 "] must be >= 0 and add up to rotary_dim / 2 = " + std::to_string(pairs));
  }
}

void apply_mrope(const RopeFrequencies& freqs, RopeStyle style, const MRope& mrope,
                 View<const float, 4> x, View<float, 4> out,
                 const std::array<Positions, 3>& positions, Direction direction) {
  apply_mrope_checked<float>(freqs, style, mrope, x, out, positions, direction, "apply_mrope");
}

namespace ref {
void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<const double, 4> x,
                View<double, 4> out, const Positions* positions, Direction direction) {
  apply_checked<double>(freqs, style, x, out, positions, direction, "ref::apply_rope");
}

void apply_mrope(const RopeFrequencies& freqs, RopeStyle style, const MRope& mrope,
                 View<const double, 4> x, View<double, 4> out,
                 const std::array<Positions, 3>& positions, Direction direction) {
  apply_mrope_checked<double>(freqs, style, mrope, x, out, positions, direction,
                              "ref::apply_mrope");
}
}  // namespace ref

}  // namespace posenc
