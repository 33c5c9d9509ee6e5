// TensorFlow checkpoint import: CRC-32C, the reader on a checkpoint TensorFlow itself wrote
// (tests/data/tf-bert-checkpoint, made by scripts/make_tf_fixtures.py), the BERT name mapping against values
// numpy computed from the same source (expected.safetensors), the ways a path can name a checkpoint, and every
// corruption or mismatch as one clear error.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <functional>

#include "core/crc32.h"
#include "core/error.h"
#include "core/io.h"
#include "model/config.h"
#include "model/params.h"
#include "test_util.h"
#include "train/safetensors.h"
#include "train/tf_checkpoint.h"

namespace nopad {
namespace {

namespace fs = std::filesystem;

fs::path fixture_dir() { return test::source_dir() / "tests/data/tf-bert-checkpoint"; }
fs::path fixture_prefix() { return fixture_dir() / "model.ckpt-3"; }

using test::error_of;

// A copy of the fixture folder that a test may damage.
struct FixtureCopy {
  test::TempDir dir{"tfck"};
  FixtureCopy() {
    for (const auto& e : fs::directory_iterator(fixture_dir()))
      if (e.is_regular_file()) fs::copy_file(e.path(), dir / e.path().filename());
  }
  fs::path prefix() const { return dir / "model.ckpt-3"; }
  fs::path index() const { return dir / "model.ckpt-3.index"; }
  fs::path data() const { return dir / "model.ckpt-3.data-00000-of-00001"; }
};

std::string read_bytes(const fs::path& p) { return read_file(p); }
void write_bytes(const fs::path& p, const std::string& s) { std::ofstream(p, std::ios::binary) << s; }

uint64_t get_varint(const std::string& s, size_t& pos) {
  uint64_t v = 0;
  for (int shift = 0;; shift += 7) {
    const auto b = static_cast<uint8_t>(s.at(pos++));
    v |= static_cast<uint64_t>(b & 0x7F) << shift;
    if (!(b & 0x80)) return v;
  }
}

// The (offset, size) of the index table's index block, from its 48-byte footer.
std::pair<uint64_t, uint64_t> index_block_handle(const std::string& table) {
  size_t pos = table.size() - 48;
  get_varint(table, pos);
  get_varint(table, pos);
  const uint64_t off = get_varint(table, pos);
  return {off, get_varint(table, pos)};
}

BertConfig fixture_config() { return BertConfig::from_file((fixture_dir() / "bert_config.json").string()); }

TEST(Crc32c, KnownValuesMaskAndContinuation) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);  // the CRC-32C check value
  EXPECT_EQ(crc32c("", 0), 0u);
  const std::string text = "The quick brown fox jumps over the lazy dog, twice over the lazy dog.";
  EXPECT_EQ(crc32c(text.data() + 20, text.size() - 20, crc32c(text.data(), 20)), crc32c(text.data(), text.size()));
  EXPECT_NE(crc32c(text.data(), text.size()), crc32(text.data(), text.size()));  // a different polynomial
  EXPECT_EQ(crc32c_mask(0), 0xA282EAD8u);
  for (uint32_t v : {0u, 1u, 0xE3069283u, 0xFFFFFFFFu, 0x80000000u}) EXPECT_EQ(crc32c_unmask(crc32c_mask(v)), v);
}

