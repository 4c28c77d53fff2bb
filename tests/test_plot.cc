// tests/test_plot.cc - the figures (plot/), `posenc plot` and `posenc demo`.
//
// Figures are rendered in memory and decoded back with cairo; pixel checks prove the content:
// heat map cells map back through the colormap to posenc::sinusoidal_table, clock hands lie at
// the angles p * w_i, a bidirectional ALiBi map is symmetric. SVGs are parsed for structure
// (cairo draws text as glyph <use> elements, so structure, not strings). The CLI is run as a
// subprocess for the exit-status contract and the demo page; headless Chromium renders the page
// where /usr/bin/chromium exists.
#include <cairo.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "figure.h"
#include "plots.h"
#include "posenc/error.h"
#include "posenc/sinusoidal.h"

#ifndef POSENC_CLI_PATH
#error "POSENC_CLI_PATH must name the posenc binary"
#endif

namespace fs = std::filesystem;

namespace posenc::plot {
namespace {

constexpr double kPi = 3.14159265358979323846;

// ---------------------------------------------------------------------------------------------
// Helpers.

struct Image {
  int width = 0, height = 0;
  std::vector<uint32_t> pixels;  // 0x00RRGGBB
  Color at(double x, double y) const {
    const int ix = std::clamp(static_cast<int>(std::floor(x)), 0, width - 1);
    const int iy = std::clamp(static_cast<int>(std::floor(y)), 0, height - 1);
    const uint32_t p = pixels[static_cast<std::size_t>(iy) * width + ix];
    return {((p >> 16) & 0xFF) / 255.0, ((p >> 8) & 0xFF) / 255.0, (p & 0xFF) / 255.0, 1};
  }
  uint32_t raw(double x, double y) const {
    return pixels[static_cast<std::size_t>(std::floor(y)) * width +
                  static_cast<std::size_t>(std::floor(x))] &
           0xFFFFFFu;
  }
};

Image from_surface(cairo_surface_t* s) {
  Image img;
  EXPECT_EQ(cairo_surface_status(s), CAIRO_STATUS_SUCCESS);
  if (cairo_surface_status(s) != CAIRO_STATUS_SUCCESS) return img;
  cairo_surface_flush(s);
  img.width = cairo_image_surface_get_width(s);
  img.height = cairo_image_surface_get_height(s);
  const int stride = cairo_image_surface_get_stride(s);
  const unsigned char* data = cairo_image_surface_get_data(s);
  img.pixels.resize(static_cast<std::size_t>(img.width) * img.height);
  for (int y = 0; y < img.height; ++y) {
    std::memcpy(&img.pixels[static_cast<std::size_t>(y) * img.width], data + y * stride,
                static_cast<std::size_t>(img.width) * 4);
  }
  return img;
}

struct Reader {
  const std::vector<unsigned char>* bytes;
  std::size_t pos = 0;
};

cairo_status_t read_bytes(void* closure, unsigned char* data, unsigned int length) {
  auto* r = static_cast<Reader*>(closure);
  if (r->pos + length > r->bytes->size()) return CAIRO_STATUS_READ_ERROR;
  std::memcpy(data, r->bytes->data() + r->pos, length);
  r->pos += length;
  return CAIRO_STATUS_SUCCESS;
}

// Decodes PNG bytes (cairo_image_surface_create_from_png_stream).
Image decode_png(const std::vector<unsigned char>& bytes) {
  Reader r{&bytes};
  cairo_surface_t* s = cairo_image_surface_create_from_png_stream(read_bytes, &r);
  Image img = from_surface(s);
  cairo_surface_destroy(s);
  return img;
}

// Decodes a PNG file (cairo_image_surface_create_from_png).
Image decode_png_file(const fs::path& p) {
  cairo_surface_t* s = cairo_image_surface_create_from_png(p.c_str());
  Image img = from_surface(s);
  cairo_surface_destroy(s);
  return img;
}

double color_distance(Color a, Color b) {
  return std::sqrt((a.r - b.r) * (a.r - b.r) + (a.g - b.g) * (a.g - b.g) +
                   (a.b - b.b) * (a.b - b.b));
}

std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// Minimal XML structure check: every tag closed in order, one root <svg>. Returns the count of
// each element name.
struct SvgInfo {
  bool ok = false;
  std::string error;
  std::string root;
  std::map<std::string, int> count;
};

SvgInfo parse_svg(const std::string& s) {
  SvgInfo info;
  std::vector<std::string> stack;
  std::size_t i = 0;
  int roots = 0;
  while ((i = s.find('<', i)) != std::string::npos) {
    if (s.compare(i, 4, "<!--") == 0) {
      const auto e = s.find("-->", i);
      if (e == std::string::npos) return info.error = "unterminated comment", info;
      i = e + 3;
      continue;
    }
    const auto e = s.find('>', i);
    if (e == std::string::npos) return info.error = "unterminated tag", info;
    const std::string tag = s.substr(i + 1, e - i - 1);
    i = e + 1;
    if (tag.empty()) return info.error = "empty tag", info;
    if (tag[0] == '?' || tag[0] == '!') continue;
    if (tag[0] == '/') {
      const std::string name = tag.substr(1);
      if (stack.empty() || stack.back() != name) {
        return info.error = "unbalanced </" + name + ">", info;
      }
      stack.pop_back();
      continue;
    }
    const std::string name = tag.substr(0, tag.find_first_of(" \t\r\n/"));
    ++info.count[name];
    if (stack.empty()) {
      ++roots;
      info.root = name;
    }
    if (tag.back() != '/') stack.push_back(name);
  }
  if (!stack.empty()) return info.error = "unclosed <" + stack.back() + ">", info;
  if (roots != 1) return info.error = "expected one root element", info;
  info.ok = true;
  return info;
}

std::size_t glyphs_in(const std::string& text) {
  // Non-space code points (UTF-8 lead bytes).
  std::size_t n = 0;
  for (unsigned char c : text) {
    if ((c & 0xC0) != 0x80 && c != ' ') ++n;
  }
  return n;
}

struct RunResult {
  int status = -1;
  std::string out, err;
};

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

class PlotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* env = std::getenv("POSENC_TEST_TMP");
    const fs::path base = env && *env ? fs::path(env) : fs::temp_directory_path() / "posenc_test";
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = base / ("plot." + std::string(info->test_suite_name()) + "." + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  RunResult run(const std::string& args) {
    const fs::path out = dir_ / "stdout.txt", err = dir_ / "stderr.txt";
    const std::string cmd = quote(POSENC_CLI_PATH) + " " + args + " >" + quote(out.string()) +
                            " 2>" + quote(err.string());
    const int raw = std::system(cmd.c_str());
    RunResult r;
    r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
    r.out = read_text(out);
    r.err = read_text(err);
    return r;
  }
  fs::path dir_;
};

// Every figure builder on its defaults (and a few options), as the CLI names them.
std::vector<std::pair<std::string, Figure>> all_figures() {
  std::vector<std::pair<std::string, Figure>> f;
  f.emplace_back("heatmap-small", heatmap_figure(heatmap_preset("small")));
  f.emplace_back("heatmap-paper", heatmap_figure(heatmap_preset("paper")));
  f.emplace_back("clock", clock_figure(ClockOptions{}));
  f.emplace_back("similarity", similarity_figure(SimilarityOptions{}));
  f.emplace_back("rope-rotation", rope_rotation_figure(RopeRotationOptions{}));
  f.emplace_back("bias", bias_figure(BiasOptions{}));
  BiasOptions causal;
  causal.causal = true;
  f.emplace_back("bias-causal", bias_figure(causal));
  f.emplace_back("attention", attention_figure(AttentionPlotOptions{}));
  AttentionPlotOptions random;
  random.content = "random";
  random.causal = true;
  f.emplace_back("attention-random", attention_figure(random));
  f.emplace_back("extrapolation", extrapolation_figure(ExtrapolationOptions{}));
  return f;
}

// ---------------------------------------------------------------------------------------------
// Rendering.

TEST(PlotRender, EveryKindRendersPngAndSvg) {
  for (const auto& [name, fig] : all_figures()) {
    SCOPED_TRACE(name);
    EXPECT_FALSE(fig.title.empty());
    EXPECT_FALSE(fig.panels.empty());
    for (const Panel& p : fig.panels) {
      // Labelled axes, with ticks on both.
      EXPECT_FALSE(p.x.label.empty());
      EXPECT_FALSE(p.y.label.empty());
    }
    for (const PanelLayout& L : layout(fig)) {
      EXPECT_GE(L.x_ticks.size(), 2u);
      EXPECT_GE(L.y_ticks.size(), 2u);
      EXPECT_GT(L.plot.w, 40);
      EXPECT_GT(L.plot.h, 40);
    }
    const Image img = decode_png(render(fig, Format::kPng));
    EXPECT_EQ(img.width, static_cast<int>(std::ceil(fig.width)));
    EXPECT_EQ(img.height, static_cast<int>(std::ceil(fig.height)));
    std::set<uint32_t> colors(img.pixels.begin(), img.pixels.end());
    EXPECT_GT(colors.size(), 50u);
    const Image big = decode_png(render(fig, Format::kPng, 2.0));
    EXPECT_EQ(big.width, static_cast<int>(std::ceil(2 * fig.width)));

    const std::vector<unsigned char> svg_bytes = render(fig, Format::kSvg);
    const std::string svg(svg_bytes.begin(), svg_bytes.end());
    const SvgInfo info = parse_svg(svg);
    ASSERT_TRUE(info.ok) << info.error;
    EXPECT_EQ(info.root, "svg");
    EXPECT_NE(svg.find("width=\"" + std::to_string(static_cast<int>(fig.width)) + "px\""),
              std::string::npos);
    // Text is drawn as glyphs: at least one <use> per visible character of the title.
    EXPECT_GE(static_cast<std::size_t>(info.count.count("use") ? info.count.at("use") : 0),
              glyphs_in(fig.title));
    EXPECT_GT(info.count.count("path") ? info.count.at("path") : 0, 20);
  }
}

TEST(PlotRender, SmallHeatmapSvgHasOneShapePerCell) {
  const Figure fig = heatmap_figure(heatmap_preset("small"));
  const std::vector<unsigned char> bytes = render(fig, Format::kSvg);
  const SvgInfo info = parse_svg(std::string(bytes.begin(), bytes.end()));
  ASSERT_TRUE(info.ok) << info.error;
  // 16 x 32 cells, each a filled rectangle, beside the glyph outlines and axes.
  EXPECT_GE(info.count.at("path"), 16 * 32);
  // The large table is an embedded image instead.
  const std::vector<unsigned char> paper =
      render(heatmap_figure(heatmap_preset("paper")), Format::kSvg);
  const SvgInfo pinfo = parse_svg(std::string(paper.begin(), paper.end()));
  ASSERT_TRUE(pinfo.ok) << pinfo.error;
  EXPECT_GE(pinfo.count.count("image"), 1u);
}

TEST(PlotRender, FontsAreReadable) {
  // Text height of a tick label ("0") at scale 1: at least 11 px tall glyph box for the font.
  cairo_surface_t* s = cairo_image_surface_create(CAIRO_FORMAT_RGB24, 10, 10);
  cairo_t* cr = cairo_create(s);
  cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, 12);
  cairo_font_extents_t fe;
  cairo_font_extents(cr, &fe);
  EXPECT_GE(fe.ascent + fe.descent, 11.0);
  cairo_destroy(cr);
  cairo_surface_destroy(s);
}

// ---------------------------------------------------------------------------------------------
// Pixel checks.

TEST(PlotPixels, HeatmapCellsTrackTheSinusoids) {
  for (Colormap map : {Colormap::kViridis, Colormap::kDiverging}) {
    HeatmapOptions o = heatmap_preset("small");
    o.colormap = map;
    const Figure fig = heatmap_figure(o);
    const PanelLayout L = layout(fig).at(0);
    const Image img = decode_png(render(fig, Format::kPng));
    SinusoidalConfig cfg;
    cfg.dim = 32;
    const std::vector<float> pe = sinusoidal_table(cfg, 16);
    double max_err = 0;
    for (int p = 0; p < 16; ++p) {
      for (int i = 0; i < 32; ++i) {
        const double t = colormap_lookup(map, img.at(L.px(i), L.py(p)));
        const double value = -1.0 + 2.0 * t;  // the colour bar spans [-1, 1]
        max_err = std::max(max_err, std::fabs(value - pe[p * 32 + i]));
      }
    }
    // One 8-bit colour step of a 256-entry table over a range of 2: about 0.008.
    EXPECT_LE(max_err, 0.02) << (map == Colormap::kViridis ? "viridis" : "diverging");
  }
}

TEST(PlotPixels, ColormapsAreOrderedAndInvertible) {
  for (Colormap map : {Colormap::kViridis, Colormap::kDiverging}) {
    for (int i = 0; i <= 255; ++i) {
      const double t = i / 255.0;
      EXPECT_NEAR(colormap_lookup(map, colormap_color(map, t)), t, 1.5 / 255.0);
    }
  }
  // Viridis-like: dark to light.
  auto lum = [](Color c) { return 0.2126 * c.r + 0.7152 * c.g + 0.0722 * c.b; };
  for (int i = 1; i <= 32; ++i) {
    EXPECT_GT(lum(colormap_color(Colormap::kViridis, i / 32.0)),
              lum(colormap_color(Colormap::kViridis, (i - 1) / 32.0)));
  }
  // Diverging: light in the middle, blue below, red above.
  const Color lo = colormap_color(Colormap::kDiverging, 0),
              mid = colormap_color(Colormap::kDiverging, 0.5),
              hi = colormap_color(Colormap::kDiverging, 1);
  EXPECT_GT(lum(mid), 0.9);
  EXPECT_GT(lo.b, lo.r);
  EXPECT_GT(hi.r, hi.b);
}

TEST(PlotPixels, ClockHandsPointAtTheirAngles) {
  ClockOptions o;
  o.dim = 4;  // two hands: w_0 = 1, w_1 = 0.01
  o.positions = {1, 2, 4};
  o.embedding_panel = false;
  const Figure fig = clock_figure(o);
  const auto layouts = layout(fig);
  const Image img = decode_png(render(fig, Format::kPng));
  for (std::size_t k = 0; k < o.positions.size(); ++k) {
    const PanelLayout& L = layouts[k];
    const double angle = static_cast<double>(o.positions[k]) * 1.0;  // hand 0, clockwise from 12
    const Color hand = clock_hand_color(0, 2);
    const double len = clock_hand_length(0, 2);
    int along = 0, across = 0, n = 0;
    for (double r = 0.25 * len; r <= 0.75 * len; r += 0.05 * len, ++n) {
      // Hand direction: (sin a, cos a) in the clock's (x = sin, y = cos) plane.
      if (color_distance(img.at(L.px(r * std::sin(angle)), L.py(r * std::cos(angle))), hand) <
          0.2) {
        ++along;
      }
      const double b = angle + kPi / 2;
      if (color_distance(img.at(L.px(r * std::sin(b)), L.py(r * std::cos(b))), hand) < 0.2) {
        ++across;
      }
    }
    SCOPED_TRACE("p = " + std::to_string(o.positions[k]));
    EXPECT_GE(along, n * 8 / 10);
    EXPECT_EQ(across, 0);
    // The slow hand (w_1 = 0.01) still points at 12 o'clock.
    const Color slow = clock_hand_color(1, 2);
    const double slow_len = clock_hand_length(1, 2);
    const double a1 = 0.01 * static_cast<double>(o.positions[k]);
    int up = 0, m = 0;
    for (double r = 0.3 * slow_len; r <= 0.8 * slow_len; r += 0.1 * slow_len, ++m) {
      if (color_distance(img.at(L.px(r * std::sin(a1)), L.py(r * std::cos(a1))), slow) < 0.2) {
        ++up;
      }
    }
    EXPECT_GE(up, m * 8 / 10);
  }
}

TEST(PlotPixels, BidirectionalAlibiMapIsSymmetric) {
  BiasOptions o;
  o.scheme = "alibi";
  o.length = 16;
  o.heads = 4;
  const Figure fig = bias_figure(o);
  ASSERT_EQ(fig.panels.size(), 4u);
  const auto layouts = layout(fig);
  const Image img = decode_png(render(fig, Format::kPng));
  for (std::size_t h = 0; h < layouts.size(); ++h) {
    const PanelLayout& L = layouts[h];
    int asymmetric = 0;
    for (int i = 0; i < 16; ++i) {
      for (int j = 0; j < 16; ++j) {
        if (img.raw(L.px(j), L.py(i)) != img.raw(L.px(i), L.py(j))) ++asymmetric;
      }
    }
    EXPECT_EQ(asymmetric, 0) << "head " << h + 1;
    // And not constant: the diagonal (bias 0) differs from the far corner.
    EXPECT_NE(img.raw(L.px(0), L.py(0)), img.raw(L.px(15), L.py(0)));
  }
  // Causal: the upper triangle is masked.
  o.causal = true;
  const Figure cfig = bias_figure(o);
  const PanelLayout L = layout(cfig).at(0);
  const Image cimg = decode_png(render(cfig, Format::kPng));
  const Color masked = masked_color();
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 16; ++j) {
      const bool is_masked = color_distance(cimg.at(L.px(j), L.py(i)), masked) < 0.01;
      EXPECT_EQ(is_masked, j > i) << i << "," << j;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Options and errors.

TEST(PlotErrors, BadOptionsThrowValueError) {
  HeatmapOptions h;
  h.dim = 7;
  EXPECT_THROW(heatmap_figure(h), ValueError);
  EXPECT_THROW(heatmap_preset("huge"), ValueError);
  ClockOptions c;
  c.positions = {};
  EXPECT_THROW(clock_figure(c), ValueError);
  SimilarityOptions s;
  s.scheme = "xyz";
  EXPECT_THROW(similarity_figure(s), ValueError);
  BiasOptions b;
  b.length = 0;
  EXPECT_THROW(bias_figure(b), ValueError);
  AttentionPlotOptions a;
  a.length = 64;
  a.head_dim = 32;
  EXPECT_THROW(attention_figure(a), ValueError);
  ExtrapolationOptions e;
  e.max_length = e.train_length;
  EXPECT_THROW(extrapolation_figure(e), ValueError);
  RopeRotationOptions r;
  r.pairs = {100};
  EXPECT_THROW(rope_rotation_figure(r), ValueError);
  EXPECT_THROW(format_from_path("figure.jpg"), ValueError);
  EXPECT_EQ(format_from_path("a.b/figure.PNG"), Format::kPng);
  EXPECT_EQ(format_from_path("figure.svg"), Format::kSvg);
}

TEST_F(PlotTest, SaveIsAtomicAndByExtension) {
  const Figure fig = bias_figure(BiasOptions{});
  save(fig, (dir_ / "b.png").string());
  save(fig, (dir_ / "b.svg").string());
  EXPECT_EQ(decode_png_file(dir_ / "b.png").width, 800);
  EXPECT_TRUE(parse_svg(read_text(dir_ / "b.svg")).ok);
  EXPECT_THROW(save(fig, (dir_ / "b.gif").string()), ValueError);
  EXPECT_FALSE(fs::exists(dir_ / "b.gif"));
  // No temporary files left beside the outputs.
  std::size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir_)) files += e.is_regular_file();
  EXPECT_EQ(files, 2u);
}

