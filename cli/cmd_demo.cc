// cli/cmd_demo.cc - `posenc demo`: every figure of posenc on embedded defaults, an HTML page that
// shows them with a paragraph per scheme and the measured properties (posenc::run_checks), and a
// summary in the terminal. `--text` prints the older text demo (a few encodings as numbers).
//
// No input needed. Everything shown comes from the public API (through plot/plots.h); nothing is
// computed here. The files are written into a temporary folder beside --out and moved into place
// once all exist, so a failed demo leaves nothing behind.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "common.h"
#include "figure.h"
#include "plots.h"
#include "posenc/alibi.h"
#include "posenc/check.h"
#include "posenc/io.h"
#include "posenc/rope.h"
#include "posenc/sinusoidal.h"
#include "posenc/t5.h"
#include "posenc/version.h"

namespace posenc::cli {

namespace {

namespace fs = std::filesystem;

struct DemoArgs {
  uint64_t seed = CheckOptions{}.seed;
  bool skip_checks = false;
  bool text = false;
  std::string out = "posenc-demo";
  std::string format = "png";
};

std::string fixed(double v, int width, int decimals) {
  if (std::fabs(v) < 0.5 * std::pow(10.0, -decimals)) v = 0.0;  // no "-0.0000"
  std::ostringstream os;
  os << std::fixed << std::setprecision(decimals) << std::setw(width) << v;
  return os.str();
}

void section(std::ostream& os, const std::string& title) {
  os << '\n' << title << '\n' << std::string(title.size(), '=') << '\n';
}

void print_sinusoidal(std::ostream& os) {
  SinusoidalConfig cfg;
  cfg.dim = 8;
  const int64_t length = 8;
  const std::vector<float> pe = sinusoidal_table(cfg, length);
  section(os, "Sinusoidal PE [8, 8] (interleaved, base 10000): rows are positions 0..7");
  for (int64_t p = 0; p < length; ++p) {
    os << "p=" << p << ' ';
    for (int64_t c = 0; c < cfg.dim; ++c) {
      os << fixed(pe[static_cast<std::size_t>(p * cfg.dim + c)], 8, 4);
    }
    os << '\n';
  }
}

void print_alibi(std::ostream& os) {
  section(os, "ALiBi slopes (max bias 8)");
  for (int64_t heads : {8, 12}) {
    const std::vector<double> s = alibi_slopes(AlibiConfig{heads, 8.0});
    os << "H=" << std::setw(2) << heads << ':';
    for (double m : s) os << ' ' << format_number(m, 6);
    os << '\n';
  }
}

void print_t5(std::ostream& os) {
  for (bool bidirectional : {true, false}) {
    T5BucketConfig cfg;
    cfg.num_buckets = 8;
    cfg.max_distance = 16;
    cfg.bidirectional = bidirectional;
    const int64_t n = 8;
    const std::vector<int64_t> map = t5_bucket_map(cfg, n, n);
    section(os, std::string("T5 buckets [8, 8], ") + (bidirectional ? "bidirectional" : "causal") +
                    " (num_buckets 8, max_distance 16): row = query, column = key");
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j)
        os << std::setw(3) << map[static_cast<std::size_t>(i * n + j)];
      os << '\n';
    }
  }
}

void print_rope(std::ostream& os) {
  const int64_t head_dim = 8;
  const std::vector<int64_t> ids = {0, 1, 2, 3, 10, 100, int64_t{1} << 20};
  const auto seq = static_cast<int64_t>(ids.size());
  RopeConfig cfg;
  cfg.head_dim = head_dim;
  const RopeFrequencies freqs = rope_frequencies(cfg, ids.back() + 1);
  // The unit vector with x[i] = 1/2 for i < head_dim/2: one unit of every rotation pair, so each
  // frequency shows as (cos, sin) / 2 in columns (i, i + head_dim/2).
  std::vector<float> x(static_cast<std::size_t>(seq * head_dim), 0.0f);
  for (int64_t i = 0; i < seq; ++i) {
    for (int64_t c = 0; c < head_dim / 2; ++c) x[static_cast<std::size_t>(i * head_dim + c)] = 0.5f;
  }
  std::vector<float> y(x.size());
  const Positions positions = Positions::shared(ids);
  apply_rope(freqs, RopeStyle::kHalf,
             View<const float, 4>::contiguous(x.data(), {1, seq, 1, head_dim}),
             View<float, 4>::contiguous(y.data(), {1, seq, 1, head_dim}), &positions);
  section(
      os,
      "RoPE of the unit vector (1, 1, 1, 1, 0, 0, 0, 0) / 2 (head_dim 8, half style, base 10000)");
  for (int64_t i = 0; i < seq; ++i) {
    os << "p=" << std::setw(7) << ids[static_cast<std::size_t>(i)] << ' ';
    for (int64_t c = 0; c < head_dim; ++c) {
      os << fixed(y[static_cast<std::size_t>(i * head_dim + c)], 8, 4);
    }
    os << '\n';
  }
}

