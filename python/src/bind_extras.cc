// python/src/bind_extras.cc - the figures (plot/plots.h, saved through cairo) and the benchmark
// suite (bench/harness.h): the module posenc._posenc_extras (extras_module.cc), apart from the
// core extension so that the core links only the library. The demo page is the CLI's
// (posenc.demo runs the bundled `posenc demo`).
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "args.h"
#include "figure.h"
#include "harness.h"
#include "plots.h"
#include "py_common.h"

namespace posenc::py {

namespace {

using pb::arg;
using namespace pybind11::literals;

// Keyword setters of one options struct: name -> f(options, value).
template <class O>
using Setters = std::map<std::string, std::function<void(O&, const pb::handle&)>>;

#define POSENC_FIELD(O, name, type)                                            \
  {                                                                            \
#name, [](O & o, const pb::handle& v) { o.name = arg_as<type>(v, #name); } \
  }
#define POSENC_T5_FIELDS(O)                                                                     \
  {"t5_num_buckets",                                                                            \
   [](O& o, const pb::handle& v) { o.t5.num_buckets = arg_as<int64_t>(v, "t5_num_buckets"); }}, \
      {"t5_max_distance",                                                                       \
       [](O& o, const pb::handle& v) {                                                          \
         o.t5.max_distance = arg_as<int64_t>(v, "t5_max_distance");                             \
       }},                                                                                      \
  {                                                                                             \
    "t5_bidirectional", [](O& o, const pb::handle& v) {                                         \
      o.t5.bidirectional = arg_as<bool>(v, "t5_bidirectional");                                 \
    }                                                                                           \
  }
#define POSENC_DEBERTA_FIELDS(O)                                                              \
  {"deberta_max_relative_positions",                                                          \
   [](O& o, const pb::handle& v) {                                                            \
     o.deberta.max_relative_positions = arg_as<int64_t>(v, "deberta_max_relative_positions"); \
   }},                                                                                        \
  {                                                                                           \
    "deberta_position_buckets", [](O& o, const pb::handle& v) {                               \
      o.deberta.position_buckets = arg_as<int64_t>(v, "deberta_position_buckets");            \
    }                                                                                         \
  }
#define POSENC_MODEL_FIELD(O)                                                 \
  {                                                                           \
    "model", [](O& o, const pb::handle& v) { o.model = model_config_arg(v); } \
  }

template <class O>
O options_from(const std::string& fn, const Setters<O>& setters, const pb::kwargs& kw, O o = {}) {
  for (auto [k, v] : kw) {
    const std::string key = pb::str(k);
    const auto it = setters.find(key);
    if (it == setters.end()) {
      std::string names;
      for (const auto& [n, f] : setters) names += (names.empty() ? "" : ", ") + n;
      throw pb::type_error("plot." + fn + "() got an unexpected keyword argument '" + key +
                           "' (options: " + names + ")");
    }
    it->second(o, v);
  }
  return o;
}

// Saves `fig` to `out` (.png / .svg) and returns the path, or returns the PNG bytes.
pb::object finish(const plot::Figure& fig, const pb::object& out, double scale) {
  if (!out.is_none()) {
    static const pb::object& fspath = py_attr("os", "fspath");
    const std::string path = fspath(out).cast<std::string>();
    {
      pb::gil_scoped_release release;
      plot::save(fig, path, scale);
    }
    return pb::str(path);
  }
  std::vector<unsigned char> bytes;
  {
    pb::gil_scoped_release release;
    bytes = plot::render(fig, plot::Format::kPng, scale);
  }
  return pb::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

SinLayout layout_of(const pb::handle& v) { return parse_layout(arg_str(v, "layout")); }

const char* kPlotDoc =
    "(out=None, *, scale=1.0, **options): draws the figure of `posenc plot %s` "
    "(docs/plots.md). out: a .png or .svg path (written atomically; returns the path); "
    "without it returns the PNG bytes. Options: %s.";

template <class O>
void def_plot(pb::module_& plt, const std::string& name, const std::string& cli_name,
              Setters<O> setters, plot::Figure (*build)(const O&)) {
  std::string names;
  for (const auto& [n, f] : setters) names += (names.empty() ? "" : ", ") + n;
  std::string doc = name + kPlotDoc;
  doc.replace(doc.find("%s"), 2, cli_name);
  doc.replace(doc.find("%s"), 2, names);
  auto shared = std::make_shared<Setters<O>>(std::move(setters));
  plt.def(
      name.c_str(),
      [name, shared, build](const pb::object& out, double scale, const pb::kwargs& kw) {
        const O o = options_from<O>(name, *shared, kw);
        plot::Figure fig;
        {
          pb::gil_scoped_release release;
          fig = build(o);
        }
        return finish(fig, out, scale);
      },
      arg("out") = pb::none(), pb::kw_only(), arg("scale") = 1.0, doc.c_str());
}

pb::dict result_dict(const bench::Result& r) {
  pb::dict d("name"_a = r.name, "median_s"_a = r.timing.median_s, "min_s"_a = r.timing.min_s,
             "reps"_a = r.timing.reps, "threads"_a = r.threads);
  if (r.is_bandwidth()) {
    d["gbps"] = r.gbps();
  } else {
    d["gflops"] = r.gflops();
  }
  d["baselines"] = r.baselines;
  for (const auto& [k, v] : r.extra) d[pb::str(k)] = v;
  for (const auto& [k, v] : r.info) d[pb::str(k)] = v;
  return d;
}

}  // namespace

void bind_extras(pb::module_& m) {
  // ---- figures ----
  pb::module_ plt = m.def_submodule("plot", "Figures (PNG / SVG through cairo)");
  using HO = plot::HeatmapOptions;
  def_plot<HO>(
      plt, "heatmap", "heatmap",
      {POSENC_FIELD(HO, length, int64_t),
       POSENC_FIELD(HO, dim, int64_t),
       POSENC_FIELD(HO, base, double),
       {"layout", [](HO& o, const pb::handle& v) { o.layout = layout_of(v); }},
       {"preset",
        [](HO& o, const pb::handle& v) { o = plot::heatmap_preset(arg_str(v, "preset")); }},
       POSENC_FIELD(HO, table_name, std::string),
       {"colormap",
        [](HO& o, const pb::handle& v) {
          const std::string c = arg_str(v, "colormap");
          if (c != "viridis" && c != "diverging") {
            throw ValueError("colormap: '" + c + "' (viridis or diverging)");
          }
          o.colormap = c == "viridis" ? plot::Colormap::kViridis : plot::Colormap::kDiverging;
        }},
       POSENC_FIELD(HO, width, double),
       POSENC_FIELD(HO, height, double)},
      &plot::heatmap_figure);
  // A learned table: its own function so the array stays alive during the call.
  plt.def(
      "heatmap_table",
      [](const pb::object& table, const pb::object& out, double scale, int64_t length,
         const std::string& table_name, double width, double height) {
        pb::array t = as_array<float>(table, "table");
        HO o;
        o.table = view_of<const float, 2>(t, "table", "[max_positions, dim]");
        o.length = length;
        o.table_name = table_name;
        o.width = width;
        o.height = height;
        plot::Figure fig;
        {
          pb::gil_scoped_release release;
          fig = plot::heatmap_figure(o);
        }
        return finish(fig, out, scale);
      },
      arg("table"), arg("out") = pb::none(), pb::kw_only(), arg("scale") = 1.0, arg("length") = 64,
      arg("table_name") = "learned table", arg("width") = 800.0, arg("height") = 0.0,
      "heatmap_table(table, out=None, *, length=64, ...): the heat map of a learned table "
      "[max_positions, dim] (rows shown: min(length, max_positions); length 0: all).");
  using CO = plot::ClockOptions;
  def_plot<CO>(plt, "clock", "clock",
               {POSENC_FIELD(CO, dim, int64_t),
                POSENC_FIELD(CO, base, double),
                {"layout", [](CO& o, const pb::handle& v) { o.layout = layout_of(v); }},
                POSENC_FIELD(CO, positions, std::vector<int64_t>),
                POSENC_FIELD(CO, embedding_x, double),
                POSENC_FIELD(CO, embedding_y, double),
                POSENC_FIELD(CO, circle_positions, int64_t),
                POSENC_FIELD(CO, embedding_panel, bool),
                POSENC_FIELD(CO, columns, int),
                POSENC_FIELD(CO, width, double),
                POSENC_FIELD(CO, height, double)},
               &plot::clock_figure);
  using SO = plot::SimilarityOptions;
  def_plot<SO>(
      plt, "similarity", "similarity",
      {POSENC_FIELD(SO, scheme, std::string), POSENC_FIELD(SO, max_offset, int64_t),
       POSENC_FIELD(SO, dim, int64_t), POSENC_FIELD(SO, base, double),
       POSENC_FIELD(SO, heads, int64_t), POSENC_T5_FIELDS(SO), POSENC_FIELD(SO, shaw_k, int64_t),
       POSENC_DEBERTA_FIELDS(SO), POSENC_MODEL_FIELD(SO), POSENC_FIELD(SO, model_name, std::string),
       POSENC_FIELD(SO, seed, uint64_t), POSENC_FIELD(SO, width, double),
       POSENC_FIELD(SO, height, double)},
      &plot::similarity_figure);
  using RO = plot::RopeRotationOptions;
  def_plot<RO>(plt, "rope_rotation", "rope-rotation",
               {POSENC_FIELD(RO, head_dim, int64_t), POSENC_FIELD(RO, base, double),
                POSENC_FIELD(RO, positions, int64_t), POSENC_FIELD(RO, pairs, std::vector<int64_t>),
                POSENC_MODEL_FIELD(RO), POSENC_FIELD(RO, model_name, std::string),
                POSENC_FIELD(RO, width, double), POSENC_FIELD(RO, height, double)},
               &plot::rope_rotation_figure);
  using BO = plot::BiasOptions;
  def_plot<BO>(plt, "bias", "bias",
               {POSENC_FIELD(BO, scheme, std::string), POSENC_FIELD(BO, length, int64_t),
                POSENC_FIELD(BO, causal, bool), POSENC_FIELD(BO, heads, int64_t),
                POSENC_T5_FIELDS(BO), POSENC_FIELD(BO, shaw_k, int64_t), POSENC_DEBERTA_FIELDS(BO),
                POSENC_MODEL_FIELD(BO), POSENC_FIELD(BO, model_name, std::string),
                POSENC_FIELD(BO, width, double), POSENC_FIELD(BO, height, double)},
               &plot::bias_figure);
  using AO = plot::AttentionPlotOptions;
  def_plot<AO>(plt, "attention", "attention",
               {POSENC_FIELD(AO, length, int64_t), POSENC_FIELD(AO, head_dim, int64_t),
                POSENC_FIELD(AO, causal, bool), POSENC_FIELD(AO, content, std::string),
                POSENC_FIELD(AO, base, double), POSENC_FIELD(AO, seed, uint64_t),
                POSENC_FIELD(AO, width, double), POSENC_FIELD(AO, height, double)},
               &plot::attention_figure);
  using EO = plot::ExtrapolationOptions;
  def_plot<EO>(plt, "extrapolation", "extrapolation",
               {POSENC_FIELD(EO, train_length, int64_t), POSENC_FIELD(EO, max_length, int64_t),
                POSENC_FIELD(EO, dim, int64_t), POSENC_FIELD(EO, base, double),
                POSENC_FIELD(EO, heads, int64_t), POSENC_T5_FIELDS(EO),
                POSENC_FIELD(EO, shaw_k, int64_t), POSENC_FIELD(EO, rope_scaling, double),
                POSENC_FIELD(EO, width, double), POSENC_FIELD(EO, height, double)},
               &plot::extrapolation_figure);
  plt.attr("kinds") = plot::plot_kinds();

  // ---- benchmarks ----
  m.def(
      "_bench_suite",
      [](int threads, bool quick, const std::string& filter) {
        bench::SuiteOptions o;
        o.threads = bench::resolve_threads(threads);
        o.quick = quick;
        o.filter = filter;
        pb::list entries;
        for (const bench::Entry& e : bench::suite(o)) {
          auto run = e.run;
          entries.append(pb::make_tuple(e.name, pb::cpp_function([run]() {
                                          bench::Result r;
                                          {
                                            pb::gil_scoped_release release;
                                            r = run();
                                          }
                                          return result_dict(r);
                                        })));
        }
        return entries;
      },
      arg("threads") = 0, arg("quick") = false, arg("filter") = "");
  m.def("_simd_target", &bench::simd_target);
}

}  // namespace posenc::py
