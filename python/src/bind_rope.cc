// python/src/bind_rope.cc - RoPE in Python: rope_frequencies (head_dim or a config, a layer's
// included), apply_rope / rope_inverse / ref.apply_rope, apply_rope_qk, re-rotation and M-RoPE.
// apply_rope's settings (rope_setup, calls.h) serve the half-precision binding too (bind_half.cc).
#include <pybind11/stl.h>

#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "args.h"
#include "calls.h"

namespace posenc::py {

// A Hugging Face rope_scaling dict (None: no scaling); py_common.h.
RopeScaling scaling_arg(const pb::handle& obj) {
  RopeScaling s;
  if (obj.is_none()) return s;
  if (!pb::isinstance<pb::dict>(obj)) {
    throw pb::type_error("scaling: a dict like Hugging Face's rope_scaling");
  }
  for (auto [k, v] : pb::reinterpret_borrow<pb::dict>(obj)) {
    const std::string key = pb::str(k);
    if (key == "rope_type" || key == "type") {
      const std::string t = arg_str(v, "scaling['" + key + "']");
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
      } else if (t == "proportional") {
        s.type = RopeScalingType::kProportional;
      } else {
        throw ValueError("scaling: rope_type '" + t +
                         "' (default, linear, dynamic, yarn, llama3, longrope, proportional)");
      }
    } else if (key == "factor") {
      s.factor = arg_float(v, "scaling['factor']");
    } else if (key == "original_max_position_embeddings") {
      s.original_max_position_embeddings =
          arg_int(v, "scaling['original_max_position_embeddings']", 0, kMaxPositionArg);
    } else if (key == "max_position_embeddings") {
      s.max_position_embeddings =
          arg_int(v, "scaling['max_position_embeddings']", 0, kMaxPositionArg);
    } else if (key == "low_freq_factor") {
      s.low_freq_factor = arg_float(v, "scaling['low_freq_factor']");
    } else if (key == "high_freq_factor") {
      s.high_freq_factor = arg_float(v, "scaling['high_freq_factor']");
    } else if (key == "beta_fast") {
      s.beta_fast = arg_float(v, "scaling['beta_fast']");
    } else if (key == "beta_slow") {
      s.beta_slow = arg_float(v, "scaling['beta_slow']");
    } else if (key == "truncate") {
      s.truncate = arg_bool(v, "scaling['truncate']");
    } else if (key == "mscale") {
      s.mscale = arg_float(v, "scaling['mscale']");
    } else if (key == "mscale_all_dim") {
      s.mscale_all_dim = arg_float(v, "scaling['mscale_all_dim']");
    } else if (key == "attention_factor") {
      s.attention_factor = arg_float(v, "scaling['attention_factor']");
    } else if (key == "short_factor") {
      s.short_factor = v.cast<std::vector<double>>();
    } else if (key == "long_factor") {
      s.long_factor = v.cast<std::vector<double>>();
    } else if (key == "partial_rotary_factor") {
      s.partial_rotary_factor = arg_float(v, "scaling['partial_rotary_factor']");
    } else {
      throw ValueError("scaling: unknown key '" + key + "'");
    }
  }
  return s;
}

namespace {

using pb::arg;
using namespace pybind11::literals;

// ---- RoPE ------------------------------------------------------------------------------------

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

}  // namespace

RopeScalars rope_scalars(const pb::object& inverse, const pb::object& inplace,
                         const pb::object& num_threads, const pb::object& rotary_dim,
                         const pb::object& base, const pb::object& seq_len,
                         const pb::object& angles) {
  RopeScalars r;
  if (!inverse.is_none()) r.inverse = arg_bool(inverse, "inverse");
  r.inplace = arg_bool(inplace, "inplace");
  r.num_threads = static_cast<int>(arg_int(num_threads, "num_threads", 0, kMaxThreads));
  r.rotary_dim = arg_int(rotary_dim, "rotary_dim", 0, int64_t{1} << 32);
  r.base = arg_float(base, "base", /*finite=*/true, /*positive=*/true);
  if (!seq_len.is_none()) r.seq_len = arg_int(seq_len, "seq_len", 0, kMaxPositionArg);
  r.angles = arg_str(angles, "angles");
  return r;
}

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
    if (!pb::isinstance<RopeFrequencies>(freqs)) {
      throw pb::type_error("freqs: expected a posenc.RopeFrequencies, got " + type_name(freqs));
    }
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
  const RopeStyle st = !style.is_none() ? parse_style(arg_str(style, "style"))
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
      result = checked_array<double>(shape, "the result");
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
      result = checked_array<float>(shape, "the result");
    }
    View<float, 4> ov = as4<float>(result, "out");
    if (ov.shape != xv.shape) throw ShapeError("out: must have x's shape");
    pb::gil_scoped_release release;
    apply_rope(f, st, xv, ov, pp, dir, num_threads);
  }
  return result;
}

}  // namespace

void bind_rope(pb::module_& m, pb::module_& ref) {
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
               const pb::object& positions, const pb::object& inverse, const pb::object& inplace,
               const pb::object& out, const pb::object& num_threads, const pb::object& rotary_dim,
               const pb::object& base, const pb::object& scaling, const pb::object& seq_len,
               const pb::object& angles, const pb::object& config) {
      const RopeScalars a =
          rope_scalars(inverse, inplace, num_threads, rotary_dim, base, seq_len, angles);
      return rope_call(x, freqs, style, positions, a.inverse.value_or(inverse_default), a.inplace,
                       out, a.num_threads, a.rotary_dim, a.base, scaling, a.seq_len, a.angles,
                       config, force_f64);
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
          pb::array out = checked_array<double>(shape, "the result");
          auto xv = as4<double>(a, "x");
          auto ov = as4<double>(out, "out");
          pb::gil_scoped_release release;
          ref::apply_mrope(freqs, st, mr, xv, ov, pos, dir);
          return out;
        }
        pb::array a = as_array<float>(x, "x");
        std::vector<pb::ssize_t> shape(a.shape(), a.shape() + a.ndim());
        pb::array out = checked_array<float>(shape, "the result");
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
}

}  // namespace posenc::py
