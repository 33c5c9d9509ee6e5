// Pre-training instance invariants on the real wiki sample: layout, segments, lengths, masking rates, NSP balance.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "core/error.h"
#include "core/io.h"
#include "core/threads.h"
#include "data/documents.h"
#include "data/instances.h"
#include "data/tokenizer.h"
#include "test_util.h"

namespace nopad {
namespace {

struct Corpus {
  Vocab vocab = Vocab::load(test::vocab_path());
  TokenizedCorpus corpus;
  Corpus() {
    const WordPieceTokenizer tok(vocab);
    for (const char* f : {"wiki_00", "wiki_01"}) {
      const std::string text = read_file(test::wiki_sample_dir() / f);
      for (const auto& d : split_documents(text, TextFormat::kAuto)) {
        std::vector<std::vector<int32_t>> sentences;
        for (auto s : d.sentences) sentences.push_back(tok.encode(s));
        corpus.add_document(sentences);
      }
    }
  }
};

const Corpus& corpus() {
  static const Corpus c;
  return c;
}

std::vector<Instance> make_all(const InstanceOptions& opt) {
  const Corpus& c = corpus();
  std::vector<Instance> all;
  for (int dupe = 0; dupe < opt.dupe_factor; ++dupe)
    for (size_t d = 0; d < c.corpus.num_docs(); ++d) {
      Rng rng({opt.seed, static_cast<uint64_t>(dupe), d});
      auto v = create_instances_from_document(c.corpus, d, c.vocab, opt, rng);
      for (auto& i : v) all.push_back(std::move(i));
    }
  return all;
}

// |observed - expected| within `sigmas` standard deviations of a binomial proportion.
void expect_rate(uint64_t hits, uint64_t n, double p, double sigmas, const char* what) {
  ASSERT_GT(n, 0u);
  const double rate = static_cast<double>(hits) / static_cast<double>(n);
  const double sd = std::sqrt(p * (1 - p) / static_cast<double>(n));
  EXPECT_NEAR(rate, p, sigmas * sd) << what << ": " << hits << " of " << n;
}

TEST(Instances, LayoutSegmentsAndLengths) {
  InstanceOptions opt;
  opt.dupe_factor = 2;
  const auto all = make_all(opt);
  ASSERT_GT(all.size(), 1000u);
  const SpecialIds& sp = corpus().vocab.special();
  size_t short_ones = 0;
  for (const Instance& inst : all) {
    const auto n = static_cast<int32_t>(inst.tokens.size());
    ASSERT_LE(n, opt.max_seq_length);
    ASSERT_GE(n, 5);
    if (n < opt.max_seq_length / 2) ++short_ones;
    // [CLS] A [SEP] B [SEP]: exactly three specials where they belong, before masking could touch anything else.
    EXPECT_EQ(inst.tokens[0], sp.cls);
    EXPECT_EQ(inst.tokens[static_cast<size_t>(inst.a_length) - 1], sp.sep);
    EXPECT_EQ(inst.tokens.back(), sp.sep);
    EXPECT_GE(inst.a_length, 3);          // [CLS] + at least one A token + [SEP]
    EXPECT_LE(inst.a_length, n - 2);      // at least one B token + [SEP]
    EXPECT_TRUE(inst.nsp_label == 0 || inst.nsp_label == 1);
  }
  // short_seq_prob = 0.1 plus documents that end early: some, not most, instances are short.
  EXPECT_GT(short_ones, all.size() / 20);
  EXPECT_LT(short_ones, all.size() / 2);
}

TEST(Instances, MaskingCountsRatesAndSpecials) {
  InstanceOptions opt;
  opt.dupe_factor = 2;
  const auto all = make_all(opt);
  const Vocab& vocab = corpus().vocab;
  const SpecialIds& sp = vocab.special();
  uint64_t masked = 0, as_mask = 0, kept = 0, random_next = 0;
  for (const Instance& inst : all) {
    const size_t n = inst.tokens.size();
    const size_t expect = std::min<size_t>(76, std::max<size_t>(1, static_cast<size_t>(std::nearbyint(0.15 * n))));
    ASSERT_EQ(inst.mlm_positions.size(), expect);
    ASSERT_EQ(inst.mlm_labels.size(), expect);
    ASSERT_LE(inst.mlm_positions.size(), 76u);
    std::set<int32_t> seen;
    for (size_t k = 0; k < inst.mlm_positions.size(); ++k) {
      const int32_t p = inst.mlm_positions[k], label = inst.mlm_labels[k];
      if (k > 0) {
        ASSERT_GT(p, inst.mlm_positions[k - 1]);
      }
      // Specials are never picked: not the three structural positions, and no label is [CLS]/[SEP].
      ASSERT_NE(p, 0);
      ASSERT_NE(p, inst.a_length - 1);
      ASSERT_NE(p, static_cast<int32_t>(n) - 1);
      ASSERT_NE(label, sp.cls);
      ASSERT_NE(label, sp.sep);
      ++masked;
      if (inst.tokens[static_cast<size_t>(p)] == sp.mask) ++as_mask;
      else if (inst.tokens[static_cast<size_t>(p)] == label) ++kept;
    }
    random_next += static_cast<uint64_t>(inst.nsp_label);
  }
  // 80% [MASK], 10% unchanged (+ the 1/V chance a random token equals the original), 10% random. 5 sigma bounds.
  expect_rate(as_mask, masked, 0.8, 5, "[MASK] share");
  expect_rate(kept, masked, 0.1, 5, "unchanged share");
  expect_rate(masked - as_mask - kept, masked, 0.1, 5, "random share");
  // Masked share of all tokens ~ 15%.
  uint64_t tokens = 0;
  for (const Instance& inst : all) tokens += inst.tokens.size();
  EXPECT_NEAR(static_cast<double>(masked) / static_cast<double>(tokens), 0.15, 0.005);
  // Random next is 50% of the draws, plus the chunks of one sentence, which must take a random B.
  const double rn = static_cast<double>(random_next) / static_cast<double>(all.size());
  EXPECT_GT(rn, 0.47);
  EXPECT_LT(rn, 0.60);
}

TEST(Instances, DeterministicPerKeyAndSeedSensitive) {
  InstanceOptions opt;
  opt.dupe_factor = 1;
  const Corpus& c = corpus();
  Rng r1({opt.seed, 0, 3}), r2({opt.seed, 0, 3}), r3({opt.seed + 1, 0, 3});
  const auto a = create_instances_from_document(c.corpus, 3, c.vocab, opt, r1);
  const auto b = create_instances_from_document(c.corpus, 3, c.vocab, opt, r2);
  const auto d = create_instances_from_document(c.corpus, 3, c.vocab, opt, r3);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].tokens, b[i].tokens);
    EXPECT_EQ(a[i].mlm_positions, b[i].mlm_positions);
  }
  bool differs = a.size() != d.size();
  for (size_t i = 0; !differs && i < a.size(); ++i) differs = a[i].tokens != d[i].tokens;
  EXPECT_TRUE(differs);
}

TEST(Instances, ShortMaxLengthAndValidation) {
  InstanceOptions opt;
  opt.max_seq_length = 32;
  opt.max_predictions = 5;
  opt.dupe_factor = 1;
  const auto all = make_all(opt);
  ASSERT_FALSE(all.empty());
  for (const Instance& inst : all) {
    EXPECT_LE(inst.tokens.size(), 32u);
    EXPECT_LE(inst.mlm_positions.size(), 5u);
  }
  InstanceOptions bad;
  bad.masked_lm_prob = 1.5;
  EXPECT_THROW(bad.validate(), Error);
  bad = InstanceOptions{};
  bad.max_seq_length = 3;
  EXPECT_THROW(bad.validate(), Error);
}

}  // namespace
}  // namespace nopad
