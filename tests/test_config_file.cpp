// Tests for the TOML-subset config: parsing, typed getters, schema errors with suggestions, overrides and dump.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "core/error.h"
#include "core/io.h"
#include "test_util.h"
#include "train/config_file.h"

namespace nopad {
namespace {

ConfigSchema test_schema() {
  ConfigSchema s;
  s.add("run_dir", std::string("runs/default"), "where checkpoints and logs go")
      .add("seed", 42, "random seed")
      .add("optim.lr", 4.25e-4, "base learning rate")
      .add("optim.kind", "lamb", "lamb or adamw")
      .add("optim.warmup_steps", 0, "linear warm-up steps")
      .add("optim.start_warmup_step", 0, "may be negative")
      .add("optim.bias_correction", true, "Adam bias correction")
      .add("data.max_seq_length", 512, "longest sequence");
  return s;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(ConfigFile, ParsesAllValueKinds) {
  const std::string text = R"(# a comment
run_dir = "out/a \"quoted\" dir\\x\n"   # trailing comment
seed = -1

[optim]
lr = 1e-4
kind = "adamw"
start_warmup_step = -4
bias_correction = false
warmup_steps = 10 # ten
)";
  const Config c = Config::parse(text, test_schema(), "t.toml");
  EXPECT_EQ(c.get_string("run_dir"), "out/a \"quoted\" dir\\x\n");
  EXPECT_EQ(c.get_int("seed"), -1);
  EXPECT_DOUBLE_EQ(c.get_double("optim.lr"), 1e-4);
  EXPECT_EQ(c.get<std::string>("optim.kind"), "adamw");
  EXPECT_EQ(c.get<int>("optim.start_warmup_step"), -4);
  EXPECT_FALSE(c.get_bool("optim.bias_correction"));
  EXPECT_EQ(c.get_int("optim.warmup_steps"), 10);
  EXPECT_EQ(c.get_int("data.max_seq_length"), 512);  // default
  EXPECT_FALSE(c.is_set("data.max_seq_length"));
  EXPECT_TRUE(c.is_set("optim.lr"));
  EXPECT_EQ(c.set_values().front().first, "run_dir");
}

TEST(ConfigFile, IntegerIsAcceptedForAFloatKey) {
  const Config c = Config::parse("[optim]\nlr = 1\n", test_schema());
  EXPECT_DOUBLE_EQ(c.get_double("optim.lr"), 1.0);
}

TEST(ConfigFile, ErrorsNameFileLineAndKey) {
  const ConfigSchema s = test_schema();
  auto err = [&](const std::string& text) { return error_of([&] { Config::parse(text, s, "x.toml"); }); };
  EXPECT_NE(err("[optim]\nlr = \"fast\"\n").find("config x.toml line 2: expected a number for optim.lr, got \"fast\""),
            std::string::npos)
      << err("[optim]\nlr = \"fast\"\n");
  EXPECT_NE(err("seed = 1.5\n").find("line 1: expected an integer for seed, got 1.5"), std::string::npos);
  EXPECT_NE(err("\n\n[optim]\nlrr = 1e-3\n").find("line 4: unknown key 'optim.lrr'; did you mean 'optim.lr'?"),
            std::string::npos)
      << err("\n\n[optim]\nlrr = 1e-3\n");
  EXPECT_NE(err("lr = 1e-3\n").find("did you mean 'optim.lr'?"), std::string::npos);  // right name, no section
  EXPECT_EQ(err("completely_unrelated_key_name = 1\n").find("did you mean"), std::string::npos);
  EXPECT_NE(err("run_dir = out/x\n").find("not a quoted string, number or boolean"), std::string::npos);
  EXPECT_NE(err("run_dir = \"open\n").find("no closing quote"), std::string::npos);
  EXPECT_NE(err("run_dir = \"a\\q\"\n").find("unknown escape"), std::string::npos);
  EXPECT_NE(err("seed = 1\nseed = 2\n").find("line 2: seed is set twice (first on line 1)"), std::string::npos);
  EXPECT_NE(err("[optim\n").find("closing ']'"), std::string::npos);
  EXPECT_NE(err("just words\n").find("expected 'key = value'"), std::string::npos);
  EXPECT_NE(err("seed =\n").find("missing value for seed"), std::string::npos);
  EXPECT_NE(err("[optim]\nbias_correction = 1\n").find("expected true or false"), std::string::npos);
  EXPECT_NE(err("seed = 99999999999999999999\n").find("out of range"), std::string::npos);
  EXPECT_NE(err("run_dir = 5\n").find("expected a quoted string for run_dir"), std::string::npos);
}

TEST(ConfigFile, OverridesUseTheSameRulesPlusBareStrings) {
  Config c = Config::parse("[optim]\nlr = 1e-4\n", test_schema());
  c.apply_override("optim.lr=4.25e-4");
  c.apply_override("run_dir=/tmp/x#y");
  c.apply_override("optim.kind=\"adamw\"");
  c.apply_override("seed=7");
  c.apply_override("optim.bias_correction=false");
  EXPECT_DOUBLE_EQ(c.get_double("optim.lr"), 4.25e-4);
  EXPECT_EQ(c.get_string("run_dir"), "/tmp/x#y");
  EXPECT_EQ(c.get_string("optim.kind"), "adamw");
  EXPECT_EQ(c.get_int("seed"), 7);
  EXPECT_FALSE(c.get_bool("optim.bias_correction"));
  c.apply_override("run_dir=123");  // a number is still a fine string for a string key
  EXPECT_EQ(c.get_string("run_dir"), "123");
  EXPECT_NE(error_of([&] { c.apply_override("optim.lr=fast"); }).find("expected a number for optim.lr, got \"fast\""),
            std::string::npos);
  EXPECT_NE(error_of([&] { c.apply_override("optim.lrate=1"); }).find("did you mean 'optim.lr'?"), std::string::npos);
  EXPECT_NE(error_of([&] { c.apply_override("seed"); }).find("expected key=value"), std::string::npos);
  // key= clears a text key; a number or flag cannot be empty; an unknown key is still named.
  c.apply_override("run_dir=");
  EXPECT_EQ(c.get_string("run_dir"), "");
  c.apply_override("run_dir=\"\"");
  EXPECT_EQ(c.get_string("run_dir"), "");
  EXPECT_NE(error_of([&] { c.apply_override("seed="); }).find("missing value for seed"), std::string::npos);
  EXPECT_NE(error_of([&] { c.apply_override("run_dirr="); }).find("did you mean 'run_dir'?"), std::string::npos);
}

TEST(ConfigFile, GettersRejectUnknownKeysAndWrongTypes) {
  const Config c(test_schema());
  EXPECT_EQ(c.get_string("run_dir"), "runs/default");
  EXPECT_DOUBLE_EQ(c.get_double("seed"), 42.0);  // an integer reads as a number
  EXPECT_NE(error_of([&] { c.get_int("optim.lr"); }).find("expected an integer for optim.lr"), std::string::npos);
  EXPECT_NE(error_of([&] { c.get_double("optim.lrr"); }).find("did you mean 'optim.lr'?"), std::string::npos);
  EXPECT_THROW(c.get_bool("seed"), Error);
}

// An integer read into a narrower type is range-checked, from a file and from --set: 2^40 read as an int was 0.
TEST(ConfigFile, NarrowIntegersAreRangeChecked) {
  const Config c = Config::parse("seed = 1099511627776\n[data]\nmax_seq_length = -3000000000\n", test_schema(),
                                 "run.toml");
  EXPECT_EQ(c.get<int64_t>("seed"), 1099511627776);
  const std::string msg = error_of([&] { c.get<int32_t>("seed"); });
  EXPECT_NE(msg.find("seed = 1099511627776 (run.toml line 1) is out of range: it must be in [-2147483648, 2147483647]"),
            std::string::npos) << msg;
  EXPECT_NE(error_of([&] { c.get<int>("data.max_seq_length"); }).find("line 3) is out of range"), std::string::npos);
  EXPECT_NE(error_of([&] { c.get<uint32_t>("data.max_seq_length"); }).find("must be in [0, 4294967295]"),
            std::string::npos);
  Config o(test_schema());
  o.apply_override("seed=1099511627776");
  EXPECT_NE(error_of([&] { o.get<int>("seed"); }).find("seed = 1099511627776 (--set) is out of range"),
            std::string::npos);
  o.apply_override("seed=-7");
  EXPECT_EQ(o.get<int>("seed"), -7);
  // Beyond 64 bits, parsing already refuses, naming the range.
  EXPECT_NE(error_of([&] { o.apply_override("seed=100000000000000000000"); })
                .find("is out of range: it must be in [-9223372036854775808, 9223372036854775807]"),
            std::string::npos);
  // A fraction for an integer key is refused.
  EXPECT_NE(error_of([&] { Config::parse("seed = 128.5\n", test_schema(), "run.toml"); })
                .find("expected an integer for seed, got 128.5"),
            std::string::npos);
}

TEST(ConfigFile, DumpRoundTrips) {
  Config c = Config::parse("seed = 3\n[optim]\nlr = 0.1\nkind = \"a \\\"b\\\" \\\\ c\\n\"\n", test_schema());
  c.apply_override("optim.start_warmup_step=-5");
  const std::string text = c.dump();
  EXPECT_NE(text.find("[optim]\n# base learning rate\nlr = 0.1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("[data]\n"), std::string::npos);
  EXPECT_LT(text.find("seed = 3"), text.find("[optim]"));  // top-level keys before any section
  const Config back = Config::parse(text, test_schema(), "dump");
  const ConfigSchema schema = test_schema();
  for (const auto& k : schema.keys()) {
    EXPECT_TRUE(back.is_set(k.key)) << k.key;  // the dump records every key
  }
  EXPECT_EQ(back.get_int("seed"), 3);
  EXPECT_DOUBLE_EQ(back.get_double("optim.lr"), 0.1);
  EXPECT_EQ(back.get_string("optim.kind"), "a \"b\" \\ c\n");
  EXPECT_EQ(back.get_int("optim.start_warmup_step"), -5);
  EXPECT_DOUBLE_EQ(back.get_double("optim.lr"), c.get_double("optim.lr"));
  EXPECT_TRUE(back.get_bool("optim.bias_correction"));
  EXPECT_EQ(back.dump(), text);
}

TEST(ConfigFile, FloatFormattingRoundTrips) {
  for (double v : {4.25e-4, 1e-4, 1.0, -1.0, 0.1, 1e20, 123456789.125}) {
    const std::string s = ConfigSchema::format_float(v);
    EXPECT_EQ(std::stod(s), v) << s;
    EXPECT_NE(s.find_first_of(".e"), std::string::npos) << s;
  }
}

TEST(ConfigFile, SchemaRejectsDuplicatesAndBadNames) {
  ConfigSchema s;
  s.add("a.b", 1, "");
  EXPECT_THROW(s.add("a.b", 2, ""), Error);
  EXPECT_THROW(s.add("bad key", 2, ""), Error);
}

// Path keys: a relative path in a config file is relative to the file's folder, one from --set to the working
// directory; both are stored absolute (so the run's config.toml says where everything was), absolute ones stay.
TEST(ConfigFile, PathKeysResolveAgainstTheConfigFolderAndTheWorkingDirectory) {
  test::TempDir tmp("cfgpaths");
  const std::filesystem::path dir = tmp.path() / "configs";
  std::filesystem::create_directories(dir);
  ConfigSchema s;
  s.add_path("run_dir", "", "out").add_path("model.config", "", "model").add_path("data.train", "", "data");
  s.add("name", "x", "a string that is not a path");
  write_file_atomic(dir / "run.toml", "run_dir = \"../out/run\"\nname = \"../not/a/path\"\n"
                                      "[model]\nconfig = \"/abs/bert.json\"\n[data]\ntrain = \"\"\n");
  Config c = Config::load(dir / "run.toml", s);
  EXPECT_EQ(std::filesystem::path(c.get_string("run_dir")), (tmp.path() / "out/run").lexically_normal());
  EXPECT_EQ(c.get_string("model.config"), "/abs/bert.json");
  EXPECT_EQ(c.get_string("name"), "../not/a/path");  // only path keys are resolved
  EXPECT_EQ(c.get_string("data.train"), "");         // empty stays empty ('' means "none")
  c.apply_override("data.train=shards/train");
  EXPECT_EQ(std::filesystem::path(c.get_string("data.train")),
            (std::filesystem::current_path() / "shards/train").lexically_normal());
  c.apply_override("run_dir=/elsewhere/run");
  EXPECT_EQ(c.get_string("run_dir"), "/elsewhere/run");
  // The dump (the run's config.toml) holds the absolute paths and reads back the same from any folder.
  const Config again = Config::parse(c.dump(), s, "dump");
  EXPECT_EQ(again.get_string("data.train"), c.get_string("data.train"));
  EXPECT_NE(c.dump().find((std::filesystem::current_path() / "shards/train").lexically_normal().string()),
            std::string::npos);
}

}  // namespace
}  // namespace nopad
