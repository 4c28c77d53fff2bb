// cli/cmd_version.cc - `posenc version`.
#include <CLI/CLI.hpp>
#include <iostream>

#include "common.h"
#include "posenc/version.h"

namespace posenc::cli {

Command add_version_command(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand("version", "Print the posenc version");
  return {app, [] {
            std::cout << "posenc " << POSENC_VERSION_STRING << '\n';
            return 0;
          }};
}

}  // namespace posenc::cli
