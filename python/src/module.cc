// python/src/module.cc - the extension module posenc._posenc: exceptions, shared argument
// conversions, and the registration of every binding file.
//
// Errors: posenc::Error and its subclasses become Python exceptions with the C++ message
// unchanged: posenc.Error (a ValueError), posenc.ShapeError, posenc.InvalidValueError and
// posenc.IoError (subclasses of posenc.Error). Arguments of the wrong Python type raise TypeError.
#include <pybind11/pybind11.h>

#include <filesystem>

#include "args.h"
#include "calls.h"

namespace posenc::py {

std::optional<Positions> positions_arg(const pb::handle& obj, const char* what) {
  if (obj.is_none()) return std::nullopt;
  // An int offset (numpy integer scalars too); arrays and sequences are ids.
  if (is_int_scalar(obj)) {
    return Positions::offset(arg_int(obj, what, 0, kMaxPositionArg));
  }
  // Integer ids only (no float truncated, no unsigned value wrapped): int_array refuses them.
  const pb::array ids = int_array<int64_t>(obj, what);
  const int64_t* p = static_cast<const int64_t*>(ids.data());
  if (ids.ndim() == 1) {
    return Positions::shared(std::vector<int64_t>(p, p + ids.shape(0)));
  }
  if (ids.ndim() == 2) {
    return Positions::per_row(std::vector<int64_t>(p, p + ids.size()), ids.shape(0), ids.shape(1));
  }
  throw ShapeError(std::string(what) + ": positions must be [seq] or [batch, seq], got " +
                   std::to_string(ids.ndim()) + " dimensions");
}

ModelConfig model_config_arg(const pb::handle& obj) {
  if (pb::isinstance<ModelConfig>(obj)) return obj.cast<ModelConfig>();
  if (pb::isinstance<pb::dict>(obj)) {
    static const pb::object& dumps = py_attr("json", "dumps");
    return parse_model_config(dumps(obj).cast<std::string>(), "config");
  }
  if (pb::isinstance<pb::str>(obj) || pb::hasattr(obj, "__fspath__")) {
    static const pb::object& fspath = py_attr("os", "fspath");
    return read_model_config(fspath(obj).cast<std::string>());
  }
  throw pb::type_error("config: expected a path to config.json, a dict or a ModelConfig");
}

void unexpected_keyword(const std::string& fn, const std::string& key) {
  throw pb::type_error(fn + "() got an unexpected keyword argument '" + key + "'");
}

}  // namespace posenc::py

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
  pb::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const posenc::ShapeError& e) {
      PyErr_SetString(shape_error.ptr(), e.what());
    } catch (const posenc::ValueError& e) {
      PyErr_SetString(value_error.ptr(), e.what());
    } catch (const posenc::IoError& e) {
      PyErr_SetString(io_error.ptr(), e.what());
    } catch (const posenc::Error& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });

  pb::module_ ref = m.def_submodule("ref", "The float64 reference (posenc::ref)");
  bind_encodings(m, ref);
  bind_attention(m, ref);
  bind_extras(m);
  bind_half(m);
  bind_paged(m);
}