TEST(TfCheckpoint, ReadsWhatTensorFlowWrote) {
  const TfCheckpoint ck(fixture_prefix());
  EXPECT_EQ(ck.num_shards(), 1);
  // 46 BERT variables, adam_m and adam_v for all but the word embeddings (45 x 2), global_step, two extras.
  EXPECT_EQ(ck.tensors().size(), 46u + 90u + 3u);
  for (size_t i = 1; i < ck.tensors().size(); ++i) EXPECT_LT(ck.tensors()[i - 1].name, ck.tensors()[i].name);

  const TfTensorEntry& emb = ck.at("bert/embeddings/word_embeddings");
  EXPECT_EQ(emb.dtype, DType::kF32);
  EXPECT_EQ(emb.shape, (std::vector<int64_t>{30522, 8}));
  EXPECT_EQ(emb.size, 30522u * 8 * 4);
  const TfTensorEntry& kernel = ck.at("bert/encoder/layer_1/intermediate/dense/kernel");
  EXPECT_EQ(kernel.shape, (std::vector<int64_t>{8, 16}));
  const TfTensorEntry& step = ck.at("global_step");
  EXPECT_EQ(step.dtype, DType::kI64);
  EXPECT_TRUE(step.shape.empty());
  EXPECT_EQ(step.numel, 1u);
  EXPECT_EQ(ck.at("extra/half").dtype, DType::kF16);
  EXPECT_EQ(ck.at("extra/bfloat16").dtype, DType::kBF16);
  EXPECT_EQ(ck.find("bert/no/such"), nullptr);
  NOPAD_EXPECT_ERROR_HAS(ck.at("bert/no/such"), "no tensor bert/no/such");

  // F16 and BF16 tensors against the values TensorFlow was given (rounded as TensorFlow rounded them).
  const SafetensorsFile expected(fixture_dir() / "expected.safetensors");
  EXPECT_EQ(ck.read_float("extra/half"), expected.read_float("extra.half"));
  EXPECT_EQ(ck.read_float("extra/bfloat16"), expected.read_float("extra.bfloat16"));
  // The first elements of the word embeddings: ((37 i + 101 k) mod 251 - 125) / 500 with k = 0.
  const std::vector<float> w = ck.read_float("bert/embeddings/word_embeddings");
  for (int i = 0; i < 8; ++i) EXPECT_EQ(w[static_cast<size_t>(i)], static_cast<float>((37 * i % 251 - 125) / 500.0));

  NOPAD_EXPECT_ERROR_HAS(ck.read_float("global_step"), "tensor global_step is int64, not a floating-point tensor");
  std::vector<float> small(3);
  NOPAD_EXPECT_ERROR_HAS(ck.read_float("extra/half", small.data(), small.size()), "has 15 elements, 3 were asked for");
}

TEST(TfCheckpoint, LoadsBertWeightsUnderHuggingFaceNames) {
  const BertConfig config = fixture_config();
  const ParamLayout layout(config);
  std::vector<float> params(layout.total_numel(), -7.0f);  // poison: every parameter must be overwritten
  const TfImportReport r = load_tf_bert_weights(fixture_prefix(), layout, params.data());
  EXPECT_EQ(r.loaded, layout.tensors().size());
  EXPECT_EQ(r.optimizer_slots, 90u);
  EXPECT_EQ(r.ignored, (std::vector<std::string>{"extra/bfloat16", "extra/half", "global_step"}));
  EXPECT_NE(r.summary().find("46 tensors loaded, 90 optimizer slots left out, 3 other tensors left out "
                             "(extra/bfloat16, extra/half, global_step)"),
            std::string::npos)
      << r.summary();

  const SafetensorsFile expected(fixture_dir() / "expected.safetensors");
  for (const ParamTensor& t : layout.tensors()) {
    SCOPED_TRACE(t.name);
    const std::vector<float> want = expected.read_float(t.name);
    ASSERT_EQ(want.size(), t.numel);
    EXPECT_TRUE(std::equal(want.begin(), want.end(), params.begin() + static_cast<std::ptrdiff_t>(t.offset)));
  }
}

TEST(TfCheckpoint, TensorFlowNamesOfTheParameters) {
  auto is = [](const std::string& hf, const std::string& tf, bool transposed) {
    const TfVariableName v = tf_variable_for(hf);
    EXPECT_EQ(v.name, tf) << hf;
    EXPECT_EQ(v.transposed, transposed) << hf;
  };
  is("bert.embeddings.word_embeddings.weight", "bert/embeddings/word_embeddings", false);
  is("bert.embeddings.position_embeddings.weight", "bert/embeddings/position_embeddings", false);
  is("bert.embeddings.LayerNorm.weight", "bert/embeddings/LayerNorm/gamma", false);
  is("bert.embeddings.LayerNorm.bias", "bert/embeddings/LayerNorm/beta", false);
  is("bert.encoder.layer.23.attention.self.query.weight", "bert/encoder/layer_23/attention/self/query/kernel", true);
  is("bert.encoder.layer.0.attention.self.value.bias", "bert/encoder/layer_0/attention/self/value/bias", false);
  is("bert.encoder.layer.7.attention.output.LayerNorm.bias", "bert/encoder/layer_7/attention/output/LayerNorm/beta",
     false);
  is("bert.encoder.layer.10.intermediate.dense.weight", "bert/encoder/layer_10/intermediate/dense/kernel", true);
  is("bert.encoder.layer.1.output.dense.weight", "bert/encoder/layer_1/output/dense/kernel", true);
  is("bert.pooler.dense.weight", "bert/pooler/dense/kernel", true);
  is("cls.predictions.bias", "cls/predictions/output_bias", false);
  is("cls.predictions.transform.dense.weight", "cls/predictions/transform/dense/kernel", true);
  is("cls.predictions.transform.LayerNorm.weight", "cls/predictions/transform/LayerNorm/gamma", false);
  is("cls.seq_relationship.weight", "cls/seq_relationship/output_weights", false);
  is("cls.seq_relationship.bias", "cls/seq_relationship/output_bias", false);
}

