// cli/cmd_bench.cc - `posenc bench`: time the library against this machine's baselines.
//
//   posenc bench [--threads N] [--quick] [--filter TEXT[,TEXT...]] [--json]
//
// --json: one JSON object per line, e.g.
//   {"name": "rope_neox_4096x32x128", "median_s": 0.0031, "min_s": 0.0030, "reps": 161,
//    "threads": 16, "gbps": 43.3, "baseline": "copy_bandwidth", "ratio": 0.87,
//    "simd_target": "AVX3", "quick": false}
// Bandwidth-bound entries carry "gbps", compute-bound ones "gflops" (useful FLOPs); "ratio" is
// the rate over the first baseline's (RoPE: copy_bandwidth, decode: read_bandwidth, attention:
// sgemm) and "ratio_<name>" over the others'; compute-bound entries also carry "vs_fma_peak",
// their GFLOP/s over fma_peak's (the processor's float32 FMA peak, whose row names the Highway
// "target" its FMA chains ran on). Attention entries with positions also carry "vs_none": their
// time over a no-position run timed in alternation with them (median of the pairs' ratios), and
// "none_median_s"; the no-position attention entries "vs_fma_peak_paired": their GFLOP/s over
// fma_peak's chains timed in alternation with them (median of the pairs), and
// "fma_peak_median_s"; backward entries "vs_forward" (over the forward, in alternation) and the
// bf16 entries "vs_float32" (over the float32 entry's work, in alternation); paged decoding
// "vs_contiguous" (over the contiguous token-major cache) and head-major decoding "vs_token_major",
// timed the same way. Without --json: a table with the same numbers. Entries run and print one at a
// time, baselines first (bench/harness.h has the list and the sizes).
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <string>

#include "common.h"
#include "harness.h"

