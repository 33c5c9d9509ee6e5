// Builds the BertForPreTraining parameter table (see params.h) and initialises parameters.
#include "model/params.h"

#include <cmath>

#include "core/error.h"
#include "core/rng.h"

namespace nopad {

void ParamLayout::add(std::string name, std::vector<int64_t> shape, ParamTensor::Init init, bool no_weight_decay,
                      bool aligned) {
  ParamTensor t;
  t.name = std::move(name);
  t.shape = std::move(shape);
  t.numel = 1;
  for (int64_t d : t.shape) t.numel *= static_cast<size_t>(d);
  if (aligned) total_ = (total_ + kParamAlign - 1) / kParamAlign * kParamAlign;
  t.offset = total_;
  t.init = init;
  t.no_weight_decay = no_weight_decay;
  total_ += t.numel;
  tensors_.push_back(std::move(t));
}

ParamLayout::ParamLayout(const BertConfig& c) {
  c.validate();
  using I = ParamTensor::Init;
  const int64_t H = c.hidden_size, F = c.intermediate_size;
  auto weight = [&](const std::string& name, std::vector<int64_t> shape, bool aligned = true) {
    add(name, std::move(shape), I::kNormal, false, aligned);
  };
  auto bias = [&](const std::string& name, int64_t n, bool aligned = true) { add(name, {n}, I::kZeros, true, aligned); };
  auto layernorm = [&](const std::string& prefix) {
    add(prefix + ".weight", {H}, I::kOnes, true);
    add(prefix + ".bias", {H}, I::kZeros, true);
  };
  const int64_t vocab_pad = padded_vocab_size(c.vocab_size) - c.vocab_size;  // zero rows after the vocabulary
  weight("bert.embeddings.word_embeddings.weight", {c.vocab_size, H});
  total_ += static_cast<size_t>(vocab_pad * H);
  weight("bert.embeddings.position_embeddings.weight", {c.max_position_embeddings, H});
  weight("bert.embeddings.token_type_embeddings.weight", {c.type_vocab_size, H});
  layernorm("bert.embeddings.LayerNorm");
  for (int32_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "bert.encoder.layer." + std::to_string(l) + ".";
    weight(p + "attention.self.query.weight", {H, H});  // q, k, v weights adjacent: the fused [3H, H] weight
    weight(p + "attention.self.key.weight", {H, H}, false);
    weight(p + "attention.self.value.weight", {H, H}, false);
    bias(p + "attention.self.query.bias", H);  // and the fused [3H] bias
    bias(p + "attention.self.key.bias", H, false);
    bias(p + "attention.self.value.bias", H, false);
    weight(p + "attention.output.dense.weight", {H, H});
    bias(p + "attention.output.dense.bias", H);
    layernorm(p + "attention.output.LayerNorm");
    weight(p + "intermediate.dense.weight", {F, H});
    bias(p + "intermediate.dense.bias", F);
    weight(p + "output.dense.weight", {H, F});
    bias(p + "output.dense.bias", H);
    layernorm(p + "output.LayerNorm");
  }
  weight("bert.pooler.dense.weight", {H, H});
  bias("bert.pooler.dense.bias", H);
  bias("cls.predictions.bias", c.vocab_size);  // the decoder's output bias (decoder.bias in HF is an alias)
  total_ += static_cast<size_t>(vocab_pad);
  weight("cls.predictions.transform.dense.weight", {H, H});
  bias("cls.predictions.transform.dense.bias", H);
  layernorm("cls.predictions.transform.LayerNorm");
  weight("cls.seq_relationship.weight", {2, H});
  bias("cls.seq_relationship.bias", 2);
}

size_t ParamLayout::num_values() const {
  size_t n = 0;
  for (const auto& t : tensors_) n += t.numel;
  return n;
}

const ParamTensor& ParamLayout::find(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return t;
  fail("no parameter named \"", name, "\" in the BERT parameter layout");
}

template <class S>
void initialize_params(const ParamLayout& layout, const BertConfig& config, uint64_t seed, S* params) {
  const double std_dev = config.initializer_range;
  size_t end = 0;  // the alignment gaps are written too (zeros), so the whole buffer is defined
  for (size_t i = 0; i < layout.tensors().size(); ++i) {
    const ParamTensor& t = layout.tensors()[i];
    for (size_t g = end; g < t.offset; ++g) params[g] = S(0);
    end = t.offset + t.numel;
    S* p = params + t.offset;
    switch (t.init) {
      case ParamTensor::Init::kZeros:
        for (size_t e = 0; e < t.numel; ++e) p[e] = S(0);
        break;
      case ParamTensor::Init::kOnes:
        for (size_t e = 0; e < t.numel; ++e) p[e] = S(1);
        break;
      case ParamTensor::Init::kNormal: {
        Rng rng({seed, 0x706172616dull /* "param" */, i});
        for (size_t e = 0; e < t.numel; ++e) {
          double z;
          do {  // Box-Muller, rejecting |z| > 2 (truncated normal at 2 std)
            const double u1 = 1.0 - rng.uniform(), u2 = rng.uniform();
            z = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586476925 * u2);
          } while (std::fabs(z) > 2.0);
          p[e] = static_cast<S>(z * std_dev);
        }
        break;
      }
    }
  }
  for (size_t g = end; g < layout.total_numel(); ++g) params[g] = S(0);
}

template void initialize_params<float>(const ParamLayout&, const BertConfig&, uint64_t, float*);
template void initialize_params<double>(const ParamLayout&, const BertConfig&, uint64_t, double*);

}  // namespace nopad
