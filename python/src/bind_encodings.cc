// python/src/bind_encodings.cc - the encodings and index functions: sinusoidal, learned, ALiBi
// slopes, T5 / Shaw / DeBERTa indices, the Transformer-XL sinusoid, model configs and the RoPE
// classes (RoPE's functions: bind_rope.cc).
#include <pybind11/stl.h>

#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "args.h"
#include "calls.h"

namespace posenc::py {

namespace {

using pb::arg;
using namespace pybind11::literals;

// ---- sinusoidal ------------------------------------------------------------------------------

SinusoidalConfig sin_config(int64_t dim, double base, const std::string& layout,
                            const std::string& denominator, int64_t origin,
                            const std::string& odd_dim) {
  SinusoidalConfig c;
  c.dim = dim;
  c.base = base;
  c.layout = parse_layout(layout);
  c.denominator = parse_sin_denominator(denominator, "denominator");
  c.origin = origin;
  c.odd_dim = parse_sin_odd_dim(odd_dim, "odd_dim");
  validate(c);
  return c;
}

// x as [batch, seq, dim] (a 2-D [seq, dim] gets a batch of 1), float32, in place or a copy.
struct Rows3 {
  pb::array arr;  // what is written (x itself when inplace)
  View<float, 3> view;
};

Rows3 rows3(const pb::handle& x, bool inplace, const char* what) {
  pb::array a = as_array<float>(x, what);
  if (inplace) {
    if (!a.is(x)) {
      throw pb::type_error(std::string(what) +
                           ": inplace=True needs a float32 array with non-negative strides");
    }
    if (!a.writeable()) throw ValueError(std::string(what) + ": array is read-only");
  } else {
    static const pb::object& copy = py_attr("numpy", "array");
    a = copy(a, "dtype"_a = "float32", "copy"_a = true);
  }
  Rows3 r{a, {}};
  if (a.ndim() == 2) {
    auto v = view_of<float, 2>(a, what, "[seq, dim]");
    r.view = View<float, 3>{v.data, {1, v.shape[0], v.shape[1]}, {0, v.stride[0], v.stride[1]}};
  } else {
    r.view = view_of<float, 3>(a, what, "[batch, seq, dim] or [seq, dim]");
  }
  return r;
}

// The library's JSON forms (describe_json, rope_scaling_json) as Python objects: the one
// serializer of a model config.
pb::object from_json(const std::string& text) {
  static const pb::object& loads = py_attr("json", "loads");
  return loads(text);
}

}  // namespace

namespace {

// ---- integer index functions, vectorized over arrays -----------------------------------------

// f over an int or an integer array `x` (named `what`): integers only, never truncated or wrapped
// (int_array refuses floats, booleans and values past int64).
template <class F>
pb::object map_int(const pb::handle& x, const char* what, F f) {
  if (is_int_scalar(x)) {
    return pb::int_(f(arg_int(x, what)));
  }
  const pb::array a = int_array<int64_t>(x, what);
  std::vector<pb::ssize_t> shape(a.shape(), a.shape() + a.ndim());
  pb::array_t<int64_t> out = checked_array<int64_t>(shape, "the result");
  const int64_t* in = static_cast<const int64_t*>(a.data());
  int64_t* o = out.mutable_data();
  for (pb::ssize_t i = 0; i < a.size(); ++i) o[i] = f(in[i]);
  return std::move(out);
}

// f over two ints or integer arrays (broadcast together), each as map_int reads it.
template <class F>
pb::object map_int2(const pb::handle& x, const pb::handle& y, const char* xwhat, const char* ywhat,
                    F f) {
  if (is_int_scalar(x) && is_int_scalar(y))
    return pb::int_(f(arg_int(x, xwhat), arg_int(y, ywhat)));
  static const pb::object& broadcast = py_attr("numpy", "broadcast_arrays");
  pb::tuple ab = broadcast(int_array<int64_t>(x, xwhat), int_array<int64_t>(y, ywhat));
  auto a = pb::array_t<int64_t, pb::array::c_style | pb::array::forcecast>::ensure(ab[0]);
  auto b = pb::array_t<int64_t, pb::array::c_style | pb::array::forcecast>::ensure(ab[1]);
  std::vector<pb::ssize_t> shape(a.shape(), a.shape() + a.ndim());
  pb::array_t<int64_t> out = checked_array<int64_t>(shape, "the result");
  for (pb::ssize_t i = 0; i < a.size(); ++i) out.mutable_data()[i] = f(a.data()[i], b.data()[i]);
  return std::move(out);
}

DebertaBuckets deberta_cfg(int64_t max_relative_positions, int64_t position_buckets,
                           bool float64_log, const std::string& p2c) {
  DebertaBuckets b;
  b.max_relative_positions = max_relative_positions;
  b.position_buckets = position_buckets;
  b.float64_log = float64_log;
  b.p2c = parse_deberta_p2c(p2c, "p2c");
  validate(b);
  return b;
}

pb::object scaling_dict(const RopeScaling& s) { return from_json(rope_scaling_json(s)); }

}  // namespace

pb::object temperature_dict(const std::optional<AttentionTemperature>& t) {
  if (!t) return pb::none();
  return pb::dict("floor_scale"_a = t->floor_scale, "attn_scale"_a = t->attn_scale);
}

namespace {

// The classes: RopeFrequencies, LayerRopeFrequencies, RopeScaling, ModelConfig.
void bind_classes(pb::module_& m) {
  pb::class_<RopeFrequencies>(m, "RopeFrequencies",
                              "RoPE inverse frequencies (float64, rotary_dim / 2 of them), the "
                              "attention factor and the angle mode (accurate or float32). Make "
                              "one with rope_frequencies(), or from your own inv_freq table.")
      .def(pb::init([](const std::vector<double>& inv_freq, double attention_factor,
                       const std::string& angles) {
             RopeFrequencies f;
             f.inv_freq = inv_freq;
             f.attention_factor = attention_factor;
             f.angles = parse_angles(angles);
             return f;
           }),
           arg("inv_freq"), pb::kw_only(), arg("attention_factor") = 1.0,
           arg("angles") = "accurate")
      .def_property_readonly("inv_freq",
                             [](const RopeFrequencies& f) {
                               return pb::array_t<double>(
                                   static_cast<pb::ssize_t>(f.inv_freq.size()), f.inv_freq.data());
                             })
      .def_readonly("attention_factor", &RopeFrequencies::attention_factor)
      .def_property_readonly("angles",
                             [](const RopeFrequencies& f) { return angles_name(f.angles); })
      .def_property_readonly("rotary_dim", &RopeFrequencies::rotary_dim)
      .def("__repr__", [](const RopeFrequencies& f) {
        return "RopeFrequencies(rotary_dim=" + std::to_string(f.rotary_dim()) +
               ", attention_factor=" + std::to_string(f.attention_factor) + ", angles='" +
               angles_name(f.angles) + "')";
      });

  pb::class_<LayerRopeFrequencies, RopeFrequencies>(
      m, "LayerRopeFrequencies",
      "One layer's RoPE (rope_frequencies(config, layer=N)): a RopeFrequencies plus layer, nope "
      "(True on a layer without RoPE, Llama 4's NoPE layers: no frequencies, rotary_dim 0, "
      "attention_factor 1), style, and temperature (the layer's attention-temperature tuning as "
      "{'floor_scale', 'attn_scale'}, or None).")
      .def_readonly("layer", &LayerRopeFrequencies::layer)
      .def_readonly("nope", &LayerRopeFrequencies::nope)
      .def_property_readonly("style",
                             [](const LayerRopeFrequencies& f) { return style_name(f.style); })
      .def_property_readonly(
          "temperature",
          [](const LayerRopeFrequencies& f) { return temperature_dict(f.temperature); })
      .def("__repr__", [](const LayerRopeFrequencies& f) {
        return "LayerRopeFrequencies(layer=" + std::to_string(f.layer) +
               ", nope=" + (f.nope ? "True" : "False") +
               ", rotary_dim=" + std::to_string(f.rotary_dim()) +
               ", attention_factor=" + std::to_string(f.attention_factor) + ", style='" +
               style_name(f.style) + "')";
      });

  pb::class_<ModelConfig>(m, "ModelConfig",
                          "A Hugging Face config.json read by read_model_config: the model's "
                          "positional encoding and the dimensions attention needs.")
      .def_readonly("model_type", &ModelConfig::model_type)
      .def_property_readonly("scheme",
                             [](const ModelConfig& c) { return model_scheme_name(c.scheme); })
      .def_readonly("hidden_size", &ModelConfig::hidden_size)
      .def_readonly("heads_q", &ModelConfig::heads_q)
      .def_readonly("heads_kv", &ModelConfig::heads_kv)
      .def_readonly("head_dim", &ModelConfig::head_dim)
      .def_readonly("max_position_embeddings", &ModelConfig::max_position_embeddings)
      .def_readonly("sliding_window", &ModelConfig::sliding_window)
      .def_readonly("pos_att_type", &ModelConfig::pos_att_type)
      .def_property_readonly(
          "rope",
          [](const ModelConfig& c) {
            return pb::dict("head_dim"_a = c.rope.head_dim, "rotary_dim"_a = c.rope.rotary_dim,
                            "base"_a = c.rope.base, "style"_a = style_name(c.rope.style),
                            "scaling"_a = scaling_dict(c.rope.scaling));
          })
      .def_property_readonly("mrope",
                             [](const ModelConfig& c) -> pb::object {
                               if (!c.mrope) return pb::none();
                               return pb::dict(
                                   "sections"_a = c.mrope->sections,
                                   "layout"_a = c.mrope->layout == MRopeLayout::kInterleaved
                                                    ? "interleaved"
                                                    : "sectioned");
                             })
      .def_property_readonly("alibi",
                             [](const ModelConfig& c) {
                               return pb::dict("heads"_a = c.alibi.heads,
                                               "max_bias"_a = c.alibi.max_bias);
                             })
      .def_property_readonly("t5",
                             [](const ModelConfig& c) {
                               return pb::dict("num_buckets"_a = c.t5.num_buckets,
                                               "max_distance"_a = c.t5.max_distance,
                                               "bidirectional"_a = c.t5.bidirectional);
                             })
      .def_property_readonly("deberta",
                             [](const ModelConfig& c) {
                               return pb::dict(
                                   "max_relative_positions"_a = c.deberta.max_relative_positions,
                                   "position_buckets"_a = c.deberta.position_buckets,
                                   "float64_log"_a = c.deberta.float64_log,
                                   "p2c"_a = p2c_name(c.deberta.p2c));
                             })
      .def_property_readonly("layers",
                             [](const ModelConfig& c) -> pb::object {
                               const pb::dict d(from_json(describe_json(c)));
                               return d.contains("layers") ? pb::object(d["layers"])
                                                           : pb::object(pb::list());
                             })
      .def(
          "to_dict", [](const ModelConfig& c) { return from_json(describe_json(c)); },
          "to_dict() -> dict\n\nThe model's positional encoding as `posenc describe --json` "
          "prints it (model_type, scheme, dims, the scheme's settings, layers, defaults).")
      .def("effective_context", &ModelConfig::effective_context)
      .def_readonly("json", &ModelConfig::json,
                    "The config.json text it was read from: read_model_config(json.loads(text)) "
                    "reads the same config (in another process too).")
      .def_readonly("source", &ModelConfig::source,
                    "Where it was read from: the path, or 'config' for a dict.")
      .def("__repr__", [](const ModelConfig& c) {
        return "<posenc.ModelConfig model_type='" + c.model_type + "' scheme='" +
               model_scheme_name(c.scheme) + "'>";
      });
}

// Model configs: read_model_config, describe.
void bind_model_configs(pb::module_& m) {
  m.def(
      "read_model_config", [](const pb::object& config) { return model_config_arg(config); },
      arg("config"),
      "read_model_config(config) -> ModelConfig\n\nA Hugging Face config.json (a path, or the "
      "parsed dict), read strictly: unknown or contradictory positional keys raise IoError.");
  // The torch ops' form of a config: its config.json text and the name of its source.
  m.def(
      "_model_config_from_json",
      [](const std::string& text, const std::string& source) {
        return parse_model_config(text, source);
      },
      arg("text"), arg("source") = "config");
  m.def(
      "describe", [](const pb::object& config) { return describe(model_config_arg(config)); },
      arg("config"),
      "describe(config) -> str: the model's positional encoding in words and numbers (what "
      "`posenc describe` prints). config: a path, a dict or a ModelConfig.");
}

// Sinusoidal and learned absolute encodings.
void bind_sinusoidal(pb::module_& m, pb::module_& ref) {
  const char* sin_doc =
      " Config keywords: base=1e4, layout='interleaved'|'concat', denominator='dim'|"
      "'half_minus_one', origin=0, odd_dim='error'|'zero_pad' (docs/sinusoidal.md).";
  m.def(
      "sinusoidal_table",
      [](int64_t length, int64_t dim, double base, const std::string& layout,
         const std::string& denominator, int64_t origin, const std::string& odd_dim) {
        const SinusoidalConfig c = sin_config(dim, base, layout, denominator, origin, odd_dim);
        std::vector<float> t;
        {
          pb::gil_scoped_release release;
          t = sinusoidal_table(c, length);
        }
        pb::array_t<float> a({length, dim});
        std::copy(t.begin(), t.end(), a.mutable_data());
        return a;
      },
      arg("length"), arg("dim"), pb::kw_only(), arg("base") = 1e4, arg("layout") = "interleaved",
      arg("denominator") = "dim", arg("origin") = 0, arg("odd_dim") = "error",
      (std::string("sinusoidal_table(length, dim, **config) -> float32 [length, dim]: row r is "
                   "PE at position origin + r.") +
       sin_doc)
          .c_str());
  ref.def(
      "sinusoidal_table",
      [](int64_t length, int64_t dim, double base, const std::string& layout,
         const std::string& denominator, int64_t origin, const std::string& odd_dim) {
        const SinusoidalConfig c = sin_config(dim, base, layout, denominator, origin, odd_dim);
        const std::vector<double> t = ref::sinusoidal_table(c, length);
        pb::array_t<double> a({length, dim});
        std::copy(t.begin(), t.end(), a.mutable_data());
        return a;
      },
      arg("length"), arg("dim"), pb::kw_only(), arg("base") = 1e4, arg("layout") = "interleaved",
      arg("denominator") = "dim", arg("origin") = 0, arg("odd_dim") = "error",
      "sinusoidal_table(length, dim, **config) -> float64 [length, dim], straight from the formula "
      "(docs/sinusoidal.md).");
  m.def(
      "sinusoidal_frequencies",
      [](int64_t dim, double base, const std::string& denominator) {
        const auto w = sinusoidal_frequencies(
            sin_config(dim, base, "interleaved", denominator, 0, dim % 2 ? "zero_pad" : "error"));
        return pb::array_t<double>(static_cast<pb::ssize_t>(w.size()), w.data());
      },
      arg("dim"), pb::kw_only(), arg("base") = 1e4, arg("denominator") = "dim",
      "sinusoidal_frequencies(dim, *, base=1e4, denominator='dim') -> float64 [dim // 2]: w_i.");
  m.def(
      "sinusoidal_encode",
      [](const pb::object& positions, int64_t dim, double base, const std::string& layout,
         const std::string& denominator, int64_t origin, const std::string& odd_dim) {
        const SinusoidalConfig c = sin_config(dim, base, layout, denominator, origin, odd_dim);
        auto ids =
            pb::array_t<int64_t, pb::array::c_style | pb::array::forcecast>::ensure(positions);
        if (!ids || ids.ndim() != 1) throw ShapeError("positions: expected a 1-D integer array");
        std::vector<int64_t> p(ids.data(), ids.data() + ids.size());
        pb::array_t<float> a({static_cast<int64_t>(p.size()), dim});
        auto v = view_of<float, 2>(a, "out", "");
        {
          pb::gil_scoped_release release;
          sinusoidal_encode(c, p, v);
        }
        return a;
      },
      arg("positions"), arg("dim"), pb::kw_only(), arg("base") = 1e4, arg("layout") = "interleaved",
      arg("denominator") = "dim", arg("origin") = 0, arg("odd_dim") = "error",
      "sinusoidal_encode(positions, dim, **config) -> float32 [n, dim]: PE at explicit positions.");
  m.def(
      "add_sinusoidal",
      [](const pb::object& x, double base, const std::string& layout,
         const std::string& denominator, int64_t origin, const std::string& odd_dim,
         const pb::object& positions, bool inplace) {
        Rows3 r = rows3(x, inplace, "x");
        const SinusoidalConfig c =
            sin_config(r.view.shape[2], base, layout, denominator, origin, odd_dim);
        const auto pos = positions_arg(positions, "positions");
        {
          pb::gil_scoped_release release;  // not across the return: it copies r.arr
          add_sinusoidal(c, r.view, pos ? &*pos : nullptr);
        }
        return r.arr;
      },
      arg("x"), pb::kw_only(), arg("base") = 1e4, arg("layout") = "interleaved",
      arg("denominator") = "dim", arg("origin") = 0, arg("odd_dim") = "error",
      arg("positions") = pb::none(), arg("inplace") = false,
      "add_sinusoidal(x, *, positions=None, inplace=False, **config) -> x + PE[position]\n\n"
      "x: float32 [batch, seq, dim] or [seq, dim] (other dtypes are converted to float32). "
      "positions: None (offset `origin`), an int offset, ids [seq] or [batch, seq]. inplace=True "
      "adds into x itself (a float32 array) and returns it.");
  m.def(
      "add_learned",
      [](const pb::object& x, const pb::object& table, const pb::object& positions, bool inplace) {
        Rows3 r = rows3(x, inplace, "x");
        pb::array t = as_array<float>(table, "table");
        const auto tv = view_of<const float, 2>(t, "table", "[max_positions, dim]");
        const auto pos = positions_arg(positions, "positions");
        {
          pb::gil_scoped_release release;  // not across the return: it copies r.arr
          add_learned(tv, r.view, pos ? &*pos : nullptr);
        }
        return r.arr;
      },
      arg("x"), arg("table"), pb::kw_only(), arg("positions") = pb::none(), arg("inplace") = false,
      "add_learned(x, table, *, positions=None, inplace=False) -> x + table[position]\n\n"
      "x: float32 [batch, seq, dim] or [seq, dim]; table [max_positions, dim]. A position "
      "outside the table raises InvalidValueError (a learned table cannot extrapolate).");
  m.def(
      "learned_backward",
      [](const pb::object& dy, int64_t max_positions, const pb::object& positions) {
        pb::array a = as_array<float>(dy, "dy");
        View<const float, 3> v;
        if (a.ndim() == 2) {
          auto v2 = view_of<const float, 2>(a, "dy", "");
          v = View<const float, 3>{
              v2.data, {1, v2.shape[0], v2.shape[1]}, {0, v2.stride[0], v2.stride[1]}};
        } else {
          v = view_of<const float, 3>(a, "dy", "[batch, seq, dim] or [seq, dim]");
        }
        if (max_positions < 0) throw ValueError("max_positions must be >= 0");
        pb::array_t<float> g = checked_array<float>({max_positions, v.shape[2]}, "dtable");
        std::fill(g.mutable_data(), g.mutable_data() + g.size(), 0.0f);
        auto gv = view_of<float, 2>(g, "dtable", "");
        const auto pos = positions_arg(positions, "positions");
        {
          pb::gil_scoped_release release;
          learned_backward(v, gv, pos ? &*pos : nullptr);
        }
        return g;
      },
      arg("dy"), arg("max_positions"), pb::kw_only(), arg("positions") = pb::none(),
      "learned_backward(dy, max_positions, *, positions=None) -> dtable float32 "
      "[max_positions, dim]: dtable[p] = sum of dy at position p.");
}

// The relative schemes' tables and indices: ALiBi slopes, T5 buckets, Shaw and DeBERTa indices, the
// Transformer-XL sinusoid.
void bind_relative(pb::module_& m, pb::module_& ref) {
  m.def(
      "alibi_slopes",
      [](int64_t heads, double max_bias) {
        const auto s = alibi_slopes({.heads = heads, .max_bias = max_bias});
        return pb::array_t<double>(static_cast<pb::ssize_t>(s.size()), s.data());
      },
      arg("heads"), pb::kw_only(), arg("max_bias") = 8.0,
      "alibi_slopes(heads, *, max_bias=8.0) -> float64 [heads] (docs/alibi.md; BLOOM, MPT, "
      "Falcon-RW).");
  auto t5_cfg = [](int64_t nb, int64_t md, bool bidir) {
    T5BucketConfig c{.num_buckets = nb, .max_distance = md, .bidirectional = bidir};
    validate(c);
    return c;
  };
  m.def(
      "t5_bucket",
      [t5_cfg](const pb::object& rel, int64_t nb, int64_t md, bool bidir) {
        const T5BucketConfig c = t5_cfg(nb, md, bidir);
        return map_int(rel, "relative_position", [&](int64_t r) { return t5_bucket(r, c); });
      },
      arg("rel"), pb::kw_only(), arg("num_buckets") = 32, arg("max_distance") = 128,
      arg("bidirectional") = true,
      "t5_bucket(rel, *, num_buckets=32, max_distance=128, bidirectional=True): the bucket of "
      "rel = pos_k - pos_q (an int or an int array), log evaluated in float32 as T5 does.");
  ref.def(
      "t5_bucket",
      [t5_cfg](const pb::object& rel, int64_t nb, int64_t md, bool bidir) {
        const T5BucketConfig c = t5_cfg(nb, md, bidir);
        return map_int(rel, "relative_position",
                       [&](int64_t r) { return ref::t5_bucket_f64(r, c); });
      },
      arg("rel"), pb::kw_only(), arg("num_buckets") = 32, arg("max_distance") = 128,
      arg("bidirectional") = true, "t5_bucket with the log in float64.");
  m.def(
      "t5_bucket_map",
      [t5_cfg](int64_t seq_q, int64_t seq_k, int64_t nb, int64_t md, bool bidir,
               const pb::object& qp, const pb::object& kp) {
        const T5BucketConfig c = t5_cfg(nb, md, bidir);
        const auto pq = positions_arg(qp, "query_positions");
        const auto pk = positions_arg(kp, "key_positions");
        const auto v = t5_bucket_map(c, seq_q, seq_k, pq ? &*pq : nullptr, pk ? &*pk : nullptr);
        pb::array_t<int64_t> a({seq_q, seq_k});
        std::copy(v.begin(), v.end(), a.mutable_data());
        return a;
      },
      arg("seq_q"), arg("seq_k"), pb::kw_only(), arg("num_buckets") = 32, arg("max_distance") = 128,
      arg("bidirectional") = true, arg("query_positions") = pb::none(),
      arg("key_positions") = pb::none(),
      "t5_bucket_map(seq_q, seq_k, **bucket config, query_positions=None, key_positions=None) "
      "-> int64 [seq_q, seq_k] (query i at seq_k - seq_q + i by default).");
  m.def(
      "shaw_index",
      [](const pb::object& rel, int64_t k) {
        if (k < 0) throw ValueError("max_relative_position must be >= 0");
        return map_int(rel, "relative_position", [&](int64_t r) { return shaw_index(r, k); });
      },
      arg("rel"), arg("max_relative_position"),
      "shaw_index(rel, max_relative_position) -> clamp(rel, -K, K) + K (docs/shaw.md).");
  m.def(
      "deberta_bucket",
      [](const pb::object& rho, int64_t mrp, int64_t pb_, bool f64log) {
        const DebertaBuckets c = deberta_cfg(mrp, pb_, f64log, "model");
        return map_int(rho, "rho", [&](int64_t r) { return deberta_bucket(r, c); });
      },
      arg("rho"), pb::kw_only(), arg("max_relative_positions") = 512, arg("position_buckets") = 0,
      arg("float64_log") = false,
      "deberta_bucket(rho, *, max_relative_positions=512, position_buckets=0, "
      "float64_log=False): rho = pos_q - pos_k after DeBERTa-v2's log bucketing.");
  for (const bool c2p : {true, false}) {
    m.def(
        c2p ? "deberta_c2p_index" : "deberta_p2c_index",
        [c2p](const pb::object& pq, const pb::object& pk, int64_t mrp, int64_t pb_, bool f64log,
              const std::string& p2c) {
          const DebertaBuckets c = deberta_cfg(mrp, pb_, f64log, p2c);
          return map_int2(pq, pk, "pos_q", "pos_k", [&](int64_t a, int64_t b) {
            return c2p ? deberta_c2p_index(a, b, c) : deberta_p2c_index(a, b, c);
          });
        },
        arg("pos_q"), arg("pos_k"), pb::kw_only(), arg("max_relative_positions") = 512,
        arg("position_buckets") = 0, arg("float64_log") = false, arg("p2c") = "model",
        c2p ? "deberta_c2p_index(pos_q, pos_k, **buckets): the row of pos_key (broadcasts)."
            : "deberta_p2c_index(pos_q, pos_k, **buckets, p2c='model'|'paper'): the row of "
              "pos_query (broadcasts).");
  }
  m.def(
      "xl_sinusoid",
      [](int64_t delta, int64_t d_model, double base) {
        const auto v = xl_sinusoid(delta, d_model, base);
        return pb::array_t<double>(static_cast<pb::ssize_t>(v.size()), v.data());
      },
      arg("delta"), arg("d_model"), pb::kw_only(), arg("base") = 1e4,
      "xl_sinusoid(delta, d_model, *, base=1e4) -> float64 [d_model]: R(delta), concat layout.");
}

}  // namespace

void bind_encodings(pb::module_& m, pb::module_& ref) {
  bind_classes(m);
  bind_model_configs(m);
  bind_sinusoidal(m, ref);
  bind_relative(m, ref);
  bind_rope(m, ref);
}

}  // namespace posenc::py
