// plot/figure.h - a small chart toolkit on cairo: figures made of panels (line plots, points,
// heat maps, circles, arrows, text), with axes, ticks, titles, legends and colour bars, rendered
// to PNG or SVG.
//
// A Figure is a plain value describing what to draw, in data coordinates; layout() places it on
// the page and render_*() / save() draw it. Nothing here knows about positional encodings: the
// figures of posenc are built in plots.h from the public API.
//
// Units are CSS pixels: a Figure{.width = 800} is an 800-pixel-wide PNG at scale 1 and an SVG
// of width="800px". Fonts are DejaVu Sans through cairo's toy text API; at scale 1 the smallest
// text (tick labels, legends) is 12 px. Errors throw posenc::ValueError (bad figure, bad
// extension) or posenc::IoError (cairo or file failures); nothing aborts.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace posenc::plot {

struct Color {
  double r = 0, g = 0, b = 0, a = 1;
};
// 0xRRGGBB.
Color rgb(uint32_t hex, double alpha = 1.0);

// Continuous colormaps, built from formulas in the Oklab perceptual colour space (Ottosson 2020):
//   kViridis   sequential: lightness rises linearly from 0.30 to 0.92 while the hue turns from
//              purple through blue, teal and green to yellow (viridis-like, perceptually ordered);
//   kDiverging signed values: blue (t = 0), near-white (t = 0.5), red (t = 1), lightness
//              symmetric about the middle.
// Each is tabulated once at 256 entries.
enum class Colormap { kViridis, kDiverging };
Color colormap_color(Colormap map, double t);  // t in [0, 1] (clamped; NaN -> t = 0)
// The t of the table entry nearest to `c` (squared RGB distance): maps a rendered pixel back to
// its value. The result is a multiple of 1/255.
double colormap_lookup(Colormap map, Color c);
// Distinct colours for lines and categories (cycles after 8).
Color category_color(int index);
// Colour of masked (NaN) heat map cells.
Color masked_color();

struct Range {
  double lo = 0, hi = 1;
};

enum class LineStyle { kSolid, kDashed, kDotted };
enum class Marker { kNone, kCircle, kCross, kSquare };

// A line (or points) in data coordinates.
struct Series {
  std::vector<double> x, y;  // same length; NaN y breaks the line
  std::string label;         // legend entry; empty: not in the legend
  Color color = {0, 0, 0, 1};
  double width = 2.0;
  LineStyle style = LineStyle::kSolid;
  bool line = true;   // connect the points
  bool step = false;  // connect as steps: horizontal to the next x, then vertical
  Marker marker = Marker::kNone;
  double marker_size = 3.5;  // radius in px
};

// A matrix drawn as cells: cell (r, c) is centred at (x0 + c dx, y0 + r dy). NaN cells are masked
// (drawn in masked_color()).
struct HeatMap {
  int64_t rows = 0, cols = 0;
  std::vector<double> values;  // [rows, cols] row-major
  double x0 = 0, dx = 1, y0 = 0, dy = 1;
  Colormap colormap = Colormap::kViridis;
  // Values mapped to t = 0 and t = 1. Default: the finite min and max (kDiverging: symmetric
  // about 0, i.e. -max|v| .. max|v|).
  std::optional<Range> value_range;
  bool colorbar = true;  // a colour bar right of the panel
  std::string colorbar_label;
  bool integer_ticks = false;  // colour bar ticks on integers only (bucket indices)
};

struct Circle {
  double cx = 0, cy = 0, r = 1;  // data units (use equal_aspect for round circles)
  Color stroke = {0, 0, 0, 1};
  double width = 1.5;
  LineStyle style = LineStyle::kSolid;
  std::optional<Color> fill;
};

// A straight arrow from (x0, y0) to (x1, y1) in data coordinates, head at the end.
struct Arrow {
  double x0 = 0, y0 = 0, x1 = 0, y1 = 0;
  Color color = {0, 0, 0, 1};
  double width = 2.0;
  bool head = true;
};

enum class Anchor { kLeft, kCenter, kRight };