// ---------------------------------------------------------------------------------------------
// The CLI.

TEST_F(PlotTest, CliDrawsEveryKind) {
  for (const std::string& kind : plot_kinds()) {
    SCOPED_TRACE(kind);
    const fs::path png = dir_ / (kind + ".png"), svg = dir_ / (kind + ".svg");
    RunResult r = run("plot " + kind + " --out " + quote(png.string()));
    ASSERT_EQ(r.status, 0) << r.err;
    const Image img = decode_png_file(png);
    EXPECT_EQ(img.width, 800);
    EXPECT_GT(img.height, 200);
    r = run("plot " + kind + " --width 640 --out " + quote(svg.string()));
    ASSERT_EQ(r.status, 0) << r.err;
    const SvgInfo info = parse_svg(read_text(svg));
    EXPECT_TRUE(info.ok) << info.error;
    EXPECT_NE(read_text(svg).find("width=\"640px\""), std::string::npos);
    r = run("plot " + kind + " --help");
    EXPECT_EQ(r.status, 0);
    EXPECT_NE(r.out.find("--out"), std::string::npos);
  }
  RunResult r = run("plot heatmap --preset paper --width 600 --scale 2 --out " +
                    quote((dir_ / "p.png").string()));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(decode_png_file(dir_ / "p.png").width, 1200);
}

