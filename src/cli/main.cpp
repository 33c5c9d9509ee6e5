// nopad: one binary for the whole BERT pre-training job. Sub-commands register themselves (cli/command.h).
#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>

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
  // A mistyped command word gets named (CLI11 would only say that a subcommand is required): the first word, and the
  // word after a command that itself takes subcommands (nopad bench loader|model|attention).
  {
    const CLI::App* level = &app;
    for (int i = 1; i < argc && level != nullptr && level->get_require_subcommand_min() > 0; ++i) {
      const std::string word = argv[i];
      if (word.empty() || word[0] == '-') break;
      const CLI::App* next = nullptr;
      std::string names;
      for (const CLI::App* sub : level->get_subcommands([](const CLI::App*) { return true; })) {
        if (sub->check_name(word)) next = sub;
        names += (names.empty() ? "" : ", ") + sub->get_name();
      }
      if (next == nullptr) {
        std::fprintf(stderr, "nopad: error: unknown command \"%s\"%s%s; the commands here are: %s (see %s --help)\n",
                     word.c_str(), level == &app ? "" : " after ", level == &app ? "" : level->get_name().c_str(),
                     names.c_str(), level == &app ? "nopad" : ("nopad " + level->get_name()).c_str());
        return 109;
      }
      level = next;
    }
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