// Text at a point in data coordinates (anchored horizontally, vertically centred).
struct Text {
  double x = 0, y = 0;
  std::string text;
  Color color = {0.2, 0.2, 0.2, 1};
  double size = 12;
  Anchor anchor = Anchor::kCenter;
  bool bold = false;
};

// A horizontal (or vertical) reference line across the panel, with an optional label.
struct RefLine {
  bool vertical = false;
  double at = 0;
  Color color = {0.35, 0.35, 0.35, 1};
  double width = 1.2;
  LineStyle style = LineStyle::kDashed;
  std::string label;  // legend entry when not empty
};

// A legend entry that is not a series: a filled swatch, or a line sample.
struct LegendEntry {
  std::string label;
  Color color;
  bool swatch = false;  // a filled square instead of a line sample
  LineStyle style = LineStyle::kSolid;
  Marker marker = Marker::kNone;
  bool line = true;
};

struct Axis {
  std::string label;
  std::optional<Range> range;  // default: the data's extent (+4% for series and shapes)
  bool integer_ticks = false;
  std::vector<double> ticks;             // explicit ticks (default: 1-2-5 steps)
  std::vector<std::string> tick_labels;  // with explicit ticks, same length (default: numbers)
};

enum class LegendPlace { kAuto, kNone };

struct Panel {
  std::string title;
  Axis x, y;
  bool y_down = false;        // y grows downwards (matrices: row 0 at the top)
  bool equal_aspect = false;  // one data unit is as long on x as on y
  bool grid = true;           // light grid lines at the ticks (never over a heat map)
  std::optional<HeatMap> heatmap;
  std::vector<Series> series;
  std::vector<Circle> circles;
  std::vector<Arrow> arrows;
  std::vector<Text> texts;
  std::vector<RefLine> ref_lines;
  std::vector<LegendEntry> legend_extra;    // appended after the series' entries
  LegendPlace legend = LegendPlace::kAuto;  // auto: the corner covering the fewest points
};

// A colour bar for the whole figure, right of the panel grid (panels sharing one value range).
struct ColorBar {
  Colormap colormap = Colormap::kViridis;
  Range range;
  std::string label;
  bool integer_ticks = false;
};

struct Figure {
  double width = 800, height = 600;  // px
  std::string title;                 // bold, top centre
  std::string subtitle;              // under the title
  int columns = 1;                   // panels fill a grid row by row
  std::vector<Panel> panels;
  std::vector<LegendEntry> legend;   // a figure-wide legend under the panels
  std::optional<ColorBar> colorbar;  // a figure-wide colour bar right of the panels
};

struct Rect {
  double x = 0, y = 0, w = 0, h = 0;
};

// Where a panel landed on the page, and its data-to-pixel mapping.
struct PanelLayout {
  Rect cell;      // the panel's grid cell
  Rect plot;      // the data area inside the axes
  Rect colorbar;  // w == 0 when there is none
  Range x, y;     // data ranges of the plot rectangle
  bool y_down = false;
  std::vector<double> x_ticks, y_ticks;
  double px(double xv) const;  // data x -> page x
  double py(double yv) const;  // data y -> page y
};

// Throws ValueError on an invalid figure (size, columns, series or heat map shapes).
std::vector<PanelLayout> layout(const Figure& fig);

enum class Format { kPng, kSvg };
// From the file name's extension (.png / .svg, case-insensitive); ValueError otherwise:
// "<path>: unsupported extension '<ext>' (use .png or .svg)".
Format format_from_path(const std::string& path);

// The encoded file. `scale` multiplies the PNG's pixel size (SVG ignores it).
std::vector<unsigned char> render(const Figure& fig, Format format, double scale = 1.0);
// Renders into memory, then writes `path` atomically (posenc::write_file_atomic): a failure
// leaves no file behind. The format comes from the extension.
void save(const Figure& fig, const std::string& path, double scale = 1.0);

// Tick positions for [lo, hi] with about `target` intervals on a 1-2-5 grid, and their labels
// (shared precision; 100k, 1.5M for large values; a true minus sign).
std::vector<double> nice_ticks(double lo, double hi, int target, bool integer = false);
std::vector<std::string> tick_labels(const std::vector<double>& ticks);

}  // namespace posenc::plot
