// Training checkpoints and Hugging Face weight import.
//
// A checkpoint is one folder RUN_DIR/checkpoints/step_XXXXXXXX/ holding
//   model.safetensors      F32 parameters under Hugging Face BertForPreTraining names and shapes (ParamLayout order);
//                          the tied aliases cls.predictions.decoder.weight/.bias are not written (save_pretrained
//                          drops them too; from_pretrained re-ties them), metadata {"format": "pt"}
//   config.json            BertConfig::to_json(), loadable by transformers.BertForPreTraining.from_pretrained
//   optimizer.safetensors  Adam moments "<param>.exp_avg" / "<param>.exp_avg_sq", metadata kind and step count
//   vocab.txt, tokenizer_config.json, special_tokens_map.json, tokenizer.json
//                          the tokenizer the data was made with (data/tokenizer_files.h), when the run knows it, so
//                          that AutoTokenizer.from_pretrained(dir) and nopad fill-mask tokenize as nopad prepare did
//   trainer_state.json     step, samples, loader cursor, seeds, schedule position, and {crc32, size} of every other
//                          file; it carries its own CRC-32 ("state_crc32") over the rest of its content
// Write protocol: everything goes into step_XXXXXXXX.tmp-PID/ (each file fsynced), the folder is renamed into place,
// the parent fsynced, then RUN_DIR/checkpoints/latest (the folder name) replaced atomically; only then are
// checkpoints beyond the newest `keep` removed. A failure at any point leaves the previous checkpoint and `latest`
// as they were. Loading verifies sizes, checksums, names and shapes, each problem one error naming the file.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/io.h"
#include "data/loader.h"
#include "data/vocab.h"
#include "model/config.h"
#include "model/params.h"
#include "optim/optimizer.h"

namespace nopad {

// Where a run stands; saved in trainer_state.json.
struct TrainerState {
  int64_t step = 0;      // completed optimizer steps
  uint64_t samples = 0;  // training samples consumed
  Cursor cursor;         // where the loader's next global batch starts
  uint64_t seed = 0;     // train.seed: data order, dropout, initialisation
  std::string optimizer = "lamb";
  int64_t optimizer_steps = 0;  // the optimizer's completed (non-skipped) updates: its bias-correction count
  double lr = 0;                // learning rate of the last update
  int64_t schedule_steps = 0;   // steps already taken on the learning-rate schedule (== step)
  nlohmann::json extra = nlohmann::json::object();  // free-form (last eval, config summary)
};

// Test hook: called with a stage name ("model.safetensors", ..., "rename", "latest") while writing; throwing from it
// simulates a crash at that point.
using CheckpointFaultHook = std::function<void(std::string_view stage)>;

struct CheckpointWriteOptions {
  int keep = 3;  // newest checkpoints to keep (<= 0: keep all)
  CheckpointFaultHook fault_hook;
  const Vocab* tokenizer_vocab = nullptr;  // non-null: the tokenizer files are written (lower-cased or not)
  bool tokenizer_lower_case = true;
};

// Writes a checkpoint of `params` (host memory, layout.total_numel() floats) and the optimizer's moments into
// run_dir/checkpoints/step_XXXXXXXX; returns the folder. Throws nopad::Error (nothing replaced) on failure.
fs::path write_checkpoint(const fs::path& run_dir, const BertConfig& config, const ParamLayout& layout,
                          const float* params, const Optimizer* optimizer, const TrainerState& state,
                          const CheckpointWriteOptions& options = {});

// The two files of a Hugging Face BertForPreTraining folder, as a checkpoint holds them: model.safetensors (every
// tensor of `layout` by its Hugging Face name and shape, F32, from params[layout.total_numel()]) and config.json.
// Each file is written whole (no other file is touched); write_checkpoint and `nopad convert --from-tf-checkpoint`
// stage them before moving them into place.
void write_hf_model_file(const fs::path& path, const ParamLayout& layout, const float* params);
void write_hf_config_file(const fs::path& path, const BertConfig& config);

std::string checkpoint_folder_name(int64_t step);  // "step_00000100"
fs::path checkpoints_dir(const fs::path& run_dir);  // run_dir/checkpoints
// The folder named by run_dir/checkpoints/latest, or an empty path when there is no `latest`.
fs::path latest_checkpoint(const fs::path& run_dir);
// Complete checkpoint folders of a run (step_* without .tmp), oldest first.
std::vector<fs::path> list_checkpoints(const fs::path& run_dir);

struct LoadedCheckpoint {
  fs::path dir;
  BertConfig config;
  TrainerState state;
  std::vector<float> params;  // [ParamLayout(config).total_numel()]
  std::string optimizer_kind;
  int64_t optimizer_steps = 0;
  std::vector<std::string> optimizer_names;  // parallel to optimizer_data
  std::vector<std::vector<float>> optimizer_data;

  // Views for Optimizer::load_state.
  std::vector<StateTensor> optimizer_state() const;
};

// Loads and verifies a nopad checkpoint folder. When `expect_config` is given, its architecture must equal the
// checkpoint's (an error names every differing field). with_optimizer = false skips optimizer.safetensors (still
// checksummed).
LoadedCheckpoint load_checkpoint(const fs::path& dir, const BertConfig* expect_config = nullptr,
                                 bool with_optimizer = true);

// The weights of a model folder for inference (eval, fill-mask): a nopad checkpoint (verified, optimizer skipped) or a
// Hugging Face folder (config.json + model.safetensors). `what` names the folder's option in errors ("--checkpoint").
// Refuses a run folder (pointing at its latest checkpoint) and weights that are not finite (naming the tensor).
std::vector<float> load_model_folder(const fs::path& dir, const std::string& what, BertConfig* config);

// Reads a Hugging Face config.json, dropping private bookkeeping keys ("_attn_implementation_autoset", "dtype")
// that recent transformers versions write and BertConfig does not list.
BertConfig read_hf_config(const fs::path& config_json);

// Loads model weights from a Hugging Face checkpoint folder (model.safetensors) or a .safetensors file, F32/F16/BF16,
// into params[layout.total_numel()]. Accepts cls.predictions.bias or cls.predictions.decoder.bias, names without
// the "bert." prefix (BertModel checkpoints; the heads must then be present too), ignores position_ids buffers, and
// checks that a stored cls.predictions.decoder.weight equals the word embeddings (warning on stderr otherwise).
// Errors: a missing tensor, a shape mismatch (naming the tensor and both shapes), an unknown tensor. Returns
// warnings (also printed).
std::vector<std::string> load_hf_weights(const fs::path& path, const ParamLayout& layout, float* params);

}  // namespace nopad
