// Parser, schema checks, typed getters and dump for nopad's TOML-subset training config (see config_file.h).
#include "train/config_file.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include "core/error.h"

namespace nopad {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

bool valid_name(std::string_view s) {
  if (s.empty() || s.front() == '.' || s.back() == '.') return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.')) return false;
  return true;
}

bool is_int_literal(std::string_view t) {
  size_t i = (!t.empty() && (t[0] == '-' || t[0] == '+')) ? 1 : 0;
  if (i == t.size()) return false;
  for (; i < t.size(); ++i)
    if (!std::isdigit(static_cast<unsigned char>(t[i]))) return false;
  return true;
}

bool parse_int(std::string_view t, int64_t* out) {
  if (!is_int_literal(t)) return false;
  if (t[0] == '+') t.remove_prefix(1);
  auto r = std::from_chars(t.data(), t.data() + t.size(), *out);
  return r.ec == std::errc() && r.ptr == t.data() + t.size();
}

bool parse_float(std::string_view t, double* out) {
  if (t.empty()) return false;
  bool digit = false;
  for (char c : t) {
    if (std::isdigit(static_cast<unsigned char>(c))) digit = true;
    else if (c != '.' && c != 'e' && c != 'E' && c != '+' && c != '-') return false;  // no inf/nan/hex
  }
  if (!digit) return false;
  if (t[0] == '+') t.remove_prefix(1);
  auto r = std::from_chars(t.data(), t.data() + t.size(), *out);
  return r.ec == std::errc() && r.ptr == t.data() + t.size() && std::isfinite(*out);
}

std::string quote(std::string_view s) {
  std::string q = "\"";
  for (char c : s) {
    if (c == '"') q += "\\\"";
    else if (c == '\\') q += "\\\\";
    else if (c == '\n') q += "\\n";
    else if (c == '\t') q += "\\t";
    else q += c;
  }
  return q + '"';
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string_view last_component(std::string_view k) {
  const size_t dot = k.rfind('.');
  return dot == std::string_view::npos ? k : k.substr(dot + 1);
}

// Parses one value. `where` prefixes errors; `key` names the key in them. With allow_bare (command-line
// overrides), an unquoted token that is not a number or boolean is a string, and '#' is not a comment.
ConfigValue parse_value(std::string_view raw, const std::string& where, const std::string& key, bool allow_bare) {
  std::string_view s = trim(raw);
  ConfigValue v;
  if (!s.empty() && s[0] == '"') {
    size_t i = 1;
    bool closed = false;
    for (; i < s.size(); ++i) {
      const char c = s[i];
      if (c == '"') {
        closed = true;
        ++i;
        break;
      }
      if (c == '\\') {
        NOPAD_CHECK(i + 1 < s.size(), where, ": unfinished escape at the end of the string for ", key);
        const char e = s[++i];
        if (e == '"') v.text += '"';
        else if (e == '\\') v.text += '\\';
        else if (e == 'n') v.text += '\n';
        else if (e == 't') v.text += '\t';
        else fail(where, ": unknown escape \\", e, " in the string for ", key, " (use \\\" \\\\ \\n or \\t)");
      } else {
        v.text += c;
      }
    }
    NOPAD_CHECK(closed, where, ": the string for ", key, " has no closing quote");
    const std::string_view rest = trim(s.substr(i));
    NOPAD_CHECK(rest.empty() || rest[0] == '#', where, ": unexpected text after the string for ", key, ": '", rest,
                "'");
    v.type = ConfigType::kString;
    return v;
  }
  if (!allow_bare) {
    const size_t hash = s.find('#');
    if (hash != std::string_view::npos) s = trim(s.substr(0, hash));
  }
  NOPAD_CHECK(!s.empty(), where, ": missing value for ", key);
  double d;
  v.text = std::string(s);
  if (s == "true" || s == "false") v.type = ConfigType::kBool;
  else if (is_int_literal(s)) v.type = ConfigType::kInt;
  else if (parse_float(s, &d)) v.type = ConfigType::kFloat;
  else if (allow_bare) v.type = ConfigType::kString;
  else fail(where, ": the value for ", key, " is not a quoted string, number or boolean: '", s,
            "' (write strings in quotes: ", last_component(key), " = \"", s, "\")");
  return v;
}

}  // namespace

const char* config_type_name(ConfigType t) {
  switch (t) {
    case ConfigType::kString: return "string";
    case ConfigType::kInt: return "integer";
    case ConfigType::kFloat: return "number";
    case ConfigType::kBool: return "boolean (true or false)";
  }
  return "?";
}

std::string ConfigSchema::format_float(double v) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), v);
  std::string s(buf, r.ptr);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

ConfigSchema& ConfigSchema::add_raw(const std::string& key, ConfigType type, std::string default_text,
                                    const std::string& help) {
  NOPAD_CHECK(valid_name(key), "config schema: invalid key name '", key, "'");
  NOPAD_CHECK(find(key) == nullptr, "config schema: key '", key, "' is declared twice");
  keys_.push_back({key, type, ConfigValue{type, std::move(default_text), "default"}, help});
  return *this;
}

