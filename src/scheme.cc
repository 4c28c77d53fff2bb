// src/scheme.cc - a PositionScheme from settings, a model config and named parameter tensors
// (posenc/scheme.h). Validation of the tables themselves (shapes against the heads and head_dim,
// finiteness) stays with attention(), which names the table; this file checks what only it
// knows: which tensors the scheme reads, their ranks, and agreement with the model config.
#include "posenc/scheme.h"

#include <algorithm>
#include <array>
#include <utility>

#include "attention/prepared.h"
#include "common.h"
#include "posenc/schemes.h"
#include "schemes/build.h"

namespace posenc {

namespace detail {

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string r = "[";
  for (std::size_t d = 0; d < shape.size(); ++d) r += (d ? ", " : "") + std::to_string(shape[d]);
  return r + "]";
}

std::vector<int64_t> param_strides(const ParamTensor& t) {
  if (!t.stride.empty()) return t.stride;
  std::vector<int64_t> st(t.shape.size());
  int64_t s = 1;
  for (std::size_t d = t.shape.size(); d-- > 0;) {
    st[d] = s;
    s *= t.shape[d];
  }
  return st;
}

template <class T>
std::vector<T> param_values(const ParamTensor& t) {
  const std::vector<int64_t> stride = param_strides(t);
  int64_t n = 1;
  for (int64_t s : t.shape) n *= s;
  std::vector<T> v;
  v.reserve(static_cast<std::size_t>(n));
  std::vector<int64_t> idx(t.shape.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = 0;
    for (std::size_t d = 0; d < t.shape.size(); ++d) off += idx[d] * stride[d];
    v.push_back(t.f32 ? static_cast<T>(t.f32[off]) : static_cast<T>(t.f64[off]));
    for (std::size_t d = t.shape.size(); d-- > 0;) {
      if (++idx[d] < t.shape[d]) break;
      idx[d] = 0;
    }
  }
  return v;
}
template std::vector<float> param_values<float>(const ParamTensor&);
template std::vector<double> param_values<double>(const ParamTensor&);

const ParamTensor* SchemeBuild::get(const std::string& name, const std::vector<std::size_t>& ranks,
                                    const std::string& layout, bool required) const {
  const auto it = params.find(name);
  if (it == params.end()) {
    if (!required) return nullptr;
    fail("scheme " + out.name + " needs parameter '" + name + "' " + layout + " in " +
         settings.params_name);
  }
  const ParamTensor& t = it->second;
  if ((t.f32 == nullptr) == (t.f64 == nullptr)) {
    fail(pname(name) + ": exactly one of float32 and float64 data must be given");
  }
  if (std::find(ranks.begin(), ranks.end(), t.shape.size()) == ranks.end()) {
    fail<ShapeError>(pname(name) + " has shape " + shape_string(t.shape) + ", expected " + layout);
  }
  if (!t.stride.empty() && t.stride.size() != t.shape.size()) {
    fail<ShapeError>(pname(name) + ": " + std::to_string(t.stride.size()) + " strides for " +
                     std::to_string(t.shape.size()) + " dimensions");
  }
  for (int64_t d : t.shape) {
    if (d < 0) fail<ShapeError>(pname(name) + ": negative dimension in " + shape_string(t.shape));
  }
  return &t;
}

}  // namespace detail

namespace {

using detail::fail;
using detail::join;

// What every scheme shares: the model's dimensions, the layer, the sinks; the scheme's own
// builder (its term's build) in between.
class Builder {
 public:
  Builder(detail::SchemeBuild& b) : b_(b) {}

  void build();

 private:
  void check_model_dims() const;
  const ModelLayer* resolve_layer();
  void build_sinks(const ModelLayer* layer);

