// Fuzz body of the HDF5 importer (data/hdf5_import.h): the bytes are an .hdf5 file; its layout is detected and every
// row read, once in one block and once three rows at a time (block boundaries), with and without the [CLS]/[SEP]
// checks. Every instance handed on must satisfy check_instance and add up to the summary.
#pragma once
#include "core/error.h"
#include "data/hdf5_import.h"
#include "fuzz_common.h"
#include "instance_check.h"

namespace nopad::fuzz {

inline void hdf5_fuzz_one(const uint8_t* data, size_t size) {
  const std::filesystem::path file = scratch_dir() / "input.hdf5";
  write_bytes(file, data, size);
  try {
    detect_hdf5_layout(file);
  } catch (const Error&) {
    return;  // not an HDF5 file nopad opens: read_hdf5_instances would refuse it the same way
  }
  for (const Hdf5ImportOptions opt : {Hdf5ImportOptions{30522, -1, -1, 4096}, Hdf5ImportOptions{30522, 101, 102, 3}}) {
    uint64_t seqs = 0, tokens = 0, masked = 0;
    try {
      const Hdf5FileSummary s = read_hdf5_instances(file, opt, [&](Instance&& inst) {
        check_instance(inst, opt.vocab_size);
        ++seqs;
        tokens += inst.tokens.size();
        masked += inst.mlm_positions.size();
      });
      require(s.num_seqs == seqs && s.num_tokens == tokens && s.num_masked == masked,
              "the summary counts what was handed on");
      require(s.layout == Hdf5Layout::kPacked ? s.num_seqs >= s.num_rows : s.num_seqs == s.num_rows,
              "one instance per row (at least one per packed row)");
    } catch (const Error&) {
    }
  }
}

}  // namespace nopad::fuzz
