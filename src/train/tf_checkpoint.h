// TensorFlow checkpoints, read without TensorFlow: the tensor-bundle format that tf.compat.v1.train.Saver (V2) and
// tf.train.Checkpoint write, and in which MLPerf ships BERT's phase-1 checkpoint (model.ckpt-28252).
//
// A checkpoint PREFIX is two or more files:
//   PREFIX.index                    a LevelDB-format table (sorted keys, prefix-compressed blocks, a CRC-32C per
//                                   block): tensor name -> BundleEntryProto (dtype, shape, shard, offset, size,
//                                   masked CRC-32C of the bytes); the empty key holds the BundleHeaderProto
//                                   (number of data shards, byte order, format version)
//   PREFIX.data-SSSSS-of-NNNNN      the tensors' raw bytes, little-endian, one shard file each
// Contract: everything is validated before use (footer magic, every block's checksum, entries' shards, bounds and
// sizes, each tensor's checksum when it is read), and every problem is one nopad::Error naming the file (and the
// tensor). Not supported, each with an error saying so: snappy-compressed index blocks (TensorFlow < 1.2),
// big-endian checkpoints, tensors saved as slices of a partitioned variable.
//
// load_tf_bert_weights maps the variable names of google-research/bert (modeling.py, run_pretraining.py) onto
// nopad's parameter layout (Hugging Face BertForPreTraining names): dense kernels are stored [in, out] and
// transposed, LayerNorm gamma/beta become weight/bias, cls/predictions/output_bias is the decoder bias and
// cls/seq_relationship/output_weights the NSP weight ([2, hidden], as stored).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/io.h"
#include "model/params.h"
#include "train/safetensors.h"

namespace nopad {

struct TfTensorEntry {
  std::string name;
  int tf_dtype = 0;           // TensorFlow's DataType enum value (DT_FLOAT = 1, DT_HALF = 19, ...)
  bool known_dtype = false;   // tf_dtype has a nopad DType (numbers and bool; not strings or variants)
  DType dtype = DType::kF32;  // valid when known_dtype
  std::vector<int64_t> shape;
  size_t numel = 0;
  int32_t shard = 0;
  uint64_t offset = 0, size = 0;  // bytes in the shard file
  uint32_t masked_crc32c = 0;     // as stored: crc32c_mask(crc32c(bytes))
  bool sliced = false;            // a partitioned variable's slices (the bytes live under other keys)
};

class TfCheckpoint {
 public:
  // `path`: the prefix (".../model.ckpt-28252"), its ".index" file, or a folder that holds a TensorFlow
  // `checkpoint` file (the checkpoint its model_checkpoint_path names) or exactly one "*.index".
  explicit TfCheckpoint(const fs::path& path);

  const fs::path& prefix() const { return prefix_; }
  fs::path index_path() const;
  fs::path data_path(int32_t shard) const;
  int32_t num_shards() const { return static_cast<int32_t>(shards_.size()); }
  const std::vector<TfTensorEntry>& tensors() const { return entries_; }  // sorted by name (the table's order)
  const TfTensorEntry* find(std::string_view name) const;
  const TfTensorEntry& at(std::string_view name) const;  // throws naming the checkpoint when absent
  // Checks the tensor's CRC-32C and converts F32, F16, BF16 or F64 to fp32 into out[0, numel); throws when
  // out_numel differs, the dtype is not a float type, or the bytes do not match their checksum.
  void read_float(std::string_view name, float* out, size_t out_numel) const;
  std::vector<float> read_float(std::string_view name) const;

 private:
  fs::path prefix_;
  std::vector<TfTensorEntry> entries_;
  std::vector<std::unique_ptr<MappedFile>> shards_;
};

// The checkpoint prefix `path` resolves to (the forms TfCheckpoint takes), or an empty path when it is none of them.
fs::path resolve_tf_checkpoint(const fs::path& path);

struct TfImportReport {
  size_t loaded = 0;                 // model tensors read (every parameter of the layout)
  size_t optimizer_slots = 0;        // "<variable>/<slot>" tensors left out (adam_m, adam_v, ...)
  std::vector<std::string> ignored;  // other tensors outside bert/ and cls/ left out (global_step, loss_scale, ...)
  std::string summary() const;       // one line for logs
};

// Loads the BERT pre-training weights of a TensorFlow checkpoint into params[layout.total_numel()].
// Errors: a missing variable, a shape that does not fit the layout (naming the variable, its shape and the one the
// model config implies), or a variable under bert/ or cls/ that the model does not have (another architecture, or
// a config with fewer layers).
TfImportReport load_tf_bert_weights(const fs::path& path, const ParamLayout& layout, float* params);

// The TensorFlow variable (and whether its stored matrix is the transpose) of a layout parameter's name.
struct TfVariableName {
  std::string name;
  bool transposed = false;
};
TfVariableName tf_variable_for(const std::string& hf_name);

}  // namespace nopad
