// The TCP communicator of torchrun-style launches (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): no MPI needed. A
// star through rank 0: rank 0 listens on MASTER_PORT, every other rank connects (retrying until the bootstrap
// timeout) and introduces itself; every collective goes to rank 0 and back. Rank 0 combines contributions in rank
// order, so sums are deterministic and every rank receives the same bits (the Communicator contract). Each message
// carries the collective's kind and size, and rank 0 refuses a rank whose call differs (a mismatched collective is
// an error naming both, not silent garbage). A peer that exits closes its socket: the others' next receive throws
// naming it. Meant for the host-side traffic (batch counts, losses, the NCCL id, CPU gradients of small models); GPU
// gradients go over NCCL.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "core/error.h"
#include "dist/comm.h"

namespace nopad::dist {

namespace {

constexpr uint64_t kMagic = 0x6e6f706164746370ull;  // "nopadtcp"

enum class Op : uint32_t { kSumF32 = 1, kSumF64, kSumI64, kMaxF64, kGather, kBcast, kAllToAll, kBarrier };

struct Header {
  uint32_t op;
  uint32_t root;
  uint64_t bytes;
};

class TcpCommunicator final : public Communicator {
 public:
  TcpCommunicator(const RankInfo& info, double timeout_s) : rank_(info.rank), size_(info.world_size) {
    NOPAD_CHECK(!info.master_addr.empty() && info.master_port > 0 && info.master_port < 65536,
                "torchrun-style launch: MASTER_ADDR and MASTER_PORT (1..65535) are needed, got '", info.master_addr,
                "' and ", info.master_port);
    peers_.assign(static_cast<size_t>(size_), -1);
    if (rank_ == 0)
      listen_and_accept(info, timeout_s);
    else
      connect_to_root(info, timeout_s);
  }
  ~TcpCommunicator() override {
    for (int fd : peers_)
      if (fd >= 0) ::close(fd);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "tcp"; }

  void all_reduce_sum(std::span<float> d) override { reduce(Op::kSumF32, d, [](float& a, float b) { a += b; }); }
  void all_reduce_sum(std::span<double> d) override { reduce(Op::kSumF64, d, [](double& a, double b) { a += b; }); }
  void all_reduce_sum(std::span<int64_t> d) override {
    reduce(Op::kSumI64, d, [](int64_t& a, int64_t b) { a += b; });
  }
  void all_reduce_max(std::span<double> d) override {
    reduce(Op::kMaxF64, d, [](double& a, double b) { a = std::max(a, b); });
  }

  void all_gather(std::span<const uint8_t> send, std::span<uint8_t> recv) override {
    NOPAD_CHECK(recv.size() == send.size() * static_cast<size_t>(size_), "all_gather: recv holds ", recv.size(),
                " bytes, need ", send.size() * static_cast<size_t>(size_));
    if (rank_ == 0) {
      std::copy(send.begin(), send.end(), recv.begin());
      for (int r = 1; r < size_; ++r) {
        expect(r, Op::kGather, 0, send.size());
        recv_bytes(r, recv.data() + send.size() * static_cast<size_t>(r), send.size());
      }
      for (int r = 1; r < size_; ++r) send_bytes(r, recv.data(), recv.size());
    } else {
      send_header(Op::kGather, 0, send.size());
      send_bytes(0, send.data(), send.size());
      recv_bytes(0, recv.data(), recv.size());
    }
  }

  void broadcast(std::span<uint8_t> data, int root) override {
    NOPAD_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " outside 0..", size_ - 1);
    if (rank_ == 0) {
      for (int r = 1; r < size_; ++r) expect(r, Op::kBcast, static_cast<uint32_t>(root), data.size());
      if (root != 0) recv_bytes(root, data.data(), data.size());
      for (int r = 1; r < size_; ++r)
        if (r != root) send_bytes(r, data.data(), data.size());
    } else {
      send_header(Op::kBcast, static_cast<uint32_t>(root), data.size());
      if (rank_ == root)
        send_bytes(0, data.data(), data.size());
      else
        recv_bytes(0, data.data(), data.size());
    }
  }

