// The single-process communicator, the communicator factory, the config-agreement check and the sample exchange
// (see comm.h). The MPI communicator is in dist/mpi/comm_mpi.cpp, built only where CMake finds MPI.
#include "dist/comm.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "core/error.h"

namespace nopad::dist {
namespace {

class SingleCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "single"; }
  void all_reduce_sum(std::span<float>) override {}
  void all_reduce_sum(std::span<double>) override {}
  void all_reduce_sum(std::span<int64_t>) override {}
  void all_reduce_max(std::span<double>) override {}
  void all_gather(std::span<const uint8_t> send, std::span<uint8_t> recv) override {
    NOPAD_CHECK(recv.size() == send.size(), "all_gather: receive buffer of ", recv.size(), " bytes for ", send.size(),
                " bytes from 1 rank");
    if (!send.empty()) std::memcpy(recv.data(), send.data(), send.size());
  }
  void broadcast(std::span<uint8_t>, int root) override {
    NOPAD_CHECK(root == 0, "broadcast: root ", root, " does not exist in a single-process job");
  }
  void all_to_all_v(std::span<const uint8_t> send, std::span<const size_t> send_bytes, std::vector<uint8_t>& recv,
                    std::vector<size_t>& recv_bytes) override {
    NOPAD_CHECK(send_bytes.size() == 1 && send_bytes[0] == send.size(), "all_to_all_v: counts do not match the ",
                "send buffer");
    recv.assign(send.begin(), send.end());
    recv_bytes.assign(1, send.size());
  }
  void barrier() override {}
  [[noreturn]] void abort(int code, const std::string& why) override {
    std::fprintf(stderr, "nopad: %s\n", why.c_str());
    std::fflush(stderr);
    std::_Exit(code);
  }
};

}  // namespace

std::unique_ptr<Communicator> make_single_communicator() { return std::make_unique<SingleCommunicator>(); }

#ifndef NOPAD_HAVE_MPI
bool mpi_built() { return false; }
std::unique_ptr<Communicator> make_mpi_communicator(const RankInfo*) {
  fail("this nopad was built without MPI: install an MPI (e.g. Debian's libopenmpi-dev) and rebuild, or run a "
       "single process");
}
#endif

std::unique_ptr<Communicator> make_communicator(const RankInfo& info) {
  if (!info.distributed()) return make_single_communicator();
  if (info.launcher == "torchrun") {
    double timeout_s = 300;
    if (const char* t = std::getenv("NOPAD_BOOTSTRAP_TIMEOUT_S")) {
      char* end = nullptr;
      timeout_s = std::strtod(t, &end);
      NOPAD_CHECK(end != t && *end == '\0' && timeout_s > 0, "NOPAD_BOOTSTRAP_TIMEOUT_S must be a positive number of "
                  "seconds, got '", t, "'");
    }
    return make_tcp_communicator(info, timeout_s);
  }
  return make_mpi_communicator(&info);
}

uint64_t hash_bytes(std::span<const uint8_t> bytes, uint64_t seed) {
  uint64_t h = seed;
  for (const uint8_t b : bytes) {
    h ^= b;
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t hash_string(const std::string& s, uint64_t seed) {
  return hash_bytes(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size()), seed);
}

std::vector<uint64_t> all_gather_u64(Communicator& comm, uint64_t value) {
  std::vector<uint64_t> all(static_cast<size_t>(comm.size()));
  comm.all_gather(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(&value), sizeof value),
                  std::span<uint8_t>(reinterpret_cast<uint8_t*>(all.data()), all.size() * sizeof(uint64_t)));
  return all;
}

void check_same_on_all_ranks(Communicator& comm, uint64_t value, const std::string& what) {
  const int n = comm.size();
  const std::vector<uint64_t> all = all_gather_u64(comm, value);
  std::string differ;
  int count = 0;
  for (int r = 1; r < n; ++r) {
    if (all[static_cast<size_t>(r)] == all[0]) continue;
    if (count++ < 8) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
  }
  if (count > 0)
    fail(what, " differs between ranks: rank(s) ", differ, count > 8 ? ", ..." : "", " (", count, " of ", n,
         ") do not match rank 0; every rank must run the same config on the same data");
}

