// Checkpoint writing/loading and Hugging Face weight import (see checkpoint.h for the layout and the guarantees).
#include "train/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>

#include "core/crc32.h"
#include "core/error.h"
#include "data/tokenizer_files.h"
#include "train/safetensors.h"

namespace nopad {
namespace {

constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kConfigFile = "config.json";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kStateFile = "trainer_state.json";
constexpr int kFormatVersion = 1;

// CRC-32 and size of a whole file, read through a map.
std::pair<uint32_t, uint64_t> file_crc(const fs::path& path) {
  MappedFile map(path);
  return {crc32(map.data(), map.size()), map.size()};
}

void hook(const CheckpointWriteOptions& o, std::string_view stage) {
  if (o.fault_hook) o.fault_hook(stage);
}

nlohmann::json state_to_json(const TrainerState& s) {
  nlohmann::json j;
  j["format_version"] = kFormatVersion;
  j["step"] = s.step;
  j["samples"] = s.samples;
  j["cursor"] = {{"epoch", s.cursor.epoch}, {"position", s.cursor.position}};
  j["seed"] = s.seed;
  j["optimizer"] = s.optimizer;
  j["optimizer_steps"] = s.optimizer_steps;
  j["lr"] = s.lr;
  j["schedule_steps"] = s.schedule_steps;
  j["extra"] = s.extra;
  return j;
}

// The CRC-32 of the state object's compact dump without its own checksum field.
uint32_t state_crc(nlohmann::json j) {
  j.erase("state_crc32");
  const std::string text = j.dump();
  return crc32(text.data(), text.size());
}

TrainerState state_from_json(const nlohmann::json& j, const fs::path& file) {
  try {
    TrainerState s;
    NOPAD_CHECK(j.at("format_version").get<int>() == kFormatVersion, file.string(), ": format_version ",
                j.at("format_version").dump(), " is not supported (this nopad writes ", kFormatVersion, ")");
    s.step = j.at("step").get<int64_t>();
    s.samples = j.at("samples").get<uint64_t>();
    s.cursor.epoch = j.at("cursor").at("epoch").get<uint64_t>();
    s.cursor.position = j.at("cursor").at("position").get<uint64_t>();
    s.seed = j.at("seed").get<uint64_t>();
    s.optimizer = j.at("optimizer").get<std::string>();
    s.optimizer_steps = j.at("optimizer_steps").get<int64_t>();
    s.lr = j.at("lr").get<double>();
    s.schedule_steps = j.at("schedule_steps").get<int64_t>();
    if (j.contains("extra")) s.extra = j.at("extra");
    return s;
  } catch (const nlohmann::json::exception& e) {
    fail(file.string(), ": missing or malformed field (", e.what(), ")");
  }
}

// Differences between two architectures, "field: A vs B" each.
std::vector<std::string> config_differences(const BertConfig& a, const BertConfig& b) {
  const nlohmann::json ja = a.to_json(), jb = b.to_json();
  std::vector<std::string> diffs;
  for (const auto& [key, value] : ja.items()) {
    if (!jb.contains(key) || jb.at(key) != value)
      diffs.push_back(key + ": " + value.dump() + " vs " + (jb.contains(key) ? jb.at(key).dump() : "absent"));
  }
  return diffs;
}

}  // namespace

std::string checkpoint_folder_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step_%08lld", static_cast<long long>(step));
  return name;
}

fs::path checkpoints_dir(const fs::path& run_dir) { return run_dir / "checkpoints"; }

fs::path latest_checkpoint(const fs::path& run_dir) {
  const fs::path latest = checkpoints_dir(run_dir) / "latest";
  std::error_code ec;
  if (!fs::exists(latest, ec)) return {};
  std::string name = read_file(latest);
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) name.pop_back();
  NOPAD_CHECK(!name.empty() && name.find('/') == std::string::npos && name.rfind("step_", 0) == 0, latest.string(),
              ": does not name a checkpoint folder (content \"", name, "\"); fix or remove it");
  return checkpoints_dir(run_dir) / name;
}

