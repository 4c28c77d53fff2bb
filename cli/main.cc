// cli/main.cc - the `posenc` command-line tool: dispatch to one subcommand and map errors.
//
// Exit status: 0 success (and --help), 1 a failed `posenc check` or an unexpected internal error,
// 2 any usage or input error (CLI11 parse errors, posenc::Error, a JSON or size error the
// standard library reports, running out of memory). Errors are one stderr line:
//   posenc <command>: error: <message>
// Hostile input (docs/reliability.md): integer options are parsed strictly into documented
// ranges, OpenMP never starts more than posenc::kMaxThreads threads, and SIGXFSZ is ignored so
// a file-size limit fails a write with EFBIG (reported, temporary file removed) instead of
// killing the process.
#include <CLI/CLI.hpp>
#include <csignal>
#include <exception>
#include <iostream>
#include <new>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "common.h"
#include "posenc/error.h"
#include "posenc/size.h"

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

// Process-wide settings that no input can override.
void harden_process() {
  // A file-size limit (ulimit -f) makes write() fail with EFBIG instead of killing us: the
  // writer then reports it and removes its temporary file.
  std::signal(SIGXFSZ, SIG_IGN);
#ifdef _OPENMP
  // OMP_NUM_THREADS=100000 would make every parallel region overflow the caller's stack.
  if (omp_get_max_threads() > posenc::kMaxThreads) omp_set_num_threads(posenc::kMaxThreads);
#endif
}

// Every option that takes a value refuses an empty one: CLI11 would read `--softcap ''` as
// "not given" (an optional stays unset) and `--window ''` as 0.
void refuse_empty_values(CLI::App& app) {
  for (CLI::Option* o : app.get_options()) {
    if (o->get_type_size_min() <= 0) continue;  // a flag
    // No description: the help text stays as it is.
    o->check(CLI::Validator(
        [](std::string& s) { return s.empty() ? std::string("an empty value") : std::string(); },
        ""));
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    refuse_empty_values(*sub);
  }
}

}  // namespace

int main(int argc, char** argv) {
  namespace pc = posenc::cli;
  std::string command;
  harden_process();
  try {
    CLI::App app{
        "posenc - transformer positional encodings (sinusoidal, learned, RoPE, ALiBi, T5, "
        "Shaw, Transformer-XL, DeBERTa).\nTensors are .npy files, named parameters "
        ".safetensors (docs/cli.md, File conventions).",
        "posenc"};
    const std::vector<pc::Command> commands = pc::add_all_commands(app);
    refuse_empty_values(app);
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
      if (!c.app->parsed()) continue;
      pc::check_out_early(*c.app);
      return c.run();
    }
    return report(command, "no command given", 2);
  } catch (const posenc::Error& e) {
    return report(command, e.what(), 2);
  } catch (const CLI::Error& e) {
    return report(command, e.what(), 2);
  } catch (const nlohmann::json::exception& e) {
    // Readers turn JSON errors into IoError; this is the net under them.
    return report(command, std::string("invalid JSON: ") + e.what(), 2);
  } catch (const std::bad_alloc&) {
    return report(command,
                  "out of memory (sizes are checked against POSENC_MAX_BYTES or the physical "
                  "memory, but the machine could not provide them)",
                  2);
  } catch (const std::length_error& e) {
    return report(command, std::string("size too large: ") + e.what(), 2);
  } catch (const std::exception& e) {
    return report(command, e.what(), 1);
  } catch (...) {
    return report(command, "unknown internal error", 1);
  }
}
