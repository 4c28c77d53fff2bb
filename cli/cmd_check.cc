// cli/cmd_check.cc - `posenc check`: the seeds' claims, measured (posenc/check.h).
#include <CLI/CLI.hpp>
#include <cstdint>
#include <iostream>
#include <memory>

#include "common.h"
#include "posenc/check.h"

namespace posenc::cli {

namespace {

struct CheckArgs {
  uint64_t seed = CheckOptions{}.seed;
  bool json = false;
};

int run_check(const CheckArgs& a) {
  CheckOptions opt;
  opt.seed = a.seed;
  const std::vector<CheckResult> results = run_checks(opt);
  if (a.json) {
    print_check_json(std::cout, results);
  } else {
    print_check_table(std::cout, results);
  }
  std::cout.flush();
  for (const CheckResult& r : results) {
    if (!r.pass) return 1;
  }
  return 0;
}

}  // namespace

Command add_check_command(CLI::App& parent) {
  auto a = std::make_shared<CheckArgs>();
  CLI::App* app = parent.add_subcommand(
      "check", "Measure the schemes' claimed properties; exit status 1 if any check fails");
  app->add_option("--seed", a->seed, "Random seed of the inputs")->capture_default_str();
  app->add_flag("--json", a->json, "One JSON object per line instead of the table");
  return {app, [a] { return run_check(*a); }};
}

}  // namespace posenc::cli
