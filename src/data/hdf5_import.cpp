// Reads NVIDIA / MLPerf BERT HDF5 files (fixed, variable-length and packed layouts) into Instances; see hdf5_import.h.
// Every HDF5 call's status is checked; data is read in blocks of rows through native int32 memory types, so any
// integer width converts (out-of-range values saturate and then fail the range checks below).
#include "data/hdf5_import.h"

#include <hdf5.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <span>
#include <utility>

#include "core/error.h"
#include "data/record_check.h"

namespace nopad {

namespace {

// HDF5 calls are serialised: the library takes a global lock in thread-safe builds anyway, and is unsafe otherwise.
std::mutex& hdf5_mutex() {
  static std::mutex m;
  return m;
}

// Silences HDF5's own error-stack printing while we hold the lock; every status is checked and reported by us.
class QuietHdf5 {
 public:
  QuietHdf5() {
    H5Eget_auto2(H5E_DEFAULT, &func_, &data_);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~QuietHdf5() { H5Eset_auto2(H5E_DEFAULT, func_, data_); }

 private:
  H5E_auto2_t func_ = nullptr;
  void* data_ = nullptr;
};

// Owns one HDF5 identifier and closes it with the matching H5*close.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  Handle(Handle&& o) noexcept : id_(std::exchange(o.id_, -1)), closer_(o.closer_) {}
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = std::exchange(o.id_, -1);
      closer_ = o.closer_;
    }
    return *this;
  }
  ~Handle() { reset(); }
  hid_t get() const { return id_; }

 private:
  void reset() {
    if (id_ >= 0 && closer_) closer_(id_);
    id_ = -1;
  }
  hid_t id_ = -1;
  Closer closer_ = nullptr;
};

constexpr const char* kHint = " (is this a BERT pre-training file written by NVIDIA's or MLPerf's scripts?)";

// Rows of one field: row i is flat[offsets[i], offsets[i+1]).
struct Rows {
  std::vector<int32_t> flat;
  std::vector<uint64_t> offsets{0};
  std::span<const int32_t> row(size_t i) const {
    return {flat.data() + offsets[i], static_cast<size_t>(offsets[i + 1] - offsets[i])};
  }
};

struct Dataset {
  std::string name;
  Handle id;
  bool vlen = false;
  std::vector<hsize_t> dims;
};

