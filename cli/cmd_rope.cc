// cli/cmd_rope.cc - `posenc rope`: rotate x [batch, seq, heads, head_dim] (SPEC §3).
#include <CLI/CLI.hpp>
#include <memory>
#include <optional>
#include <string>

#include "common.h"
#include "posenc/rope.h"

namespace posenc::cli {

namespace {

struct RopeArgs {
  std::string in;
  std::string out;
  double base = 1e4;
  int64_t rotary_dim = 0;
  std::string style = "half";
  std::optional<int64_t> offset;
  std::string positions;
  bool inverse = false;
};

int run_rope(const RopeArgs& a) {
  FloatArray x = read_float_npy(a.in, 4, "[batch, seq, heads, head_dim]", true);
  const int64_t batch = x.shape[0], seq = x.shape[1];
  const Positions positions = positions_from_flags(a.offset, a.positions, batch, seq);

  RopeConfig cfg;
  cfg.head_dim = x.shape[3];
  cfg.rotary_dim = a.rotary_dim;
  cfg.base = a.base;
  cfg.style = parse_rope_style(a.style);
  validate(cfg);
  const RopeFrequencies freqs = rope_frequencies(cfg, positions.max_position(batch, seq) + 1);

  FloatArray y;
  y.shape = x.shape;
  y.data.resize(x.data.size());
  apply_rope(freqs, cfg.style, x.view<4>(), y.mutable_view<4>(), &positions,
             a.inverse ? Direction::kInverse : Direction::kForward);
  write_f32(a.out, y.shape, y.data);
  return 0;
}

}  // namespace

Command add_rope_command(CLI::App& parent) {
  auto a = std::make_shared<RopeArgs>();
  CLI::App* app = parent.add_subcommand(
      "rope", "Apply rotary position embedding to x [batch, seq, heads, head_dim] (.npy)");
  app->add_option("--in", a->in, "Input .npy, float32 (or float64) [batch, seq, heads, head_dim]")
      ->required();
  app->add_option("--out", a->out, "Output .npy, float32, same shape")->required();
  app->add_option("--base", a->base, "theta (rope_theta)")->capture_default_str();
  app->add_option("--rotary-dim", a->rotary_dim,
                  "Rotary dim R (even, <= head_dim); 0 or absent: R = head_dim");
  app->add_option("--style", a->style, "half (GPT-NeoX, HF) or interleaved (GPT-J, RoFormer)")
      ->check(CLI::IsMember({"half", "interleaved"}))
      ->capture_default_str();
  auto* offset = app->add_option("--offset", a->offset, "Token i at position K + i (default 0)");
  auto* positions = app->add_option("--positions", a->positions,
                                    "int64 position ids [seq] or [batch, seq] (.npy)");
  offset->excludes(positions);
  app->add_flag("--inverse", a->inverse, "Rotate by -angle (the inverse / backward)");
  return {app, [a] { return run_rope(*a); }};
}

}  // namespace posenc::cli