TEST_F(PlotTest, CliErrorsAreOneLineExit2NoFile) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"plot heatmap --out OUT.jpg", "unsupported extension"},
      {"plot heatmap --dim 7 --out OUT.png", "dim"},
      {"plot heatmap --preset big --out OUT.png", "preset"},
      {"plot heatmap --preset small --table t.npy --out OUT.png", ""},
      {"plot heatmap --table missing.npy --out OUT.png", "missing.npy"},
      {"plot clock --positions -1 --out OUT.png", "positions"},
      {"plot similarity --scheme xyz --out OUT.png", "scheme"},
      {"plot bias --length 0 --out OUT.png", "length"},
      {"plot attention --length 64 --head-dim 16 --out OUT.png", "head-dim"},
      {"plot extrapolation --max-length 10 --out OUT.png", "max-length"},
      {"plot rope-rotation --pairs 99 --out OUT.png", "pair"},
      {"plot similarity --config missing.json --out OUT.png", "missing.json"},
      {"plot nosuchkind --out OUT.png", "unknown plot kind 'nosuchkind'"},
      {"plot heatmap", "--out"},
      {"plot", "no plot kind"},
      {"plot heatmap --bogus 3 --out OUT.png", "unexpected"},
      {"plot heatmap --out OUT.png extra", "unexpected"},
  };
  for (const auto& [args, needle] : cases) {
    SCOPED_TRACE(args);
    const fs::path out = dir_ / "out.png";
    std::string a = args;
    a = std::regex_replace(a, std::regex("OUT"), (dir_ / "out").string());
    a = std::regex_replace(a, std::regex("missing"), (dir_ / "missing").string());
    const RunResult r = run(a);
    EXPECT_EQ(r.status, 2) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(r.err.rfind("posenc plot: error: ", 0), 0u) << r.err;
    if (!needle.empty()) {
      EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
    }
    EXPECT_FALSE(fs::exists(out));
    EXPECT_FALSE(fs::exists(dir_ / "out.jpg"));
  }
}

