// plot/plots.cc - the figures of posenc (see plots.h). Numbers come from the public API; this
// file arranges them into panels.
#include "plots.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "posenc/alibi.h"
#include "posenc/attention.h"
#include "posenc/check.h"
#include "posenc/error.h"
#include "posenc/learned.h"
#include "posenc/names.h"
#include "posenc/rope.h"
#include "posenc/schemes.h"
#include "posenc/shaw.h"
#include "posenc/xl.h"

namespace posenc::plot {

namespace {

constexpr double kPi = 3.14159265358979323846;
const Color kGrey{0.55, 0.55, 0.55, 1};
const Color kDark{0.15, 0.15, 0.15, 1};

void require(bool ok, const std::string& message) {
  if (!ok) throw ValueError(message);
}

// Integers as integers, else 4 significant digits ("10000", "0.0039", "1e+06").
// The schemes whose relative term is an additive [Lq, Lk] bias or index map (the registry's
// bias_map), and names for messages: "alibi, t5, shaw or deberta".
std::vector<std::string> bias_map_schemes() {
  std::vector<std::string> out;
  for (const SchemeInfo& s : attention_schemes()) {
    if (s.bias_map) out.push_back(s.name);
  }
  return out;
}
std::string names_text(const std::vector<std::string>& names) {
  std::string s;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i > 0) s += i + 1 == names.size() ? " or " : ", ";
    s += names[i];
  }
  return s;
}

std::string num(double v) {
  char buf[64];
  if (std::fabs(v) < 1e7 && v == std::round(v)) {
    std::snprintf(buf, sizeof(buf), "%.0f", v);
  } else {
    std::snprintf(buf, sizeof(buf), "%.4g", v);
  }
  std::string s = buf;
  if (!s.empty() && s[0] == '-') s = "\u2212" + s.substr(1);
  return s;
}

std::vector<double> randn(std::mt19937_64& rng, int64_t n, double sd = 1.0) {
  std::normal_distribution<double> nd(0.0, sd);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (double& x : v) x = nd(rng);
  return v;
}

std::vector<float> to_float(const std::vector<double>& v) {
  std::vector<float> f(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) f[i] = static_cast<float>(v[i]);
  return f;
}

std::vector<double> offsets(int64_t k) {
  std::vector<double> x;
  for (int64_t i = -k; i <= k; ++i) x.push_back(static_cast<double>(i));
  return x;
}

double auto_height(double height, double computed) { return height > 0 ? height : computed; }

// A line series.
Series line(std::vector<double> x, std::vector<double> y, const std::string& label, Color c,
            double width = 2.0, LineStyle style = LineStyle::kSolid) {
  Series s;
  s.x = std::move(x);
  s.y = std::move(y);
  s.label = label;
  s.color = c;
  s.width = width;
  s.style = style;
  return s;
}

// Three dash styles so that coinciding curves stay visible: a wide pale line under a dashed
// and a dotted one.
void overlay_style(Series& s, int i) {
  if (i == 0) {
    s.width = 5;
    s.color.a = 0.45;
  } else {
    s.width = 2;
    s.style = i == 1 ? LineStyle::kDashed : LineStyle::kDotted;
  }
}

// Up to `at_most` heads of h, evenly spaced from the first to the last (distinct, in order).
std::vector<int64_t> some_heads(int64_t h, std::size_t at_most) {
  std::vector<int64_t> out;
  const auto n = static_cast<int64_t>(std::min<std::size_t>(at_most, static_cast<std::size_t>(h)));
  for (int64_t k = 0; k < n; ++k) {
    const int64_t v = n == 1 ? 0 : (k * (h - 1) + (n - 1) / 2) / (n - 1);
    if (out.empty() || out.back() != v) out.push_back(v);
  }
  return out;
}

RopeFrequencies model_or_default_rope(const std::optional<ModelConfig>& model, int64_t head_dim,
                                      double base, RopeStyle* style, int64_t* dim) {
  if (model) {
    *style = model->rope.style;
    *dim = model->rope.head_dim;
    return model_rope_frequencies(*model);
  }
  RopeConfig cfg;
  cfg.head_dim = head_dim;
  cfg.base = base;
  *style = cfg.style;
  *dim = head_dim;
  return rope_frequencies(cfg);
}

// Panels of one model: its scheme only; `kind` names the plot for messages.
std::string model_scheme(const std::optional<ModelConfig>& model, const std::string& requested,
                         const std::string& kind, const std::string& model_name,
                         const std::vector<std::string>& supported) {
  if (!model) return requested;
  const std::string s = model_scheme_name(model->scheme);
  if (requested != "all" && requested != s) {
    throw ValueError(kind + ": --scheme " + requested + " conflicts with the model (" + model_name +
                     " is " + model->model_type + ", scheme " + s + ")");
  }
  if (std::find(supported.begin(), supported.end(), s) == supported.end()) {
    std::string list;
    for (const auto& x : supported) list += (list.empty() ? "" : ", ") + x;
    throw ValueError(kind + ": " + model_name + " (" + model->model_type + ") uses " + s +
                     " positions, which this plot does not show (it shows " + list + ")");
  }
  return s;
}

// Extends the y range above the data by `fraction` of its span: room for the legend.
void add_headroom(Panel& p, double fraction) {
  double lo = INFINITY, hi = -INFINITY;
  for (const Series& s : p.series) {
    for (double v : s.y) {
      if (std::isfinite(v)) {
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
    }
  }
  if (!(hi > lo)) return;
  const double span = hi - lo;
  p.y.range = Range{lo - 0.05 * span, hi + fraction * span};
}

// ---------------------------------------------------------------------------------------------
// Scores from ref::attention_scores: one query at position `pos_q` against one key per position
// in `key_pos`, content broadcast from single vectors (stride 0 over the sequence).
std::vector<double> scores_vs_keys(const std::vector<double>& q, const std::vector<double>& k,
                                   int64_t heads, int64_t dim, const PositionScheme& scheme,
                                   int64_t pos_q, const std::vector<int64_t>& key_pos, int64_t head,
                                   double scale) {
  const auto n = static_cast<int64_t>(key_pos.size());
  const View<const double, 4> qv{q.data(), {1, 1, heads, dim}, {heads * dim, heads * dim, dim, 1}};
  const View<const double, 4> kv{k.data(), {1, n, heads, dim}, {heads * dim, 0, dim, 1}};
  const Positions qp = Positions::shared({pos_q});
  const Positions kp = Positions::shared(key_pos);
  AttentionOptions opt;
  opt.scale = scale;
  return ref::attention_scores(qv, kv, scheme, opt, 0, head, &qp, &kp);
}

// ---------------------------------------------------------------------------------------------
// Heat map helpers.

Panel heat_panel(const std::string& title, int64_t rows, int64_t cols, std::vector<double> values,
                 const std::string& xlabel, const std::string& ylabel) {
  Panel p;
  p.title = title;
  p.y_down = true;
  p.equal_aspect = true;  // square cells
  p.x.label = xlabel;
  p.y.label = ylabel;
  p.x.integer_ticks = true;
  p.y.integer_ticks = true;
  HeatMap h;
  h.rows = rows;
  h.cols = cols;
  h.values = std::move(values);
  p.heatmap = std::move(h);
  return p;
}

}  // namespace

