// cli/cmd_sinusoidal.cc - `posenc sinusoidal`: a fixed sinusoidal table (docs/sinusoidal.md).
#include <CLI/CLI.hpp>
#include <memory>
#include <optional>
#include <string>

#include "common.h"
#include "posenc/sinusoidal.h"

namespace posenc::cli {

namespace {

struct SinusoidalArgs {
  std::optional<int64_t> length;
  int64_t dim = 0;
  double base = 1e4;
  std::string layout = "interleaved";
  std::string denominator = "dim";
  int64_t origin = 0;
  std::string odd_dim = "error";
  std::string positions;
  std::string out;
};

int run_sinusoidal(const SinusoidalArgs& a) {
  SinusoidalConfig cfg;
  cfg.dim = a.dim;
  cfg.base = a.base;
  cfg.layout = a.layout == "concat" ? SinLayout::kConcat : SinLayout::kInterleaved;
  cfg.denominator = parse_sin_denominator(a.denominator, "--denominator");
  cfg.origin = a.origin;
  cfg.odd_dim = parse_sin_odd_dim(a.odd_dim, "--odd-dim");
  validate(cfg);

  if (!a.positions.empty()) {
    const Tensor t = read_npy(a.positions);
    require_rank(t, 1, "[n]", a.positions);
    const std::vector<int64_t> ids = t.to_i64(a.positions);
    const int64_t n = static_cast<int64_t>(ids.size());
    std::vector<float> table(static_cast<std::size_t>(checked_elements(
        "the float32 table [n, dim]", {{"--positions (n)", n}, {"--dim", cfg.dim}}, 4)));
    sinusoidal_encode(cfg, ids, View<float, 2>::contiguous(table.data(), {n, cfg.dim}));
    write_f32(a.out, {n, cfg.dim}, table);
    return 0;
  }
  if (!a.length) throw UsageError("--length is required (or --positions P.npy)");
  require_at_least("--length", *a.length, 0);
  checked_elements("the float32 table [length, dim]", {{"--length", *a.length}, {"--dim", cfg.dim}},
                   4);
  const std::vector<float> table = sinusoidal_table(cfg, *a.length);
  if (static_cast<int64_t>(table.size()) != *a.length * cfg.dim) {
    throw std::runtime_error("sinusoidal_table returned " + std::to_string(table.size()) +
                             " values, expected length x dim");
  }
  write_f32(a.out, {*a.length, cfg.dim}, table);
  return 0;
}

}  // namespace

Command add_sinusoidal_command(CLI::App& parent) {
  auto a = std::make_shared<SinusoidalArgs>();
  CLI::App* app = parent.add_subcommand(
      "sinusoidal", "Write the sinusoidal table PE [length, dim] (float32) to a .npy file");
  auto* length = app->add_option("--length", a->length, "Number of positions N (rows)");
  app->add_option("--dim", a->dim, "Model width d (even unless --odd-dim zero-pad)")->required();
  app->add_option("--base", a->base, "Frequency base")->capture_default_str();
  app->add_option("--layout", a->layout, "interleaved (paper) or concat (Transformer-XL, BART)")
      ->check(CLI::IsMember({"interleaved", "concat"}))
      ->capture_default_str();
  app->add_option("--denominator", a->denominator,
                  "Exponent denominator: dim (paper) or half-minus-one (tensor2tensor, fairseq)")
      ->check(CLI::IsMember({"dim", "half-minus-one"}))
      ->capture_default_str();
  app->add_option("--origin", a->origin, "Position of the first row (fairseq: padding_idx + 1)")
      ->capture_default_str();
  app->add_option("--odd-dim", a->odd_dim, "Odd dim: error or zero-pad (fairseq)")
      ->check(CLI::IsMember({"error", "zero-pad"}))
      ->capture_default_str();
  auto* positions = app->add_option("--positions", a->positions,
                                    "Explicit int64 positions [n] (.npy) instead of --length");
  length->excludes(positions);
  app->add_option("--out", a->out, "Output .npy file, float32 [length, dim]")->required();
  return {app, [a] { return run_sinusoidal(*a); }};
}

}  // namespace posenc::cli