class Hdf5Reader {
 public:
  explicit Hdf5Reader(const std::filesystem::path& path) : name_(path.string()) {
    std::error_code ec;
    NOPAD_CHECK(std::filesystem::is_regular_file(path, ec), "HDF5 file ", name_, " does not exist");
    const htri_t is_h5 = H5Fis_hdf5(name_.c_str());
    NOPAD_CHECK(is_h5 > 0, "file ", name_, " is not an HDF5 file (or cannot be read)", kHint);
    file_ = Handle(H5Fopen(name_.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    NOPAD_CHECK(file_.get() >= 0, "cannot open HDF5 file ", name_, " for reading");
  }

  const std::string& name() const { return name_; }

  bool has(const char* field) const {
    const htri_t e = H5Lexists(file_.get(), field, H5P_DEFAULT);
    NOPAD_CHECK(e >= 0, "HDF5 file ", name_, ": cannot look up dataset '", field, "'");
    return e > 0;
  }

  // Opens `field`, checks integer (or vlen-of-integer) type and the expected rank and vlen-ness.
  Dataset open(const char* field, bool want_vlen, int min_rank, int max_rank) const {
    NOPAD_CHECK(has(field), "HDF5 file ", name_, " has no dataset '", field, "'", kHint);
    Dataset d;
    d.name = field;
    d.id = Handle(H5Dopen2(file_.get(), field, H5P_DEFAULT), H5Dclose);
    NOPAD_CHECK(d.id.get() >= 0, "HDF5 file ", name_, ": cannot open dataset '", field, "'");
    Handle type(H5Dget_type(d.id.get()), H5Tclose);
    NOPAD_CHECK(type.get() >= 0, "HDF5 file ", name_, ": cannot read the type of dataset '", field, "'");
    const H5T_class_t cls = H5Tget_class(type.get());
    NOPAD_CHECK(cls != H5T_NO_CLASS, "HDF5 file ", name_, ": cannot read the type class of dataset '", field, "'");
    H5T_class_t elem_cls = cls;
    d.vlen = cls == H5T_VLEN;
    if (d.vlen) {
      Handle super(H5Tget_super(type.get()), H5Tclose);
      NOPAD_CHECK(super.get() >= 0, "HDF5 file ", name_, ": cannot read the element type of dataset '", field, "'");
      elem_cls = H5Tget_class(super.get());
    }
    NOPAD_CHECK(elem_cls == H5T_INTEGER, "HDF5 file ", name_, ": dataset '", field, "' has ",
                elem_cls == H5T_FLOAT ? "a floating-point" : "a non-integer", " element type; expected integers",
                kHint);
    NOPAD_CHECK(d.vlen == want_vlen, "HDF5 file ", name_, ": dataset '", field, "' is ",
                d.vlen ? "variable-length" : "fixed-length", " but this file's layout needs it ",
                want_vlen ? "variable-length" : "fixed-length", kHint);
    Handle space(H5Dget_space(d.id.get()), H5Sclose);
    NOPAD_CHECK(space.get() >= 0, "HDF5 file ", name_, ": cannot read the shape of dataset '", field, "'");
    const int rank = H5Sget_simple_extent_ndims(space.get());
    NOPAD_CHECK(rank >= min_rank && rank <= max_rank, "HDF5 file ", name_, ": dataset '", field, "' has rank ", rank,
                ", expected ", min_rank == max_rank ? std::to_string(min_rank) : str_cat(min_rank, " or ", max_rank),
                kHint);
    d.dims.resize(static_cast<size_t>(rank));
    NOPAD_CHECK(H5Sget_simple_extent_dims(space.get(), d.dims.data(), nullptr) == rank, "HDF5 file ", name_,
                ": cannot read the dimensions of dataset '", field, "'");
    return d;
  }

  // Rows [row0, row0 + count) of `d`: a fixed dataset gives dims[1] (or 1) values per row, a vlen one its row.
  Rows read(const Dataset& d, hsize_t row0, hsize_t count) const {
    Rows out;
    Handle fspace(H5Dget_space(d.id.get()), H5Sclose);
    NOPAD_CHECK(fspace.get() >= 0, "HDF5 file ", name_, ": cannot read the shape of dataset '", d.name, "'");
    const hsize_t cols = d.dims.size() == 2 ? d.dims[1] : 1;
    std::vector<hsize_t> start(d.dims.size(), 0), cnt = d.dims;
    start[0] = row0;
    cnt[0] = count;
    NOPAD_CHECK(H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start.data(), nullptr, cnt.data(), nullptr) >= 0,
                "HDF5 file ", name_, ": cannot select rows ", row0, "..", row0 + count, " of dataset '", d.name, "'");
    Handle mspace(H5Screate_simple(static_cast<int>(cnt.size()), cnt.data(), nullptr), H5Sclose);
    NOPAD_CHECK(mspace.get() >= 0, "HDF5 file ", name_, ": cannot create a memory space for '", d.name, "'");
    if (!d.vlen) {
      out.flat.resize(static_cast<size_t>(count * cols));
      if (count > 0)
        NOPAD_CHECK(H5Dread(d.id.get(), H5T_NATIVE_INT32, mspace.get(), fspace.get(), H5P_DEFAULT, out.flat.data()) >= 0,
                    "HDF5 file ", name_, ": cannot read rows ", row0, "..", row0 + count, " of dataset '", d.name,
                    "' (damaged file or unsupported compression filter?)");
      out.offsets.resize(static_cast<size_t>(count + 1));
      for (hsize_t i = 0; i <= count; ++i) out.offsets[i] = i * cols;
      return out;
    }
    Handle mtype(H5Tvlen_create(H5T_NATIVE_INT32), H5Tclose);
    NOPAD_CHECK(mtype.get() >= 0, "HDF5 file ", name_, ": cannot create a vlen memory type");
    std::vector<hvl_t> buf(static_cast<size_t>(count));
    if (count == 0) return out;
    NOPAD_CHECK(H5Dread(d.id.get(), mtype.get(), mspace.get(), fspace.get(), H5P_DEFAULT, buf.data()) >= 0,
                "HDF5 file ", name_, ": cannot read rows ", row0, "..", row0 + count, " of dataset '", d.name,
                "' (damaged file or unsupported compression filter?)");
    size_t total = 0;
    for (const hvl_t& v : buf) total += v.len;
    out.flat.reserve(total);
    out.offsets.reserve(buf.size() + 1);
    for (const hvl_t& v : buf) {
      const auto* p = static_cast<const int32_t*>(v.p);
      out.flat.insert(out.flat.end(), p, p + v.len);
      out.offsets.push_back(out.flat.size());
    }
#if H5_VERSION_GE(1, 12, 0)
    const herr_t freed = H5Treclaim(mtype.get(), mspace.get(), H5P_DEFAULT, buf.data());
#else
    const herr_t freed = H5Dvlen_reclaim(mtype.get(), mspace.get(), H5P_DEFAULT, buf.data());
#endif
    NOPAD_CHECK(freed >= 0, "HDF5 file ", name_, ": cannot release vlen rows of dataset '", d.name, "'");
    return out;
  }

  Hdf5Layout detect() const {
    if (has("input_mask")) return Hdf5Layout::kFixed;
    if (has("packed_input_len")) return Hdf5Layout::kPacked;
    return Hdf5Layout::kVariable;
  }

 private:
  std::string name_;
  Handle file_;
};

}  // namespace

