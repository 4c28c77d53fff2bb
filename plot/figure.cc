// plot/figure.cc - layout and cairo rendering of plot::Figure (see figure.h).
//
// Size: about 1,100 lines, one file because layout and drawing are one pass over the same cairo
// context (text is measured with the font it is drawn in) and the same panel layouts; the
// sections are colour maps, text, ranges and ticks, legends, panels and the figure.
#include "figure.h"

#include <cairo-svg.h>
#include <cairo.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "posenc/error.h"
#include "posenc/io.h"

namespace posenc::plot {

namespace {

constexpr double kPi = 3.14159265358979323846;
constexpr const char* kFont = "DejaVu Sans";

// Font sizes (px at scale 1).
constexpr double kTitleSize = 17;
constexpr double kSubtitleSize = 12.5;
constexpr double kPanelTitleSize = 14;
constexpr double kLabelSize = 13;
constexpr double kTickSize = 12;
constexpr double kLegendSize = 12;

constexpr double kTickLength = 5;
constexpr double kColorbarGap = 12;
constexpr double kColorbarWidth = 14;
constexpr double kLegendRow = 17;
constexpr double kLegendSample = 24;

// ---------------------------------------------------------------------------------------------
// Colour.

double srgb_encode(double v) {
  v = std::clamp(v, 0.0, 1.0);
  return v <= 0.0031308 ? 12.92 * v : 1.055 * std::pow(v, 1.0 / 2.4) - 0.055;
}

// Oklab (L, a, b) to linear sRGB (Ottosson's matrices).
std::array<double, 3> oklab_to_linear(double l, double a, double b) {
  const double l_ = l + 0.3963377774 * a + 0.2158037573 * b;
  const double m_ = l - 0.1055613458 * a - 0.0638541728 * b;
  const double s_ = l - 0.0894841775 * a - 1.2914855480 * b;
  const double l3 = l_ * l_ * l_, m3 = m_ * m_ * m_, s3 = s_ * s_ * s_;
  return {4.0767416621 * l3 - 3.3077115913 * m3 + 0.2309699292 * s3,
          -1.2684380046 * l3 + 2.6097574011 * m3 - 0.3413193965 * s3,
          -0.0041960863 * l3 - 0.7034186147 * m3 + 1.7076147010 * s3};
}

// Oklch -> sRGB, reducing the chroma until the colour is inside the sRGB gamut.
Color oklch(double l, double c, double hue_deg) {
  const double h = hue_deg * kPi / 180.0;
  double lo = 0.0, hi = 1.0;
  auto in_gamut = [&](double f) {
    const auto rgb = oklab_to_linear(l, f * c * std::cos(h), f * c * std::sin(h));
    for (double v : rgb) {
      if (v < -1e-9 || v > 1.0 + 1e-9) return false;
    }
    return true;
  };
  if (in_gamut(1.0)) {
    lo = 1.0;
  } else {
    for (int it = 0; it < 40; ++it) {
      const double mid = 0.5 * (lo + hi);
      (in_gamut(mid) ? lo : hi) = mid;
    }
  }
  const auto rgb = oklab_to_linear(l, lo * c * std::cos(h), lo * c * std::sin(h));
  return {srgb_encode(rgb[0]), srgb_encode(rgb[1]), srgb_encode(rgb[2]), 1.0};
}

Color viridis_formula(double t) {
  const double l = 0.30 + 0.62 * t;
  const double c = 0.105 + 0.075 * t;
  const double hue = 300.0 - 195.0 * t;
  return oklch(l, c, hue);
}

Color diverging_formula(double t) {
  const double u = 2.0 * t - 1.0;
  const double a = std::fabs(u);
  const double l = 0.97 - 0.52 * a;
  const double c = 0.17 * std::pow(a, 0.8);
  return oklch(l, c, u < 0 ? 255.0 : 30.0);
}

using Table = std::array<Color, 256>;

// Each channel quantised to 8 bits, as a rendered pixel carries it: lookups then compare like
// with like.
Color quantise(Color c) {
  auto q = [](double v) { return std::round(std::clamp(v, 0.0, 1.0) * 255.0) / 255.0; };
  return {q(c.r), q(c.g), q(c.b), c.a};
}

const Table& table(Colormap map) {
  static const Table viridis = [] {
    Table t;
    for (std::size_t i = 0; i < t.size(); ++i) {
      t[i] = quantise(viridis_formula(static_cast<double>(i) / 255.0));
    }
    return t;
  }();
  static const Table diverging = [] {
    Table t;
    for (std::size_t i = 0; i < t.size(); ++i) {
      t[i] = quantise(diverging_formula(static_cast<double>(i) / 255.0));
    }
    return t;
  }();
  return map == Colormap::kViridis ? viridis : diverging;
}

// ---------------------------------------------------------------------------------------------
// Text.

struct Measure {
  cairo_surface_t* surface = nullptr;
  cairo_t* cr = nullptr;
  Measure() {
    surface = cairo_image_surface_create(CAIRO_FORMAT_RGB24, 4, 4);
    cr = cairo_create(surface);
  }
  ~Measure() {
    cairo_destroy(cr);
    cairo_surface_destroy(surface);
  }
  Measure(const Measure&) = delete;
  Measure& operator=(const Measure&) = delete;
};

void set_font(cairo_t* cr, double size, bool bold) {
  cairo_select_font_face(cr, kFont, CAIRO_FONT_SLANT_NORMAL,
                         bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, size);
  cairo_font_options_t* fo = cairo_font_options_create();
  cairo_font_options_set_hint_metrics(fo, CAIRO_HINT_METRICS_OFF);
  cairo_font_options_set_hint_style(fo, CAIRO_HINT_STYLE_NONE);
  cairo_set_font_options(cr, fo);
  cairo_font_options_destroy(fo);
}

double text_width(cairo_t* cr, const std::string& s, double size, bool bold = false) {
  if (s.empty()) return 0;
  set_font(cr, size, bold);
  cairo_text_extents_t e;
  cairo_text_extents(cr, s.c_str(), &e);
  return e.x_advance;
}

void set_color(cairo_t* cr, Color c) { cairo_set_source_rgba(cr, c.r, c.g, c.b, c.a); }

// Draws `s` anchored at x, vertically centred on y; rotated by -90 degrees when `vertical` (reads
// bottom to top, centred on (x, y)).
void draw_text(cairo_t* cr, const std::string& s, double x, double y, double size, bool bold,
               Anchor anchor, Color color, bool vertical = false) {
  if (s.empty()) return;
  set_font(cr, size, bold);
  cairo_text_extents_t e;
  cairo_text_extents(cr, s.c_str(), &e);
  cairo_font_extents_t fe;
  cairo_font_extents(cr, &fe);
  double dx = 0;
  if (anchor == Anchor::kCenter) dx = -0.5 * e.x_advance;
  if (anchor == Anchor::kRight) dx = -e.x_advance;
  const double dy = 0.5 * (fe.ascent - fe.descent);
  cairo_save(cr);
  set_color(cr, color);
  cairo_translate(cr, x, y);
  if (vertical) cairo_rotate(cr, -kPi / 2);
  cairo_move_to(cr, dx, dy);
  cairo_show_text(cr, s.c_str());
  cairo_new_path(cr);
  cairo_restore(cr);
}

// ---------------------------------------------------------------------------------------------
// Ranges and ticks.

void extend(Range& r, bool& any, double v) {
  if (!std::isfinite(v)) return;
  if (!any) {
    r = {v, v};
    any = true;
  } else {
    r.lo = std::min(r.lo, v);
    r.hi = std::max(r.hi, v);
  }
}

Range heatmap_x(const HeatMap& h) {
  const double a = h.x0 - 0.5 * h.dx, b = h.x0 + (static_cast<double>(h.cols) - 0.5) * h.dx;
  return {std::min(a, b), std::max(a, b)};
}
Range heatmap_y(const HeatMap& h) {
  const double a = h.y0 - 0.5 * h.dy, b = h.y0 + (static_cast<double>(h.rows) - 0.5) * h.dy;
  return {std::min(a, b), std::max(a, b)};
}

// The data ranges of a panel: explicit ranges, else the heat map's extent, else the extent of
// every series and shape padded by 4%.
void data_ranges(const Panel& p, Range& xr, Range& yr) {
  bool ax = false, ay = false;
  Range x{0, 1}, y{0, 1};
  for (const Series& s : p.series) {
    for (std::size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.y[i])) continue;
      extend(x, ax, s.x[i]);
      extend(y, ay, s.y[i]);
    }
  }
  for (const Circle& c : p.circles) {
    extend(x, ax, c.cx - c.r);
    extend(x, ax, c.cx + c.r);
    extend(y, ay, c.cy - c.r);
    extend(y, ay, c.cy + c.r);
  }
  for (const Arrow& a : p.arrows) {
    extend(x, ax, a.x0);
    extend(x, ax, a.x1);
    extend(y, ay, a.y0);
    extend(y, ay, a.y1);
  }
  for (const Text& t : p.texts) {
    extend(x, ax, t.x);
    extend(y, ay, t.y);
  }
  for (const RefLine& r : p.ref_lines) extend(r.vertical ? x : y, r.vertical ? ax : ay, r.at);
  auto pad = [](Range& r) {
    const double span = r.hi - r.lo;
    const double m = span > 0 ? 0.04 * span : (r.lo != 0 ? 0.1 * std::fabs(r.lo) : 1.0);
    r.lo -= m;
    r.hi += m;
  };
  pad(x);
  pad(y);
  if (p.heatmap) {
    x = heatmap_x(*p.heatmap);
    y = heatmap_y(*p.heatmap);
  }
  xr = p.x.range ? *p.x.range : x;
  yr = p.y.range ? *p.y.range : y;
  if (!(xr.hi > xr.lo)) xr = {xr.lo - 0.5, xr.lo + 0.5};
  if (!(yr.hi > yr.lo)) yr = {yr.lo - 0.5, yr.lo + 0.5};
}