namespace posenc::cli {

namespace {

struct BenchArgs {
  int threads = 0;
  bool quick = false;
  bool json = false;
  std::string filter;
};

// A JSON number (6 significant digits), or null when not finite.
std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

std::string json_string(const std::string& s) { return "\"" + json_escape(s) + "\""; }

// Three significant digits, trailing zeros kept: "3.20", "32.0", "320".
std::string format_3(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", v >= 99.95 ? 0 : (v >= 9.995 ? 1 : 2), v);
  return buf;
}

// "12.3 ms".
std::string format_seconds(double s) {
  if (s >= 1) return format_3(s) + " s";
  if (s >= 1e-3) return format_3(s * 1e3) + " ms";
  return format_3(s * 1e6) + " us";
}

std::string format_fixed(double v, int decimals) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

std::string pad(std::string s, std::size_t width, bool right = false) {
  if (s.size() >= width) return s + " ";
  const std::string fill(width - s.size(), ' ');
  return right ? fill + s : s + fill;
}

struct Context {
  std::string simd_target;
  bool quick = false;
  std::map<std::string, bench::Result> done;  // baselines measured so far
};

void print_json(const bench::Result& r, const Context& ctx) {
  std::string line = "{\"name\": " + json_string(r.name) +
                     ", \"median_s\": " + json_number(r.timing.median_s) +
                     ", \"min_s\": " + json_number(r.timing.min_s) +
                     ", \"reps\": " + std::to_string(r.timing.reps) +
                     ", \"threads\": " + std::to_string(r.threads);
  line += r.is_bandwidth() ? ", \"gbps\": " + json_number(r.gbps())
                           : ", \"gflops\": " + json_number(r.gflops());
  if (!r.baselines.empty()) line += ", \"baseline\": " + json_string(r.baselines.front());
  for (const bench::RatioField& f : bench::ratio_fields(r, ctx.done)) {
    line += ", " + json_string(f.key) + ": " + json_number(f.value);
  }
  for (const auto& [key, value] : r.extra) {
    line += ", " + json_string(key) + ": " + json_number(value);
  }
  for (const auto& [key, value] : r.info) {
    line += ", " + json_string(key) + ": " + json_string(value);
  }
  line += ", \"simd_target\": " + json_string(ctx.simd_target);
  line += std::string(", \"quick\": ") + (ctx.quick ? "true" : "false") + "}";
  std::cout << line << std::endl;
}

constexpr std::size_t kNameWidth = 50;

void print_table_header(int threads, const Context& ctx) {
  std::cout << "posenc bench: SIMD target " << ctx.simd_target
            << " (available: " << bench::simd_targets_available() << "), " << threads << " thread"
            << (threads == 1 ? "" : "s") << (ctx.quick ? ", quick sizes" : "") << '\n'
            << "BLAS: " << bench::blas_config() << "\n\n"
            << pad("name", kNameWidth) << pad("median", 11, true) << pad("min", 11, true)
            << pad("rate", 17, true) << "  ratio\n";
  std::cout.flush();
}

void print_table_row(const bench::Result& r, const Context& ctx) {
  const std::string rate = format_fixed(r.rate(), 1) + (r.is_bandwidth() ? " GB/s" : " GFLOP/s");
  std::string line = pad(r.name, kNameWidth) + pad(format_seconds(r.timing.median_s), 11, true) +
                     pad(format_seconds(r.timing.min_s), 11, true) + pad(rate, 17, true);
  std::string ratios;
  for (const bench::RatioField& f : bench::ratio_fields(r, ctx.done)) {
    ratios += (ratios.empty() ? "  " : ", ") + format_fixed(f.value, 3) + " x " + f.baseline;
  }
  line += ratios;
  if (r.name == "fma_peak" || r.name == "bf16_dot_peak") {
    // The Highway target (or the instruction) and the chains: "AVX3, 16 chains x 16 lanes".
    std::string target;
    double chains = 0, lanes = 0;
    for (const auto& [key, value] : r.info) {
      if (key == "target" || key == "instruction") target = value;
    }
    for (const auto& [key, value] : r.extra) {
      if (key == "chains") chains = value;
      if (key == "lanes") lanes = value;
    }
    line += "  " + target + ", " + format_fixed(chains, 0) + " chains x " + format_fixed(lanes, 0) +
            " lanes";
  }
  for (const auto& [key, value] : r.extra) {
    if (key == "peak_mb" || key == "inputs_outputs_mb" || key == "workspace_mb" ||
        key == "naive_scores_mb") {
      line += "  " + key.substr(0, key.size() - 3) + " " + format_fixed(value, 1) + " MiB";
    } else if (key == "vs_none" || key == "vs_forward" || key == "vs_float32") {
      line += (ratios.empty() ? "  " : ", ") + format_fixed(value, 3) + " x " +
              (key == "vs_none"      ? "none's"
               : key == "vs_forward" ? "forward's"
                                     : "float32's") +
              " time";
    } else if (key == "vs_separate" || key == "vs_dense" || key == "vs_no_cap") {
      line += (ratios.empty() ? "  " : ", ") + key + " " + format_fixed(value, 3);
    } else if (key == "vs_fma_peak_paired") {
      line +=
          (ratios.empty() ? "  " : ", ") + format_fixed(value, 3) + " x fma_peak in alternation";
    } else if (key == "vs_contiguous" || key == "vs_token_major") {
      line += (ratios.empty() ? "  " : ", ") + format_fixed(value, 3) + " x " +
              (key == "vs_contiguous" ? "contiguous" : "token-major") + " time";
    }
  }
  std::cout << line << std::endl;
}

int run_bench(const BenchArgs& a) {
  require_at_least("--threads", a.threads, 0);
  bench::SuiteOptions opt;
  opt.threads = bench::resolve_threads(a.threads);
  opt.quick = a.quick;
  opt.filter = a.filter;
  const std::vector<bench::Entry> entries = bench::suite(opt);
  if (entries.empty()) throw UsageError("--filter '" + a.filter + "' matches no entry");
  Context ctx;
  ctx.simd_target = bench::simd_target();
  ctx.quick = a.quick;
  if (!a.json) print_table_header(opt.threads, ctx);
  for (const bench::Entry& e : entries) {
    bench::Result r = e.run();
    if (a.json) {
      print_json(r, ctx);
    } else {
      print_table_row(r, ctx);
    }
    ctx.done.emplace(r.name, std::move(r));
  }
  return 0;
}

}  // namespace

Command add_bench_command(CLI::App& parent) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* app = parent.add_subcommand(
      "bench",
      "Time RoPE, attention per scheme and decode against memory bandwidth, the float32 FMA "
      "peak, OpenBLAS sgemm and a naive materialized attention (minutes; --quick: seconds)");
  app->add_option("--threads", a->threads, "Threads (0 = all available)")->capture_default_str();
  app->add_flag("--quick", a->quick, "Smaller sizes and shorter timing (names show the sizes)");
  app->add_option("--filter", a->filter,
                  "Run only the entries whose name contains this text; comma-separated "
                  "alternatives, =NAME for exactly that entry (e.g. "
                  "fma_peak,sgemm,=attention_none_causal_L512_H8_D128)");
  app->add_flag("--json", a->json, "One JSON object per line instead of the table");
  return {app, [a] { return run_bench(*a); }};
}

}  // namespace posenc::cli