int run_text_demo(const DemoArgs& a) {
  std::ostream& os = std::cout;
  if (!a.skip_checks) {
    CheckOptions opt;
    opt.seed = a.seed;
    section(os, "posenc check (seed " + std::to_string(a.seed) + ")");
    print_check_table(os, run_checks(opt));
  }
  print_sinusoidal(os);
  print_alibi(os);
  print_t5(os);
  print_rope(os);
  os.flush();
  return 0;
}

// ---------------------------------------------------------------------------------------------
// The figures and the page.

struct DemoFigure {
  std::string name;     // file stem
  std::string caption;  // one sentence
  std::string command;  // how to draw it alone
  std::function<plot::Figure()> build;
};

std::vector<DemoFigure> demo_figures() {
  using namespace plot;
  return {
      {"heatmap-small",
       "The sinusoidal table for 16 positions and 32 dimensions: each column pair is a sine and a "
       "cosine whose frequency falls from left to right, so the first columns change fast with "
       "the position and the last ones hardly at all.",
       "posenc plot heatmap --preset small --out heatmap-small.png",
       [] { return heatmap_figure(heatmap_preset("small")); }},
      {"heatmap-paper",
       "The same table at the original Transformer's width (512 dimensions, 128 positions): "
       "the stripes of the fast dimensions bend into the slow ones, which stay at sin = 0, "
       "cos = 1.",
       "posenc plot heatmap --preset paper --out heatmap-paper.png",
       [] { return heatmap_figure(heatmap_preset("paper")); }},
      {"clock",
       "The clock with many hands: each (sin, cos) pair is a point on the unit circle, starting "
       "at 12 o'clock and turning clockwise by ωᵢ per position, slower and slower toward the "
       "end of the vector; the last panel adds the first pair to a word embedding: e + PE(p) "
       "walks around a unit circle centred on e.",
       "posenc plot clock --out clock.png", [] { return clock_figure(ClockOptions{}); }},
      {"rope-rotation",
       "RoPE rotates each pair of a query or key by p times its frequency: the first pair turns "
       "by a radian per position, later pairs by ever smaller angles.",
       "posenc plot rope-rotation --out rope-rotation.png",
       [] { return rope_rotation_figure(RopeRotationOptions{}); }},
      {"similarity",
       "Scores as a function of the offset k between two positions: for sinusoids and RoPE the "
       "curves of different starting positions coincide exactly (they depend on k only); ALiBi "
       "is linear per head, T5 maps k to log-spaced buckets, Shaw and DeBERTa clip.",
       "posenc plot similarity --out similarity.png",
       [] { return similarity_figure(SimilarityOptions{}); }},
      {"bias",
       "The relative terms as [query, key] maps (bidirectional): ALiBi's per-head distance "
       "penalty, T5's buckets (separate halves for keys before and after the query), Shaw's and "
       "DeBERTa's clipped table rows.",
       "posenc plot bias --out bias.png", [] { return bias_figure(BiasOptions{}); }},
      {"bias-causal",
       "The same maps for a causal decoder: keys after the query are masked and T5 switches to "
       "its causal buckets (all 32 for the past).",
       "posenc plot bias --causal --out bias-causal.png",
       [] {
         BiasOptions o;
         o.causal = true;
         return bias_figure(o);
       }},
      {"attention",
       "Attention weights of identical tokens (same q and k everywhere) under each scheme: "
       "without positions attention is uniform; ALiBi and T5 favour nearby keys, RoPE and the "
       "sinusoids make the weight a function of the offset, Shaw and DeBERTa stop changing "
       "beyond their clipping distance.",
       "posenc plot attention --out attention.png",
       [] { return attention_figure(AttentionPlotOptions{}); }},
      {"extrapolation",
       "Beyond the training length: ALiBi keeps penalising linearly, T5's buckets and Shaw's "
       "index saturate, sinusoid and RoPE scores stay bounded (linear scaling stretches RoPE), "
       "and a learned table refuses positions past its last row.",
       "posenc plot extrapolation --out extrapolation.png",
       [] { return extrapolation_figure(ExtrapolationOptions{}); }},
  };
}

