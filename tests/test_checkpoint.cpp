// Checkpoints: round trip, Hugging Face names and shapes, every corruption detected with a clear error, crash
// safety of the write protocol, retention, and Hugging Face weight import (init_from).
#include <gtest/gtest.h>

#include <fstream>

#include "core/error.h"
#include "model/params.h"
#include "optim/optimizer.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/safetensors.h"

namespace nopad {
namespace {

namespace fs = std::filesystem;

BertConfig small_config() {
  BertConfig c;
  c.hidden_size = 16;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.intermediate_size = 32;
  c.vocab_size = 50;
  c.max_position_embeddings = 24;
  return c;
}

// Parameters, gradients and an optimizer that has taken two steps (non-zero moments).
struct Fixture {
  BertConfig config = small_config();
  ParamLayout layout{config};
  std::vector<float> params, grads;
  std::unique_ptr<Optimizer> opt;
  TrainerState state;

  Fixture() {
    params.resize(layout.total_numel());
    grads.resize(layout.total_numel());
    initialize_params(layout, config, 7, params.data());
    for (size_t i = 0; i < grads.size(); ++i) grads[i] = 0.01f * static_cast<float>((i * 37) % 11) - 0.05f;
    std::vector<ParamView> views;
    for (const auto& t : layout.tensors())
      views.push_back({t.name, params.data() + t.offset, grads.data() + t.offset, t.numel, t.no_weight_decay});
    opt = make_optimizer("lamb", views, {});
    opt->step(1e-3);
    opt->step(1e-3);
    state.step = 100;
    state.samples = 3200;
    state.cursor = {2, 640};
    state.seed = 99;
    state.optimizer = "lamb";
    state.optimizer_steps = 2;
    state.lr = 5e-4;
    state.schedule_steps = 100;
  }
  fs::path write(const fs::path& run, int64_t step, const CheckpointWriteOptions& o = {}) {
    state.step = step;
    return write_checkpoint(run, config, layout, params.data(), opt.get(), state, o);
  }
};

using test::error_of;

TEST(Checkpoint, RoundTripParamsOptimizerCursor) {
  test::TempDir dir("ckpt");
  Fixture f;
  const fs::path ck = f.write(dir.path(), 100);
  EXPECT_EQ(ck.filename(), "step_00000100");
  EXPECT_EQ(latest_checkpoint(dir.path()), ck);
  for (const char* name : {"model.safetensors", "config.json", "optimizer.safetensors", "trainer_state.json"})
    EXPECT_TRUE(fs::exists(ck / name)) << name;

  const LoadedCheckpoint l = load_checkpoint(ck, &f.config);
  EXPECT_EQ(l.params, f.params);
  EXPECT_EQ(l.state.step, 100);
  EXPECT_EQ(l.state.samples, 3200u);
  EXPECT_EQ(l.state.cursor, (Cursor{2, 640}));
  EXPECT_EQ(l.state.seed, 99u);
  EXPECT_EQ(l.state.lr, 5e-4);
  EXPECT_EQ(l.optimizer_kind, "lamb");
  EXPECT_EQ(l.optimizer_steps, 2);
  const auto saved = f.opt->state_tensors();
  ASSERT_EQ(l.optimizer_names.size(), saved.size());
  size_t matched = 0;
  for (const StateTensor& s : saved) {
    for (size_t i = 0; i < l.optimizer_names.size(); ++i) {
      if (l.optimizer_names[i] != s.name) continue;
      ASSERT_EQ(l.optimizer_data[i].size(), s.numel);
      EXPECT_TRUE(std::equal(s.data, s.data + s.numel, l.optimizer_data[i].begin())) << s.name;
      ++matched;
    }
  }
  EXPECT_EQ(matched, saved.size());

  // The loaded state restores into a fresh optimizer.
  Fixture g;
  g.opt->load_state(l.optimizer_steps, l.optimizer_state());
  EXPECT_EQ(g.opt->step_count(), 2);
}

// Every tensor of Hugging Face's BertForPreTraining state dict for bert-tiny (2 layers, H 128, FFN 512), except the
// tied aliases cls.predictions.decoder.weight (= word embeddings) and cls.predictions.decoder.bias
// (= cls.predictions.bias) that save_pretrained does not write.
TEST(Checkpoint, TensorNamesAndShapesMatchHuggingFaceBertTiny) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> expected = {
      {"bert.embeddings.word_embeddings.weight", {30522, 128}},
      {"bert.embeddings.position_embeddings.weight", {512, 128}},
      {"bert.embeddings.token_type_embeddings.weight", {2, 128}},
      {"bert.embeddings.LayerNorm.weight", {128}},
      {"bert.embeddings.LayerNorm.bias", {128}},
  };
  for (int l = 0; l < 2; ++l) {
    const std::string p = "bert.encoder.layer." + std::to_string(l) + ".";
    for (const char* qkv : {"query", "key", "value"}) {
      expected.push_back({p + "attention.self." + qkv + ".weight", {128, 128}});
      expected.push_back({p + "attention.self." + qkv + ".bias", {128}});
    }
    expected.push_back({p + "attention.output.dense.weight", {128, 128}});
    expected.push_back({p + "attention.output.dense.bias", {128}});
    expected.push_back({p + "attention.output.LayerNorm.weight", {128}});
    expected.push_back({p + "attention.output.LayerNorm.bias", {128}});
    expected.push_back({p + "intermediate.dense.weight", {512, 128}});
    expected.push_back({p + "intermediate.dense.bias", {512}});
    expected.push_back({p + "output.dense.weight", {128, 512}});
    expected.push_back({p + "output.dense.bias", {128}});
    expected.push_back({p + "output.LayerNorm.weight", {128}});
    expected.push_back({p + "output.LayerNorm.bias", {128}});
  }
  for (const auto& e : std::vector<std::pair<std::string, std::vector<int64_t>>>{
           {"bert.pooler.dense.weight", {128, 128}},
           {"bert.pooler.dense.bias", {128}},
           {"cls.predictions.bias", {30522}},
           {"cls.predictions.transform.dense.weight", {128, 128}},
           {"cls.predictions.transform.dense.bias", {128}},
           {"cls.predictions.transform.LayerNorm.weight", {128}},
           {"cls.predictions.transform.LayerNorm.bias", {128}},
           {"cls.seq_relationship.weight", {2, 128}},
           {"cls.seq_relationship.bias", {2}}})
    expected.push_back(e);
  ASSERT_EQ(expected.size(), 46u);  // 39 under bert. + 7 under cls.