std::vector<fs::path> list_checkpoints(const fs::path& run_dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  const fs::path dir = checkpoints_dir(run_dir);
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && name.rfind("step_", 0) == 0 && name.find(".tmp") == std::string::npos)
      out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

void write_hf_model_file(const fs::path& path, const ParamLayout& layout, const float* params) {
  std::vector<SafetensorsTensor> tensors;
  for (const ParamTensor& t : layout.tensors()) tensors.push_back({t.name, DType::kF32, t.shape, params + t.offset});
  write_safetensors(path, tensors, {{"format", "pt"}});
}

void write_hf_config_file(const fs::path& path, const BertConfig& config) {
  write_file_atomic(path, config.to_json().dump(2) + "\n");
}

fs::path write_checkpoint(const fs::path& run_dir, const BertConfig& config, const ParamLayout& layout,
                          const float* params, const Optimizer* optimizer, const TrainerState& state,
                          const CheckpointWriteOptions& options) {
  const fs::path parent = checkpoints_dir(run_dir);
  std::error_code ec;
  fs::create_directories(parent, ec);
  NOPAD_CHECK(!ec, "cannot create the checkpoint folder ", parent.string(), ": ", ec.message());
  const std::string name = checkpoint_folder_name(state.step);
  const fs::path final_dir = parent / name;
  const fs::path tmp_dir = parent / (name + ".tmp-" + std::to_string(::getpid()));
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  NOPAD_CHECK(!ec, "cannot create ", tmp_dir.string(), ": ", ec.message());

  // Removes the partial folder unless the rename succeeded.
  struct TmpGuard {
    fs::path dir;
    bool keep = false;
    ~TmpGuard() {
      std::error_code e;
      if (!keep) fs::remove_all(dir, e);
    }
  } guard{tmp_dir};

  write_hf_model_file(tmp_dir / kModelFile, layout, params);
  hook(options, kModelFile);

  write_hf_config_file(tmp_dir / kConfigFile, config);
  hook(options, kConfigFile);

  std::vector<std::string> files = {kModelFile, kConfigFile};
  if (options.tokenizer_vocab) {
    write_tokenizer_files(tmp_dir, *options.tokenizer_vocab, options.tokenizer_lower_case,
                          config.max_position_embeddings);
    for (const std::string& f : tokenizer_file_names()) files.push_back(f);
    hook(options, "tokenizer");
  }

  // optimizer.safetensors: moments with the parameter's shape.
  if (optimizer) {
    std::map<std::string, const ParamTensor*> by_name;
    for (const ParamTensor& t : layout.tensors()) by_name[t.name] = &t;
    std::vector<SafetensorsTensor> opt_tensors;
    for (const StateTensor& s : optimizer->state_tensors()) {
      const std::string param = s.name.substr(0, s.name.rfind('.'));
      const auto it = by_name.find(param);
      std::vector<int64_t> shape = it != by_name.end() && it->second->numel == s.numel
                                       ? it->second->shape
                                       : std::vector<int64_t>{static_cast<int64_t>(s.numel)};
      opt_tensors.push_back({s.name, DType::kF32, shape, s.data});
    }
    write_safetensors(tmp_dir / kOptimizerFile, opt_tensors,
                      {{"kind", optimizer->kind()}, {"step", std::to_string(optimizer->step_count())}});
    files.push_back(kOptimizerFile);
    hook(options, kOptimizerFile);
  }

  nlohmann::json j = state_to_json(state);
  nlohmann::json file_sums = nlohmann::json::object();
  for (const std::string& f : files) {
    const auto [crc, size] = file_crc(tmp_dir / f);
    file_sums[f] = {{"crc32", crc}, {"size", size}};
  }
  j["files"] = file_sums;
  j["state_crc32"] = state_crc(j);
  write_file_atomic(tmp_dir / kStateFile, j.dump(2) + "\n");
  hook(options, kStateFile);
  fsync_dir(tmp_dir);

  // A checkpoint of the same step already there (a re-run of the same step) is replaced only now, when the new one
  // is complete.
  hook(options, "rename");
  if (fs::exists(final_dir, ec)) {
    const fs::path old = parent / (name + ".tmp-old-" + std::to_string(::getpid()));
    fs::remove_all(old, ec);
    fs::rename(final_dir, old, ec);
    NOPAD_CHECK(!ec, "cannot move the old checkpoint ", final_dir.string(), " aside: ", ec.message());
    fs::rename(tmp_dir, final_dir, ec);
    if (ec) {
      std::error_code e2;
      fs::rename(old, final_dir, e2);
      fail("cannot rename ", tmp_dir.string(), " to ", final_dir.string(), ": ", ec.message());
    }
    fs::remove_all(old, ec);
  } else {
    fs::rename(tmp_dir, final_dir, ec);
    NOPAD_CHECK(!ec, "cannot rename ", tmp_dir.string(), " to ", final_dir.string(), ": ", ec.message());
  }
  guard.keep = true;
  fsync_dir(parent);

  hook(options, "latest");
  write_file_atomic(parent / "latest", name + "\n");

  // Retention: the newest `keep` complete checkpoints (never the one just written).
  if (options.keep > 0) {
    std::vector<fs::path> all = list_checkpoints(run_dir);
    const size_t keep = static_cast<size_t>(options.keep);
    for (size_t i = 0; i + keep < all.size(); ++i) {
      if (all[i] == final_dir) continue;
      fs::remove_all(all[i], ec);
    }
  }
  return final_dir;
}