  detail::SchemeBuild& b_;
};

void Builder::check_model_dims() const {
  const ModelConfig& m = *b_.model;
  const SchemeSettings& s = b_.settings;
  const std::string who = b_.model_name();
  if (m.head_dim > 0 && b_.dims.head_dim != m.head_dim) {
    fail<ShapeError>(s.q_name + ": head_dim " + std::to_string(b_.dims.head_dim) +
                     " does not match " + who + ": head_dim " + std::to_string(m.head_dim));
  }
  if (m.heads_q > 0 && b_.dims.heads_q != m.heads_q) {
    fail<ShapeError>(s.q_name + ": heads_q " + std::to_string(b_.dims.heads_q) +
                     " does not match " + who + ": " + std::to_string(m.heads_q) +
                     " attention heads");
  }
  if (m.heads_kv > 0 && b_.dims.heads_kv != m.heads_kv) {
    fail<ShapeError>(s.k_name + ": heads_kv " + std::to_string(b_.dims.heads_kv) +
                     " does not match " + who + ": " + std::to_string(m.heads_kv) +
                     " key/value heads");
  }
}

// The model layer SchemeSettings::layer names (nullptr without one); fills the layer's window,
// chunk, scale and query temperature into the BuiltScheme. A model whose layers differ needs one.
const ModelLayer* Builder::resolve_layer() {
  const SchemeSettings& s = b_.settings;
  if (!b_.model) {
    if (s.layer) fail("layer " + std::to_string(*s.layer) + " needs a model config");
    return nullptr;
  }
  if (!s.layer) {
    if (b_.model->layers_differ()) {
      fail(s.config_name + ": the layers of model_type '" + b_.model->model_type +
           "' differ in position handling (see posenc describe); choose a layer");
    }
    return nullptr;
  }
  const ModelLayer& l = model_layer(*b_.model, *s.layer);
  b_.out.window = l.sliding_window;
  b_.out.chunk = l.attention_chunk;
  b_.out.softcap = l.softcap;
  if (l.softmax_scale > 0) b_.out.scale = l.softmax_scale;
  if (!l.rope) b_.out.query_temperature = l.temperature;
  return &l;
}

// The optional `sinks` [heads_q] parameter: attention sinks for any scheme; required by a model
// layer that has them (gpt-oss).
void Builder::build_sinks(const ModelLayer* layer) {
  const bool required = layer != nullptr && layer->attention_sinks;
  if (b_.params.find("sinks") == b_.params.end()) {
    if (required) {
      fail("layer " + std::to_string(layer->index) + " of " + b_.model_name() +
           " has attention sinks: it needs parameter 'sinks' [heads_q] in " +
           b_.settings.params_name);
    }
    return;
  }
  const ParamTensor* t = b_.get("sinks", {1}, "[heads_q]", true);
  if (t->shape[0] != b_.dims.heads_q) {
    fail<ShapeError>(b_.pname("sinks") + " has shape " + detail::shape_string(t->shape) +
                     ", expected [" + std::to_string(b_.dims.heads_q) + "] (heads_q)");
  }
  if (b_.f64) {
    b_.out.tables64.sinks = b_.view<double, 1>(*t);
  } else {
    b_.out.sinks = b_.view<float, 1>(*t);
  }
  b_.learned("sinks", *t, t->shape);
}

// Calls Term::build of the alternative at `index` of SchemeTerm (PositionScheme's order).
template <std::size_t I = 0>
void build_term(std::size_t index, detail::SchemeBuild& b, const ModelLayer* layer) {
  if constexpr (I < std::variant_size_v<attn::SchemeTerm<float>>) {
    if (index == I) {
      std::variant_alternative_t<I, attn::SchemeTerm<float>>::build(b, layer);
      return;
    }
    build_term<I + 1>(index, b, layer);
  }
}

void Builder::build() {
  const SchemeSettings& s = b_.settings;
  if (b_.dims.seq_len < 0) fail("build_scheme: seq_len must be >= 0");
  std::string name = s.scheme;
  if (b_.model) {
    const std::string implied = model_attention_scheme(*b_.model, s.config_name);
    if (!name.empty() && name != implied) {
      fail("scheme " + name + " conflicts with " + s.config_name + " (model_type '" +
           b_.model->model_type + "' uses " + implied + ")");
    }
    name = implied;
    check_model_dims();
  } else if (name.empty()) {
    fail("build_scheme: a scheme name is required without a model config");
  }
  const std::vector<std::string> known = scheme_param_names(name);  // throws on unknown names
  for (const auto& [pn, t] : b_.params) {
    if (std::find(known.begin(), known.end(), pn) == known.end()) {
      fail(b_.pname(pn) + " is not a parameter of scheme " + name +
           (known.empty() ? std::string(" (it has none)")
                          : " (it reads " + join(known, ", ") + ")"));
    }
  }
  b_.out.name = name;
  const ModelLayer* layer = resolve_layer();
  // The registry's rows are in PositionScheme's order: a row's place is its alternative's index.
  build_term(static_cast<std::size_t>(&scheme_info(name) - attention_schemes().data()), b_, layer);
  build_sinks(layer);
}

}  // namespace

