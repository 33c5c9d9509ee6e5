// nopad: one binary for the whole BERT pre-training job. Sub-commands register themselves (cli/command.h).
#include <algorithm>
#include <cstdio>
#include <exception>

#include "cli/command.h"
#include "core/error.h"

namespace nopad::cli {
std::vector<Command>& command_registry() {
  static std::vector<Command> registry;
  return registry;
}
}  // namespace nopad::cli

int main(int argc, char** argv) {
  using namespace nopad::cli;
  CLI::App app{
      "nopad: pre-train BERT-family encoders on unpadded, variable-length batches.\n"
      "Text -> WordPiece -> pre-training instances -> shards -> training -> evaluation -> checkpoints.\n"
      "Run `nopad COMMAND --help` for the options of a command."};
  app.set_version_flag("--version", std::string("nopad ") + NOPAD_VERSION
#ifdef NOPAD_HAVE_CUDA
                                        + " (CUDA backend built)"
#else
                                        + " (CPU only)"
#endif
  );
  app.require_subcommand(1);
  auto& registry = command_registry();
  std::sort(registry.begin(), registry.end(), [](const Command& a, const Command& b) { return a.order < b.order; });
  for (const Command& c : registry) {
    CLI::App* sub = app.add_subcommand(c.name, c.help);
    c.setup(*sub);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const nopad::Error& e) {
    const std::string cmd = app.get_subcommands().empty() ? "" : " " + app.get_subcommands().front()->get_name();
    std::fprintf(stderr, "nopad%s: error: %s\n", cmd.c_str(), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nopad: internal error: %s\n", e.what());
    return 2;
  }
  return 0;
}
