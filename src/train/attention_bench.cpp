// The attention benchmark's host side (attention_bench.h): batches from a dataset or a lengths file, the workload
// file, the FLOP count; the timing itself is ops/cuda/attention_bench.cu.
#include "train/attention_bench.h"

#include <fstream>
#include <sstream>

#include "core/error.h"
#include "data/dataset.h"
#include "data/loader.h"

#ifdef NOPAD_HAVE_CUDA
#include "ops/cuda/attention_bench.h"
#endif

namespace nopad {

AttentionBenchBatches attention_bench_batches(const AttentionBenchOptions& o) {
  NOPAD_CHECK(o.data.empty() != o.lengths.empty(), "bench attention needs exactly one of --data and --lengths");
  NOPAD_CHECK(o.batch >= 1 && o.batches >= 1, "bench attention needs --batch >= 1 and --batches >= 1");
  AttentionBenchBatches out;
  if (!o.data.empty()) {
    const Dataset ds(o.data);
    NOPAD_CHECK(o.batch <= ds.size(), "--batch ", o.batch, " is larger than the dataset ", o.data, " (", ds.size(),
                " sequences)");
    LoaderOptions lo;  // the same draw as bench model with this seed
    lo.global_batch = o.batch;
    lo.seed = o.seed;
    lo.background = false;
    Loader loader(ds, lo);
    for (uint64_t i = 0; i < o.batches; ++i) {
      const HostBatch& b = loader.next();
      std::vector<int32_t> len, msk(static_cast<size_t>(b.num_seqs()), 0);
      for (int32_t s = 0; s < b.num_seqs(); ++s) len.push_back(b.cu_seqlens[s + 1] - b.cu_seqlens[s]);
      for (int32_t pos : b.mlm_positions) {  // masked positions are rows of the packed batch
        int32_t s = 0;
        while (b.cu_seqlens[s + 1] <= pos) ++s;
        ++msk[static_cast<size_t>(s)];
      }
      out.lengths.push_back(std::move(len));
      out.masked.push_back(std::move(msk));
    }
    return out;
  }
  std::ifstream f(o.lengths);
  NOPAD_CHECK(f.good(), "cannot read the lengths file ", o.lengths);
  std::vector<int32_t> len, msk;
  std::string line;
  int64_t line_no = 0;
  while (std::getline(f, line)) {
    ++line_no;
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    int64_t n = -1, m = -1;
    ls >> n;
    NOPAD_CHECK(!ls.fail() && n >= 1 && n < (1 << 20), o.lengths, ":", line_no, ": expected 'length [masked]' with ",
                "a length in [1, 2^20), got \"", line, "\"");
    if (!(ls >> m)) m = 0;
    len.push_back(static_cast<int32_t>(n));
    msk.push_back(static_cast<int32_t>(m));
    if (len.size() == o.batch) {
      out.lengths.push_back(std::move(len));
      out.masked.push_back(std::move(msk));
      len.clear();
      msk.clear();
      if (out.lengths.size() == o.batches) break;
    }
  }
  NOPAD_CHECK(!out.lengths.empty(), "the lengths file ", o.lengths, " holds fewer than --batch ", o.batch,
              " sequences");
  return out;
}

double attention_forward_flops(const std::vector<int32_t>& lengths, int heads, int head_dim) {
  double f = 0;
  for (int32_t l : lengths) f += 4.0 * static_cast<double>(l) * l * head_dim * heads;
  return f;
}

std::vector<std::string> run_attention_bench(const AttentionBenchOptions& o) {
  const AttentionBenchBatches b = attention_bench_batches(o);
  if (!o.workload.empty()) {
    std::ofstream f(o.workload);
    NOPAD_CHECK(f.good(), "cannot write the workload file ", o.workload);
    for (size_t i = 0; i < b.lengths.size(); ++i)
      for (size_t s = 0; s < b.lengths[i].size(); ++s) f << b.lengths[i][s] << ' ' << b.masked[i][s] << '\n';
    f.flush();
    NOPAD_CHECK(!f.fail(), "error writing the workload file ", o.workload);
  }
#ifdef NOPAD_HAVE_CUDA
  return cuda::run_attention_bench_gpu(o, b.lengths);
#else
  fail("bench attention runs on a GPU: this nopad was built without the CUDA backend (rebuild with -DNOPAD_CUDA=ON)");
#endif
}

}  // namespace nopad
