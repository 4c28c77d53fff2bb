// python/src/bind_attention.cc - attention, its gradients and the float64 reference, for every
// scheme: keyword arguments -> posenc::SchemeSettings + named parameter arrays ->
// posenc::build_scheme (the library function the CLI uses too) -> posenc::attention /
// attention_backward (float32) or posenc::ref:: (float64, with float64 parameter tables). The
// parser (parse, calls.h) serves the half-precision bindings too (bind_half.cc).
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "args.h"
#include "calls.h"
#include "posenc/schemes.h"

namespace posenc::py {

namespace {

using pb::arg;

// Keyword arguments of the attention functions that belong to some schemes only (the registry's
// settings, posenc/schemes.h), each with the schemes it applies to.
const std::vector<SchemeSettingUse>& scheme_keywords() {
  static const std::vector<SchemeSettingUse> uses = scheme_settings();
  return uses;
}

bool applies(const SchemeSettingUse& k, const std::string& scheme) {
  return std::find(k.schemes.begin(), k.schemes.end(), scheme) != k.schemes.end();
}

std::string join_names(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : " ") + n;
  return s;
}

// A checked value into the settings; one the front end reads itself (seq_len) is only checked.
void store_setting(SchemeSettings& settings, const SchemeSettingInfo& info, SettingValue value,
                   const std::string& name) {
  if (info.store == nullptr) {
    check_setting(info, std::move(value), name);
  } else {
    set_scheme_setting(settings, info, std::move(value), name);
  }
}

bool is_setting_keyword(const std::string& name) {
  for (const SchemeSettingUse& k : scheme_keywords()) {
    if (k.setting.keyword == name) return true;
  }
  return false;
}

// The keyword `name` of scheme `scheme` converted by the registry's type (args.h's rules: a
// value of the wrong kind is a TypeError naming it) and checked by its range (ValueError) into
// `settings`. A keyword of another scheme is a TypeError naming the schemes it is for.
void set_setting(const std::string& fn, SchemeSettings& settings, const std::string& scheme,
                 const std::string& name, const pb::handle& value) {
  const SchemeSettingInfo* info = scheme_setting(scheme, name);
  if (info == nullptr) {
    for (const SchemeSettingUse& k : scheme_keywords()) {
      if (k.setting.keyword != name) continue;
      throw pb::type_error(fn + "(): keyword '" + name + "' does not apply to scheme '" + scheme +
                           "' (it is for " + join_names(k.schemes) + ")");
    }
    unexpected_keyword(fn, name);
  }
  switch (info->type) {
    case SettingType::kRopeFrequencies:
      if (!pb::isinstance<RopeFrequencies>(value)) {
        throw pb::type_error(name + ": expected a posenc.RopeFrequencies, got " + type_name(value));
      }
      settings.freqs = value.cast<RopeFrequencies>();
      return;
    case SettingType::kRopeScaling:
      settings.scaling = scaling_arg(value);
      return;
    case SettingType::kFloat:
      return store_setting(settings, *info, arg_float(value, name, /*finite=*/false), name);
    case SettingType::kInt:
      return store_setting(settings, *info, arg_int(value, name), name);
    case SettingType::kBool:
      return store_setting(settings, *info, arg_bool(value, name), name);
    case SettingType::kChoice:
      return store_setting(settings, *info, arg_str(value, name), name);
  }
}

void add_param(Call& c, const std::string& name, const pb::handle& value) {
  pb::array a;
  if (pb::isinstance<pb::array>(value)) a = pb::reinterpret_borrow<pb::array>(value);
  const bool f32_ok = a && viewable<float>(a);
  const bool f64_ok = a && viewable<double>(a);
  if (!f32_ok && !f64_ok) {
    a = c.f64 ? as_array<double>(value, ("params['" + name + "']").c_str())
              : as_array<float>(value, ("params['" + name + "']").c_str());
  }
  ParamTensor t;
  if (viewable<float>(a)) {
    t.f32 = static_cast<const float*>(a.data());
    for (pb::ssize_t d = 0; d < a.ndim(); ++d) t.stride.push_back(a.strides(d) / 4);
  } else {
    t.f64 = static_cast<const double*>(a.data());
    for (pb::ssize_t d = 0; d < a.ndim(); ++d) t.stride.push_back(a.strides(d) / 8);
  }
  t.shape.assign(a.shape(), a.shape() + a.ndim());
  c.keep.push_back(a);
  c.params[name] = std::move(t);
}

// Parameters from a dict of arrays (or torch tensors / anything NumPy converts), or from a
// .safetensors path (the tensors of the scheme only).
void parse_params(Call& c, const pb::handle& obj) {
  if (obj.is_none()) return;
  if (pb::isinstance<pb::dict>(obj)) {
    for (auto [k, v] : pb::reinterpret_borrow<pb::dict>(obj)) {
      if (!pb::isinstance<pb::str>(k)) throw pb::type_error("params: keys must be strings");
      add_param(c, k.cast<std::string>(), v);
    }
    return;
  }
  if (pb::isinstance<pb::str>(obj) || pb::hasattr(obj, "__fspath__")) {
    static const pb::object& fspath = py_attr("os", "fspath");
    const std::string path = fspath(obj).cast<std::string>();
    const SafetensorsFile file = read_safetensors(path);
    c.settings.params_name = path;
    const std::string scheme = c.settings.scheme.empty() && c.model
                                   ? model_attention_scheme(*c.model, c.settings.config_name)
                                   : c.settings.scheme;
    for (const std::string& name : scheme_param_names(scheme.empty() ? "none" : scheme)) {
      const auto it = file.tensors.find(name);
      if (it == file.tensors.end()) continue;
      const Tensor& t = it->second;
      std::vector<pb::ssize_t> shape(t.shape.begin(), t.shape.end());
      if (t.dtype == DType::kF64 || c.f64) {
        const auto v = t.to_f64(path + ": " + name);
        pb::array_t<double> a(shape);
        std::copy(v.begin(), v.end(), a.mutable_data());
        add_param(c, name, a);
      } else {
        const auto v = t.to_f32(path + ": " + name);
        pb::array_t<float> a(shape);
        std::copy(v.begin(), v.end(), a.mutable_data());
        add_param(c, name, a);
      }
    }
    return;
  }
  throw pb::type_error("params: a dict {name: array} or a .safetensors path");
}

// A dense mask as uint8 0 / 1: booleans as they are; integers and floats by "nonzero attends"
// (256 and 0.5 attend, NaN too), never by a cast that would wrap or truncate them.
pb::array dense_mask(const pb::handle& value) {
  static const pb::object& asarray = py_attr("numpy", "asarray");
  pb::array a;
  try {
    a = asarray(value);
  } catch (pb::error_already_set& e) {
    throw pb::type_error(
        std::string("mask: expected a boolean array [batch or 1, seq_q, seq_k] (") + e.what() +
        ")");
  }
  const char kind = a.dtype().kind();
  if (kind != 'b' && kind != 'i' && kind != 'u' && kind != 'f') {
    throw pb::type_error(
        "mask: expected a boolean (or integer / float, nonzero attends) array, "
        "got dtype " +
        pb::str(a.dtype()).cast<std::string>());
  }
  if (kind != 'b') a = a.attr("__ne__")(0);
  return pb::array_t<uint8_t, pb::array::c_style | pb::array::forcecast>::ensure(a);
}

}  // namespace