const std::vector<std::string>& plot_kinds() {
  static const std::vector<std::string> kinds = {
      "heatmap", "clock", "similarity", "rope-rotation", "bias", "attention", "extrapolation"};
  return kinds;
}

// ---------------------------------------------------------------------------------------------
// heatmap

HeatmapOptions heatmap_preset(const std::string& name) {
  HeatmapOptions o;
  if (name == "small") {
    o.length = 16;
    o.dim = 32;
  } else if (name == "paper") {
    o.length = 128;
    o.dim = 512;
  } else {
    throw ValueError("heatmap: unknown preset '" + name + "' (use small or paper)");
  }
  return o;
}

Figure heatmap_figure(const HeatmapOptions& o) {
  Figure fig;
  fig.width = o.width;
  int64_t rows = 0, cols = 0;
  std::vector<double> values;
  Panel p;
  if (o.table) {
    const View<const float, 2>& t = *o.table;
    require(t.shape[0] >= 1 && t.shape[1] >= 1,
            "heatmap: the table is empty " + shape_str(t.shape));
    require(o.length >= 0, "heatmap: --length must be >= 0 (got " + std::to_string(o.length) + ")");
    rows = o.length == 0 ? t.shape[0] : std::min(o.length, t.shape[0]);
    cols = t.shape[1];
    require(rows * cols <= (int64_t{1} << 22), "heatmap: at most 4194304 cells (got " +
                                                   std::to_string(rows) + " x " +
                                                   std::to_string(cols) + ")");
    values.resize(static_cast<std::size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        values[static_cast<std::size_t>(r * cols + c)] = static_cast<double>(t(r, c));
      }
    }
    fig.title = "Learned position table: " + o.table_name;
    fig.subtitle = "rows 0.." + std::to_string(rows - 1) + " of " + std::to_string(t.shape[0]) +
                   " positions, " + std::to_string(cols) + " dims: y = x + W[p]";
    p = heat_panel("", rows, cols, std::move(values), "dimension", "position p");
    p.equal_aspect = false;
    p.heatmap->colormap = o.colormap.value_or(Colormap::kDiverging);
    p.heatmap->colorbar_label = "W[p, i]";
  } else {
    require(o.length >= 1 && o.length <= 65536,
            "heatmap: --length must be in [1, 65536] (got " + std::to_string(o.length) + ")");
    SinusoidalConfig cfg;
    cfg.dim = o.dim;
    cfg.base = o.base;
    cfg.layout = o.layout;
    validate(cfg);
    require(o.length * o.dim <= (int64_t{1} << 22), "heatmap: at most 4194304 cells (got " +
                                                        std::to_string(o.length) + " x " +
                                                        std::to_string(o.dim) + ")");
    const std::vector<float> pe = sinusoidal_table(cfg, o.length);
    rows = o.length;
    cols = o.dim;
    values.assign(pe.begin(), pe.end());
    fig.title = "Sinusoidal positional encoding: " + std::to_string(rows) + " positions \u00d7 " +
                std::to_string(cols) + " dims";
    fig.subtitle =
        (o.layout == SinLayout::kInterleaved
             ? std::string(
                   "PE[p, 2i] = sin(p\u00b7\u03c9\u1d62), PE[p, 2i+1] = cos(p\u00b7\u03c9\u1d62)")
             : std::string("PE[p, i] = sin(p\u00b7\u03c9\u1d62), PE[p, d/2+i] = "
                           "cos(p\u00b7\u03c9\u1d62)")) +
        ", \u03c9\u1d62 = " + num(o.base) + "^(\u22122i/d), " + layout_name(o.layout) + " layout";
    p = heat_panel("", rows, cols, std::move(values), "dimension", "position p");
    p.equal_aspect = false;
    p.heatmap->colormap = o.colormap.value_or(Colormap::kViridis);
    p.heatmap->value_range = Range{-1, 1};
    p.heatmap->colorbar_label = "PE(p, i)";
  }
  fig.panels.push_back(std::move(p));
  // Height from the table's aspect: square cells when that fits in [240, 560] px of plot.
  const double plot_w = o.width - 150;
  const double plot_h =
      std::clamp(plot_w * static_cast<double>(rows) / static_cast<double>(cols), 240.0, 560.0);
  fig.height = auto_height(o.height, plot_h + 128);
  return fig;
}

// ---------------------------------------------------------------------------------------------
// clock

double clock_hand_length(int64_t pair, int64_t hands) {
  if (hands <= 1) return 1.0;
  return 1.0 - 0.45 * static_cast<double>(pair) / static_cast<double>(hands - 1);
}

Color clock_hand_color(int64_t pair, int64_t hands) {
  if (hands <= 8) return category_color(static_cast<int>(pair));
  return colormap_color(Colormap::kViridis,
                        0.85 * static_cast<double>(pair) / static_cast<double>(hands - 1));
}

