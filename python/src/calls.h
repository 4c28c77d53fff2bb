// python/src/calls.h - the argument handling of attention and apply_rope, shared by their float
// bindings (bind_attention.cc, bind_encodings.cc) and the half-precision ones (bind_half.cc):
// one parser, so every keyword means the same in posenc.attention and posenc.attention_half.
#pragma once

#include <array>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "py_common.h"

namespace posenc::py {

// ---- attention -------------------------------------------------------------------------------

// What parse() converts q, k and v to.
enum class Inputs {
  kAuto,     // float32, or float64 when q is float64 (posenc.attention)
  kFloat64,  // float64 (posenc.ref)
  kBf16,     // 2-byte arrays holding bf16 bits; q may be float32 instead (the mixed path)
  kF16,      // the same with f16 bits
};

// Everything one call computes from, parsed and converted.
struct Call {
  bool f64 = false;
  pb::array q, k, v;
  SchemeSettings settings;
  ParamMap params;
  std::vector<pb::array> keep;  // parameter arrays the views point into
  std::optional<ModelConfig> model;
  AttentionOptions opt;
  std::optional<Positions> qp, kp;
  bool return_lse = false;
  pb::object out = pb::none(), lse = pb::none();
  BuiltScheme built;
  std::array<int64_t, 4> qshape{}, kshape{}, vshape{};
  // Half precision (Inputs::kBf16 / kF16): k and v hold the half bits; q holds them too when
  // q_half (the result is then half too), else q is float32 (the mixed path, float32 out).
  bool q_half = false;
  // Packed variable-length sequences (cu_seqlens_q / cu_seqlens_k): q, k, v arrive as
  // [total, heads, D] and are held as [1, total, heads, D]; outputs go back to rank 3.
  std::optional<PackedSequences> packed;
  // Block-mask arrays (int32 documents, int64 prefix, uint8 dense) the option views point into.
  std::vector<pb::array> mask_arrays;

  // An output of the 4-D call in the caller's layout: out [1, total_q, H, D] -> [total_q, H, D],
  // lse [1, H, total_q] -> [H, total_q], gradients likewise (unchanged without packing).
  pb::object unpack(const pb::object& x) const {
    if (!packed || x.is_none()) return x;
    pb::array a = pb::reinterpret_borrow<pb::array>(x);
    std::vector<pb::ssize_t> shape(a.shape() + 1, a.shape() + a.ndim());
    return a.attr("reshape")(pb::cast(shape));
  }

  // The output's shape: q's with v's head dim (narrower under multi-head latent attention).
  std::array<int64_t, 4> oshape() const { return {qshape[0], qshape[1], qshape[2], vshape[3]}; }

  const Positions* pq() const { return qp ? &*qp : nullptr; }
  const Positions* pk() const { return kp ? &*kp : nullptr; }
};

template <class T>
View<const T, 4> view4(const pb::array& a, const char* what, const char* layout) {
  return view_of<const T, 4>(a, what, layout);
}

// Parses (q, k, v, scheme, **kwargs) of the function `fn` and builds its scheme. `extra` lists
// the function's own keywords (out, lse, return_lse), left in c for the caller.
// `names`: what errors call q, k and v (attention_paged: q, k_pages, v_pages).
using QkvNames = std::array<const char*, 3>;
Call parse(const std::string& fn, const pb::handle& q, const pb::handle& k, const pb::handle& v,
           const pb::object& scheme, const pb::kwargs& kw, Inputs inputs,
           const std::set<std::string>& extra, const QkvNames& names = {"q", "k", "v"});

// bind_half.cc: q, k, v of a half-precision call (c.q, c.k, c.v, c.q_half): 2-byte
// arrays viewed in place when their strides allow (else one contiguous copy), q float32 for the
// mixed path; TypeError naming the argument and the dtype found otherwise.
void half_inputs(Call& c, Inputs inputs, const pb::handle& q, const pb::handle& k,
                 const pb::handle& v, const QkvNames& names);

// ---- RoPE ------------------------------------------------------------------------------------

// apply_rope's settings resolved for an input x (3 or 4 dimensions, else ShapeError): the
// frequencies (freqs, else config's or head_dim's at seq_len, default max position + 1), the
// style (default config's, else half), the positions and the direction.
struct RopeSetup {
  RopeFrequencies freqs;
  RopeStyle style = RopeStyle::kHalf;
  std::optional<Positions> positions;
  Direction direction = Direction::kForward;

  const Positions* pos() const { return positions ? &*positions : nullptr; }
};
// apply_rope's scalar keywords, typed by args.h (the bindings take them as Python objects).
struct RopeScalars {
  std::optional<bool> inverse;
  bool inplace = false;
  int num_threads = 0;
  int64_t rotary_dim = 0;
  double base = 1e4;
  std::optional<int64_t> seq_len;
  std::string angles;
};
RopeScalars rope_scalars(const pb::object& inverse, const pb::object& inplace,
                         const pb::object& num_threads, const pb::object& rotary_dim,
                         const pb::object& base, const pb::object& seq_len,
                         const pb::object& angles);

RopeSetup rope_setup(const pb::array& x, const pb::object& freqs, const pb::object& style,
                     const pb::object& positions, bool inverse, int64_t rotary_dim, double base,
                     const pb::object& scaling, std::optional<int64_t> seq_len,
                     const std::string& angles, const pb::object& config);

// x as [batch, seq, heads, head_dim] (a 3-D [seq, heads, head_dim] gets a batch of 1).
template <class T>
View<T, 4> as4(const pb::array& a, const char* what) {
  if (a.ndim() == 3) {
    auto v = view_of<T, 3>(a, what, "");
    return View<T, 4>{v.data,
                      {1, v.shape[0], v.shape[1], v.shape[2]},
                      {0, v.stride[0], v.stride[1], v.stride[2]}};
  }
  return view_of<T, 4>(a, what, "[batch, seq, heads, head_dim] or [seq, heads, head_dim]");
}

// apply_rope's keywords after (x, freqs, *), with their defaults: the signature of apply_rope,
// rope_inverse, ref.apply_rope and (with dtype first) _apply_rope_half.
#define POSENC_ROPE_KEYWORDS                                                                \
  pybind11::arg("style") = pybind11::none(), pybind11::arg("positions") = pybind11::none(), \
  pybind11::arg("inverse") = pybind11::none(), pybind11::arg("inplace") = false,            \
  pybind11::arg("out") = pybind11::none(), pybind11::arg("num_threads") = 0,                \
  pybind11::arg("rotary_dim") = 0, pybind11::arg("base") = 1e4,                             \
  pybind11::arg("scaling") = pybind11::none(), pybind11::arg("seq_len") = pybind11::none(), \
  pybind11::arg("angles") = "accurate", pybind11::arg("config") = pybind11::none()

// Llama 4's attention-temperature tuning as {"floor_scale", "attn_scale"}, or None.
pb::object temperature_dict(const std::optional<AttentionTemperature>& t);

// Registration of RoPE's functions (bind_rope.cc; bind_encodings calls it).
void bind_rope(pb::module_& m, pb::module_& ref);

// Registration of the half-precision bindings (bind_half.cc).
void bind_half(pb::module_& m);

// Registration of the paged KV-cache bindings (bind_paged.cc).
void bind_paged(pb::module_& m);

}  // namespace posenc::py