std::vector<double> axis_ticks(const Axis& a, Range r, double length_px, double spacing_px) {
  if (!a.ticks.empty()) {
    std::vector<double> t;
    for (double v : a.ticks) {
      if (v >= r.lo - 1e-9 * (r.hi - r.lo) && v <= r.hi + 1e-9 * (r.hi - r.lo)) t.push_back(v);
    }
    return t;
  }
  const int target = std::max(2, static_cast<int>(length_px / spacing_px));
  return nice_ticks(r.lo, r.hi, target, a.integer_ticks);
}

std::vector<std::string> axis_labels(const Axis& a, const std::vector<double>& ticks) {
  if (!a.ticks.empty() && a.tick_labels.size() == a.ticks.size()) {
    std::vector<std::string> out;
    for (double v : ticks) {
      for (std::size_t i = 0; i < a.ticks.size(); ++i) {
        if (a.ticks[i] == v) {
          out.push_back(a.tick_labels[i]);
          break;
        }
      }
    }
    return out;
  }
  return tick_labels(ticks);
}

Range value_range(const HeatMap& h) {
  if (h.value_range) return *h.value_range;
  bool any = false;
  Range r{0, 1};
  for (double v : h.values) extend(r, any, v);
  if (h.colormap == Colormap::kDiverging) {
    const double m = std::max(std::fabs(r.lo), std::fabs(r.hi));
    r = {-m, m};
  }
  if (!(r.hi > r.lo)) r = {r.lo - 1, r.hi + 1};
  return r;
}

// Width taken by a colour bar (gap, bar, ticks, tick labels, label) of `height` px.
double colorbar_space(cairo_t* cr, Range vr, bool integer, const std::string& label,
                      double height) {
  const auto ticks = nice_ticks(vr.lo, vr.hi, std::max(2, static_cast<int>(height / 55)), integer);
  double w = 0;
  for (const auto& s : tick_labels(ticks)) w = std::max(w, text_width(cr, s, kTickSize));
  return kColorbarGap + kColorbarWidth + kTickLength + 3 + w + (label.empty() ? 4 : 22);
}

double colorbar_space(cairo_t* cr, const HeatMap& h, double plot_h) {
  if (!h.colorbar) return 0;
  return colorbar_space(cr, value_range(h), h.integer_ticks, h.colorbar_label, plot_h);
}

