// python/src/bind_checks.cc - the property checks (posenc::run_checks), RoPE precision rows and
// the zero-copy probe of the array conversions, in the core extension.
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "args.h"
#include "py_common.h"

namespace posenc::py {

using pb::arg;

void bind_checks(pb::module_& m) {
  m.def(
      "_run_checks",
      [](uint64_t seed) {
        std::vector<CheckResult> rows;
        {
          pb::gil_scoped_release release;
          rows = run_checks({.seed = seed});
        }
        pb::list out;
        for (const auto& r : rows) {
          out.append(
              pb::make_tuple(r.property, r.scheme, r.measured, r.threshold, r.expect, r.pass));
        }
        return out;
      },
      arg("seed") = CheckOptions{}.seed);
  m.def(
      "_rope_precision",
      [](const std::vector<int64_t>& positions, int64_t head_dim, double base, uint64_t seed) {
        std::vector<RopePrecisionRow> rows;
        {
          pb::gil_scoped_release release;
          rows = rope_precision(positions, head_dim, base, seed);
        }
        pb::list out;
        for (const auto& r : rows) {
          out.append(
              pb::make_tuple(r.position, r.accurate_error, r.float32_error, r.float32_angle_error));
        }
        return out;
      },
      arg("positions"), arg("head_dim") = 128, arg("base") = 5e5, arg("seed") = 1);

  // The address of the array the bindings would view for `obj` in `dtype` (as_array): the
  // caller's buffer when no conversion is needed. For the zero-copy tests.
  m.def("_viewed_address", [](const pb::object& obj, const std::string& dtype) {
    const pb::array a = dtype == "float64" ? as_array<double>(obj, "x") : as_array<float>(obj, "x");
    return reinterpret_cast<std::uintptr_t>(a.data());
  });

  // A keyword's value as the plain Python value of its kind ("bool", "int", "float", "str") by
  // the bindings' rules (args.h): what posenc.torch hands to the typed torch ops, whose schemas
  // would otherwise read True as 1 or refuse a NumPy integer. Ranges are checked where the value
  // is used.
  m.def(
      "_arg",
      [](const pb::object& value, const std::string& kind, const std::string& name) -> pb::object {
        if (kind == "bool") return pb::bool_(arg_bool(value, name));
        if (kind == "int") return pb::int_(arg_int(value, name));
        if (kind == "float") return pb::float_(arg_float(value, name, /*finite=*/false));
        if (kind == "str") return pb::str(arg_str(value, name));
        throw ValueError("_arg: unknown kind '" + kind + "' (bool, int, float or str)");
      },
      arg("value"), arg("kind"), arg("name"));
}

}  // namespace posenc::py
