// Tests of the WordPiece tokenizer: golden cases checked by hand against Google BERT's tokenization.py semantics
// (uncased vocabulary), a synthetic vocabulary for the greedy longest-match rule, and a seeded fuzz loop over
// random bytes. Line-by-line parity on Wikipedia text is tests/python/test_tokenizer_parity.py.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "data/unicode.h"

namespace nopad {
namespace {

using Strings = std::vector<std::string>;

const Vocab& bert_vocab() {
  static const Vocab v = Vocab::load(NOPAD_SOURCE_DIR "/data/vocab/bert-uncased-vocab.txt");
  return v;
}

const WordPieceTokenizer& bert() {
  static const WordPieceTokenizer t(bert_vocab());
  return t;
}

TEST(TokenizerUnicode, DecodesValidAndReplacesInvalidUtf8) {
  auto decode_all = [](std::string_view s) {
    std::vector<uint32_t> cps;
    const auto* p = reinterpret_cast<const unsigned char*>(s.data());
    for (size_t i = 0; i < s.size();) i = unicode::decode_utf8(p, s.size(), i, cps.emplace_back());
    return cps;
  };
  EXPECT_EQ(decode_all("a\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80"), (std::vector<uint32_t>{'a', 0xE9, 0x20AC, 0x1F600}));
  // Lone continuation byte, 0xFF, overlong '/', surrogate half, above U+10FFFF: replaced; the next byte survives.
  EXPECT_EQ(decode_all("\x80x"), (std::vector<uint32_t>{0xFFFD, 'x'}));
  EXPECT_EQ(decode_all("\xFFx"), (std::vector<uint32_t>{0xFFFD, 'x'}));
  EXPECT_EQ(decode_all("\xC0\xAFx"), (std::vector<uint32_t>{0xFFFD, 0xFFFD, 'x'}));
  EXPECT_EQ(decode_all("\xE0\x80\xAFx"), (std::vector<uint32_t>{0xFFFD, 0xFFFD, 0xFFFD, 'x'}));
  EXPECT_EQ(decode_all("\xED\xA0\x80x"), (std::vector<uint32_t>{0xFFFD, 0xFFFD, 0xFFFD, 'x'}));
  EXPECT_EQ(decode_all("\xF4\x90\x80\x80"), (std::vector<uint32_t>(4, 0xFFFD)));
  // Truncated 3-byte sequence: one replacement for the valid prefix, then the interrupting character.
  EXPECT_EQ(decode_all("\xE2\x82x"), (std::vector<uint32_t>{0xFFFD, 'x'}));
  EXPECT_EQ(decode_all("\xE2\x82"), (std::vector<uint32_t>{0xFFFD}));
}

TEST(TokenizerUnicode, TableClasses) {
  EXPECT_TRUE(unicode::flags(0x00) & unicode::kDrop);
  EXPECT_TRUE(unicode::flags(0xFFFD) & unicode::kDrop);
  EXPECT_TRUE(unicode::flags(0x200B) & unicode::kDrop);  // zero width space is Cf
  EXPECT_TRUE(unicode::flags('\t') & unicode::kSpace);
  EXPECT_FALSE(unicode::flags('\t') & unicode::kDrop);
  EXPECT_TRUE(unicode::flags(0x3000) & unicode::kSpace);   // ideographic space, Zs
  EXPECT_TRUE(unicode::flags(0x2028) & unicode::kSpace);   // line separator: str.split() splits on it
  EXPECT_TRUE(unicode::flags('$') & unicode::kPunct);      // ASCII symbol range, though category Sc
  EXPECT_TRUE(unicode::flags(0x2014) & unicode::kPunct);   // em dash, Pd
  EXPECT_FALSE(unicode::flags(0x00A9) & unicode::kPunct);  // copyright sign, So
  EXPECT_TRUE(unicode::flags(0x0301) & unicode::kMn);
  EXPECT_TRUE(unicode::flags(0x00C9) & unicode::kMapped);
  EXPECT_FALSE(unicode::flags('a') & unicode::kMapped);
  EXPECT_TRUE(unicode::flags('A') & unicode::kCased);
  EXPECT_TRUE(unicode::flags('.') & unicode::kIgnorable);
  std::vector<uint32_t> out;
  unicode::append_lower_nfd(0x00C9, out);  // É -> e + combining acute
  EXPECT_EQ(out, (std::vector<uint32_t>{'e', 0x0301}));
  out.clear();
  unicode::append_lower_nfd(0xD55C, out);  // 한 -> ᄒ ᅡ ᆫ
  EXPECT_EQ(out, (std::vector<uint32_t>{0x1112, 0x1161, 0x11AB}));
  out.clear();
  unicode::append_lower_nfd(0x0130, out);  // İ -> i + combining dot above (full lower-case mapping)
  EXPECT_EQ(out, (std::vector<uint32_t>{'i', 0x0307}));
  EXPECT_EQ(unicode::combining_class(0x0301), 230);
  EXPECT_EQ(unicode::combining_class('a'), 0);
}

TEST(Tokenizer, PlainEnglishWithContinuations) {
  EXPECT_EQ(bert().pieces("Hello, World! Tokenization isn't hard."),
            (Strings{"hello", ",", "world", "!", "token", "##ization", "isn", "'", "t", "hard", "."}));
  EXPECT_EQ(bert().pieces("The unaffable Anarchists"),
            (Strings{"the", "una", "##ffa", "##ble", "anarchist", "##s"}));
}

TEST(Tokenizer, IdsAreVocabularyPositionsOfPieces) {
  const std::string text = "Anarchism is a political philosophy (1840s) -- see [citation needed].";
  const std::vector<int32_t> ids = bert().encode(text);
  const Strings pieces = bert().pieces(text);
  ASSERT_EQ(ids.size(), pieces.size());
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(ids[i], bert_vocab().find(pieces[i])) << pieces[i];
  // encode appends.
  std::vector<int32_t> out{7};
  bert().encode("hello", out);
  EXPECT_EQ(out, (std::vector<int32_t>{7, bert_vocab().find("hello")}));
}

TEST(Tokenizer, Punctuation) {
  EXPECT_EQ(bert().basic_tokens("a.b,c$d~e\xE2\x80\x94" "f\xC2\xBFg"),  // em dash, inverted question mark
            (Strings{"a", ".", "b", ",", "c", "$", "d", "~", "e", "\xE2\x80\x94", "f", "\xC2\xBF", "g"}));
  EXPECT_EQ(bert().basic_tokens("...!!"), (Strings{".", ".", ".", "!", "!"}));
  // The copyright sign is So, not punctuation: it stays inside the word.
  EXPECT_EQ(bert().basic_tokens("x\xC2\xA9y"), (Strings{"x\xC2\xA9y"}));
}

TEST(Tokenizer, AccentsAreStripped) {
  EXPECT_EQ(bert().basic_tokens("Caf\xC3\xA9 \xC3\x9Cn\xC3\xAF" "c\xC3\xB6" "d\xC3\xA9"), (Strings{"cafe", "unicode"}));
  // Already decomposed input gives the same.
  EXPECT_EQ(bert().basic_tokens("Cafe\xCC\x81"), (Strings{"cafe"}));
  EXPECT_EQ(bert().pieces("Caf\xC3\xA9"), (Strings{"cafe"}));
}

TEST(Tokenizer, CjkIdeographsAreSeparated) {
  // 我爱NLP。 -> 我 / 爱 / nlp / 。 (the ideographic full stop is punctuation)
  EXPECT_EQ(bert().basic_tokens("\xE6\x88\x91\xE7\x88\xB1NLP\xE3\x80\x82"),
            (Strings{"\xE6\x88\x91", "\xE7\x88\xB1", "nlp", "\xE3\x80\x82"}));
  // 我愛NLP: both ideographs are in the vocabulary; the simplified 爱 above is not, so it alone is [UNK].
  EXPECT_EQ(bert().pieces("\xE6\x88\x91\xE6\x84\x9BNLP"), (Strings{"\xE6\x88\x91", "\xE6\x84\x9B", "nl", "##p"}));
  EXPECT_EQ(bert().pieces("\xE6\x88\x91\xE7\x88\xB1NLP"), (Strings{"\xE6\x88\x91", "[UNK]", "nl", "##p"}));
  // Hiragana is not in the CJK ideograph ranges: ひらがな stays one word.
  EXPECT_EQ(bert().basic_tokens("\xE3\x81\xB2\xE3\x82\x89\xE3\x81\x8C\xE3\x81\xAA"),
            (Strings{"\xE3\x81\xB2\xE3\x82\x89\xE3\x81\x8B\xE3\x81\xAA"}));  // NFD + Mn drop: が -> か
}

TEST(Tokenizer, ControlCharactersAndWhitespace) {
  // \x01 and U+200B (Cf) are dropped without splitting; tabs, CR/LF, NBSP, U+3000 split.
  EXPECT_EQ(bert().basic_tokens("a\tb\x01" "c\xE2\x80\x8B" "d\r\ne\xC2\xA0" "f\xE3\x80\x80g"),
            (Strings{"a", "bcd", "e", "f", "g"}));
  EXPECT_EQ(bert().pieces("a\tb\x01" "c\xE2\x80\x8B" "d\r\ne"), (Strings{"a", "bc", "##d", "e"}));
  EXPECT_EQ(bert().basic_tokens(std::string_view("x\0y", 3)), (Strings{"xy"}));
  EXPECT_TRUE(bert().encode("").empty());
  EXPECT_TRUE(bert().encode(" \t\r\n \xE3\x80\x80 \xC2\xA0").empty());
  EXPECT_TRUE(bert().encode("\x01\x02\x7F").empty());
}

TEST(Tokenizer, LongAndUnmatchableWordsBecomeUnk) {
  const int32_t unk = bert_vocab().special().unk;
  EXPECT_EQ(bert().encode(std::string(101, 'a')), (std::vector<int32_t>{unk}));
  EXPECT_NE(bert().encode(std::string(100, 'a')), (std::vector<int32_t>{unk}));
  // The 100-character limit counts code points of the normalised word: 100 x "é" is 200 bytes but allowed.
  std::string e100;
  for (int i = 0; i < 100; ++i) e100 += "\xC3\xA9";
  EXPECT_NE(bert().encode(e100), (std::vector<int32_t>{unk}));
  EXPECT_EQ(bert().encode(e100 + "\xC3\xA9"), (std::vector<int32_t>{unk}));
  // The snowman is in no vocabulary piece: the whole word is [UNK], its neighbours are not affected.
  EXPECT_EQ(bert().pieces("go snow\xE2\x98\x83man now"), (Strings{"go", "[UNK]", "now"}));
}

TEST(Tokenizer, GreekFinalSigma) {
  // Python's str.lower(): a capital sigma after a cased letter and not before one becomes final sigma.
  EXPECT_EQ(bert().basic_tokens("\xCE\x9F\xCE\x94\xCE\xA5\xCE\xA3\xCE\xA3\xCE\x95\xCE\xA5\xCE\xA3"),  // ΟΔΥΣΣΕΥΣ
            (Strings{"\xCE\xBF\xCE\xB4\xCF\x85\xCF\x83\xCF\x83\xCE\xB5\xCF\x85\xCF\x82"}));        // οδυσσευς
  EXPECT_EQ(bert().pieces("\xCE\x9F\xCE\x94\xCE\xA5\xCE\xA3\xCE\xA3\xCE\x95\xCE\xA5\xCE\xA3"),
            (Strings{"\xCE\xBF", "##\xCE\xB4", "##\xCF\x85", "##\xCF\x83", "##\xCF\x83", "##\xCE\xB5", "##\xCF\x85",
                     "##\xCF\x82"}));  // ο ##δ ##υ ##σ ##σ ##ε ##υ ##ς
  // ΣΑΣ. -> σας / .  (the full stop is case-ignorable, so the sigma is still final)
  EXPECT_EQ(bert().basic_tokens("\xCE\xA3\xCE\x91\xCE\xA3."), (Strings{"\xCF\x83\xCE\xB1\xCF\x82", "."}));
  // A lone capital sigma has no cased letter before it: plain sigma.
  EXPECT_EQ(bert().basic_tokens("\xCE\xA3"), (Strings{"\xCF\x83"}));
  // Ά (with tonos) is cased; the tonos is stripped after lower-casing: ΆΣ -> ας
  EXPECT_EQ(bert().basic_tokens("\xCE\x86\xCE\xA3"), (Strings{"\xCE\xB1\xCF\x82"}));
  // A dropped control character does not hide the end of the word, a tab does: ΑΣ\x01 -> ας, ΑΣ\tΒ -> ας / β
  EXPECT_EQ(bert().basic_tokens("\xCE\x91\xCE\xA3\x01"), (Strings{"\xCE\xB1\xCF\x82"}));
  EXPECT_EQ(bert().basic_tokens("\xCE\x91\xCE\xA3\t\xCE\x92"), (Strings{"\xCE\xB1\xCF\x82", "\xCE\xB2"}));
  // Followed by a cased letter after ignorable ones: not final. ΑΣ'Β -> ασ / ' / β
  EXPECT_EQ(bert().basic_tokens("\xCE\x91\xCE\xA3'\xCE\x92"), (Strings{"\xCE\xB1\xCF\x83", "'", "\xCE\xB2"}));
}

TEST(Tokenizer, CanonicalReorderingBeforeMarksAreDropped) {
  // U+1D16D (Mc, class 226) before U+1D165 (Mc, class 216): NFD puts 216 first, also across a dropped U+0301
  // (Mn, class 230); a class-0 mark (U+0941, Mn) ends the run, so nothing moves across it.
  const std::string c216 = "\xF0\x9D\x85\xA5", c226 = "\xF0\x9D\x85\xAD";
  EXPECT_EQ(bert().basic_tokens("a" + c226 + c216), (Strings{"a" + c216 + c226}));
  EXPECT_EQ(bert().basic_tokens("a" + c226 + "\xCC\x81" + c216), (Strings{"a" + c216 + c226}));
  EXPECT_EQ(bert().basic_tokens("a" + c226 + "\xE0\xA5\x81" + c216), (Strings{"a" + c226 + c216}));
}

TEST(Tokenizer, HangulDecomposesToJamo) {
  // 한국어 -> ᄒ ᅡ ᆫ ᄀ ᅮ ᆨ ᄋ ᅥ
  const std::string jamo = "\xE1\x84\x92\xE1\x85\xA1\xE1\x86\xAB\xE1\x84\x80\xE1\x85\xAE\xE1\x86\xA8\xE1\x84\x8B"
                           "\xE1\x85\xA5";
  EXPECT_EQ(bert().basic_tokens("\xED\x95\x9C\xEA\xB5\xAD\xEC\x96\xB4"), (Strings{jamo}));
  const Strings p = bert().pieces("\xED\x95\x9C\xEA\xB5\xAD\xEC\x96\xB4");
  ASSERT_FALSE(p.empty());
  EXPECT_EQ(p[0], "\xE1\x84\x92");
  for (size_t i = 1; i < p.size(); ++i) EXPECT_EQ(p[i].substr(0, 2), "##");
}

TEST(Tokenizer, DottedCapitalI) {
  // İstanbul: lower() gives "i" + U+0307, NFD keeps it, the Mn is dropped -> istanbul
  EXPECT_EQ(bert().basic_tokens("\xC4\xB0stanbul"), (Strings{"istanbul"}));
  EXPECT_EQ(bert().pieces("\xC4\xB0stanbul"), (Strings{"istanbul"}));
}

TEST(Tokenizer, InvalidUtf8IsDropped) {
  EXPECT_EQ(bert().basic_tokens("a\x80" "b"), (Strings{"ab"}));
  EXPECT_EQ(bert().basic_tokens("x\xE2\x82"), (Strings{"x"}));
  EXPECT_EQ(bert().basic_tokens("\xE2\x82y z"), (Strings{"y", "z"}));
  EXPECT_EQ(bert().basic_tokens("\xFF"), Strings{});
  EXPECT_EQ(bert().basic_tokens("\xC0\xAF" "z"), (Strings{"z"}));  // overlong '/': not punctuation
  EXPECT_EQ(bert().basic_tokens("\xED\xA0\x80"), Strings{});       // encoded surrogate
  EXPECT_TRUE(bert().encode("\xFF\xFE\x80\xC0").empty());
}

TEST(Tokenizer, GreedyLongestMatchOnSmallVocabulary) {
  const Vocab v = Vocab::from_tokens({"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "un", "##aff", "##able", "a",
                                      "##b", "##bc", "##c"});
  const WordPieceTokenizer t(v);
  EXPECT_EQ(t.pieces("unaffable"), (Strings{"un", "##aff", "##able"}));
  EXPECT_EQ(t.pieces("abc"), (Strings{"a", "##bc"}));        // longest continuation first
  EXPECT_EQ(t.pieces("abcb"), (Strings{"a", "##bc", "##b"}));
  EXPECT_EQ(t.pieces("abd unaff"), (Strings{"[UNK]", "un", "##aff"}));
  EXPECT_EQ(t.pieces("b"), (Strings{"[UNK]"}));  // "##b" does not match at the start of a word
  const Vocab v2 = Vocab::from_tokens({"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "un", "unaff", "##aff",
                                       "##able"});
  EXPECT_EQ(WordPieceTokenizer(v2).pieces("unaffable"), (Strings{"unaff", "##able"}));
}

TEST(Tokenizer, CasedModeKeepsCaseAndAccents) {
  const WordPieceTokenizer cased(bert_vocab(), /*lower_case=*/false);
  EXPECT_EQ(cased.basic_tokens("Caf\xC3\xA9, OK"), (Strings{"Caf\xC3\xA9", ",", "OK"}));
}

TEST(Tokenizer, MoveKeepsWorking) {
  WordPieceTokenizer a(bert_vocab());
  WordPieceTokenizer b(std::move(a));
  EXPECT_EQ(b.pieces("Hello"), (Strings{"hello"}));
}

TEST(Tokenizer, FuzzRandomBytesNeverCrash) {
  std::mt19937_64 rng(12345);
  const int32_t n = bert_vocab().size();
  // Mix of uniform bytes and bytes drawn from interesting lead/continuation/ASCII sets.
  const unsigned char specials[] = {0x00, 0x09, 0x20, 0x2E, 0x41, 0x61, 0x7F, 0x80, 0xBF, 0xC0, 0xC2, 0xCE, 0xA3,
                                    0xE0, 0xE2, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF, 0xE4, 0xB8, 0xAD};
  size_t total = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    const size_t len = rng() % 64;
    std::string s(len, '\0');
    for (auto& c : s) {
      c = static_cast<char>((rng() & 1) ? specials[rng() % sizeof specials] : static_cast<unsigned char>(rng()));
    }
    const std::vector<int32_t> ids = bert().encode(s);
    total += ids.size();
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < n) << id;
    // Never more pieces than bytes: every piece covers at least one input character.
    ASSERT_LE(ids.size(), s.size());
  }
  EXPECT_GT(total, 0u);
}

}  // namespace
}  // namespace nopad
