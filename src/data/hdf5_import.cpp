// Reads NVIDIA / MLPerf BERT HDF5 files (fixed, variable-length and packed layouts) into Instances; see hdf5_import.h.
// Every HDF5 call's status is checked, and a failure's message carries the library's own error stack (its printer is
// silenced). Fixed-size data is read in blocks of rows through native int32 memory types, so any integer width
// converts (out-of-range values saturate and then fail the range checks below).
//
// Variable-length data is never handed to libhdf5's conversion, which trusts the lengths and heap addresses stored in
// the file and faults on damaged ones. libhdf5 gives only the metadata (types, shapes, layout, filters) and the raw
// bytes of each chunk; the sequence descriptors (length, global-heap collection address, object index) and the global
// heap collections they point into are then parsed here, every length, address and size checked against the file
// (HDF5 file format specification, "Global Heap" and "Variable-length Datatype" storage), so damage is an error
// naming the file, dataset and row.
#include "data/hdf5_import.h"

#include <fcntl.h>
#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <utility>

#if NOPAD_HAVE_ZLIB
#include <zlib.h>
#endif

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

// The library's error stack for the call that just failed (its printer is off), for nopad's message: "; HDF5 says:
// H5Dopen2(): unable to open dataset <- H5O__chunk_deserialize(): bad object header version number".
herr_t collect_hdf5_error(unsigned, const H5E_error2_t* e, void* data) {
  auto* out = static_cast<std::vector<std::string>*>(data);
  char minor[160] = "";
  if (H5Eget_msg(e->min_num, nullptr, minor, sizeof minor) < 0) minor[0] = '\0';
  std::string entry = str_cat(e->func_name ? e->func_name : "?", "(): ", e->desc ? e->desc : "");
  if (minor[0] != '\0' && (e->desc == nullptr || std::strstr(e->desc, minor) == nullptr)) entry += str_cat(" (", minor, ")");
  out->push_back(std::move(entry));
  return 0;
}
std::string hdf5_says() {
  std::vector<std::string> entries;
  if (H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, collect_hdf5_error, &entries) < 0 || entries.empty()) return "";
  // Downward: from the API function called to where it failed; the first and the deepest four say most (e.g.
  // "H5Z_pipeline(): required filter 'lzf' is not registered" and the plugin search behind it).
  std::string out = "; HDF5 says: " + entries.front();
  for (size_t i = std::max<size_t>(1, entries.size() >= 5 ? entries.size() - 4 : 1); i < entries.size(); ++i)
    out += " <- " + entries[i];
  H5Eclear2(H5E_DEFAULT);
  return out;
}

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

// An HDF5 filter of a chunked dataset's pipeline (filter_mask bit k skips entry k for a chunk).
struct Filter {
  H5Z_filter_t id = 0;
  std::vector<unsigned> cd;  // client data (the shuffle's element size)
};

struct Dataset {
  std::string name;
  Handle id;
  bool vlen = false;
  std::vector<hsize_t> dims;
  // Variable-length datasets: where their descriptors are and what their elements are.
  H5D_layout_t layout = H5D_CONTIGUOUS;
  uint64_t contiguous_offset = 0;  // file offset of the descriptors (contiguous layout)
  hsize_t chunk_rows = 0;          // rows per chunk (chunked layout)
  std::vector<Filter> filters;
  size_t elem_bytes = 0;  // an element's width in the file: 1, 2, 4 or 8 bytes
  bool elem_signed = true, elem_big_endian = false;
  // The last chunk's decoded descriptors (rows are read in order, so each chunk is decoded once).
  hsize_t cached_chunk = ~hsize_t{0};
  std::vector<uint8_t> chunk_bytes;
};

// Little-endian unsigned integer of `n` (<= 8) bytes: the byte order of HDF5's own structures.
uint64_t read_le(const uint8_t* p, size_t n) {
  uint64_t v = 0;
  for (size_t i = n; i-- > 0;) v = (v << 8) | p[i];
  return v;
}

// One global heap collection ("GCOL"): its bytes and where each object's data lies in them.
struct HeapCollection {
  std::vector<uint8_t> bytes;
  std::map<uint32_t, std::pair<size_t, uint64_t>> objects;  // index -> (offset of the data in bytes, size)
};