void draw_colorbar(cairo_t* cr, Rect C, Colormap map, Range vr, bool integer,
                   const std::string& label) {
  const Color frame{0.25, 0.25, 0.25, 1};
  cairo_pattern_t* grad = cairo_pattern_create_linear(0, C.y + C.h, 0, C.y);
  for (int i = 0; i <= 32; ++i) {
    const Color c = colormap_color(map, i / 32.0);
    cairo_pattern_add_color_stop_rgb(grad, i / 32.0, c.r, c.g, c.b);
  }
  cairo_set_source(cr, grad);
  cairo_rectangle(cr, C.x, C.y, C.w, C.h);
  cairo_fill(cr);
  cairo_pattern_destroy(grad);
  set_color(cr, frame);
  cairo_set_line_width(cr, 1);
  cairo_set_dash(cr, nullptr, 0, 0);
  cairo_rectangle(cr, std::round(C.x) + 0.5, std::round(C.y) + 0.5, std::round(C.w),
                  std::round(C.h));
  cairo_stroke(cr);
  const auto ticks = nice_ticks(vr.lo, vr.hi, std::max(2, static_cast<int>(C.h / 55)), integer);
  const auto labels = tick_labels(ticks);
  double w = 0;
  const double right = std::round(C.x + C.w) + 0.5;
  for (std::size_t i = 0; i < ticks.size(); ++i) {
    const double y = std::round(C.y + C.h - (ticks[i] - vr.lo) / (vr.hi - vr.lo) * C.h) + 0.5;
    set_color(cr, frame);
    cairo_move_to(cr, right, y);
    cairo_line_to(cr, right + kTickLength, y);
    cairo_stroke(cr);
    draw_text(cr, labels[i], right + kTickLength + 3, y, kTickSize, false, Anchor::kLeft,
              {0.2, 0.2, 0.2, 1});
    w = std::max(w, text_width(cr, labels[i], kTickSize));
  }
  draw_text(cr, label, right + kTickLength + 3 + w + 12, C.y + C.h / 2, kLabelSize, false,
            Anchor::kCenter, {0.1, 0.1, 0.1, 1}, true);
}

// ---------------------------------------------------------------------------------------------
// Legends.

struct LegendItem {
  std::string label;
  Color color;
  bool swatch = false;
  LineStyle style = LineStyle::kSolid;
  Marker marker = Marker::kNone;
  bool line = true;
  double width = 2;
};

std::vector<LegendItem> legend_items(const Panel& p) {
  std::vector<LegendItem> items;
  for (const Series& s : p.series) {
    if (s.label.empty()) continue;
    items.push_back({s.label, s.color, false, s.style, s.marker, s.line, s.width});
  }
  for (const RefLine& r : p.ref_lines) {
    if (r.label.empty()) continue;
    items.push_back({r.label, r.color, false, r.style, Marker::kNone, true, r.width});
  }
  for (const LegendEntry& e : p.legend_extra) {
    items.push_back({e.label, e.color, e.swatch, e.style, e.marker, e.line, 2});
  }
  return items;
}

void set_dash(cairo_t* cr, LineStyle style, double width) {
  if (style == LineStyle::kDashed) {
    const double d[] = {std::max(5.0, 3.0 * width), std::max(3.5, 2.0 * width)};
    cairo_set_dash(cr, d, 2, 0);
  } else if (style == LineStyle::kDotted) {
    const double d[] = {0.1, std::max(3.0, 2.0 * width)};
    cairo_set_dash(cr, d, 2, 0);
  } else {
    cairo_set_dash(cr, nullptr, 0, 0);
  }
}

void draw_marker(cairo_t* cr, Marker m, double x, double y, double r, Color c) {
  set_color(cr, c);
  switch (m) {
    case Marker::kCircle:
      cairo_new_sub_path(cr);
      cairo_arc(cr, x, y, r, 0, 2 * kPi);
      cairo_fill(cr);
      break;
    case Marker::kSquare:
      cairo_rectangle(cr, x - r, y - r, 2 * r, 2 * r);
      cairo_fill(cr);
      break;
    case Marker::kCross:
      cairo_set_dash(cr, nullptr, 0, 0);
      cairo_set_line_width(cr, std::max(1.5, 0.5 * r));
      cairo_move_to(cr, x - r, y - r);
      cairo_line_to(cr, x + r, y + r);
      cairo_move_to(cr, x - r, y + r);
      cairo_line_to(cr, x + r, y - r);
      cairo_stroke(cr);
      break;
    case Marker::kNone:
      break;
  }
}

void draw_legend_sample(cairo_t* cr, const LegendItem& it, double x, double y) {
  if (it.swatch) {
    set_color(cr, it.color);
    cairo_rectangle(cr, x + 5, y - 6, 14, 12);
    cairo_fill_preserve(cr);
    cairo_set_source_rgba(cr, 0.4, 0.4, 0.4, 1);
    cairo_set_line_width(cr, 0.8);
    cairo_set_dash(cr, nullptr, 0, 0);
    cairo_stroke(cr);
    return;
  }
  if (it.line) {
    set_color(cr, it.color);
    cairo_set_line_width(cr, std::min(it.width, 3.0));
    cairo_set_line_cap(cr, CAIRO_LINE_CAP_ROUND);
    set_dash(cr, it.style, std::min(it.width, 3.0));
    cairo_move_to(cr, x + 1, y);
    cairo_line_to(cr, x + kLegendSample - 1, y);
    cairo_stroke(cr);
    cairo_set_dash(cr, nullptr, 0, 0);
  }
  if (it.marker != Marker::kNone)
    draw_marker(cr, it.marker, x + kLegendSample / 2, y, 3.5, it.color);
}

Rect legend_box(cairo_t* cr, const std::vector<LegendItem>& items) {
  double w = 0;
  for (const auto& it : items) w = std::max(w, text_width(cr, it.label, kLegendSize));
  return {0, 0, w + kLegendSample + 6 + 16, static_cast<double>(items.size()) * kLegendRow + 10};
}

void draw_legend_at(cairo_t* cr, const std::vector<LegendItem>& items, Rect box) {
  cairo_set_source_rgba(cr, 1, 1, 1, 0.88);
  cairo_rectangle(cr, box.x, box.y, box.w, box.h);
  cairo_fill_preserve(cr);
  cairo_set_source_rgba(cr, 0.7, 0.7, 0.7, 1);
  cairo_set_line_width(cr, 0.8);
  cairo_set_dash(cr, nullptr, 0, 0);
  cairo_stroke(cr);
  double y = box.y + 5 + kLegendRow / 2;
  for (const auto& it : items) {
    draw_legend_sample(cr, it, box.x + 8, y);
    draw_text(cr, it.label, box.x + 8 + kLegendSample + 6, y, kLegendSize, false, Anchor::kLeft,
              {0.1, 0.1, 0.1, 1});
    y += kLegendRow;
  }
}

