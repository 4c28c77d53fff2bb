// cli/cmd_alibi.cc - `posenc alibi-slopes`: ALiBi head slopes (docs/alibi.md).
#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "common.h"
#include "posenc/alibi.h"

namespace posenc::cli {

namespace {

struct AlibiArgs {
  int64_t heads = 0;
  double max_bias = 8.0;
  std::string out_dtype = "float32";
  std::string out;
};

int run_alibi(const AlibiArgs& a) {
  const std::vector<double> slopes = alibi_slopes(AlibiConfig{a.heads, a.max_bias});
  const auto n = static_cast<int64_t>(slopes.size());
  if (a.out_dtype == "float64") {
    write_f64(a.out, {n}, slopes);
  } else {
    std::vector<float> f(slopes.size());
    for (std::size_t h = 0; h < slopes.size(); ++h) f[h] = static_cast<float>(slopes[h]);
    write_f32(a.out, {n}, f);
  }
  return 0;
}

}  // namespace

Command add_alibi_slopes_command(CLI::App& parent) {
  auto a = std::make_shared<AlibiArgs>();
  CLI::App* app =
      parent.add_subcommand("alibi-slopes", "Write the ALiBi slopes [heads] to a .npy file");
  app->add_option("--heads", a->heads, "Number of heads H (>= 1)")->required();
  app->add_option("--max-bias", a->max_bias, "Maximum bias B (MPT alibi_bias_max)")
      ->capture_default_str();
  app->add_option("--out-dtype", a->out_dtype, "float32 or float64")
      ->check(CLI::IsMember({"float32", "float64"}))
      ->capture_default_str();
  app->add_option("--out", a->out, "Output .npy, [heads]")->required();
  return {app, [a] { return run_alibi(*a); }};
}

}  // namespace posenc::cli