Figure clock_figure(const ClockOptions& o) {
  SinusoidalConfig cfg;
  cfg.dim = o.dim;
  cfg.base = o.base;
  cfg.layout = o.layout;
  validate(cfg);
  require(o.dim <= 4096, "clock: --dim must be <= 4096 (got " + std::to_string(o.dim) + ")");
  require(!o.positions.empty() && o.positions.size() <= 16,
          "clock: --positions must list 1 to 16 positions (got " +
              std::to_string(o.positions.size()) + ")");
  for (int64_t p : o.positions) {
    require(p >= 0 && p <= kMaxPosition,
            "clock: positions must be in [0, 2^48] (got " + std::to_string(p) + ")");
  }
  require(o.circle_positions >= 1 && o.circle_positions <= 64,
          "clock: circle positions must be in [1, 64] (got " + std::to_string(o.circle_positions) +
              ")");
  require(std::isfinite(o.embedding_x) && std::isfinite(o.embedding_y),
          "clock: the embedding must be finite");
  require(o.columns >= 1, "clock: columns must be >= 1");
  const int64_t d = o.dim, hands = d / 2;
  const auto n = static_cast<int64_t>(o.positions.size());
  std::vector<float> pe(static_cast<std::size_t>(n * d));
  sinusoidal_encode(cfg, o.positions, View<float, 2>::contiguous(pe.data(), {n, d}));
  const std::vector<double> w = sinusoidal_frequencies(cfg);
  auto sin_index = [&](int64_t i) { return o.layout == SinLayout::kInterleaved ? 2 * i : i; };
  auto cos_index = [&](int64_t i) {
    return o.layout == SinLayout::kInterleaved ? 2 * i + 1 : hands + i;
  };

  Figure fig;
  fig.width = o.width;
  fig.columns = o.columns;
  fig.title = "The clock with many hands: sinusoidal PE, d = " + std::to_string(d) + " (" +
              std::to_string(hands) + " hands)";
  fig.subtitle =
      "hand i points at (sin p\u00b7\u03c9\u1d62, cos p\u00b7\u03c9\u1d62): 12 o'clock at "
      "p = 0, clockwise by \u03c9\u1d62 = " +
      num(o.base) + "^(\u22122i/d) rad per position";
  for (int64_t k = 0; k < n; ++k) {
    Panel p;
    p.title = "p = " + std::to_string(o.positions[static_cast<std::size_t>(k)]);
    p.equal_aspect = true;
    p.x.range = Range{-1.18, 1.18};
    p.y.range = Range{-1.18, 1.18};
    p.x.ticks = {-1, 0, 1};
    p.y.ticks = {-1, 0, 1};
    p.x.label = "sin";
    p.y.label = "cos";
    p.legend = LegendPlace::kNone;
    p.circles.push_back({0, 0, 1, kGrey, 1.2, LineStyle::kSolid, std::nullopt});
    // Hour marks.
    for (int h = 0; h < 12; ++h) {
      const double a = 2 * kPi * h / 12.0;
      p.series.push_back(
          line({0.9 * std::sin(a), std::sin(a)}, {0.9 * std::cos(a), std::cos(a)}, "", kGrey, 1.2));
    }
    // Slow hands first so that the fast ones stay on top.
    for (int64_t i = hands - 1; i >= 0; --i) {
      const auto row = static_cast<std::size_t>(k * d);
      const double s = pe[row + static_cast<std::size_t>(sin_index(i))];
      const double c = pe[row + static_cast<std::size_t>(cos_index(i))];
      const double len = clock_hand_length(i, hands);
      const Color col = clock_hand_color(i, hands);
      Arrow a;
      a.x1 = len * s;
      a.y1 = len * c;
      a.color = col;
      a.width = hands <= 16 ? 2.6 : 1.4;
      a.head = hands <= 16;
      p.arrows.push_back(a);
      Series tip;
      tip.x = {s};
      tip.y = {c};
      tip.line = false;
      tip.marker = Marker::kCircle;
      tip.marker_size = 3;
      tip.color = col;
      p.series.push_back(tip);
    }
    Series hub;
    hub.x = {0};
    hub.y = {0};
    hub.line = false;
    hub.marker = Marker::kCircle;
    hub.color = kDark;
    p.series.push_back(hub);
    fig.panels.push_back(std::move(p));
  }
  // Legend of the hands: every hand when there are few, else a sample.
  std::vector<int64_t> shown;
  if (hands <= 10) {
    for (int64_t i = 0; i < hands; ++i) shown.push_back(i);
  } else {
    for (int64_t i : {int64_t{0}, hands / 8, hands / 4, hands / 2, hands - 1}) shown.push_back(i);
  }
  for (int64_t i : shown) {
    LegendEntry e;
    e.label = "i=" + std::to_string(i) + " (\u03c9=" + num(w[static_cast<std::size_t>(i)]) + ")";
    e.color = clock_hand_color(i, hands);
    fig.legend.push_back(e);
  }

  if (o.embedding_panel) {
    // x [1, N, d]: the same word embedding at every position (its first two dims set, the rest
    // zero), then add_sinusoidal adds PE(p) to row p.
    const int64_t m = o.circle_positions;
    std::vector<float> x(static_cast<std::size_t>(m * d), 0.0f);
    for (int64_t r = 0; r < m; ++r) {
      x[static_cast<std::size_t>(r * d + sin_index(0))] = static_cast<float>(o.embedding_x);
      x[static_cast<std::size_t>(r * d + cos_index(0))] = static_cast<float>(o.embedding_y);
    }
    add_sinusoidal(cfg, View<float, 3>::contiguous(x.data(), {1, m, d}));
    Panel p;
    p.title = "embedding + PE";
    p.equal_aspect = true;
    p.x.label = "dim 0";
    p.y.label = "dim 1";
    const double ex = o.embedding_x, ey = o.embedding_y;
    p.circles.push_back({ex, ey, 1, kGrey, 1.2, LineStyle::kDashed, std::nullopt});
    Series pts;
    pts.line = false;
    pts.marker = Marker::kCircle;
    pts.marker_size = 3.5;
    pts.color = category_color(1);
    pts.label = "e + PE(p)";
    for (int64_t r = 0; r < m; ++r) {
      const double px = x[static_cast<std::size_t>(r * d + sin_index(0))];
      const double py = x[static_cast<std::size_t>(r * d + cos_index(0))];
      Arrow a;
      a.x1 = px;
      a.y1 = py;
      a.color = rgb(0xe0562a, 0.35);
      a.width = 1.2;
      a.head = false;
      p.arrows.push_back(a);
      pts.x.push_back(px);
      pts.y.push_back(py);
      if (r < 8) {
        const double dx = px - ex, dy = py - ey;
        p.texts.push_back({ex + 1.22 * dx, ey + 1.22 * dy, std::to_string(r), kDark, 11.5,
                           Anchor::kCenter, false});
      }
    }
    Arrow e;
    e.x1 = ex;
    e.y1 = ey;
    e.color = kDark;
    e.width = 2.4;
    p.arrows.push_back(e);
    p.series.push_back(pts);
    Series dummy = line({}, {}, "word embedding e", kDark, 2.4);
    p.series.push_back(dummy);
    p.ref_lines.push_back({false, 0, rgb(0xbbbbbb), 1, LineStyle::kSolid, ""});
    p.ref_lines.push_back({true, 0, rgb(0xbbbbbb), 1, LineStyle::kSolid, ""});
    const double lo = std::min({0.0, ex - 1.35, ey - 1.35}), hi = std::max({ex + 1.35, ey + 1.35});
    p.x.range = Range{lo, hi};
    p.y.range = Range{lo, hi};
    p.legend = LegendPlace::kNone;
    fig.panels.push_back(std::move(p));
    LegendEntry le;
    le.label = "embedding e; e + PE(p) on a unit circle around e (p labelled)";
    le.color = category_color(1);
    le.marker = Marker::kCircle;
    le.line = false;
    fig.legend.push_back(le);
  }
  const int cols = std::min<int>(o.columns, static_cast<int>(fig.panels.size()));
  const int rows = (static_cast<int>(fig.panels.size()) + cols - 1) / cols;
  const double cell = o.width / cols;
  fig.height = auto_height(o.height, rows * (cell + 22) + 96 + (hands > 6 ? 20 : 0));
  return fig;
}

// ---------------------------------------------------------------------------------------------
// similarity