// ---------------------------------------------------------------------------------------------
// Drawing a panel.

void draw_heatmap(cairo_t* cr, const HeatMap& h, const PanelLayout& L) {
  const Range vr = value_range(h);
  auto color_of = [&](double v) {
    if (!std::isfinite(v)) return masked_color();
    return colormap_color(h.colormap, (v - vr.lo) / (vr.hi - vr.lo));
  };
  const double left = L.px(h.x0 - 0.5 * h.dx);
  const double top = L.py(h.y0 - 0.5 * h.dy);
  const double cw = L.px(h.x0 + 0.5 * h.dx) - left;
  const double ch = L.py(h.y0 + 0.5 * h.dy) - top;
  const bool cells = std::fabs(cw) >= 2 && std::fabs(ch) >= 2 && h.rows * h.cols <= 20000;
  if (cells) {
    // One rectangle per cell, each overlapping its right and lower neighbours by half a pixel so
    // that no seam shows between antialiased edges (SVG viewers antialias every edge).
    cairo_set_antialias(cr, CAIRO_ANTIALIAS_NONE);
    const double ox = cw > 0 ? 0.5 : -0.5, oy = ch > 0 ? 0.5 : -0.5;
    for (int64_t r = 0; r < h.rows; ++r) {
      for (int64_t c = 0; c < h.cols; ++c) {
        set_color(cr, color_of(h.values[static_cast<std::size_t>(r * h.cols + c)]));
        const double x = left + static_cast<double>(c) * cw;
        const double y = top + static_cast<double>(r) * ch;
        cairo_rectangle(cr, x, y, cw + (c + 1 < h.cols ? ox : 0), ch + (r + 1 < h.rows ? oy : 0));
        cairo_fill(cr);
      }
    }
    cairo_set_antialias(cr, CAIRO_ANTIALIAS_DEFAULT);
    return;
  }
  cairo_surface_t* img = cairo_image_surface_create(CAIRO_FORMAT_RGB24, static_cast<int>(h.cols),
                                                    static_cast<int>(h.rows));
  cairo_surface_flush(img);
  unsigned char* data = cairo_image_surface_get_data(img);
  const int stride = cairo_image_surface_get_stride(img);
  for (int64_t r = 0; r < h.rows; ++r) {
    auto* row = reinterpret_cast<uint32_t*>(data + r * stride);
    for (int64_t c = 0; c < h.cols; ++c) {
      const Color col = color_of(h.values[static_cast<std::size_t>(r * h.cols + c)]);
      auto byte = [](double v) { return static_cast<uint32_t>(std::lround(v * 255.0)); };
      row[c] = 0xFF000000u | (byte(col.r) << 16) | (byte(col.g) << 8) | byte(col.b);
    }
  }
  cairo_surface_mark_dirty(img);
  cairo_save(cr);
  cairo_translate(cr, left, top);
  cairo_scale(cr, cw, ch);
  cairo_set_source_surface(cr, img, 0, 0);
  cairo_pattern_t* pat = cairo_get_source(cr);
  cairo_pattern_set_extend(pat, CAIRO_EXTEND_PAD);
  cairo_pattern_set_filter(pat, CAIRO_FILTER_GOOD);
  cairo_rectangle(cr, 0, 0, static_cast<double>(h.cols), static_cast<double>(h.rows));
  cairo_fill(cr);
  cairo_restore(cr);
  cairo_surface_destroy(img);
}

void draw_series(cairo_t* cr, const Series& s, const PanelLayout& L) {
  if (s.line && s.x.size() > 1) {
    set_color(cr, s.color);
    cairo_set_line_width(cr, s.width);
    cairo_set_line_cap(cr, CAIRO_LINE_CAP_ROUND);
    cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
    set_dash(cr, s.style, s.width);
    bool pen = false;
    double prev_y = 0;
    for (std::size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.y[i]) || !std::isfinite(s.x[i])) {
        pen = false;
        continue;
      }
      const double x = L.px(s.x[i]), y = L.py(s.y[i]);
      if (!pen) {
        cairo_move_to(cr, x, y);
        pen = true;
      } else {
        if (s.step) cairo_line_to(cr, x, prev_y);
        cairo_line_to(cr, x, y);
      }
      prev_y = y;
    }
    cairo_stroke(cr);
    cairo_set_dash(cr, nullptr, 0, 0);
  }
  if (s.marker != Marker::kNone) {
    for (std::size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.y[i]) || !std::isfinite(s.x[i])) continue;
      draw_marker(cr, s.marker, L.px(s.x[i]), L.py(s.y[i]), s.marker_size, s.color);
    }
  }
}

void draw_arrow(cairo_t* cr, const Arrow& a, const PanelLayout& L) {
  const double x0 = L.px(a.x0), y0 = L.py(a.y0), x1 = L.px(a.x1), y1 = L.py(a.y1);
  const double len = std::hypot(x1 - x0, y1 - y0);
  set_color(cr, a.color);
  cairo_set_line_cap(cr, CAIRO_LINE_CAP_ROUND);
  cairo_set_dash(cr, nullptr, 0, 0);
  if (len < 1e-9) return;
  const double ux = (x1 - x0) / len, uy = (y1 - y0) / len;
  const double head_len = a.head ? std::min(0.45 * len, 5.0 + 2.5 * a.width) : 0.0;
  const double head_w = a.head ? std::min(0.3 * len, 2.5 + 1.5 * a.width) : 0.0;
  cairo_set_line_width(cr, a.width);
  cairo_move_to(cr, x0, y0);
  cairo_line_to(cr, x1 - ux * head_len * 0.8, y1 - uy * head_len * 0.8);
  cairo_stroke(cr);
  if (a.head) {
    const double bx = x1 - ux * head_len, by = y1 - uy * head_len;
    cairo_move_to(cr, x1, y1);
    cairo_line_to(cr, bx - uy * head_w, by + ux * head_w);
    cairo_line_to(cr, bx + uy * head_w, by - ux * head_w);
    cairo_close_path(cr);
    cairo_fill(cr);
  }
}

