// HDF5 import and `nopad convert`: files in the three NVIDIA layouts (fixed, variable-length, packed) are written with
// the libhdf5 C API from seeded random instances, converted, read back with ShardReader and compared sample by
// sample. Bad inputs must fail with one nopad::Error naming the file and the field, leaving no shard behind.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/io.h"
#include "core/rng.h"
#include "data/hdf5_import.h"
#include "data/shard.h"
#include "data/vocab.h"

namespace nopad {
namespace {

namespace fs = std::filesystem;

const fs::path kVocabPath = fs::path(NOPAD_SOURCE_DIR) / "data/vocab/bert-uncased-vocab.txt";

const Vocab& bert_vocab() {
  static const Vocab v = Vocab::load(kVocabPath);
  return v;
}

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::path(testing::TempDir()) / ("nopad_hdf5_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// A random instance [CLS] A [SEP] B [SEP] of `length` tokens with up to `max_masked` ascending masked positions
// (never on [CLS] or [SEP], as BERT's data creation does).
Instance random_instance(Rng& rng, int length, int max_masked) {
  const Vocab& v = bert_vocab();
  Instance inst;
  inst.a_length = static_cast<int32_t>(rng.uniform_int(2, length - 1));
  inst.tokens.resize(static_cast<size_t>(length));
  for (auto& t : inst.tokens) t = static_cast<int32_t>(rng.uniform_int(999, v.size() - 1));
  inst.tokens[0] = v.special().cls;
  inst.tokens[static_cast<size_t>(inst.a_length - 1)] = v.special().sep;
  inst.tokens.back() = v.special().sep;
  const int want = static_cast<int>(rng.uniform_int(0, std::min(max_masked, length - 3)));
  for (int p = 1; p < length - 1 && static_cast<int>(inst.mlm_positions.size()) < want; ++p) {
    if (p == inst.a_length - 1) continue;
    if (rng.uniform() < 0.3) {
      inst.mlm_positions.push_back(p);
      inst.mlm_labels.push_back(static_cast<int32_t>(rng.uniform_int(0, v.size() - 1)));
    }
  }
  inst.nsp_label = static_cast<int32_t>(rng.uniform_int(0, 1));
  return inst;
}

std::vector<Instance> random_instances(uint64_t seed, int count, int min_len, int max_len, int max_masked) {
  Rng rng(seed);
  std::vector<Instance> out;
  for (int i = 0; i < count; ++i) {
    // Cover the extremes explicitly, the rest at random.
    const int len = i == 0 ? min_len : i == 1 ? max_len : static_cast<int>(rng.uniform_int(min_len, max_len));
    out.push_back(random_instance(rng, len, max_masked));
  }
  return out;
}

std::vector<int64_t> segment_ids(const Instance& inst) {
  std::vector<int64_t> s(inst.tokens.size(), 1);
  for (int i = 0; i < inst.a_length; ++i) s[static_cast<size_t>(i)] = 0;
  return s;
}

// --------------------------------------------------------------------------------------- HDF5 writing (C API)

class H5Out {
 public:
  explicit H5Out(const fs::path& path) {
    id_ = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    if (id_ < 0) throw std::runtime_error("cannot create " + path.string());
  }
  ~H5Out() { H5Fclose(id_); }

  // A fixed dataset of shape dims (rank 1 or 2) stored as `file_type`, from int64 values.
  void fixed(const char* name, hid_t file_type, std::vector<hsize_t> dims, const std::vector<int64_t>& values) {
    const hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
    const hid_t ds = H5Dcreate2(id_, name, file_type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    check(ds >= 0, name);
    check(H5Dwrite(ds, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) >= 0, name);
    H5Dclose(ds);
    H5Sclose(space);
  }
  void floats(const char* name, std::vector<hsize_t> dims, const std::vector<double>& values) {
    const hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
    const hid_t ds = H5Dcreate2(id_, name, H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    check(ds >= 0, name);
    check(H5Dwrite(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) >= 0, name);
    H5Dclose(ds);
    H5Sclose(space);
  }
  // A 1-D dataset of variable-length rows of `base_type` (gzip-compressed, chunked, as NVIDIA's scripts write).
  void vlen(const char* name, hid_t base_type, const std::vector<std::vector<int64_t>>& rows) {
    const hsize_t n = rows.size();
    const hid_t space = H5Screate_simple(1, &n, nullptr);
    const hid_t ftype = H5Tvlen_create(base_type);
    const hid_t mtype = H5Tvlen_create(H5T_NATIVE_INT64);
    const hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    const hsize_t chunk = std::max<hsize_t>(1, std::min<hsize_t>(n, 64));
    H5Pset_chunk(dcpl, 1, &chunk);
    H5Pset_deflate(dcpl, 4);
    const hid_t ds = H5Dcreate2(id_, name, ftype, space, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    check(ds >= 0, name);
    std::vector<hvl_t> buf(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) buf[i] = hvl_t{rows[i].size(), const_cast<int64_t*>(rows[i].data())};
    check(H5Dwrite(ds, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data()) >= 0, name);
    H5Dclose(ds);
    H5Pclose(dcpl);
    H5Tclose(mtype);
    H5Tclose(ftype);
    H5Sclose(space);
  }

 private:
  static void check(bool ok, const char* name) {
    if (!ok) throw std::runtime_error(std::string("HDF5 write of ") + name + " failed");
  }
  hid_t id_;
};

constexpr int kSeqLen = 512, kMaxPred = 76;

// Optional damage to apply while writing, to test rejection.
struct Damage {
  std::string skip_field;          // leave this dataset out
  std::string float_field;         // write this dataset as float32
  bool short_labels = false;       // next_sentence_labels with one row fewer
  bool holey_mask = false;         // row 0's input_mask 1..1 0 1 0..0
  bool position_out_of_range = false;  // row 0's last masked position beyond the sequence
};

void write_fixed(const fs::path& path, const std::vector<Instance>& insts, const Damage& dmg = {}) {
  const size_t n = insts.size();
  std::vector<int64_t> ids(n * kSeqLen, 0), mask(n * kSeqLen, 0), segs(n * kSeqLen, 0), pos(n * kMaxPred, 0),
      lab(n * kMaxPred, 0), nsp(n, 0);
  for (size_t i = 0; i < n; ++i) {
    const Instance& in = insts[i];
    const auto s = segment_ids(in);
    for (size_t j = 0; j < in.tokens.size(); ++j) {
      ids[i * kSeqLen + j] = in.tokens[j];
      mask[i * kSeqLen + j] = 1;
      segs[i * kSeqLen + j] = s[j];
    }
    for (size_t k = 0; k < in.mlm_positions.size(); ++k) {
      pos[i * kMaxPred + k] = in.mlm_positions[k];
      lab[i * kMaxPred + k] = in.mlm_labels[k];
    }
    nsp[i] = in.nsp_label;
  }
  if (dmg.holey_mask) mask[insts[0].tokens.size() + 1] = 1;  // a 1 after the first 0
  if (dmg.position_out_of_range) {
    const size_t k = insts[0].mlm_positions.size() - 1;
    pos[k] = static_cast<int64_t>(insts[0].tokens.size()) + 3;
  }
  H5Out f(path);
  const hsize_t N = n;
  auto put = [&](const char* name, hid_t type, std::vector<hsize_t> dims, const std::vector<int64_t>& v) {
    if (dmg.skip_field == name) return;
    if (dmg.float_field == name) return f.floats(name, dims, std::vector<double>(v.begin(), v.end()));
    f.fixed(name, type, dims, v);
  };
  put("input_ids", H5T_STD_I16LE, {N, kSeqLen}, ids);
  put("input_mask", H5T_STD_I8LE, {N, kSeqLen}, mask);
  put("segment_ids", H5T_STD_I8LE, {N, kSeqLen}, segs);
  put("masked_lm_positions", H5T_STD_I16LE, {N, kMaxPred}, pos);
  put("masked_lm_ids", H5T_STD_I16LE, {N, kMaxPred}, lab);
  if (dmg.short_labels) nsp.pop_back();
  put("next_sentence_labels", H5T_STD_I8LE, {dmg.short_labels ? N - 1 : N}, nsp);
}

template <class T>
std::vector<int64_t> widen(const std::vector<T>& v) {
  return {v.begin(), v.end()};
}

// Variable-length layout; wide = true stores ids as uint32 / int64 to check that any integer width is accepted.
void write_variable(const fs::path& path, const std::vector<Instance>& insts, bool wide = false) {
  std::vector<std::vector<int64_t>> ids, segs, pos, lab;
  std::vector<int64_t> nsp;
  for (const Instance& in : insts) {
    ids.push_back(widen(in.tokens));
    segs.push_back(segment_ids(in));
    pos.push_back(widen(in.mlm_positions));
    lab.push_back(widen(in.mlm_labels));
    nsp.push_back(in.nsp_label);
  }
  H5Out f(path);
  f.vlen("input_ids", wide ? H5T_STD_U32LE : H5T_STD_I16LE, ids);
  f.vlen("segment_ids", H5T_STD_I8LE, segs);
  f.vlen("masked_lm_positions", wide ? H5T_STD_I64LE : H5T_STD_I16LE, pos);
  f.vlen("masked_lm_ids", H5T_STD_I16LE, lab);
  f.fixed("next_sentence_labels", wide ? H5T_STD_U8LE : H5T_STD_I8LE, {insts.size()}, nsp);
}

// Packed layout: rows of 1, 2, 3, 1, 2, 3... sequences; returns the number of rows.
size_t write_packed(const fs::path& path, const std::vector<Instance>& insts, bool bad_lengths = false) {
  std::vector<std::vector<int64_t>> ids, segs, pos, lab, lens, mlens, nsp;
  size_t next = 0;
  for (size_t r = 0; next < insts.size(); ++r) {
    const size_t k = std::min<size_t>(1 + r % 3, insts.size() - next);
    std::vector<int64_t> rid, rseg, rpos, rlab, rlen, rmlen, rnsp;
    for (size_t j = 0; j < k; ++j) {
      const Instance& in = insts[next++];
      const int64_t offset = static_cast<int64_t>(rid.size());
      const auto s = segment_ids(in);
      rid.insert(rid.end(), in.tokens.begin(), in.tokens.end());
      rseg.insert(rseg.end(), s.begin(), s.end());
      for (size_t m = 0; m < in.mlm_positions.size(); ++m) {
        rpos.push_back(in.mlm_positions[m] + offset);
        rlab.push_back(in.mlm_labels[m]);
      }
      rlen.push_back(static_cast<int64_t>(in.tokens.size()));
      rmlen.push_back(static_cast<int64_t>(in.mlm_positions.size()));
      rnsp.push_back(in.nsp_label);
    }
    ids.push_back(rid), segs.push_back(rseg), pos.push_back(rpos), lab.push_back(rlab);
    lens.push_back(rlen), mlens.push_back(rmlen), nsp.push_back(rnsp);
  }
  if (bad_lengths) lens[0][0] += 1;
  H5Out f(path);
  f.vlen("input_ids", H5T_STD_I16LE, ids);
  f.vlen("segment_ids", H5T_STD_I8LE, segs);
  f.vlen("masked_lm_positions", H5T_STD_I16LE, pos);
  f.vlen("masked_lm_ids", H5T_STD_I16LE, lab);
  f.vlen("packed_input_len", H5T_STD_I16LE, lens);
  f.vlen("packed_masked_lm_len", H5T_STD_I16LE, mlens);
  f.vlen("next_sentence_labels", H5T_STD_I8LE, nsp);
  return ids.size();
}

// ----------------------------------------------------------------------------------------------- helpers

void expect_same(const Instance& want, const Instance& got, size_t index) {
  SCOPED_TRACE("sample " + std::to_string(index));
  EXPECT_EQ(want.tokens, got.tokens);
  EXPECT_EQ(want.a_length, got.a_length);
  EXPECT_EQ(want.nsp_label, got.nsp_label);
  EXPECT_EQ(want.mlm_positions, got.mlm_positions);
  EXPECT_EQ(want.mlm_labels, got.mlm_labels);
}

int run_convert(const std::vector<fs::path>& inputs, const fs::path& out, const std::string& extra,
                const fs::path& log) {
  std::string cmd = NOPAD_BINARY;
  for (const std::string& part : {std::string(" convert --vocab "), kVocabPath.string(), std::string(" --output "),
                                  out.string(), " " + extra, std::string(" --from-hdf5")})
    cmd.append(part);
  for (const auto& p : inputs) cmd.append(" ").append(p.string());
  cmd.append(" > ").append(log.string()).append(" 2>&1");
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::vector<Instance> read_all_shards(const fs::path& dir) {
  std::vector<Instance> out;
  for (const fs::path& p : list_shards(dir)) {
    ShardReader r(p, ShardReader::Options{true, bert_vocab().checksum()});
    r.validate_samples();
    for (uint64_t i = 0; i < r.num_seqs(); ++i) out.push_back(r.sample(i).to_instance());
  }
  return out;
}

size_t count_shards(const fs::path& dir) {
  size_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.path().extension() == kShardExtension || e.path().filename() == "dataset.json") ++n;
  return n;
}

Hdf5ImportOptions import_options() {
  Hdf5ImportOptions o;
  o.vocab_size = bert_vocab().size();
  o.cls_id = bert_vocab().special().cls;
  o.sep_id = bert_vocab().special().sep;
  o.rows_per_block = 7;  // several blocks even in small test files
  return o;
}

// ------------------------------------------------------------------------------------------------- tests

TEST(Hdf5Import, ReadsAllThreeLayoutsExactly) {
  const fs::path dir = fresh_dir("layouts");
  const auto fixed = random_instances(11, 40, 8, 512, kMaxPred);
  const auto variable = random_instances(12, 40, 8, 512, 80);
  const auto packed = random_instances(13, 41, 8, 512, 80);
  write_fixed(dir / "fixed.hdf5", fixed);
  write_variable(dir / "variable.hdf5", variable);
  write_variable(dir / "wide.hdf5", variable, /*wide=*/true);
  const size_t packed_rows = write_packed(dir / "packed.hdf5", packed);

  EXPECT_EQ(detect_hdf5_layout(dir / "fixed.hdf5"), Hdf5Layout::kFixed);
  EXPECT_EQ(detect_hdf5_layout(dir / "variable.hdf5"), Hdf5Layout::kVariable);
  EXPECT_EQ(detect_hdf5_layout(dir / "packed.hdf5"), Hdf5Layout::kPacked);

  struct Case {
    const char* file;
    const std::vector<Instance>* want;
    size_t rows;
  };
  for (const Case& c : {Case{"fixed.hdf5", &fixed, fixed.size()}, Case{"variable.hdf5", &variable, variable.size()},
                        Case{"wide.hdf5", &variable, variable.size()}, Case{"packed.hdf5", &packed, packed_rows}}) {
    SCOPED_TRACE(c.file);
    Hdf5FileSummary s;
    const auto got = read_hdf5_file(dir / c.file, import_options(), &s);
    ASSERT_EQ(got.size(), c.want->size());
    EXPECT_EQ(s.num_rows, c.rows);
    EXPECT_EQ(s.num_seqs, c.want->size());
    for (size_t i = 0; i < got.size(); ++i) expect_same((*c.want)[i], got[i], i);
  }
  EXPECT_LT(packed_rows, packed.size());  // some rows really held several sequences
  fs::remove_all(dir);
}

TEST(Hdf5Convert, ConvertsAllLayoutsIntoShards) {
  const fs::path dir = fresh_dir("convert");
  const auto fixed = random_instances(21, 30, 8, 512, kMaxPred);
  const auto variable = random_instances(22, 35, 8, 512, 80);
  const auto packed = random_instances(23, 37, 8, 512, 80);
  write_fixed(dir / "a_fixed.hdf5", fixed);
  write_variable(dir / "b_part_00000_of_04320.hdf5", variable);
  write_packed(dir / "c_packed.hdf5", packed);
  const fs::path out = dir / "shards";
  const int rc = run_convert({dir / "a_fixed.hdf5", dir / "b_part_00000_of_04320.hdf5", dir / "c_packed.hdf5"}, out,
                             "--seqs-per-shard 25 --threads 2", dir / "log.txt");
  ASSERT_EQ(rc, 0) << read_file(dir / "log.txt");

  std::vector<Instance> want = fixed;
  want.insert(want.end(), variable.begin(), variable.end());
  want.insert(want.end(), packed.begin(), packed.end());
  const auto shards = list_shards(out);
  ASSERT_EQ(shards.size(), (want.size() + 24) / 25);
  EXPECT_EQ(shards.front().filename(), "shard_00000.nopad");
  const auto got = read_all_shards(out);
  ASSERT_EQ(got.size(), want.size());
  uint64_t tokens = 0, masked = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    expect_same(want[i], got[i], i);
    tokens += want[i].tokens.size();
    masked += want[i].mlm_positions.size();
  }

  const auto manifest = nlohmann::json::parse(read_file(out / "dataset.json"));
  EXPECT_EQ(manifest["format"], "nopad-shards");
  EXPECT_EQ(manifest["version"], 1);
  EXPECT_EQ(manifest["source"], "hdf5");
  EXPECT_EQ(manifest["inputs"].size(), 3u);
  EXPECT_EQ(manifest["inputs"][2]["layout"], "packed");
  EXPECT_EQ(manifest["num_shards"], shards.size());
  EXPECT_EQ(manifest["num_seqs"], want.size());
  EXPECT_EQ(manifest["num_tokens"], tokens);
  EXPECT_EQ(manifest["num_masked"], masked);
  EXPECT_EQ(manifest["vocab_size"], bert_vocab().size());
  EXPECT_EQ(manifest["vocab_checksum"], bert_vocab().checksum());
  // Nothing but shards, the manifest and the vocabulary is left behind (no staging folder).
  size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(out)) ++entries;
  EXPECT_EQ(entries, shards.size() + 2);
  EXPECT_EQ(read_file(out / "vocab.txt"), read_file(kVocabPath));
  EXPECT_EQ(manifest["vocab_file"], "vocab.txt");
  EXPECT_EQ(manifest["do_lower_case"], true);

  // A second conversion into the same folder is refused rather than mixing datasets, and changes nothing.
  const std::string manifest_before = read_file(out / "dataset.json");
  EXPECT_NE(run_convert({dir / "a_fixed.hdf5"}, out, "", dir / "log2.txt"), 0);
  EXPECT_NE(read_file(dir / "log2.txt").find("already holds a dataset"), std::string::npos);
  EXPECT_NE(read_file(dir / "log2.txt").find("--overwrite"), std::string::npos);
  EXPECT_EQ(read_file(out / "dataset.json"), manifest_before);
  EXPECT_EQ(list_shards(out).size(), shards.size());
  // With --overwrite the folder then holds exactly the new dataset: the old shards beyond its count are gone.
  ASSERT_EQ(run_convert({dir / "a_fixed.hdf5"}, out, "--overwrite --seqs-per-shard 1000", dir / "log3.txt"), 0)
      << read_file(dir / "log3.txt");
  const auto replaced = read_all_shards(out);
  ASSERT_EQ(replaced.size(), fixed.size());
  for (size_t i = 0; i < fixed.size(); ++i) expect_same(fixed[i], replaced[i], i);
  EXPECT_EQ(list_shards(out).size(), 1u);
  EXPECT_EQ(nlohmann::json::parse(read_file(out / "dataset.json"))["num_seqs"], fixed.size());
  fs::remove_all(dir);
}

struct BadCase {
  const char* name;
  Damage damage;
  const char* field;  // the dataset the error must name
  bool packed_lengths = false;
};

class Hdf5BadInput : public testing::TestWithParam<BadCase> {};

TEST_P(Hdf5BadInput, FailsNamingFileAndFieldAndLeavesNoShard) {
  const BadCase& c = GetParam();
  const fs::path dir = fresh_dir(std::string("bad_") + c.name);
  // A good file first, so that a shard would exist if conversion were not all-or-nothing.
  const auto good = random_instances(31, 10, 8, 64, 10);
  write_variable(dir / "good.hdf5", good);
  auto insts = random_instances(32, 10, 16, 128, 10);
  for (auto& in : insts)
    if (in.mlm_positions.empty()) {  // position_out_of_range needs a masked entry in row 0
      in.mlm_positions = {1};
      in.mlm_labels = {5};
    }
  const fs::path bad = dir / (std::string(c.name) + ".hdf5");
  if (c.packed_lengths)
    write_packed(bad, insts, /*bad_lengths=*/true);
  else
    write_fixed(bad, insts, c.damage);

  try {
    read_hdf5_file(bad, import_options());
    FAIL() << "no error for " << c.name;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(bad.string()), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::string("'") + c.field + "'"), std::string::npos) << msg;
  }

  const fs::path out = dir / "shards";
  EXPECT_EQ(run_convert({dir / "good.hdf5", bad}, out, "--seqs-per-shard 3", dir / "log.txt"), 1);
  const std::string log = read_file(dir / "log.txt");
  EXPECT_NE(log.find(c.field), std::string::npos) << log;
  EXPECT_NE(log.find(bad.filename().string()), std::string::npos) << log;
  EXPECT_EQ(count_shards(out), 0u) << "a failed conversion left shards behind";
  fs::remove_all(dir);
}

Damage damage(void (*set)(Damage&)) {
  Damage d;
  set(d);
  return d;
}

INSTANTIATE_TEST_SUITE_P(
    Hdf5, Hdf5BadInput,
    testing::Values(
        BadCase{"missing_field", damage([](Damage& d) { d.skip_field = "segment_ids"; }), "segment_ids"},
        BadCase{"float_dtype", damage([](Damage& d) { d.float_field = "input_ids"; }), "input_ids"},
        BadCase{"row_counts", damage([](Damage& d) { d.short_labels = true; }), "next_sentence_labels"},
        BadCase{"holey_mask", damage([](Damage& d) { d.holey_mask = true; }), "input_mask"},
        BadCase{"position_out_of_range", damage([](Damage& d) { d.position_out_of_range = true; }),
                "masked_lm_positions"},
        BadCase{"packed_lengths", Damage{}, "packed_input_len", true}),
    [](const testing::TestParamInfo<BadCase>& info) { return std::string(info.param.name); });

TEST(Hdf5Import, RejectsTokenIdsOutsideTheVocabulary) {
  const fs::path dir = fresh_dir("vocab");
  write_variable(dir / "v.hdf5", random_instances(41, 5, 8, 64, 5));
  Hdf5ImportOptions o = import_options();
  o.vocab_size = 1000;  // the random tokens are >= 999
  try {
    read_hdf5_file(dir / "v.hdf5", o);
    FAIL() << "token ids beyond the vocabulary were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'input_ids'"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace nopad
