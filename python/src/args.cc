// python/src/args.cc - scalar arguments' types and ranges (args.h).
#include "args.h"

#include <cmath>
#include <sstream>

namespace posenc::py {

std::string type_name(const pb::handle& v) {
  const pb::handle t = pb::type::handle_of(v);
  const std::string module = pb::str(t.attr("__module__")).cast<std::string>();
  const std::string name = pb::str(t.attr("__qualname__")).cast<std::string>();
  return module == "builtins" ? name : module + "." + name;
}

namespace {

bool is_text(const pb::handle& v) {
  return pb::isinstance<pb::str>(v) || pb::isinstance<pb::bytes>(v) || PyByteArray_Check(v.ptr());
}

// numpy.bool_ and torch's bool tensors are neither Python bools nor ints, but say what they are
// through their dtype.
bool is_bool_like(const pb::handle& v) {
  if (PyBool_Check(v.ptr())) return true;
  if (!pb::hasattr(v, "dtype")) return false;
  const std::string s = pb::str(v.attr("dtype")).cast<std::string>();
  return s == "bool" || s == "torch.bool";
}

// Python and NumPy complex numbers, complex tensors: float() would drop the imaginary part.
bool is_complex(const pb::handle& v) {
  if (PyComplex_Check(v.ptr())) return true;
  if (!pb::hasattr(v, "dtype")) return false;
  return pb::str(v.attr("dtype")).cast<std::string>().find("complex") != std::string::npos;
}

std::string short_repr(const pb::handle& v) {
  std::string s = pb::repr(v).cast<std::string>();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

}  // namespace

bool arg_bool(const pb::handle& v, const std::string& name) {
  if (PyBool_Check(v.ptr())) return v.ptr() == Py_True;
  const std::string t = type_name(v);
  if (t == "numpy.bool" || t == "numpy.bool_") return PyObject_IsTrue(v.ptr()) == 1;
  throw pb::type_error(name + ": expected True or False, got " + t + " " + short_repr(v));
}

int64_t arg_int(const pb::handle& v, const std::string& name, int64_t lo, int64_t hi) {
  if (is_bool_like(v) || is_text(v) || !PyIndex_Check(v.ptr())) {
    throw pb::type_error(name + ": expected an integer, got " + type_name(v) + " " + short_repr(v));
  }
  const pb::object i = pb::reinterpret_steal<pb::object>(PyNumber_Index(v.ptr()));
  if (!i) throw pb::error_already_set();
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (overflow == 0 && x == -1 && PyErr_Occurred()) throw pb::error_already_set();
  if (overflow != 0 || x < lo || x > hi) {
    std::ostringstream m;
    m << name << ": " << pb::str(i).cast<std::string>() << " is outside [" << lo << ", " << hi
      << "]";
    throw ValueError(m.str());
  }
  return static_cast<int64_t>(x);
}

double arg_float(const pb::handle& v, const std::string& name, bool finite, bool positive) {
  const bool number = PyFloat_Check(v.ptr()) || PyLong_Check(v.ptr()) ||
                      (pb::hasattr(v, "__float__") && !is_text(v));
  if (!number || is_bool_like(v) || is_complex(v)) {
    throw pb::type_error(name + ": expected a number, got " + type_name(v) + " " + short_repr(v));
  }
  const double x = PyFloat_AsDouble(v.ptr());
  if (x == -1.0 && PyErr_Occurred()) {
    // An int beyond double's range, a multi-element tensor: not one number.
    PyErr_Clear();
    throw ValueError(name + ": " + short_repr(v) + " is not one real number in double's range");
  }
  if (finite && !std::isfinite(x)) {
    throw ValueError(name + ": must be finite (got " + short_repr(v) + ")");
  }
  if (positive && !(x > 0)) throw ValueError(name + ": must be > 0 (got " + short_repr(v) + ")");
  return x;
}

std::string arg_str(const pb::handle& v, const std::string& name) {
  if (!pb::isinstance<pb::str>(v)) {
    throw pb::type_error(name + ": expected a string, got " + type_name(v) + " " + short_repr(v));
  }
  return v.cast<std::string>();
}

}  // namespace posenc::py