TEST(TfCheckpoint, APathMayNameThePrefixTheIndexOrTheFolder) {
  EXPECT_EQ(resolve_tf_checkpoint(fixture_prefix()), fixture_prefix());
  EXPECT_EQ(resolve_tf_checkpoint(fixture_dir() / "model.ckpt-3.index"), fixture_prefix());
  EXPECT_EQ(resolve_tf_checkpoint(fixture_dir()), fixture_prefix());  // through its `checkpoint` file
  EXPECT_TRUE(resolve_tf_checkpoint(fixture_dir() / "model.ckpt-4").empty());
  EXPECT_TRUE(resolve_tf_checkpoint(fixture_dir() / "expected.safetensors").empty());
  EXPECT_TRUE(resolve_tf_checkpoint(test::source_dir() / "data/configs").empty());
  NOPAD_EXPECT_ERROR_HAS(TfCheckpoint(fixture_dir() / "model.ckpt-4"),
                         "TensorFlow checkpoint " + (fixture_dir() / "model.ckpt-4").string() + ": not found");

  FixtureCopy copy;
  // A `checkpoint` file with the absolute path the folder was saved under elsewhere: the name is found here.
  write_bytes(copy.dir / "checkpoint", "model_checkpoint_path: \"/elsewhere/run7/model.ckpt-3\"\n");
  EXPECT_EQ(resolve_tf_checkpoint(copy.dir.path()), copy.prefix());
  // No `checkpoint` file: the folder's only .index.
  fs::remove(copy.dir / "checkpoint");
  EXPECT_EQ(resolve_tf_checkpoint(copy.dir.path()), copy.prefix());
  fs::copy_file(copy.index(), copy.dir / "model.ckpt-9.index");
  EXPECT_TRUE(resolve_tf_checkpoint(copy.dir.path()).empty());  // two: ambiguous
  // TensorFlow writes model_checkpoint_path first; the key is matched at the start of a line, in any order.
  write_bytes(copy.dir / "checkpoint",
              "all_model_checkpoint_paths: \"model.ckpt-9\"\n  model_checkpoint_path: \"model.ckpt-3\"\n");
  EXPECT_EQ(resolve_tf_checkpoint(copy.dir.path()), copy.prefix());
  write_bytes(copy.dir / "checkpoint", "all_model_checkpoint_paths: \"x\"\n");
  NOPAD_EXPECT_ERROR_HAS(resolve_tf_checkpoint(copy.dir.path()), "no model_checkpoint_path line");
}

