// plot/plot_util.h - what the figures share (plots.cc, plots_attention.cc): colours, random
// inputs, scores from the float64 oracle, heat-map and overlay panels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "plots.h"
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

namespace posenc::plot::util {

constexpr double kPi = 3.14159265358979323846;
inline const Color kGrey{0.55, 0.55, 0.55, 1};
inline const Color kDark{0.15, 0.15, 0.15, 1};

inline void require(bool ok, const std::string& message) {
  if (!ok) throw ValueError(message);
}

// Integers as integers, else 4 significant digits ("10000", "0.0039", "1e+06").
// The schemes whose relative term is an additive [Lq, Lk] bias or index map (the registry's
// bias_map), and names for messages: "alibi, t5, shaw or deberta".
inline std::vector<std::string> bias_map_schemes() {
  std::vector<std::string> out;
  for (const SchemeInfo& s : attention_schemes()) {
    if (s.bias_map) out.push_back(s.name);
  }
  return out;
}
inline std::string names_text(const std::vector<std::string>& names) {
  std::string s;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i > 0) s += i + 1 == names.size() ? " or " : ", ";
    s += names[i];
  }
  return s;
}

inline std::string num(double v) {
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

inline std::vector<double> randn(std::mt19937_64& rng, int64_t n, double sd = 1.0) {
  std::normal_distribution<double> nd(0.0, sd);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (double& x : v) x = nd(rng);
  return v;
}

inline std::vector<float> to_float(const std::vector<double>& v) {
  std::vector<float> f(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) f[i] = static_cast<float>(v[i]);
  return f;
}

inline std::vector<double> offsets(int64_t k) {
  std::vector<double> x;
  for (int64_t i = -k; i <= k; ++i) x.push_back(static_cast<double>(i));
  return x;
}

inline double auto_height(double height, double computed) { return height > 0 ? height : computed; }

// A line series.
inline Series line(std::vector<double> x, std::vector<double> y, const std::string& label, Color c,
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
inline void overlay_style(Series& s, int i) {
  if (i == 0) {
    s.width = 5;
    s.color.a = 0.45;
  } else {
    s.width = 2;
    s.style = i == 1 ? LineStyle::kDashed : LineStyle::kDotted;
  }
}

// Up to `at_most` heads of h, evenly spaced from the first to the last (distinct, in order).
inline std::vector<int64_t> some_heads(int64_t h, std::size_t at_most) {
  std::vector<int64_t> out;
  const auto n = static_cast<int64_t>(std::min<std::size_t>(at_most, static_cast<std::size_t>(h)));
  for (int64_t k = 0; k < n; ++k) {
    const int64_t v = n == 1 ? 0 : (k * (h - 1) + (n - 1) / 2) / (n - 1);
    if (out.empty() || out.back() != v) out.push_back(v);
  }
  return out;
}

inline RopeFrequencies model_or_default_rope(const std::optional<ModelConfig>& model,
                                             int64_t head_dim, double base, RopeStyle* style,
                                             int64_t* dim) {
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
inline std::string model_scheme(const std::optional<ModelConfig>& model,
                                const std::string& requested, const std::string& kind,
                                const std::string& model_name,
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
inline void add_headroom(Panel& p, double fraction) {
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
inline std::vector<double> scores_vs_keys(const std::vector<double>& q,
                                          const std::vector<double>& k, int64_t heads, int64_t dim,
                                          const PositionScheme& scheme, int64_t pos_q,
                                          const std::vector<int64_t>& key_pos, int64_t head,
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

inline Panel heat_panel(const std::string& title, int64_t rows, int64_t cols,
                        std::vector<double> values, const std::string& xlabel,
                        const std::string& ylabel) {
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

}  // namespace posenc::plot::util
