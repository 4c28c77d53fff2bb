// cli/cmd_describe.cc - `posenc describe config.json`: the positional encoding a model config
// implies (posenc::describe), or the same as one JSON object with --json.
#include <CLI/CLI.hpp>
#include <iostream>
#include <memory>
#include <string>

#include "common.h"
#include "posenc/config.h"

namespace posenc::cli {

namespace {

struct DescribeArgs {
  std::string config;
  bool json = false;
};

int run_describe(const DescribeArgs& a) {
  const ModelConfig cfg = read_model_config(a.config);
  if (a.json) {
    std::cout << describe_json(cfg) << std::endl;
  } else {
    std::cout << describe(cfg) << std::flush;
  }
  return 0;
}

}  // namespace

Command add_describe_command(CLI::App& parent) {
  auto a = std::make_shared<DescribeArgs>();
  CLI::App* app = parent.add_subcommand(
      "describe",
      "Describe the positional encoding of a model config.json (scheme, dims, theta, style, "
      "scaling, attention factor, effective context, the per-layer pattern, and which values "
      "are the model type's defaults)");
  app->add_option("config", a->config, "HF-style config.json")->required();
  app->add_flag("--json", a->json, "One JSON object instead of text");
  return {app, [a] { return run_describe(*a); }};
}

}  // namespace posenc::cli