const ConfigSchema::Key* ConfigSchema::find(std::string_view key) const {
  for (const Key& k : keys_)
    if (k.key == key) return &k;
  return nullptr;
}

std::string ConfigSchema::closest(std::string_view key) const {
  std::string best;
  size_t best_d = std::max<size_t>(2, key.size() / 3) + 1;
  for (const Key& k : keys_) {
    size_t d = edit_distance(key, k.key);
    if (last_component(k.key) == last_component(key)) d = std::min<size_t>(d, 1);  // right name, wrong section
    if (d < best_d) {
      best_d = d;
      best = k.key;
    }
  }
  return best;
}

void Config::set(const std::string& key, ConfigValue v, const std::string& where, const fs::path& base_dir) {
  const ConfigSchema::Key* k = schema_.find(key);
  if (k == nullptr) {
    const std::string near = schema_.closest(key);
    fail(where, ": unknown key '", key, "'", near.empty() ? std::string() : "; did you mean '" + near + "'?");
  }
  const bool bare_ok = v.source == "--set";
  switch (k->type) {
    case ConfigType::kString:
      // A command-line token like 123 or true is still a fine string for a string key.
      NOPAD_CHECK(v.type == ConfigType::kString || bare_ok, where, ": expected a quoted string for ", key, ", got ",
                  v.text, " (write ", last_component(key), " = \"", v.text, "\")");
      v.type = ConfigType::kString;
      if (k->is_path && !v.text.empty() && !base_dir.empty() && fs::path(v.text).is_relative())
        v.text = (base_dir / v.text).lexically_normal().string();
      break;
    case ConfigType::kInt:
      NOPAD_CHECK(v.type == ConfigType::kInt, where, ": expected an integer for ", key, ", got ",
                  v.type == ConfigType::kString ? quote(v.text) : v.text);
      int64_t i;
      NOPAD_CHECK(parse_int(v.text, &i), where, ": integer ", v.text, " for ", key,
                  " is out of range: it must be in [", INT64_MIN, ", ", INT64_MAX, "]");
      break;
    case ConfigType::kFloat:
      NOPAD_CHECK(v.type == ConfigType::kInt || v.type == ConfigType::kFloat, where, ": expected a number for ", key,
                  ", got ", v.type == ConfigType::kString ? quote(v.text) : v.text);
      double d;
      NOPAD_CHECK(parse_float(v.text, &d), where, ": number ", v.text, " for ", key, " is out of range");
      v.type = ConfigType::kFloat;
      break;
    case ConfigType::kBool:
      NOPAD_CHECK(v.type == ConfigType::kBool, where, ": expected true or false for ", key, ", got ",
                  v.type == ConfigType::kString ? quote(v.text) : v.text);
      break;
  }
  if (!values_.count(key)) order_.push_back(key);
  values_[key] = std::move(v);
}

Config Config::parse(std::string_view text, const ConfigSchema& schema, const std::string& source,
                     const fs::path& base_dir) {
  Config c(schema);
  std::string section;
  std::map<std::string, size_t> first_line;
  size_t line_no = 0;
  while (!text.empty() || line_no == 0) {
    const size_t nl = text.find('\n');
    const std::string_view line = trim(text.substr(0, nl));
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    ++line_no;
    const std::string where = "config " + source + " line " + std::to_string(line_no);
    if (line.empty() || line[0] == '#') {
      if (text.empty()) break;
      continue;
    }
    if (line[0] == '[') {
      const size_t close = line.find(']');
      NOPAD_CHECK(close != std::string_view::npos, where, ": section header without a closing ']'");
      const std::string_view rest = trim(line.substr(close + 1));
      NOPAD_CHECK(rest.empty() || rest[0] == '#', where, ": unexpected text after the section header: '", rest, "'");
      const std::string_view name = trim(line.substr(1, close - 1));
      NOPAD_CHECK(valid_name(name), where, ": invalid section name '", name,
                  "' (letters, digits, '_', '-' and '.'; arrays of tables are not supported)");
      section = std::string(name);
      continue;
    }
    const size_t eq = line.find('=');
    NOPAD_CHECK(eq != std::string_view::npos, where, ": expected 'key = value', '[section]' or a # comment, got '",
                line, "'");
    const std::string_view k = trim(line.substr(0, eq));
    NOPAD_CHECK(valid_name(k), where, ": invalid key '", k, "' (letters, digits, '_', '-' and '.')");
    const std::string key = section.empty() ? std::string(k) : section + "." + std::string(k);
    auto [it, fresh] = first_line.emplace(key, line_no);
    NOPAD_CHECK(fresh, where, ": ", key, " is set twice (first on line ", it->second, ")");
    ConfigValue v = parse_value(line.substr(eq + 1), where, key, false);
    v.source = source + " line " + std::to_string(line_no);
    c.set(key, std::move(v), where, base_dir);
    if (text.empty()) break;
  }
  return c;
}