struct SchemeText {
  std::string key;  // CheckResult::scheme
  std::string title;
  std::string what;
  std::string models;
  std::vector<std::string> figures;
};

std::vector<SchemeText> scheme_texts() {
  return {
      {"none",
       "No positions",
       "Scaled dot-product attention by itself: every query scores every key by content only, so "
       "permuting the tokens permutes the output, and the model cannot tell word order.",
       "the baseline every scheme below adds to",
       {"attention"}},
      {"sinusoidal",
       "Sinusoidal (absolute)",
       "A fixed table added to the token embeddings: PE[p, 2i] = sin(p·ωᵢ), PE[p, 2i+1] = "
       "cos(p·ωᵢ) with ωᵢ = 10000^(−2i/d), a geometric series of wavelengths from 2π to "
       "10000·2π. The dot product of two encodings depends only on their distance.",
       "the original Transformer (interleaved); Transformer-XL, Marian, Pegasus (concatenated "
       "halves); tensor2tensor, fairseq, Whisper",
       {"heatmap-small", "heatmap-paper", "clock", "similarity", "extrapolation"}},
      {"learned",
       "Learned absolute",
       "A trained table W [max_positions, d] added to the embeddings: y = x + W[p]. It adapts to "
       "the data but has no row for a position beyond its size, which posenc refuses instead of "
       "clamping.",
       "GPT-2, BERT, RoBERTa, OPT, BART",
       {"extrapolation"}},
      {"rope",
       "Rotary (RoPE)",
       "Queries and keys are rotated pair by pair by p·θᵢ (θᵢ = base^(−2i/R)) before "
       "the dot product, so ⟨rope(q, m), rope(k, n)⟩ depends on n − m only; rotations keep norms.",
       "Llama, Mistral, Qwen, Gemma, GPT-NeoX, Phi (half style); GPT-J, RoFormer (interleaved)",
       {"rope-rotation", "similarity", "attention", "extrapolation"}},
      {"alibi",
       "ALiBi",
       "No embedding at all: each head h adds −mₕ·|i − j| to the attention scores, with "
       "geometric slopes mₕ = 2^(−8h/H); the penalty keeps growing linearly past the training "
       "length.",
       "BLOOM, MPT, Falcon-RW",
       {"bias", "similarity", "attention", "extrapolation"}},
      {"t5",
       "T5 relative bias",
       "A learned scalar per head and bucket of the relative position j - i: exact buckets for "
       "short distances, log-spaced ones up to max_distance, one shared bucket beyond.",
       "T5, mT5, Flan-T5, UL2",
       {"bias", "bias-causal", "similarity", "extrapolation"}},
      {"shaw",
       "Shaw et al. relative positions",
       "Learned relative key (and value) embeddings indexed by j - i clipped to [-K, K]: "
       "s_ij = q_i . (k_j + a_clip(j-i)).",
       "Shaw et al. 2018, relative-position NMT (OpenNMT, tensor2tensor)",
       {"bias", "similarity", "extrapolation"}},
      {"xl",
       "Transformer-XL",
       "Relative attention with a sinusoid of the distance projected per head and two learned "
       "biases u, v: s_ij = (q_i + u) . k_j + (q_i + v) . W_r R(i - j).",
       "Transformer-XL, XLNet",
       {"attention"}},
      {"deberta",
       "DeBERTa",
       "Disentangled attention: content-to-position and position-to-content terms read a "
       "relative table at the clipped (and, from v2, log-bucketed) distance, scaled by "
       "1/sqrt(3d).",
       "DeBERTa v1, v2, v3",
       {"bias", "similarity", "attention"}},
  };
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// `command` with its ".png" output renamed to `ext`.
std::string with_extension(std::string command, const std::string& ext) {
  const auto at = command.rfind(".png");
  if (at != std::string::npos) command.replace(at, 4, ext);
  return command;
}

std::string build_html(const std::vector<DemoFigure>& figs, const std::string& ext,
                       const std::vector<CheckResult>& checks, bool checks_run) {
  std::ostringstream h;
  h << R"(<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>posenc demo: positional encodings, drawn and measured</title>
<style>
body { font-family: "DejaVu Sans", Verdana, sans-serif; color: #1a1a1a; background: #fafafa;
       max-width: 880px; margin: 0 auto; padding: 24px; line-height: 1.5; }
h1 { font-size: 1.7em; margin-bottom: 0.2em; }
h2 { border-bottom: 2px solid #2166c4; padding-bottom: 4px; margin-top: 2em; }
figure { background: #fff; border: 1px solid #ddd; border-radius: 6px; margin: 1.2em 0;
         padding: 10px; }
figure img { display: block; max-width: 100%; height: auto; margin: 0 auto; }
figcaption { font-size: 0.95em; margin-top: 6px; }
code { background: #eef2f8; padding: 1px 4px; border-radius: 3px; font-size: 0.9em; }
table { border-collapse: collapse; font-size: 0.85em; width: 100%; background: #fff; }
th, td { border: 1px solid #ddd; padding: 4px 6px; text-align: left; vertical-align: top; }
th { background: #eef2f8; }
.pass { color: #1d7a3a; font-weight: bold; }
.fail { color: #b3261e; font-weight: bold; }
.scheme { background: #fff; border-left: 4px solid #2166c4; padding: 6px 14px; margin: 1em 0; }
.models { color: #444; }
ul.props { margin: 0.3em 0; }
</style>
</head>
<body>
<h1>posenc: positional encodings, drawn and measured</h1>
<p>Generated by <code>posenc demo</code> (posenc )"
    << POSENC_VERSION_STRING << R"() on embedded defaults. Every number in these figures comes
from the posenc library; the properties below are measured by <code>posenc check</code>.</p>
<h2>Figures</h2>
)";
  for (const DemoFigure& f : figs) {
    h << "<figure id=\"" << f.name << "\">\n<img src=\"" << f.name << ext << "\" alt=\""
      << html_escape(f.caption) << "\">\n<figcaption>" << html_escape(f.caption) << "<br><code>"
      << html_escape(with_extension(f.command, ext)) << "</code></figcaption>\n</figure>\n";
  }
  h << "<h2>Schemes</h2>\n";
  for (const SchemeText& s : scheme_texts()) {
    h << "<div class=\"scheme\" id=\"scheme-" << s.key << "\">\n<h3>" << html_escape(s.title)
      << "</h3>\n<p>" << html_escape(s.what)
      << "</p>\n<p class=\"models\">Used by: " << html_escape(s.models) << ". Figures: ";
    for (std::size_t i = 0; i < s.figures.size(); ++i) {
      h << (i ? ", " : "") << "<a href=\"#" << s.figures[i] << "\">" << s.figures[i] << "</a>";
    }
    h << ".</p>\n";
    std::vector<const CheckResult*> mine;
    for (const CheckResult& c : checks) {
      if (c.scheme == s.key) mine.push_back(&c);
    }
    if (!mine.empty()) {
      h << "<p>Measured by <code>posenc check</code>:</p>\n<ul class=\"props\">\n";
      for (const CheckResult* c : mine) {
        h << "<li>" << html_escape(c->property) << ": " << html_escape(format_number(c->measured))
          << " (expected " << html_escape(expected_text(*c)) << ") <span class=\""
          << (c->pass ? "pass\">PASS" : "fail\">FAIL") << "</span></li>\n";
      }
      h << "</ul>\n";
    } else if (!checks_run) {
      h << "<p>(checks skipped: run <code>posenc check</code>)</p>\n";
    }
    h << "</div>\n";
  }
  if (checks_run) {
    h << "<h2>All checks</h2>\n<table>\n<tr><th>property</th><th>scheme</th><th>measured</th>"
         "<th>expected</th><th>result</th></tr>\n";
    for (const CheckResult& c : checks) {
      h << "<tr><td>" << html_escape(c.property) << "</td><td>" << html_escape(c.scheme)
        << "</td><td>" << html_escape(format_number(c.measured)) << "</td><td>"
        << html_escape(expected_text(c)) << "</td><td class=\""
        << (c.pass ? "pass\">PASS" : "fail\">FAIL") << "</td></tr>\n";
    }
    h << "</table>\n";
  }
  h << "</body>\n</html>\n";
  return h.str();
}

// A folder beside `dir` that the demo writes into before moving its files into place: a failed
// demo leaves nothing behind. Removed (with what is left in it) on destruction.
class StagingDir {
 public:
  explicit StagingDir(const fs::path& dir) {
    const fs::path parent = dir.has_parent_path() ? dir.parent_path() : fs::path(".");
    std::string name = dir.filename().string();
    constexpr std::size_t kMaxStem = 255 - 1 - 10;  // "." + stem + ".tmpXXXXXX" within NAME_MAX
    if (name.size() > kMaxStem) name.resize(kMaxStem);
    std::string tmpl = (parent / ("." + name + ".tmpXXXXXX")).string();
    if (::mkdtemp(tmpl.data()) == nullptr) {
      throw IoError("--out: cannot create a temporary folder in " + parent.string() + " (" +
                    std::strerror(errno) + ")");
    }
    path_ = tmpl;
  }
  StagingDir(const StagingDir&) = delete;
  StagingDir& operator=(const StagingDir&) = delete;
  ~StagingDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  // `message` with the staging folder's name replaced by `dir`: errors name the final files.
  std::string rename_in_message(std::string message, const fs::path& dir) const {
    const std::string from = path_.string(), to = dir.string();
    for (std::size_t at = message.find(from); at != std::string::npos;
         at = message.find(from, at + to.size())) {
      message.replace(at, from.size(), to);
    }
    return message;
  }

  // Moves the staged files into `dir`: the whole folder when `dir` does not exist (one rename),
  // else file by file (each replaced atomically; other files in `dir` are kept).
  void commit(const fs::path& dir, const std::vector<std::string>& names) {
    if (::rename(path_.c_str(), dir.c_str()) == 0) {
      path_.clear();
      return;
    }
    for (const std::string& n : names) check_output_path((dir / n).string());
    for (const std::string& n : names) {
      if (::rename((path_ / n).c_str(), (dir / n).c_str()) != 0) {
        throw IoError((dir / n).string() + ": cannot move into place (" + std::strerror(errno) +
                      ")");
      }
    }
  }

 private:
  fs::path path_;
};

int run_demo(const DemoArgs& a) {
  if (a.text) return run_text_demo(a);
  const std::string ext = "." + a.format;
  const fs::path dir(a.out);
  std::error_code ec;
  if (a.out.empty()) throw UsageError("--out: empty folder name");
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) {
    throw UsageError("--out: " + a.out + " exists and is not a directory");
  }
  if (dir.has_parent_path() && !fs::is_directory(dir.parent_path(), ec)) {
    throw IoError("--out: the folder " + dir.parent_path().string() + " does not exist");
  }

  std::vector<CheckResult> checks;
  if (!a.skip_checks) {
    CheckOptions opt;
    opt.seed = a.seed;
    checks = run_checks(opt);
  }
  StagingDir staging(dir);
  // Progress lines only on a terminal: elsewhere stderr carries nothing but an error's one line.
  const bool progress = ::isatty(STDERR_FILENO) == 1;
  const std::vector<DemoFigure> figs = demo_figures();
  std::vector<std::string> names;
  for (std::size_t i = 0; i < figs.size(); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string name = figs[i].name + ext;
    try {
      plot::save(figs[i].build(), (staging.path() / name).string());
    } catch (const IoError& e) {
      throw IoError(staging.rename_in_message(e.what(), dir));
    }
    if (progress) {
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::cerr << "[" << (i + 1) << "/" << figs.size() << "] " << (dir / name).string() << " ("
                << std::fixed << std::setprecision(2) << secs << " s)" << std::endl;
    }
    names.push_back(name);
  }
  const std::string html = build_html(figs, ext, checks, !a.skip_checks);
  write_file_atomic((staging.path() / "index.html").string(),
                    reinterpret_cast<const unsigned char*>(html.data()), html.size());
  names.push_back("index.html");
  staging.commit(dir, names);
  const fs::path index = dir / "index.html";

  std::ostream& os = std::cout;
  if (!a.skip_checks) {
    section(os, "posenc check (seed " + std::to_string(a.seed) + ")");
    print_check_table(os, checks);
  }
  section(os, "Wrote " + std::to_string(names.size()) + " files");
  for (const auto& n : names) os << "  " << (dir / n).string() << '\n';
  os << "\nOpen " << fs::absolute(index, ec).lexically_normal().string()
     << " in a browser (file:// works: the page is self-contained).\n";
  os.flush();
  return 0;
}

}  // namespace

Command add_demo_command(CLI::App& parent) {
  auto a = std::make_shared<DemoArgs>();
  CLI::App* app = parent.add_subcommand(
      "demo",
      "Draw every figure on embedded defaults into DIR (default posenc-demo/) with an index.html "
      "that explains each scheme and its measured properties; print the checks and the files");
  app->add_option("--out", a->out, "Output directory")->capture_default_str();
  app->add_option("--format", a->format, "Figure format: png or svg")
      ->check(CLI::IsMember({"png", "svg"}))
      ->capture_default_str();
  app->add_option("--seed", a->seed, "Random seed of the checks")->capture_default_str();
  app->add_flag("--skip-checks", a->skip_checks, "Do not run the property checks");
  app->add_flag("--text", a->text,
                "Print the checks and a few encodings as text instead (no files written)");
  return {app, [a] { return run_demo(*a); }};
}

}  // namespace posenc::cli
