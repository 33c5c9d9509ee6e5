// The TCP communicator of torchrun-style launches (dist/comm_tcp.cpp), with its ranks as threads of this process on
// 127.0.0.1: every collective's result on every rank (identical bits, sums in rank order), a collective called
// differently by one rank refused by name, a rank that goes away making the others' next collective fail naming it,
// and a bootstrap that times out with a message when a rank never comes.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "dist/comm.h"

namespace nopad::dist {
namespace {

int free_port() {  // a port the kernel just gave out (released again: racy in theory, fine on a test machine)
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

RankInfo info(int rank, int world, int port) {
  RankInfo i;
  i.rank = rank;
  i.world_size = world;
  i.launcher = "torchrun";
  i.master_addr = "127.0.0.1";
  i.master_port = port;
  return i;
}

// Runs body(comm) on `world` threads, one rank each; returns each rank's error text ("" when none).
std::vector<std::string> run_ranks(int world, const std::function<void(Communicator&)>& body) {
  const int port = free_port();
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        auto c = make_tcp_communicator(info(r, world, port), 30);
        body(*c);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

TEST(TcpCommunicator, EveryCollective) {
  static constexpr int kWorld = 4;
  const auto errors = run_ranks(kWorld, [](Communicator& c) {
    const int r = c.rank();
    EXPECT_EQ(c.size(), kWorld);
    EXPECT_EQ(c.name(), "tcp");
    // Sums: float values whose sum depends on the order are summed in rank order (((x0 + x1) + x2) + x3).
    std::vector<float> f = {1.0f + static_cast<float>(r), r == 0 ? 1e8f : 1.0f, -1.0f};
    c.all_reduce_sum(std::span<float>(f));
    float want = 1e8f;
    for (int k = 1; k < kWorld; ++k) want += 1.0f;
    EXPECT_EQ(f[0], 10.0f);
    EXPECT_EQ(f[1], want);
    EXPECT_EQ(f[2], -4.0f);
    std::vector<double> d = {0.5 * r};
    c.all_reduce_sum(std::span<double>(d));
    EXPECT_EQ(d[0], 3.0);
    std::vector<int64_t> i = {r, int64_t{1} << 40};
    c.all_reduce_sum(std::span<int64_t>(i));
    EXPECT_EQ(i[0], 6);
    EXPECT_EQ(i[1], int64_t{4} << 40);
    std::vector<double> m = {static_cast<double>(r), -static_cast<double>(r)};
    c.all_reduce_max(std::span<double>(m));
    EXPECT_EQ(m[0], 3.0);
    EXPECT_EQ(m[1], 0.0);
    // all_gather, broadcast from a root other than 0, barrier.
    const uint8_t mine[2] = {static_cast<uint8_t>(r), static_cast<uint8_t>(10 + r)};
    std::vector<uint8_t> all(2 * kWorld, 0xff);
    c.all_gather(std::span<const uint8_t>(mine, 2), std::span<uint8_t>(all));
    for (int k = 0; k < kWorld; ++k) {
      EXPECT_EQ(all[2 * k], k);
      EXPECT_EQ(all[2 * k + 1], 10 + k);
    }
    std::vector<uint8_t> b(1000, static_cast<uint8_t>(r == 2 ? 7 : 0));
    c.broadcast(std::span<uint8_t>(b), 2);
    for (uint8_t x : b) ASSERT_EQ(x, 7);
    c.barrier();
    // all_to_all_v: rank s sends (s + 1) bytes of value 10 s + d to rank d.
    std::vector<uint8_t> send;
    std::vector<size_t> counts;
    for (int dst = 0; dst < kWorld; ++dst) {
      counts.push_back(static_cast<size_t>(r + 1));
      for (int k = 0; k <= r; ++k) send.push_back(static_cast<uint8_t>(10 * r + dst));
    }
    std::vector<uint8_t> recv;
    std::vector<size_t> recv_counts;
    c.all_to_all_v(send, counts, recv, recv_counts);
    ASSERT_EQ(recv_counts.size(), static_cast<size_t>(kWorld));
    size_t at = 0;
    for (int s = 0; s < kWorld; ++s) {
      EXPECT_EQ(recv_counts[static_cast<size_t>(s)], static_cast<size_t>(s + 1));
      for (int k = 0; k <= s; ++k) EXPECT_EQ(recv[at++], 10 * s + r);
    }
    EXPECT_EQ(at, recv.size());
    // A larger buffer (several MB) goes through in pieces.
    std::vector<float> big(3 << 20, 1.0f);
    c.all_reduce_sum(std::span<float>(big));
    EXPECT_EQ(big.front(), static_cast<float>(kWorld));
    EXPECT_EQ(big.back(), static_cast<float>(kWorld));
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

TEST(TcpCommunicator, MismatchedCollectiveIsRefusedByName) {
  const auto errors = run_ranks(2, [](Communicator& c) {
    std::vector<double> d(c.rank() == 0 ? 3 : 5, 1.0);  // rank 1 sums 5 values, rank 0 three
    c.all_reduce_sum(std::span<double>(d));
  });
  EXPECT_NE(errors[0].find("rank 1 called another collective"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1], "");  // rank 0 went away: rank 1 learns it instead of waiting forever
}

TEST(TcpCommunicator, APeerThatLeavesIsNamed) {
  const auto errors = run_ranks(3, [](Communicator& c) {
    c.barrier();
    if (c.rank() == 2) return;  // rank 2 leaves (its socket closes)
    std::vector<int64_t> x = {1};
    c.all_reduce_sum(std::span<int64_t>(x));
  });
  EXPECT_NE(errors[0].find("connection to rank 2"), std::string::npos) << errors[0];
  EXPECT_EQ(errors[2], "");
}

TEST(TcpCommunicator, BootstrapTimesOutWithAMessage) {
  const int port = free_port();
  try {
    make_tcp_communicator(info(0, 2, port), 0.5);  // rank 1 never comes
    ADD_FAILURE() << "rank 0 started without rank 1";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("only 1 of 2 ranks joined"), std::string::npos) << e.what();
  }
  try {
    make_tcp_communicator(info(1, 2, free_port()), 0.5);  // nobody listens
    ADD_FAILURE() << "rank 1 started without rank 0";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("could not reach rank 0"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace nopad::dist