Call parse(const std::string& fn, const pb::handle& q, const pb::handle& k, const pb::handle& v,
           const pb::object& scheme, const pb::kwargs& kw, Inputs inputs,
           const std::set<std::string>& extra, const QkvNames& names) {
  Call c;
  c.f64 = inputs == Inputs::kFloat64 ||
          (inputs == Inputs::kAuto && pb::isinstance<pb::array>(q) &&
           pb::reinterpret_borrow<pb::array>(q).dtype().is(pb::dtype::of<double>()));
  const bool varlen = (kw.contains("cu_seqlens_q") && !kw["cu_seqlens_q"].is_none()) ||
                      (kw.contains("cu_seqlens_k") && !kw["cu_seqlens_k"].is_none());
  if (inputs == Inputs::kBf16 || inputs == Inputs::kF16) {
    half_inputs(c, inputs, q, k, v, names);
  } else if (c.f64) {
    c.q = as_array<double>(q, names[0]);
    c.k = as_array<double>(k, names[1]);
    c.v = as_array<double>(v, names[2]);
  } else {
    c.q = as_array<float>(q, names[0]);
    c.k = as_array<float>(k, names[1]);
    c.v = as_array<float>(v, names[2]);
  }
  for (const auto& [a, what] :
       {std::pair{&c.q, names[0]}, std::pair{&c.k, names[1]}, std::pair{&c.v, names[2]}}) {
    if (varlen) {
      if (a->ndim() != 3) {
        throw ShapeError(
            std::string(what) + ": with cu_seqlens expected 3 dimensions " +
            (what[0] == 'q' ? "[total_q, heads_q, head_dim]" : "[total_k, heads_kv, head_dim]") +
            ", got " + std::to_string(a->ndim()));
      }
      *a = pb::reinterpret_borrow<pb::array>(
          a->attr("reshape")(pb::make_tuple(1, a->shape(0), a->shape(1), a->shape(2))));
      continue;
    }
    if (a->ndim() != 4) {
      throw ShapeError(std::string(what) + ": expected 4 dimensions " +
                       (what[0] == 'q' ? "[batch, seq_q, heads_q, head_dim]"
                                       : "[batch, seq_k, heads_kv, head_dim]") +
                       ", got " + std::to_string(a->ndim()));
    }
  }
  for (int d = 0; d < 4; ++d) {
    c.qshape[d] = c.q.shape(d);
    c.kshape[d] = c.k.shape(d);
    c.vshape[d] = c.v.shape(d);
  }
  if (!scheme.is_none()) c.settings.scheme = arg_str(scheme, "scheme");
  pb::object params = pb::none();
  pb::object cu_q = pb::none(), cu_k = pb::none();
  std::vector<std::pair<std::string, pb::object>> settings;  // the schemes' keywords
  for (auto [key, value] : kw) {
    const std::string name = key.cast<std::string>();
    if (extra.count(name)) {
      if (name == "out") c.out = pb::reinterpret_borrow<pb::object>(value);
      if (name == "lse") c.lse = pb::reinterpret_borrow<pb::object>(value);
      if (name == "return_lse") c.return_lse = arg_bool(value, name);
      continue;
    }
    if (value.is_none()) continue;  // None = not given
    if (name == "causal") {
      c.opt.causal = arg_bool(value, name);
    } else if (name == "scale") {
      c.opt.scale = arg_float(value, name);
    } else if (name == "window") {
      c.opt.window = arg_int(value, name, 1, kMaxPositionArg);
    } else if (name == "chunk") {
      c.opt.chunk = arg_int(value, name, 1, kMaxPositionArg);
    } else if (name == "softcap") {
      c.opt.softcap = arg_float(value, name, /*finite=*/true, /*positive=*/true);
    } else if (name == "cu_seqlens_q") {
      cu_q = pb::reinterpret_borrow<pb::object>(value);
    } else if (name == "cu_seqlens_k") {
      cu_k = pb::reinterpret_borrow<pb::object>(value);
    } else if (name == "query_documents" || name == "key_documents") {
      const auto a = int_array<int32_t>(value, name);
      c.mask_arrays.push_back(a);
      auto& view =
          name[0] == 'q' ? c.opt.block_mask.query_documents : c.opt.block_mask.key_documents;
      view = view_of<const int32_t, 2>(a, name.c_str(),
                                       name[0] == 'q' ? "[batch, seq_q]" : "[batch, seq_k]");
    } else if (name == "prefix") {
      const auto a = int_array<int64_t>(value, name);
      c.mask_arrays.push_back(a);
      c.opt.block_mask.prefix =
          view_of<const int64_t, 1>(a, "prefix", "[batch] or [num_documents]");
    } else if (name == "global_positions") {
      const auto a = int_array<int64_t>(value, name);
      if (a.ndim() != 1) throw ShapeError("global_positions: a list of positions (1 dimension)");
      const int64_t* p = static_cast<const int64_t*>(a.data());
      c.opt.block_mask.global_positions.assign(p, p + a.shape(0));
    } else if (name == "mask") {
      const pb::array a = dense_mask(value);
      c.mask_arrays.push_back(a);
      c.opt.block_mask.dense = view_of<const uint8_t, 3>(a, "mask", "[batch or 1, seq_q, seq_k]");
    } else if (name == "layer") {
      c.settings.layer = arg_int(value, name, 0, std::numeric_limits<int32_t>::max());
    } else if (name == "allow_fully_masked") {
      c.opt.allow_fully_masked = arg_bool(value, name);
    } else if (name == "num_threads") {
      c.opt.num_threads = static_cast<int>(arg_int(value, name, 0, kMaxThreads));
    } else if (name == "query_positions") {
      c.qp = positions_arg(value, "query_positions");
    } else if (name == "key_positions") {
      c.kp = positions_arg(value, "key_positions");
    } else if (name == "params") {
      params = pb::reinterpret_borrow<pb::object>(value);
    } else if (name == "config") {
      c.model = model_config_arg(value);
      // Messages name the config by its path (a ModelConfig: the path it was read from).
      c.settings.config_name = c.model->source.empty() ? std::string("config") : c.model->source;
    } else if (is_setting_keyword(name)) {
      settings.emplace_back(name, pb::reinterpret_borrow<pb::object>(value));
    } else {
      unexpected_keyword(fn, name);
    }
  }
  // Scheme-specific keywords must fit the scheme (a typo or a wrong scheme is an error); their
  // values are checked by the registry's type and range (set_setting).
  const std::string s = !c.settings.scheme.empty() ? c.settings.scheme
                        : c.model ? model_attention_scheme(*c.model, c.settings.config_name)
                                  : std::string("none");
  if (c.settings.scheme.empty() && !c.model) c.settings.scheme = "none";
  for (const auto& [name, value] : settings) set_setting(fn, c.settings, s, name, value);
  parse_params(c, params);
  if (varlen) {
    if (cu_q.is_none() || cu_k.is_none()) {
      throw ValueError(std::string(cu_q.is_none() ? "cu_seqlens_q" : "cu_seqlens_k") +
                       " is missing: packed sequences need cu_seqlens_q and cu_seqlens_k");
    }
    auto cu = [](const pb::object& x, const char* what) {
      const auto a = int_array<int64_t>(x, what);
      if (a.ndim() != 1) {
        throw ShapeError(std::string(what) + ": expected 1 dimension [num_seqs + 1], got " +
                         std::to_string(a.ndim()));
      }
      const int64_t* p = static_cast<const int64_t*>(a.data());
      return std::vector<int64_t>(p, p + a.shape(0));
    };
    c.packed = pack_sequences(cu(cu_q, "cu_seqlens_q"), cu(cu_k, "cu_seqlens_k"), c.qshape[1],
                              c.kshape[1], c.pq(), c.pk());
    c.opt = c.packed->options(c.opt);
    c.qp = c.packed->query_positions;
    c.kp = c.packed->key_positions;
  }
  // Length for length-dependent RoPE scaling: seq_len=, else the largest position + 1.
  int64_t seq_len = 0;
  if (kw.contains("seq_len") && !kw["seq_len"].is_none()) {
    seq_len = arg_int(kw["seq_len"], "seq_len", 0, kMaxPositionArg);
  } else {
    if (c.qp) c.qp->validate(c.qshape[0], c.qshape[1], "attention: query positions");
    if (c.kp) c.kp->validate(c.kshape[0], c.kshape[1], "attention: key positions");
    seq_len = attention_seq_len(c.qshape[0], c.qshape[1], c.kshape[1], c.pq(), c.pk());
  }
  c.built = build_scheme(c.settings, c.params, c.model ? &*c.model : nullptr,
                         SchemeDims{.heads_q = c.qshape[2],
                                    .heads_kv = c.kshape[2],
                                    .head_dim = c.qshape[3],
                                    .seq_len = seq_len},
                         c.f64 ? SchemePrecision::kFloat64 : SchemePrecision::kFloat32);
  // The model layer's scale, window, chunk, sinks and query temperature (Llama 4's NoPE layers),
  // where the keywords leave them unset.
  c.opt = c.built.options(c.opt);
  return c;
}

