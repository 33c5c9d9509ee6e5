// Rank detection from launcher environments (dist/launch.h) and the single-process communicator (dist/comm.h):
// Open MPI, MPICH/PMI, Slurm and torchrun variables, precedence, bad values, and that a single process needs nothing.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/comm.h"
#include "dist/launch.h"

namespace nopad::dist {
namespace {

RankInfo detect(const std::map<std::string, std::string>& vars) {
  return detect_rank_info([&](const char* name) -> const char* {
    const auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    detect(vars);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Launch, SingleProcessWhenNothingIsSet) {
  const RankInfo i = detect({});
  EXPECT_EQ(i.rank, 0);
  EXPECT_EQ(i.world_size, 1);
  EXPECT_FALSE(i.distributed());
  EXPECT_EQ(i.launcher, "single");
}

TEST(Launch, OpenMpi) {
  const RankInfo i = detect({{"OMPI_COMM_WORLD_RANK", "5"},
                             {"OMPI_COMM_WORLD_SIZE", "8"},
                             {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                             {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(i.rank, 5);
  EXPECT_EQ(i.world_size, 8);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.local_size, 4);
  EXPECT_EQ(i.launcher, "mpi");
  EXPECT_EQ(describe(i), "rank 5 of 8 (local 1 of 4, mpi)");
}

// A launcher starts one process per rank: each takes its share of the node's cores, not all of them.
TEST(Launch, DefaultThreadsShareTheNodesCores) {
  EXPECT_EQ(default_cpu_threads(detect({}), 16), 16);
  const RankInfo two = detect({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                               {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(default_cpu_threads(two, 2), 1);
  EXPECT_EQ(default_cpu_threads(two, 16), 8);
  const RankInfo torch = detect({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "4"},
                                 {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(default_cpu_threads(torch, 16), 4);
  EXPECT_EQ(default_cpu_threads(torch, 3), 1);  // never 0
}

TEST(Launch, MpichPmi) {
  const RankInfo i = detect({{"PMI_RANK", "2"}, {"PMI_SIZE", "3"}, {"MPI_LOCALRANKID", "0"}});
  EXPECT_EQ(i.rank, 2);
  EXPECT_EQ(i.world_size, 3);
  EXPECT_EQ(i.local_rank, 0);
  EXPECT_EQ(i.local_size, 0);  // not given
}

TEST(Launch, SlurmTakesAPlainTasksPerNodeOnly) {
  RankInfo i = detect({{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "1"},
                       {"SLURM_NTASKS_PER_NODE", "8"}});
  EXPECT_EQ(i.launcher, "slurm");
  EXPECT_EQ(i.rank, 9);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.local_size, 8);
  i = detect({{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "1"},
              {"SLURM_NTASKS_PER_NODE", "8(x2)"}});
  EXPECT_EQ(i.local_size, 0);
}

TEST(Launch, TorchrunNeedsItsBootstrapPoint) {
  const RankInfo i = detect({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "4"},
                             {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(i.launcher, "torchrun");
  EXPECT_EQ(i.rank, 3);
  EXPECT_EQ(i.master_addr, "node0");
  EXPECT_EQ(i.master_port, 29500);
  const std::string e = error_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}});
  EXPECT_NE(e.find("MASTER_ADDR/MASTER_PORT"), std::string::npos) << e;
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}}), "");  // one process needs no bootstrap
}

TEST(Launch, MpiWinsOverSlurmAndTorchrun) {
  // mpirun inside a Slurm allocation, with stale torchrun variables around: mpirun's view is the job's.
  const RankInfo i = detect({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"SLURM_PROCID", "0"},
                             {"SLURM_NTASKS", "1"}, {"RANK", "7"}, {"WORLD_SIZE", "9"}});
  EXPECT_EQ(i.launcher, "mpi");
  EXPECT_EQ(i.rank, 1);
  EXPECT_EQ(i.world_size, 2);
}

TEST(Launch, BadValuesNameTheVariable) {
  std::string e = error_of({{"OMPI_COMM_WORLD_RANK", "two"}, {"OMPI_COMM_WORLD_SIZE", "4"}});
  EXPECT_NE(e.find("OMPI_COMM_WORLD_RANK=\"two\""), std::string::npos) << e;
  e = error_of({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}});
  EXPECT_NE(e.find("SLURM_PROCID=4 is outside [0, SLURM_NTASKS=4)"), std::string::npos) << e;
  e = error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}});
  EXPECT_NE(e.find("WORLD_SIZE=0"), std::string::npos) << e;
  e = error_of({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_NE(e.find("OMPI_COMM_WORLD_LOCAL_RANK=3"), std::string::npos) << e;
}

TEST(Communicator, SingleProcessCollectivesAreIdentity) {
  auto c = make_single_communicator();
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  std::vector<float> f = {1.5f, -2.0f};
  c->all_reduce_sum(f);
  EXPECT_EQ(f, (std::vector<float>{1.5f, -2.0f}));
  const std::vector<uint8_t> send = {1, 2, 3};
  std::vector<uint8_t> recv(3, 0);
  c->all_gather(send, recv);
  EXPECT_EQ(recv, send);
  EXPECT_NO_THROW(check_same_on_all_ranks(*c, 42, "the config"));
  // The exchange with one rank returns every sample, sorted by id.
  const std::vector<uint64_t> ids = {7, 3};
  const std::vector<int32_t> dest = {0, 0};
  const std::vector<uint8_t> payload = {70, 71, 30};
  const std::vector<size_t> offsets = {0, 2, 3};
  const SampleExchange x = exchange_samples(*c, ids, dest, payload, offsets);
  EXPECT_EQ(x.ids, (std::vector<uint64_t>{3, 7}));
  EXPECT_EQ(x.payload, (std::vector<uint8_t>{30, 70, 71}));
  EXPECT_EQ(x.offsets, (std::vector<size_t>{0, 1, 3}));
  const std::vector<int32_t> bad_dest = {0, 1};
  EXPECT_THROW(exchange_samples(*c, ids, bad_dest, payload, offsets), Error);
}

TEST(Communicator, FactoryPicksByLauncher) {
  EXPECT_EQ(make_communicator(RankInfo{})->name(), "single");
  // torchrun: the TCP communicator, whatever the build; without MASTER_ADDR/PORT it says what is missing.
  RankInfo t;
  t.world_size = 2;
  t.rank = 1;
  t.launcher = "torchrun";
  try {
    make_communicator(t);
    ADD_FAILURE() << "a torchrun launch without MASTER_ADDR/MASTER_PORT was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MASTER_ADDR"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace nopad::dist
