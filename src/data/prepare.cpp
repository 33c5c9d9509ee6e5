#include "data/prepare.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <string>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/io.h"
#include "core/progress.h"
#include "core/threads.h"
#include "data/dataset_folder.h"
#include "data/shard.h"
#include "data/text_input.h"
#include "data/tokenizer.h"
#include "data/tokenizer_files.h"
#include "data/vocab.h"

namespace nopad {

namespace fs = std::filesystem;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Every instance of `corpus` for dupe rounds 0 .. dupes-1, in (dupe, document) order.
std::vector<Instance> make_instances(const TokenizedCorpus& corpus, const Vocab& vocab, const InstanceOptions& o,
                                     int dupes, int threads, Progress* progress) {
  const size_t num_docs = corpus.num_docs();
  const size_t jobs = num_docs * static_cast<size_t>(dupes);
  std::vector<std::vector<Instance>> per_job(jobs);
  parallel_for(
      jobs, threads,
      [&](size_t j) {
        const size_t dupe = j / num_docs, doc = j % num_docs;
        Rng rng({o.seed, 0x696e7374ull /* "inst" */, dupe, doc});
        per_job[j] = create_instances_from_document(corpus, doc, vocab, o, rng);
        if (progress) progress->add(1);
      },
      16);
  std::vector<Instance> out;
  for (auto& v : per_job)
    for (auto& inst : v) out.push_back(std::move(inst));
  return out;
}

// Writes instances[order[0 .. count)] as shards into `out`'s staging folder, then commits them with `manifest` (its
// num_* fields filled in). Returns the bytes written.
uint64_t write_dataset(DatasetFolderWriter& out, const std::vector<Instance>& instances,
                       const std::vector<uint64_t>& order, size_t count, size_t per_shard, const Vocab& vocab,
                       nlohmann::json manifest, int threads, bool show_progress, size_t* shards_out) {
  const size_t num_shards = (count + per_shard - 1) / per_shard;
  std::vector<uint64_t> shard_bytes(num_shards);
  {
    Progress progress("write", static_cast<double>(num_shards), "shards", show_progress);
    parallel_for(num_shards, threads, [&](size_t s) {
      ShardWriter w(out.staged_shard(s), vocab.size(), vocab.checksum());
      const size_t end = std::min(count, (s + 1) * per_shard);
      for (size_t i = s * per_shard; i < end; ++i) w.add(instances[order[i]]);
      shard_bytes[s] = w.finish();
      progress.add(1);
    });
    progress.finish();
  }
  uint64_t bytes = 0, tokens = 0, masked = 0;
  for (uint64_t b : shard_bytes) bytes += b;
  for (size_t i = 0; i < count; ++i) {
    tokens += instances[order[i]].tokens.size();
    masked += instances[order[i]].mlm_positions.size();
  }
  // The vocabulary travels with the shards, so that training can put the tokenizer beside every checkpoint.
  std::string vocab_text;
  for (const std::string& t : vocab.tokens()) vocab_text += t + "\n";
  out.stage_file("vocab.txt", vocab_text);
  manifest["vocab_file"] = "vocab.txt";
  manifest["num_shards"] = num_shards;
  manifest["num_seqs"] = count;
  manifest["num_tokens"] = tokens;
  manifest["num_masked"] = masked;
  out.commit(num_shards, manifest);
  *shards_out = num_shards;
  return bytes;
}

}  // namespace