std::vector<StateTensor> LoadedCheckpoint::optimizer_state() const {
  std::vector<StateTensor> out;
  for (size_t i = 0; i < optimizer_names.size(); ++i)
    out.push_back({optimizer_names[i], optimizer_data[i].data(), optimizer_data[i].size()});
  return out;
}

LoadedCheckpoint load_checkpoint(const fs::path& dir, const BertConfig* expect_config, bool with_optimizer) {
  std::error_code ec;
  NOPAD_CHECK(fs::is_directory(dir, ec), "checkpoint ", dir.string(), " is not a folder (or does not exist)");
  LoadedCheckpoint ck;
  ck.dir = dir;
  const fs::path state_path = dir / kStateFile;
  NOPAD_CHECK(fs::exists(state_path, ec), "checkpoint ", dir.string(), ": file ", kStateFile,
              " is missing (the checkpoint is incomplete; use an earlier one)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(state_path));
  } catch (const nlohmann::json::exception& e) {
    fail(state_path.string(), ": corrupted (not valid JSON: ", e.what(), ")");
  }
  NOPAD_CHECK(j.is_object() && j.contains("state_crc32") && j.at("state_crc32").is_number_unsigned(),
              state_path.string(), ": corrupted (no state_crc32 field)");
  NOPAD_CHECK(j.at("state_crc32").get<uint32_t>() == state_crc(j), state_path.string(),
              ": corrupted (its content does not match its state_crc32 checksum)");
  ck.state = state_from_json(j, state_path);

  // Every listed file: present, right size, right checksum.
  NOPAD_CHECK(j.contains("files") && j.at("files").is_object(), state_path.string(), ": no file list");
  for (const char* required : {kModelFile, kConfigFile})
    NOPAD_CHECK(j.at("files").contains(required), state_path.string(), ": does not list ", required);
  for (const auto& [name, info] : j.at("files").items()) {
    const fs::path f = dir / name;
    NOPAD_CHECK(fs::exists(f, ec), "checkpoint ", dir.string(), ": file ", name,
                " is missing (the checkpoint is incomplete; use an earlier one)");
    const auto [crc, size] = file_crc(f);
    const uint64_t want_size = info.at("size").get<uint64_t>();
    NOPAD_CHECK(size == want_size, "checkpoint ", dir.string(), ": file ", name, " has ", size,
                " bytes, expected ", want_size, " (truncated or replaced)");
    NOPAD_CHECK(crc == info.at("crc32").get<uint32_t>(), "checkpoint ", dir.string(), ": file ", name,
                " is corrupted (CRC-32 mismatch)");
  }

  ck.config = BertConfig::from_file((dir / kConfigFile).string());
  if (expect_config) {
    const auto diffs = config_differences(*expect_config, ck.config);
    if (!diffs.empty()) {
      std::string list;
      for (const auto& d : diffs) list += (list.empty() ? "" : "; ") + d;
      fail("checkpoint ", dir.string(), ": model config differs from the run's model.config (run vs checkpoint: ",
           list, ")");
    }
  }

  const ParamLayout layout(ck.config);
  ck.params.resize(layout.total_numel());
  {
    const SafetensorsFile st(dir / kModelFile);
    std::set<std::string> expected;
    for (const ParamTensor& t : layout.tensors()) {
      expected.insert(t.name);
      const SafetensorsEntry* e = st.find(t.name);
      NOPAD_CHECK(e, "checkpoint ", (dir / kModelFile).string(), ": tensor ", t.name, " is missing");
      NOPAD_CHECK(e->shape == t.shape, "checkpoint ", (dir / kModelFile).string(), ": tensor ", t.name,
                  " has shape ", shape_str(e->shape), ", the model expects ", shape_str(t.shape));
      NOPAD_CHECK(e->dtype == DType::kF32, "checkpoint ", (dir / kModelFile).string(), ": tensor ", t.name,
                  " is ", dtype_name(e->dtype), ", expected F32");
      st.read_float(t.name, ck.params.data() + t.offset, t.numel);
    }
    for (const SafetensorsEntry& e : st.tensors())
      NOPAD_CHECK(expected.count(e.name), "checkpoint ", (dir / kModelFile).string(), ": unexpected tensor ",
                  e.name);
  }

  if (with_optimizer && j.at("files").contains(kOptimizerFile)) {
    const SafetensorsFile st(dir / kOptimizerFile);
    const auto kind = st.metadata().find("kind");
    const auto step = st.metadata().find("step");
    NOPAD_CHECK(kind != st.metadata().end() && step != st.metadata().end(), st.path().string(),
                ": metadata lacks kind/step");
    ck.optimizer_kind = kind->second;
    ck.optimizer_steps = std::stoll(step->second);
    for (const SafetensorsEntry& e : st.tensors()) {
      ck.optimizer_names.push_back(e.name);
      ck.optimizer_data.push_back(st.read_float(e.name));
    }
  }
  return ck;
}

