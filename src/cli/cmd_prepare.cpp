// nopad prepare: text -> WordPiece -> pre-training instances -> shards (data/prepare.h), with MLPerf's defaults.
#include <cstdio>
#include <memory>

#include "cli/command.h"
#include "data/prepare.h"

namespace {

void setup(CLI::App& sub) {
  auto opt = std::make_shared<nopad::PrepareOptions>();
  auto inputs = std::make_shared<std::vector<std::string>>();
  auto format = std::make_shared<std::string>("auto");
  auto quiet = std::make_shared<bool>(false);
  sub.add_option("--input", *inputs,
                 "text files, folders (every file below), or - for standard input: WikiExtractor output (<doc> ... "
                 "</doc>), one sentence per line with a blank line between documents, or JSON lines; each may be "
                 "gzip-, xz- or zstd-compressed")
      ->required();
  sub.add_option("--vocab", opt->vocab, "WordPiece vocabulary (BERT vocab.txt); copied into --output, so that "
                 "training writes it beside every checkpoint")->required();
  sub.add_option("--do-lower-case", opt->lower_case,
                 "casing: auto (follow the vocabulary: a cased vocabulary, one with capitalised tokens, keeps the "
                 "text's case and accents; an uncased one lower-cases and strips accents), true or false")
      ->check(CLI::IsMember({"auto", "true", "false"}))
      ->capture_default_str();
  sub.add_option("--output", opt->output, "output folder for the shards and dataset.json")->required();
  sub.add_option("--max-seq-length", opt->instances.max_seq_length, "longest instance in tokens")
      ->capture_default_str();
  sub.add_option("--max-predictions", opt->instances.max_predictions, "most masked positions per instance")
      ->capture_default_str();
  sub.add_option("--masked-lm-prob", opt->instances.masked_lm_prob, "fraction of tokens masked")
      ->capture_default_str();
  sub.add_option("--short-seq-prob", opt->instances.short_seq_prob,
                 "probability of aiming at a shorter random length")
      ->capture_default_str();
  sub.add_option("--dupe-factor", opt->instances.dupe_factor,
                 "passes over the text, each with different masks and pairs")
      ->capture_default_str();
  sub.add_option("--seed", opt->instances.seed, "random seed")->capture_default_str();
  sub.add_option("--threads", opt->threads, "worker threads (0: all cores)")->capture_default_str();
  sub.add_option("--seqs-per-shard", opt->seqs_per_shard, "instances per shard file")->capture_default_str();
  sub.add_option("--format", *format,
                 "input format: auto (per file: JSON lines when the first non-blank line is a JSON object, wiki when "
                 "it is a <doc> line, else lines), wiki (WikiExtractor), lines (one sentence per line) or jsonl (one "
                 "JSON object per line, the text in --text-field); gzip, xz and zstd files are decompressed first, "
                 "whatever the format; binary files, Parquet and JSON read as text are refused")
      ->check(CLI::IsMember({"auto", "wiki", "lines", "jsonl"}))
      ->capture_default_str();
  sub.add_option("--text-field", opt->text_field,
                 "the field of each JSON-lines record that holds its text (a top-level key; split into paragraphs "
                 "at newlines and into sentences)")
      ->capture_default_str();
  sub.add_option("--eval-output", opt->eval_output,
                 "also write a held-out evaluation set here: documents drawn at random (seeded) are kept out of "
                 "training until their instances reach --eval-samples; exactly that many are written (MLPerf's "
                 "eval protocol)");
  sub.add_option("--eval-samples", opt->eval_samples, "instances in the held-out evaluation set")
      ->capture_default_str();
  sub.add_option("--eval-dupe-factor", opt->eval_dupe_factor,
                 "passes over the held-out documents (0: --dupe-factor; MLPerf made its eval set with 10)")
      ->capture_default_str();
  sub.add_flag("--overwrite", opt->overwrite, "replace a dataset already in --output (and --eval-output)");
  sub.add_flag("--quiet", *quiet, "no progress output");
  sub.callback([opt, inputs, format, quiet] {
    for (const auto& s : *inputs) opt->inputs.emplace_back(s);
    opt->format = *format == "wiki"    ? nopad::TextFormat::kWikiExtractor
                  : *format == "lines" ? nopad::TextFormat::kSentenceLines
                  : *format == "jsonl" ? nopad::TextFormat::kJsonLines
                                       : nopad::TextFormat::kAuto;
    opt->progress = !*quiet;
    const nopad::PrepareResult r = nopad::prepare_dataset(*opt);
    const double mb = static_cast<double>(r.input_bytes) / 1e6;
    std::printf(
        "prepared %s: %llu files, %.1f MB of text, %llu documents, %llu sentences, %llu text tokens\n"
        "  %llu instances in %llu shards (%.1f MB), mean length %.1f tokens, mean masked %.2f, random next %.1f%%\n"
        "  time %.2f s on %d threads (read %.2f, tokenize %.2f, instances %.2f, write %.2f): %.1f MB/s, "
        "%.2f MB/s per thread\n",
        opt->output.string().c_str(), static_cast<unsigned long long>(r.input_files), mb,
        static_cast<unsigned long long>(r.documents), static_cast<unsigned long long>(r.sentences),
        static_cast<unsigned long long>(r.text_tokens), static_cast<unsigned long long>(r.instances),
        static_cast<unsigned long long>(r.shards), static_cast<double>(r.output_bytes) / 1e6,
        static_cast<double>(r.instance_tokens) / static_cast<double>(r.instances),
        static_cast<double>(r.masked) / static_cast<double>(r.instances),
        100.0 * static_cast<double>(r.random_next) / static_cast<double>(r.instances), r.total_s, r.threads, r.read_s,
        r.tokenize_s, r.instances_s, r.write_s, mb / r.total_s, mb / r.total_s / r.threads);
    if (!opt->eval_output.empty())
      std::printf("  held out for evaluation: %llu documents -> %llu instances, %llu of them written to %s\n",
                  static_cast<unsigned long long>(r.eval_documents),
                  static_cast<unsigned long long>(r.eval_candidates),
                  static_cast<unsigned long long>(r.eval_instances), opt->eval_output.string().c_str());
  });
}

NOPAD_REGISTER_COMMAND("prepare", "text -> WordPiece -> pre-training instances -> shards", 20, setup);

}  // namespace
