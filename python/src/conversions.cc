// python/src/conversions.cc - argument conversions shared by the binding files of both extension
// modules (posenc._posenc, posenc._posenc_extras): positions, model configs, keyword errors.
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

void set_python_error(std::exception_ptr p, const ErrorClasses& c) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const posenc::ShapeError& e) {
    PyErr_SetString(c.shape_error, e.what());
  } catch (const posenc::ValueError& e) {
    PyErr_SetString(c.value_error, e.what());
  } catch (const posenc::IoError& e) {
    PyErr_SetString(c.io_error, e.what());
  } catch (const posenc::Error& e) {
    PyErr_SetString(c.error, e.what());
  }
}

}  // namespace posenc::py