namespace {

Panel sinusoidal_similarity(const SimilarityOptions& o) {
  SinusoidalConfig cfg;
  cfg.dim = o.dim;
  cfg.base = o.base;
  validate(cfg);
  Panel p;
  p.title = "sinusoidal: PE(p)\u00b7PE(p+k), d = " + std::to_string(o.dim);
  p.x.label = "offset k";
  p.y.label = "dot product";
  const std::vector<double> ks = offsets(o.max_offset);
  const std::vector<int64_t> ps = {o.max_offset, 1000 + o.max_offset, 100000};
  for (std::size_t i = 0; i < ps.size(); ++i) {
    std::vector<double> y;
    for (double k : ks) {
      y.push_back(sinusoidal_dot(o.dim, ps[i], ps[i] + static_cast<int64_t>(k)));
    }
    Series s =
        line(ks, y, "p = " + num(static_cast<double>(ps[i])), category_color(static_cast<int>(i)));
    overlay_style(s, static_cast<int>(i));
    p.series.push_back(s);
  }
  if (o.base != 1e4) p.title += ", base " + num(o.base);
  return p;
}

Panel rope_similarity(const SimilarityOptions& o) {
  RopeStyle style;
  int64_t dim = 0;
  const RopeFrequencies freqs = model_or_default_rope(o.model, o.dim, o.base, &style, &dim);
  std::mt19937_64 rng(o.seed);
  const std::vector<double> q = randn(rng, dim), k = randn(rng, dim);
  Panel p;
  p.title = "RoPE: \u27e8rope(q,m), rope(k,m+k)\u27e9";
  p.x.label = "offset k = n \u2212 m";
  p.y.label = "q\u00b7k after rotation";
  const std::vector<double> ks = offsets(o.max_offset);
  const std::vector<int64_t> ms = {o.max_offset, 1000 + o.max_offset, 100000};
  for (std::size_t i = 0; i < ms.size(); ++i) {
    std::vector<int64_t> kp;
    for (double x : ks) kp.push_back(ms[i] + static_cast<int64_t>(x));
    const std::vector<double> y =
        scores_vs_keys(q, k, 1, dim, Rope{freqs, style}, ms[i], kp, 0, 1.0);
    Series s =
        line(ks, y, "m = " + num(static_cast<double>(ms[i])), category_color(static_cast<int>(i)));
    overlay_style(s, static_cast<int>(i));
    p.series.push_back(s);
  }
  return p;
}

Panel alibi_similarity(const SimilarityOptions& o) {
  AlibiConfig cfg;
  cfg.heads = o.model ? o.model->alibi.heads : o.heads;
  cfg.max_bias = o.model ? o.model->alibi.max_bias : 8.0;
  const std::vector<double> slopes = alibi_slopes(cfg);
  Panel p;
  p.title = "ALiBi: bias \u2212m\u2095|k|, " + std::to_string(cfg.heads) + " heads";
  p.x.label = "offset k";
  p.y.label = "bias";
  const std::vector<double> ks = offsets(o.max_offset);
  const auto heads = some_heads(cfg.heads, 4);
  for (std::size_t i = 0; i < heads.size(); ++i) {
    const double m = slopes[static_cast<std::size_t>(heads[i])];
    std::vector<double> y;
    for (double k : ks) y.push_back(alibi_bias(m, 0, static_cast<int64_t>(k)));
    p.series.push_back(line(ks, y, "head " + std::to_string(heads[i] + 1) + " (m=" + num(m) + ")",
                            category_color(static_cast<int>(i))));
  }
  return p;
}

Panel t5_similarity(const SimilarityOptions& o) {
  T5BucketConfig cfg = o.model ? o.model->t5 : o.t5;
  cfg.bidirectional = true;
  validate(cfg);
  T5BucketConfig causal = cfg;
  causal.bidirectional = false;
  Panel p;
  p.title = "T5: bucket of k (" + std::to_string(cfg.num_buckets) + " buckets, max " +
            std::to_string(cfg.max_distance) + ")";
  p.x.label = "offset k = pos_k \u2212 pos_q";
  p.y.label = "bucket";
  const int64_t kmax = std::max<int64_t>(o.max_offset, cfg.max_distance + cfg.max_distance / 2);
  const std::vector<double> ks = offsets(kmax);
  std::vector<double> yb, yc;
  for (double k : ks) {
    yb.push_back(static_cast<double>(t5_bucket(static_cast<int64_t>(k), cfg)));
    yc.push_back(static_cast<double>(t5_bucket(static_cast<int64_t>(k), causal)));
  }
  Series b = line(ks, yb, "bidirectional", category_color(0));
  b.step = true;
  Series c = line(ks, yc, "causal", category_color(1), 2.0, LineStyle::kDashed);
  c.step = true;
  p.series.push_back(b);
  p.series.push_back(c);
  p.ref_lines.push_back({true, static_cast<double>(cfg.max_distance), kGrey, 1, LineStyle::kDotted,
                         "\u00b1max_distance"});
  p.ref_lines.push_back(
      {true, -static_cast<double>(cfg.max_distance), kGrey, 1, LineStyle::kDotted, ""});
  p.y.integer_ticks = true;
  return p;
}

Panel shaw_similarity(const SimilarityOptions& o) {
  require(o.shaw_k >= 1 && o.shaw_k <= 4096,
          "similarity: --shaw-k must be in [1, 4096] (got " + std::to_string(o.shaw_k) + ")");
  const int64_t kk = o.shaw_k, dim = 16, heads = 3;
  std::mt19937_64 rng(o.seed + 1);
  const std::vector<float> table = to_float(randn(rng, (2 * kk + 1) * dim));
  const std::vector<double> q = randn(rng, heads * dim);
  const std::vector<double> k(static_cast<std::size_t>(heads * dim), 0.0);  // content off
  Shaw s;
  s.rel_k = shaw_table(View<const float, 2>::contiguous(table.data(), {2 * kk + 1, dim}));
  Panel p;
  p.title = "Shaw: q\u00b7rel_k[clip(k, \u00b1" + std::to_string(kk) + ")], random q, table";
  p.x.label = "offset k = pos_k \u2212 pos_q";
  p.y.label = "relative score";
  const int64_t kmax = 3 * kk;  // the clipped ends and the detail in between
  const std::vector<double> ks = offsets(kmax);
  const int64_t pos_q = kmax;
  std::vector<int64_t> kp;
  for (double x : ks) kp.push_back(pos_q + static_cast<int64_t>(x));
  for (int64_t h = 0; h < heads; ++h) {
    const std::vector<double> y = scores_vs_keys(q, k, heads, dim, s, pos_q, kp, h, 1.0);
    p.series.push_back(
        line(ks, y, "head " + std::to_string(h + 1), category_color(static_cast<int>(h))));
  }
  p.ref_lines.push_back({true, static_cast<double>(kk), kGrey, 1, LineStyle::kDotted, ""});
  p.ref_lines.push_back({true, -static_cast<double>(kk), kGrey, 1, LineStyle::kDotted, ""});
  add_headroom(p, 0.45);
  return p;
}

Panel deberta_similarity(const SimilarityOptions& o) {
  const DebertaBuckets cfg = o.model ? o.model->deberta : o.deberta;
  validate(cfg);
  const int64_t span = cfg.span();
  Panel p;
  p.title = "DeBERTa: relative position seen";
  p.x.label = "offset k = pos_k \u2212 pos_q";
  p.y.label = "\u03c1 after bucketing";
  const int64_t kmax = std::max<int64_t>(o.max_offset, cfg.max_relative_positions * 3 / 2);
  const std::vector<double> ks = offsets(kmax);
  std::vector<double> yb, yc;
  for (double k : ks) {
    const auto ki = static_cast<int64_t>(k);
    yb.push_back(static_cast<double>(deberta_bucket(-ki, cfg)));
    yc.push_back(static_cast<double>(deberta_c2p_index(kmax, kmax + ki, cfg) - span));
  }
  std::string name = cfg.position_buckets > 0
                         ? "log buckets (" + std::to_string(cfg.position_buckets) + ", max " +
                               std::to_string(cfg.max_relative_positions) + ")"
                         : "no buckets";
  Series b = line(ks, yb, name, category_color(0), 4.0);
  b.color.a = 0.5;
  b.step = true;
  Series c = line(ks, yc, "c2p row \u2212 K (clipped)", category_color(1), 2.0, LineStyle::kDashed);
  c.step = true;
  p.series.push_back(b);
  p.series.push_back(c);
  return p;
}

}  // namespace

