// nopad's training config: a readable TOML subset, checked against a schema of known keys.
//
// Format: `# comments`, `[section]` headers, `key = value`; the full key is "section.key" (or "key" before any
// section). Values: "quoted strings" (escapes \" \\ \n \t), integers (-1, 42), floats (1e-4, 4.25e-4, 0.5),
// booleans true/false. Each key at most once per file. Overrides (`--set key=value`) use the same value rules and
// also accept bare unquoted strings (`--set run_dir=/tmp/x`).
//
// The schema declares every key with its type, default and help; an unknown key is an error that names the
// closest known key, a value of the wrong type is an error naming the key, the source and line. dump() writes the
// effective config (every schema key, defaults included) in the same format, so parse(dump()) gives it back.
//
// Path keys (ConfigSchema::add_path): a relative path written in a config file means relative to that file's folder
// (so `nopad train --config /elsewhere/run.toml` works from any working directory), one given with --set relative
// to the working directory, as any command-line path; both are stored absolute, so dump() (the run's config.toml)
// records where everything was.
#pragma once
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "core/io.h"

namespace nopad {

enum class ConfigType { kString, kInt, kFloat, kBool };
const char* config_type_name(ConfigType t);

// A typed value; `text` is the string value for kString, the literal for the others.
struct ConfigValue {
  ConfigType type = ConfigType::kString;
  std::string text;
  std::string source;  // "FILE line N", "--set", or "default"
};

class ConfigSchema {
 public:
  struct Key {
    std::string key;
    ConfigType type;
    ConfigValue default_value;
    std::string help;
    bool is_path = false;  // a file or folder (see above)
  };

  // T: std::string / const char* (string), an integer type (int), float/double (float), bool.
  template <class T>
  ConfigSchema& add(const std::string& key, const T& default_value, const std::string& help) {
    if constexpr (std::is_same_v<T, bool>) {
      return add_raw(key, ConfigType::kBool, default_value ? "true" : "false", help);
    } else if constexpr (std::is_integral_v<T>) {
      return add_raw(key, ConfigType::kInt, std::to_string(static_cast<int64_t>(default_value)), help);
    } else if constexpr (std::is_floating_point_v<T>) {
      return add_raw(key, ConfigType::kFloat, format_float(static_cast<double>(default_value)), help);
    } else {
      return add_raw(key, ConfigType::kString, std::string(default_value), help);
    }
  }

  // A string key that names a file or folder (relative values are resolved, see above).
  ConfigSchema& add_path(const std::string& key, const std::string& default_value, const std::string& help) {
    add_raw(key, ConfigType::kString, default_value, help);
    keys_.back().is_path = true;
    return *this;
  }

  const Key* find(std::string_view key) const;
  const std::vector<Key>& keys() const { return keys_; }
  // The known key closest to `key` (edit distance, or the same last component), or "" when none is close.
  std::string closest(std::string_view key) const;

  // Shortest text that reads back as the same double, always with a '.' or exponent ("1.0", "4.25e-04").
  static std::string format_float(double v);

 private:
  ConfigSchema& add_raw(const std::string& key, ConfigType type, std::string default_text, const std::string& help);
  std::vector<Key> keys_;
};

class Config {
 public:
  // Parses `text`; `source` names it in errors ("config FILE line N: ...").
  // Relative path values are resolved against base_dir (empty: left as written).
  static Config parse(std::string_view text, const ConfigSchema& schema, const std::string& source = "<config>",
                      const fs::path& base_dir = {});
  // parse() of the file, its path keys resolved against the file's folder.
  static Config load(const fs::path& path, const ConfigSchema& schema);
  // A config holding only the defaults.
  explicit Config(ConfigSchema schema) : schema_(std::move(schema)) {}

  // "key=value" from the command line.
  // "key=value" from the command line (a relative path value: against the working directory).
  void apply_override(std::string_view assignment);

  // The effective value (set, or the schema default). Throws when the key is not in the schema or the value
  // cannot be read as T (an int key read as double is fine).
  std::string get_string(std::string_view key) const;
  int64_t get_int(std::string_view key) const;
  double get_double(std::string_view key) const;
  bool get_bool(std::string_view key) const;
  // An integral T narrower than int64 is range-checked: a value outside T's range is an error naming the key, the
  // value, where it was set and the range (never a silent wrap-around, 2^40 read as 0).
  template <class T>
  T get(std::string_view key) const {
    if constexpr (std::is_same_v<T, bool>) {
      return get_bool(key);
    } else if constexpr (std::is_integral_v<T>) {
      const int64_t v = get_int(key);
      constexpr int64_t lo = std::is_signed_v<T> ? static_cast<int64_t>(std::numeric_limits<T>::min()) : 0;
      constexpr int64_t hi = static_cast<uint64_t>(std::numeric_limits<T>::max()) > uint64_t{INT64_MAX}
                                 ? INT64_MAX
                                 : static_cast<int64_t>(std::numeric_limits<T>::max());
      if (v < lo || v > hi) fail_out_of_range(key, v, lo, hi);
      return static_cast<T>(v);
    } else if constexpr (std::is_floating_point_v<T>) {
      return static_cast<T>(get_double(key));
    } else {
      return get_string(key);
    }
  }

  bool is_set(std::string_view key) const { return values_.count(std::string(key)) != 0; }
  // Values that were set (file or overrides), in the order first set.
  std::vector<std::pair<std::string, ConfigValue>> set_values() const;
  const ConfigSchema& schema() const { return schema_; }

  // Every schema key with its effective value, grouped by section, help as comments.
  std::string dump() const;

 private:
  const ConfigValue& value(std::string_view key) const;
  [[noreturn]] void fail_out_of_range(std::string_view key, int64_t v, int64_t lo, int64_t hi) const;
  void set(const std::string& key, ConfigValue v, const std::string& where, const fs::path& base_dir = {});

  ConfigSchema schema_;
  std::map<std::string, ConfigValue> values_;
  std::vector<std::string> order_;
};

}  // namespace nopad