  void all_to_all_v(std::span<const uint8_t> send, std::span<const size_t> send_bytes_per_rank,
                    std::vector<uint8_t>& recv, std::vector<size_t>& recv_bytes_per_rank) override {
    const size_t n = static_cast<size_t>(size_);
    NOPAD_CHECK(send_bytes_per_rank.size() == n, "all_to_all_v: ", send_bytes_per_rank.size(), " counts for ", n,
                " ranks");
    size_t total = 0;
    for (size_t b : send_bytes_per_rank) total += b;
    NOPAD_CHECK(total == send.size(), "all_to_all_v: counts add up to ", total, " bytes, send holds ", send.size());
    std::vector<uint64_t> counts(send_bytes_per_rank.begin(), send_bytes_per_rank.end());
    if (rank_ != 0) {
      send_header(Op::kAllToAll, 0, counts.size() * sizeof(uint64_t));
      send_bytes(0, counts.data(), counts.size() * sizeof(uint64_t));
      send_bytes(0, send.data(), send.size());
      std::vector<uint64_t> in(n);
      recv_bytes(0, in.data(), n * sizeof(uint64_t));
      recv_bytes_per_rank.assign(in.begin(), in.end());
      size_t in_total = 0;
      for (uint64_t b : in) in_total += b;
      recv.resize(in_total);
      recv_bytes(0, recv.data(), in_total);
      return;
    }
    // Rank 0 routes: every rank's counts and payload, then each destination's part from every source in order.
    std::vector<std::vector<uint64_t>> all_counts(n);
    std::vector<std::vector<uint8_t>> all_payload(n);
    all_counts[0] = counts;
    all_payload[0].assign(send.begin(), send.end());
    for (size_t r = 1; r < n; ++r) {
      expect(static_cast<int>(r), Op::kAllToAll, 0, n * sizeof(uint64_t));
      all_counts[r].resize(n);
      recv_bytes(static_cast<int>(r), all_counts[r].data(), n * sizeof(uint64_t));
      size_t bytes = 0;
      for (uint64_t b : all_counts[r]) bytes += b;
      all_payload[r].resize(bytes);
      recv_bytes(static_cast<int>(r), all_payload[r].data(), bytes);
    }
    for (size_t d = 0; d < n; ++d) {
      std::vector<uint64_t> in(n);
      std::vector<uint8_t> out;
      for (size_t s = 0; s < n; ++s) {
        size_t offset = 0;
        for (size_t k = 0; k < d; ++k) offset += all_counts[s][k];
        in[s] = all_counts[s][d];
        out.insert(out.end(), all_payload[s].begin() + static_cast<std::ptrdiff_t>(offset),
                   all_payload[s].begin() + static_cast<std::ptrdiff_t>(offset + in[s]));
      }
      if (d == 0) {
        recv_bytes_per_rank.assign(in.begin(), in.end());
        recv = std::move(out);
      } else {
        send_bytes(static_cast<int>(d), in.data(), n * sizeof(uint64_t));
        send_bytes(static_cast<int>(d), out.data(), out.size());
      }
    }
  }

  void barrier() override {
    int64_t one = 1;
    reduce(Op::kBarrier, std::span<int64_t>(&one, 1), [](int64_t& a, int64_t b) { a += b; });
  }

  [[noreturn]] void abort(int code, const std::string& why) override {
    std::fprintf(stderr, "rank %d of %d: %s\n", rank_, size_, why.c_str());
    std::fflush(stderr);
    std::_Exit(code == 0 ? 1 : code);  // the sockets close: the other ranks' next receive fails, naming this rank
  }

 private:
  template <class T, class F>
  void reduce(Op op, std::span<T> d, F combine) {
    const size_t bytes = d.size() * sizeof(T);
    if (rank_ == 0) {
      std::vector<T> in(d.size());
      for (int r = 1; r < size_; ++r) {  // in rank order: the same bits on every rank and every run
        expect(r, op, 0, bytes);
        recv_bytes(r, in.data(), bytes);
        for (size_t i = 0; i < d.size(); ++i) combine(d[i], in[i]);
      }
      for (int r = 1; r < size_; ++r) send_bytes(r, d.data(), bytes);
    } else {
      send_header(op, 0, bytes);
      send_bytes(0, d.data(), bytes);
      recv_bytes(0, d.data(), bytes);
    }
  }

  void send_header(Op op, uint32_t root, uint64_t bytes) {
    const Header h{static_cast<uint32_t>(op), root, bytes};
    send_bytes(0, &h, sizeof h);
  }
  // Rank 0: the next message from rank r must be this collective.
  void expect(int r, Op op, uint32_t root, uint64_t bytes) {
    Header h{};
    recv_bytes(r, &h, sizeof h);
    NOPAD_CHECK(h.op == static_cast<uint32_t>(op) && h.root == root && h.bytes == bytes, "rank 0 of ", size_,
                ": rank ", r, " called another collective (kind ", h.op, ", root ", h.root, ", ", h.bytes,
                " bytes) than rank 0 (kind ", static_cast<uint32_t>(op), ", root ", root, ", ", bytes,
                " bytes): the ranks run different code or configs");
  }