int64_t attention_seq_len(int64_t batch, int64_t seq_q, int64_t seq_k,
                          const Positions* query_positions, const Positions* key_positions) {
  const int64_t max_q = query_positions ? query_positions->max_position(batch, seq_q) : seq_k - 1;
  const int64_t max_k = key_positions ? key_positions->max_position(batch, seq_k) : seq_k - 1;
  return std::max<int64_t>({max_q, max_k, 0}) + 1;
}

std::vector<std::string> scheme_param_names(const std::string& name) {
  std::vector<std::string> names = scheme_required_params(name);
  for (const SchemeParamInfo& p : scheme_info(name).params) {
    if (!p.required) names.push_back(p.name);
  }
  for (const SchemeParamInfo& p : common_scheme_params()) names.push_back(p.name);
  return names;
}

std::vector<std::string> scheme_required_params(const std::string& name) {
  std::vector<std::string> names;
  for (const SchemeParamInfo& p : scheme_info(name).params) {
    if (p.required) names.push_back(p.name);
  }
  return names;
}

std::string model_attention_scheme(const ModelConfig& model, const std::string& config_name) {
  if (model.scheme != ModelScheme::kLearned) return model_scheme_name(model.scheme);
  fail(config_name + ": model_type '" + model.model_type +
       "' uses learned absolute positions, which are added to the input, not applied in "
       "attention (see add_learned)");
}

BuiltScheme build_scheme(const SchemeSettings& settings, const ParamMap& params,
                         const ModelConfig* model, const SchemeDims& dims,
                         SchemePrecision precision) {
  BuiltScheme out;
  detail::SchemeBuild b(settings, params, model, dims, precision, out);
  Builder(b).build();
  return out;
}

template <class T>
void bind_param_grad(AttentionGradsOf<T>& g, const LearnedParam& p, T* data) {
  auto view = [&](auto& field) {
    using V = std::remove_reference_t<decltype(field)>;
    V v{};
    if (p.grad_shape.size() != v.shape.size()) {
      fail<ShapeError>("bind_param_grad: d" + p.name + ": rank " +
                       std::to_string(p.grad_shape.size()) + ", expected " +
                       std::to_string(v.shape.size()));
    }
    std::copy(p.grad_shape.begin(), p.grad_shape.end(), v.shape.begin());
    field = V::contiguous(data, v.shape);
  };
  if (p.name == "sinks") {
    view(g.dsinks);
    return;
  }
  // The scheme terms' tables (SchemeTerm: each term's grad_fields).
  bool found = false;
  auto visit = [&](auto type_tag) {
    using Term = typename decltype(type_tag)::type;
    std::apply(
        [&](auto... field) {
          ((found = found || (p.name == field.first && (view(*field.second), true))), ...);
        },
        Term::grad_fields(g));
  };
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (visit(std::type_identity<std::variant_alternative_t<I, attn::SchemeTerm<T>>>{}), ...);
  }
  (std::make_index_sequence<std::variant_size_v<attn::SchemeTerm<T>>>{});
  if (!found) fail("bind_param_grad: unknown parameter '" + p.name + "'");
}

template <class T>
std::vector<T> grad_to_given_shape(const LearnedParam& p, const std::vector<T>& grad) {
  if (!p.summed_over_heads) return grad;
  const auto rows = static_cast<std::size_t>(p.grad_shape[0]);
  const auto heads = static_cast<std::size_t>(p.grad_shape[1]);
  const auto dim = static_cast<std::size_t>(p.grad_shape[2]);
  std::vector<T> out(rows * dim);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t c = 0; c < dim; ++c) {
      double sum = 0;
      for (std::size_t h = 0; h < heads; ++h) {
        sum += static_cast<double>(grad[(r * heads + h) * dim + c]);
      }
      out[r * dim + c] = static_cast<T>(sum);
    }
  }
  return out;
}

template void bind_param_grad<float>(AttentionGradsOf<float>&, const LearnedParam&, float*);
template void bind_param_grad<double>(AttentionGradsOf<double>&, const LearnedParam&, double*);
template std::vector<float> grad_to_given_shape<float>(const LearnedParam&,
                                                       const std::vector<float>&);
template std::vector<double> grad_to_given_shape<double>(const LearnedParam&,
                                                         const std::vector<double>&);

}  // namespace posenc