Config Config::load(const fs::path& path, const ConfigSchema& schema) {
  return parse(read_file(path), schema, path.string(), fs::absolute(path).parent_path());
}

void Config::apply_override(std::string_view assignment) {
  const std::string where = "--set " + std::string(assignment);
  const size_t eq = assignment.find('=');
  NOPAD_CHECK(eq != std::string_view::npos, where, ": expected key=value (for example --set optim.lr=4.25e-4)");
  const std::string key(trim(assignment.substr(0, eq)));
  NOPAD_CHECK(valid_name(key), where, ": invalid key '", key, "'");
  if (trim(assignment.substr(eq + 1)).empty()) {  // key= : the empty string, for text keys (e.g. data.eval=)
    const ConfigSchema::Key* k = schema_.find(key);
    NOPAD_CHECK(k == nullptr || k->type == ConfigType::kString, where, ": missing value for ", key,
                " (only text keys can be set empty)");
    ConfigValue v;
    v.source = "--set";
    set(key, std::move(v), where);  // an unknown key fails here, naming the closest one
    return;
  }
  ConfigValue v = parse_value(assignment.substr(eq + 1), where, key, true);
  v.source = "--set";
  set(key, std::move(v), where, fs::current_path());
}

const ConfigValue& Config::value(std::string_view key) const {
  const ConfigSchema::Key* k = schema_.find(key);
  if (k == nullptr) {
    const std::string near = schema_.closest(key);
    fail("config: no key '", key, "' is declared", near.empty() ? std::string() : "; did you mean '" + near + "'?");
  }
  auto it = values_.find(k->key);
  return it == values_.end() ? k->default_value : it->second;
}

std::string Config::get_string(std::string_view key) const {
  const ConfigValue& v = value(key);
  NOPAD_CHECK(v.type == ConfigType::kString, "config: ", key, " is a ", config_type_name(v.type),
              ", not a string");
  return v.text;
}

int64_t Config::get_int(std::string_view key) const {
  const ConfigValue& v = value(key);
  int64_t i = 0;
  NOPAD_CHECK(v.type == ConfigType::kInt && parse_int(v.text, &i), "config: expected an integer for ", key,
              ", got ", v.text, " (", v.source, ")");
  return i;
}

void Config::fail_out_of_range(std::string_view key, int64_t v, int64_t lo, int64_t hi) const {
  fail("config: ", key, " = ", v, " (", value(key).source, ") is out of range: it must be in [", lo, ", ", hi, "]");
}

double Config::get_double(std::string_view key) const {
  const ConfigValue& v = value(key);
  double d = 0;
  NOPAD_CHECK((v.type == ConfigType::kInt || v.type == ConfigType::kFloat) && parse_float(v.text, &d),
              "config: expected a number for ", key, ", got ", v.text, " (", v.source, ")");
  return d;
}

bool Config::get_bool(std::string_view key) const {
  const ConfigValue& v = value(key);
  NOPAD_CHECK(v.type == ConfigType::kBool, "config: expected true or false for ", key, ", got ", v.text, " (",
              v.source, ")");
  return v.text == "true";
}

std::vector<std::pair<std::string, ConfigValue>> Config::set_values() const {
  std::vector<std::pair<std::string, ConfigValue>> out;
  for (const std::string& k : order_) out.emplace_back(k, values_.at(k));
  return out;
}

std::string Config::dump() const {
  // Sections in order of first declaration; top-level keys (no '.') first, as TOML requires.
  std::vector<std::string> sections;
  auto section_of = [](const std::string& k) {
    const size_t dot = k.rfind('.');
    return dot == std::string::npos ? std::string() : k.substr(0, dot);
  };
  sections.push_back("");
  for (const auto& k : schema_.keys()) {
    const std::string s = section_of(k.key);
    if (std::find(sections.begin(), sections.end(), s) == sections.end()) sections.push_back(s);
  }
  std::string out = "# nopad effective config (every known key; defaults included)\n";
  for (const std::string& s : sections) {
    bool header = false;
    for (const auto& k : schema_.keys()) {
      if (section_of(k.key) != s) continue;
      if (!header && !s.empty()) out += "\n[" + s + "]\n";
      header = true;
      const ConfigValue& v = value(k.key);
      if (!k.help.empty()) {
        std::string help = k.help;
        std::replace(help.begin(), help.end(), '\n', ' ');
        out += "# " + help + "\n";
      }
      out += std::string(last_component(k.key)) + " = ";
      switch (k.type) {
        case ConfigType::kString: out += quote(v.text); break;
        case ConfigType::kFloat: out += ConfigSchema::format_float(get_double(k.key)); break;
        default: out += v.text; break;
      }
      out += '\n';
    }
  }
  return out;
}

}  // namespace nopad
