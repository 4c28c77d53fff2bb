// python/src/args.h - the one place that decides the Python type and range of a scalar argument
// (a keyword of attention, attention_paged, rope_append, ...; the torch ops hand their options to
// the same functions). Nothing is cast silently: a value of the wrong kind is a TypeError, a value
// out of range a ValueError, both naming the argument and what was expected.
//
//   bool   True / False (numpy.bool_ too); not 0 / 1, not a string
//   int    a Python int or anything with __index__ (numpy integers, integer 0-d tensors); not a
//          bool, not a float (2.0 included), not a string
//   float  an int or a float (numpy floating and integer scalars, anything with __float__ that is
//          not a string, bytes or bool)
//   str    a str
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "posenc/size.h"
#include "py_common.h"

namespace posenc::py {

// The largest position and window posenc takes (2^48, docs/attention.md).
inline constexpr int64_t kMaxPositionArg = int64_t{1} << 48;

bool arg_bool(const pb::handle& v, const std::string& name);

// Whether `v` is one integer (a Python int, a NumPy integer scalar, anything with __index__ that
// is neither an array nor a sequence): the form of a position offset, against an id array.
inline bool is_int_scalar(const pb::handle& v) {
  return !pb::isinstance<pb::array>(v) && !pb::isinstance<pb::sequence>(v) &&
         PyIndex_Check(v.ptr());
}

// An integer in [lo, hi].
int64_t arg_int(const pb::handle& v, const std::string& name,
                int64_t lo = std::numeric_limits<int64_t>::min(),
                int64_t hi = std::numeric_limits<int64_t>::max());

// A real number; `finite` refuses inf and NaN, `positive` values <= 0 (and NaN).
double arg_float(const pb::handle& v, const std::string& name, bool finite = true,
                 bool positive = false);

std::string arg_str(const pb::handle& v, const std::string& name);

// A Python type name for messages ("float", "str", "numpy.float64").
std::string type_name(const pb::handle& v);

// `v` as T by the rules above (bool, integers in T's range, finite floating point, strings);
// another T through pybind11, its failure a TypeError naming the argument.
template <class T>
T arg_as(const pb::handle& v, const std::string& name) {
  if constexpr (std::is_same_v<T, bool>) {
    return arg_bool(v, name);
  } else if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(
        arg_int(v, name, std::numeric_limits<T>::min(),
                static_cast<int64_t>(std::min<uint64_t>(std::numeric_limits<T>::max(),
                                                        std::numeric_limits<int64_t>::max()))));
  } else if constexpr (std::is_floating_point_v<T>) {
    return static_cast<T>(arg_float(v, name));
  } else if constexpr (std::is_same_v<T, std::string>) {
    return arg_str(v, name);
  } else {
    try {
      return v.cast<T>();
    } catch (const pb::cast_error&) {
      throw pb::type_error(name + ": unsupported value of type " + type_name(v));
    }
  }
}

}  // namespace posenc::py
