// The TCP communicator of torchrun-style launches (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): no MPI needed. A
// star through rank 0: rank 0 listens, every other rank connects (retrying until the bootstrap timeout) and
// introduces itself; every collective goes to rank 0 and back. Where rank 0 listens: on MASTER_PORT, except under a
// torchrun that shares its agent's store with the workers (TORCHELASTIC_USE_AGENT_STORE=True, PyTorch 2.4 and later):
// MASTER_ADDR:MASTER_PORT is then that TCPStore, already bound, so rank 0 listens on a port the kernel picks and
// publishes "address:port" in the store under nopad/<TORCHELASTIC_RUN_ID>/<TORCHELASTIC_RESTART_COUNT>/bootstrap (the
// address is the local end of its connection to the store, reachable from the store's network; when that is a
// loopback address and the job spans several hosts, the addresses of rank 0's interfaces, comma-separated), and the
// other ranks wait for that key and connect to the first address that answers (dist/tcp_store_client.h). Rank 0
// combines contributions in rank
// order, so sums are deterministic and every rank receives the same bits (the Communicator contract). Each message
// carries the collective's kind and size, and rank 0 refuses a rank whose call differs (a mismatched collective is
// an error naming both, not silent garbage). A peer that exits closes its socket: the others' next receive throws
// naming it. Meant for the host-side traffic (batch counts, losses, the NCCL id, CPU gradients of small models); GPU
// gradients go over NCCL.
#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
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
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.h"
#include "dist/comm.h"
#include "dist/tcp_store_client.h"

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
    if (info.agent_store)
      bootstrap_through_store(info, timeout_s);
    else if (rank_ == 0)
      accept_ranks(listen_on(info.master_port, AF_INET, "MASTER_PORT"), timeout_s, std::chrono::steady_clock::now(),
                   "port " + std::to_string(info.master_port),
                   "check that every rank was started with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE");
    else
      connect_to_root({{info.master_addr, info.master_port}}, timeout_s, "MASTER_ADDR:MASTER_PORT", timeout_s);
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

  // A listening socket on `port` (0: one the kernel picks) of every local address of `family` (AF_INET6 also
  // takes IPv4 peers). `what` names the port in the error.
  static int listen_on(int port, int family, const char* what) {
    const int lfd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    NOPAD_CHECK(lfd >= 0, "rank 0: socket(): ", std::strerror(errno));
    int one = 1, zero = 0;
    (void)::setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_storage addr{};
    socklen_t len = 0;
    if (family == AF_INET6) {
      (void)::setsockopt(lfd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
      auto* a6 = reinterpret_cast<sockaddr_in6*>(&addr);
      a6->sin6_family = AF_INET6;
      a6->sin6_addr = in6addr_any;
      a6->sin6_port = htons(static_cast<uint16_t>(port));
      len = sizeof(sockaddr_in6);
    } else {
      auto* a4 = reinterpret_cast<sockaddr_in*>(&addr);
      a4->sin_family = AF_INET;
      a4->sin_addr.s_addr = htonl(INADDR_ANY);
      a4->sin_port = htons(static_cast<uint16_t>(port));
      len = sizeof(sockaddr_in);
    }
    if (::bind(lfd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(lfd, 128) != 0) {
      const std::string err = std::strerror(errno);
      ::close(lfd);
      fail("rank 0: cannot listen on port ", port, " (", what, "): ", err, "; choose a free port");
    }
    return lfd;
  }

  static int bound_port(int lfd) {
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    NOPAD_CHECK(::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len) == 0, "rank 0: getsockname(): ",
                std::strerror(errno));
    return a.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port)
                                   : ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
  }

  // Rank 0: accepts the other ranks on `lfd` (closed on return) until all have joined; `where` and `advice` go into
  // the timeout's message.
  void accept_ranks(int lfd, double timeout_s, std::chrono::steady_clock::time_point start, const std::string& where,
                    const std::string& advice) {
    int joined = 1;
    while (joined < size_) {
      const double left = timeout_s - std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      pollfd p{lfd, POLLIN, 0};
      const int ready = left > 0 ? ::poll(&p, 1, static_cast<int>(std::min(left, 1e6) * 1000)) : 0;
      if (ready < 0 && errno == EINTR) continue;
      if (ready <= 0) {
        ::close(lfd);
        fail("rank 0: only ", joined, " of ", size_, " ranks joined within ", timeout_s,
             " s (NOPAD_BOOTSTRAP_TIMEOUT_S) at ", where, ": ", advice);
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

  // Ranks 1..: connects to rank 0 at the first of `addrs` (host, port) that answers, retrying until timeout_s, and
  // introduces itself. `what` says where the addresses came from and `limit_s` the time limit the user set
  // (NOPAD_BOOTSTRAP_TIMEOUT_S), for the error.
  void connect_to_root(const std::vector<std::pair<std::string, int>>& addrs, double timeout_s,
                       const std::string& what, double limit_s) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    const auto start = std::chrono::steady_clock::now();
    auto left = [&] {
      return timeout_s - std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    std::string last_error = "not tried";
    for (;;) {
      for (const auto& [host, port] : addrs) {
        addrinfo* res = nullptr;
        const int gai = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
        if (gai != 0) {
          last_error = "cannot resolve '" + host + "': " + ::gai_strerror(gai);
          continue;
        }
        for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
          const int fd = connect_within(a, std::clamp(left(), 0.05, 5.0), last_error);
          if (fd < 0) continue;
          if (::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0) {  // the peer sockets block
            last_error = std::string("fcntl(): ") + std::strerror(errno);
            ::close(fd);
            continue;
          }
          ::freeaddrinfo(res);
          tune(fd);
          peers_[0] = fd;
          const uint64_t hello[3] = {kMagic, static_cast<uint64_t>(rank_), static_cast<uint64_t>(size_)};
          send_bytes(0, hello, sizeof hello);
          return;
        }
        ::freeaddrinfo(res);
      }
      if (left() <= 0)
        fail("rank ", rank_, " of ", size_, ": could not reach rank 0 at ", join_addresses(addrs), " (", what,
             ") within ", limit_s, " s (NOPAD_BOOTSTRAP_TIMEOUT_S): ", last_error);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  // "host:port" with an IPv6 address in brackets; a list joined by commas.
  static std::string join_addresses(const std::vector<std::pair<std::string, int>>& addrs) {
    std::string out;
    for (const auto& [host, port] : addrs) {
      if (!out.empty()) out += ",";
      out += (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
    }
    return out;
  }

  static bool is_loopback(const std::string& host) {
    in_addr a4{};
    in6_addr a6{};
    if (::inet_pton(AF_INET, host.c_str(), &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
    if (::inet_pton(AF_INET6, host.c_str(), &a6) == 1)
      return IN6_IS_ADDR_LOOPBACK(&a6) || (IN6_IS_ADDR_V4MAPPED(&a6) && a6.s6_addr[12] == 127);
    return false;
  }

  // The addresses of this host's interfaces that are up, other than loopback and IPv6 link-local ones (IPv4 only
  // unless `with_ipv6`), IPv4 first.
  static std::vector<std::string> interface_addresses(bool with_ipv6) {
    std::vector<std::string> v4, v6;
    ifaddrs* list = nullptr;
    if (::getifaddrs(&list) != 0) return {};
    for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr || !(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK)) continue;
      const int family = i->ifa_addr->sa_family;
      if (family != AF_INET && !(family == AF_INET6 && with_ipv6)) continue;
      if (family == AF_INET6 &&
          IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr))
        continue;
      char host[NI_MAXHOST] = {0};
      const socklen_t len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
      if (::getnameinfo(i->ifa_addr, len, host, sizeof host, nullptr, 0, NI_NUMERICHOST) != 0) continue;
      auto& out = family == AF_INET ? v4 : v6;
      if (!is_loopback(host) && std::find(out.begin(), out.end(), host) == out.end()) out.push_back(host);
    }
    ::freeifaddrs(list);
    v4.insert(v4.end(), v6.begin(), v6.end());
    if (v4.size() > 16) v4.resize(16);
    return v4;
  }

  // torchrun with TORCHELASTIC_USE_AGENT_STORE: the ranks meet through the agent's TCPStore at MASTER_ADDR:MASTER_PORT.
  // Rank 0 publishes where it listens as "host:port[,host:port...]"; the others try those in order.
  void bootstrap_through_store(const RankInfo& info, double timeout_s) {
    const auto start = std::chrono::steady_clock::now();
    auto left = [&](double at_least) {
      return std::max(at_least,
                      timeout_s - std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    };
    const std::string key = "nopad/" + info.run_id + "/" + std::to_string(info.restart_count) + "/bootstrap";
    const std::string role = "torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True) at MASTER_ADDR:MASTER_PORT";
    TcpStoreClient store(info.master_addr, info.master_port, timeout_s, role);
    if (rank_ == 0) {
      // The local end of the connection to the store is an address of this host that the store's network reaches,
      // unless it is a loopback address (the store runs on this host, reached as localhost or as a host name that
      // resolves to 127.0.1.1): then, when ranks run on other hosts too, this host's interface addresses instead.
      const std::string local = store.local_address();
      const bool v6 = store.local_family() == AF_INET6;
      const int lfd = listen_on(0, v6 ? AF_INET6 : AF_INET, "a free port");
      const int port = bound_port(lfd);
      std::vector<std::pair<std::string, int>> addrs{{local, port}};
      const bool one_host = info.local_size > 0 && info.local_size == info.world_size;
      if (is_loopback(local) && !one_host) {
        std::vector<std::pair<std::string, int>> ifs;
        for (const std::string& h : interface_addresses(v6)) ifs.emplace_back(h, port);
        if (!ifs.empty()) addrs = std::move(ifs);
      }
      const std::string value = join_addresses(addrs);
      try {
        store.set(key, value, left(5));
        NOPAD_CHECK(store.check(key, left(5)), role, " (", store.endpoint(), ") did not keep the key '", key,
                    "' that rank 0 set: it does not behave as a TCPStore");
      } catch (...) {
        ::close(lfd);
        throw;
      }
      accept_ranks(lfd, timeout_s, start, value + " (published in " + role + " = " + store.endpoint() + " as '" +
                                              key + "')",
                   "check that every rank was started by the same torchrun with the same WORLD_SIZE, and that the "
                   "other hosts can reach " + value);
      return;
    }
    const std::optional<std::string> value = store.wait_get(key, left(0.01));
    if (!value)
      fail("rank ", rank_, " of ", size_, ": rank 0 did not publish its address in ", role, " (", store.endpoint(),
           ", key '", key, "') within ", timeout_s, " s (NOPAD_BOOTSTRAP_TIMEOUT_S): rank 0 did not start or failed "
           "before its bootstrap; check its log");
    // "host:port" or "[v6 address]:port", comma-separated
    std::vector<std::pair<std::string, int>> addrs;
    for (size_t at = 0; at <= value->size();) {
      const size_t comma = std::min(value->find(',', at), value->size());
      const std::string item = value->substr(at, comma - at);
      at = comma + 1;
      const size_t colon = item.rfind(':');
      std::string host = colon == std::string::npos ? "" : item.substr(0, colon);
      if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
      char* end = nullptr;
      const long port = colon == std::string::npos ? 0 : std::strtol(item.c_str() + colon + 1, &end, 10);
      NOPAD_CHECK(!host.empty() && port > 0 && port < 65536 && end != nullptr && *end == '\0', "rank ", rank_,
                  ": the value of '", key, "' in ", role, " (", store.endpoint(), ") is '", *value,
                  "', not host:port[,host:port...]: another program wrote that key");
      addrs.emplace_back(host, static_cast<int>(port));
    }
    connect_to_root(addrs, left(5), "its address from " + role + ", key '" + key + "'", timeout_s);
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