void draw_circle(cairo_t* cr, const Circle& c, const PanelLayout& L) {
  const double sx = L.px(c.cx + 1) - L.px(c.cx);
  const double sy = L.py(c.cy + 1) - L.py(c.cy);
  cairo_save(cr);
  cairo_translate(cr, L.px(c.cx), L.py(c.cy));
  cairo_scale(cr, sx, sy);
  cairo_new_sub_path(cr);
  cairo_arc(cr, 0, 0, c.r, 0, 2 * kPi);
  cairo_restore(cr);
  if (c.fill) {
    set_color(cr, *c.fill);
    cairo_fill_preserve(cr);
  }
  set_color(cr, c.stroke);
  cairo_set_line_width(cr, c.width);
  set_dash(cr, c.style, c.width);
  cairo_stroke(cr);
  cairo_set_dash(cr, nullptr, 0, 0);
}

// Points a legend box would hide: series points, arrow tips and circle outlines in page space.
std::vector<std::array<double, 2>> occupied_points(const Panel& p, const PanelLayout& L) {
  std::vector<std::array<double, 2>> pts;
  for (const Series& s : p.series) {
    const std::size_t n = s.x.size();
    const std::size_t every = std::max<std::size_t>(1, n / 400);
    for (std::size_t i = 0; i < n; i += every) {
      if (std::isfinite(s.y[i])) pts.push_back({L.px(s.x[i]), L.py(s.y[i])});
      // Points in between, so that a line crossing a corner counts too.
      if (s.line && i + every < n && std::isfinite(s.y[i + every])) {
        for (int k = 1; k < 4; ++k) {
          const double f = k / 4.0;
          pts.push_back({L.px(s.x[i] + f * (s.x[i + every] - s.x[i])),
                         L.py(s.y[i] + f * (s.y[i + every] - s.y[i]))});
        }
      }
    }
  }
  for (const Arrow& a : p.arrows) {
    for (int k = 0; k <= 8; ++k) {
      const double f = k / 8.0;
      pts.push_back({L.px(a.x0 + f * (a.x1 - a.x0)), L.py(a.y0 + f * (a.y1 - a.y0))});
    }
  }
  for (const Circle& c : p.circles) {
    for (int k = 0; k < 48; ++k) {
      const double t = 2 * kPi * k / 48.0;
      pts.push_back({L.px(c.cx + c.r * std::cos(t)), L.py(c.cy + c.r * std::sin(t))});
    }
  }
  for (const Text& t : p.texts) pts.push_back({L.px(t.x), L.py(t.y)});
  return pts;
}

void draw_panel(cairo_t* cr, const Panel& p, const PanelLayout& L) {
  const Rect& R = L.plot;
  const Color frame{0.25, 0.25, 0.25, 1};
  const Color grid{0.9, 0.9, 0.9, 1};
  const Color tick_text{0.2, 0.2, 0.2, 1};
  // Grid.
  if (p.grid && !p.heatmap) {
    set_color(cr, grid);
    cairo_set_line_width(cr, 1);
    for (double t : L.x_ticks) {
      const double x = std::round(L.px(t)) + 0.5;
      cairo_move_to(cr, x, R.y);
      cairo_line_to(cr, x, R.y + R.h);
    }
    for (double t : L.y_ticks) {
      const double y = std::round(L.py(t)) + 0.5;
      cairo_move_to(cr, R.x, y);
      cairo_line_to(cr, R.x + R.w, y);
    }
    cairo_stroke(cr);
  }
  // Data, clipped to the plot rectangle.
  cairo_save(cr);
  cairo_rectangle(cr, R.x, R.y, R.w, R.h);
  cairo_clip(cr);
  if (p.heatmap) draw_heatmap(cr, *p.heatmap, L);
  for (const RefLine& r : p.ref_lines) {
    set_color(cr, r.color);
    cairo_set_line_width(cr, r.width);
    set_dash(cr, r.style, r.width);
    if (r.vertical) {
      cairo_move_to(cr, L.px(r.at), R.y);
      cairo_line_to(cr, L.px(r.at), R.y + R.h);
    } else {
      cairo_move_to(cr, R.x, L.py(r.at));
      cairo_line_to(cr, R.x + R.w, L.py(r.at));
    }
    cairo_stroke(cr);
    cairo_set_dash(cr, nullptr, 0, 0);
  }
  for (const Circle& c : p.circles) draw_circle(cr, c, L);
  for (const Series& s : p.series) draw_series(cr, s, L);
  for (const Arrow& a : p.arrows) draw_arrow(cr, a, L);
  for (const Text& t : p.texts) {
    draw_text(cr, t.text, L.px(t.x), L.py(t.y), t.size, t.bold, t.anchor, t.color);
  }
  cairo_restore(cr);
  // Frame and ticks.
  set_color(cr, frame);
  cairo_set_line_width(cr, 1);
  cairo_set_dash(cr, nullptr, 0, 0);
  cairo_rectangle(cr, std::round(R.x) + 0.5, std::round(R.y) + 0.5, std::round(R.w),
                  std::round(R.h));
  cairo_stroke(cr);
  const double bottom = std::round(R.y + R.h) + 0.5;
  const auto xl = axis_labels(p.x, L.x_ticks);
  for (std::size_t i = 0; i < L.x_ticks.size(); ++i) {
    const double x = std::round(L.px(L.x_ticks[i])) + 0.5;
    set_color(cr, frame);
    cairo_move_to(cr, x, bottom);
    cairo_line_to(cr, x, bottom + kTickLength);
    cairo_stroke(cr);
    if (i < xl.size()) {
      draw_text(cr, xl[i], x, bottom + kTickLength + 9, kTickSize, false, Anchor::kCenter,
                tick_text);
    }
  }
  const double left = std::round(R.x) + 0.5;
  const auto yl = axis_labels(p.y, L.y_ticks);
  double max_label = 0;
  for (std::size_t i = 0; i < L.y_ticks.size(); ++i) {
    const double y = std::round(L.py(L.y_ticks[i])) + 0.5;
    set_color(cr, frame);
    cairo_move_to(cr, left, y);
    cairo_line_to(cr, left - kTickLength, y);
    cairo_stroke(cr);
    if (i < yl.size()) {
      draw_text(cr, yl[i], left - kTickLength - 3, y, kTickSize, false, Anchor::kRight, tick_text);
      max_label = std::max(max_label, text_width(cr, yl[i], kTickSize));
    }
  }
  // Axis labels and title.
  draw_text(cr, p.x.label, R.x + R.w / 2, bottom + kTickLength + 29, kLabelSize, false,
            Anchor::kCenter, {0.1, 0.1, 0.1, 1});
  draw_text(cr, p.y.label, left - kTickLength - 3 - max_label - 12, R.y + R.h / 2, kLabelSize,
            false, Anchor::kCenter, {0.1, 0.1, 0.1, 1}, true);
  {
    // Centred on the plot, moved (then shrunk, down to 11 px) to stay inside the cell.
    double size = kPanelTitleSize;
    const double room = L.cell.w - 6;
    while (size > 11 && text_width(cr, p.title, size, true) > room) size -= 0.5;
    const double w = text_width(cr, p.title, size, true);
    const double cx = std::clamp(R.x + R.w / 2, L.cell.x + 3 + w / 2,
                                 std::max(L.cell.x + 3 + w / 2, L.cell.x + L.cell.w - 3 - w / 2));
    draw_text(cr, p.title, cx, R.y - 12, size, true, Anchor::kCenter, {0.05, 0.05, 0.05, 1});
  }
  // Colour bar.
  if (p.heatmap && p.heatmap->colorbar && L.colorbar.w > 0) {
    const HeatMap& h = *p.heatmap;
    draw_colorbar(cr, L.colorbar, h.colormap, value_range(h), h.integer_ticks, h.colorbar_label);
  }
  // Legend: the corner that hides the fewest points.
  const auto items = legend_items(p);
  if (!items.empty() && p.legend == LegendPlace::kAuto) {
    Rect box = legend_box(cr, items);
    const auto pts = occupied_points(p, L);
    const double inset = 6;
    // Corners first (preferred on ties), then the middles of the edges.
    const double right = R.x + R.w - box.w - inset, bottom_y = R.y + R.h - box.h - inset;
    const double mid_x = R.x + 0.5 * (R.w - box.w), mid_y = R.y + 0.5 * (R.h - box.h);
    const std::array<std::array<double, 2>, 8> corners = {{
        {right, R.y + inset},
        {R.x + inset, R.y + inset},
        {right, bottom_y},
        {R.x + inset, bottom_y},
        {mid_x, R.y + inset},
        {mid_x, bottom_y},
        {right, mid_y},
        {R.x + inset, mid_y},
    }};
    std::size_t best = 0, best_count = std::numeric_limits<std::size_t>::max();
    for (std::size_t c = 0; c < corners.size(); ++c) {
      std::size_t n = 0;
      for (const auto& q : pts) {
        if (q[0] >= corners[c][0] - 3 && q[0] <= corners[c][0] + box.w + 3 &&
            q[1] >= corners[c][1] - 3 && q[1] <= corners[c][1] + box.h + 3) {
          ++n;
        }
      }
      if (n < best_count) {
        best_count = n;
        best = c;
      }
    }
    box.x = corners[best][0];
    box.y = corners[best][1];
    draw_legend_at(cr, items, box);
  }
}