Figure similarity_figure(const SimilarityOptions& o) {
  static const std::vector<std::string> all = {"sinusoidal", "rope", "alibi",
                                               "t5",         "shaw", "deberta"};
  require(o.scheme == "all" || std::find(all.begin(), all.end(), o.scheme) != all.end(),
          "similarity: unknown scheme '" + o.scheme +
              "' (use all, sinusoidal, rope, alibi, t5, shaw or deberta)");
  require(
      o.max_offset >= 1 && o.max_offset <= 100000,
      "similarity: --max-offset must be in [1, 100000] (got " + std::to_string(o.max_offset) + ")");
  require(o.heads >= 1, "similarity: --heads must be >= 1 (got " + std::to_string(o.heads) + ")");
  const std::string scheme = model_scheme(o.model, o.scheme, "similarity", o.model_name,
                                          {"rope", "alibi", "t5", "deberta"});
  Figure fig;
  fig.width = o.width;
  fig.title = "Scores against the offset between two positions";
  fig.subtitle = o.model ? o.model_name + " (" + o.model->model_type + ")"
                         : "each curve depends only on k: the position p (or m) does not move it";
  std::vector<std::string> schemes = scheme == "all" ? all : std::vector<std::string>{scheme};
  for (const auto& s : schemes) {
    if (s == "sinusoidal") fig.panels.push_back(sinusoidal_similarity(o));
    if (s == "rope") fig.panels.push_back(rope_similarity(o));
    if (s == "alibi") fig.panels.push_back(alibi_similarity(o));
    if (s == "t5") fig.panels.push_back(t5_similarity(o));
    if (s == "shaw") fig.panels.push_back(shaw_similarity(o));
    if (s == "deberta") fig.panels.push_back(deberta_similarity(o));
  }
  fig.columns = fig.panels.size() > 1 ? 2 : 1;
  const double rows = std::ceil(static_cast<double>(fig.panels.size()) / fig.columns);
  fig.height = auto_height(o.height, rows * 290 + 60);
  return fig;
}

// ---------------------------------------------------------------------------------------------
// rope-rotation

Figure rope_rotation_figure(const RopeRotationOptions& o) {
  require(
      o.positions >= 2 && o.positions <= 4096,
      "rope-rotation: --positions must be in [2, 4096] (got " + std::to_string(o.positions) + ")");
  RopeStyle style;
  int64_t dim = 0;
  const RopeFrequencies freqs = model_or_default_rope(o.model, o.head_dim, o.base, &style, &dim);
  const int64_t half = freqs.rotary_dim() / 2;
  std::vector<int64_t> pairs = o.pairs;
  if (pairs.empty()) {
    for (int64_t i : {int64_t{0}, half / 8, half / 4, half / 2}) {
      const int64_t c = std::min(i, half - 1);
      if (std::find(pairs.begin(), pairs.end(), c) == pairs.end()) pairs.push_back(c);
    }
  }
  require(pairs.size() <= 8, "rope-rotation: at most 8 pairs");
  for (int64_t i : pairs) {
    require(i >= 0 && i < half, "rope-rotation: pair " + std::to_string(i) + " is outside [0, " +
                                    std::to_string(half) + ")");
  }
  const int64_t n = o.positions;
  Figure fig;
  fig.width = o.width;
  fig.columns = std::min<int>(4, static_cast<int>(pairs.size()));
  fig.title = "RoPE rotates each pair of q and k by p\u00b7\u03b8\u1d62";
  fig.subtitle = (o.model ? o.model_name + ": " : std::string()) + "head_dim " +
                 std::to_string(dim) + ", rotary_dim " + std::to_string(freqs.rotary_dim()) + ", " +
                 style_name(style) + " style; a unit vector in pair i at positions 0.." +
                 std::to_string(n - 1);
  for (int64_t i : pairs) {
    const int64_t a = style == RopeStyle::kHalf ? i : 2 * i;
    const int64_t b = style == RopeStyle::kHalf ? i + half : 2 * i + 1;
    // x [1, n, 1, dim]: the unit vector e_a at every position, rotated by apply_rope.
    std::vector<float> x(static_cast<std::size_t>(n * dim), 0.0f), y(x.size());
    for (int64_t p = 0; p < n; ++p) x[static_cast<std::size_t>(p * dim + a)] = 1.0f;
    apply_rope(freqs, style, View<const float, 4>::contiguous(x.data(), {1, n, 1, dim}),
               View<float, 4>::contiguous(y.data(), {1, n, 1, dim}));
    Panel p;
    const double theta = freqs.inv_freq[static_cast<std::size_t>(i)];
    p.title = "pair " + std::to_string(i) + ": \u03b8 = " + num(theta) + " rad";
    p.equal_aspect = true;
    p.x.range = Range{-1.22, 1.22};
    p.y.range = Range{-1.22, 1.22};
    p.x.ticks = {-1, 0, 1};
    p.y.ticks = {-1, 0, 1};
    p.x.label = "x[" + std::to_string(a) + "]";
    p.y.label = "x[" + std::to_string(b) + "]";
    p.legend = LegendPlace::kNone;
    p.circles.push_back({0, 0, 1, kGrey, 1.0, LineStyle::kSolid, std::nullopt});
    Series chord = line({}, {}, "", rgb(0x999999), 1.0);
    for (int64_t t = 0; t < n; ++t) {
      chord.x.push_back(y[static_cast<std::size_t>(t * dim + a)] / freqs.attention_factor);
      chord.y.push_back(y[static_cast<std::size_t>(t * dim + b)] / freqs.attention_factor);
    }
    p.series.push_back(chord);
    for (int64_t t = 0; t < std::min<int64_t>(n, 2); ++t) {
      Arrow ar;
      ar.x1 = chord.x[static_cast<std::size_t>(t)];
      ar.y1 = chord.y[static_cast<std::size_t>(t)];
      ar.color = kDark;
      ar.width = 1.6;
      p.arrows.push_back(ar);
    }
    for (int64_t t = 0; t < n; ++t) {
      Series pt;
      pt.x = {chord.x[static_cast<std::size_t>(t)]};
      pt.y = {chord.y[static_cast<std::size_t>(t)]};
      pt.line = false;
      pt.marker = Marker::kCircle;
      pt.marker_size = 4;
      pt.color = colormap_color(Colormap::kViridis,
                                0.9 * static_cast<double>(t) / static_cast<double>(n - 1));
      p.series.push_back(pt);
    }
    fig.panels.push_back(std::move(p));
  }
  for (int64_t t : {int64_t{0}, n / 4, n / 2, 3 * n / 4, n - 1}) {
    LegendEntry e;
    e.label = "p = " + std::to_string(t);
    e.color = colormap_color(Colormap::kViridis,
                             0.9 * static_cast<double>(t) / static_cast<double>(n - 1));
    e.marker = Marker::kCircle;
    e.line = false;
    fig.legend.push_back(e);
  }
  LegendEntry arrows;
  arrows.label = "p = 0 and p = 1 (angle \u03b8)";
  arrows.color = kDark;
  fig.legend.push_back(arrows);
  const int rows = (static_cast<int>(pairs.size()) + fig.columns - 1) / fig.columns;
  fig.height = auto_height(o.height, rows * (o.width / fig.columns + 20) + 92);
  return fig;
}

// ---------------------------------------------------------------------------------------------
// bias

