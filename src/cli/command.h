// Sub-command registry of the nopad binary. Each cmd_*.cpp registers itself with NOPAD_REGISTER_COMMAND; main()
// builds the CLI11 app from the registry, so adding a command never touches another command's file.
// A command's setup function adds its options to the CLI11 sub-app and sets its callback; the callback throws
// nopad::Error for user-facing failures, which main() prints as one line and turns into exit code 1.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace nopad::cli {

struct Command {
  std::string name;
  std::string help;
  int order;  // position in `nopad --help`
  std::function<void(CLI::App& sub)> setup;
};

std::vector<Command>& command_registry();
inline bool register_command(Command c) {
  command_registry().push_back(std::move(c));
  return true;
}

}  // namespace nopad::cli

#define NOPAD_CONCAT_INNER(a, b) a##b
#define NOPAD_CONCAT(a, b) NOPAD_CONCAT_INNER(a, b)
#define NOPAD_REGISTER_COMMAND(name, help, order, setup) \
  static const bool NOPAD_CONCAT(nopad_command_registered_, __LINE__) = \
      ::nopad::cli::register_command({name, help, order, setup})