namespace {

// A rank-3 varlen array (dout, the forward's out or lse) as the 4-D call's ([1, ...]).
pb::object repack(const Call& c, const pb::object& x) {
  if (!c.packed || x.is_none()) return x;
  static const pb::object& expand_dims = py_attr("numpy", "expand_dims");
  return expand_dims(x, 0);
}

template <class T>
pb::object forward(Call& c) {
  if (c.packed && !c.out.is_none()) {
    throw pb::type_error("attention(): out= is not supported with cu_seqlens (the result is new)");
  }
  const std::array<int64_t, 3> lshape{c.qshape[0], c.qshape[2], c.qshape[1]};
  pb::object out = c.out.is_none() ? pb::object(new_array<T, 4>(c.oshape())) : c.out;
  const View<T, 4> ov = out_view<T, 4>(out, c.oshape(), "out");
  pb::object lse = pb::none();
  View<T, 3> lv{};
  if (c.return_lse) {
    lse = new_array<T, 3>(lshape);
    lv = out_view<T, 3>(lse, lshape, "lse");
  }
  const auto qv = view4<T>(c.q, "q", ""), kv = view4<T>(c.k, "k", ""), vv = view4<T>(c.v, "v", "");
  {
    pb::gil_scoped_release release;
    if constexpr (std::is_same_v<T, double>) {
      if (c.return_lse) {
        ref::attention(qv, kv, vv, c.built.scheme, c.opt, c.built.tables64, ov, lv, c.pq(), c.pk());
      } else {
        ref::attention(qv, kv, vv, c.built.scheme, c.opt, c.built.tables64, ov, c.pq(), c.pk());
      }
    } else {
      if (c.return_lse) {
        attention(qv, kv, vv, c.built.scheme, c.opt, ov, lv, c.pq(), c.pk());
      } else {
        attention(qv, kv, vv, c.built.scheme, c.opt, ov, c.pq(), c.pk());
      }
    }
  }
  if (c.return_lse) return pb::make_tuple(c.unpack(out), c.unpack(lse));
  return c.unpack(out);
}

template <class T>
pb::dict backward(Call& c, const pb::handle& dout_obj) {
  const std::array<int64_t, 3> lshape{c.qshape[0], c.qshape[2], c.qshape[1]};
  if (c.packed) {
    c.out = repack(c, c.out);
    c.lse = repack(c, c.lse);
  }
  pb::array dout = as_array<T>(repack(c, pb::reinterpret_borrow<pb::object>(dout_obj)), "dout");
  const auto dov = view4<T>(dout, "dout", "[batch, seq_q, heads_q, head_dim]");
  const auto qv = view4<T>(c.q, "q", ""), kv = view4<T>(c.k, "k", ""), vv = view4<T>(c.v, "v", "");
  // The forward's out and lse: given (as saved by a training framework), else computed here.
  pb::array out, lse;
  if (c.out.is_none() != c.lse.is_none()) {
    throw pb::type_error("attention_grad(): give both out= and lse= (the forward's) or neither");
  }
  if (c.out.is_none()) {
    out = new_array<T, 4>(c.oshape());
    lse = new_array<T, 3>(lshape);
    const View<T, 4> ov = out_view<T, 4>(out, c.oshape(), "out");
    const View<T, 3> lv = out_view<T, 3>(lse, lshape, "lse");
    pb::gil_scoped_release release;
    if constexpr (std::is_same_v<T, double>) {
      ref::attention(qv, kv, vv, c.built.scheme, c.opt, c.built.tables64, ov, lv, c.pq(), c.pk());
    } else {
      attention(qv, kv, vv, c.built.scheme, c.opt, ov, lv, c.pq(), c.pk());
    }
  } else {
    out = as_array<T>(c.out, "out");
    lse = as_array<T>(c.lse, "lse");
  }
  const auto ov = view4<T>(out, "out", "[batch, seq_q, heads_q, head_dim]");
  const auto lv = view_of<const T, 3>(lse, "lse", "[batch, heads_q, seq_q]");
  pb::array_t<T> dq = new_array<T, 4>(c.qshape), dk = new_array<T, 4>(c.kshape),
                 dv = new_array<T, 4>(c.vshape);
  AttentionGradsOf<T> g;
  g.dq = mutable_view<T, 4>(dq);
  g.dk = mutable_view<T, 4>(dk);
  g.dv = mutable_view<T, 4>(dv);
  std::vector<pb::array_t<T>> dparams;
  for (const LearnedParam& p : c.built.learned) {
    std::vector<pb::ssize_t> shape(p.grad_shape.begin(), p.grad_shape.end());
    dparams.emplace_back(shape);
    bind_param_grad(g, p, dparams.back().mutable_data());
  }
  {
    pb::gil_scoped_release release;
    if constexpr (std::is_same_v<T, double>) {
      ref::attention_backward(qv, kv, vv, ov, lv, dov, c.built.scheme, c.opt, c.built.tables64, g,
                              c.pq(), c.pk());
    } else {
      attention_backward(qv, kv, vv, ov, lv, dov, c.built.scheme, c.opt, g, c.pq(), c.pk());
    }
  }
  pb::dict result;
  result["dq"] = c.unpack(dq);
  result["dk"] = c.unpack(dk);
  result["dv"] = c.unpack(dv);
  for (std::size_t i = 0; i < dparams.size(); ++i) {
    const LearnedParam& p = c.built.learned[i];
    pb::object grad = dparams[i];
    if (p.summed_over_heads) {
      grad = dparams[i].attr("sum")(1);  // a shared table broadcast over the heads
    } else {
      grad = dparams[i].attr("reshape")(pb::cast(p.shape));
    }
    result[pb::str("d" + p.name)] = grad;
  }
  return result;
}

const char* kAttentionDoc =
    R"doc(attention(q, k, v, scheme=None, *, causal=False, scale=None, window=None, chunk=None,
          softcap=None, query_positions=None, key_positions=None, params=None, config=None, layer=None,
          allow_fully_masked=False, num_threads=0, return_lse=False, out=None,
          **scheme settings) -> out, or (out, lse) with return_lse=True

