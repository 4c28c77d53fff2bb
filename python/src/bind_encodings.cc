// python/src/bind_encodings.cc - the encodings and index functions: sinusoidal, learned, RoPE
// (frequencies, apply / inverse, q and k together, re-rotation, M-RoPE), ALiBi slopes, T5 / Shaw
// / DeBERTa indices, the Transformer-XL sinusoid, model configs. apply_rope's settings
// (rope_setup, calls.h) serve the half-precision binding too (bind_half.cc).
#include <pybind11/stl.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

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

// ---- RoPE ------------------------------------------------------------------------------------

RopeScaling scaling_arg(const pb::handle& obj) {
  RopeScaling s;
  if (obj.is_none()) return s;
  if (!pb::isinstance<pb::dict>(obj)) {
    throw pb::type_error("scaling: a dict like Hugging Face's rope_scaling");
  }
  for (auto [k, v] : pb::reinterpret_borrow<pb::dict>(obj)) {
    const std::string key = pb::str(k);
    if (key == "rope_type" || key == "type") {
      const std::string t = pb::str(v);
      if (t == "default") {
        s.type = RopeScalingType::kDefault;
      } else if (t == "linear") {
        s.type = RopeScalingType::kLinear;
      } else if (t == "dynamic") {
        s.type = RopeScalingType::kDynamic;
      } else if (t == "yarn") {
        s.type = RopeScalingType::kYarn;
      } else if (t == "llama3") {
        s.type = RopeScalingType::kLlama3;
      } else if (t == "longrope") {
        s.type = RopeScalingType::kLongRope;
      } else {
        throw ValueError("scaling: rope_type '" + t +
                         "' (default, linear, dynamic, yarn, llama3, longrope)");
      }
    } else if (key == "factor") {
      s.factor = v.cast<double>();
    } else if (key == "original_max_position_embeddings") {
      s.original_max_position_embeddings = v.cast<int64_t>();
    } else if (key == "max_position_embeddings") {
      s.max_position_embeddings = v.cast<int64_t>();
    } else if (key == "low_freq_factor") {
      s.low_freq_factor = v.cast<double>();
    } else if (key == "high_freq_factor") {
      s.high_freq_factor = v.cast<double>();
    } else if (key == "beta_fast") {
      s.beta_fast = v.cast<double>();
    } else if (key == "beta_slow") {
      s.beta_slow = v.cast<double>();
    } else if (key == "truncate") {
      s.truncate = v.cast<bool>();
    } else if (key == "mscale") {
      s.mscale = v.cast<double>();
    } else if (key == "mscale_all_dim") {
      s.mscale_all_dim = v.cast<double>();
    } else if (key == "attention_factor") {
      s.attention_factor = v.cast<double>();
    } else if (key == "short_factor") {
      s.short_factor = v.cast<std::vector<double>>();
    } else if (key == "long_factor") {
      s.long_factor = v.cast<std::vector<double>>();
    } else {
      throw ValueError("scaling: unknown key '" + key + "'");
    }
  }
  return s;
}

// Frequencies from the keyword arguments: a config, or head_dim + rotary_dim + base + scaling.
RopeFrequencies make_freqs(const pb::object& config, std::optional<int64_t> head_dim,
                           int64_t rotary_dim, double base, const pb::object& scaling,
                           int64_t seq_len, const std::string& angles) {
  const RopeAngles a = parse_angles(angles);
  if (!config.is_none()) {
    const ModelConfig m = model_config_arg(config);
    return model_rope_frequencies(m, seq_len, a);
  }
  if (!head_dim) throw pb::type_error("rope_frequencies: head_dim (or config=) is required");
  RopeConfig c;
  c.head_dim = *head_dim;
  c.rotary_dim = rotary_dim;
  c.base = base;
  c.scaling = scaling_arg(scaling);
  validate(c);
  return rope_frequencies(c, seq_len, a);
}

pb::object temperature_dict(const std::optional<AttentionTemperature>& t) {
  if (!t) return pb::none();
  return pb::dict("floor_scale"_a = t->floor_scale, "attn_scale"_a = t->attn_scale);
}

