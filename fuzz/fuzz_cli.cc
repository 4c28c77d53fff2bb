// fuzz/fuzz_cli.cc - posenc's command line (every subcommand and option, cli/common.cc's
// add_all_commands) on arbitrary argument lists: the input is split into arguments at '\n'
// bytes. Parsing must end in success or a CLI11 / posenc error; the commands are not run.
#include <CLI/CLI.hpp>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common.h"
#include "fuzz_util.h"
#include "posenc/error.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  posenc::fuzz::limit_allocations();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  constexpr std::size_t kMaxArgs = 64;
  std::vector<std::string> args = {"posenc"};
  std::string cur;
  for (std::size_t i = 0; i < size && args.size() < kMaxArgs; ++i) {
    if (data[i] == '\n') {
      args.push_back(cur);
      cur.clear();
    } else if (data[i] != '\0') {
      cur += static_cast<char>(data[i]);
    }
  }
  if (!cur.empty() && args.size() < kMaxArgs) args.push_back(cur);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  CLI::App app{"posenc", "posenc"};
  const std::vector<posenc::cli::Command> commands = posenc::cli::add_all_commands(app);
  try {
    app.parse(static_cast<int>(args.size()), argv.data());
    for (const auto& c : commands) {
      if (c.app->parsed()) posenc::cli::check_out_early(*c.app);
    }
  } catch (const CLI::Error&) {
  } catch (const posenc::Error&) {
  }
  return 0;
}