// The figure-wide legend: rows of entries, centred, wrapped to the width.
struct FigureLegendRow {
  std::vector<std::size_t> items;
  double width = 0;
};

std::vector<FigureLegendRow> figure_legend_rows(cairo_t* cr, const Figure& fig) {
  std::vector<FigureLegendRow> rows;
  const double max_w = fig.width - 24;
  for (std::size_t i = 0; i < fig.legend.size(); ++i) {
    const double w = kLegendSample + 6 + text_width(cr, fig.legend[i].label, kLegendSize) + 18;
    if (rows.empty() || rows.back().width + w > max_w) rows.push_back({});
    rows.back().items.push_back(i);
    rows.back().width += w;
  }
  return rows;
}

double header_height(const Figure& fig) {
  double h = 6;
  if (!fig.title.empty()) h += 26;
  if (!fig.subtitle.empty()) h += 18;
  return h + 4;
}

void validate_figure(const Figure& fig) {
  if (!(fig.width >= 50 && fig.width <= 20000 && fig.height >= 50 && fig.height <= 20000)) {
    throw ValueError("figure: width and height must be in [50, 20000] px (got " +
                     std::to_string(fig.width) + " x " + std::to_string(fig.height) + ")");
  }
  if (fig.columns < 1) throw ValueError("figure: columns must be >= 1");
  if (fig.colorbar && !(fig.colorbar->range.hi > fig.colorbar->range.lo)) {
    throw ValueError("figure: colour bar range must have hi > lo");
  }
  for (const Panel& p : fig.panels) {
    for (const Series& s : p.series) {
      if (s.x.size() != s.y.size()) {
        throw ValueError("figure: series '" + s.label + "' has " + std::to_string(s.x.size()) +
                         " x values and " + std::to_string(s.y.size()) + " y values");
      }
    }
    if (p.heatmap) {
      const HeatMap& h = *p.heatmap;
      if (h.rows < 1 || h.cols < 1 || h.rows > 65536 || h.cols > 65536 ||
          static_cast<int64_t>(h.values.size()) != h.rows * h.cols) {
        throw ValueError("figure: heat map of " + std::to_string(h.rows) + " x " +
                         std::to_string(h.cols) + " cells has " + std::to_string(h.values.size()) +
                         " values");
      }
      if (!(h.dx > 0 && h.dy > 0)) throw ValueError("figure: heat map cell size must be > 0");
    }
  }
}

double figure_colorbar_width(cairo_t* cr, const Figure& fig, double grid_h) {
  if (!fig.colorbar) return 0;
  const ColorBar& c = *fig.colorbar;
  return colorbar_space(cr, c.range, c.integer_ticks, c.label, grid_h) + 4;
}