  test::TempDir dir("ckpt-hf");
  const BertConfig tiny = BertConfig::from_file(test::source_dir() / "data/configs/bert-tiny.json");
  const ParamLayout layout(tiny);
  std::vector<float> params(layout.total_numel(), 0.5f);
  TrainerState st;
  const fs::path ck = write_checkpoint(dir.path(), tiny, layout, params.data(), nullptr, st);
  const SafetensorsFile file(ck / "model.safetensors");
  EXPECT_EQ(file.metadata().at("format"), "pt");
  ASSERT_EQ(file.tensors().size(), expected.size());
  for (const auto& [name, shape] : expected) {
    const SafetensorsEntry* e = file.find(name);
    ASSERT_NE(e, nullptr) << name;
    EXPECT_EQ(e->shape, shape) << name;
    EXPECT_EQ(e->dtype, DType::kF32) << name;
  }
  const nlohmann::json cfg = nlohmann::json::parse(read_file(ck / "config.json"));
  EXPECT_EQ(cfg.at("model_type"), "bert");
  EXPECT_EQ(cfg.at("architectures"), nlohmann::json::array({"BertForPreTraining"}));
}

TEST(Checkpoint, EveryCorruptionIsAClearError) {
  test::TempDir dir("ckpt-bad");
  Fixture f;
  const fs::path ck = f.write(dir.path(), 5);
  const fs::path pristine = dir / "pristine";
  fs::copy(ck, pristine);
  auto restore = [&] {
    fs::remove_all(ck);
    fs::copy(pristine, ck);
  };
  for (const char* name : {"model.safetensors", "config.json", "optimizer.safetensors", "trainer_state.json"}) {
    SCOPED_TRACE(name);
    const uint64_t size = fs::file_size(ck / name);
    {  // a flipped byte in the middle
      std::fstream io(ck / name, std::ios::in | std::ios::out | std::ios::binary);
      io.seekg(static_cast<std::streamoff>(size / 2));
      const char c = static_cast<char>(io.get());
      io.seekp(static_cast<std::streamoff>(size / 2));
      io.put(static_cast<char>(c ^ 0x5a));
    }
    const std::string flipped = error_of([&] { load_checkpoint(ck, &f.config); });
    if (std::string(name) == "trainer_state.json")
      EXPECT_NE(flipped.find("trainer_state.json: corrupted"), std::string::npos) << flipped;
    else
      EXPECT_NE(flipped.find(std::string("file ") + name + " is corrupted (CRC-32 mismatch)"), std::string::npos)
          << flipped;
    restore();

    fs::resize_file(ck / name, size - 3);
    const std::string truncated = error_of([&] { load_checkpoint(ck, &f.config); });
    if (std::string(name) == "trainer_state.json")
      EXPECT_NE(truncated.find("trainer_state.json: corrupted"), std::string::npos) << truncated;
    else
      EXPECT_NE(truncated.find(std::string("file ") + name + " has " + std::to_string(size - 3) + " bytes, expected " +
                               std::to_string(size)),
                std::string::npos)
          << truncated;
    restore();

    fs::remove(ck / name);
    const std::string missing = error_of([&] { load_checkpoint(ck, &f.config); });
    EXPECT_NE(missing.find(std::string("file ") + name + " is missing"), std::string::npos) << missing;
    restore();
  }
  EXPECT_EQ(load_checkpoint(ck, &f.config).params, f.params);  // the restored copy is good again

  // The run's architecture differs from the checkpoint's.
  BertConfig other = f.config;
  other.intermediate_size = 64;
  const std::string mismatch = error_of([&] { load_checkpoint(ck, &other); });
  EXPECT_NE(mismatch.find("model config differs"), std::string::npos) << mismatch;
  EXPECT_NE(mismatch.find("intermediate_size: 64 vs 32"), std::string::npos) << mismatch;

  // A consistent folder (checksums right) whose tensors do not have the shapes its config.json implies.
  test::TempDir dir2("ckpt-shape");
  BertConfig wider = f.config;
  wider.vocab_size = 60;
  const fs::path bad = write_checkpoint(dir2.path(), wider, f.layout, f.params.data(), nullptr, f.state);
  const std::string shape = error_of([&] { load_checkpoint(bad); });
  EXPECT_NE(shape.find("tensor bert.embeddings.word_embeddings.weight has shape [50, 16], the model expects [60, 16]"),
            std::string::npos)
      << shape;

  // `latest` naming a folder that is gone.
  fs::remove_all(ck);
  const std::string gone = error_of([&] { load_checkpoint(latest_checkpoint(dir.path())); });
  EXPECT_NE(gone.find("is not a folder"), std::string::npos) << gone;
}

TEST(Checkpoint, FailureMidWriteKeepsThePreviousCheckpoint) {
  test::TempDir dir("ckpt-crash");
  Fixture f;
  const fs::path first = f.write(dir.path(), 1);
  const std::vector<float> good = f.params;
  for (float& p : f.params) p += 1.0f;  // the next checkpoint would hold other values
  for (const char* stage :
       {"model.safetensors", "config.json", "optimizer.safetensors", "trainer_state.json", "rename", "latest"}) {
    SCOPED_TRACE(stage);
    CheckpointWriteOptions o;
    o.fault_hook = [&](std::string_view s) {
      if (s == stage) throw Error("simulated crash");
    };
    EXPECT_THROW(f.write(dir.path(), 2, o), Error);
    EXPECT_EQ(latest_checkpoint(dir.path()), first);
    EXPECT_EQ(load_checkpoint(first, &f.config).params, good);
    for (const auto& e : fs::directory_iterator(checkpoints_dir(dir.path())))
      EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
    fs::remove_all(checkpoints_dir(dir.path()) / "step_00000002");  // renamed before the `latest` crash
  }
  // Rewriting the same step replaces it only once the new one is complete.
  CheckpointWriteOptions o;
  o.fault_hook = [](std::string_view s) {
    if (s == "rename") throw Error("simulated crash");
  };
  EXPECT_THROW(f.write(dir.path(), 1, o), Error);
  EXPECT_EQ(load_checkpoint(first, &f.config).params, good);
}

TEST(Checkpoint, KeepsTheNewestK) {
  test::TempDir dir("ckpt-keep");
  Fixture f;
  CheckpointWriteOptions o;
  o.keep = 2;
  for (int64_t s : {10, 20, 30, 40}) f.write(dir.path(), s, o);
  const auto all = list_checkpoints(dir.path());
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].filename(), "step_00000030");
  EXPECT_EQ(all[1].filename(), "step_00000040");
  EXPECT_EQ(latest_checkpoint(dir.path()).filename(), "step_00000040");
}

