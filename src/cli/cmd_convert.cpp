// nopad convert --from-hdf5 PATH... --output DIR: NVIDIA / MLPerf BERT HDF5 files -> nopad shards; --from-tfrecord
// PATH... the same from the MLPerf reference's TFRecord files (create_pretraining_data.py's tf.train.Example records).
// Input files are read in the order given (several at once with --threads) and their instances are written, in that
// order, into DIR/shard_00000.nopad, shard_00001.nopad, ... of --seqs-per-shard sequences each, plus DIR/dataset.json.
// All-or-nothing (data/dataset_folder.h): shards are written into a staging folder inside DIR and moved into place only
// after every input has converted; on any error the staging folder is removed and DIR is left as it was.
//
// nopad convert --from-tf-checkpoint PATH --output DIR [--config bert_config.json]: a TensorFlow BERT checkpoint
// (MLPerf's phase-1 model.ckpt-28252, google-research/bert's) -> a Hugging Face BertForPreTraining folder
// (model.safetensors, config.json, and the tokenizer files of data/tokenizer_files.h) that nopad's init_from, eval
// and fill-mask and transformers' from_pretrained load. The same all-or-nothing rule: every file is staged, then
// moved into place, the config last.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/command.h"
#include "core/error.h"
#include "core/io.h"
#include "core/paths.h"
#include "core/progress.h"
#include "core/threads.h"
#include "data/dataset_folder.h"
#include "data/hdf5_import.h"
#include "data/tfrecord_import.h"
#include "data/tokenizer_files.h"
#include "data/shard.h"
#include "data/vocab.h"
#include "model/config.h"
#include "model/params.h"
#include "train/checkpoint.h"
#include "train/tf_checkpoint.h"