std::vector<float> load_model_folder(const fs::path& dir, const std::string& what, BertConfig* config) {
  std::error_code ec;
  NOPAD_CHECK(fs::is_directory(dir, ec), what, " ", dir.string(),
              " is not a folder (expected a checkpoint folder with model.safetensors and config.json)");
  NOPAD_CHECK(!fs::exists(dir / "checkpoints" / "latest", ec), what, " ", dir.string(), " is a run folder: give "
              "one of its checkpoints, e.g. ", (dir / "checkpoints").string(), "/$(cat ",
              (dir / "checkpoints" / "latest").string(), ")");
  *config = read_hf_config(dir / kConfigFile);
  const ParamLayout layout(*config);
  std::vector<float> params(layout.total_numel());
  if (fs::exists(dir / kStateFile, ec)) {
    params = load_checkpoint(dir, config, /*with_optimizer=*/false).params;  // a verified nopad checkpoint
  } else {
    load_hf_weights(dir, layout, params.data());
  }
  // Weights that are not finite (a diverged run's last checkpoint) would only give a null loss.
  for (const ParamTensor& t : layout.tensors())
    for (size_t i = 0; i < t.numel; ++i)
      NOPAD_CHECK(std::isfinite(params[t.offset + i]), "checkpoint ", dir.string(), ": tensor ", t.name,
                  " holds a non-finite value (element ", i, "): the run that wrote it diverged; use an earlier "
                  "checkpoint");
  return params;
}

BertConfig read_hf_config(const fs::path& config_json) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(config_json));
  } catch (const nlohmann::json::exception& e) {
    fail(config_json.string(), ": not valid JSON (", e.what(), ")");
  }
  NOPAD_CHECK(j.is_object(), config_json.string(), ": a config must be a JSON object");
  std::vector<std::string> drop;
  for (const auto& [key, value] : j.items())
    if (key.rfind('_', 0) == 0 || key == "dtype") drop.push_back(key);
  for (const auto& k : drop) j.erase(k);
  return BertConfig::from_json(j, config_json.string());
}