class Hdf5Reader {
 public:
  explicit Hdf5Reader(const std::filesystem::path& path) : name_(path.string()) {
    std::error_code ec;
    NOPAD_CHECK(std::filesystem::is_regular_file(path, ec), "HDF5 file ", name_, " does not exist");
    const htri_t is_h5 = H5Fis_hdf5(name_.c_str());
    NOPAD_CHECK(is_h5 > 0, "file ", name_, " is not an HDF5 file (or cannot be read)", kHint);
    file_ = Handle(H5Fopen(name_.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    NOPAD_CHECK(file_.get() >= 0, "cannot open HDF5 file ", name_, " for reading", hdf5_says());
    // For the variable-length data, parsed here from the file's bytes: its size, and the widths and base of the
    // addresses in it (addresses count from the end of the user block).
    file_size_ = std::filesystem::file_size(path, ec);
    NOPAD_CHECK(!ec, "HDF5 file ", name_, ": cannot read its size: ", ec.message());
    Handle fcpl(H5Fget_create_plist(file_.get()), H5Pclose);
    hsize_t userblock = 0;
    NOPAD_CHECK(fcpl.get() >= 0 && H5Pget_sizes(fcpl.get(), &sizeof_addr_, &sizeof_size_) >= 0 &&
                    H5Pget_userblock(fcpl.get(), &userblock) >= 0,
                "HDF5 file ", name_, ": cannot read its creation properties", hdf5_says());
    NOPAD_CHECK(sizeof_addr_ >= 2 && sizeof_addr_ <= 8 && sizeof_size_ >= 2 && sizeof_size_ <= 8, "HDF5 file ", name_,
                ": unsupported address or length width (", sizeof_addr_, ", ", sizeof_size_, " bytes)");
    base_ = userblock;
    fd_ = ::open(name_.c_str(), O_RDONLY | O_CLOEXEC);
    NOPAD_CHECK(fd_ >= 0, "cannot open HDF5 file ", name_, ": ", std::strerror(errno));
  }
  ~Hdf5Reader() {
    if (fd_ >= 0) ::close(fd_);
  }
  Hdf5Reader(const Hdf5Reader&) = delete;
  Hdf5Reader& operator=(const Hdf5Reader&) = delete;

  const std::string& name() const { return name_; }

  bool has(const char* field) const {
    const htri_t e = H5Lexists(file_.get(), field, H5P_DEFAULT);
    NOPAD_CHECK(e >= 0, "HDF5 file ", name_, ": cannot look up dataset '", field, "'", hdf5_says());
    return e > 0;
  }

  // Opens `field`, checks integer (or vlen-of-integer) type and the expected rank and vlen-ness.
  Dataset open(const char* field, bool want_vlen, int min_rank, int max_rank) const {
    NOPAD_CHECK(has(field), "HDF5 file ", name_, " has no dataset '", field, "'", kHint);
    Dataset d;
    d.name = field;
    d.id = Handle(H5Dopen2(file_.get(), field, H5P_DEFAULT), H5Dclose);
    NOPAD_CHECK(d.id.get() >= 0, "HDF5 file ", name_, ": cannot open dataset '", field, "'", hdf5_says());
    Handle type(H5Dget_type(d.id.get()), H5Tclose);
    NOPAD_CHECK(type.get() >= 0, "HDF5 file ", name_, ": cannot read the type of dataset '", field, "'", hdf5_says());
    const H5T_class_t cls = H5Tget_class(type.get());
    NOPAD_CHECK(cls != H5T_NO_CLASS, "HDF5 file ", name_, ": cannot read the type class of dataset '", field, "'",
                hdf5_says());
    H5T_class_t elem_cls = cls;
    d.vlen = cls == H5T_VLEN;
    if (d.vlen) {
      Handle super(H5Tget_super(type.get()), H5Tclose);
      NOPAD_CHECK(super.get() >= 0, "HDF5 file ", name_, ": cannot read the element type of dataset '", field, "'",
                  hdf5_says());
      elem_cls = H5Tget_class(super.get());
      if (elem_cls == H5T_INTEGER) {
        d.elem_bytes = H5Tget_size(super.get());
        d.elem_signed = H5Tget_sign(super.get()) == H5T_SGN_2;
        d.elem_big_endian = H5Tget_order(super.get()) == H5T_ORDER_BE;
        NOPAD_CHECK(d.elem_bytes == 1 || d.elem_bytes == 2 || d.elem_bytes == 4 || d.elem_bytes == 8, "HDF5 file ",
                    name_, ": dataset '", field, "' has ", d.elem_bytes, "-byte integers; expected 1, 2, 4 or 8", kHint);
      }
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
                ": cannot read the dimensions of dataset '", field, "'", hdf5_says());
    // A row of a fixed dataset is one sequence (or its masks): the shard format's limit bounds what is read at once.
    if (rank == 2)
      NOPAD_CHECK(d.dims[1] >= 1 && d.dims[1] <= 65536, "HDF5 file ", name_, ": dataset '", field, "' has ", d.dims[1],
                  " columns; a sequence holds 1 to 65535 tokens", kHint);
    if (d.vlen) locate_vlen(d);
    return d;
  }

  // Where a variable-length dataset's descriptors are (16 bytes a row with 8-byte addresses), checked against the
  // file: contiguous storage, or chunks through the filters nopad can undo (deflate, shuffle, Fletcher-32).
  void locate_vlen(Dataset& d) const {
    Handle dcpl(H5Dget_create_plist(d.id.get()), H5Pclose);
    NOPAD_CHECK(dcpl.get() >= 0, "HDF5 file ", name_, ": cannot read the storage of dataset '", d.name, "'",
                hdf5_says());
    d.layout = H5Pget_layout(dcpl.get());
    const uint64_t rows = d.dims[0], desc = descriptor_bytes();
    NOPAD_CHECK(rows <= file_size_ / desc, "HDF5 file ", name_, ": dataset '", d.name, "' claims ", rows,
                " rows, more than the ", file_size_, "-byte file can hold (the file is damaged)");
    if (d.layout == H5D_CONTIGUOUS) {
      const haddr_t offset = H5Dget_offset(d.id.get());  // from the start of the file, user block included
      NOPAD_CHECK(rows == 0 || (offset != HADDR_UNDEF && offset <= file_size_ && rows * desc <= file_size_ - offset),
                  "HDF5 file ", name_, ": the rows of dataset '", d.name, "' lie outside the file (the file is damaged)");
      d.contiguous_offset = offset;
      return;
    }
    NOPAD_CHECK(d.layout == H5D_CHUNKED, "HDF5 file ", name_, ": dataset '", d.name, "' uses ",
                d.layout == H5D_COMPACT ? "compact" : "virtual or unknown", " storage, which nopad does not read for "
                "variable-length data; rewrite it with h5repack -l CHUNK=4096 (or from h5py with compression=\"gzip\")");
    hsize_t chunk = 0;
    NOPAD_CHECK(H5Pget_chunk(dcpl.get(), 1, &chunk) == 1 && chunk >= 1 && chunk <= file_size_, "HDF5 file ", name_,
                ": cannot read the chunk shape of dataset '", d.name, "'", hdf5_says());
    d.chunk_rows = chunk;
    const int n = H5Pget_nfilters(dcpl.get());
    NOPAD_CHECK(n >= 0 && n <= 32, "HDF5 file ", name_, ": cannot read the filters of dataset '", d.name, "'",
                hdf5_says());
    for (int k = 0; k < n; ++k) {
      Filter f;
      unsigned flags = 0, config = 0;
      size_t cd_count = 8;
      f.cd.resize(cd_count);
      char fname[64] = "";
      f.id = H5Pget_filter2(dcpl.get(), static_cast<unsigned>(k), &flags, &cd_count, f.cd.data(), sizeof fname, fname,
                            &config);
      NOPAD_CHECK(f.id >= 0, "HDF5 file ", name_, ": cannot read filter ", k, " of dataset '", d.name, "'",
                  hdf5_says());
      f.cd.resize(std::min<size_t>(cd_count, 8));
      NOPAD_CHECK(f.id == H5Z_FILTER_DEFLATE || f.id == H5Z_FILTER_SHUFFLE || f.id == H5Z_FILTER_FLETCHER32,
                  "HDF5 file ", name_, ": dataset '", d.name, "' is compressed with the HDF5 filter ", f.id, " (",
                  fname, "), which nopad does not read for variable-length data: rewrite the file with gzip, e.g. "
                  "h5repack -f GZIP=4 IN OUT");
#if !NOPAD_HAVE_ZLIB
      NOPAD_CHECK(f.id != H5Z_FILTER_DEFLATE, "HDF5 file ", name_, ": dataset '", d.name, "' is gzip-compressed, but "
                  "this nopad was built without zlib: install zlib1g-dev and rebuild (bash scripts/setup.sh)");
#endif
      d.filters.push_back(std::move(f));
    }
  }

  uint64_t descriptor_bytes() const { return 4 + sizeof_addr_ + 4; }  // length, collection address, object index

  [[noreturn]] void damaged(const Dataset& d, uint64_t row, const std::string& what) const {
    fail("HDF5 file ", name_, ", dataset '", d.name, "', row ", row, ": damaged variable-length data (", what,
         "); the file is damaged: copy or re-create it");
  }

  void pread_exact(uint64_t offset, void* out, size_t bytes) const {
    size_t done = 0;
    while (done < bytes) {
      const ssize_t got = ::pread(fd_, static_cast<char*>(out) + done, bytes - done, static_cast<off_t>(offset + done));
      if (got < 0 && errno == EINTR) continue;
      NOPAD_CHECK(got > 0, "HDF5 file ", name_, ": cannot read ", bytes, " bytes at offset ", offset, ": ",
                  got < 0 ? std::strerror(errno) : "the file ends before");
      done += static_cast<size_t>(got);
    }
  }

  // The descriptors of chunk `k` (chunk_rows of them), its stored bytes with the filters undone, last first.
  const std::vector<uint8_t>& chunk_descriptors(Dataset& d, hsize_t k) const {
    if (d.cached_chunk == k) return d.chunk_bytes;
    d.cached_chunk = ~hsize_t{0};
    const uint64_t row0 = k * d.chunk_rows;
    const uint64_t want = d.chunk_rows * descriptor_bytes();
    hsize_t offset = row0, stored = 0;
    NOPAD_CHECK(H5Dget_chunk_storage_size(d.id.get(), &offset, &stored) >= 0, "HDF5 file ", name_,
                ": cannot find the chunk of dataset '", d.name, "' at row ", row0, hdf5_says());
    if (stored == 0 || stored > file_size_)
      damaged(d, row0, str_cat("its chunk ", stored == 0 ? "is not stored" : "claims more bytes than the file has"));
    std::vector<uint8_t> bytes(stored);
    uint32_t mask = 0;
#if defined(H5Dread_chunk_vers) && H5Dread_chunk_vers >= 2
    size_t size = bytes.size();
    const herr_t read = H5Dread_chunk(d.id.get(), H5P_DEFAULT, &offset, &mask, bytes.data(), &size);
#else
    const herr_t read = H5Dread_chunk(d.id.get(), H5P_DEFAULT, &offset, &mask, bytes.data());
#endif
    NOPAD_CHECK(read >= 0, "HDF5 file ", name_, ": cannot read the chunk of dataset '", d.name, "' at row ", row0,
                hdf5_says());
    for (size_t f = d.filters.size(); f-- > 0;) {
      if (mask & (1u << f)) continue;  // not applied to this chunk
      const Filter& filter = d.filters[f];
      if (filter.id == H5Z_FILTER_FLETCHER32) {
        if (bytes.size() < 4) damaged(d, row0, "its chunk is shorter than its checksum");
        bytes.resize(bytes.size() - 4);
      } else if (filter.id == H5Z_FILTER_SHUFFLE) {
        const size_t es = filter.cd.empty() ? 0 : filter.cd[0];
        if (es < 1 || es > 64) damaged(d, row0, str_cat("shuffle element size ", es));
        const size_t n = bytes.size() / es;
        std::vector<uint8_t> out(bytes.size());
        for (size_t b = 0; b < es; ++b)
          for (size_t i = 0; i < n; ++i) out[i * es + b] = bytes[b * n + i];
        std::copy(bytes.begin() + static_cast<std::ptrdiff_t>(n * es), bytes.end(),
                  out.begin() + static_cast<std::ptrdiff_t>(n * es));
        bytes = std::move(out);
      } else {
#if NOPAD_HAVE_ZLIB
        // Inflated into at most what the chunk must hold (plus checksums of filters before this one): a damaged
        // stream cannot make it allocate more.
        std::vector<uint8_t> out(want + 4 * d.filters.size());
        z_stream zs{};
        NOPAD_CHECK(inflateInit(&zs) == Z_OK, "zlib could not start a decoder for HDF5 file ", name_);
        zs.next_in = bytes.data();
        zs.avail_in = static_cast<uInt>(bytes.size());
        zs.next_out = out.data();
        zs.avail_out = static_cast<uInt>(out.size());
        const int rc = inflate(&zs, Z_FINISH);
        const size_t produced = out.size() - zs.avail_out;
        inflateEnd(&zs);
        if (rc != Z_STREAM_END) damaged(d, row0, "its compressed chunk does not decompress");
        out.resize(produced);
        bytes = std::move(out);
#endif
      }
    }
    if (bytes.size() != want)
      damaged(d, row0, str_cat("its chunk holds ", bytes.size(), " bytes of descriptors, not ", want));
    d.chunk_bytes = std::move(bytes);
    d.cached_chunk = k;
    return d.chunk_bytes;
  }

  // The global heap collection at file address `addr` (from the descriptors), parsed and bounded by the file.
  const HeapCollection& collection(const Dataset& d, uint64_t row, uint64_t addr) const {
    if (auto it = heaps_.find(addr); it != heaps_.end()) return it->second;
    const uint64_t header = 8 + sizeof_size_;  // "GCOL", version, 3 reserved bytes, collection size
    if (addr > file_size_ || base_ > file_size_ - addr || header > file_size_ - addr - base_)
      damaged(d, row, str_cat("heap collection address ", addr, " is outside the file"));
    const uint64_t at = base_ + addr;
    uint8_t head[16];
    pread_exact(at, head, header);
    if (std::memcmp(head, "GCOL", 4) != 0 || head[4] != 1)
      damaged(d, row, str_cat("no global heap collection at address ", addr));
    const uint64_t size = read_le(head + 8, sizeof_size_);
    if (size < header || size > file_size_ - at)
      damaged(d, row, str_cat("heap collection at address ", addr, " claims ", size, " bytes"));
    if (heaps_.size() >= 64) heaps_.clear();  // rows point into a few collections at a time
    HeapCollection& c = heaps_[addr];
    c.bytes.resize(size);
    pread_exact(at, c.bytes.data(), size);
    // Objects: index (2 bytes), reference count (2), reserved (4), size, data padded to 8 bytes; index 0 is the
    // free space and ends the list.
    const uint64_t object_header = 8 + sizeof_size_;
    for (uint64_t pos = header; pos + object_header <= size;) {
      const uint32_t index = static_cast<uint32_t>(read_le(c.bytes.data() + pos, 2));
      if (index == 0) break;
      const uint64_t bytes = read_le(c.bytes.data() + pos + 8, sizeof_size_);
      const uint64_t data = pos + object_header;
      if (bytes > size - data) {
        heaps_.erase(addr);
        damaged(d, row, str_cat("object ", index, " of the heap collection at address ", addr, " runs past its end"));
      }
      c.objects[index] = {static_cast<size_t>(data), bytes};
      pos = data + (bytes + 7) / 8 * 8;
    }
    return c;
  }

  // Rows [row0, row0 + count) of a variable-length dataset, each element converted to int32 (saturating).
  Rows read_vlen(Dataset& d, hsize_t row0, hsize_t count) const {
    Rows out;
    out.offsets.reserve(count + 1);
    const uint64_t desc = descriptor_bytes();
    std::vector<uint8_t> contiguous;
    if (d.layout == H5D_CONTIGUOUS && count > 0) {
      contiguous.resize(count * desc);
      pread_exact(d.contiguous_offset + row0 * desc, contiguous.data(), contiguous.size());
    }
    for (hsize_t i = 0; i < count; ++i) {
      const uint64_t row = row0 + i;
      const uint8_t* p = d.layout == H5D_CONTIGUOUS
                             ? contiguous.data() + i * desc
                             : chunk_descriptors(d, row / d.chunk_rows).data() + (row % d.chunk_rows) * desc;
      const uint64_t length = read_le(p, 4), addr = read_le(p + 4, sizeof_addr_);
      const uint32_t index = static_cast<uint32_t>(read_le(p + 4 + sizeof_addr_, 4));
      if (length > 0) {
        const HeapCollection& c = collection(d, row, addr);
        const auto it = c.objects.find(index);
        if (it == c.objects.end())
          damaged(d, row, str_cat("heap collection at address ", addr, " has no object ", index));
        if (it->second.second != length * d.elem_bytes)
          damaged(d, row, str_cat(length, " elements of ", d.elem_bytes, " bytes, but heap object ", index, " holds ",
                                  it->second.second, " bytes"));
        const uint8_t* e = c.bytes.data() + it->second.first;
        for (uint64_t k = 0; k < length; ++k, e += d.elem_bytes) {
          uint64_t u = 0;
          for (size_t b = 0; b < d.elem_bytes; ++b) u |= uint64_t{e[d.elem_big_endian ? d.elem_bytes - 1 - b : b]} << (8 * b);
          int64_t v;
          if (d.elem_signed && d.elem_bytes < 8 && (u >> (8 * d.elem_bytes - 1)) != 0)
            v = static_cast<int64_t>(u | (~uint64_t{0} << (8 * d.elem_bytes)));  // sign-extended
          else if (!d.elem_signed && u > static_cast<uint64_t>(INT64_MAX))
            v = INT64_MAX;
          else
            v = static_cast<int64_t>(u);
          out.flat.push_back(static_cast<int32_t>(std::clamp<int64_t>(v, INT32_MIN, INT32_MAX)));
        }
      }
      out.offsets.push_back(out.flat.size());
    }
    return out;
  }

  // Rows [row0, row0 + count) of `d`: a fixed dataset gives dims[1] (or 1) values per row, a vlen one its row.
  Rows read(Dataset& d, hsize_t row0, hsize_t count) const {
    if (d.vlen) return read_vlen(d, row0, count);
    Rows out;
    Handle fspace(H5Dget_space(d.id.get()), H5Sclose);
    NOPAD_CHECK(fspace.get() >= 0, "HDF5 file ", name_, ": cannot read the shape of dataset '", d.name, "'",
                hdf5_says());
    const hsize_t cols = d.dims.size() == 2 ? d.dims[1] : 1;
    std::vector<hsize_t> start(d.dims.size(), 0), cnt = d.dims;
    start[0] = row0;
    cnt[0] = count;
    NOPAD_CHECK(H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start.data(), nullptr, cnt.data(), nullptr) >= 0,
                "HDF5 file ", name_, ": cannot select rows ", row0, "..", row0 + count, " of dataset '", d.name, "'",
                hdf5_says());
    Handle mspace(H5Screate_simple(static_cast<int>(cnt.size()), cnt.data(), nullptr), H5Sclose);
    NOPAD_CHECK(mspace.get() >= 0, "HDF5 file ", name_, ": cannot create a memory space for '", d.name, "'",
                hdf5_says());
    out.flat.resize(static_cast<size_t>(count * cols));
    if (count > 0)
      NOPAD_CHECK(H5Dread(d.id.get(), H5T_NATIVE_INT32, mspace.get(), fspace.get(), H5P_DEFAULT, out.flat.data()) >= 0,
                  "HDF5 file ", name_, ": cannot read rows ", row0, "..", row0 + count, " of dataset '", d.name,
                  "' (damaged file or unsupported compression filter?)", hdf5_says());
    out.offsets.resize(static_cast<size_t>(count + 1));
    for (hsize_t i = 0; i <= count; ++i) out.offsets[i] = i * cols;
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
  int fd_ = -1;
  uint64_t file_size_ = 0, base_ = 0;
  size_t sizeof_addr_ = 8, sizeof_size_ = 8;
  mutable std::map<uint64_t, HeapCollection> heaps_;  // by address, a bounded cache
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

  // Rows per block, fewer for wide rows: a block's fixed-size values stay under 16M int32 (64 MB) a field.
  const hsize_t widest = fixed ? std::max(ds[0].dims[1], ds[2].dims[1]) : 1;
  const hsize_t block = std::max<hsize_t>(1, std::min<hsize_t>(static_cast<hsize_t>(opt.rows_per_block),
                                                              (hsize_t{1} << 24) / widest));
  for (hsize_t row0 = 0; row0 < num_rows; row0 += block) {
    const hsize_t count = std::min(block, num_rows - row0);
    if (!lock.owns_lock()) {
      lock.lock();
      quiet.emplace();
    }
    std::vector<Rows> rows;
    for (Dataset& d : ds) rows.push_back(r.read(d, row0, count));
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
