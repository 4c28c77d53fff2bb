// python/src/py_common.h - what the binding files share: NumPy arrays as posenc views (without
// copies when the dtype and strides allow), keyword parsing, positions, model configs.
//
// Conversion policy (docs/python.md): an input array is used in place when its dtype is the one
// the computation runs in (float32 for the kernels, float64 for the reference) and its strides
// are non-negative multiples of the element size; anything else (another dtype, negative or
// unaligned strides) is converted once with numpy.ascontiguousarray(x, dtype). Outputs are new
// C-contiguous arrays unless an `out=` array is given (then it must have the exact dtype and
// shape; any non-negative strides).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "posenc/posenc.h"
#include "posenc/size.h"

namespace posenc::py {

namespace pb = pybind11;

// module.attr, looked up once and never released (a function-local static pb::object would be
// destroyed after the interpreter finalizes).
inline const pb::object& py_attr(const char* module, const char* name) {
  return *new pb::object(pb::module_::import(module).attr(name));
}

// True when `a` can be viewed in place as elements of T: dtype T, strides non-negative multiples
// of sizeof(T).
template <class T>
bool viewable(const pb::array& a) {
  if (!pb::isinstance<pb::array_t<T>>(a)) return false;
  if (reinterpret_cast<std::uintptr_t>(a.data()) % alignof(T) != 0) return false;
  for (pb::ssize_t d = 0; d < a.ndim(); ++d) {
    const pb::ssize_t s = a.strides(d);
    if (s < 0 || s % static_cast<pb::ssize_t>(sizeof(T)) != 0) return false;
  }
  return true;
}

// `obj` (an integer array, sequence or scalar) as a C-contiguous array of the integer type T.
// TypeError naming `what` for floats, booleans and objects NumPy cannot convert; ValueError for
// values T cannot hold.
template <class T>
pb::array int_array(const pb::handle& obj, const std::string& what) {
  static const pb::object& asarray = py_attr("numpy", "asarray");
  pb::array a;
  try {
    a = asarray(obj);
  } catch (pb::error_already_set& e) {
    throw pb::type_error(what + ": expected integers (" + e.what() + ")");
  }
  const char kind = a.dtype().kind();
  if (kind != 'i' && kind != 'u' && !(a.size() == 0 && kind == 'f')) {
    throw pb::type_error(what + ": expected integers, got dtype " +
                         pb::str(a.dtype()).cast<std::string>());
  }
  static const pb::object& iinfo = py_attr("numpy", "iinfo");
  if (a.size() > 0) {
    const auto lo = a.attr("min")().cast<long double>(), hi = a.attr("max")().cast<long double>();
    const pb::object info = iinfo(pb::dtype::of<T>());
    const bool low = lo < info.attr("min").cast<long double>();
    if (low || hi > info.attr("max").cast<long double>()) {
      throw ValueError(what + ": value " +
                       pb::str(a.attr(low ? "min" : "max")()).cast<std::string>() +
                       " is out of range for " + pb::str(pb::dtype::of<T>()).cast<std::string>() +
                       " [" + pb::str(info.attr("min")).cast<std::string>() + ", " +
                       pb::str(info.attr("max")).cast<std::string>() + "]");
    }
  }
  return pb::array_t<T, pb::array::c_style | pb::array::forcecast>::ensure(a);
}

// `obj` as an array of T that can be viewed in place: itself when possible, else one converted
// C-contiguous copy. Real numbers only: floating arrays (converted to T), integer arrays whose
// values T holds exactly; TypeError (naming `what`) for complex, boolean, object or text data
// and for objects NumPy cannot convert, ValueError for integers T would round.
template <class T>
pb::array as_array(const pb::handle& obj, const char* what) {
  if (pb::isinstance<pb::array>(obj)) {
    pb::array a = pb::reinterpret_borrow<pb::array>(obj);
    if (viewable<T>(a)) return a;
  }
  const char* tname = sizeof(T) == 4 ? "float32" : "float64";
  pb::array src;
  try {
    static const pb::object& asarray = py_attr("numpy", "asarray");
    src = asarray(obj);
  } catch (pb::error_already_set& e) {
    throw pb::type_error(std::string(what) + ": cannot be converted to a " + tname + " array (" +
                         e.what() + ")");
  }
  const char kind = src.dtype().kind();
  if (kind != 'f' && kind != 'i' && kind != 'u') {
    throw pb::type_error(std::string(what) + ": expected a real floating-point array, got dtype " +
                         pb::str(src.dtype()).cast<std::string>() +
                         (kind == 'c' ? " (the imaginary part would be dropped)" : ""));
  }
  static const pb::object& ascontig = py_attr("numpy", "ascontiguousarray");
  pb::array a = ascontig(src, pb::dtype::of<T>());
  if (kind != 'f' && src.size() > 0) {
    // Integers: exact in T, or refused (no silent rounding of large values).
    static const pb::object& array_equal = py_attr("numpy", "array_equal");
    if (!array_equal(a.attr("astype")(src.dtype()), src).cast<bool>() ||
        !array_equal(a.attr("astype")("float64"), src.attr("astype")("float64")).cast<bool>()) {
      throw ValueError(std::string(what) + ": integer values that " + tname +
                       " cannot hold exactly (pass a floating-point array)");
    }
  }
  if (viewable<T>(a)) return a;
  // Contiguous but unaligned data comes back from ascontiguousarray as itself: one aligned
  // copy (numpy.array(copy=True) allocates a fresh buffer).
  static const pb::object& array = py_attr("numpy", "array");
  return array(a, pb::arg("copy") = true, pb::arg("order") = "C");
}

// A rank-R view of an array (viewable<T>), or ShapeError naming `what` and `layout`.
template <class T, std::size_t R>
View<T, R> view_of(const pb::array& a, const char* what, const char* layout) {
  if (a.ndim() != static_cast<pb::ssize_t>(R)) {
    throw ShapeError(std::string(what) + ": expected " + std::to_string(R) + " dimensions " +
                     layout + ", got " + std::to_string(a.ndim()));
  }
  View<T, R> v;
  v.data = static_cast<T*>(const_cast<void*>(a.data()));
  for (std::size_t d = 0; d < R; ++d) {
    v.shape[d] = a.shape(static_cast<pb::ssize_t>(d));
    v.stride[d] = a.strides(static_cast<pb::ssize_t>(d)) / static_cast<pb::ssize_t>(sizeof(T));
  }
  return v;
}

// A writable view of an output array (exact dtype and shape required; no conversion).
template <class T, std::size_t R>
View<T, R> out_view(const pb::handle& obj, const std::array<int64_t, R>& shape, const char* what) {
  if (!pb::isinstance<pb::array>(obj)) throw pb::type_error(std::string(what) + ": not an array");
  pb::array a = pb::reinterpret_borrow<pb::array>(obj);
  if (!pb::isinstance<pb::array_t<T>>(a)) {
    throw pb::type_error(std::string(what) + ": dtype must be " +
                         (sizeof(T) == 4 ? "float32" : "float64") + ", got " +
                         pb::str(a.dtype()).cast<std::string>());
  }
  if (!a.writeable()) throw ValueError(std::string(what) + ": array is read-only");
  if (!viewable<T>(a)) throw ValueError(std::string(what) + ": strides must be non-negative");
  auto v = view_of<T, R>(a, what, "");
  if (v.shape != shape) {
    throw ShapeError(std::string(what) + ": shape " + shape_str(v.shape) + ", expected " +
                     shape_str(shape));
  }
  return View<T, R>{static_cast<T*>(a.mutable_data()), v.shape, v.stride};
}

// A new C-contiguous array of `shape` (sizes from the caller's arguments), checked against the
// allocation limit before it is made: SizeError naming `what` and the bytes.
template <class T>
pb::array_t<T> checked_array(const std::vector<pb::ssize_t>& shape, const std::string& what) {
  int64_t n = 1;
  bool overflow = false;
  for (const pb::ssize_t d : shape) {
    if (d < 0) throw ValueError(what + ": negative size " + std::to_string(d));
    const std::optional<int64_t> m = checked_mul(n, d);
    overflow = overflow || !m;
    n = m.value_or(n);
  }
  const std::optional<int64_t> bytes = checked_mul(n, static_cast<int64_t>(sizeof(T)));
  if (overflow || !bytes) throw SizeError(what + ": the size overflows a 64-bit integer");
  require_allocation(what, *bytes);
  return pb::array_t<T>(shape);
}

// A new C-contiguous array of `shape`, checked against the allocation limit first (inputs
// broadcast with stride 0 can describe results far larger than themselves).
template <class T, std::size_t R>
pb::array_t<T> new_array(const std::array<int64_t, R>& shape, const char* what = "the result") {
  return checked_array<T>(std::vector<pb::ssize_t>(shape.begin(), shape.end()),
                          std::string(what) + " " + shape_str(shape));
}

template <class T, std::size_t R>
View<T, R> mutable_view(pb::array_t<T>& a) {
  return view_of<T, R>(a, "out", "");
}

// Positions from None (nullopt), an int (offset) or an integer array [seq] (shared) or
// [batch, seq] (per row). `what` names the argument.
std::optional<Positions> positions_arg(const pb::handle& obj, const char* what);

// A model config from a path (str / os.PathLike), a dict (the config.json contents) or a
// ModelConfig.
ModelConfig model_config_arg(const pb::handle& obj);

// A Hugging Face rope_scaling dict (rope_type and its fields) as RopeScaling; None: no scaling
// (bind_rope.cc).
RopeScaling scaling_arg(const pb::handle& obj);

// Enum spellings (ValueError listing the choices).
// The enums' names: posenc/names.h (parse_rope_style, parse_rope_angles, parse_sin_layout, ...).
inline RopeStyle parse_style(const std::string& s) { return parse_rope_style(s, "style"); }
inline RopeAngles parse_angles(const std::string& s) { return parse_rope_angles(s, "angles"); }
inline SinLayout parse_layout(const std::string& s) { return parse_sin_layout(s, "layout"); }

// Raises TypeError "<fn>() got an unexpected keyword argument '<key>'".
[[noreturn]] void unexpected_keyword(const std::string& fn, const std::string& key);

// The Python classes of posenc's exceptions (the core module's: posenc.Error, ShapeError,
// InvalidValueError, IoError), and the translation both extension modules register: the
// exception in `p`, when it is a posenc::Error, becomes the matching Python error with its message
// unchanged; anything else is left to pybind11 (rethrown).
struct ErrorClasses {
  PyObject* error = nullptr;
  PyObject* shape_error = nullptr;
  PyObject* value_error = nullptr;
  PyObject* io_error = nullptr;
};
void set_python_error(std::exception_ptr p, const ErrorClasses& c);

// Registration of each binding file.
void bind_encodings(pb::module_& m, pb::module_& ref);
void bind_attention(pb::module_& m, pb::module_& ref);
void bind_checks(pb::module_& m);
void bind_extras(pb::module_& m);  // the module posenc._posenc_extras

}  // namespace posenc::py
