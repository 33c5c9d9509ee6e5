// nopad fill-mask (see fill_mask.h).
#include "train/fill_mask.h"

#include <algorithm>
#include <memory>
#include <numeric>

#include "core/error.h"
#include "data/batch.h"
#include "data/tokenizer_files.h"
#include "dist/launch.h"
#include "train/checkpoint.h"
#include "train/engine.h"

namespace nopad {

namespace {

constexpr std::string_view kMask = "[MASK]";
constexpr std::string_view kSep = "[SEP]";
constexpr size_t kTextsPerBatch = 32;

}  // namespace

std::vector<int32_t> encode_with_special_tokens(const WordPieceTokenizer& tokenizer, std::string_view text) {
  const SpecialIds& sp = tokenizer.vocab().special();
  std::vector<int32_t> ids = {sp.cls};
  // Split at the literal special tokens first (the basic tokenizer would cut "[MASK]" into "[", "mask", "]").
  while (!text.empty()) {
    const size_t m = text.find(kMask), s = text.find(kSep);
    const size_t at = std::min(m, s);
    tokenizer.encode(text.substr(0, at), ids);
    if (at == std::string_view::npos) break;
    const bool is_mask = at == m;
    ids.push_back(is_mask ? sp.mask : sp.sep);
    text.remove_prefix(at + (is_mask ? kMask.size() : kSep.size()));
  }
  ids.push_back(sp.sep);
  return ids;
}

std::vector<FillMaskAnswer> fill_mask(const FillMaskOptions& o, const std::vector<std::string>& texts,
                                      std::string* device_name) {
  NOPAD_CHECK(o.top_k >= 1, "--top-k must be at least 1, got ", o.top_k);
  NOPAD_CHECK(!texts.empty(), "no text given: pass texts with [MASK] in them (or lines on standard input)");
  BertConfig config;
  const std::vector<float> params = load_model_folder(o.model_dir, "--checkpoint", &config);
  std::unique_ptr<TokenizerFiles> tok_files;
  if (o.vocab.empty()) {
    tok_files = std::make_unique<TokenizerFiles>(read_tokenizer_files(o.model_dir));
  } else {
    tok_files = std::make_unique<TokenizerFiles>(TokenizerFiles{Vocab::load(o.vocab)});
    tok_files->lower_case = resolve_lower_case(o.lower_case, tok_files->vocab, "--do-lower-case");
  }
  const Vocab& vocab = tok_files->vocab;
  NOPAD_CHECK(vocab.size() <= config.vocab_size, "the vocabulary ", vocab.origin(), " has ", vocab.size(),
              " tokens, more than the model's vocab_size ", config.vocab_size, ": it is not this model's vocabulary");
  const WordPieceTokenizer tokenizer(vocab, tok_files->lower_case);

  std::vector<std::vector<int32_t>> encoded(texts.size());
  size_t longest = 0, most_masks = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    encoded[i] = encode_with_special_tokens(tokenizer, texts[i]);
    const size_t masks = static_cast<size_t>(std::count(encoded[i].begin(), encoded[i].end(), vocab.special().mask));
    NOPAD_CHECK(masks > 0, "text ", i + 1, " (\"", texts[i], "\") has no [MASK]: write [MASK] where a token is to "
                "be predicted");
    NOPAD_CHECK(encoded[i].size() <= static_cast<size_t>(config.max_position_embeddings), "text ", i + 1, " is ",
                encoded[i].size(), " tokens long, more than the model's max_position_embeddings ",
                config.max_position_embeddings);
    longest = std::max(longest, encoded[i].size());
    most_masks = std::max(most_masks, masks);
  }

  const std::string device = resolve_device(o.device);
  const size_t per_batch = std::min(kTextsPerBatch, texts.size());
  EngineOptions eo;
  eo.config = config;
  eo.max_tokens = static_cast<int32_t>(per_batch * longest);
  eo.max_seqs = static_cast<int32_t>(per_batch);
  eo.max_masked = static_cast<int32_t>(per_batch * most_masks);
  eo.precision = resolve_precision("auto", device);
  eo.threads = o.threads > 0 ? o.threads : dist::default_cpu_threads();
  const std::unique_ptr<TrainEngine> engine = make_engine(device, eo);
  engine->set_params(params.data());
  if (device_name) *device_name = engine->device_name() + ", " + engine->precision();

  const size_t V = static_cast<size_t>(config.vocab_size);
  std::vector<FillMaskAnswer> answers(texts.size());
  HostBatch batch;
  for (size_t first = 0; first < texts.size(); first += per_batch) {
    const size_t last = std::min(texts.size(), first + per_batch);
    batch.clear();
    for (size_t i = first; i < last; ++i) {
      const std::vector<int32_t>& ids = encoded[i];
      const int32_t start = batch.num_tokens();
      for (size_t p = 0; p < ids.size(); ++p) {
        if (ids[p] == vocab.special().mask) {
          batch.mlm_positions.push_back(start + static_cast<int32_t>(p));
          batch.mlm_labels.push_back(ids[p]);  // any valid id: only the probabilities are read
        }
        batch.tokens.push_back(ids[p]);
        batch.positions.push_back(static_cast<int32_t>(p));
        batch.segments.push_back(0);
      }
      batch.cu_seqlens.push_back(batch.num_tokens());
      batch.max_seqlen = std::max(batch.max_seqlen, static_cast<int32_t>(ids.size()));
      batch.nsp_labels.push_back(0);
      batch.sample_ids.push_back(i);
    }
    const std::vector<float> probs = engine->mlm_probabilities(batch);
    NOPAD_CHECK(probs.size() == static_cast<size_t>(batch.num_masked()) * V, "internal: fill-mask got ",
                probs.size(), " probabilities for ", batch.num_masked(), " masks of ", V, " tokens");
    size_t row = 0;
    std::vector<int32_t> order(V);
    for (size_t i = first; i < last; ++i) {
      FillMaskAnswer& a = answers[i];
      a.text = texts[i];
      const size_t masks = static_cast<size_t>(std::count(encoded[i].begin(), encoded[i].end(), vocab.special().mask));
      for (size_t k = 0; k < masks; ++k, ++row) {
        const float* p = probs.data() + row * V;
        std::iota(order.begin(), order.end(), 0);
        // Only the vocabulary's tokens are candidates (a model's vocab_size may pad the vocabulary).
        const size_t n = static_cast<size_t>(vocab.size());
        const size_t top = std::min<size_t>(static_cast<size_t>(o.top_k), n);
        std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(top),
                          order.begin() + static_cast<std::ptrdiff_t>(n),
                          [&](int32_t x, int32_t y) { return p[x] > p[y] || (p[x] == p[y] && x < y); });
        std::vector<FillMaskCandidate> list;
        for (size_t j = 0; j < top; ++j) list.push_back({order[j], vocab.token(order[j]), p[order[j]]});
        a.masks.push_back(std::move(list));
      }
      // The text with each [MASK] replaced by its best token ("##" continuations joined to the word before).
      std::string_view rest = a.text;
      for (const auto& list : a.masks) {
        const size_t at = rest.find(kMask);
        std::string best = list.front().token;
        std::string_view head = rest.substr(0, at);
        if (best.rfind("##", 0) == 0) {
          best = best.substr(2);
          while (!head.empty() && head.back() == ' ') head.remove_suffix(1);
        }
        a.filled.append(head);
        a.filled += best;
        rest.remove_prefix(at + kMask.size());
      }
      a.filled.append(rest);
    }
  }
  return answers;
}

}  // namespace nopad