Figure bias_figure(const BiasOptions& o) {
  static const std::vector<std::string> all = bias_map_schemes();
  require(o.scheme == "all" || std::find(all.begin(), all.end(), o.scheme) != all.end(),
          "bias: unknown scheme '" + o.scheme + "' (use all, " + names_text(all) + ")");
  require(o.length >= 1 && o.length <= 1024,
          "bias: --length must be in [1, 1024] (got " + std::to_string(o.length) + ")");
  require(o.shaw_k >= 1, "bias: --shaw-k must be >= 1 (got " + std::to_string(o.shaw_k) + ")");
  const std::string scheme =
      model_scheme(o.model, o.scheme, "bias", o.model_name, {"alibi", "t5", "deberta"});
  const int64_t L = o.length;
  auto masked = [&](int64_t i, int64_t j) { return o.causal && j > i; };
  const double nan = std::nan("");
  Figure fig;
  fig.width = o.width;
  fig.title = std::string("Relative position terms, ") + (o.causal ? "causal" : "bidirectional") +
              ": " + std::to_string(L) + " queries \u00d7 " + std::to_string(L) + " keys";
  fig.subtitle = o.model ? o.model_name + " (" + o.model->model_type + ")"
                         : "row = query position i, column = key position j";
  auto add_alibi = [&](const std::vector<int64_t>& heads, const AlibiConfig& cfg) {
    const std::vector<double> slopes = alibi_slopes(cfg);
    for (int64_t h : heads) {
      const double m = slopes[static_cast<std::size_t>(h)];
      std::vector<double> v(static_cast<std::size_t>(L * L));
      for (int64_t i = 0; i < L; ++i) {
        for (int64_t j = 0; j < L; ++j) {
          v[static_cast<std::size_t>(i * L + j)] = masked(i, j) ? nan : alibi_bias(m, i, j);
        }
      }
      Panel p = heat_panel("ALiBi head " + std::to_string(h + 1) + "/" + std::to_string(cfg.heads) +
                               ", m = " + num(m),
                           L, L, std::move(v), "key j", "query i");
      p.heatmap->colorbar_label = "bias";
      fig.panels.push_back(std::move(p));
    }
  };
  const std::vector<std::string> schemes = scheme == "all" ? all : std::vector<std::string>{scheme};
  for (const auto& s : schemes) {
    if (s == "alibi") {
      AlibiConfig cfg;
      cfg.heads = o.model ? o.model->alibi.heads : o.heads;
      cfg.max_bias = o.model ? o.model->alibi.max_bias : 8.0;
      require(cfg.heads >= 1, "bias: --heads must be >= 1 (got " + std::to_string(cfg.heads) + ")");
      std::vector<int64_t> heads;
      if (scheme == "all") {
        heads = some_heads(cfg.heads, 3);  // first, middle, last
      } else {
        heads = some_heads(cfg.heads, 8);
        if (cfg.heads <= 8) {
          heads.clear();
          for (int64_t h = 0; h < cfg.heads; ++h) heads.push_back(h);
        }
      }
      add_alibi(heads, cfg);
    } else if (s == "t5") {
      T5BucketConfig cfg = o.model ? o.model->t5 : o.t5;
      cfg.bidirectional = !o.causal;
      const std::vector<int64_t> map = t5_bucket_map(cfg, L, L);
      std::vector<double> v(map.size());
      for (int64_t i = 0; i < L; ++i) {
        for (int64_t j = 0; j < L; ++j) {
          const auto c = static_cast<std::size_t>(i * L + j);
          v[c] = masked(i, j) ? nan : static_cast<double>(map[c]);
        }
      }
      Panel p = heat_panel("T5 buckets (" + std::to_string(cfg.num_buckets) + ", max " +
                               std::to_string(cfg.max_distance) + ")",
                           L, L, std::move(v), "key j", "query i");
      p.heatmap->colorbar_label = "bucket";
      p.heatmap->integer_ticks = true;
      fig.panels.push_back(std::move(p));
    } else if (s == "shaw") {
      std::vector<double> v(static_cast<std::size_t>(L * L));
      for (int64_t i = 0; i < L; ++i) {
        for (int64_t j = 0; j < L; ++j) {
          v[static_cast<std::size_t>(i * L + j)] =
              masked(i, j) ? nan : static_cast<double>(shaw_index(j - i, o.shaw_k));
        }
      }
      Panel p = heat_panel("Shaw: clip(j\u2212i, \u00b1" + std::to_string(o.shaw_k) + ") + K", L, L,
                           std::move(v), "key j", "query i");
      p.heatmap->colorbar_label = "table row";
      p.heatmap->integer_ticks = true;
      fig.panels.push_back(std::move(p));
    } else if (s == "deberta") {
      const DebertaBuckets cfg = o.model ? o.model->deberta : o.deberta;
      validate(cfg);
      std::vector<double> v(static_cast<std::size_t>(L * L));
      for (int64_t i = 0; i < L; ++i) {
        for (int64_t j = 0; j < L; ++j) {
          v[static_cast<std::size_t>(i * L + j)] =
              masked(i, j) ? nan : static_cast<double>(deberta_c2p_index(i, j, cfg));
        }
      }
      Panel p = heat_panel(
          "DeBERTa c2p row (" +
              (cfg.position_buckets > 0 ? std::to_string(cfg.position_buckets) + " buckets, "
                                        : std::string()) +
              "max " + std::to_string(cfg.max_relative_positions) + ")",
          L, L, std::move(v), "key j", "query i");
      p.heatmap->colorbar_label = "table row";
      p.heatmap->integer_ticks = true;
      fig.panels.push_back(std::move(p));
    }
  }
  if (o.causal) {
    LegendEntry e;
    e.label = "masked (causal: key after the query)";
    e.color = masked_color();
    e.swatch = true;
    fig.legend.push_back(e);
  }
  const int n = static_cast<int>(fig.panels.size());
  fig.columns = n <= 3 ? n : n == 4 ? 2 : 3;
  const int rows = (n + fig.columns - 1) / fig.columns;
  // Square maps: the plot is as tall as the cell is wide, less the axes and the colour bar.
  const double plot = std::min(o.width / fig.columns - 140, 420.0);
  fig.height = auto_height(o.height, rows * (plot + 84) + 64 + (o.causal ? 28 : 0));
  return fig;
}

// ---------------------------------------------------------------------------------------------
// attention