// rope_frequencies(...): the first positional argument is head_dim (an int) or a config (a path,
// dict or ModelConfig, as config=); layer= picks a layer of the config, NoPE layers included.
pb::object rope_frequencies_call(const pb::object& first, int64_t rotary_dim, double base,
                                 const pb::object& scaling, int64_t seq_len,
                                 const std::string& angles, pb::object config,
                                 std::optional<int64_t> layer) {
  std::optional<int64_t> head_dim;
  if (!first.is_none()) {
    if (pb::isinstance<pb::int_>(first) && !pb::isinstance<pb::bool_>(first)) {
      head_dim = first.cast<int64_t>();
    } else if (pb::isinstance<pb::str>(first) || pb::isinstance<pb::dict>(first) ||
               pb::isinstance<ModelConfig>(first) || pb::hasattr(first, "__fspath__")) {
      if (!config.is_none()) {
        throw pb::type_error("rope_frequencies: config given twice (positionally and config=)");
      }
      config = first;
    } else {
      throw pb::type_error(
          "rope_frequencies: the first argument must be head_dim (an int) or a "
          "config (a config.json path, dict or ModelConfig), got " +
          pb::str(pb::type::handle_of(first).attr("__name__")).cast<std::string>());
    }
  }
  if (layer) {
    if (config.is_none()) throw pb::type_error("rope_frequencies: layer= needs a config");
    if (head_dim) throw pb::type_error("rope_frequencies: layer= takes a config, not head_dim");
    const ModelConfig m = model_config_arg(config);
    if (seq_len < 0) throw ValueError("rope_frequencies: seq_len must be >= 0");
    return pb::cast(layer_rope(m, *layer, seq_len, parse_angles(angles)));
  }
  if (!config.is_none() && head_dim) {
    throw pb::type_error("rope_frequencies: head_dim and config are exclusive");
  }
  return pb::cast(make_freqs(config, head_dim, rotary_dim, base, scaling, seq_len, angles));
}

// The library's JSON forms (describe_json, rope_scaling_json) as Python objects: the one
// serializer of a model config.
pb::object from_json(const std::string& text) {
  static const pb::object& loads = py_attr("json", "loads");
  return loads(text);
}

}  // namespace

RopeSetup rope_setup(const pb::array& xa, const pb::object& freqs, const pb::object& style,
                     const pb::object& positions, bool inverse, int64_t rotary_dim, double base,
                     const pb::object& scaling, std::optional<int64_t> seq_len,
                     const std::string& angles, const pb::object& config) {
  if (xa.ndim() != 3 && xa.ndim() != 4) {
    throw ShapeError("x: expected [batch, seq, heads, head_dim] or [seq, heads, head_dim], got " +
                     std::to_string(xa.ndim()) + " dimensions");
  }
  const int64_t head_dim = xa.shape(xa.ndim() - 1);
  const std::optional<Positions> pos = positions_arg(positions, "positions");
  std::optional<ModelConfig> model;
  if (!config.is_none()) model = model_config_arg(config);
  RopeFrequencies f;
  if (!freqs.is_none()) {
    f = freqs.cast<RopeFrequencies>();
  } else {
    // Length-dependent scaling: by default the largest position + 1.
    int64_t len = 0;
    if (seq_len) {
      len = *seq_len;
    } else {
      const int64_t b = xa.ndim() == 4 ? xa.shape(0) : 1, l = xa.shape(xa.ndim() - 3);
      if (pos) pos->validate(b, l, "positions");
      len = (pos ? pos->max_position(b, l) : l - 1) + 1;
    }
    f = model ? model_rope_frequencies(*model, len, parse_angles(angles))
              : make_freqs(pb::none(), head_dim, rotary_dim, base, scaling, len, angles);
  }
  const RopeStyle st = !style.is_none() ? parse_style(style.cast<std::string>())
                       : model          ? model->rope.style
                                        : RopeStyle::kHalf;
  return RopeSetup{f, st, pos, inverse ? Direction::kInverse : Direction::kForward};
}