Scaled dot-product attention with a positional scheme (docs/attention.md): q [batch, seq_q,
heads_q, head_dim], k and v [batch, seq_k, heads_kv, head_dim] (heads_kv divides heads_q: MHA,
GQA, MQA).
float32 q runs the fused kernel (SIMD, threads, no [seq_q, seq_k] matrix); float64 q runs the
float64 reference with float64 parameters. k, v, dout and params are converted to q's dtype if
they differ; arrays of that dtype with non-negative strides are used without a copy.

scheme: 'none', 'rope', 'alibi', 't5', 'shaw', 'xl', 'deberta' (default: config's, else none).
params: {name: array} by parameter name, or a .safetensors path: t5 relative_attention_bias
[num_buckets, heads_q]; alibi slopes [heads_q] (optional); shaw rel_k, rel_v [2K+1, head_dim] or
[2K+1, heads_q, head_dim]; xl r_w_bias, r_r_bias [heads_q, head_dim], r_net [heads_q*head_dim,
d_model]; deberta pos_key, pos_query [2K, heads_q, head_dim]; any scheme: sinks [heads_q]
(attention sinks, gpt-oss: one logit per head added to every row's softmax denominator, no
value; lse includes it, and a row with no visible key gives out 0, lse = sink).
window: sliding window w (key visible iff |rel| < w); chunk: chunked local attention c (Llama 4:
key visible iff floor(pos_k / c) == floor(pos_q / c)), both on top of causal.
softcap: logit soft-capping C > 0 (Gemma 2): each score s, scale and positional bias included,
becomes C * tanh(s / C) before the mask and softmax (a Gemma 2 config layer sets it).
config: a model config.json path, dict or ModelConfig: scheme and settings from the model.
layer: with config, the decoder layer whose attention to use (required when the model's layers
differ): its RoPE (none on a Llama 4 NoPE layer, whose queries are then scaled by the attention
temperature), sliding window, chunk, softmax scale, and its sinks requirement (gpt-oss: params
must hold sinks). Explicit scale / window / chunk override the layer's.
Scheme settings: rope base=1e4, rotary_dim=0 (= head_dim), style='half'|'interleaved',
angles='accurate'|'float32', seq_len (default max position + 1), freqs=RopeFrequencies; alibi
max_bias=8; t5 num_buckets, max_distance=128, bidirectional (default: not causal); xl base=1e4;
deberta position_buckets=0, max_relative_positions=512, deberta_p2c='model'|'paper',
deberta_float64_log=False. A setting for another scheme raises TypeError.
Positions: None (the defaults: key j at j, query i at seq_k - seq_q + i), an int offset, or int
ids [seq] / [batch, seq]. lse [batch, heads_q, seq_q] is the per-row log-sum-exp.)doc";

