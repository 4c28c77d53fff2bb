// cli/cmd_rope_precision.cc - `posenc rope-precision`: RoPE output and angle error at large
// positions, accurate vs float32 angles (posenc::rope_precision, docs/precision.md).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "posenc/check.h"

namespace posenc::cli {

namespace {

struct RopePrecisionArgs {
  std::vector<int64_t> exponents = {10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  int64_t head_dim = 128;
  double base = 5e5;
  uint64_t seed = 1;
  bool json = false;
};

constexpr int64_t kMaxExponent = 52;

int run_rope_precision(const RopePrecisionArgs& a) {
  std::vector<int64_t> positions;
  for (const int64_t e : a.exponents) {
    if (e < 0 || e > kMaxExponent) {
      throw UsageError("--positions: exponent " + std::to_string(e) + " outside [0, " +
                       std::to_string(kMaxExponent) + "]");
    }
    positions.push_back(int64_t{1} << e);
  }
  if (a.head_dim < 2 || a.head_dim % 2 != 0) {
    throw UsageError("--head-dim must be even and >= 2 (got " + std::to_string(a.head_dim) + ")");
  }
  const std::vector<RopePrecisionRow> rows = rope_precision(positions, a.head_dim, a.base, a.seed);

  if (a.json) {
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const RopePrecisionRow& r = rows[i];
      std::cout << "{\"position\": " << r.position << ", \"exponent\": " << a.exponents[i]
                << ", \"accurate_max_err\": " << full_precision(r.accurate_error)
                << ", \"float32_max_err\": " << full_precision(r.float32_error)
                << ", \"float32_angle_err_rad\": " << full_precision(r.float32_angle_error)
                << "}\n";
    }
    std::cout << std::flush;
    return 0;
  }
  const std::array<std::string, 5> header = {"position", "accurate_max_err", "float32_max_err",
                                             "float32_angle_err_rad", "2^e"};
  std::vector<std::array<std::string, 5>> cells;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const RopePrecisionRow& r = rows[i];
    cells.push_back({std::to_string(r.position), format_number(r.accurate_error, 3),
                     format_number(r.float32_error, 3), format_number(r.float32_angle_error, 3),
                     "2^" + std::to_string(a.exponents[i])});
  }
  std::array<std::size_t, 5> width{};
  for (std::size_t c = 0; c < 5; ++c) width[c] = header[c].size();
  for (const auto& row : cells) {
    for (std::size_t c = 0; c < 5; ++c) width[c] = std::max(width[c], row[c].size());
  }
  auto print_row = [&](const std::array<std::string, 5>& row) {
    for (std::size_t c = 0; c < 5; ++c) {
      std::cout << row[c];
      if (c + 1 < 5) std::cout << std::string(width[c] - row[c].size() + 2, ' ');
    }
    std::cout << '\n';
  };
  print_row(header);
  std::array<std::string, 5> rule;
  for (std::size_t c = 0; c < 5; ++c) rule[c] = std::string(width[c], '-');
  print_row(rule);
  for (const auto& row : cells) print_row(row);
  std::cout << std::flush;
  return 0;
}

}  // namespace

Command add_rope_precision_command(CLI::App& parent) {
  auto a = std::make_shared<RopePrecisionArgs>();
  CLI::App* app = parent.add_subcommand(
      "rope-precision",
      "RoPE precision at large positions: max output error of accurate and float32 angles "
      "against the float64 reference, and the float32 angle error in radians");
  app->footer(
      "Per position p: 8 tokens at p .. p+7 x 4 heads of unit-normal inputs (fixed seed). "
      "accurate_max_err and float32_max_err: max |float32 output - float64 reference|; the "
      "float32 mode's reference uses the same float32-rounded inv_freq with accurate angles, so "
      "only the angle error shows. float32_angle_err_rad: max over tokens and pairs of "
      "|remainder(float32(p) * float32(inv) - p * inv, 2 pi)|.");
  app->add_option("--positions", a->exponents,
                  "Comma-separated exponents e: positions 2^e (0 <= e <= 52)")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--head-dim", a->head_dim, "Head dim (= rotary dim, even)")
      ->capture_default_str();
  app->add_option("--base", a->base, "theta")->capture_default_str();
  app->add_option("--seed", a->seed, "Seed of the unit-normal inputs")->capture_default_str();
  app->add_flag("--json", a->json, "One JSON object per line instead of the table");
  return {app, [a] { return run_rope_precision(*a); }};
}

}  // namespace posenc::cli
