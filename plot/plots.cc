// plot/plots.cc - the figures of posenc (see plots.h) about the encodings themselves: heatmap,
// clock and similarity (the attention figures: plots_attention.cc). Numbers come from the public
// API; this file arranges them into panels.
#include "plots.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "plot_util.h"

namespace posenc::plot {

using namespace util;

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

}  // namespace posenc::plot