TEST_F(PlotTest, CliPlotsAModelConfig) {
  const fs::path cfg = dir_ / "config.json";
  std::ofstream(cfg) << R"({"model_type": "bloom", "n_head": 16, "hidden_size": 1024})";
  RunResult r = run("plot similarity --config " + quote(cfg.string()) + " --out " +
                    quote((dir_ / "s.png").string()));
  ASSERT_EQ(r.status, 0) << r.err;
  r = run("plot bias --config " + quote(cfg.string()) + " --out " +
          quote((dir_ / "b.png").string()));
  ASSERT_EQ(r.status, 0) << r.err;
  // A flag the config decides conflicts with it.
  r = run("plot bias --config " + quote(cfg.string()) + " --heads 4 --out " +
          quote((dir_ / "c.png").string()));
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("conflicts with --config"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "c.png"));
}

// ---------------------------------------------------------------------------------------------
// The demo.

std::vector<std::string> src_attributes(const std::string& html) {
  std::vector<std::string> out;
  const std::regex re("src=\"([^\"]*)\"");
  for (auto it = std::sregex_iterator(html.begin(), html.end(), re); it != std::sregex_iterator();
       ++it) {
    out.push_back((*it)[1].str());
  }
  return out;
}

TEST_F(PlotTest, DemoWritesAPageThatReferencesOnlyExistingFiles) {
  const fs::path out = dir_ / "demo";
  const RunResult r = run("demo --out " + quote(out.string()));
  ASSERT_EQ(r.status, 0) << r.err;
  // The check table and the files written on stdout; progress goes to stderr only when it is a
  // terminal, so stderr stays empty here (and holds just the error line when a demo fails).
  EXPECT_NE(r.out.find("checks,"), std::string::npos);
  EXPECT_NE(r.out.find("index.html"), std::string::npos);
  EXPECT_EQ(r.err, "");
  const std::string html = read_text(out / "index.html");
  ASSERT_FALSE(html.empty());
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(html.find("<style>"), std::string::npos);  // inline CSS, nothing fetched
  EXPECT_EQ(html.find("http://"), std::string::npos);
  EXPECT_EQ(html.find("https://"), std::string::npos);
  const std::vector<std::string> srcs = src_attributes(html);
  EXPECT_GE(srcs.size(), 7u);
  std::set<std::string> referenced;
  for (const std::string& s : srcs) {
    SCOPED_TRACE(s);
    EXPECT_EQ(s.find('/'), std::string::npos);  // relative, in the folder
    ASSERT_TRUE(fs::exists(out / s));
    EXPECT_GT(decode_png_file(out / s).width, 0);
    referenced.insert(s);
  }
  // Every figure file is on the page, and every scheme has its paragraph.
  for (const auto& e : fs::directory_iterator(out)) {
    if (e.path().extension() == ".png") {
      EXPECT_TRUE(referenced.count(e.path().filename().string()));
    }
  }
  for (const char* id : {"scheme-sinusoidal", "scheme-learned", "scheme-rope", "scheme-alibi",
                         "scheme-t5", "scheme-shaw", "scheme-xl", "scheme-deberta"}) {
    EXPECT_NE(html.find(id), std::string::npos) << id;
  }
  EXPECT_NE(html.find("PASS"), std::string::npos);
  // The old text demo is still there.
  const RunResult t = run("demo --text --skip-checks");
  EXPECT_EQ(t.status, 0);
  EXPECT_NE(t.out.find("Sinusoidal PE"), std::string::npos);
  // An existing file in place of the folder: exit 2.
  std::ofstream(dir_ / "file") << "x";
  const RunResult bad = run("demo --out " + quote((dir_ / "file").string()));
  EXPECT_EQ(bad.status, 2);
}

