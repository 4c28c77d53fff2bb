// src/schemes/build.h - what a scheme's builder gets: the settings, the named parameter tensors,
// the model config and the BuiltScheme it fills (build_scheme in src/scheme.cc).
//
// Each scheme builds its PositionScheme alternative in its own file (its term's static build(),
// defined in src/schemes/<scheme>.cc): which tensors it reads and their ranks, which settings a
// model config fixes, and the model's values.
#pragma once

#include <algorithm>
#include <array>
#include <string>
#include <type_traits>
#include <vector>

#include "common.h"
#include "posenc/config.h"
#include "posenc/scheme.h"

namespace posenc::detail {

std::string join(const std::vector<std::string>& v, const std::string& sep);
std::string shape_string(const std::vector<int64_t>& shape);
// Row-major strides of t (its own when given).
std::vector<int64_t> param_strides(const ParamTensor& t);
// Every element of t in row-major order, as T (a copy).
template <class T>
std::vector<T> param_values(const ParamTensor& t);

class SchemeBuild {
 public:
  SchemeBuild(const SchemeSettings& s, const ParamMap& params, const ModelConfig* model,
              const SchemeDims& dims, SchemePrecision precision, BuiltScheme& out)
      : settings(s),
        params(params),
        model(model),
        dims(dims),
        f64(precision == SchemePrecision::kFloat64),
        out(out) {}

  const SchemeSettings& settings;
  const ParamMap& params;
  const ModelConfig* model;  // nullable
  const SchemeDims& dims;
  const bool f64;  // building for the float64 oracle: tables go to out.tables64
  BuiltScheme& out;

  // "params: name", as messages name a parameter.
  std::string pname(const std::string& name) const { return settings.params_name + ": " + name; }
  // "config (model_type 'x')".
  std::string model_name() const {
    return settings.config_name + " (model_type '" + model->model_type + "')";
  }

  // The parameter `name` checked for rank (one of `ranks`); nullptr when absent and optional.
  const ParamTensor* get(const std::string& name, const std::vector<std::size_t>& ranks,
                         const std::string& layout, bool required) const;

  // The tensor as a rank-R view of scalar T: its own data when the dtype is T, else a row-major
  // converted copy owned by the BuiltScheme.
  template <class T, std::size_t R>
  View<const T, R> view(const ParamTensor& t) {
    std::array<int64_t, R> shape{};
    std::copy(t.shape.begin(), t.shape.end(), shape.begin());
    const T* own = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      own = t.f32;
    } else {
      own = t.f64;
    }
    if (own != nullptr) {
      const std::vector<int64_t> st = param_strides(t);
      View<const T, R> v{own, shape, {}};
      std::copy(st.begin(), st.end(), v.stride.begin());
      return v;
    }
    std::vector<T>* buf = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      buf = &out.storage32.emplace_back(param_values<float>(t));
    } else {
      buf = &out.storage64.emplace_back(param_values<double>(t));
    }
    return View<const T, R>::contiguous(buf->data(), shape);
  }

  // A learned parameter of the built scheme (its gradient has grad_shape; summed: a shared table
  // broadcast over the heads, its gradient summed back).
  void learned(const std::string& name, const ParamTensor& t, std::vector<int64_t> grad_shape,
               bool summed = false) {
    out.learned.push_back({name, t.shape, std::move(grad_shape), summed});
  }

  // A setting given beside a model config, whose value the model fixes: an error.
  void conflict(bool given, const std::string& setting) const {
    if (given) {
      fail(settings.name_of(setting) + " conflicts with " + model_name() +
           ": the model's value is used");
    }
  }
};

}  // namespace posenc::detail
