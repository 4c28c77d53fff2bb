// python/src/module.cc - the extension module posenc._posenc: exceptions and the registration of
// every binding file of the core (the figures and the benchmark suite are posenc._posenc_extras,
// extras_module.cc).
//
// Errors: posenc::Error and its subclasses become Python exceptions with the C++ message
// unchanged: posenc.Error (a ValueError), posenc.ShapeError, posenc.InvalidValueError and
// posenc.IoError (subclasses of posenc.Error). Arguments of the wrong Python type raise TypeError.
#include <pybind11/pybind11.h>

#include <filesystem>

#include "args.h"
#include "calls.h"

PYBIND11_MODULE(_posenc, m) {
  namespace pb = pybind11;
  using namespace posenc::py;
  m.doc() = "posenc: transformer positional encodings (the compiled core; import posenc)";
  m.attr("__version__") = POSENC_VERSION_STRING;

  // Base first: pybind11 tries translators in reverse order of registration.
  static auto& error = *new pb::exception<posenc::Error>(m, "Error", PyExc_ValueError);
  static auto& shape_error = *new pb::exception<posenc::ShapeError>(m, "ShapeError", error.ptr());
  static auto& value_error =
      *new pb::exception<posenc::ValueError>(m, "InvalidValueError", error.ptr());
  static auto& io_error = *new pb::exception<posenc::IoError>(m, "IoError", error.ptr());
  static const ErrorClasses classes{error.ptr(), shape_error.ptr(), value_error.ptr(),
                                    io_error.ptr()};
  pb::register_exception_translator([](std::exception_ptr p) { set_python_error(p, classes); });

  pb::module_ ref = m.def_submodule("ref", "The float64 reference (posenc::ref)");
  bind_encodings(m, ref);
  bind_attention(m, ref);
  bind_checks(m);
  bind_half(m);
  bind_paged(m);
}