// Hugging Face checkpoints as save_pretrained writes them, or older variants.
TEST(Checkpoint, InitFromHuggingFaceWeights) {
  test::TempDir dir("ckpt-init");
  Fixture f;
  const std::vector<float>& src = f.params;
  auto tensors_of = [&](bool bare, bool decoder_bias_name, bool with_tied, bool f16,
                        std::vector<std::vector<uint16_t>>& halves) {
    std::vector<SafetensorsTensor> ts;
    for (const auto& t : f.layout.tensors()) {
      std::string name = t.name;
      if (bare && name.rfind("bert.", 0) == 0) name = name.substr(5);
      if (decoder_bias_name && name == "cls.predictions.bias") name = "cls.predictions.decoder.bias";
      if (f16) {
        halves.emplace_back(t.numel);
        for (size_t i = 0; i < t.numel; ++i) halves.back()[i] = float_to_half(src[t.offset + i]);
        ts.push_back({name, DType::kF16, t.shape, halves.back().data()});
      } else {
        ts.push_back({name, DType::kF32, t.shape, src.data() + t.offset});
      }
    }
    if (with_tied) {
      const auto& w = f.layout.find("bert.embeddings.word_embeddings.weight");
      ts.push_back({"cls.predictions.decoder.weight", DType::kF32, w.shape, src.data() + w.offset});
    }
    return ts;
  };
  std::vector<std::vector<uint16_t>> halves;
  halves.reserve(100);
  std::vector<float> out(f.layout.total_numel());

  write_safetensors(dir / "a.safetensors", tensors_of(false, true, true, false, halves));
  EXPECT_TRUE(load_hf_weights(dir / "a.safetensors", f.layout, out.data()).empty());
  EXPECT_EQ(out, src);

  // A folder with model.safetensors; position_ids buffer ignored; bare BertModel-style names are mapped.
  fs::create_directories(dir / "hf");
  auto ts = tensors_of(true, false, false, false, halves);
  std::vector<int64_t> pos_ids(24);
  ts.push_back({"embeddings.position_ids", DType::kI64, {1, 24}, pos_ids.data()});
  write_safetensors(dir / "hf/model.safetensors", ts);
  std::fill(out.begin(), out.end(), 0.0f);
  load_hf_weights(dir / "hf", f.layout, out.data());
  EXPECT_EQ(out, src);

  // F16 storage is converted.
  write_safetensors(dir / "h.safetensors", tensors_of(false, false, false, true, halves));
  load_hf_weights(dir / "h.safetensors", f.layout, out.data());
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], half_to_float(float_to_half(src[i])));

  // An untied decoder weight is a warning.
  auto untied = tensors_of(false, false, false, false, halves);
  std::vector<float> other(f.layout.find("bert.embeddings.word_embeddings.weight").numel, 0.25f);
  untied.push_back({"cls.predictions.decoder.weight", DType::kF32, {50, 16}, other.data()});
  write_safetensors(dir / "u.safetensors", untied);
  const auto warnings = load_hf_weights(dir / "u.safetensors", f.layout, out.data());
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("differs from the word embeddings"), std::string::npos);

  // Shape mismatch names the tensor and both shapes; a missing tensor is named.
  BertConfig bigger = f.config;
  bigger.max_position_embeddings = 32;
  const ParamLayout big(bigger);
  std::vector<float> out_big(big.total_numel());
  const std::string shape = error_of([&] { load_hf_weights(dir / "a.safetensors", big, out_big.data()); });
  EXPECT_NE(shape.find("tensor bert.embeddings.position_embeddings.weight has shape [24, 16], the model "
                       "(model.config) expects [32, 16]"),
            std::string::npos)
      << shape;
  auto partial = tensors_of(false, false, false, false, halves);
  partial.pop_back();
  write_safetensors(dir / "p.safetensors", partial);
  const std::string missing = error_of([&] { load_hf_weights(dir / "p.safetensors", f.layout, out.data()); });
  EXPECT_NE(missing.find("tensor cls.seq_relationship.bias is missing"), std::string::npos) << missing;
  const std::string nofile = error_of([&] { load_hf_weights(dir / "nothing", f.layout, out.data()); });
  EXPECT_NE(nofile.find("does not exist"), std::string::npos) << nofile;
}

}  // namespace
}  // namespace nopad
