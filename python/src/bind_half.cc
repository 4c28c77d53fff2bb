// python/src/bind_half.cc - half precision (bf16, f16) for NumPy: _attention_half and
// _apply_rope_half over the library's native half entry points (posenc/half.h). NumPy has no
// bfloat16, so half arrays travel as their 2-byte bits: any 2-byte integer or float dtype
// (uint16, int16, float16), read as bf16 or f16 by the dtype= argument; results are new uint16
// arrays of bits (posenc/__init__.py views them as float16 for dtype='float16').
//
// The keywords are parsed by the float bindings' parsers (calls.h), so they mean exactly what
// they mean for posenc.attention / posenc.apply_rope. The library computes in float32 on the
// exactly widened inputs and rounds the result once, so a half result equals the float32
// function of the widened inputs, rounded (tests/python/test_half.py checks it bit for bit).
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "args.h"
#include "calls.h"

namespace posenc::py {

namespace {

using pb::arg;

const char* dtype_name(Inputs inputs) { return inputs == Inputs::kBf16 ? "bfloat16" : "float16"; }

Inputs parse_half_dtype(const std::string& s) {
  if (s == "bfloat16") return Inputs::kBf16;
  if (s == "float16") return Inputs::kF16;
  throw ValueError("dtype: '" + s + "' ('bfloat16' or 'float16')");
}

// True for an array whose elements are 2-byte numbers (float16, uint16, int16): half bits.
bool is_half_array(const pb::handle& obj) {
  if (!pb::isinstance<pb::array>(obj)) return false;
  const pb::dtype dt = pb::reinterpret_borrow<pb::array>(obj).dtype();
  const char kind = dt.kind();
  return dt.itemsize() == 2 && (kind == 'f' || kind == 'u' || kind == 'i');
}

std::string type_of(const pb::handle& obj) {
  if (pb::isinstance<pb::array>(obj)) {
    return "dtype " + pb::str(pb::reinterpret_borrow<pb::array>(obj).dtype()).cast<std::string>();
  }
  return pb::str(pb::type::handle_of(obj).attr("__name__")).cast<std::string>();
}

// A 2-byte array, itself when its strides are non-negative multiples of 2 bytes and its data
// aligned (viewed in place), else one aligned C-contiguous copy of the same dtype. `float32_ok`:
// the message mentions float32 (q of the mixed path).
pb::array half_array(const pb::handle& obj, const char* what, Inputs inputs,
                     bool float32_ok = false) {
  if (inputs == Inputs::kBf16 && pb::isinstance<pb::array>(obj) &&
      pb::reinterpret_borrow<pb::array>(obj).dtype().kind() == 'f' &&
      pb::reinterpret_borrow<pb::array>(obj).dtype().itemsize() == 2) {
    throw pb::type_error(std::string(what) +
                         ": a float16 array for dtype='bfloat16' (its bits are f16, not bf16: "
                         "bf16 travels as uint16 bits)");
  }
  if (!is_half_array(obj)) {
    throw pb::type_error(std::string(what) + ": dtype='" + dtype_name(inputs) +
                         "' needs a 2-byte array (float16, or the bits as uint16 / int16)" +
                         (float32_ok ? " or a float32 q with half k, v" : "") + ", got " +
                         type_of(obj));
  }
  pb::array a = pb::reinterpret_borrow<pb::array>(obj);
  bool in_place = reinterpret_cast<std::uintptr_t>(a.data()) % 2 == 0;
  for (pb::ssize_t d = 0; d < a.ndim(); ++d) {
    if (a.strides(d) < 0 || a.strides(d) % 2 != 0) in_place = false;
  }
  if (in_place) return a;
  // numpy.array(copy=True): a fresh (aligned) buffer even when a is contiguous but unaligned,
  // where numpy.ascontiguousarray would return a itself.
  static const pb::object& array = py_attr("numpy", "array");
  return array(a, pb::arg("copy") = true, pb::arg("order") = "C");
}

// A new C-contiguous uint16 array holding a half result.
pb::array_t<uint16_t> new_bits(const std::vector<pb::ssize_t>& shape) {
  return checked_array<uint16_t>(shape, "the result");
}

template <class H>
pb::object attention_half(Call& c) {
  const auto kv = view4<H>(c.k, "k", ""), vv = view4<H>(c.v, "v", "");
  const std::array<int64_t, 4> oshape = c.oshape();
  std::vector<pb::ssize_t> shape(oshape.begin(), oshape.end());
  if (c.q_half) {
    pb::array_t<uint16_t> out = new_bits(shape);
    const View<H, 4> ov = view_of<H, 4>(out, "out", "");
    const auto qv = view4<H>(c.q, "q", "");
    {
      pb::gil_scoped_release release;
      attention(qv, kv, vv, c.built.scheme, c.opt, ov, c.pq(), c.pk());
    }
    return c.unpack(std::move(out));
  }
  // float32 q: the mixed path (float32 out).
  pb::array_t<float> out = new_array<float, 4>(oshape);
  const View<float, 4> ov = mutable_view<float, 4>(out);
  const auto qv = view4<float>(c.q, "q", "");
  {
    pb::gil_scoped_release release;
    attention(qv, kv, vv, c.built.scheme, c.opt, ov, c.pq(), c.pk());
  }
  return c.unpack(std::move(out));
}

template <class H>
pb::array rope_half(const pb::array& xa, const RopeSetup& r, bool inplace, int num_threads) {
  pb::array result = xa;
  if (!inplace) result = new_bits(std::vector<pb::ssize_t>(xa.shape(), xa.shape() + xa.ndim()));
  const auto xv = as4<const H>(xa, "x");
  const auto ov = as4<H>(result, "out");
  pb::gil_scoped_release release;
  apply_rope(r.freqs, r.style, xv, ov, r.pos(), r.direction, num_threads);
  return result;
}

const char* kAttentionHalfDoc =
    R"doc(_attention_half(q, k, v, scheme=None, *, dtype, **keywords of attention) -> out

Attention in half precision (posenc.attention_half is the NumPy API over it). dtype: 'bfloat16'
or 'float16', how the 2-byte arrays' bits are read (any 2-byte dtype: float16, uint16, int16).
q, k, v half: out is a new uint16 array of bits [batch, seq_q, heads_q, head_dim]. q float32
with half k, v (a half KV cache): out is float32. The result is posenc.attention's float32
result on the exactly widened inputs, rounded once. Every keyword of posenc.attention applies
except return_lse and out (TypeError).)doc";

const char* kRopeHalfDoc =
    R"doc(_apply_rope_half(x, freqs=None, *, dtype, **keywords of apply_rope) -> rotated x

RoPE in half precision (posenc.apply_rope_half is the NumPy API over it): x a 2-byte array of
bf16 or f16 bits (dtype 'bfloat16' or 'float16'), [batch, seq, heads, head_dim] or [seq, heads,
head_dim]; returns a new uint16 array of bits, or x itself with inplace=True (x must then be a
writable 2-byte array with non-negative strides). The result is apply_rope's float32 result on
the exactly widened x, rounded once. out= is refused (TypeError).)doc";

}  // namespace