namespace {

// The RoPE call shared by apply_rope / rope_inverse / ref.apply_rope.
pb::array rope_call(const pb::handle& x, const pb::object& freqs, const pb::object& style,
                    const pb::object& positions, bool inverse, bool inplace, const pb::object& out,
                    int num_threads, int64_t rotary_dim, double base, const pb::object& scaling,
                    std::optional<int64_t> seq_len, const std::string& angles,
                    const pb::object& config, bool force_f64) {
  const bool f64 =
      force_f64 || (pb::isinstance<pb::array>(x) &&
                    pb::reinterpret_borrow<pb::array>(x).dtype().is(pb::dtype::of<double>()));
  pb::array xa = f64 ? as_array<double>(x, "x") : as_array<float>(x, "x");
  const RopeSetup r = rope_setup(xa, freqs, style, positions, inverse, rotary_dim, base, scaling,
                                 seq_len, angles, config);
  const RopeFrequencies& f = r.freqs;
  const RopeStyle st = r.style;
  const Direction dir = r.direction;
  const Positions* pp = r.pos();
  pb::array result;
  if (f64) {
    auto xv = as4<double>(xa, "x");
    if (inplace) {
      if (!xa.is(x) || !xa.writeable()) {
        throw pb::type_error("x: inplace=True needs a writable float64 array (no conversion)");
      }
      result = xa;
    } else if (!out.is_none()) {
      result = pb::reinterpret_borrow<pb::array>(out);
    } else {
      std::vector<pb::ssize_t> shape(xa.shape(), xa.shape() + xa.ndim());
      result = pb::array_t<double>(shape);
    }
    View<double, 4> ov = as4<double>(result, "out");
    if (!out.is_none()) {
      const pb::array o = pb::reinterpret_borrow<pb::array>(out);
      if (!viewable<double>(o) || !o.writeable() || ov.shape != xv.shape) {
        throw ValueError("out: must be a writable float64 array shaped like x");
      }
    }
    pb::gil_scoped_release release;
    ref::apply_rope(f, st, xv, ov, pp, dir);
  } else {
    auto xv = as4<float>(xa, "x");
    if (inplace) {
      if (!xa.is(x) || !xa.writeable()) {
        throw pb::type_error("x: inplace=True needs a writable float32 array (no conversion)");
      }
      result = xa;
    } else if (!out.is_none()) {
      result = pb::reinterpret_borrow<pb::array>(out);
      const pb::array o = result;
      if (!viewable<float>(o) || !o.writeable()) {
        throw ValueError("out: must be a writable float32 array shaped like x");
      }
    } else {
      std::vector<pb::ssize_t> shape(xa.shape(), xa.shape() + xa.ndim());
      result = pb::array_t<float>(shape);
    }
    View<float, 4> ov = as4<float>(result, "out");
    if (ov.shape != xv.shape) throw ShapeError("out: must have x's shape");
    pb::gil_scoped_release release;
    apply_rope(f, st, xv, ov, pp, dir, num_threads);
  }
  return result;
}

// ---- integer index functions, vectorized over arrays -----------------------------------------

template <class F>
pb::object map_int(const pb::handle& x, F f) {
  if (pb::isinstance<pb::int_>(x)) return pb::int_(f(x.cast<int64_t>()));
  auto a = pb::array_t<int64_t, pb::array::c_style | pb::array::forcecast>::ensure(x);
  if (!a) throw pb::type_error("expected an int or an integer array");
  std::vector<pb::ssize_t> shape(a.shape(), a.shape() + a.ndim());
  pb::array_t<int64_t> out(shape);
  const int64_t* in = a.data();
  int64_t* o = out.mutable_data();
  for (pb::ssize_t i = 0; i < a.size(); ++i) o[i] = f(in[i]);
  return std::move(out);
}

template <class F>
pb::object map_int2(const pb::handle& x, const pb::handle& y, F f) {
  if (pb::isinstance<pb::int_>(x) && pb::isinstance<pb::int_>(y)) {
    return pb::int_(f(x.cast<int64_t>(), y.cast<int64_t>()));
  }
  static const pb::object& broadcast = py_attr("numpy", "broadcast_arrays");
  pb::tuple ab = broadcast(pb::array_t<int64_t, pb::array::forcecast>::ensure(x),
                           pb::array_t<int64_t, pb::array::forcecast>::ensure(y));
  auto a = pb::array_t<int64_t, pb::array::c_style | pb::array::forcecast>::ensure(ab[0]);
  auto b = pb::array_t<int64_t, pb::array::c_style | pb::array::forcecast>::ensure(ab[1]);
  std::vector<pb::ssize_t> shape(a.shape(), a.shape() + a.ndim());
  pb::array_t<int64_t> out(shape);
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

void bind_encodings(pb::module_& m, pb::module_& ref) {
  // ---- classes ----
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
      .def("__repr__", [](const ModelConfig& c) {
        return "<posenc.ModelConfig model_type='" + c.model_type + "' scheme='" +
               model_scheme_name(c.scheme) + "'>";
      });

  // ---- model configs ----
  m.def(
      "read_model_config", [](const pb::object& config) { return model_config_arg(config); },
      arg("config"),
      "read_model_config(config) -> ModelConfig\n\nA Hugging Face config.json (a path, or the "
      "parsed dict), read strictly: unknown or contradictory positional keys raise IoError.");
  m.def(
      "describe", [](const pb::object& config) { return describe(model_config_arg(config)); },
      arg("config"),
      "describe(config) -> str: the model's positional encoding in words and numbers (what "
      "`posenc describe` prints). config: a path, a dict or a ModelConfig.");

  // ---- sinusoidal ----
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
        pb::gil_scoped_release release;
        sinusoidal_encode(c, p, v);
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
        pb::gil_scoped_release release;
        add_sinusoidal(c, r.view, pos ? &*pos : nullptr);
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
        pb::gil_scoped_release release;
        add_learned(tv, r.view, pos ? &*pos : nullptr);
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
        pb::array_t<float> g({max_positions, v.shape[2]});
        std::fill(g.mutable_data(), g.mutable_data() + g.size(), 0.0f);
        auto gv = view_of<float, 2>(g, "dtable", "");
        const auto pos = positions_arg(positions, "positions");
        pb::gil_scoped_release release;
        learned_backward(v, gv, pos ? &*pos : nullptr);
        return g;
      },
      arg("dy"), arg("max_positions"), pb::kw_only(), arg("positions") = pb::none(),
      "learned_backward(dy, max_positions, *, positions=None) -> dtable float32 "
      "[max_positions, dim]: dtable[p] = sum of dy at position p.");

