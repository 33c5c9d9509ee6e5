// Fuzz body of the training-config parser (train/config_file.h) with nopad's real schema (train_config_schema()).
// The bytes are a config file; after a NUL byte, one `--set key=value` override per line. An accepted config must
// answer every key through its typed getter, and parse(dump()) must give every value back (the run folder's
// config.toml is such a dump).
#pragma once
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "train/config_file.h"
#include "train/trainer.h"
#include "fuzz_common.h"

namespace nopad::fuzz {

// Every key's effective value through its typed getter, as text (doubles by their bits).
inline std::vector<std::string> config_values(const Config& c) {
  std::vector<std::string> out;
  for (const ConfigSchema::Key& k : c.schema().keys()) {
    switch (k.type) {
      case ConfigType::kString: out.push_back(c.get_string(k.key)); break;
      case ConfigType::kInt: out.push_back(std::to_string(c.get_int(k.key))); break;
      case ConfigType::kBool: out.push_back(c.get_bool(k.key) ? "true" : "false"); break;
      case ConfigType::kFloat: {
        const double d = c.get_double(k.key);
        uint64_t bits;
        std::memcpy(&bits, &d, sizeof bits);
        out.push_back(std::to_string(bits));
        break;
      }
    }
  }
  return out;
}

inline void config_fuzz_one(const uint8_t* data, size_t size) {
  static const ConfigSchema schema = train_config_schema();
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const size_t nul = bytes.find('\0');
  const std::string_view file = bytes.substr(0, nul);
  std::optional<Config> config;
  try {
    config = Config::parse(file, schema, "fuzz.toml", "/fuzz");
  } catch (const Error&) {
    return;
  }
  if (nul != std::string_view::npos) {
    std::string_view sets = bytes.substr(nul + 1);
    while (!sets.empty()) {
      const size_t nl = sets.find('\n');
      const std::string_view assignment = sets.substr(0, nl);
      sets = nl == std::string_view::npos ? std::string_view() : sets.substr(nl + 1);
      try {
        config->apply_override(assignment);
      } catch (const Error&) {
      }
    }
  }
  // From here on nothing may fail: the config was accepted.
  const std::vector<std::string> values = config_values(*config);
  const Config back = Config::parse(config->dump(), schema, "dump", "/fuzz");
  require(config_values(back) == values, "parse(dump()) gives every value back");
}

}  // namespace nopad::fuzz
