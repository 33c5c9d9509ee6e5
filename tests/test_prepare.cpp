// nopad prepare end to end on the shipped wiki sample: determinism across thread counts, shards that read back,
// and bad inputs that fail cleanly without leaving files behind.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/crc32.h"
#include "core/error.h"
#include "core/io.h"
#include "data/dataset.h"
#include "data/prepare.h"
#include "data/stats.h"
#include "data/vocab.h"
#include "test_util.h"

namespace nopad {
namespace {

namespace fs = std::filesystem;

PrepareOptions sample_options(const fs::path& out, int threads) {
  PrepareOptions o;
  o.inputs = {test::wiki_sample_dir() / "wiki_00", test::wiki_sample_dir() / "wiki_01"};
  o.vocab = test::vocab_path();
  o.output = out;
  o.instances.dupe_factor = 2;
  o.threads = threads;
  o.seqs_per_shard = 1000;
  o.progress = false;
  return o;
}

TEST(Prepare, ByteIdenticalAcrossThreadCounts) {
  test::TempDir a("prep1"), b("prep3");
  const PrepareResult ra = prepare_dataset(sample_options(a.path(), 1));
  const PrepareResult rb = prepare_dataset(sample_options(b.path(), 3));
  EXPECT_EQ(ra.instances, rb.instances);
  ASSERT_GE(ra.shards, 2u);
  const auto fa = list_shards(a.path()), fb = list_shards(b.path());
  ASSERT_EQ(fa.size(), fb.size());
  for (size_t i = 0; i < fa.size(); ++i) {
    EXPECT_EQ(fa[i].filename(), fb[i].filename());
    EXPECT_TRUE(read_file(fa[i]) == read_file(fb[i])) << fa[i] << " differs from " << fb[i];
  }
  // A different seed gives different data.
  test::TempDir c("prepseed");
  auto oc = sample_options(c.path(), 2);
  oc.instances.seed = 7;
  prepare_dataset(oc);
  EXPECT_FALSE(read_file(list_shards(c.path())[0]) == read_file(fa[0]));
}

TEST(Prepare, ShardsReadBackWithManifestAndStats) {
  test::TempDir dir("prepread");
  const PrepareResult r = prepare_dataset(sample_options(dir.path(), 2));
  const Vocab vocab = Vocab::load(test::vocab_path());
  Dataset::Options dopt;
  dopt.expect_vocab_checksum = vocab.checksum();
  const Dataset ds(dir.path(), dopt);
  EXPECT_EQ(ds.size(), r.instances);
  EXPECT_EQ(ds.vocab_size(), 30522u);
  uint64_t tokens = 0, masked = 0;
  for (uint64_t i = 0; i < ds.size(); ++i) {
    const SampleRef s = ds.sample(i);
    tokens += s.length;
    masked += s.num_masked;
    ASSERT_EQ(s.token(0), vocab.special().cls);
    ASSERT_EQ(s.token(s.length - 1), vocab.special().sep);
    ASSERT_EQ(s.token(s.a_length - 1), vocab.special().sep);
  }
  EXPECT_EQ(tokens, r.instance_tokens);
  EXPECT_EQ(masked, r.masked);
  for (size_t s = 0; s < ds.num_shards(); ++s) ds.shard(s).validate_samples();

  const auto manifest = nlohmann::json::parse(read_file(dir / "dataset.json"));
  EXPECT_EQ(manifest["num_seqs"].get<uint64_t>(), r.instances);
  EXPECT_EQ(manifest["vocab_checksum"].get<uint32_t>(), vocab.checksum());
  EXPECT_EQ(manifest["num_shards"].get<uint64_t>(), r.shards);

  const DatasetStats st = compute_stats(ds, 512);
  EXPECT_EQ(st.num_seqs, r.instances);
  EXPECT_EQ(st.num_tokens, r.instance_tokens);
  EXPECT_LE(st.max_length, 512u);
  EXPECT_GT(st.padding_fraction(), 0.0);
  EXPECT_LT(st.padding_fraction(), 1.0);
  uint64_t hist_total = 0;
  for (uint64_t c : st.length_counts) hist_total += c;
  EXPECT_EQ(hist_total, st.num_seqs);
}

TEST(Prepare, RefusesToOverwriteUnlessAsked) {
  test::TempDir dir("prepover");
  auto o = sample_options(dir.path(), 2);
  o.inputs = {test::wiki_sample_dir() / "wiki_00"};
  prepare_dataset(o);
  const std::string before = read_file(list_shards(dir.path())[0]);
  EXPECT_THROW(prepare_dataset(o), Error);
  EXPECT_EQ(read_file(list_shards(dir.path())[0]), before);  // untouched
  o.overwrite = true;
  o.seqs_per_shard = 100000;  // fewer shards than before: stale ones must go
  prepare_dataset(o);
  EXPECT_EQ(list_shards(dir.path()).size(), 1u);
  // The new shards were staged and moved into place with their vocabulary: nothing else is left, and the manifest
  // describes them.
  for (const auto& e : fs::directory_iterator(dir.path()))
    EXPECT_TRUE(e.path().extension() == kShardExtension || e.path().filename() == "dataset.json" ||
                e.path().filename() == "vocab.txt") << e.path();
  EXPECT_EQ(Vocab::load(dir / "vocab.txt").checksum(), Vocab::load(o.vocab).checksum());
  const Dataset ds(dir.path());
  EXPECT_EQ(nlohmann::json::parse(read_file(dir / "dataset.json"))["num_seqs"].get<uint64_t>(), ds.size());
  // A shard lost since the manifest was written is reported, naming the manifest.
  o.seqs_per_shard = 300;
  prepare_dataset(o);
  const std::vector<fs::path> shards = list_shards(dir.path());
  ASSERT_GE(shards.size(), 2u);
  fs::remove(shards.back());
  try {
    const Dataset lost(dir.path());
    ADD_FAILURE() << "a dataset with a lost shard opened";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dataset.json lists " + std::to_string(shards.size()) + " shards"),
              std::string::npos) << e.what();
  }
}

TEST(Prepare, BadInputsFailCleanly) {
  test::TempDir dir("prepbad");
  const fs::path out = dir / "out";
  auto expect_error = [&](PrepareOptions o, const std::string& needle) {
    o.output = out;
    try {
      prepare_dataset(o);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(out)) << "a failed prepare left its new output folder behind";
  };
  // Non-UTF-8 text: the error names the file and the offset.
  write_file_atomic(dir / "latin1.txt", std::string("Caf\xe9 au lait.\n", 14));
  auto o = sample_options(out, 1);
  o.inputs = {dir / "latin1.txt"};
  expect_error(o, "offset 3");
  // Empty text.
  write_file_atomic(dir / "empty.txt", "\n\n  \n");
  o.inputs = {dir / "empty.txt"};
  expect_error(o, "contains no text");
  // Missing input.
  o.inputs = {dir / "nope.txt"};
  expect_error(o, "does not exist");
  // Vocabulary without [MASK].
  write_file_atomic(dir / "vocab.txt", "[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\n");
  o = sample_options(out, 1);
  o.vocab = dir / "vocab.txt";
  expect_error(o, "[MASK]");
  // Missing vocabulary.
  o.vocab = dir / "missing-vocab.txt";
  expect_error(o, "missing-vocab.txt");
}

// One line of a million characters without spaces (about 600,000 word pieces: short words between punctuation).
// Truncating the pair to max_seq_length took O(n^2) (62 s for this input); the instances must stay exactly what the
// token-by-token truncation gave (the shard's CRC-32 below is that of the quadratic version's output).
TEST(Prepare, MillionCharacterLineIsLinearAndUnchanged) {
  test::TempDir dir("preplong");
  std::string text = "Hello there.\n";
  const std::string_view pattern = "ab.cd,ef-gh;";
  while (text.size() < 1'000'013) text += pattern[text.size() % pattern.size()];
  text += "\nAnother line here.\n";
  write_file_atomic(dir / "long.txt", text);
  PrepareOptions o;
  o.inputs = {dir / "long.txt"};
  o.vocab = test::vocab_path();
  o.output = dir / "out";
  o.format = TextFormat::kSentenceLines;
  o.instances.max_seq_length = 128;
  o.instances.dupe_factor = 2;
  o.threads = 1;
  o.progress = false;
  const auto t0 = std::chrono::steady_clock::now();
  const PrepareResult r = prepare_dataset(o);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(seconds, 5.0) << "prepare of one 1M-character line took " << seconds << " s";
  EXPECT_GT(r.text_tokens, 500'000u);
  const std::string shard = read_file(list_shards(dir / "out").at(0));
  EXPECT_EQ(crc32(shard.data(), shard.size()), 1748319357u) << "the instances changed";

  // The same run as a WikiExtractor paragraph, through the sentence splitter as well.
  write_file_atomic(dir / "long.wiki", "<doc id=\"1\" url=\"u\" title=\"Long\">\nLong\n" + text + "</doc>\n");
  o.inputs = {dir / "long.wiki"};
  o.format = TextFormat::kWikiExtractor;
  o.overwrite = true;
  const auto t1 = std::chrono::steady_clock::now();
  prepare_dataset(o);
  const double wiki_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  EXPECT_LT(wiki_seconds, 5.0) << "prepare of a 1M-character paragraph took " << wiki_seconds << " s";
}

}  // namespace
}  // namespace nopad