const char* kGradDoc =
    R"doc(attention_grad(q, k, v, dout, scheme=None, *, out=None, lse=None, **attention's keywords)
    -> {'dq', 'dk', 'dv', 'd<name>' for each parameter in params (dsinks for sinks)}

Gradients of attention (the fused FlashAttention-2 backward for float32, the float64 reference
for float64). out and lse: the forward's (attention(..., return_lse=True)); without them the
forward runs first. Parameter gradients have the shape the parameter was given in.)doc";

}  // namespace

namespace {

pb::object optional_value(const std::optional<int64_t>& x) {
  return x ? pb::object(pb::int_(*x)) : pb::object(pb::none());
}
pb::object optional_value(const std::optional<double>& x) {
  return x ? pb::object(pb::float_(*x)) : pb::object(pb::none());
}

// What an attention call resolves to, for a backend that computes it outside posenc's kernels:
// the scheme (a model config's, checked against the inputs), the options with a config layer's
// scale, window, chunk, soft-cap and query temperature filled in, and the scheme's settings
// (RoPE's frequencies, style and offset; ALiBi's computed slopes; T5's max_distance and
// bidirectional; DeBERTa's buckets; XL's base).
pb::dict resolved(const Call& c) {
  pb::dict d;
  d["scheme"] = c.built.name;
  d["causal"] = c.opt.causal;
  d["scale"] = optional_value(c.opt.scale);
  d["window"] = optional_value(c.opt.window);
  d["chunk"] = optional_value(c.opt.chunk);
  d["softcap"] = optional_value(c.opt.softcap);
  d["query_temperature"] = c.opt.query_temperature
                               ? pb::object(pb::make_tuple(c.opt.query_temperature->floor_scale,
                                                           c.opt.query_temperature->attn_scale))
                               : pb::object(pb::none());
  pb::dict settings;
  if (const auto* r = std::get_if<Rope>(&c.built.scheme)) {
    settings["inv_freq"] = r->freqs.inv_freq;
    settings["attention_factor"] = r->freqs.attention_factor;
    settings["angles"] = r->freqs.angles == RopeAngles::kFloat32 ? "float32" : "accurate";
    settings["style"] = r->style == RopeStyle::kInterleaved ? "interleaved" : "half";
    settings["offset"] = r->offset;
  } else if (const auto* a = std::get_if<Alibi>(&c.built.scheme)) {
    settings["slopes"] = a->slopes;
    settings["max_bias"] = a->max_bias;
  } else if (const auto* t = std::get_if<T5Bias>(&c.built.scheme)) {
    settings["max_distance"] = t->max_distance;
    settings["bidirectional"] = t->bidirectional.value_or(!c.opt.causal);
  } else if (const auto* x = std::get_if<TransformerXL>(&c.built.scheme)) {
    settings["base"] = x->base;
  } else if (const auto* db = std::get_if<DeBERTa>(&c.built.scheme)) {
    settings["position_buckets"] = db->buckets.position_buckets;
    settings["max_relative_positions"] = db->buckets.max_relative_positions;
    settings["deberta_float64_log"] = db->buckets.float64_log;
    settings["deberta_p2c"] = db->buckets.p2c == DebertaP2c::kModel ? "model" : "paper";
  }
  d["settings"] = settings;
  return d;
}

}  // namespace