Figure attention_figure(const AttentionPlotOptions& o) {
  require(o.length >= 2 && o.length <= 256,
          "attention: --length must be in [2, 256] (got " + std::to_string(o.length) + ")");
  require(o.content == "constant" || o.content == "random",
          "attention: --content must be constant or random (got " + o.content + ")");
  const int64_t L = o.length;
  const int64_t D = o.head_dim == 0 ? std::max<int64_t>(32, L + (L % 2)) : o.head_dim;
  require(D >= L && D % 2 == 0 && D <= 1024,
          "attention: --head-dim must be even, in [--length, 1024] (got " + std::to_string(D) +
              "): the weights are read as the outputs for one-hot values");
  std::mt19937_64 rng(o.seed);
  // Content: constant (one vector for every token, q = k) or random per token.
  std::vector<double> q, k;
  if (o.content == "constant") {
    const std::vector<double> u = randn(rng, D, 1.6);
    for (int64_t t = 0; t < L; ++t) q.insert(q.end(), u.begin(), u.end());
    k = q;
  } else {
    q = randn(rng, L * D);
    k = randn(rng, L * D);
  }
  // Values: one-hot rows, so that output row i is the attention weights of query i.
  std::vector<double> v(static_cast<std::size_t>(L * D), 0.0);
  for (int64_t j = 0; j < L; ++j) v[static_cast<std::size_t>(j * D + j)] = 1.0;
  const std::array<int64_t, 4> shape{1, L, 1, D};
  AttentionOptions opt;
  opt.causal = o.causal;

  // Scheme tables, from the seed (illustrative: trained models learn them).
  const int64_t shaw_k = 4, deberta_k = 8;
  const std::vector<float> shaw_rel = to_float(randn(rng, (2 * shaw_k + 1) * D, 0.6));
  const std::vector<float> u_bias = to_float(randn(rng, D, 0.3));
  const std::vector<float> v_bias = to_float(randn(rng, D, 0.3));
  const std::vector<float> r_net = to_float(randn(rng, D * D, 1.0 / std::sqrt(double(D)) * 2.0));
  const std::vector<float> pos_key = to_float(randn(rng, 2 * deberta_k * D, 1.0));
  const std::vector<float> pos_query = to_float(randn(rng, 2 * deberta_k * D, 1.0));
  T5BucketConfig t5cfg;
  t5cfg.bidirectional = !o.causal;
  std::vector<float> t5_table(static_cast<std::size_t>(t5cfg.num_buckets));
  const int64_t half = t5cfg.bidirectional ? t5cfg.num_buckets / 2 : t5cfg.num_buckets;
  for (int64_t b = 0; b < t5cfg.num_buckets; ++b) {
    t5_table[static_cast<std::size_t>(b)] =
        static_cast<float>(-0.3 * static_cast<double>(b % half));
  }
  RopeConfig rc;
  rc.head_dim = D;
  rc.base = o.base;
  const double alibi_m = alibi_slopes(AlibiConfig{8, 8.0})[0];

  struct Entry {
    std::string title;
    PositionScheme scheme;
    bool add_pe = false;
  };
  Shaw shaw;
  shaw.rel_k = View<const float, 3>{shaw_rel.data(), {2 * shaw_k + 1, 1, D}, {D, D, 1}};
  TransformerXL xl;
  xl.r_w_bias = View<const float, 2>::contiguous(u_bias.data(), {1, D});
  xl.r_r_bias = View<const float, 2>::contiguous(v_bias.data(), {1, D});
  xl.r_net = View<const float, 2>::contiguous(r_net.data(), {D, D});
  xl.base = o.base;
  DeBERTa deb;
  deb.pos_key = View<const float, 3>::contiguous(pos_key.data(), {2 * deberta_k, 1, D});
  deb.pos_query = View<const float, 3>::contiguous(pos_query.data(), {2 * deberta_k, 1, D});
  deb.buckets.max_relative_positions = deberta_k;
  T5Bias t5;
  t5.table = View<const float, 2>::contiguous(t5_table.data(), {t5cfg.num_buckets, 1});
  t5.max_distance = t5cfg.max_distance;
  std::vector<Entry> entries = {
      {"no positions", NoPositions{}, false},
      {"sinusoidal (x + PE)", NoPositions{}, true},
      {"RoPE", Rope{rope_frequencies(rc), RopeStyle::kHalf}, false},
      {"ALiBi (m = " + num(alibi_m) + ")", Alibi{{alibi_m}, 8.0}, false},
      {"T5 buckets", t5, false},
      {"Shaw (K = " + std::to_string(shaw_k) + ")", shaw, false},
      {"Transformer-XL", xl, false},
      {"DeBERTa (K = " + std::to_string(deberta_k) + ")", deb, false},
  };
  std::vector<std::vector<double>> weights;
  double vmax = 0;
  for (const Entry& e : entries) {
    std::vector<double> qe = q, ke = k;
    if (e.add_pe) {
      // x + PE(p) through the float API, then widened: the sinusoidal input of the paper.
      SinusoidalConfig sc;
      sc.dim = D;
      sc.base = o.base;
      std::vector<float> qf = to_float(qe), kf = to_float(ke);
      add_sinusoidal(sc, View<float, 3>::contiguous(qf.data(), {1, L, D}));
      add_sinusoidal(sc, View<float, 3>::contiguous(kf.data(), {1, L, D}));
      qe.assign(qf.begin(), qf.end());
      ke.assign(kf.begin(), kf.end());
    }
    std::vector<double> out(static_cast<std::size_t>(L * D));
    ref::attention(View<const double, 4>::contiguous(qe.data(), shape),
                   View<const double, 4>::contiguous(ke.data(), shape),
                   View<const double, 4>::contiguous(v.data(), shape), e.scheme, opt,
                   View<double, 4>::contiguous(out.data(), shape));
    std::vector<double> w(static_cast<std::size_t>(L * L));
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t j = 0; j < L; ++j) {
        const double a = out[static_cast<std::size_t>(i * D + j)];
        w[static_cast<std::size_t>(i * L + j)] = (o.causal && j > i) ? std::nan("") : a;
        // The colour scale ignores the first causal rows (one visible key: weight 1), which
        // would flatten every other row; those cells saturate.
        if (std::isfinite(a) && (!o.causal || i >= L / 4)) vmax = std::max(vmax, a);
      }
    }
    weights.push_back(std::move(w));
  }
  Figure fig;
  fig.width = o.width;
  fig.columns = 3;
  fig.title = std::string("Attention weights, same q and k, one scheme per panel (") +
              (o.causal ? "causal" : "bidirectional") + ")";
  fig.subtitle =
      (o.content == "constant"
           ? std::string("every token has the same content (q = k), so each pattern is "
                         "the positional effect alone")
           : std::string("random q and k per token (seed ") + std::to_string(o.seed) + ")") +
      "; L = " + std::to_string(L) + ", head_dim " + std::to_string(D);
  for (std::size_t e = 0; e < entries.size(); ++e) {
    Panel p = heat_panel(entries[e].title, L, L, std::move(weights[e]), "key j", "query i");
    p.heatmap->colorbar = false;
    p.heatmap->value_range = Range{0, vmax > 0 ? vmax : 1};
    fig.panels.push_back(std::move(p));
  }
  fig.colorbar =
      ColorBar{Colormap::kViridis, Range{0, vmax > 0 ? vmax : 1},
               o.causal ? "attention weight (first rows saturate)" : "attention weight", false};
  if (o.causal) {
    LegendEntry e;
    e.label = "masked (causal)";
    e.color = masked_color();
    e.swatch = true;
    fig.legend.push_back(e);
  }
  // Square maps in three columns beside the shared colour bar.
  const double plot = (o.width - 90) / 3 - 75;
  fig.height = auto_height(o.height, 3 * (plot + 84) + 64 + (o.causal ? 28 : 0));
  return fig;
}

// ---------------------------------------------------------------------------------------------
// extrapolation

