// Document splitting and the rule-based sentence splitter.
#include <gtest/gtest.h>

#include "core/io.h"
#include "data/documents.h"
#include "test_util.h"

namespace nopad {
namespace {

std::vector<std::string> S(const std::vector<std::string_view>& v) { return {v.begin(), v.end()}; }

TEST(Sentences, SplitsOnTerminatorsFollowedByCapitals) {
  EXPECT_EQ(S(split_sentences("The cat sat. The dog ran! Did it? Yes.")),
            (std::vector<std::string>{"The cat sat.", "The dog ran!", "Did it?", "Yes."}));
}

TEST(Sentences, KeepsAbbreviationsInitialsAndNumbers) {
  EXPECT_EQ(S(split_sentences("Mr. Smith met Dr. Jones in St. Louis. They talked.")),
            (std::vector<std::string>{"Mr. Smith met Dr. Jones in St. Louis.", "They talked."}));
  EXPECT_EQ(S(split_sentences("J. R. R. Tolkien wrote it in 1937. It sold well.")),
            (std::vector<std::string>{"J. R. R. Tolkien wrote it in 1937.", "It sold well."}));
  EXPECT_EQ(S(split_sentences("Pi is 3.14 roughly. E.g. this. Costs $2.50 each.")),
            (std::vector<std::string>{"Pi is 3.14 roughly.", "E.g. this.", "Costs $2.50 each."}));
  EXPECT_EQ(S(split_sentences("It was in the U.S. Army. He left.")),
            (std::vector<std::string>{"It was in the U.S. Army.", "He left."}));
}

TEST(Sentences, NoSplitBeforeLowerCaseOrInsideQuotes) {
  EXPECT_EQ(S(split_sentences("He said wait... and left. Then \"Go!\" She went.")),
            (std::vector<std::string>{"He said wait... and left.", "Then \"Go!\"", "She went."}));
  EXPECT_EQ(S(split_sentences("no terminator at all")), (std::vector<std::string>{"no terminator at all"}));
  EXPECT_TRUE(split_sentences("   ").empty());
}

TEST(Documents, WikiExtractorFormatDropsTagsAndTitles) {
  const std::string text =
      "<doc id=\"1\" url=\"u\" title=\"A\">\nA\n\nFirst para. Second sentence.\nAnother para.\n</doc>\n"
      "<doc id=\"2\" url=\"u\" title=\"B\">\nB\n\n</doc>\n"
      "<doc id=\"3\" url=\"u\" title=\"C\">\nC\n\nOnly one.\n</doc>\n";
  ASSERT_TRUE(looks_like_wikiextractor(text));
  const auto docs = split_documents(text, TextFormat::kAuto);
  ASSERT_EQ(docs.size(), 2u);  // the empty document is dropped
  EXPECT_EQ(S(docs[0].sentences), (std::vector<std::string>{"First para.", "Second sentence.", "Another para."}));
  EXPECT_EQ(S(docs[1].sentences), (std::vector<std::string>{"Only one."}));
}

TEST(Documents, SentencePerLineFormat) {
  const std::string text = "s1 a.\ns2 b.\n\n\ns3 c. Not split.\n";
  ASSERT_FALSE(looks_like_wikiextractor(text));
  const auto docs = split_documents(text, TextFormat::kAuto);
  ASSERT_EQ(docs.size(), 2u);
  EXPECT_EQ(S(docs[0].sentences), (std::vector<std::string>{"s1 a.", "s2 b."}));
  EXPECT_EQ(S(docs[1].sentences), (std::vector<std::string>{"s3 c. Not split."}));
}

TEST(Documents, WikiSampleHasItsArticles) {
  size_t docs = 0, sentences = 0;
  for (const char* f : {"wiki_00", "wiki_01", "wiki_02", "wiki_03"}) {
    const std::string text = read_file(test::wiki_sample_dir() / f);
    const auto d = split_documents(text, TextFormat::kAuto);
    docs += d.size();
    for (const auto& doc : d) sentences += doc.sentences.size();
  }
  // The sample holds 153 articles (data/README.md); a few may be empty once the title is dropped.
  EXPECT_GE(docs, 140u);
  EXPECT_LE(docs, 153u);
  EXPECT_GT(sentences, 20000u);
}

}  // namespace
}  // namespace nopad