void half_inputs(Call& c, Inputs inputs, const pb::handle& q, const pb::handle& k,
                 const pb::handle& v, const QkvNames& names) {
  const bool q_f32 = pb::isinstance<pb::array>(q) &&
                     pb::reinterpret_borrow<pb::array>(q).dtype().is(pb::dtype::of<float>());
  c.q_half = !q_f32;
  c.q = q_f32 ? as_array<float>(q, names[0]) : half_array(q, names[0], inputs, true);
  c.k = half_array(k, names[1], inputs);
  c.v = half_array(v, names[2], inputs);
}

void bind_half(pb::module_& m) {
  const std::set<std::string> extra = {"out", "return_lse"};
  m.def(
      "_attention_half",
      [extra](const pb::object& q, const pb::object& k, const pb::object& v,
              const pb::object& scheme, const pb::object& dtype, const pb::kwargs& kw) {
        const Inputs inputs = parse_half_dtype(arg_str(dtype, "dtype"));
        Call c = parse("attention_half", q, k, v, scheme, kw, inputs, extra);
        if (c.return_lse) {
          throw pb::type_error(
              "attention_half(): return_lse is not available in half precision (use "
              "posenc.attention on float32 inputs for the log-sum-exp)");
        }
        if (!c.out.is_none()) {
          throw pb::type_error(
              "attention_half(): out= is not available (the result is a new "
              "array)");
        }
        return inputs == Inputs::kBf16 ? attention_half<bf16>(c) : attention_half<f16>(c);
      },
      arg("q"), arg("k"), arg("v"), arg("scheme") = pb::none(), pb::kw_only(), arg("dtype"),
      kAttentionHalfDoc);
  m.def(
      "_apply_rope_half",
      [](const pb::object& x, const pb::object& freqs, const pb::object& dtype,
         const pb::object& style, const pb::object& positions, const pb::object& inverse_arg,
         const pb::object& inplace_arg, const pb::object& out, const pb::object& num_threads_arg,
         const pb::object& rotary_dim_arg, const pb::object& base_arg, const pb::object& scaling,
         const pb::object& seq_len_arg, const pb::object& angles_arg, const pb::object& config) {
        const RopeScalars a = rope_scalars(inverse_arg, inplace_arg, num_threads_arg,
                                           rotary_dim_arg, base_arg, seq_len_arg, angles_arg);
        const bool inplace = a.inplace;
        const std::optional<bool> inverse = a.inverse;
        const int num_threads = a.num_threads;
        const int64_t rotary_dim = a.rotary_dim;
        const double base = a.base;
        const std::optional<int64_t> seq_len = a.seq_len;
        const std::string& angles = a.angles;
        const Inputs inputs = parse_half_dtype(arg_str(dtype, "dtype"));
        if (!out.is_none()) {
          throw pb::type_error(
              "apply_rope_half(): out= is not available (the result is a new "
              "array, or x itself with inplace=True)");
        }
        pb::array xa = half_array(x, "x", inputs);
        if (inplace && (!xa.is(x) || !xa.writeable())) {
          throw pb::type_error(
              "x: inplace=True needs a writable 2-byte array with non-negative strides (no "
              "copy)");
        }
        const RopeSetup r = rope_setup(xa, freqs, style, positions, inverse.value_or(false),
                                       rotary_dim, base, scaling, seq_len, angles, config);
        return inputs == Inputs::kBf16 ? rope_half<bf16>(xa, r, inplace, num_threads)
                                       : rope_half<f16>(xa, r, inplace, num_threads);
      },
      arg("x"), arg("freqs") = pb::none(), pb::kw_only(), arg("dtype"), POSENC_ROPE_KEYWORDS,
      kRopeHalfDoc);
  // The address of the array the half bindings would view for `obj` (half_array, what
  // _attention_half's k, v, half q and _apply_rope_half's x go through): the caller's buffer
  // when no copy is needed. For the zero-copy tests.
  m.def("_viewed_address_half", [](const pb::object& obj, const std::string& dtype) {
    const pb::array a = half_array(obj, "x", parse_half_dtype(dtype));
    return reinterpret_cast<std::uintptr_t>(a.data());
  });
}

}  // namespace posenc::py