Figure extrapolation_figure(const ExtrapolationOptions& o) {
  require(o.train_length >= 1 && o.train_length <= (int64_t{1} << 20),
          "extrapolation: --train-length must be in [1, 2^20] (got " +
              std::to_string(o.train_length) + ")");
  require(o.max_length > o.train_length && o.max_length <= (int64_t{1} << 22),
          "extrapolation: --max-length must be in (--train-length, 2^22] (got " +
              std::to_string(o.max_length) + ")");
  require(o.heads >= 1, "extrapolation: --heads must be >= 1");
  require(o.rope_scaling >= 1, "extrapolation: --rope-scaling must be >= 1");
  const int64_t Lt = o.train_length, Lm = o.max_length;
  // Sample distances: every one up to 2048 points, then evenly.
  const int64_t step = std::max<int64_t>(1, Lm / 2048);
  std::vector<double> ds;
  for (int64_t d = 0; d <= Lm; d += step) ds.push_back(static_cast<double>(d));
  const RefLine train{true, static_cast<double>(Lt), rgb(0x444444),
                      1.3,  LineStyle::kDashed,      "training length " + std::to_string(Lt)};
  Figure fig;
  fig.width = o.width;
  fig.columns = 2;
  fig.title = "Beyond the training length (" + std::to_string(Lt) + " tokens)";
  fig.subtitle = "what each scheme does with distances it never saw";

  {  // ALiBi
    const std::vector<double> slopes = alibi_slopes(AlibiConfig{o.heads, 8.0});
    Panel p;
    p.title = "ALiBi: bias keeps decaying linearly";
    p.x.label = "distance d = pos_q \u2212 pos_k";
    p.y.label = "bias";
    const auto heads = some_heads(o.heads, 3);
    for (std::size_t i = 0; i < heads.size(); ++i) {
      const double m = slopes[static_cast<std::size_t>(heads[i])];
      std::vector<double> y;
      for (double d : ds) y.push_back(alibi_bias(m, static_cast<int64_t>(d), 0));
      p.series.push_back(line(ds, y, "head " + std::to_string(heads[i] + 1) + " (m=" + num(m) + ")",
                              category_color(static_cast<int>(i))));
    }
    p.ref_lines.push_back(train);
    fig.panels.push_back(std::move(p));
  }
  {  // T5
    validate(o.t5);
    Panel p;
    p.title = "T5: buckets saturate";
    p.x.label = "distance d = pos_q \u2212 pos_k";
    p.y.label = "bucket";
    std::vector<double> y;
    for (double d : ds) y.push_back(static_cast<double>(t5_bucket(-static_cast<int64_t>(d), o.t5)));
    Series s = line(ds, y,
                    std::string(o.t5.bidirectional ? "bidirectional" : "causal") + ", " +
                        std::to_string(o.t5.num_buckets) + " buckets",
                    category_color(0));
    s.step = true;
    p.series.push_back(s);
    p.ref_lines.push_back({true, static_cast<double>(o.t5.max_distance), category_color(1), 1.3,
                           LineStyle::kDotted,
                           "max_distance " + std::to_string(o.t5.max_distance)});
    p.ref_lines.push_back(train);
    p.y.integer_ticks = true;
    fig.panels.push_back(std::move(p));
  }
  {  // Sinusoidal
    Panel p;
    p.title = "sinusoidal: PE(0)\u00b7PE(d) stays bounded";
    p.x.label = "distance d";
    p.y.label = "PE(0)\u00b7PE(d) / (d_model/2)";
    std::vector<double> y;
    const double norm = static_cast<double>(o.dim) / 2.0;
    for (double d : ds) y.push_back(sinusoidal_dot(o.dim, 0, static_cast<int64_t>(d)) / norm);
    p.series.push_back(line(ds, y, "d_model = " + std::to_string(o.dim), category_color(0), 1.5));
    p.ref_lines.push_back(train);
    p.y.range = Range{-0.3, 1.1};
    fig.panels.push_back(std::move(p));
  }
  {  // RoPE
    Panel p;
    p.title = "RoPE: score of q = k decays, scaling stretches";
    p.x.label = "distance d = n \u2212 m";
    p.y.label = "\u27e8rope(q,0), rope(q,d)\u27e9 / |q|\u00b2";
    const std::vector<double> ones(static_cast<std::size_t>(o.dim), 1.0);
    std::vector<int64_t> kp;
    for (double d : ds) kp.push_back(static_cast<int64_t>(d));
    RopeConfig base_cfg;
    base_cfg.head_dim = o.dim;
    base_cfg.base = o.base;
    RopeConfig scaled = base_cfg;
    scaled.scaling.type = RopeScalingType::kLinear;
    scaled.scaling.factor = o.rope_scaling;
    const std::vector<std::pair<RopeConfig, std::string>> cfgs = {
        {base_cfg, "base " + num(o.base)}, {scaled, "linear scaling \u00d7" + num(o.rope_scaling)}};
    for (std::size_t i = 0; i < cfgs.size(); ++i) {
      if (i == 1 && o.rope_scaling == 1) break;
      std::vector<double> y =
          scores_vs_keys(ones, ones, 1, o.dim,
                         Rope{rope_frequencies(cfgs[i].first), RopeStyle::kHalf}, 0, kp, 0, 1.0);
      for (double& v : y) v /= static_cast<double>(o.dim);
      p.series.push_back(line(ds, y, cfgs[i].second, category_color(static_cast<int>(i)), 1.5));
    }
    p.ref_lines.push_back(train);
    fig.panels.push_back(std::move(p));
  }
  {  // Shaw
    Panel p;
    p.title = "Shaw: the relative index clips at K";
    p.x.label = "distance d = pos_q \u2212 pos_k";
    p.y.label = "clip(\u2212d, \u00b1K) (table row \u2212 K)";
    std::vector<double> y;
    for (double d : ds) {
      y.push_back(static_cast<double>(shaw_index(-static_cast<int64_t>(d), o.shaw_k) - o.shaw_k));
    }
    p.series.push_back(line(ds, y, "K = " + std::to_string(o.shaw_k), category_color(0)));
    p.ref_lines.push_back(train);
    fig.panels.push_back(std::move(p));
  }
  {  // Learned: probe add_learned at positions up to max_length.
    const int64_t dim = 8;
    std::vector<float> table(static_cast<std::size_t>(Lt * dim), 0.01f);
    const View<const float, 2> tv = View<const float, 2>::contiguous(table.data(), {Lt, dim});
    Series ok, refused;
    ok.line = refused.line = false;
    ok.marker = Marker::kCircle;
    refused.marker = Marker::kCross;
    ok.color = category_color(2);
    refused.color = category_color(1);
    ok.label = "accepted";
    refused.label = "refused (ValueError)";
    const int64_t probes = 48;
    for (int64_t k = 0; k <= probes; ++k) {
      const int64_t pos = std::min(Lm, k * Lm / probes);
      std::vector<float> x(static_cast<std::size_t>(dim), 0.0f);
      const Positions ps = Positions::shared({pos});
      bool accepted = true;
      try {
        add_learned(tv, View<float, 3>::contiguous(x.data(), {1, 1, dim}), &ps);
      } catch (const ValueError&) {
        accepted = false;
      }
      (accepted ? ok : refused).x.push_back(static_cast<double>(pos));
      (accepted ? ok : refused).y.push_back(accepted ? 1.0 : 0.0);
    }
    Panel p;
    p.title = "learned table (" + std::to_string(Lt) + " rows): refuses beyond";
    p.x.label = "position p";
    p.y.label = "add_learned";
    p.y.range = Range{-0.6, 1.6};
    p.y.ticks = {0, 1};
    p.y.tick_labels = {"refused", "ok"};
    p.x.range = Range{-0.02 * static_cast<double>(Lm), 1.02 * static_cast<double>(Lm)};
    p.series.push_back(ok);
    p.series.push_back(refused);
    p.ref_lines.push_back(train);
    fig.panels.push_back(std::move(p));
  }
  fig.height = auto_height(o.height, 3 * 270 + 60);
  return fig;
}

}  // namespace posenc::plot