SampleExchange exchange_samples(Communicator& comm, std::span<const uint64_t> ids, std::span<const int32_t> dest,
                                std::span<const uint8_t> payload, std::span<const size_t> offsets) {
  const size_t n = ids.size(), world = static_cast<size_t>(comm.size());
  NOPAD_CHECK(dest.size() == n && offsets.size() == n + 1 && offsets[n] == payload.size(),
              "exchange_samples: ids (", n, "), dest (", dest.size(), "), offsets (", offsets.size(),
              ") and payload (", payload.size(), " bytes) do not describe the same samples");
  // Per destination: records of [id (8 bytes), payload length (8 bytes), payload], in this rank's sample order.
  std::vector<size_t> send_bytes(world, 0);
  for (size_t i = 0; i < n; ++i) {
    NOPAD_CHECK(dest[i] >= 0 && static_cast<size_t>(dest[i]) < world, "exchange_samples: sample ", ids[i],
                " is sent to rank ", dest[i], ", outside [0, ", world, ")");
    NOPAD_CHECK(offsets[i] <= offsets[i + 1], "exchange_samples: offsets decrease at sample ", i);
    send_bytes[static_cast<size_t>(dest[i])] += 16 + (offsets[i + 1] - offsets[i]);
  }
  std::vector<size_t> cursor(world, 0);
  std::exclusive_scan(send_bytes.begin(), send_bytes.end(), cursor.begin(), size_t{0});
  std::vector<uint8_t> send(std::accumulate(send_bytes.begin(), send_bytes.end(), size_t{0}));
  for (size_t i = 0; i < n; ++i) {
    size_t& at = cursor[static_cast<size_t>(dest[i])];
    const uint64_t len = offsets[i + 1] - offsets[i];
    std::memcpy(send.data() + at, &ids[i], 8);
    std::memcpy(send.data() + at + 8, &len, 8);
    if (len) std::memcpy(send.data() + at + 16, payload.data() + offsets[i], len);
    at += 16 + len;
  }
  std::vector<uint8_t> recv;
  std::vector<size_t> recv_bytes;
  comm.all_to_all_v(send, send_bytes, recv, recv_bytes);

  // Parse, then order by id.
  struct Rec {
    uint64_t id;
    size_t at, len;
  };
  std::vector<Rec> recs;
  for (size_t at = 0; at < recv.size();) {
    NOPAD_CHECK(at + 16 <= recv.size(), "exchange_samples: truncated record at byte ", at, " of ", recv.size());
    Rec r{};
    uint64_t len = 0;
    std::memcpy(&r.id, recv.data() + at, 8);
    std::memcpy(&len, recv.data() + at + 8, 8);
    NOPAD_CHECK(at + 16 + len <= recv.size(), "exchange_samples: record of sample ", r.id, " runs past the data");
    r.at = at + 16;
    r.len = static_cast<size_t>(len);
    recs.push_back(r);
    at += 16 + static_cast<size_t>(len);
  }
  std::sort(recs.begin(), recs.end(), [](const Rec& a, const Rec& b) { return a.id < b.id; });
  SampleExchange out;
  out.ids.reserve(recs.size());
  out.offsets.reserve(recs.size() + 1);
  out.offsets.push_back(0);
  for (size_t i = 0; i < recs.size(); ++i) {
    NOPAD_CHECK(i == 0 || recs[i].id != recs[i - 1].id, "exchange_samples: sample ", recs[i].id,
                " arrived twice (two ranks sent it)");
    out.ids.push_back(recs[i].id);
    out.payload.insert(out.payload.end(), recv.begin() + static_cast<std::ptrdiff_t>(recs[i].at),
                       recv.begin() + static_cast<std::ptrdiff_t>(recs[i].at + recs[i].len));
    out.offsets.push_back(out.payload.size());
  }
  return out;
}

}  // namespace nopad::dist