  // ---- RoPE ----
  m.def("rope_frequencies", &rope_frequencies_call, arg("head_dim") = pb::none(), pb::kw_only(),
        arg("rotary_dim") = 0, arg("base") = 1e4, arg("scaling") = pb::none(), arg("seq_len") = 0,
        arg("angles") = "accurate", arg("config") = pb::none(), arg("layer") = pb::none(),
        "rope_frequencies(head_dim, *, rotary_dim=0, base=1e4, scaling=None, seq_len=0, "
        "angles='accurate', config=None, layer=None) -> RopeFrequencies\n\n"
        "rotary_dim 0 means head_dim; scaling is a Hugging Face rope_scaling dict (rope_type "
        "linear, dynamic, yarn, llama3, longrope and their keys); seq_len is the sequence length "
        "(max position + 1) for dynamic NTK and LongRoPE. config (a config.json path, dict or "
        "ModelConfig; also accepted as the first argument) replaces head_dim, rotary_dim, base and "
        "scaling. layer=N (with a config) gives that layer's RoPE as a LayerRopeFrequencies: a "
        "layer without RoPE (Llama 4's NoPE layers) is no error but nope=True, rotary_dim 0, "
        "attention_factor 1 and the layer's temperature tuning.");
  const char* rope_doc =
      "apply_rope(x, freqs=None, *, style=None, positions=None, inverse=False, inplace=False, "
      "out=None, num_threads=0, rotary_dim=0, base=1e4, scaling=None, seq_len=None, "
      "angles='accurate', config=None) -> rotated x\n\n"
      "x: [batch, seq, heads, head_dim] or [seq, heads, head_dim]; float32 runs the SIMD "
      "kernel, float64 the reference (other dtypes are converted to float32). freqs: a "
      "RopeFrequencies; without it they come from config, or from head_dim = x.shape[-1], "
      "rotary_dim, base and scaling at seq_len (default: max position + 1). style: 'half' "
      "(GPT-NeoX, Llama in HF) or 'interleaved' (GPT-J); default the config's, else half. "
      "positions: None (0, 1, ...), an int offset, ids [seq] or [batch, seq]. inverse=True "
      "rotates back (the backward). Dims >= rotary_dim pass through.";
  auto rope_fn = [](bool inverse_default, bool force_f64) {
    return [inverse_default, force_f64](
               const pb::object& x, const pb::object& freqs, const pb::object& style,
               const pb::object& positions, std::optional<bool> inverse, bool inplace,
               const pb::object& out, int num_threads, int64_t rotary_dim, double base,
               const pb::object& scaling, std::optional<int64_t> seq_len, const std::string& angles,
               const pb::object& config) {
      return rope_call(x, freqs, style, positions, inverse.value_or(inverse_default), inplace, out,
                       num_threads, rotary_dim, base, scaling, seq_len, angles, config, force_f64);
    };
  };
#define POSENC_ROPE_ARGS arg("x"), arg("freqs") = pb::none(), pb::kw_only(), POSENC_ROPE_KEYWORDS
  m.def("apply_rope", rope_fn(false, false), POSENC_ROPE_ARGS, rope_doc);
  m.def("rope_inverse", rope_fn(true, false), POSENC_ROPE_ARGS,
        "rope_inverse(x, freqs=None, **kwargs): apply_rope(..., inverse=True), the exact "
        "transpose of the rotation (its backward).");
  ref.def("apply_rope", rope_fn(false, true), POSENC_ROPE_ARGS,
          "ref.apply_rope(x, freqs=None, **kwargs): apply_rope in float64 (x converted to "
          "float64).");
#undef POSENC_ROPE_ARGS
  m.def(
      "apply_rope_qk",
      [](const pb::object& q, const pb::object& k, const RopeFrequencies& freqs,
         const std::string& style, const pb::object& positions, bool inverse, bool inplace,
         int num_threads) {
        auto prep = [&](const pb::object& x, const char* what) {
          pb::array a = as_array<float>(x, what);
          if (inplace) {
            if (!a.is(x) || !a.writeable()) {
              throw pb::type_error(std::string(what) +
                                   ": inplace=True needs a writable float32 array");
            }
            return a;
          }
          static const pb::object& copy = py_attr("numpy", "array");
          return pb::array(copy(a, "dtype"_a = "float32", "copy"_a = true));
        };
        pb::array qa = prep(q, "q"), ka = prep(k, "k");
        auto qv = as4<float>(qa, "q");
        auto kv = as4<float>(ka, "k");
        const auto pos = positions_arg(positions, "positions");
        const RopeStyle st = parse_style(style);
        {
          pb::gil_scoped_release release;
          apply_rope_qk(freqs, st, qv, kv, pos ? &*pos : nullptr,
                        inverse ? Direction::kInverse : Direction::kForward, num_threads);
        }
        return pb::make_tuple(qa, ka);
      },
      arg("q"), arg("k"), arg("freqs"), pb::kw_only(), arg("style") = "half",
      arg("positions") = pb::none(), arg("inverse") = false, arg("inplace") = false,
      arg("num_threads") = 0,
      "apply_rope_qk(q, k, freqs, *, style='half', positions=None, inverse=False, "
      "inplace=False, num_threads=0) -> (q', k'): q and k rotated in one pass (heads may "
      "differ), float32.");
  m.def(
      "rerotate_rope",
      [](const pb::object& k, const RopeFrequencies& from, const RopeFrequencies& to,
         const std::string& style, const pb::object& positions, bool inplace) {
        pb::array a = as_array<float>(k, "k");
        if (inplace) {
          if (!a.is(k) || !a.writeable()) {
            throw pb::type_error("k: inplace=True needs a writable float32 array");
          }
        } else {
          static const pb::object& copy = py_attr("numpy", "array");
          a = copy(a, "dtype"_a = "float32", "copy"_a = true);
        }
        auto kv = as4<float>(a, "k");
        const auto pos = positions_arg(positions, "positions");
        const RopeStyle st = parse_style(style);
        pb::gil_scoped_release release;
        rerotate_rope(from, to, st, kv, pos ? &*pos : nullptr);
        return a;
      },
      arg("k"), arg("from_freqs"), arg("to_freqs"), pb::kw_only(), arg("style") = "half",
      arg("positions") = pb::none(), arg("inplace") = false,
      "rerotate_rope(k, from_freqs, to_freqs, *, style='half', positions=None, inplace=False): "
      "keys cached as rope(k, p; from) moved to rope(k, p; to) exactly (dynamic NTK growth, "
      "LongRoPE crossing its original length) without a re-prefill.");
  m.def(
      "apply_mrope",
      [](const pb::object& x, const RopeFrequencies& freqs, const pb::object& positions,
         const std::string& style, std::array<int64_t, 3> sections, const std::string& layout,
         bool inverse) {
        const bool f64 = pb::isinstance<pb::array>(x) &&
                         pb::reinterpret_borrow<pb::array>(x).dtype().is(pb::dtype::of<double>());
        MRope mr;
        mr.sections = sections;
        if (layout == "sectioned") {
          mr.layout = MRopeLayout::kSectioned;
        } else if (layout == "interleaved") {
          mr.layout = MRopeLayout::kInterleaved;
        } else {
          throw ValueError("layout: '" + layout + "' (sectioned or interleaved)");
        }
        auto ids =
            pb::array_t<int64_t, pb::array::c_style | pb::array::forcecast>::ensure(positions);
        if (!ids || (ids.ndim() != 2 && ids.ndim() != 3) || ids.shape(0) != 3) {
          throw ShapeError("positions: expected [3, seq] or [3, batch, seq] (t, h, w)");
        }
        std::array<Positions, 3> pos;
        const pb::ssize_t n = ids.size() / 3;
        for (int c = 0; c < 3; ++c) {
          std::vector<int64_t> v(ids.data() + c * n, ids.data() + (c + 1) * n);
          pos[c] = ids.ndim() == 2 ? Positions::shared(std::move(v))
                                   : Positions::per_row(std::move(v), ids.shape(1), ids.shape(2));
        }
        const Direction dir = inverse ? Direction::kInverse : Direction::kForward;
        const RopeStyle st = parse_style(style);
        if (f64) {
          pb::array a = as_array<double>(x, "x");
          std::vector<pb::ssize_t> shape(a.shape(), a.shape() + a.ndim());
          pb::array out = pb::array_t<double>(shape);
          auto xv = as4<double>(a, "x");
          auto ov = as4<double>(out, "out");
          pb::gil_scoped_release release;
          ref::apply_mrope(freqs, st, mr, xv, ov, pos, dir);
          return out;
        }
        pb::array a = as_array<float>(x, "x");
        std::vector<pb::ssize_t> shape(a.shape(), a.shape() + a.ndim());
        pb::array out = pb::array_t<float>(shape);
        auto xv = as4<float>(a, "x");
        auto ov = as4<float>(out, "out");
        pb::gil_scoped_release release;
        apply_mrope(freqs, st, mr, xv, ov, pos, dir);
        return out;
      },
      arg("x"), arg("freqs"), arg("positions"), pb::kw_only(), arg("style") = "half",
      arg("sections") = std::array<int64_t, 3>{16, 24, 24}, arg("layout") = "sectioned",
      arg("inverse") = false,
      "apply_mrope(x, freqs, positions, *, style='half', sections=(16, 24, 24), "
      "layout='sectioned'|'interleaved', inverse=False): multimodal RoPE with (t, h, w) "
      "positions [3, seq] or [3, batch, seq] (Qwen2-VL sectioned, Qwen3-VL interleaved).");