TEST(TfCheckpoint, EveryCorruptionIsAClearError) {
  const BertConfig config = fixture_config();
  const ParamLayout layout(config);
  std::vector<float> params(layout.total_numel());
  {
    SCOPED_TRACE("a flipped bit in a tensor's bytes");
    FixtureCopy c;
    const TfTensorEntry e = TfCheckpoint(c.prefix()).at("bert/encoder/layer_0/attention/self/key/kernel");
    std::string d = read_bytes(c.data());
    d[e.offset + 5] ^= 0x10;
    write_bytes(c.data(), d);
    NOPAD_EXPECT_ERROR_HAS(load_tf_bert_weights(c.prefix(), layout, params.data()),
                           "tensor bert/encoder/layer_0/attention/self/key/kernel in " + c.data().string() +
                               " does not match its checksum");
  }
  {
    SCOPED_TRACE("a truncated data file");
    FixtureCopy c;
    const std::string d = read_bytes(c.data());
    write_bytes(c.data(), d.substr(0, d.size() / 2));
    NOPAD_EXPECT_ERROR_HAS(TfCheckpoint(c.prefix()), "runs past the end of the file");
  }
  {
    SCOPED_TRACE("a missing data file");
    FixtureCopy c;
    fs::remove(c.data());
    NOPAD_EXPECT_ERROR_HAS(TfCheckpoint(c.prefix()), "data file " + c.data().string() + " is missing");
  }
  {
    SCOPED_TRACE("a flipped bit in the index's first data block");
    FixtureCopy c;
    std::string t = read_bytes(c.index());
    t[12] ^= 0x01;
    write_bytes(c.index(), t);
    NOPAD_EXPECT_ERROR_HAS(TfCheckpoint(c.prefix()), "the data block at byte 0 does not match its checksum");
  }
  {
    SCOPED_TRACE("not a table");
    FixtureCopy c;
    write_bytes(c.index(), std::string(100, 'x'));
    NOPAD_EXPECT_ERROR_HAS(TfCheckpoint(c.prefix()), c.index().string() + ": not a TensorFlow checkpoint index");
    write_bytes(c.index(), "short");
    NOPAD_EXPECT_ERROR_HAS(TfCheckpoint(c.prefix()), "too short for a checkpoint index");
  }
  {
    SCOPED_TRACE("a snappy-compressed block (TensorFlow before 1.2)");
    FixtureCopy c;
    std::string t = read_bytes(c.index());
    const auto [off, size] = index_block_handle(t);
    t[off + size] = 1;  // the block's compression type, then a checksum that covers it
    const uint32_t masked = crc32c_mask(crc32c(t.data() + off, size + 1));
    std::memcpy(t.data() + off + size + 1, &masked, 4);
    write_bytes(c.index(), t);
    NOPAD_EXPECT_ERROR_HAS(TfCheckpoint(c.prefix()), "is snappy-compressed");
  }
}

TEST(TfCheckpoint, AnObjectBasedCheckpointIsRefusedWithAReason) {
  // What tf.train.Checkpoint (Keras) writes: names after the Python objects, and a string tensor of the object graph.
  const fs::path p = fixture_dir() / "object-based" / "ckpt";
  const TfCheckpoint ck(p);
  ASSERT_NE(ck.find("_CHECKPOINTABLE_OBJECT_GRAPH"), nullptr);
  EXPECT_FALSE(ck.at("_CHECKPOINTABLE_OBJECT_GRAPH").known_dtype);  // a string: listed, never read
  NOPAD_EXPECT_ERROR_HAS(ck.read_float("_CHECKPOINTABLE_OBJECT_GRAPH"), "is string, not a floating-point tensor");
  EXPECT_EQ(ck.read_float("model/kernel/.ATTRIBUTES/VARIABLE_VALUE"), std::vector<float>(6, 0.5f));
  const ParamLayout layout(fixture_config());
  std::vector<float> params(layout.total_numel());
  NOPAD_EXPECT_ERROR_HAS(load_tf_bert_weights(p, layout, params.data()), "this is an object-based checkpoint");
}

TEST(TfCheckpoint, AModelConfigThatDoesNotFitIsAClearError) {
  auto load_with = [](const std::function<void(BertConfig&)>& change) {
    BertConfig config = fixture_config();
    change(config);
    const ParamLayout layout(config);
    std::vector<float> params(layout.total_numel());
    load_tf_bert_weights(fixture_prefix(), layout, params.data());
  };
  const std::string where = "TensorFlow checkpoint " + fixture_prefix().string() + ": ";
  NOPAD_EXPECT_ERROR_HAS(load_with([](BertConfig& c) { c.intermediate_size = 32; }),
                         where +
                             "variable bert/encoder/layer_0/intermediate/dense/kernel has shape [8, 16], the model "
                             "(model.config) expects [8, 32] (TensorFlow kernels are stored [in, out])");
  NOPAD_EXPECT_ERROR_HAS(load_with([](BertConfig& c) { c.vocab_size = 30528; }),
                         where +
                             "variable bert/embeddings/word_embeddings has shape [30522, 8], the model (model.config) "
                             "expects [30528, 8]");
  NOPAD_EXPECT_ERROR_HAS(load_with([](BertConfig& c) { c.num_hidden_layers = 3; }),
                         where +
                             "variable bert/encoder/layer_2/attention/self/query/kernel "
                             "(bert.encoder.layer.2.attention.self.query.weight) is missing");
  NOPAD_EXPECT_ERROR_HAS(load_with([](BertConfig& c) { c.num_hidden_layers = 1; }),
                         where +
                             "variable bert/encoder/layer_1/attention/output/LayerNorm/beta is not a parameter of the "
                             "model in model.config");
}

}  // namespace
}  // namespace nopad
