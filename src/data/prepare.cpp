#include "data/prepare.h"

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/io.h"
#include "core/progress.h"
#include "core/threads.h"
#include "core/utf8.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "data/vocab.h"

namespace nopad {

namespace fs = std::filesystem;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string shard_name(size_t index) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "shard_%05zu%s", index, kShardExtension);
  return buf;
}

}  // namespace

std::vector<fs::path> expand_inputs(const std::vector<fs::path>& inputs) {
  NOPAD_CHECK(!inputs.empty(), "no input given: pass text files or folders with --input");
  std::vector<fs::path> files;
  for (const fs::path& in : inputs) {
    std::error_code ec;
    if (fs::is_regular_file(in, ec)) {
      files.push_back(in);
    } else if (fs::is_directory(in, ec)) {
      std::vector<fs::path> found;
      for (const auto& e : fs::recursive_directory_iterator(in))
        if (e.is_regular_file() && e.path().filename().string().rfind('.', 0) != 0) found.push_back(e.path());
      NOPAD_CHECK(!found.empty(), "input folder ", in.string(), " holds no files");
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else {
      fail("input ", in.string(), " does not exist");
    }
  }
  return files;
}

PrepareResult prepare_dataset(const PrepareOptions& opt) {
  const auto t_start = std::chrono::steady_clock::now();
  PrepareResult r;
  r.threads = opt.threads > 0 ? opt.threads : hardware_threads();
  opt.instances.validate();
  NOPAD_CHECK(opt.seqs_per_shard >= 1, "--seqs-per-shard must be at least 1");

  // Everything that can fail cheaply fails before the long work starts.
  const Vocab vocab = Vocab::load(opt.vocab);
  const WordPieceTokenizer tokenizer(vocab);
  const std::vector<fs::path> files = expand_inputs(opt.inputs);
  ensure_writable_dir(opt.output);
  std::vector<fs::path> stale;
  for (const auto& e : fs::directory_iterator(opt.output))
    if (e.path().extension() == kShardExtension || e.path().filename() == "dataset.json") stale.push_back(e.path());
  NOPAD_CHECK(stale.empty() || opt.overwrite, "output folder ", opt.output.string(),
              " already holds a dataset; pass --overwrite to replace it, or choose another --output");

  // 1. Read and split into documents (views into the file texts, which stay alive until tokenised).
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> texts(files.size());
  std::vector<std::vector<TextDocument>> file_docs(files.size());
  parallel_for(files.size(), r.threads, [&](size_t f) {
    texts[f] = read_file(files[f]);
    const size_t bad = find_invalid_utf8(texts[f]);
    NOPAD_CHECK(bad == std::string::npos, "input ", files[f].string(), " is not UTF-8 text: invalid byte 0x",
                std::hex, static_cast<int>(static_cast<unsigned char>(texts[f][bad])), std::dec, " at offset ", bad,
                " (convert it to UTF-8, e.g. with iconv)");
    file_docs[f] = split_documents(texts[f], opt.format);
    NOPAD_CHECK(!file_docs[f].empty(), "input ", files[f].string(), " contains no text");
  });
  std::vector<const TextDocument*> docs;
  for (size_t f = 0; f < files.size(); ++f) {
    r.input_bytes += texts[f].size();
    for (const TextDocument& d : file_docs[f]) docs.push_back(&d);
  }
  r.input_files = files.size();
  r.read_s = seconds_since(t0);

  // 2. Tokenise every document in parallel.
  t0 = std::chrono::steady_clock::now();
  std::vector<std::vector<std::vector<int32_t>>> doc_tokens(docs.size());
  {
    Progress progress("tokenize", static_cast<double>(r.input_bytes) / 1e6, "MB", opt.progress);
    parallel_for(
        docs.size(), r.threads,
        [&](size_t d) {
          auto& out = doc_tokens[d];
          out.resize(docs[d]->sentences.size());
          size_t bytes = 0;
          for (size_t s = 0; s < out.size(); ++s) {
            tokenizer.encode(docs[d]->sentences[s], out[s]);
            bytes += docs[d]->sentences[s].size();
          }
          progress.add(static_cast<double>(bytes) / 1e6);
        },
        8);
    progress.finish();
  }
  TokenizedCorpus corpus;
  for (auto& d : doc_tokens) {
    corpus.add_document(d);
    std::vector<std::vector<int32_t>>().swap(d);
  }
  doc_tokens.clear();
  texts.clear();
  file_docs.clear();
  r.documents = corpus.num_docs();
  r.sentences = corpus.sentence_offsets.size() - 1;
  r.text_tokens = corpus.tokens.size();
  NOPAD_CHECK(r.documents >= 1, "the inputs contain no tokenisable text");
  r.tokenize_s = seconds_since(t0);

  // 3. Instances for every (dupe, document), each from its own keyed random stream.
  t0 = std::chrono::steady_clock::now();
  const size_t num_docs = corpus.num_docs();
  const size_t jobs = num_docs * static_cast<size_t>(opt.instances.dupe_factor);
  std::vector<std::vector<Instance>> per_job(jobs);
  {
    Progress progress("instances", static_cast<double>(jobs), "docs", opt.progress);
    parallel_for(
        jobs, r.threads,
        [&](size_t j) {
          const size_t dupe = j / num_docs, doc = j % num_docs;
          Rng rng({opt.instances.seed, 0x696e7374ull /* "inst" */, dupe, doc});
          per_job[j] = create_instances_from_document(corpus, doc, vocab, opt.instances, rng);
          progress.add(1);
        },
        16);
    progress.finish();
  }
  std::vector<Instance> instances;
  for (auto& v : per_job)
    for (auto& inst : v) instances.push_back(std::move(inst));
  per_job.clear();
  NOPAD_CHECK(!instances.empty(), "no pre-training instances could be made: the text is too short");
  Rng shuffle_rng({opt.instances.seed, 0x73687566ull /* "shuf" */});
  std::vector<uint64_t> order(instances.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  shuffle_rng.shuffle(order.begin(), order.end());
  r.instances = instances.size();
  for (const Instance& inst : instances) {
    r.instance_tokens += inst.tokens.size();
    r.masked += inst.mlm_positions.size();
    r.random_next += static_cast<uint64_t>(inst.nsp_label);
  }
  r.instances_s = seconds_since(t0);

  // 4. Shards, written in parallel, each atomically; dataset.json last, so a complete manifest means a complete set.
  t0 = std::chrono::steady_clock::now();
  const size_t per_shard = static_cast<size_t>(opt.seqs_per_shard);
  const size_t num_shards = (instances.size() + per_shard - 1) / per_shard;
  std::vector<uint64_t> shard_bytes(num_shards);
  {
    Progress progress("write", static_cast<double>(num_shards), "shards", opt.progress);
    parallel_for(num_shards, r.threads, [&](size_t s) {
      ShardWriter w(opt.output / shard_name(s), vocab.size(), vocab.checksum());
      const size_t end = std::min(instances.size(), (s + 1) * per_shard);
      for (size_t i = s * per_shard; i < end; ++i) w.add(instances[order[i]]);
      shard_bytes[s] = w.finish();
      progress.add(1);
    });
    progress.finish();
  }
  for (uint64_t b : shard_bytes) r.output_bytes += b;
  r.shards = num_shards;
  for (const fs::path& p : stale) {
    bool rewritten = false;
    for (size_t s = 0; s < num_shards && !rewritten; ++s) rewritten = p.filename() == shard_name(s);
    if (!rewritten && p.filename() != "dataset.json") fs::remove(p);
  }
  nlohmann::json manifest = {
      {"format", "nopad-shards"},
      {"version", kShardVersion},
      {"source", "text"},
      {"num_shards", num_shards},
      {"num_seqs", r.instances},
      {"num_tokens", r.instance_tokens},
      {"num_masked", r.masked},
      {"vocab_size", vocab.size()},
      {"vocab_checksum", vocab.checksum()},
      {"options",
       {{"max_seq_length", opt.instances.max_seq_length},
        {"max_predictions", opt.instances.max_predictions},
        {"masked_lm_prob", opt.instances.masked_lm_prob},
        {"short_seq_prob", opt.instances.short_seq_prob},
        {"dupe_factor", opt.instances.dupe_factor},
        {"seed", opt.instances.seed}}},
      {"documents", r.documents},
      {"sentences", r.sentences},
  };
  nlohmann::json inputs = nlohmann::json::array();
  for (const fs::path& f : files) inputs.push_back(f.string());
  manifest["inputs"] = inputs;
  write_file_atomic(opt.output / "dataset.json", manifest.dump(2) + "\n");
  r.write_s = seconds_since(t0);
  r.total_s = seconds_since(t_start);
  return r;
}

}  // namespace nopad