  // ---- ALiBi, T5, Shaw, DeBERTa, XL ----
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
        return map_int(rel, [&](int64_t r) { return t5_bucket(r, c); });
      },
      arg("rel"), pb::kw_only(), arg("num_buckets") = 32, arg("max_distance") = 128,
      arg("bidirectional") = true,
      "t5_bucket(rel, *, num_buckets=32, max_distance=128, bidirectional=True): the bucket of "
      "rel = pos_k - pos_q (an int or an int array), log evaluated in float32 as T5 does.");
  ref.def(
      "t5_bucket",
      [t5_cfg](const pb::object& rel, int64_t nb, int64_t md, bool bidir) {
        const T5BucketConfig c = t5_cfg(nb, md, bidir);
        return map_int(rel, [&](int64_t r) { return ref::t5_bucket_f64(r, c); });
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
        return map_int(rel, [&](int64_t r) { return shaw_index(r, k); });
      },
      arg("rel"), arg("max_relative_position"),
      "shaw_index(rel, max_relative_position) -> clamp(rel, -K, K) + K (docs/shaw.md).");
  m.def(
      "deberta_bucket",
      [](const pb::object& rho, int64_t mrp, int64_t pb_, bool f64log) {
        const DebertaBuckets c = deberta_cfg(mrp, pb_, f64log, "model");
        return map_int(rho, [&](int64_t r) { return deberta_bucket(r, c); });
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
          return map_int2(pq, pk, [&](int64_t a, int64_t b) {
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

}  // namespace posenc::py