namespace {

namespace fs = std::filesystem;

// The vocabulary nopad ships (core/paths.h finds it in a checkout or an installation): BERT's uncased WordPiece, the
// one MLPerf's data and phase-1 checkpoint use.
constexpr const char* kDefaultVocab = "vocab/bert-uncased-vocab.txt";

struct ConvertOptions {
  std::vector<std::string> inputs;     // --from-hdf5
  std::vector<std::string> tfrecords;  // --from-tfrecord
  std::string tf_checkpoint;
  std::string config;
  std::string output;
  bool overwrite = false;
  std::string vocab;
  std::string lower_case = "auto";
  int64_t seqs_per_shard = 65536;
  int threads = 0;
};

// Removes the staging folder of a TensorFlow checkpoint conversion unless released (the conversion succeeded).
struct StagingDir {
  fs::path path;
  bool keep = false;
  ~StagingDir() {
    std::error_code ec;
    if (!keep) fs::remove_all(path, ec);
  }
};

// Per input file: what the manifest records of it.
struct InputSummary {
  std::string layout;
  uint64_t rows = 0, seqs = 0;
};

void run_convert(const ConvertOptions& opt) {
  using nopad::fail;
  const bool tfrecord = !opt.tfrecords.empty();
  const std::vector<std::string>& input_paths = tfrecord ? opt.tfrecords : opt.inputs;
  const auto t0 = std::chrono::steady_clock::now();
  fs::path vocab_path = opt.vocab;
  if (vocab_path.empty()) {
    const auto found = nopad::find_data_file(kDefaultVocab);
    if (!found)
      fail("no vocabulary given and nopad's default data/", kDefaultVocab,
           " is not found: pass --vocab FILE (the vocab.txt the input files were made with)");
    vocab_path = *found;
  }
  const nopad::Vocab vocab = nopad::Vocab::load(vocab_path);
  const bool lower_case = nopad::resolve_lower_case(opt.lower_case, vocab, "--do-lower-case");
  NOPAD_CHECK(opt.seqs_per_shard > 0, "--seqs-per-shard must be positive, got ", opt.seqs_per_shard);
  for (const std::string& in : input_paths) {
    std::error_code ec;
    NOPAD_CHECK(fs::is_regular_file(in, ec), "input ", in, " does not exist or is not a file");
  }

  // An existing dataset is never mixed with this one: refused, or with --overwrite replaced once the new one is
  // complete (until then it stays as it was).
  nopad::DatasetFolderWriter out(opt.output, opt.overwrite, "--output");

  nopad::Hdf5ImportOptions import;
  import.vocab_size = vocab.size();
  import.cls_id = vocab.special().cls;
  import.sep_id = vocab.special().sep;
  const nopad::InstanceRules rules{import.vocab_size, import.cls_id, import.sep_id};

  const int threads = opt.threads > 0 ? opt.threads : std::min(nopad::hardware_threads(), 8);
  nopad::Progress progress("convert", static_cast<double>(input_paths.size()), "files");
  size_t num_shards = 0;
  std::unique_ptr<nopad::ShardWriter> writer;
  uint64_t num_seqs = 0, num_tokens = 0, num_masked = 0;
  nlohmann::json inputs = nlohmann::json::array();

  auto flush = [&] {
    if (!writer) return;
    writer->finish();
    writer.reset();
  };
  auto add = [&](const nopad::Instance& inst) {
    if (!writer) {
      writer = std::make_unique<nopad::ShardWriter>(out.staged_shard(num_shards++), vocab.size(), vocab.checksum());
    }
    writer->add(inst);
    ++num_seqs;
    num_tokens += inst.tokens.size();
    num_masked += inst.mlm_positions.size();
    if (static_cast<int64_t>(writer->num_seqs()) >= opt.seqs_per_shard) flush();
  };

  // Files are read `threads` at a time and written in input order, so the shards do not depend on --threads.
  for (size_t first = 0; first < input_paths.size(); first += static_cast<size_t>(threads)) {
    const size_t count = std::min(input_paths.size() - first, static_cast<size_t>(threads));
    std::vector<std::vector<nopad::Instance>> batch(count);
    std::vector<InputSummary> summaries(count);
    nopad::parallel_for(count, threads, [&](size_t i) {
      if (tfrecord) {
        nopad::TfRecordSummary t;
        batch[i] = nopad::read_tfrecord_file(input_paths[first + i], rules, &t);
        summaries[i] = {"tfrecord", t.num_records, t.num_records};
      } else {
        nopad::Hdf5FileSummary h;
        batch[i] = nopad::read_hdf5_file(input_paths[first + i], import, &h);
        summaries[i] = {nopad::hdf5_layout_name(h.layout), h.num_rows, h.num_seqs};
      }
      progress.add(1);
    });
    for (size_t i = 0; i < count; ++i) {
      for (const nopad::Instance& inst : batch[i]) add(inst);
      batch[i] = {};
      inputs.push_back({{"path", input_paths[first + i]},
                        {"layout", summaries[i].layout},
                        {"rows", summaries[i].rows},
                        {"seqs", summaries[i].seqs}});
    }
  }
  flush();
  progress.finish();
  NOPAD_CHECK(num_seqs > 0, "the inputs hold no sequences; nothing to convert");

  // The vocabulary travels with the shards (training puts it beside every checkpoint).
  std::string vocab_text;
  for (const std::string& t : vocab.tokens()) vocab_text += t + "\n";
  out.stage_file("vocab.txt", vocab_text);
  const nlohmann::json manifest = {
      {"format", "nopad-shards"}, {"version", 1},           {"source", tfrecord ? "tfrecord" : "hdf5"},
      {"inputs", inputs},         {"num_shards", num_shards}, {"num_seqs", num_seqs},
      {"num_tokens", num_tokens}, {"num_masked", num_masked}, {"vocab_size", vocab.size()},
      {"vocab_checksum", vocab.checksum()}, {"vocab_file", "vocab.txt"}, {"do_lower_case", lower_case}};
  out.commit(num_shards, manifest);

  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf(
      "converted %zu files -> %zu shards in %s\n  sequences %llu, tokens %llu (%.1f per sequence), masked %llu\n"
      "  time %s\n",
      input_paths.size(), num_shards, out.dir().string().c_str(), static_cast<unsigned long long>(num_seqs),
      static_cast<unsigned long long>(num_tokens), static_cast<double>(num_tokens) / static_cast<double>(num_seqs),
      static_cast<unsigned long long>(num_masked), nopad::format_duration(seconds).c_str());
}

// The bert_config.json a TensorFlow BERT checkpoint ships with: --config, else bert_config.json beside the
// checkpoint or in the folder given.
fs::path tf_config_path(const ConvertOptions& opt, const fs::path& prefix) {
  if (!opt.config.empty()) return opt.config;
  std::error_code ec;
  for (const fs::path& dir : {prefix.parent_path(), fs::path(opt.tf_checkpoint)})
    if (!dir.empty() && fs::is_regular_file(dir / "bert_config.json", ec)) return dir / "bert_config.json";
  nopad::fail("no model config: pass --config FILE (the bert_config.json the checkpoint was trained with; none "
              "was found beside ", prefix.string(), ")");
}

// The vocabulary of a TensorFlow checkpoint's tokenizer: --vocab, else vocab.txt beside the checkpoint (as
// google-research/bert's and MLPerf's folders ship it), else nopad's default when it fits the model's vocab_size.
nopad::Vocab tf_vocab(const ConvertOptions& opt, const fs::path& prefix, const nopad::BertConfig& config,
                      std::string* origin) {
  std::error_code ec;
  fs::path path = opt.vocab;
  *origin = "--vocab";
  if (path.empty()) {
    for (const fs::path& dir : {prefix.parent_path(), fs::path(opt.tf_checkpoint)})
      if (!dir.empty() && fs::is_regular_file(dir / "vocab.txt", ec)) {
        path = dir / "vocab.txt";
        *origin = "beside the checkpoint";
        break;
      }
  }
  if (path.empty()) {
    const auto found = nopad::find_data_file(kDefaultVocab);
    if (found) {
      nopad::Vocab v = nopad::Vocab::load(*found);
      if (v.size() == config.vocab_size) {
        *origin = "nopad's default (no vocab.txt beside the checkpoint; pass --vocab if it was trained with another)";
        return v;
      }
    }
    nopad::fail("no vocabulary for the checkpoint's tokenizer: none given, no vocab.txt beside ", prefix.string(),
                ", and nopad's default does not match its vocab_size ", config.vocab_size,
                ": pass --vocab FILE (the vocab.txt it was trained with)");
  }
  nopad::Vocab v = nopad::Vocab::load(path);
  NOPAD_CHECK(v.size() <= config.vocab_size, "--vocab ", path.string(), " has ", v.size(),
              " tokens, more than the checkpoint's vocab_size ", config.vocab_size,
              ": it is not the vocabulary this model was trained with");
  return v;
}

void run_convert_tf(const ConvertOptions& opt) {
  using nopad::fail;
  const auto t0 = std::chrono::steady_clock::now();
  const fs::path prefix = nopad::resolve_tf_checkpoint(opt.tf_checkpoint);
  NOPAD_CHECK(!prefix.empty(), "--from-tf-checkpoint ", opt.tf_checkpoint,
              ": no TensorFlow checkpoint there (give the prefix, e.g. .../model.ckpt-28252 beside "
              "model.ckpt-28252.index, the .index file, or a folder with a `checkpoint` file or one .index file)");
  const fs::path config_path = tf_config_path(opt, prefix);
  const nopad::BertConfig config = nopad::BertConfig::from_file(config_path.string());
  const nopad::ParamLayout layout(config);
  std::vector<float> params(layout.total_numel(), 0.0f);
  const nopad::TfImportReport report = nopad::load_tf_bert_weights(prefix, layout, params.data());
  std::string vocab_origin;
  const nopad::Vocab vocab = tf_vocab(opt, prefix, config, &vocab_origin);
  const bool lower_case = nopad::resolve_lower_case(opt.lower_case, vocab, "--do-lower-case");

  const fs::path out_dir(opt.output);
  nopad::ensure_writable_dir(out_dir);
  std::error_code ec;
  const bool existing = fs::exists(out_dir / "model.safetensors", ec) || fs::exists(out_dir / "config.json", ec);
  if (existing && !opt.overwrite)
    fail("output folder ", out_dir.string(), " already holds a model (model.safetensors or config.json): pass "
         "--overwrite to replace it, or choose an empty folder");
  nopad::remove_dead_staging_folders(out_dir, ".convert-staging-");
  StagingDir staging{out_dir / nopad::staging_folder_name(".convert-staging-")};
  fs::remove_all(staging.path);
  fs::create_directories(staging.path);
  nopad::write_hf_model_file(staging.path / "model.safetensors", layout, params.data());
  nopad::write_hf_config_file(staging.path / "config.json", config);
  nopad::write_tokenizer_files(staging.path, vocab, lower_case, config.max_position_embeddings);
  // The old config goes first: a folder without config.json is incomplete, never a mix of two models.
  if (existing) {
    fs::remove(out_dir / "config.json");
    nopad::fsync_dir(out_dir);
  }
  for (const std::string& name : nopad::tokenizer_file_names()) fs::rename(staging.path / name, out_dir / name);
  fs::rename(staging.path / "model.safetensors", out_dir / "model.safetensors");
  fs::rename(staging.path / "config.json", out_dir / "config.json");
  nopad::fsync_dir(out_dir);

  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("converted TensorFlow checkpoint %s -> %s (Hugging Face BertForPreTraining, %zu parameters)\n"
              "  %s\n  config %s; tokenizer: %s vocabulary %s, %d tokens (%s); time %s\n",
              prefix.string().c_str(), out_dir.string().c_str(), layout.num_values(), report.summary().c_str(),
              config_path.string().c_str(), lower_case ? "uncased" : "cased", vocab.origin().c_str(), vocab.size(),
              vocab_origin.c_str(), nopad::format_duration(seconds).c_str());
}

void setup(CLI::App& sub) {
  auto opt = std::make_shared<ConvertOptions>();
  auto* hdf5 = sub.add_option("--from-hdf5", opt->inputs,
                              "NVIDIA/MLPerf BERT HDF5 files (fixed, variable-length or packed) -> shards")
                   ->expected(1, -1);
  auto* tf = sub.add_option("--from-tf-checkpoint", opt->tf_checkpoint,
                            "a TensorFlow BERT checkpoint (prefix, .index file or folder; e.g. MLPerf's phase-1 "
                            "model.ckpt-28252) -> a Hugging Face BertForPreTraining folder");
  auto* tfrec = sub.add_option("--from-tfrecord", opt->tfrecords,
                               "the MLPerf reference's TFRecord files (create_pretraining_data.py output) -> shards")
                    ->expected(1, -1);
  hdf5->excludes(tf);
  tfrec->excludes(tf);
  tfrec->excludes(hdf5);
  sub.add_option("--config", opt->config,
                 "with --from-tf-checkpoint: the model's bert_config.json (default: bert_config.json beside the "
                 "checkpoint)");
  sub.add_option("--output", opt->output,
                 "output folder: shard_NNNNN.nopad and dataset.json, or model.safetensors and config.json")
      ->required();
  sub.add_option("--vocab", opt->vocab,
                 std::string("vocabulary the data files or the checkpoint were made with (default: data/") +
                     kDefaultVocab + " shipped with nopad; for a checkpoint, vocab.txt beside it first)");
  sub.add_option("--do-lower-case", opt->lower_case,
                 "the tokenizer's casing recorded with the data or written beside the model: auto (follow the "
                 "vocabulary: cased when it holds capitalised tokens), true (uncased BERT) or false (cased BERT)")
      ->check(CLI::IsMember({"auto", "true", "false"}))
      ->capture_default_str();
  sub.add_option("--seqs-per-shard", opt->seqs_per_shard, "sequences per shard")->default_val(65536);
  sub.add_option("--threads", opt->threads, "input files read at once (default: cores, at most 8)");
  sub.add_flag("--overwrite", opt->overwrite,
               "replace a dataset or model already in --output (it stays untouched until the new one is complete)");
  sub.callback([opt] {
    if (!opt->tf_checkpoint.empty()) return run_convert_tf(*opt);
    NOPAD_CHECK(!opt->inputs.empty() || !opt->tfrecords.empty(), "nothing to convert: give --from-hdf5 FILE... or "
                "--from-tfrecord FILE... (data) or --from-tf-checkpoint PATH (a model)");
    NOPAD_CHECK(opt->config.empty(), "--config goes with --from-tf-checkpoint, not with data conversion");
    run_convert(*opt);
  });
}

NOPAD_REGISTER_COMMAND("convert",
                       "convert NVIDIA/MLPerf BERT HDF5 or TFRecord files into nopad shards, or a TensorFlow BERT "
                       "checkpoint into a Hugging Face folder",
                       40, setup);

}  // namespace