void bind_attention(pb::module_& m, pb::module_& ref) {
  m.def(
      "schemes",
      [] {
        pb::list out;
        for (const SchemeInfo& s : attention_schemes()) {
          pb::list params, settings;
          for (const SchemeParamInfo& p : s.params) {
            params.append(pb::dict(pb::arg("name") = p.name, pb::arg("layout") = p.layout,
                                   pb::arg("required") = p.required, pb::arg("learned") = p.learned,
                                   pb::arg("head_axis") = p.head_axis < 0
                                                              ? pb::object(pb::none())
                                                              : pb::object(pb::int_(p.head_axis)),
                                   pb::arg("help") = p.help));
          }
          for (const SchemeSettingInfo& t : s.settings) {
            auto bound = [](const std::optional<double>& x, SettingType type) -> pb::object {
              if (!x) return pb::none();
              if (type == SettingType::kInt) return pb::int_(static_cast<int64_t>(*x));
              return pb::float_(*x);
            };
            settings.append(pb::dict(
                pb::arg("keyword") = t.keyword, pb::arg("flag") = t.flag,
                pb::arg("type") = setting_type_name(t.type), pb::arg("min") = bound(t.min, t.type),
                pb::arg("max") = bound(t.max, t.type), pb::arg("min_exclusive") = t.min_exclusive,
                pb::arg("choices") = t.choices, pb::arg("default") = t.default_value,
                pb::arg("range") = setting_range_text(t), pb::arg("model_sets") = t.model_sets,
                pb::arg("help") = t.help));
          }
          out.append(pb::dict(pb::arg("name") = s.name, pb::arg("title") = s.title,
                              pb::arg("summary") = s.summary, pb::arg("models") = s.models,
                              pb::arg("doc") = s.doc, pb::arg("params") = params,
                              pb::arg("settings") = settings, pb::arg("relative") = s.relative,
                              pb::arg("bias_map") = s.bias_map));
        }
        return out;
      },
      "schemes() -> list of dict\n\nThe attention schemes, in order (none, rope, alibi, t5, "
      "shaw, xl, deberta): name, title, summary, models, doc (its documentation page), params "
      "(name, layout, required, learned, head_axis: the axis that indexes the heads, or None, "
      "help), settings (keyword, flag, type: float, int, bool, choice, rope_frequencies or "
      "rope_scaling, min, max, min_exclusive, choices, default, range in words, model_sets: a "
      "model config fixes it, help), relative and bias_map. posenc.SCHEMES holds the names.");
  const std::set<std::string> fwd_extra = {"out", "return_lse"};
  const std::set<std::string> grad_extra = {"out", "lse"};
  m.def(
      "_resolve_attention",
      [](const pb::object& q, const pb::object& k, const pb::object& v, const pb::object& scheme,
         const pb::kwargs& kw) {
        return resolved(parse("attention", q, k, v, scheme, kw, Inputs::kAuto, {}));
      },
      arg("q"), arg("k"), arg("v"), arg("scheme") = pb::none(),
      "_resolve_attention(q, k, v, scheme=None, **attention keywords) -> dict: what the call "
      "resolves to (scheme, causal, scale, window, chunk, softcap, query_temperature, and the "
      "scheme's settings), with posenc.attention's checks and errors; nothing is computed. q, k, "
      "v and the params' arrays are read for their shapes only (zero-stride views serve).");
  m.def(
      "attention",
      [fwd_extra](const pb::object& q, const pb::object& k, const pb::object& v,
                  const pb::object& scheme, const pb::kwargs& kw) {
        Call c = parse("attention", q, k, v, scheme, kw, Inputs::kAuto, fwd_extra);
        return c.f64 ? forward<double>(c) : forward<float>(c);
      },
      arg("q"), arg("k"), arg("v"), arg("scheme") = pb::none(), kAttentionDoc);
  m.def(
      "attention_grad",
      [grad_extra](const pb::object& q, const pb::object& k, const pb::object& v,
                   const pb::object& dout, const pb::object& scheme, const pb::kwargs& kw) {
        Call c = parse("attention_grad", q, k, v, scheme, kw, Inputs::kAuto, grad_extra);
        return c.f64 ? backward<double>(c, dout) : backward<float>(c, dout);
      },
      arg("q"), arg("k"), arg("v"), arg("dout"), arg("scheme") = pb::none(), kGradDoc);
  ref.def(
      "attention",
      [fwd_extra](const pb::object& q, const pb::object& k, const pb::object& v,
                  const pb::object& scheme, const pb::kwargs& kw) {
        Call c = parse("attention", q, k, v, scheme, kw, Inputs::kFloat64, fwd_extra);
        return forward<double>(c);
      },
      arg("q"), arg("k"), arg("v"), arg("scheme") = pb::none(),
      "ref.attention(q, k, v, scheme=None, **kwargs): attention in float64 (inputs and "
      "parameters converted to float64): posenc::ref::attention, materialized from the formulas of "
      "docs/attention.md.");
  ref.def(
      "attention_grad",
      [grad_extra](const pb::object& q, const pb::object& k, const pb::object& v,
                   const pb::object& dout, const pb::object& scheme, const pb::kwargs& kw) {
        Call c = parse("attention_grad", q, k, v, scheme, kw, Inputs::kFloat64, grad_extra);
        return backward<double>(c, dout);
      },
      arg("q"), arg("k"), arg("v"), arg("dout"), arg("scheme") = pb::none(),
      "ref.attention_grad(q, k, v, dout, scheme=None, **kwargs): attention_grad in float64.");
  ref.def(
      "attention_scores",
      [](const pb::object& q, const pb::object& k, const pb::object& scheme, int64_t batch_index,
         int64_t head, const pb::kwargs& kw) {
        Call c = parse("attention_scores", q, k, k, scheme, kw, Inputs::kFloat64, {});
        std::vector<double> s;
        {
          const auto qv = view4<double>(c.q, "q", ""), kv = view4<double>(c.k, "k", "");
          pb::gil_scoped_release release;
          s = ref::attention_scores(qv, kv, c.built.scheme, c.opt, c.built.tables64, batch_index,
                                    head, c.pq(), c.pk());
        }
        pb::array_t<double> a({c.qshape[1], c.kshape[1]});
        std::copy(s.begin(), s.end(), a.mutable_data());
        return a;
      },
      arg("q"), arg("k"), arg("scheme") = pb::none(), pb::kw_only(), arg("batch_index") = 0,
      arg("head") = 0,
      "ref.attention_scores(q, k, scheme=None, *, batch_index=0, head=0, **kwargs) -> float64 "
      "[seq_q, seq_k]: the scores of one (batch row, query head) before masking and softmax, "
      "scale and every positional term included.");
  // Seconds per call of the C++ attention alone (arguments parsed once, `reps` calls, GIL
  // released): what bench/python_attention.py subtracts to measure the Python calling overhead.
  m.def(
      "_time_attention",
      [fwd_extra](const pb::object& q, const pb::object& k, const pb::object& v,
                  const pb::object& scheme, int reps, const pb::kwargs& kw) {
        Call c = parse("attention", q, k, v, scheme, kw, Inputs::kAuto, fwd_extra);
        pb::array_t<float> out = new_array<float, 4>(c.oshape());
        const View<float, 4> ov = mutable_view<float, 4>(out);
        const auto qv = view4<float>(c.q, "q", ""), kv = view4<float>(c.k, "k", ""),
                   vv = view4<float>(c.v, "v", "");
        pb::gil_scoped_release release;
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < reps; ++i) {
          attention(qv, kv, vv, c.built.scheme, c.opt, ov, c.pq(), c.pk());
        }
        const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
        return dt.count() / std::max(reps, 1);
      },
      arg("q"), arg("k"), arg("v"), arg("scheme") = pb::none(), arg("reps") = 1000);
  m.def(
      "attention_merge",
      [](const pb::object& out_a, const pb::object& lse_a, const pb::object& out_b,
         const pb::object& lse_b) {
        pb::array oa = as_array<float>(out_a, "out_a"), la = as_array<float>(lse_a, "lse_a");
        pb::array ob = as_array<float>(out_b, "out_b"), lb = as_array<float>(lse_b, "lse_b");
        const auto oav = view_of<const float, 4>(oa, "out_a", "[batch, seq_q, heads_q, head_dim]");
        std::array<int64_t, 4> os = oav.shape;
        pb::array_t<float> out = new_array<float, 4>(os);
        pb::array_t<float> lse = new_array<float, 3>({os[0], os[2], os[1]});
        attention_merge(oav, view_of<const float, 3>(la, "lse_a", "[batch, heads_q, seq_q]"),
                        view_of<const float, 4>(ob, "out_b", "[batch, seq_q, heads_q, head_dim]"),
                        view_of<const float, 3>(lb, "lse_b", "[batch, heads_q, seq_q]"),
                        mutable_view<float, 4>(out), mutable_view<float, 3>(lse));
        return pb::make_tuple(out, lse);
      },
      arg("out_a"), arg("lse_a"), arg("out_b"), arg("lse_b"),
      "attention_merge(out_a, lse_a, out_b, lse_b) -> (out, lse): the attention over the union "
      "of two disjoint key sets from the two partial attentions (positions kept global).");
}

}  // namespace posenc::py