const char* hdf5_layout_name(Hdf5Layout layout) {
  switch (layout) {
    case Hdf5Layout::kFixed: return "fixed";
    case Hdf5Layout::kVariable: return "variable";
    case Hdf5Layout::kPacked: return "packed";
  }
  return "?";
}

Hdf5Layout detect_hdf5_layout(const std::filesystem::path& path) {
  std::lock_guard<std::mutex> lock(hdf5_mutex());
  QuietHdf5 quiet;
  return Hdf5Reader(path).detect();
}

Hdf5FileSummary read_hdf5_instances(const std::filesystem::path& path, const Hdf5ImportOptions& opt,
                                    const std::function<void(Instance&&)>& sink) {
  NOPAD_CHECK(opt.vocab_size > 0, "HDF5 import of ", path.string(), ": vocabulary size must be positive");
  NOPAD_CHECK(opt.rows_per_block > 0, "HDF5 import: rows_per_block must be positive");
  std::unique_lock<std::mutex> lock(hdf5_mutex());
  std::optional<QuietHdf5> quiet(std::in_place);
  Hdf5Reader r(path);
  const std::string& file = r.name();
  Hdf5FileSummary summary;
  summary.layout = r.detect();
  const bool fixed = summary.layout == Hdf5Layout::kFixed;
  const bool packed = summary.layout == Hdf5Layout::kPacked;

  // Open and check every field of the layout before reading any data.
  std::vector<Dataset> ds;
  const int seq_rank = fixed ? 2 : 1;
  ds.push_back(r.open("input_ids", !fixed, seq_rank, seq_rank));
  ds.push_back(r.open("segment_ids", !fixed, seq_rank, seq_rank));
  ds.push_back(r.open("masked_lm_positions", !fixed, seq_rank, seq_rank));
  ds.push_back(r.open("masked_lm_ids", !fixed, seq_rank, seq_rank));
  ds.push_back(r.open("next_sentence_labels", packed, 1, packed ? 1 : 2));
  if (fixed) ds.push_back(r.open("input_mask", false, 2, 2));
  if (packed) {
    ds.push_back(r.open("packed_input_len", true, 1, 1));
    ds.push_back(r.open("packed_masked_lm_len", true, 1, 1));
  }
  // Whatever happens below (including an exception while parsing unlocked), datasets and file close under the lock.
  struct Relock {
    std::unique_lock<std::mutex>& lock;
    std::optional<QuietHdf5>& quiet;
    ~Relock() {
      if (!lock.owns_lock()) {
        lock.lock();
        quiet.emplace();
      }
    }
  } relock{lock, quiet};
  const hsize_t num_rows = ds[0].dims[0];
  for (const Dataset& d : ds)
    NOPAD_CHECK(d.dims[0] == num_rows, "HDF5 file ", file, ": dataset '", d.name, "' has ", d.dims[0],
                " rows but input_ids has ", num_rows, " (mismatched row counts)", kHint);
  if (ds[4].dims.size() == 2)
    NOPAD_CHECK(ds[4].dims[1] == 1, "HDF5 file ", file, ": dataset 'next_sentence_labels' has shape [", num_rows, ",",
                ds[4].dims[1], "], expected [", num_rows, "] or [", num_rows, ",1]");
  if (fixed) {
    for (int f : {1, 5})
      NOPAD_CHECK(ds[f].dims[1] == ds[0].dims[1], "HDF5 file ", file, ": dataset '", ds[f].name, "' has ",
                  ds[f].dims[1], " columns but input_ids has ", ds[0].dims[1]);
    NOPAD_CHECK(ds[3].dims[1] == ds[2].dims[1], "HDF5 file ", file, ": dataset 'masked_lm_ids' has ", ds[3].dims[1],
                " columns but masked_lm_positions has ", ds[2].dims[1]);
  }
  summary.num_rows = num_rows;

  const InstanceRules rules{opt.vocab_size, opt.cls_id, opt.sep_id};
  auto place = [&](uint64_t row, int packed_index) {
    return RecordPlace{"HDF5 file", file, "dataset", "row", row, packed_index, kHint};
  };
  auto emit = [&](Instance&& inst) {
    ++summary.num_seqs;
    summary.num_tokens += inst.tokens.size();
    summary.num_masked += inst.mlm_positions.size();
    sink(std::move(inst));
  };

  const hsize_t block = static_cast<hsize_t>(opt.rows_per_block);
  for (hsize_t row0 = 0; row0 < num_rows; row0 += block) {
    const hsize_t count = std::min(block, num_rows - row0);
    if (!lock.owns_lock()) {
      lock.lock();
      quiet.emplace();
    }
    std::vector<Rows> rows;
    for (const Dataset& d : ds) rows.push_back(r.read(d, row0, count));
    // Parse and validate without holding the HDF5 lock, so other files' reads proceed meanwhile.
    quiet.reset();
    lock.unlock();

    const Rows &ids = rows[0], &segs = rows[1], &pos = rows[2], &lab = rows[3], &nsp = rows[4];
    for (hsize_t i = 0; i < count; ++i) {
      const uint64_t row = row0 + i;
      const RecordPlace w = place(row, -1);
      if (!packed) {
        std::span<const int32_t> tokens = ids.row(i), segments = segs.row(i);
        if (fixed) {
          // Real length = sum(input_mask); the mask must be 1..1 0..0.
          const auto mask = rows[5].row(i);
          size_t len = 0;
          while (len < mask.size() && mask[len] == 1) ++len;
          for (size_t j = len; j < mask.size(); ++j)
            if (mask[j] != 0)
              bad(w, "input_mask", "mask value ", mask[j], " at position ", j, " is not of the form 1..1 0..0");
          tokens = tokens.first(len);
          segments = segments.first(len);
        }
        const auto positions = pos.row(i), labels = lab.row(i);
        if (!fixed && labels.size() != positions.size())
          bad(w, "masked_lm_ids", labels.size(), " masked labels but ", positions.size(), " masked positions");
        const size_t k = unpadded_masked_count(w, positions);
        emit(make_checked_instance(w, tokens, segments, positions.first(k), labels.first(k), nsp.row(i)[0], 0, rules));
        continue;
      }
      // Packed row: split by packed_input_len / packed_masked_lm_len, one NSP label per sequence.
      const auto tokens = ids.row(i), segments = segs.row(i), positions = pos.row(i), labels = lab.row(i);
      const auto seq_lens = rows[5].row(i), masked_lens = rows[6].row(i), labels_nsp = nsp.row(i);
      if (seq_lens.empty()) bad(w, "packed_input_len", "row holds no sequence");
      if (masked_lens.size() != seq_lens.size())
        bad(w, "packed_masked_lm_len", masked_lens.size(), " entries but packed_input_len has ", seq_lens.size());
      if (labels_nsp.size() != seq_lens.size())
        bad(w, "next_sentence_labels", labels_nsp.size(), " entries but packed_input_len has ", seq_lens.size());
      if (segments.size() != tokens.size())
        bad(w, "segment_ids", segments.size(), " entries but input_ids has ", tokens.size());
      if (labels.size() != positions.size())
        bad(w, "masked_lm_ids", labels.size(), " masked labels but ", positions.size(), " masked positions");
      int64_t len_sum = 0, masked_sum = 0;
      for (size_t j = 0; j < seq_lens.size(); ++j) {
        if (seq_lens[j] < 2) bad(w, "packed_input_len", "sequence ", j, " has length ", seq_lens[j]);
        if (masked_lens[j] < 0) bad(w, "packed_masked_lm_len", "sequence ", j, " has ", masked_lens[j], " masks");
        len_sum += seq_lens[j];
        masked_sum += masked_lens[j];
      }
      if (len_sum != static_cast<int64_t>(tokens.size()))
        bad(w, "packed_input_len", "lengths sum to ", len_sum, " but the row has ", tokens.size(), " tokens");
      if (masked_sum != static_cast<int64_t>(positions.size()))
        bad(w, "packed_masked_lm_len", "counts sum to ", masked_sum, " but the row has ", positions.size(),
            " masked positions");
      size_t tok_off = 0, mask_off = 0;
      for (size_t j = 0; j < seq_lens.size(); ++j) {
        const size_t len = static_cast<size_t>(seq_lens[j]), nm = static_cast<size_t>(masked_lens[j]);
        const RecordPlace wj = place(row, static_cast<int>(j));
        emit(make_checked_instance(wj, tokens.subspan(tok_off, len), segments.subspan(tok_off, len),
                           positions.subspan(mask_off, nm), labels.subspan(mask_off, nm), labels_nsp[j],
                           static_cast<int64_t>(tok_off), rules));
        tok_off += len;
        mask_off += nm;
      }
    }
  }
  return summary;
}

std::vector<Instance> read_hdf5_file(const std::filesystem::path& path, const Hdf5ImportOptions& options,
                                     Hdf5FileSummary* summary) {
  std::vector<Instance> out;
  const Hdf5FileSummary s = read_hdf5_instances(path, options, [&](Instance&& inst) { out.push_back(std::move(inst)); });
  if (summary) *summary = s;
  return out;
}

}  // namespace nopad
