// The model benchmark on the CPU: its FLOP count against a hand computation (the peers' model_flops), and a whole
// `bench model --device cpu` run on a tiny prepared dataset producing a well-formed JSON report and workload file.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/prepare.h"
#include "model/config.h"
#include "test_util.h"
#include "train/attention_bench.h"
#include "train/bench.h"

namespace nopad {
namespace {

BertConfig tiny() { return BertConfig::from_file((test::source_dir() / "data/configs/bert-tiny.json").string()); }

TEST(BenchFlops, MatchesHandComputationOnBertTiny) {
  // Two sequences: 10 tokens with 2 masked, 64 tokens with 9 masked. h=128, 2 layers, ffn 512, vocab 30522.
  HostBatch b;
  b.cu_seqlens = {0, 10, 74};
  b.tokens.assign(74, 1000);
  b.positions.assign(74, 0);
  b.segments.assign(74, 0);
  b.nsp_labels = {0, 1};
  b.sample_ids = {0, 1};
  b.max_seqlen = 64;
  b.mlm_positions = {1, 5, 11, 12, 20, 30, 40, 50, 60, 70, 73};
  b.mlm_labels.assign(b.mlm_positions.size(), 2000);
  // per sequence: n*L*2*(4h^2 + 2h*ffn) + L*4*n^2*h + m*2*(h^2 + h*V) + 2*(h^2 + 2h)
  const uint64_t s1 = 7864320ull + 102400ull + 15692800ull + 33280ull;   // n=10, m=2
  const uint64_t s2 = 50331648ull + 4194304ull + 70617600ull + 33280ull; // n=64, m=9
  EXPECT_EQ(sequence_train_flops(tiny(), 10, 2), 3 * s1);
  EXPECT_EQ(sequence_train_flops(tiny(), 64, 9), 3 * s2);
  EXPECT_EQ(batch_train_flops(tiny(), b), 446608896ull);  // peers/common.py model_flops([(10,2),(64,9)], ...)
  EXPECT_EQ(3 * (s1 + s2), 446608896ull);
}

struct BenchData {
  test::TempDir dir{"bench-data"};
  std::filesystem::path path;
  BenchData() {
    PrepareOptions o;
    o.inputs = {test::wiki_sample_dir() / "wiki_00"};
    o.vocab = test::vocab_path();
    o.output = dir / "wiki_00";
    o.instances.max_seq_length = 64;
    o.instances.max_predictions = 10;  // must not exceed max_seq_length
    o.instances.dupe_factor = 1;
    o.threads = 2;
    o.progress = false;
    prepare_dataset(o);
    path = o.output;
  }
};
const BenchData& bench_data() {  // prepared once for the suite
  static BenchData d;
  return d;
}

TEST(BenchModel, CpuRunPrintsCompleteJson) {
  const BenchData& data = bench_data();
  test::TempDir out{"bench-out"};
  ModelBenchOptions o;
  o.model = (test::source_dir() / "data/configs/bert-tiny.json").string();
  o.data = data.path.string();
  o.batch = 4;
  o.steps = 2;
  o.warmup = 1;
  o.device = "cpu";
  o.threads = 2;
  o.workload = (out / "workload.txt").string();
  const ModelBenchResult r = run_model_bench(o);

  const nlohmann::json j = nlohmann::json::parse(r.json);
  for (const char* key : {"bench", "device", "gpu", "model", "batch", "steps", "step_ms", "seqs_per_s",
                          "real_tokens_per_s", "model_tflops", "mfu", "max_mem_gib", "final_loss"})
    EXPECT_TRUE(j.contains(key)) << "missing key " << key;
  EXPECT_EQ(j["bench"], "model");
  EXPECT_EQ(j["device"], "cpu");
  EXPECT_EQ(j["model"], "bert-tiny");
  EXPECT_EQ(j["batch"], 4);
  EXPECT_EQ(j["steps"], 2);
  EXPECT_GT(j["seqs_per_s"].get<double>(), 0.0);
  EXPECT_GT(j["real_tokens_per_s"].get<double>(), 0.0);
  EXPECT_GT(j["model_tflops"].get<double>(), 0.0);
  EXPECT_GT(j["step_ms"].get<double>(), 0.0);
  ASSERT_TRUE(j["final_loss"].is_number());
  EXPECT_TRUE(std::isfinite(j["final_loss"].get<double>()));
  EXPECT_GT(j["final_loss"].get<double>(), 0.0);
  EXPECT_EQ(r.seqs, 8u);
  // The CPU has no energy meter: no power fields rather than made-up ones.
  for (const char* key : {"power_w", "energy_j_per_seq", "sm_clock_mhz", "power_capped"})
    EXPECT_FALSE(j.contains(key)) << "unexpected key " << key;
  EXPECT_FALSE(r.energy.valid);

  // The workload file: one "length masked" line per timed sequence, and its FLOPs are the report's.
  std::ifstream f(o.workload);
  int64_t n = 0, m = 0, lines = 0;
  uint64_t flops = 0, tokens = 0;
  const BertConfig config = tiny();
  while (f >> n >> m) {
    EXPECT_GE(n, 5);
    EXPECT_LE(n, 64);
    EXPECT_GE(m, 0);
    EXPECT_LT(m, n);
    flops += sequence_train_flops(config, n, m);
    tokens += static_cast<uint64_t>(n);
    ++lines;
  }
  EXPECT_EQ(lines, 8);
  EXPECT_EQ(flops, r.flops);
  EXPECT_EQ(tokens, r.tokens);
}

// The energy reading's arithmetic: counter deltas in millijoules over host seconds, the sampled clock's mean and the
// share of samples with the power cap active.
TEST(Energy, ReadingFromCounterDeltas) {
  const EnergyReading r = make_energy_reading(5'000'000, 5'000'000 + 2'079'000, 3.0, 1600.0 + 1650.0 + 1700.0, 2, 3);
  ASSERT_TRUE(r.valid);
  EXPECT_DOUBLE_EQ(r.joules, 2079.0);
  EXPECT_DOUBLE_EQ(r.seconds, 3.0);
  EXPECT_DOUBLE_EQ(r.watts(), 693.0);
  EXPECT_DOUBLE_EQ(r.sm_mhz, 1650.0);
  EXPECT_DOUBLE_EQ(r.power_capped, 2.0 / 3.0);
  EXPECT_EQ(r.samples, 3);
  const EnergyReading no_samples = make_energy_reading(0, 1000, 0.5, 0.0, 0, 0);  // a window shorter than a sample
  ASSERT_TRUE(no_samples.valid);
  EXPECT_DOUBLE_EQ(no_samples.watts(), 2.0);
  EXPECT_DOUBLE_EQ(no_samples.sm_mhz, 0.0);
  EXPECT_FALSE(make_energy_reading(2000, 1000, 1.0, 0.0, 0, 0).valid);  // the counter went back (a driver reset)
  EXPECT_FALSE(make_energy_reading(1000, 2000, 0.0, 0.0, 0, 0).valid);  // no time elapsed
}

// A meter for a device NVML does not have (or on a machine without the driver, as in CI) is unavailable, says why,
// and its window gives no reading.
TEST(Energy, MeterWithoutTheDeviceIsUnavailable) {
  EnergyMeter m("00000000:FF:1F.7");
  EXPECT_FALSE(m.available());
  EXPECT_FALSE(m.why_unavailable().empty());
  m.begin();
  EXPECT_FALSE(m.end().valid);
}

// --graph on a device without graphs: the experiment says so, and still reports what T buckets would pad.
TEST(BenchModel, GraphExperimentOnCpuReportsBucketPaddingOnly) {
  const BenchData& data = bench_data();
  ModelBenchOptions o;
  o.model = (test::source_dir() / "data/configs/bert-tiny.json").string();
  o.data = data.path.string();
  o.batch = 4;
  o.steps = 2;
  o.warmup = 1;
  o.device = "cpu";
  o.threads = 2;
  o.graph = true;
  const nlohmann::json j = nlohmann::json::parse(run_model_bench(o).json);
  ASSERT_TRUE(j.contains("graph_experiment"));
  const nlohmann::json& g = j["graph_experiment"];
  EXPECT_EQ(g["note"], "not supported on this device");
  EXPECT_FALSE(g.contains("graph_ms"));
  // Batches of 4 sequences of <= 64 tokens are < 256 rows: a 1024-row bucket pads more than a 128-row one.
  EXPECT_GT(g["bucket_128_padding"].get<double>(), 0.0);
  EXPECT_GT(g["bucket_1024_padding"].get<double>(), g["bucket_128_padding"].get<double>());
}

TEST(BenchModel, RejectsBatchLargerThanDataset) {
  const BenchData& data = bench_data();
  ModelBenchOptions o;
  o.model = (test::source_dir() / "data/configs/bert-tiny.json").string();
  o.data = data.path.string();
  o.batch = 100000000;
  o.steps = 1;
  o.device = "cpu";
  try {
    run_model_bench(o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("larger than the dataset"), std::string::npos) << e.what();
  }
}

// bench attention's host side: batches from a lengths file (cut in order, comments skipped, masked counts optional)
// and from a dataset (the loader's batches: lengths and masked counts add up to the batch), the workload file written
// before the GPU is needed, and clear errors for bad input.
TEST(BenchAttention, BatchesFromALengthsFile) {
  test::TempDir dir{"bench-attn"};
  const std::string path = (dir / "lengths.txt").string();
  {
    std::ofstream f(path);
    f << "# lengths\n512 76\n1\n300 45\n\n64 9\n65 10\n128 20\n7 1\n";
  }
  AttentionBenchOptions o;
  o.lengths = path;
  o.batch = 3;
  o.batches = 5;
  const AttentionBenchBatches b = attention_bench_batches(o);
  ASSERT_EQ(b.lengths.size(), 2u);  // 7 sequences: two full batches of 3, the rest dropped
  EXPECT_EQ(b.lengths[0], (std::vector<int32_t>{512, 1, 300}));
  EXPECT_EQ(b.masked[0], (std::vector<int32_t>{76, 0, 45}));
  EXPECT_EQ(b.lengths[1], (std::vector<int32_t>{64, 65, 128}));
  EXPECT_DOUBLE_EQ(attention_forward_flops({512, 1}, 16, 64), 4.0 * (512.0 * 512 + 1) * 64 * 16);

  {
    std::ofstream f(path);
    f << "100 3\nabc\n";
  }
  o.batch = 1;
  try {
    o.batches = 2;
    attention_bench_batches(o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lengths.txt:2"), std::string::npos) << e.what();
  }
  o.lengths = (dir / "missing.txt").string();
  EXPECT_THROW(attention_bench_batches(o), Error);
  o.data = "x";  // both sources
  EXPECT_THROW(attention_bench_batches(o), Error);
}

TEST(BenchAttention, BatchesFromADatasetAndTheWorkloadFile) {
  const BenchData& data = bench_data();
  test::TempDir out{"bench-attn-out"};
  AttentionBenchOptions o;
  o.data = data.path.string();
  o.batch = 4;
  o.batches = 2;
  o.workload = (out / "workload.txt").string();
  const AttentionBenchBatches b = attention_bench_batches(o);
  ASSERT_EQ(b.lengths.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    ASSERT_EQ(b.lengths[i].size(), 4u);
    for (size_t s = 0; s < 4; ++s) {
      EXPECT_GE(b.lengths[i][s], 5);
      EXPECT_LE(b.lengths[i][s], 64);
      EXPECT_GE(b.masked[i][s], 1);
      EXPECT_LT(b.masked[i][s], b.lengths[i][s]);
    }
  }
  // The GPU part fails here (no GPU, or no CUDA backend), after the workload file was written for the peers.
  EXPECT_THROW(run_attention_bench(o), Error);
  std::ifstream f(o.workload);
  int64_t n = 0, m = 0;
  size_t lines = 0;
  while (f >> n >> m) {
    EXPECT_EQ(n, b.lengths[lines / 4][lines % 4]);
    EXPECT_EQ(m, b.masked[lines / 4][lines % 4]);
    ++lines;
  }
  EXPECT_EQ(lines, 8u);
}

}  // namespace
}  // namespace nopad