  void send_bytes(int peer, const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    while (n > 0) {
      const ssize_t k = ::send(peers_[static_cast<size_t>(peer)], b, std::min<size_t>(n, size_t{1} << 30), MSG_NOSIGNAL);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) lost(peer, k < 0 ? std::strerror(errno) : "closed");
      b += k;
      n -= static_cast<size_t>(k);
    }
  }
  void recv_bytes(int peer, void* p, size_t n) {
    auto* b = static_cast<uint8_t*>(p);
    while (n > 0) {
      const ssize_t k = ::recv(peers_[static_cast<size_t>(peer)], b, std::min<size_t>(n, size_t{1} << 30), 0);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) lost(peer, k < 0 ? std::strerror(errno) : "closed by the peer");
      b += k;
      n -= static_cast<size_t>(k);
    }
  }
  [[noreturn]] void lost(int peer, const char* why) {
    fail("rank ", rank_, " of ", size_, ": the connection to rank ", peer, " failed (", why,
         "): that rank exited or died; the job stops (check its log)");
  }

  static void tune(int fd) {
    int one = 1;
    (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // small collectives: no Nagle delay
  }

  void listen_and_accept(const RankInfo& info, double timeout_s) {
    int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
    NOPAD_CHECK(lfd >= 0, "rank 0: socket(): ", std::strerror(errno));
    int one = 1;
    (void)::setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(info.master_port));
    if (::bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(lfd, size_) != 0) {
      const std::string err = std::strerror(errno);
      ::close(lfd);
      fail("rank 0: cannot listen on port ", info.master_port, " (MASTER_PORT): ", err,
           "; choose a free port");
    }
    const auto start = std::chrono::steady_clock::now();
    int joined = 1;
    while (joined < size_) {
      const double left = timeout_s - std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      pollfd p{lfd, POLLIN, 0};
      const int ready = left > 0 ? ::poll(&p, 1, static_cast<int>(std::min(left, 1e6) * 1000)) : 0;
      if (ready <= 0) {
        ::close(lfd);
        fail("rank 0: only ", joined, " of ", size_, " ranks joined within ", timeout_s,
             " s (NOPAD_BOOTSTRAP_TIMEOUT_S) at port ", info.master_port,
             ": check that every rank was started with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE");
      }
      const int cfd = ::accept(lfd, nullptr, nullptr);
      if (cfd < 0) continue;
      tune(cfd);
      uint64_t hello[3] = {0, 0, 0};  // magic, rank, world size
      size_t got = 0;
      while (got < sizeof hello) {
        const ssize_t k = ::recv(cfd, reinterpret_cast<uint8_t*>(hello) + got, sizeof hello - got, 0);
        if (k <= 0) break;
        got += static_cast<size_t>(k);
      }
      if (got != sizeof hello || hello[0] != kMagic) {  // not one of ours (a port scan, another job): ignore it
        ::close(cfd);
        continue;
      }
      const int r = static_cast<int>(hello[1]);
      if (static_cast<int>(hello[2]) != size_ || r <= 0 || r >= size_ || peers_[static_cast<size_t>(r)] >= 0) {
        ::close(cfd);
        ::close(lfd);
        fail("rank 0: a process introduced itself as rank ", r, " of ", hello[2], " while this job has WORLD_SIZE ",
             size_, (r > 0 && r < size_ && peers_[static_cast<size_t>(r)] >= 0) ? " (that rank already joined)" : "",
             ": check the launcher's RANK/WORLD_SIZE");
      }
      peers_[static_cast<size_t>(r)] = cfd;
      ++joined;
    }
    ::close(lfd);
  }

  void connect_to_root(const RankInfo& info, double timeout_s) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    const std::string port = std::to_string(info.master_port);
    const auto start = std::chrono::steady_clock::now();
    std::string last_error = "not tried";
    for (;;) {
      addrinfo* res = nullptr;
      const int gai = ::getaddrinfo(info.master_addr.c_str(), port.c_str(), &hints, &res);
      if (gai != 0) {
        last_error = std::string("cannot resolve MASTER_ADDR: ") + ::gai_strerror(gai);
      } else {
        for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
          const int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
          if (fd < 0) continue;
          if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
            ::freeaddrinfo(res);
            tune(fd);
            peers_[0] = fd;
            const uint64_t hello[3] = {kMagic, static_cast<uint64_t>(rank_), static_cast<uint64_t>(size_)};
            send_bytes(0, hello, sizeof hello);
            return;
          }
          last_error = std::strerror(errno);
          ::close(fd);
        }
        ::freeaddrinfo(res);
      }
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout_s)
        fail("rank ", rank_, " of ", size_, ": could not reach rank 0 at ", info.master_addr, ":", info.master_port,
             " (MASTER_ADDR:MASTER_PORT) within ", timeout_s, " s (NOPAD_BOOTSTRAP_TIMEOUT_S): ", last_error);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  int rank_ = 0, size_ = 1;
  std::vector<int> peers_;  // rank 0: a socket per other rank; other ranks: peers_[0] = the socket to rank 0
};

}  // namespace

std::unique_ptr<Communicator> make_tcp_communicator(const RankInfo& info, double timeout_s) {
  NOPAD_CHECK(info.world_size >= 1 && info.rank >= 0 && info.rank < info.world_size, "TCP communicator: rank ",
              info.rank, " of ", info.world_size);
  NOPAD_CHECK(timeout_s > 0, "TCP communicator: the bootstrap timeout must be positive, got ", timeout_s);
  return std::make_unique<TcpCommunicator>(info, timeout_s);
}

}  // namespace nopad::dist