std::vector<PanelLayout> layout_with(cairo_t* cr, const Figure& fig) {
  validate_figure(fig);
  const double top = header_height(fig);
  const auto legend_rows = figure_legend_rows(cr, fig);
  const double legend_h =
      legend_rows.empty() ? 0 : static_cast<double>(legend_rows.size()) * 20 + 8;
  const int n = static_cast<int>(fig.panels.size());
  const int cols = std::max(1, std::min(fig.columns, std::max(n, 1)));
  const int rows = (n + cols - 1) / cols;
  const double grid_h = fig.height - top - legend_h - 4;
  const double grid_w = fig.width - 8 - figure_colorbar_width(cr, fig, grid_h);
  std::vector<PanelLayout> out;
  for (int i = 0; i < n; ++i) {
    const Panel& p = fig.panels[static_cast<std::size_t>(i)];
    PanelLayout L;
    L.cell = {4 + (i % cols) * grid_w / cols, top + (i / cols) * grid_h / std::max(rows, 1),
              grid_w / cols, grid_h / std::max(rows, 1)};
    data_ranges(p, L.x, L.y);
    L.y_down = p.y_down;
    const double top_space = p.title.empty() ? 10 : 30;
    const double bottom_space = kTickLength + 18 + (p.x.label.empty() ? 4 : 22);
    const double approx_h = std::max(20.0, L.cell.h - top_space - bottom_space);
    L.y_ticks = axis_ticks(p.y, L.y, approx_h, 42);
    double yw = 0;
    for (const auto& s : axis_labels(p.y, L.y_ticks))
      yw = std::max(yw, text_width(cr, s, kTickSize));
    const double left_space = 8 + (p.y.label.empty() ? 0 : 22) + yw + kTickLength + 3;
    double right_space = 12;
    if (p.heatmap)
      right_space = std::max(right_space, colorbar_space(cr, *p.heatmap, approx_h) + 6);
    // Room for the last x tick label to overhang the frame.
    right_space = std::max(right_space, 18.0);
    L.plot = {L.cell.x + left_space, L.cell.y + top_space,
              std::max(20.0, L.cell.w - left_space - right_space),
              std::max(20.0, L.cell.h - top_space - bottom_space)};
    if (p.equal_aspect) {
      const double sx = L.plot.w / (L.x.hi - L.x.lo), sy = L.plot.h / (L.y.hi - L.y.lo);
      const double s = std::min(sx, sy);
      const double w = s * (L.x.hi - L.x.lo), h = s * (L.y.hi - L.y.lo);
      L.plot.x += 0.5 * (L.plot.w - w);
      L.plot.y += 0.5 * (L.plot.h - h);
      L.plot.w = w;
      L.plot.h = h;
    }
    L.y_ticks = axis_ticks(p.y, L.y, L.plot.h, 42);
    double max_x_label = 0;
    const auto provisional = axis_ticks(p.x, L.x, L.plot.w, 70);
    for (const auto& s : axis_labels(p.x, provisional)) {
      max_x_label = std::max(max_x_label, text_width(cr, s, kTickSize));
    }
    L.x_ticks = axis_ticks(p.x, L.x, L.plot.w, std::max(70.0, max_x_label + 16));
    if (p.heatmap && p.heatmap->colorbar) {
      L.colorbar = {L.plot.x + L.plot.w + kColorbarGap, L.plot.y, kColorbarWidth, L.plot.h};
    }
    out.push_back(L);
  }
  return out;
}

void render_figure(cairo_t* cr, const Figure& fig) {
  const auto layouts = layout_with(cr, fig);
  cairo_set_source_rgb(cr, 1, 1, 1);
  cairo_paint(cr);
  double y = 6;
  if (!fig.title.empty()) {
    draw_text(cr, fig.title, fig.width / 2, y + 13, kTitleSize, true, Anchor::kCenter,
              {0, 0, 0, 1});
    y += 26;
  }
  if (!fig.subtitle.empty()) {
    draw_text(cr, fig.subtitle, fig.width / 2, y + 8, kSubtitleSize, false, Anchor::kCenter,
              {0.3, 0.3, 0.3, 1});
  }
  for (std::size_t i = 0; i < layouts.size(); ++i) draw_panel(cr, fig.panels[i], layouts[i]);
  if (fig.colorbar) {
    // Spans the plots' vertical extent, right of the grid.
    double top = fig.height, bottom = 0, right = 0;
    for (const auto& L : layouts) {
      top = std::min(top, L.plot.y);
      bottom = std::max(bottom, L.plot.y + L.plot.h);
      right = std::max(right, L.cell.x + L.cell.w);
    }
    if (layouts.empty()) {
      top = header_height(fig);
      bottom = fig.height - 20;
      right = fig.width / 2;
    }
    const ColorBar& c = *fig.colorbar;
    draw_colorbar(cr, {right + kColorbarGap - 8, top, kColorbarWidth, bottom - top}, c.colormap,
                  c.range, c.integer_ticks, c.label);
  }
  const auto rows = figure_legend_rows(cr, fig);
  double ly = fig.height - static_cast<double>(rows.size()) * 20 - 2;
  for (const auto& row : rows) {
    double x = (fig.width - row.width) / 2 + 9;
    for (std::size_t idx : row.items) {
      const LegendEntry& e = fig.legend[idx];
      const LegendItem it{e.label, e.color, e.swatch, e.style, e.marker, e.line, 2.5};
      draw_legend_sample(cr, it, x, ly + 8);
      draw_text(cr, e.label, x + kLegendSample + 6, ly + 8, kLegendSize, false, Anchor::kLeft,
                {0.1, 0.1, 0.1, 1});
      x += kLegendSample + 6 + text_width(cr, e.label, kLegendSize) + 18;
    }
    ly += 20;
  }
}

cairo_status_t append_bytes(void* closure, const unsigned char* data, unsigned int length) {
  auto* out = static_cast<std::vector<unsigned char>*>(closure);
  out->insert(out->end(), data, data + length);
  return CAIRO_STATUS_SUCCESS;
}

void check_status(cairo_status_t st, const char* what) {
  if (st != CAIRO_STATUS_SUCCESS) {
    throw IoError(std::string("plot: ") + what + ": " + cairo_status_to_string(st));
  }
}

std::string lower_extension(const std::string& path) {
  const auto slash = path.find_last_of('/');
  const auto dot = path.find_last_of('.');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return "";
  std::string ext = path.substr(dot);
  for (char& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return ext;
}

}  // namespace

// -----------------------------------------------------------------------------------------------

Color rgb(uint32_t hex, double alpha) {
  return {static_cast<double>((hex >> 16) & 0xFF) / 255.0,
          static_cast<double>((hex >> 8) & 0xFF) / 255.0, static_cast<double>(hex & 0xFF) / 255.0,
          alpha};
}

Color colormap_color(Colormap map, double t) {
  if (!(t >= 0)) t = 0;  // NaN too
  if (t > 1) t = 1;
  const Table& tab = table(map);
  const double f = t * 255.0;
  const auto i = static_cast<std::size_t>(std::min(254.0, std::floor(f)));
  const double w = f - static_cast<double>(i);
  const Color& a = tab[i];
  const Color& b = tab[i + 1];
  return {a.r + w * (b.r - a.r), a.g + w * (b.g - a.g), a.b + w * (b.b - a.b), 1.0};
}

