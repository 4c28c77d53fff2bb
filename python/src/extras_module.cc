// python/src/extras_module.cc - the extension module posenc._posenc_extras: the figures (cairo)
// and the benchmark suite, loaded on demand by posenc.plot and posenc.bench, so that the core
// extension posenc._posenc links only the library.
//
// Errors: the library's exceptions raised here become the core module's Python exceptions
// (posenc.Error, posenc.ShapeError, posenc.InvalidValueError, posenc.IoError), as in the core.
#include <pybind11/pybind11.h>

#include "args.h"
#include "calls.h"

PYBIND11_MODULE(_posenc_extras, m) {
  namespace pb = pybind11;
  using namespace posenc::py;
  m.doc() = "posenc: figures and benchmarks (loaded on demand; import posenc)";
  const pb::module_ core = pb::module_::import("posenc._posenc");
  // The core module's classes (it stays imported: posenc imports it first).
  static const ErrorClasses classes{core.attr("Error").ptr(), core.attr("ShapeError").ptr(),
                                    core.attr("InvalidValueError").ptr(),
                                    core.attr("IoError").ptr()};
  pb::register_local_exception_translator(
      [](std::exception_ptr p) { set_python_error(p, classes); });
  bind_extras(m);
}
