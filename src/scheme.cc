// src/scheme.cc - a PositionScheme from settings, a model config and named parameter tensors
// (posenc/scheme.h). Validation of the tables themselves (shapes against the heads and head_dim,
// finiteness) stays with attention(), which names the table; this file checks what only it
// knows: which tensors the scheme reads, their ranks, and agreement with the model config.
#include "posenc/scheme.h"

#include <algorithm>
#include <array>
#include <utility>

#include "common.h"
#include "posenc/schemes.h"

namespace posenc {

namespace {

using detail::fail;

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

// Visits every element of a strided tensor in row-major order: f(n, offset).
template <class F>
void for_each_offset(const std::vector<int64_t>& shape, const std::vector<int64_t>& stride, F f) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::vector<int64_t> idx(shape.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = 0;
    for (std::size_t d = 0; d < shape.size(); ++d) off += idx[d] * stride[d];
    f(i, off);
    for (std::size_t d = shape.size(); d-- > 0;) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

class Builder {
 public:
  Builder(const SchemeSettings& s, const ParamMap& params, const ModelConfig* model,
          const SchemeDims& dims, SchemePrecision precision, BuiltScheme& out)
      : s_(s),
        params_(params),
        model_(model),
        dims_(dims),
        f64_(precision == SchemePrecision::kFloat64),
        out_(out) {}

  void build();

 private:
  std::string pname(const std::string& name) const { return s_.params_name + ": " + name; }

  // The parameter `name` checked for rank (one of `ranks`); nullptr when absent and optional.
  const ParamTensor* get(const std::string& name, const std::vector<std::size_t>& ranks,
                         const std::string& layout, bool required) {
    const auto it = params_.find(name);
    if (it == params_.end()) {
      if (!required) return nullptr;
      fail("scheme " + out_.name + " needs parameter '" + name + "' " + layout + " in " +
           s_.params_name);
    }
    const ParamTensor& t = it->second;
    if ((t.f32 == nullptr) == (t.f64 == nullptr)) {
      fail(pname(name) + ": exactly one of float32 and float64 data must be given");
    }
    if (std::find(ranks.begin(), ranks.end(), t.shape.size()) == ranks.end()) {
      fail<ShapeError>(pname(name) + " has shape " + shape_string(t.shape) + ", expected " +
                       layout);
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

  static std::vector<int64_t> strides(const ParamTensor& t) {
    if (!t.stride.empty()) return t.stride;
    std::vector<int64_t> st(t.shape.size());
    int64_t s = 1;
    for (std::size_t d = t.shape.size(); d-- > 0;) {
      st[d] = s;
      s *= t.shape[d];
    }
    return st;
  }

  // The tensor as a rank-R view of scalar T: its own data when the dtype is T, else a row-major
  // converted copy owned by the BuiltScheme.
  template <class T, std::size_t R>
  View<const T, R> view(const ParamTensor& t) {
    std::array<int64_t, R> shape{};
    std::copy(t.shape.begin(), t.shape.end(), shape.begin());
    const std::vector<int64_t> st = strides(t);
    const T* own = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      own = t.f32;
    } else {
      own = t.f64;
    }
    if (own != nullptr) {
      View<const T, R> v{own, shape, {}};
      std::copy(st.begin(), st.end(), v.stride.begin());
      return v;
    }
    std::vector<T>* buf = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      buf = &out_.storage32.emplace_back();
    } else {
      buf = &out_.storage64.emplace_back();
    }
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    buf->resize(static_cast<std::size_t>(n));
    for_each_offset(t.shape, st, [&](int64_t i, int64_t off) {
      (*buf)[static_cast<std::size_t>(i)] =
          t.f32 ? static_cast<T>(t.f32[off]) : static_cast<T>(t.f64[off]);
    });
    return View<const T, R>::contiguous(buf->data(), shape);
  }

  // Values as double (ALiBi slopes).
  std::vector<double> values(const ParamTensor& t) {
    std::vector<double> v;
    for_each_offset(t.shape, strides(t), [&](int64_t, int64_t off) {
      v.push_back(t.f32 ? static_cast<double>(t.f32[off]) : t.f64[off]);
    });
    return v;
  }

  void learned(const std::string& name, const ParamTensor& t, std::vector<int64_t> grad_shape,
               bool summed = false) {
    out_.learned.push_back({name, t.shape, std::move(grad_shape), summed});
  }

  void conflict(bool given, const std::string& setting) const {
    if (given) {
      fail(setting + " conflicts with " + s_.config_name + " (model_type '" + model_->model_type +
           "'): the model's value is used");
    }
  }

  void check_model_dims() const;
  const ModelLayer* resolve_layer();
  void build_sinks(const ModelLayer* layer);
  void build_rope(const ModelLayer* layer);
  void build_alibi();
  void build_t5();
  void build_shaw();
  void build_xl();
  void build_deberta();

  const SchemeSettings& s_;
  const ParamMap& params_;
  const ModelConfig* model_;
  const SchemeDims& dims_;
  bool f64_;
  BuiltScheme& out_;
};

void Builder::check_model_dims() const {
  const ModelConfig& m = *model_;
  const std::string who = s_.config_name + " (model_type '" + m.model_type + "')";
  if (m.head_dim > 0 && dims_.head_dim != m.head_dim) {
    fail<ShapeError>(s_.q_name + ": head_dim " + std::to_string(dims_.head_dim) +
                     " does not match " + who + ": head_dim " + std::to_string(m.head_dim));
  }
  if (m.heads_q > 0 && dims_.heads_q != m.heads_q) {
    fail<ShapeError>(s_.q_name + ": heads_q " + std::to_string(dims_.heads_q) + " does not match " +
                     who + ": " + std::to_string(m.heads_q) + " attention heads");
  }
  if (m.heads_kv > 0 && dims_.heads_kv != m.heads_kv) {
    fail<ShapeError>(s_.k_name + ": heads_kv " + std::to_string(dims_.heads_kv) +
                     " does not match " + who + ": " + std::to_string(m.heads_kv) +
                     " key/value heads");
  }
  if (m.scheme == ModelScheme::kAlibi && dims_.heads_q != m.alibi.heads) {
    fail<ShapeError>(s_.q_name + ": heads_q " + std::to_string(dims_.heads_q) + " does not match " +
                     who + ": " + std::to_string(m.alibi.heads) + " ALiBi heads");
  }
}

// The model layer SchemeSettings::layer names (nullptr without one); fills the layer's window,
// chunk, scale and query temperature into the BuiltScheme. A model whose layers differ needs one.
const ModelLayer* Builder::resolve_layer() {
  if (!model_) {
    if (s_.layer) fail("layer " + std::to_string(*s_.layer) + " needs a model config");
    return nullptr;
  }
  if (!s_.layer) {
    if (model_->layers_differ()) {
      fail(s_.config_name + ": the layers of model_type '" + model_->model_type +
           "' differ in position handling (see posenc describe); choose a layer");
    }
    return nullptr;
  }
  const ModelLayer& l = model_layer(*model_, *s_.layer);
  out_.window = l.sliding_window;
  out_.chunk = l.attention_chunk;
  if (l.softmax_scale > 0) out_.scale = l.softmax_scale;
  if (!l.rope) out_.query_temperature = l.temperature;
  return &l;
}

// The optional `sinks` [heads_q] parameter: attention sinks for any scheme; required by a model
// layer that has them (gpt-oss).
void Builder::build_sinks(const ModelLayer* layer) {
  const bool required = layer != nullptr && layer->attention_sinks;
  const auto it = params_.find("sinks");
  if (it == params_.end()) {
    if (required) {
      fail("layer " + std::to_string(layer->index) + " of " + s_.config_name + " (model_type '" +
           model_->model_type + "') has attention sinks: it needs parameter 'sinks' [heads_q] in " +
           s_.params_name);
    }
    return;
  }
  const ParamTensor* t = get("sinks", {1}, "[heads_q]", true);
  if (t->shape[0] != dims_.heads_q) {
    fail<ShapeError>(pname("sinks") + " has shape " + shape_string(t->shape) + ", expected [" +
                     std::to_string(dims_.heads_q) + "] (heads_q)");
  }
  if (f64_) {
    out_.tables64.sinks = view<double, 1>(*t);
  } else {
    out_.sinks = view<float, 1>(*t);
  }
  learned("sinks", *t, t->shape);
}

void Builder::build_rope(const ModelLayer* layer) {
  if (layer != nullptr && !layer->rope) {  // a NoPE layer (Llama 4)
    if (s_.freqs)
      fail("freqs conflicts with a NoPE layer (layer " + std::to_string(layer->index) + ")");
    out_.scheme = NoPositions{};
    out_.name = "none";
    return;
  }
  if (s_.freqs) {
    if (model_) conflict(s_.style.has_value(), "style");
    out_.scheme = Rope{*s_.freqs, layer    ? layer->rope_config.style
                                  : model_ ? model_->rope.style
                                           : s_.style.value_or(RopeStyle::kHalf)};
    return;
  }
  if (model_) {
    conflict(s_.base.has_value(), "base");
    conflict(s_.rotary_dim.has_value(), "rotary_dim");
    conflict(s_.style.has_value(), "style");
    // DeepSeek's decoupled RoPE: heads [qk_nope | qk_rope] rotate from rope_offset on; q and k
    // may also be the rotary parts alone. Pairs rotate as the model's code pairs them (its
    // de-interleaved output layout permutes q and k alike and leaves every score unchanged).
    int64_t offset = 0;
    if (model_->rope_offset > 0) {
      const int64_t full = model_->rope_offset + model_->rope.head_dim;
      if (dims_.head_dim == full) {
        offset = model_->rope_offset;
        if (!layer && !model_->layers.empty() && model_->layers[0].softmax_scale > 0) {
          out_.scale = model_->layers[0].softmax_scale;  // 1 / sqrt(qk_head_dim) x mscale^2
        }
      } else if (dims_.head_dim != model_->rope.head_dim) {
        fail<ShapeError>(s_.q_name + ": head_dim " + std::to_string(dims_.head_dim) + " fits " +
                         s_.config_name + " (model_type '" + model_->model_type +
                         "') neither as full heads (qk_nope_head_dim + qk_rope_head_dim = " +
                         std::to_string(full) + ") nor as their rotary parts (" +
                         std::to_string(model_->rope.head_dim) + ")");
      }
    }
    if (layer != nullptr) {
      out_.scheme = Rope{layer_rope_frequencies(*model_, layer->index, dims_.seq_len, s_.angles),
                         layer->rope_config.style, offset};
      return;
    }
    // M-RoPE configs: text positions (t = h = w) make M-RoPE plain RoPE with these frequencies.
    out_.scheme =
        Rope{model_rope_frequencies(*model_, dims_.seq_len, s_.angles), model_->rope.style, offset};
    return;
  }
  RopeConfig cfg;
  cfg.head_dim = dims_.head_dim;
  cfg.rotary_dim = s_.rotary_dim.value_or(0);
  cfg.base = s_.base.value_or(1e4);
  cfg.style = s_.style.value_or(RopeStyle::kHalf);
  validate(cfg);
  out_.scheme = Rope{rope_frequencies(cfg, dims_.seq_len, s_.angles), cfg.style};
}

void Builder::build_alibi() {
  Alibi alibi;
  const ParamTensor* slopes = get("slopes", {1}, "[heads]", false);
  if (model_) {
    conflict(s_.max_bias.has_value(), "max_bias");
    if (slopes) {
      fail(pname("slopes") + " conflicts with " + s_.config_name +
           " (the config's slopes are used)");
    }
    alibi.max_bias = model_->alibi.max_bias;
    alibi.slopes = alibi_slopes(model_->alibi);
  } else {
    alibi.max_bias = s_.max_bias.value_or(8.0);
    if (slopes) {
      alibi.slopes = values(*slopes);  // the attention call checks the count against heads_q
      learned("slopes", *slopes, {dims_.heads_q});
    }
  }
  out_.scheme = std::move(alibi);
}

void Builder::build_t5() {
  const ParamTensor* t = get("relative_attention_bias", {2}, "[num_buckets, heads]", true);
  T5Bias bias;
  bias.bidirectional = s_.bidirectional;
  if (model_) {
    conflict(s_.num_buckets.has_value(), "num_buckets");
    conflict(s_.max_distance.has_value(), "max_distance");
    if (model_->t5.num_buckets != t->shape[0]) {
      fail<ShapeError>(pname("relative_attention_bias") + " has " + std::to_string(t->shape[0]) +
                       " buckets, but " + s_.config_name + " says relative_attention_num_buckets " +
                       std::to_string(model_->t5.num_buckets));
    }
    bias.max_distance = model_->t5.max_distance;
    out_.scale = 1.0;  // T5 does not scale its scores
  } else {
    if (s_.num_buckets && *s_.num_buckets != t->shape[0]) {
      fail<ShapeError>("num_buckets " + std::to_string(*s_.num_buckets) + " does not match " +
                       pname("relative_attention_bias") + " with " + std::to_string(t->shape[0]) +
                       " buckets");
    }
    bias.max_distance = s_.max_distance.value_or(128);
  }
  if (f64_) {
    bias.table = View<const float, 2>{nullptr, {t->shape[0], t->shape[1]}, {}};
    out_.tables64.relative_attention_bias = view<double, 2>(*t);
  } else {
    bias.table = view<float, 2>(*t);
  }
  learned("relative_attention_bias", *t, t->shape);
  out_.scheme = bias;
}

void Builder::build_shaw() {
  const std::string layout = "[2K+1, head_dim] or [2K+1, heads, head_dim]";
  const ParamTensor* rk = get("rel_k", {2, 3}, layout, true);
  const ParamTensor* rv = get("rel_v", {2, 3}, layout, false);
  // [2K+1, D] is a table shared by the heads: [2K+1, 1, D] with a zero head stride.
  auto as3 = [&](const ParamTensor& t, auto tag) {
    using T = decltype(tag);
    if (t.shape.size() == 3) return view<T, 3>(t);
    const View<const T, 2> v2 = view<T, 2>(t);
    return View<const T, 3>{
        v2.data, {v2.shape[0], 1, v2.shape[1]}, {v2.stride[0], 0, v2.stride[1]}};
  };
  auto heads = [](const ParamTensor& t) { return t.shape.size() == 3 ? t.shape[1] : int64_t{1}; };
  // One shared table with one per-head table: the shared one is broadcast over the heads (the
  // library wants both with the same number of table heads).
  const bool mixed = rv && heads(*rk) != heads(*rv);
  const int64_t th = rv ? std::max(heads(*rk), heads(*rv)) : heads(*rk);
  auto grad_shape = [&](const ParamTensor& t) {
    return std::vector<int64_t>{t.shape[0], mixed ? th : heads(t), t.shape.back()};
  };
  auto broadcast = [&](auto v) {
    if (mixed && v.shape[1] == 1) {
      v.shape[1] = th;
      v.stride[1] = 0;
    }
    return v;
  };
  Shaw shaw;
  if (f64_) {
    out_.tables64.rel_k = broadcast(as3(*rk, double{}));
    if (rv) out_.tables64.rel_v = broadcast(as3(*rv, double{}));
    shaw.rel_k = View<const float, 3>{nullptr, out_.tables64.rel_k.shape, {}};
  } else {
    shaw.rel_k = broadcast(as3(*rk, float{}));
    if (rv) shaw.rel_v = broadcast(as3(*rv, float{}));
  }
  learned("rel_k", *rk, grad_shape(*rk), mixed && heads(*rk) == 1);
  if (rv) learned("rel_v", *rv, grad_shape(*rv), mixed && heads(*rv) == 1);
  out_.scheme = shaw;
}

void Builder::build_xl() {
  const ParamTensor* u = get("r_w_bias", {2}, "[heads, head_dim]", true);
  const ParamTensor* v = get("r_r_bias", {2}, "[heads, head_dim]", true);
  const ParamTensor* r = get("r_net", {2}, "[heads * head_dim, d_model]", true);
  TransformerXL xl;
  xl.base = s_.base.value_or(1e4);
  if (f64_) {
    out_.tables64.r_w_bias = view<double, 2>(*u);
    out_.tables64.r_r_bias = view<double, 2>(*v);
    out_.tables64.r_net = view<double, 2>(*r);
  } else {
    xl.r_w_bias = view<float, 2>(*u);
    xl.r_r_bias = view<float, 2>(*v);
    xl.r_net = view<float, 2>(*r);
  }
  learned("r_w_bias", *u, u->shape);
  learned("r_r_bias", *v, v->shape);
  learned("r_net", *r, r->shape);
  out_.scheme = xl;
}

void Builder::build_deberta() {
  DebertaBuckets buckets;
  if (model_) {
    conflict(s_.position_buckets.has_value(), "position_buckets");
    conflict(s_.max_relative_positions.has_value(), "max_relative_positions");
    buckets = model_->deberta;
    const auto& types = model_->pos_att_type;
    const bool c2p = std::find(types.begin(), types.end(), "c2p") != types.end();
    const bool p2c = std::find(types.begin(), types.end(), "p2c") != types.end();
    if (!c2p || !p2c) {
      fail(s_.config_name + ": pos_att_type '" + join(types, "|") +
           "' lacks c2p or p2c; posenc's DeBERTa scheme computes both");
    }
  } else {
    buckets.position_buckets = s_.position_buckets.value_or(buckets.position_buckets);
    buckets.max_relative_positions =
        s_.max_relative_positions.value_or(buckets.max_relative_positions);
  }
  buckets.p2c = s_.deberta_p2c.value_or(buckets.p2c);
  buckets.float64_log = s_.deberta_float64_log.value_or(buckets.float64_log);
  validate(buckets);
  const ParamTensor* pk = get("pos_key", {3}, "[2K, heads, head_dim]", true);
  const ParamTensor* pq = get("pos_query", {3}, "[2K, heads, head_dim]", true);
  const int64_t k = buckets.span();
  const std::string setting =
      buckets.position_buckets > 0 ? "position_buckets " : "max_relative_positions ";
  const std::string origin =
      (model_ ? s_.config_name + ": " : std::string()) + setting + std::to_string(k);
  for (const auto& [name, t] : {std::pair{"pos_key", pk}, std::pair{"pos_query", pq}}) {
    if (t->shape[0] != 2 * k) {
      fail<ShapeError>(pname(name) + " has " + std::to_string(t->shape[0]) +
                       " rows, expected 2K = " + std::to_string(2 * k) + " (K = " + origin + ")");
    }
  }
  DeBERTa db;
  db.buckets = buckets;
  if (f64_) {
    out_.tables64.pos_key = view<double, 3>(*pk);
    out_.tables64.pos_query = view<double, 3>(*pq);
  } else {
    db.pos_key = view<float, 3>(*pk);
    db.pos_query = view<float, 3>(*pq);
  }
  learned("pos_key", *pk, pk->shape);
  learned("pos_query", *pq, pq->shape);
  out_.scheme = db;
}

void Builder::build() {
  if (dims_.seq_len < 0) fail("build_scheme: seq_len must be >= 0");
  std::string name = s_.scheme;
  if (model_) {
    const std::string implied = model_attention_scheme(*model_, s_.config_name);
    if (!name.empty() && name != implied) {
      fail("scheme " + name + " conflicts with " + s_.config_name + " (model_type '" +
           model_->model_type + "' uses " + implied + ")");
    }
    name = implied;
    check_model_dims();
  } else if (name.empty()) {
    fail("build_scheme: a scheme name is required without a model config");
  }
  const std::vector<std::string> known = scheme_param_names(name);  // throws on unknown names
  for (const auto& [pn, t] : params_) {
    if (std::find(known.begin(), known.end(), pn) == known.end()) {
      fail(pname(pn) + " is not a parameter of scheme " + name +
           (known.empty() ? std::string(" (it has none)")
                          : " (it reads " + join(known, ", ") + ")"));
    }
  }
  out_.name = name;
  const ModelLayer* layer = resolve_layer();
  if (name == "none") {
    out_.scheme = NoPositions{};
  } else if (name == "rope") {
    build_rope(layer);
  } else if (name == "alibi") {
    build_alibi();
  } else if (name == "t5") {
    build_t5();
  } else if (name == "shaw") {
    build_shaw();
  } else if (name == "xl") {
    build_xl();
  } else {
    build_deberta();
  }
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
  Builder(settings, params, model, dims, precision, out).build();
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
  if (p.name == "relative_attention_bias") {
    view(g.drelative_attention_bias);
  } else if (p.name == "slopes") {
    view(g.dslopes);
  } else if (p.name == "rel_k") {
    view(g.drel_k);
  } else if (p.name == "rel_v") {
    view(g.drel_v);
  } else if (p.name == "r_w_bias") {
    view(g.dr_w_bias);
  } else if (p.name == "r_r_bias") {
    view(g.dr_r_bias);
  } else if (p.name == "r_net") {
    view(g.dr_net);
  } else if (p.name == "pos_key") {
    view(g.dpos_key);
  } else if (p.name == "pos_query") {
    view(g.dpos_query);
  } else if (p.name == "sinks") {
    view(g.dsinks);
  } else {
    fail("bind_param_grad: unknown parameter '" + p.name + "'");
  }
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