double colormap_lookup(Colormap map, Color c) {
  const Table& tab = table(map);
  std::size_t best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < tab.size(); ++i) {
    const double d = (tab[i].r - c.r) * (tab[i].r - c.r) + (tab[i].g - c.g) * (tab[i].g - c.g) +
                     (tab[i].b - c.b) * (tab[i].b - c.b);
    if (d < best_d) {
      best_d = d;
      best = i;
    }
  }
  return static_cast<double>(best) / 255.0;
}

Color category_color(int index) {
  static constexpr uint32_t kPalette[] = {0x2166c4, 0xe0562a, 0x2e9e4f, 0x8e44ad,
                                          0xd99a00, 0x1aa3b8, 0x6b6b6b, 0xd6337f};
  const int n = static_cast<int>(sizeof(kPalette) / sizeof(kPalette[0]));
  return rgb(kPalette[((index % n) + n) % n]);
}

Color masked_color() { return rgb(0xdcdcdc); }

double PanelLayout::px(double xv) const { return plot.x + (xv - x.lo) / (x.hi - x.lo) * plot.w; }

double PanelLayout::py(double yv) const {
  const double f = (yv - y.lo) / (y.hi - y.lo);
  return y_down ? plot.y + f * plot.h : plot.y + plot.h - f * plot.h;
}

std::vector<PanelLayout> layout(const Figure& fig) {
  Measure m;
  return layout_with(m.cr, fig);
}

Format format_from_path(const std::string& path) {
  const std::string ext = lower_extension(path);
  if (ext == ".png") return Format::kPng;
  if (ext == ".svg") return Format::kSvg;
  throw ValueError(path + ": unsupported extension '" + ext + "' (use .png or .svg)");
}

std::vector<unsigned char> render(const Figure& fig, Format format, double scale) {
  validate_figure(fig);
  if (!(scale > 0 && scale <= 8)) {
    throw ValueError("plot: scale must be in (0, 8] (got " + std::to_string(scale) + ")");
  }
  std::vector<unsigned char> bytes;
  if (format == Format::kPng) {
    const int w = static_cast<int>(std::ceil(fig.width * scale));
    const int h = static_cast<int>(std::ceil(fig.height * scale));
    cairo_surface_t* s = cairo_image_surface_create(CAIRO_FORMAT_RGB24, w, h);
    std::unique_ptr<cairo_surface_t, void (*)(cairo_surface_t*)> guard(s, cairo_surface_destroy);
    check_status(cairo_surface_status(s), "creating the image");
    cairo_t* cr = cairo_create(s);
    cairo_scale(cr, scale, scale);
    try {
      render_figure(cr, fig);
    } catch (...) {
      cairo_destroy(cr);
      throw;
    }
    const cairo_status_t st = cairo_status(cr);
    cairo_destroy(cr);
    check_status(st, "drawing");
    cairo_surface_flush(s);
    check_status(cairo_surface_write_to_png_stream(s, append_bytes, &bytes), "encoding PNG");
  } else {
    cairo_surface_t* s =
        cairo_svg_surface_create_for_stream(append_bytes, &bytes, fig.width, fig.height);
    std::unique_ptr<cairo_surface_t, void (*)(cairo_surface_t*)> guard(s, cairo_surface_destroy);
    check_status(cairo_surface_status(s), "creating the SVG");
    cairo_svg_surface_set_document_unit(s, CAIRO_SVG_UNIT_PX);
    cairo_t* cr = cairo_create(s);
    try {
      render_figure(cr, fig);
    } catch (...) {
      cairo_destroy(cr);
      throw;
    }
    const cairo_status_t st = cairo_status(cr);
    cairo_destroy(cr);
    check_status(st, "drawing");
    cairo_surface_finish(s);
    check_status(cairo_surface_status(s), "encoding SVG");
  }
  return bytes;
}

void save(const Figure& fig, const std::string& path, double scale) {
  const Format f = format_from_path(path);
  const std::vector<unsigned char> bytes = render(fig, f, scale);
  write_file_atomic(path, bytes.data(), bytes.size());
}

std::vector<double> nice_ticks(double lo, double hi, int target, bool integer) {
  if (!(hi > lo) || !std::isfinite(lo) || !std::isfinite(hi)) return {lo};
  const double span = hi - lo;
  const double raw = span / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double n = raw / mag;
  double step = (n < 1.5 ? 1.0 : n < 3.0 ? 2.0 : n < 7.0 ? 5.0 : 10.0) * mag;
  if (integer) step = std::max(1.0, std::round(step));
  const double first = std::ceil(lo / step - 1e-9);
  std::vector<double> ticks;
  for (double k = first;; k += 1) {
    double v = k * step;
    if (v > hi + 1e-9 * span) break;
    if (std::fabs(v) < 1e-12 * span) v = 0;
    ticks.push_back(v);
    if (ticks.size() > 1000) break;
  }
  return ticks;
}

std::vector<std::string> tick_labels(const std::vector<double>& ticks) {
  double max_abs = 0;
  for (double t : ticks) max_abs = std::max(max_abs, std::fabs(t));
  double unit = 1;
  const char* suffix = "";
  if (max_abs >= 1e6) {
    unit = 1e6;
    suffix = "M";
  } else if (max_abs >= 1e5) {
    unit = 1e3;
    suffix = "k";
  }
  // Fewest decimals that show every tick exactly (up to 6).
  int decimals = 0;
  for (; decimals < 6; ++decimals) {
    const double p = std::pow(10.0, decimals);
    bool ok = true;
    for (double t : ticks) {
      const double v = t / unit * p;
      if (std::fabs(v - std::round(v)) > 1e-6 * std::max(1.0, std::fabs(v))) ok = false;
    }
    if (ok) break;
  }
  std::vector<std::string> out;
  for (double t : ticks) {
    char buf[64];
    double v = t / unit;
    if (std::fabs(v) < 0.5 * std::pow(10.0, -decimals)) v = 0;
    std::snprintf(buf, sizeof(buf), "%.*f%s", decimals, v, v == 0 ? "" : suffix);
    std::string s = buf;
    if (!s.empty() && s[0] == '-') s = "\u2212" + s.substr(1);
    out.push_back(s);
  }
  return out;
}

}  // namespace posenc::plot