TEST_F(PlotTest, DemoPageRendersInHeadlessChromium) {
  const char* chromium = "/usr/bin/chromium";
  if (access(chromium, X_OK) != 0) {
    GTEST_SKIP() << "/usr/bin/chromium is not installed (Debian package `chromium`): the demo "
                    "page was not rendered in a browser";
  }
  const fs::path out = dir_ / "demo";
  RunResult r = run("demo --skip-checks --out " + quote(out.string()));
  ASSERT_EQ(r.status, 0) << r.err;
  const fs::path shot = dir_ / "shot.png";
  const std::string cmd =
      std::string("timeout 60 ") + chromium +
      " --headless --no-sandbox --disable-gpu --disable-background-networking --no-first-run"
      " --user-data-dir=" +
      quote((dir_ / "chromium-profile").string()) + " --screenshot=" + quote(shot.string()) +
      " --window-size=1200,2000 " + quote("file://" + fs::absolute(out / "index.html").string()) +
      " >" + quote((dir_ / "chromium.log").string()) + " 2>&1";
  const int raw = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(raw) && WEXITSTATUS(raw) == 0) << read_text(dir_ / "chromium.log");
  const Image img = decode_png_file(shot);
  ASSERT_EQ(img.width, 1200);
  ASSERT_EQ(img.height, 2000);
  // Not blank: many distinct colours (the figures' colormaps) and a good share of non-background.
  std::set<uint32_t> colors(img.pixels.begin(), img.pixels.end());
  EXPECT_GT(colors.size(), 1000u);
  const uint32_t background = img.pixels[0] & 0xFFFFFFu;
  std::size_t other = 0;
  for (uint32_t p : img.pixels) other += (p & 0xFFFFFFu) != background;
  EXPECT_GT(static_cast<double>(other) / img.pixels.size(), 0.2);
}

}  // namespace
}  // namespace posenc::plot
