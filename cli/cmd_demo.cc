// cli/cmd_demo.cc - `posenc demo`: the checks table and a few encodings printed as text.
//
// No input needed. Everything shown comes from the public API; nothing is computed here.
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "common.h"
#include "posenc/alibi.h"
#include "posenc/check.h"
#include "posenc/rope.h"
#include "posenc/sinusoidal.h"
#include "posenc/t5.h"

namespace posenc::cli {

namespace {

struct DemoArgs {
  uint64_t seed = CheckOptions{}.seed;
  bool skip_checks = false;
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

int run_demo(const DemoArgs& a) {
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

}  // namespace

Command add_demo_command(CLI::App& parent) {
  auto a = std::make_shared<DemoArgs>();
  CLI::App* app = parent.add_subcommand(
      "demo", "Print the checks table and a few encodings (sinusoidal, ALiBi, T5, RoPE) as text");
  app->add_option("--seed", a->seed, "Random seed of the checks")->capture_default_str();
  app->add_flag("--skip-checks", a->skip_checks, "Only print the encodings");
  return {app, [a] { return run_demo(*a); }};
}

}  // namespace posenc::cli