std::vector<std::string> load_hf_weights(const fs::path& path, const ParamLayout& layout, float* params) {
  std::error_code ec;
  fs::path file = path;
  if (fs::is_directory(path, ec)) file = path / kModelFile;
  NOPAD_CHECK(fs::exists(file, ec), "init weights: ", file.string(),
              " does not exist (expected a Hugging Face folder with model.safetensors, or a .safetensors file)");
  const SafetensorsFile st(file);
  const std::string where = file.string();
  std::set<std::string> used;
  std::vector<std::string> warnings;

  // BertModel checkpoints store "embeddings...", "encoder...", "pooler..." without the "bert." prefix.
  const bool bare = !st.find("bert.embeddings.word_embeddings.weight") && st.find("embeddings.word_embeddings.weight");
  auto stored_name = [&](const std::string& name) -> std::string {
    if (st.find(name)) return name;
    if (name == "cls.predictions.bias" && st.find("cls.predictions.decoder.bias")) return "cls.predictions.decoder.bias";
    if (bare && name.rfind("bert.", 0) == 0 && st.find(name.substr(5))) return name.substr(5);
    return {};
  };
  for (const ParamTensor& t : layout.tensors()) {
    const std::string s = stored_name(t.name);
    if (s.empty()) {
      if (bare && t.name.rfind("cls.", 0) == 0)
        fail("init weights ", where, ": tensor ", t.name,
             " is missing (this looks like a BertModel checkpoint without the pre-training heads; "
             "use a BertForPreTraining checkpoint)");
      fail("init weights ", where, ": tensor ", t.name, " is missing");
    }
    const SafetensorsEntry& e = st.at(s);
    NOPAD_CHECK(e.shape == t.shape, "init weights ", where, ": tensor ", s, " has shape ", shape_str(e.shape),
                ", the model (model.config) expects ", shape_str(t.shape));
    NOPAD_CHECK(e.dtype == DType::kF32 || e.dtype == DType::kF16 || e.dtype == DType::kBF16, "init weights ", where,
                ": tensor ", s, " is ", dtype_name(e.dtype), " (supported: F32, F16, BF16)");
    st.read_float(s, params + t.offset, t.numel);
    used.insert(s);
  }
  for (const SafetensorsEntry& e : st.tensors()) {
    if (used.count(e.name)) continue;
    if (e.name == "bert.embeddings.position_ids" || e.name == "embeddings.position_ids") continue;
    if (e.name == "cls.predictions.decoder.bias") {
      // Both bias names stored: they are one tensor in Hugging Face and must agree.
      const std::vector<float> b = st.read_float(e.name);
      const ParamTensor& t = layout.find("cls.predictions.bias");
      if (b.size() != t.numel || !std::equal(b.begin(), b.end(), params + t.offset))
        warnings.push_back("cls.predictions.decoder.bias differs from cls.predictions.bias; using the latter");
      continue;
    }
    if (e.name == "cls.predictions.decoder.weight") {
      const ParamTensor& t = layout.find("bert.embeddings.word_embeddings.weight");
      NOPAD_CHECK(e.shape == t.shape, "init weights ", where, ": tensor ", e.name, " has shape ",
                  shape_str(e.shape), ", expected ", shape_str(t.shape), " (it is tied to the word embeddings)");
      const std::vector<float> w = st.read_float(e.name);
      if (!std::equal(w.begin(), w.end(), params + t.offset))
        warnings.push_back(where + ": cls.predictions.decoder.weight differs from the word embeddings; nopad ties "
                                   "them and uses bert.embeddings.word_embeddings.weight");
      continue;
    }
    fail("init weights ", where, ": unexpected tensor ", e.name,
         " (not a BertForPreTraining parameter; is this checkpoint for another architecture?)");
  }
  for (const auto& w : warnings) std::fprintf(stderr, "warning: %s\n", w.c_str());
  return warnings;
}

}  // namespace nopad