std::vector<fs::path> expand_inputs(const std::vector<fs::path>& inputs) {
  NOPAD_CHECK(!inputs.empty(), "no input given: pass text files, folders or - (standard input) with --input");
  std::vector<fs::path> files;
  bool stdin_seen = false;
  for (const fs::path& in : inputs) {
    std::error_code ec;
    if (in == "-") {
      NOPAD_CHECK(!stdin_seen, "--input - is given twice: standard input can be read only once");
      stdin_seen = true;
      files.push_back(in);
      continue;
    }
    const fs::file_status st = fs::status(in, ec);
    if (ec && !is_missing_path_error(ec)) fail_unreadable_path("input", in, ec);
    if (fs::is_regular_file(st) || fs::is_fifo(st) || fs::is_character_file(st)) {
      files.push_back(in);  // a pipe: a process substitution such as <(zcat FILE), or a named pipe
    } else if (fs::is_directory(st)) {
      // Every file below, hidden ones skipped; links to folders are not followed (so a link cannot loop the walk),
      // and an entry that cannot be read (a link that loops, a folder without permission) is an error naming it.
      std::vector<fs::path> found;
      fs::recursive_directory_iterator it(in, ec);
      if (ec) fail_unreadable_path("input folder", in, ec);
      for (const fs::recursive_directory_iterator end; it != end;) {
        const fs::path entry = it->path();
        if (entry.filename().string().rfind('.', 0) != 0) {
          const bool regular = it->is_regular_file(ec);
          if (ec && !is_missing_path_error(ec)) fail_unreadable_path("input", entry, ec);
          if (regular) found.push_back(entry);
        }
        it.increment(ec);  // descends into `entry` when it is a folder
        if (ec) fail_unreadable_path("input folder", entry, ec);
      }
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
  const bool lower_case = resolve_lower_case(opt.lower_case, vocab, "--do-lower-case");
  const WordPieceTokenizer tokenizer(vocab, lower_case);
  const std::vector<fs::path> files = expand_inputs(opt.inputs);
  // Output folders this call creates are removed again if it fails (they are empty then: the writers below remove
  // their staging folders first).
  struct CreatedDirs {
    std::vector<fs::path> dirs;
    bool keep = false;
    void note(const fs::path& dir) {
      std::error_code ec;
      if (!fs::exists(dir, ec)) dirs.push_back(dir);
    }
    ~CreatedDirs() {
      std::error_code ec;
      if (!keep)
        for (const fs::path& d : dirs) fs::remove(d, ec);  // only an empty folder goes
    }
  } created;
  created.note(opt.output);
  if (!opt.eval_output.empty()) created.note(opt.eval_output);
  // The output folders: refused if they hold a dataset (unless --overwrite), replaced only once the new one is
  // complete.
  DatasetFolderWriter out(opt.output, opt.overwrite, "--output");
  const bool held_out = !opt.eval_output.empty();
  const int eval_dupes = opt.eval_dupe_factor > 0 ? opt.eval_dupe_factor : opt.instances.dupe_factor;
  std::optional<DatasetFolderWriter> eval_out;
  if (held_out) {
    NOPAD_CHECK(opt.eval_samples >= 1, "--eval-samples must be at least 1, got ", opt.eval_samples);
    NOPAD_CHECK(opt.eval_dupe_factor >= 0, "--eval-dupe-factor must be >= 0 (0: --dupe-factor), got ",
                opt.eval_dupe_factor);
    NOPAD_CHECK(fs::weakly_canonical(opt.eval_output) != fs::weakly_canonical(opt.output),
                "--eval-output must be another folder than --output");
    eval_out.emplace(opt.eval_output, opt.overwrite, "--eval-output");
  }

  // 1. Read (decompressing), check the format of each file on its own, and split into documents (views into the
  // texts, which stay alive until tokenised: the file's text, or for JSON lines the records' decoded texts).
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> texts(files.size()), names(files.size());
  std::vector<std::vector<TextDocument>> file_docs(files.size());
  parallel_for(files.size(), r.threads, [&](size_t f) {
    TextInput in = read_text_input(files[f]);
    names[f] = in.name;
    const TextFormat format = detect_text_format(in, opt.format);
    if (format == TextFormat::kJsonLines) {
      // Decoded into texts[f] in place: it does not move again, so the views stay valid.
      file_docs[f] = split_json_lines(in.text, opt.text_field, in.name, texts[f]);
    } else {
      texts[f] = std::move(in.text);
      file_docs[f] = split_documents(texts[f], format);
    }
    NOPAD_CHECK(!file_docs[f].empty(), "input ", in.name, " contains no text");
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
  // The input's sentences and tokens (training and held-out documents together; empty sentences are not kept).
  for (const auto& d : doc_tokens)
    for (const auto& sent : d)
      if (!sent.empty()) ++r.sentences, r.text_tokens += sent.size();
  // 2b. Held-out evaluation documents (PrepareOptions::eval_output): a seeded random order of the documents; the first
  // m are held out, m doubling until their instances reach eval_samples (at least one document stays for training).
  std::vector<Instance> eval_instances;
  std::vector<uint64_t> eval_order;
  std::vector<char> is_eval(doc_tokens.size(), 0);
  if (held_out) {
    const auto t_eval = std::chrono::steady_clock::now();
    std::vector<size_t> doc_order(doc_tokens.size());
    for (size_t i = 0; i < doc_order.size(); ++i) doc_order[i] = i;
    Rng eval_rng({opt.instances.seed, 0x6576616cull /* "eval" */});
    eval_rng.shuffle(doc_order.begin(), doc_order.end());
    const size_t usable = doc_tokens.size() - 1;
    NOPAD_CHECK(usable >= 1, "a held-out eval set needs at least 2 documents; the inputs hold ",
                doc_tokens.size());
    // First guess: documents' tokens ~ instances x max_seq_length / dupes, with a margin.
    const double tokens_per_doc =
        std::max(1.0, static_cast<double>(r.text_tokens) / static_cast<double>(doc_tokens.size()));
    size_t m = static_cast<size_t>(std::ceil(1.5 * static_cast<double>(opt.eval_samples) * opt.instances.max_seq_length /
                                             (tokens_per_doc * eval_dupes)));
    m = std::clamp<size_t>(m, 1, usable);
    for (;;) {
      TokenizedCorpus eval_corpus;
      for (size_t i = 0; i < m; ++i) eval_corpus.add_document(doc_tokens[doc_order[i]]);
      eval_instances = make_instances(eval_corpus, vocab, opt.instances, eval_dupes, r.threads, nullptr);
      if (eval_instances.size() >= static_cast<size_t>(opt.eval_samples) || m == usable) break;
      m = std::min(usable, 2 * m);
    }
    NOPAD_CHECK(eval_instances.size() >= static_cast<size_t>(opt.eval_samples), "--eval-samples ", opt.eval_samples,
                ": holding out ", m, " of ", doc_tokens.size(), " documents (all but one) gives only ",
                eval_instances.size(), " instances with --eval-dupe-factor ", eval_dupes,
                "; lower --eval-samples, raise --eval-dupe-factor or add text");
    for (size_t i = 0; i < m; ++i) is_eval[doc_order[i]] = 1;
    eval_order.resize(eval_instances.size());
    for (size_t i = 0; i < eval_order.size(); ++i) eval_order[i] = i;
    Rng pick_rng({opt.instances.seed, 0x7069636bull /* "pick" */});
    pick_rng.shuffle(eval_order.begin(), eval_order.end());
    r.eval_documents = m;
    r.eval_candidates = eval_instances.size();
    r.eval_instances = static_cast<uint64_t>(opt.eval_samples);
    r.tokenize_s += seconds_since(t_eval);
  }
  TokenizedCorpus corpus;
  for (size_t d = 0; d < doc_tokens.size(); ++d) {
    if (!is_eval[d]) corpus.add_document(doc_tokens[d]);
    std::vector<std::vector<int32_t>>().swap(doc_tokens[d]);
  }
  doc_tokens.clear();
  texts.clear();
  file_docs.clear();
  r.documents = corpus.num_docs() + r.eval_documents;  // all documents: training's and the held-out ones
  NOPAD_CHECK(corpus.num_docs() >= 1, "the inputs contain no tokenisable text");
  r.tokenize_s = seconds_since(t0);

  // 3. Instances for every (dupe, document), each from its own keyed random stream.
  t0 = std::chrono::steady_clock::now();
  const size_t jobs = corpus.num_docs() * static_cast<size_t>(opt.instances.dupe_factor);
  std::vector<Instance> instances;
  {
    Progress progress("instances", static_cast<double>(jobs), "docs", opt.progress);
    instances = make_instances(corpus, vocab, opt.instances, opt.instances.dupe_factor, r.threads, &progress);
    progress.finish();
  }
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
  // The eval set first: a training manifest that names it is only written once it is complete.
  t0 = std::chrono::steady_clock::now();
  nlohmann::json options = {{"max_seq_length", opt.instances.max_seq_length},
                            {"max_predictions", opt.instances.max_predictions},
                            {"masked_lm_prob", opt.instances.masked_lm_prob},
                            {"short_seq_prob", opt.instances.short_seq_prob},
                            {"dupe_factor", opt.instances.dupe_factor},
                            {"seed", opt.instances.seed}};
  nlohmann::json inputs = nlohmann::json::array();
  for (const std::string& name : names) inputs.push_back(name);
  const size_t per_shard = static_cast<size_t>(opt.seqs_per_shard);
  if (held_out) {
    nlohmann::json eval_options = options;
    eval_options["dupe_factor"] = eval_dupes;
    nlohmann::json m = {{"format", "nopad-shards"},
                        {"version", kShardVersion},
                        {"source", "text, held-out documents"},
                        {"vocab_size", vocab.size()},
                        {"vocab_checksum", vocab.checksum()},
                        {"do_lower_case", lower_case},
                        {"options", eval_options},
                        {"documents", r.eval_documents},
                        {"candidates", r.eval_candidates},
                        {"training_set", fs::absolute(opt.output).lexically_normal().string()},
                        {"inputs", inputs}};
    size_t eval_shards = 0;
    r.output_bytes += write_dataset(*eval_out, eval_instances, eval_order, static_cast<size_t>(opt.eval_samples),
                                    per_shard, vocab, m, r.threads, false, &eval_shards);
  }
  nlohmann::json manifest = {{"format", "nopad-shards"},
                             {"version", kShardVersion},
                             {"source", "text"},
                             {"vocab_size", vocab.size()},
                             {"vocab_checksum", vocab.checksum()},
                             {"do_lower_case", lower_case},
                             {"options", options},
                             {"documents", corpus.num_docs()},
                             {"sentences", corpus.sentence_offsets.size() - 1},
                             {"inputs", inputs}};
  if (held_out) {
    manifest["held_out_documents"] = r.eval_documents;
    manifest["eval_set"] = fs::absolute(opt.eval_output).lexically_normal().string();
  }
  size_t num_shards = 0;
  r.output_bytes += write_dataset(out, instances, order, instances.size(), per_shard, vocab, manifest, r.threads,
                                  opt.progress, &num_shards);
  r.shards = num_shards;
  r.write_s = seconds_since(t0);
  r.total_s = seconds_since(t_start);
  created.keep = true;
  return r;
}

}  // namespace nopad
