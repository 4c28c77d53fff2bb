// src/half_precision_api.cc - bf16 / f16 entry points of attention, apply_rope and rerotate_rope:
// the half-precision views widened exactly into float32 buffers, the float32 function, and one
// rounding of the result to the output's type. apply_rope / rerotate_rope take the native
// row-by-row kernel (src/rope.cc, src/kernels/rope_hwy.cc) when it applies, with the same bits.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "attention/half.h"
#include "attention/model_inputs.h"
#include "common.h"
#include "posenc/attention.h"
#include "posenc/half.h"
#include "posenc/rope.h"

namespace posenc {

namespace detail {
// src/rope.cc: the checks of apply_rope / rerotate_rope on the half views, then the native
// kernel when it applies (accurate angles, unit-stride head_dim, rows that do not overlap);
// false when the caller takes the widening path instead.
template <class T>
bool apply_rope_half(const RopeFrequencies& freqs, RopeStyle style, View<const T, 4> x,
                     View<T, 4> out, const Positions* positions, Direction direction,
                     int num_threads);
template <class T>
bool rerotate_rope_half(const RopeFrequencies& from, const RopeFrequencies& to, RopeStyle style,
                        View<T, 4> k, const Positions* positions);
}  // namespace detail

namespace {

// A contiguous float32 copy of x (any strides, stride 0 allowed).
// True when v is row-major contiguous (a flat loop covers it).
template <class V>
bool dense(const V& v) {
  int64_t s = 1;
  for (std::size_t d = 4; d-- > 0;) {
    if (v.shape[d] != 1 && v.stride[d] != s) return false;
    s *= v.shape[d];
  }
  return true;
}

template <class T>
std::vector<float> widen(View<const T, 4> x, const std::string& name) {
  detail::require_data(x, name);
  std::vector<float> out(static_cast<std::size_t>(x.numel()));
  if (dense(x)) {
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = to_float(x.data[i]);
    return out;
  }
  std::size_t n = 0;
  for (int64_t a = 0; a < x.shape[0]; ++a)
    for (int64_t b = 0; b < x.shape[1]; ++b)
      for (int64_t c = 0; c < x.shape[2]; ++c)
        for (int64_t d = 0; d < x.shape[3]; ++d) out[n++] = to_float(x(a, b, c, d));
  return out;
}

template <class T>
View<const float, 4> view_of(const std::vector<float>& data, const View<const T, 4>& like) {
  return View<const float, 4>::contiguous(data.data(), like.shape);
}

// out = round(src), src contiguous with out's shape.
template <class T>
void narrow(const std::vector<float>& src, View<T, 4> out) {
  if (dense(out)) {
    for (std::size_t i = 0; i < src.size(); ++i) out.data[i] = from_float<T>(src[i]);
    return;
  }
  std::size_t n = 0;
  for (int64_t a = 0; a < out.shape[0]; ++a)
    for (int64_t b = 0; b < out.shape[1]; ++b)
      for (int64_t c = 0; c < out.shape[2]; ++c)
        for (int64_t d = 0; d < out.shape[3]; ++d) out(a, b, c, d) = from_float<T>(src[n++]);
}

template <class T>
DType storage_of() {
  return std::is_same_v<T, bf16>  ? DType::kBF16
         : std::is_same_v<T, f16> ? DType::kF16
                                  : DType::kF32;
}

// Shape-and-stride views of the storage (see detail::StorageViews).
template <class T>
View<const float, 4> as_float_view(const View<const T, 4>& x) {
  return View<const float, 4>{reinterpret_cast<const float*>(x.data), x.shape, x.stride};
}

template <class Q, class KV, class O>
detail::StorageViews storage_views(const View<const Q, 4>& q, const View<const KV, 4>& k,
                                   const View<const KV, 4>& v, const View<O, 4>& out) {
  detail::StorageViews s;
  s.q = as_float_view(q);
  s.k = as_float_view(k);
  s.v = as_float_view(v);
  s.out = View<float, 4>{reinterpret_cast<float*>(out.data), out.shape, out.stride};
  s.q_type = storage_of<Q>();
  s.kv_type = storage_of<KV>();
  s.out_type = storage_of<O>();
  return s;
}

template <class Q, class KV, class O>
void attention_half(View<const Q, 4> q, View<const KV, 4> k, View<const KV, 4> v,
                    const PositionScheme& scheme, const AttentionOptions& options, View<O, 4> out,
                    const Positions* qp, const Positions* kp) {
  // The query temperature (q scaled into float32) and narrower values, then this function.
  if (detail::forward_model_inputs(q, k, v, scheme, options, out, qp,
                                   [&](auto qv, auto vv, const AttentionOptions& o, auto ov) {
                                     attention_half(qv, k, vv, scheme, o, ov, qp, kp);
                                   })) {
    return;
  }
  detail::require_data(out, "attention: out");
  // The fused kernel on the storage itself; outside its domain (or to report a non-finite
  // result), the inputs widened into float32 buffers and the float32 function.
  if (detail::attention_fused_storage(storage_views(q, k, v, out), scheme, options, qp, kp)) {
    return;
  }
  const std::vector<float> kf = widen(k, "attention: k"), vf = widen(v, "attention: v");
  if constexpr (std::is_same_v<Q, float> && std::is_same_v<O, float>) {
    attention(q, view_of(kf, k), view_of(vf, v), scheme, options, out, qp, kp);
  } else {
    const std::vector<float> qf = widen(q, "attention: q");
    std::vector<float> of(static_cast<std::size_t>(out.numel()));
    attention(view_of(qf, q), view_of(kf, k), view_of(vf, v), scheme, options,
              View<float, 4>::contiguous(of.data(), out.shape), qp, kp);
    narrow(of, out);
  }
}

template <class T>
void rope_half(const RopeFrequencies& freqs, RopeStyle style, View<const T, 4> x, View<T, 4> out,
               const Positions* positions, Direction direction, int num_threads) {
  detail::require_data(out, "apply_rope: out");
  detail::require_data(x, "apply_rope: x");
  if (detail::apply_rope_half(freqs, style, x, out, positions, direction, num_threads)) return;
  std::vector<float> xf = widen(x, "apply_rope: x");
  std::vector<float> of(xf.size());
  apply_rope(freqs, style, View<const float, 4>::contiguous(xf.data(), x.shape),
             View<float, 4>::contiguous(of.data(), out.shape), positions, direction, num_threads);
  narrow(of, out);
}

template <class T>
void rerotate_half(const RopeFrequencies& from, const RopeFrequencies& to, RopeStyle style,
                   View<T, 4> k, const Positions* positions) {
  detail::require_data(k, "rerotate_rope: k");
  if (detail::rerotate_rope_half(from, to, style, k, positions)) return;
  std::vector<float> kf = widen(View<const T, 4>(k), "rerotate_rope: k");
  rerotate_rope(from, to, style, View<float, 4>::contiguous(kf.data(), k.shape), positions);
  narrow(kf, k);
}

}  // namespace

// The four public half-precision attention overloads (posenc/attention.h): q, kv and out types.
#define POSENC_HALF_ATTENTION(Q, KV, O)                                                         \
  void attention(View<const Q, 4> q, View<const KV, 4> k, View<const KV, 4> v,                  \
                 const PositionScheme& scheme, const AttentionOptions& options, View<O, 4> out, \
                 const Positions* query_positions, const Positions* key_positions) {            \
    attention_half(q, k, v, scheme, options, out, query_positions, key_positions);              \
  }
POSENC_HALF_ATTENTION(bf16, bf16, bf16)
POSENC_HALF_ATTENTION(f16, f16, f16)
POSENC_HALF_ATTENTION(float, bf16, float)
POSENC_HALF_ATTENTION(float, f16, float)
#undef POSENC_HALF_ATTENTION

void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<const bf16, 4> x,
                View<bf16, 4> out, const Positions* positions, Direction direction,
                int num_threads) {
  rope_half(freqs, style, x, out, positions, direction, num_threads);
}

void apply_rope(const RopeFrequencies& freqs, RopeStyle style, View<const f16, 4> x,
                View<f16, 4> out, const Positions* positions, Direction direction,
                int num_threads) {
  rope_half(freqs, style, x, out, positions, direction, num_threads);
}

void rerotate_rope(const RopeFrequencies& from, const RopeFrequencies& to, RopeStyle style,
                   View<bf16, 4> k, const Positions* positions) {
  rerotate_half(from, to, style, k, positions);
}

void rerotate_rope(const RopeFrequencies& from, const RopeFrequencies& to, RopeStyle style,
                   View<f16, 4> k, const Positions* positions) {
  rerotate_half(from, to, style, k, positions);
}

}  // namespace posenc
