// plot/plots_attention.cc - the figures of posenc (see plots.h) about attention: rope-rotation,
// bias, attention and extrapolation. Numbers come from the public API; this file arranges them
// into panels.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "plot_util.h"
#include "plots.h"

namespace posenc::plot {

using namespace util;

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
