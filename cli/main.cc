// cli/main.cc - the `posenc` command-line tool: dispatch to one subcommand and map errors.
//
// Exit status: 0 success (and --help), 1 a failed `posenc check` or an unexpected internal error,
// 2 any usage or input error (CLI11 parse errors, posenc::Error). Errors are one stderr line:
//   posenc <command>: error: <message>
#include <CLI/CLI.hpp>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "common.h"
#include "posenc/error.h"
#include "posenc/version.h"

namespace {

// The subcommand named on the command line (for the error prefix), parsing or not.
std::string command_name(int argc, char** argv, const std::vector<posenc::cli::Command>& cmds) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (!arg.empty() && arg[0] == '-') continue;
    for (const auto& c : cmds) {
      if (c.app->check_name(arg)) return c.app->get_name();
    }
    return "";
  }
  return "";
}

int report(const std::string& command, const std::string& message, int status) {
  std::cerr << "posenc" << (command.empty() ? "" : " " + command)
            << ": error: " << posenc::cli::one_line(message) << std::endl;
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  namespace pc = posenc::cli;
  std::string command;
  try {
    CLI::App app{
        "posenc - transformer positional encodings (sinusoidal, learned, RoPE, ALiBi, T5, "
        "Shaw, Transformer-XL, DeBERTa).\nTensors are .npy files, named parameters "
        ".safetensors (see SPEC.md section 9).",
        "posenc"};
    app.require_subcommand(1);
    app.set_version_flag("--version", std::string("posenc ") + POSENC_VERSION_STRING);
    const std::vector<pc::Command> commands = {
        pc::add_sinusoidal_command(app),
        pc::add_rope_command(app),
        pc::add_rope_freqs_command(app),
        pc::add_rope_precision_command(app),
        pc::add_alibi_slopes_command(app),
        pc::add_t5_buckets_command(app),
        pc::add_deberta_buckets_command(app),
        pc::add_learned_command(app),
        pc::add_attention_command(app),
        pc::add_attention_grad_command(app),
        pc::add_check_command(app),
        pc::add_bench_command(app),
        pc::add_describe_command(app),
        pc::add_inspect_command(app),
        pc::add_demo_command(app),
        pc::add_plot_command(app),
        pc::add_version_command(app),
    };
    command = command_name(argc, argv, commands);
    if (argc > 1 && argv[1][0] != '-' && command.empty()) {
      std::string names;
      for (const auto& c : commands) names += (names.empty() ? "" : ", ") + c.app->get_name();
      return report("", "unknown command '" + std::string(argv[1]) + "' (commands: " + names + ")",
                    2);
    }
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version: stdout, status 0
      return report(command, e.what(), 2);
    }
    for (const auto& c : commands) {
      if (c.app->parsed()) return c.run();
    }
    return report(command, "no command given", 2);
  } catch (const posenc::Error& e) {
    return report(command, e.what(), 2);
  } catch (const CLI::Error& e) {
    return report(command, e.what(), 2);
  } catch (const std::exception& e) {
    return report(command, e.what(), 1);
  } catch (...) {
    return report(command, "unknown internal error", 1);
  }
}
