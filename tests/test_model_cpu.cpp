// The BERT model on the CPU backend: config parsing and validation, the parameter table against Hugging Face's
// names, shapes and counts, a finite-difference check of the whole model's gradient (double, dropout on), equality
// with an independent padded reference implementation (loss and every parameter gradient, dropout off and on),
// independence from the batch split, gradient accumulation, and a bert-tiny step timing.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "core/error.h"
#include "core/philox.h"
#include "model/bert.h"
#include "model/config.h"
#include "model/params.h"
#include "ops/cpu/cpu_backend.h"
#include "support/batches.h"

namespace nopad {
namespace {

using test_support::make_batch;
using test_support::small_config;
using test_support::sub_batch;

std::string config_path(const std::string& name) { return std::string(NOPAD_SOURCE_DIR) + "/data/configs/" + name; }

// ------------------------------------------------------------------------------------------------ config

TEST(Config, LoadsExampleConfigs) {
  const BertConfig tiny = BertConfig::from_file(config_path("bert-tiny.json"));
  EXPECT_EQ(tiny.hidden_size, 128);
  EXPECT_EQ(tiny.num_hidden_layers, 2);
  EXPECT_EQ(tiny.num_attention_heads, 2);
  EXPECT_EQ(tiny.intermediate_size, 512);
  EXPECT_EQ(tiny.vocab_size, 30522);
  EXPECT_DOUBLE_EQ(tiny.layer_norm_eps, 1e-12);  // default when absent
  for (const char* name : {"bert-mini.json", "bert-base.json", "bert-large-mlperf.json"})
    EXPECT_NO_THROW(BertConfig::from_file(config_path(name))) << name;
}

std::string error_of(const nlohmann::json& j) {
  try {
    BertConfig::from_json(j);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Config, ValidationErrorsNameTheProblem) {
  const nlohmann::json base = BertConfig{}.to_json();
  auto with = [&](const char* key, nlohmann::json value) {
    nlohmann::json j = base;
    j[key] = value;
    return error_of(j);
  };
  EXPECT_NE(with("num_attention_heads", 7).find("not divisible"), std::string::npos);
  EXPECT_NE(with("hidden_act", "relu").find("hidden_act"), std::string::npos);
  for (const char* tanh_name : {"gelu_new", "gelu_pytorch_tanh", "gelu_fast"}) {  // the tanh GELU's names
    EXPECT_EQ(with("hidden_act", tanh_name), "") << tanh_name;
    nlohmann::json j = base;
    j["hidden_act"] = tanh_name;
    const BertConfig c = BertConfig::from_json(j);
    EXPECT_TRUE(c.gelu_tanh());
    EXPECT_EQ(c.to_json()["hidden_act"], tanh_name);  // exported as loaded
  }
  EXPECT_FALSE(BertConfig{}.gelu_tanh());
  EXPECT_NE(with("position_embedding_type", "relative_key").find("position_embedding_type"), std::string::npos);
  EXPECT_NE(with("num_hidden_layer", 3).find("\"num_hidden_layer\""), std::string::npos);  // a typo is not ignored
  EXPECT_NE(with("hidden_size", "768").find("hidden_size"), std::string::npos);             // wrong type
  EXPECT_NE(with("hidden_dropout_prob", 1.0).find("hidden_dropout_prob"), std::string::npos);
  // The attention masks draw 8 bits per element: p above 1 - 1/256 would keep nothing and is refused when read.
  EXPECT_NE(with("attention_probs_dropout_prob", 0.998).find("8 bits"), std::string::npos);
  EXPECT_EQ(with("attention_probs_dropout_prob", 255.0 / 256.0), "");
  EXPECT_NE(with("model_type", "roberta").find("model_type"), std::string::npos);
  EXPECT_NE(with("vocab_size", 0).find("vocab_size"), std::string::npos);
  // Standard Hugging Face keys are accepted.
  nlohmann::json hf = base;
  hf["pad_token_id"] = 0;
  hf["use_cache"] = true;
  hf["classifier_dropout"] = nullptr;
  hf["gradient_checkpointing"] = false;
  hf["transformers_version"] = "4.40.0";
  EXPECT_EQ(error_of(hf), "");
}

// An integer field takes only JSON integers that fit it: nlohmann would turn 128.5 into 128 and 2^40 into 0 (then
// reported as "hidden_size must be positive, got 0").
TEST(Config, IntegerFieldsTakeOnlyIntegersThatFit) {
  const nlohmann::json base = BertConfig{}.to_json();
  auto with = [&](const char* key, nlohmann::json value) {
    nlohmann::json j = base;
    j[key] = value;
    return error_of(j);
  };
  EXPECT_NE(with("hidden_size", 128.5).find("field \"hidden_size\" must be an integer, got 128.5"), std::string::npos)
      << with("hidden_size", 128.5);
  EXPECT_NE(with("num_hidden_layers", 2.0).find("must be an integer"), std::string::npos);
  const std::string big = with("hidden_size", 1099511627776ll);
  EXPECT_NE(big.find("field \"hidden_size\" = 1099511627776 is out of range: it must be in [-2147483648, 2147483647]"),
            std::string::npos) << big;
  EXPECT_NE(with("vocab_size", 18446744073709551615ull).find("out of range"), std::string::npos);
  EXPECT_NE(with("intermediate_size", -4294967296ll).find("out of range"), std::string::npos);
  // In range but invalid: the field's own rule speaks.
  EXPECT_NE(with("num_hidden_layers", -5).find("num_hidden_layers must be positive, got -5"), std::string::npos);
  EXPECT_EQ(with("hidden_size", 768), "");
}

TEST(Config, ToJsonRoundTripsAndIsHuggingFaceShaped) {
  const BertConfig c = BertConfig::from_file(config_path("bert-large-mlperf.json"));
  const nlohmann::json j = c.to_json();
  EXPECT_EQ(j.at("model_type"), "bert");
  EXPECT_EQ(j.at("architectures"), nlohmann::json::array({"BertForPreTraining"}));
  const BertConfig back = BertConfig::from_json(j);
  EXPECT_EQ(back.hidden_size, 1024);
  EXPECT_EQ(back.num_hidden_layers, 24);
  EXPECT_EQ(back.num_attention_heads, 16);
  EXPECT_EQ(back.intermediate_size, 4096);
  EXPECT_DOUBLE_EQ(back.attention_probs_dropout_prob, c.attention_probs_dropout_prob);
}

// ------------------------------------------------------------------------------------------------ params

TEST(Params, BertBaseNamesShapesAndCount) {
  const ParamLayout layout(BertConfig::from_file(config_path("bert-base.json")));
  const std::vector<std::pair<std::string, std::vector<int64_t>>> expected = {
      {"bert.embeddings.word_embeddings.weight", {30522, 768}},
      {"bert.embeddings.position_embeddings.weight", {512, 768}},
      {"bert.embeddings.token_type_embeddings.weight", {2, 768}},
      {"bert.embeddings.LayerNorm.weight", {768}},
      {"bert.encoder.layer.0.attention.self.query.weight", {768, 768}},
      {"bert.encoder.layer.11.attention.self.value.bias", {768}},
      {"bert.encoder.layer.5.attention.output.LayerNorm.bias", {768}},
      {"bert.encoder.layer.3.intermediate.dense.weight", {3072, 768}},
      {"bert.encoder.layer.3.output.dense.weight", {768, 3072}},
      {"bert.encoder.layer.11.output.LayerNorm.weight", {768}},
      {"bert.pooler.dense.weight", {768, 768}},
      {"cls.predictions.bias", {30522}},
      {"cls.predictions.transform.dense.weight", {768, 768}},
      {"cls.predictions.transform.LayerNorm.bias", {768}},
      {"cls.seq_relationship.weight", {2, 768}},
      {"cls.seq_relationship.bias", {2}},
  };
  for (const auto& [name, shape] : expected) EXPECT_EQ(layout.find(name).shape, shape) << name;
  EXPECT_THROW(layout.find("cls.predictions.decoder.weight"), Error);  // tied: not a separate tensor
  // 5 embedding tensors + 16 per layer + 2 pooler + 7 heads.
  EXPECT_EQ(layout.tensors().size(), 5u + 16u * 12 + 2 + 7);
  // HF BertForPreTraining(bert-base-uncased) with the decoder tied: embeddings 23,837,184 + 12 layers x 7,087,872
  // + pooler 590,592 = 109,482,240 (BertModel) + heads 30,522 + 590,592 + 1,536 + 1,538 = 110,106,428.
  EXPECT_EQ(layout.num_values(), 110106428u);
  EXPECT_GE(layout.total_numel(), layout.num_values());
  for (const ParamTensor& t : layout.tensors()) {
    if (t.name.find(".key.") == std::string::npos && t.name.find(".value.") == std::string::npos) {
      EXPECT_EQ(t.offset % kParamAlign, 0u) << t.name;
    }
  }
  // Names unique, each tensor after the previous one (at the next aligned offset, or right after it within a q/k/v
  // group; the word embeddings and the decoder bias are followed by the vocabulary's padding, 30522 -> 30528),
  // flags on biases and LayerNorm only.
  EXPECT_EQ(padded_vocab_size(30522), 30528);
  EXPECT_EQ(padded_vocab_size(30528), 30528);
  std::set<std::string> names;
  size_t next = 0;
  for (const auto& t : layout.tensors()) {
    EXPECT_TRUE(names.insert(t.name).second) << t.name;
    const bool grouped = t.name.find(".key.") != std::string::npos || t.name.find(".value.") != std::string::npos;
    EXPECT_EQ(t.offset, grouped ? next : (next + kParamAlign - 1) / kParamAlign * kParamAlign) << t.name;
    next = t.offset + t.numel;
    if (t.name == "bert.embeddings.word_embeddings.weight") next += 6 * 768;
    if (t.name == "cls.predictions.bias") next += 6;
    const bool is_bias_or_ln = t.name.ends_with(".bias") || t.name.find("LayerNorm") != std::string::npos;
    EXPECT_EQ(t.no_weight_decay, is_bias_or_ln) << t.name;
  }
  // The fused QKV views: [3H, H] weight and [3H] bias are contiguous.
  const size_t H = 768;
  for (int l : {0, 7}) {
    const std::string p = "bert.encoder.layer." + std::to_string(l) + ".attention.self.";
    EXPECT_EQ(layout.offset(p + "key.weight"), layout.offset(p + "query.weight") + H * H);
    EXPECT_EQ(layout.offset(p + "value.weight"), layout.offset(p + "query.weight") + 2 * H * H);
    EXPECT_EQ(layout.offset(p + "key.bias"), layout.offset(p + "query.bias") + H);
    EXPECT_EQ(layout.offset(p + "value.bias"), layout.offset(p + "query.bias") + 2 * H);
  }
}

TEST(Params, BertLargeCount) {
  const ParamLayout layout(BertConfig::from_file(config_path("bert-large-mlperf.json")));
  // Embeddings 30522*1024 + 512*1024 + 2*1024 + 2*1024 = 31,782,912; per layer 4*(1024^2+1024) + 2*1024
  // + (4096*1024+4096) + (1024*4096+1024) + 2*1024 = 12,596,224, x24 = 302,309,376; pooler 1,049,600
  // (BertModel 335,141,888); heads 30,522 + 1,049,600 + 2,048 + 2,050 = 1,084,220.
  EXPECT_EQ(layout.num_values(), 336226108u);
  // Alignment gaps (< 64 elements per tensor) plus the vocabulary padding (6 rows of the word embeddings, 6 bias
  // entries).
  EXPECT_LT(layout.total_numel() - layout.num_values(), 64u * layout.tensors().size() + 6 * 1024 + 6);
  EXPECT_GE(layout.total_numel() - layout.num_values(), 6u * 1024 + 6);
}

TEST(Params, InitialisationFollowsBert) {
  BertConfig c = BertConfig::from_file(config_path("bert-tiny.json"));
  const ParamLayout layout(c);
  std::vector<float> p(layout.total_numel(), std::nanf(""));
  initialize_params(layout, c, 42, p.data());
  for (const auto& t : layout.tensors()) {
    double sum = 0, sum2 = 0, max_abs = 0;
    for (size_t e = 0; e < t.numel; ++e) {
      const double v = p[t.offset + e];
      ASSERT_TRUE(std::isfinite(v)) << t.name;
      sum += v, sum2 += v * v, max_abs = std::max(max_abs, std::fabs(v));
    }
    if (t.name.find("LayerNorm.weight") != std::string::npos) {
      EXPECT_EQ(sum, static_cast<double>(t.numel)) << t.name;
      EXPECT_EQ(max_abs, 1.0);
    } else if (t.no_weight_decay) {
      EXPECT_EQ(max_abs, 0.0) << t.name;
    } else {
      EXPECT_LE(max_abs, 2 * 0.02 + 1e-7) << t.name;  // truncated at 2 std
      if (t.numel > 10000) {  // std of a normal truncated at +-2 sigma is 0.8796 sigma
        EXPECT_NEAR(std::sqrt(sum2 / t.numel), 0.02 * 0.8796, 0.0005) << t.name;
        EXPECT_NEAR(sum / t.numel, 0.0, 0.0005) << t.name;
      }
    }
  }
  std::vector<float> q(layout.total_numel());
  initialize_params(layout, c, 42, q.data());
  EXPECT_EQ(p, q);  // deterministic in the seed
}

// ------------------------------------------------------------------------------------------------ model helpers

// ------------------------------------------------------------------------------------------------ whole-model FD

void expect_whole_model_gradient(const std::string& hidden_act) {
  // Tolerance as in test_ops_cpu.cpp: h = 1e-6 central differences in double, loss O(1).
  BertConfig c = small_config();
  c.hidden_act = hidden_act;
  c.validate();
  ops::CpuBackend<ops::CpuF64> be(1);
  const HostBatch batch = make_batch({1, 5, 9}, {11, 22, 33}, c.vocab_size, 5);
  BertModel<ops::CpuF64> model(c, be, 15, 3, 15);
  model.init_params(7);
  std::vector<double> params(model.num_params()), grads(model.num_params(), std::nan(""));
  model.get_params(params.data());
  model.zero_grad();
  const StepResult r = model.forward(batch, /*train=*/true, 99, 4);
  EXPECT_TRUE(std::isfinite(r.loss));
  EXPECT_EQ(r.mlm_count, batch.num_masked());
  EXPECT_EQ(r.nsp_count, 3);
  model.backward();
  model.get_grads(grads.data());
  const double h = 1e-6;
  int bad = 0, nonzero = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const double saved = params[i];
    params[i] = saved + h;
    model.set_params(params.data());
    const double up = model.forward(batch, true, 99, 4).loss;
    params[i] = saved - h;
    model.set_params(params.data());
    const double down = model.forward(batch, true, 99, 4).loss;
    params[i] = saved;
    const double numeric = (up - down) / (2 * h);
    nonzero += std::fabs(grads[i]) > 1e-8;
    if (!(std::fabs(numeric - grads[i]) <= 1e-6 * (std::fabs(numeric) + std::fabs(grads[i])) + 1e-8) && bad++ < 8) {
      std::string name;
      for (const auto& t : model.layout().tensors())
        if (i >= t.offset && i < t.offset + t.numel) name = t.name;
      ADD_FAILURE() << name << " [" << i << "]: analytic " << grads[i] << " numeric " << numeric;
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_GT(nonzero, static_cast<int>(params.size()) / 2);
}
TEST(ModelCpu, WholeModelGradientMatchesFiniteDifferences) { expect_whole_model_gradient("gelu"); }

// Gradient buckets for data-parallel overlap: they tile the buffer exactly once, the layers' come first (last layer
// first), and an armed hook reports each bucket in that order at a point where its gradients are already final (the
// CPU backend computes synchronously, so the values seen at the hook equal the values after backward).
TEST(ModelCpu, GradientBucketsAreCompleteWhenReported) {
  const BertConfig c = small_config();
  ops::CpuBackend<ops::CpuF64> be(1);
  const HostBatch batch = make_batch({1, 5, 9}, {11, 22, 33}, c.vocab_size, 5);
  BertModel<ops::CpuF64> model(c, be, 15, 3, 15);
  model.init_params(7);
  const auto& buckets = model.grad_buckets();
  ASSERT_EQ(buckets.size(), static_cast<size_t>(c.num_hidden_layers) + 2);  // + embeddings, + pooler/heads
  std::vector<std::pair<size_t, size_t>> sorted = buckets;
  std::sort(sorted.begin(), sorted.end());
  size_t at = 0;
  for (const auto& [offset, count] : sorted) {
    EXPECT_EQ(offset, at);
    EXPECT_GT(count, 0u);
    at = offset + count;
  }
  EXPECT_EQ(at, model.layout().total_numel());
  for (int32_t l = 0; l < c.num_hidden_layers; ++l) {  // bucket i is layer L-1-i
    const auto& b = buckets[static_cast<size_t>(c.num_hidden_layers - 1 - l)];
    const ParamTensor& q = model.layout().find("bert.encoder.layer." + std::to_string(l) + ".attention.self.query.weight");
    EXPECT_TRUE(q.offset >= b.first && q.offset < b.first + b.second) << "layer " << l;
  }

  std::vector<std::pair<size_t, size_t>> seen;
  std::vector<std::vector<double>> at_hook;
  model.set_grad_ready_hook([&](size_t offset, size_t count) {
    seen.emplace_back(offset, count);
    at_hook.emplace_back(model.grads() + offset, model.grads() + offset + count);
  });
  model.zero_grad();
  model.forward(batch, true, 99, 4);
  model.backward();  // not armed: silent
  EXPECT_TRUE(seen.empty());
  model.zero_grad();
  model.forward(batch, true, 99, 4);
  model.arm_grad_ready_hook(true);
  model.backward();
  model.arm_grad_ready_hook(false);
  ASSERT_EQ(seen, buckets);
  for (size_t i = 0; i < seen.size(); ++i) {
    const double* final_grads = model.grads() + seen[i].first;
    size_t differ = 0, nonzero = 0;
    for (size_t j = 0; j < seen[i].second; ++j) {
      differ += at_hook[i][j] != final_grads[j];
      nonzero += final_grads[j] != 0.0;
    }
    EXPECT_EQ(differ, 0u) << "bucket " << i << " changed after it was reported";
    EXPECT_GT(nonzero, 0u) << "bucket " << i;
  }
}
// The tanh GELU (in the FFN and the MLM transform) with its backward folded into the FFN output layer.
TEST(ModelCpu, WholeModelGradientMatchesFiniteDifferencesGeluTanh) { expect_whole_model_gradient("gelu_new"); }

// ------------------------------------------------------------------------------------------------ padded reference

// A minimal reverse-mode automatic differentiation over scalars: each node records its parents and local partials.
struct Tape {
  struct Node {
    int a, b;
    double da, db;
  };
  std::vector<Node> nodes;
  std::vector<double> values;
  int push(double v, int a = -1, double da = 0, int b = -1, double db = 0) {
    nodes.push_back({a, b, da, db});
    values.push_back(v);
    return static_cast<int>(values.size()) - 1;
  }
  std::vector<double> gradient(int out) const {
    std::vector<double> g(values.size(), 0.0);
    g[out] = 1;
    for (int i = out; i >= 0; --i) {
      if (g[i] == 0) continue;
      if (nodes[i].a >= 0) g[nodes[i].a] += nodes[i].da * g[i];
      if (nodes[i].b >= 0) g[nodes[i].b] += nodes[i].db * g[i];
    }
    return g;
  }
};
Tape* g_tape = nullptr;

struct Var {
  int id = -1;
  double v() const { return g_tape->values[id]; }
};
Var leaf(double x) { return {g_tape->push(x)}; }
Var operator+(Var a, Var b) { return {g_tape->push(a.v() + b.v(), a.id, 1, b.id, 1)}; }
Var operator-(Var a, Var b) { return {g_tape->push(a.v() - b.v(), a.id, 1, b.id, -1)}; }
Var operator*(Var a, Var b) { return {g_tape->push(a.v() * b.v(), a.id, b.v(), b.id, a.v())}; }
Var operator*(Var a, double s) { return {g_tape->push(a.v() * s, a.id, s)}; }
Var operator+(Var a, double s) { return {g_tape->push(a.v() + s, a.id, 1)}; }
Var operator/(Var a, Var b) { return {g_tape->push(a.v() / b.v(), a.id, 1 / b.v(), b.id, -a.v() / (b.v() * b.v()))}; }
Var exp(Var a) {
  const double e = std::exp(a.v());
  return {g_tape->push(e, a.id, e)};
}
Var log(Var a) { return {g_tape->push(std::log(a.v()), a.id, 1 / a.v())}; }
Var sqrt(Var a) {
  const double s = std::sqrt(a.v());
  return {g_tape->push(s, a.id, 0.5 / s)};
}
Var tanh(Var a) {
  const double t = std::tanh(a.v());
  return {g_tape->push(t, a.id, 1 - t * t)};
}
Var gelu(Var a) {
  const double x = a.v(), cdf = 0.5 * (1 + std::erf(x / std::sqrt(2.0)));
  return {g_tape->push(x * cdf, a.id, cdf + x * std::exp(-0.5 * x * x) / std::sqrt(2 * M_PI))};
}
using Row = std::vector<Var>;

Row layer_norm(const Row& x, const Var* gamma, const Var* beta, double eps) {
  const int H = static_cast<int>(x.size());
  Var mean = x[0];
  for (int j = 1; j < H; ++j) mean = mean + x[j];
  mean = mean * (1.0 / H);
  Var var = (x[0] - mean) * (x[0] - mean);
  for (int j = 1; j < H; ++j) var = var + (x[j] - mean) * (x[j] - mean);
  const Var denom = sqrt(var * (1.0 / H) + eps);
  Row y(H);
  for (int j = 0; j < H; ++j) y[j] = (x[j] - mean) / denom * gamma[j] + beta[j];
  return y;
}
// y = x W^T + b with W [n, k] at w.
Row linear(const Row& x, const Var* w, const Var* b, int n) {
  const int k = static_cast<int>(x.size());
  Row y(n);
  for (int o = 0; o < n; ++o) {
    Var acc = b[o];
    for (int i = 0; i < k; ++i) acc = acc + x[i] * w[o * k + i];
    y[o] = acc;
  }
  return y;
}

// Padded BERT: dense [B, Lmax, H] activations, additive -inf attention mask on padded keys, pad token 0, the same
// sample-keyed Philox dropout masks. Parameters are read by Hugging Face name (separate q, k, v).
Var padded_bert_loss(const BertConfig& c, const ParamLayout& layout, const std::vector<Var>& P, const HostBatch& batch,
                     bool train, uint64_t seed, uint64_t step) {
  const int B = batch.num_seqs(), Lmax = batch.max_seqlen, H = c.hidden_size, NH = c.num_attention_heads,
            D = H / NH, I = c.intermediate_size, V = c.vocab_size;
  auto p = [&](const std::string& name) { return &P[layout.offset(name)]; };
  const float ph = train ? static_cast<float>(c.hidden_dropout_prob) : 0.0f;
  const float pa = train ? static_cast<float>(c.attention_probs_dropout_prob) : 0.0f;
  // Hidden states: the 16-bit draws, keep-scale 65536 / (65536 - ceil(p * 65536)); attention probabilities: the 8-bit
  // draws, keep-scale 256 / (256 - ceil(p * 256)); both rounded to float (core/philox.h).
  auto dropout = [&](Var x, float prob, uint32_t op, int b, uint64_t element, bool attention = false) {
    if (prob == 0.0f) return x;
    if (attention) {
      const double scale = attention_dropout_keep_scale(attention_dropout_threshold(prob));
      return attention_dropout_keep(seed, step, op, batch.sample_ids[b], element, prob) ? x * scale : x * 0.0;
    }
    const double scale = dropout_keep_scale(dropout_threshold(prob));
    return dropout_keep(seed, step, op, batch.sample_ids[b], element, prob, kPhiloxRounds) ? x * scale : x * 0.0;
  };
  std::vector<int> len(B);
  for (int b = 0; b < B; ++b) len[b] = batch.cu_seqlens[b + 1] - batch.cu_seqlens[b];
  // Embeddings.
  std::vector<std::vector<Row>> h(B, std::vector<Row>(Lmax));
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < Lmax; ++i) {
      const bool real = i < len[b];
      const int tok = real ? batch.tokens[batch.cu_seqlens[b] + i] : 0;
      const int seg = real ? batch.segments[batch.cu_seqlens[b] + i] : 0;
      Row x(H);
      for (int j = 0; j < H; ++j)
        x[j] = p("bert.embeddings.word_embeddings.weight")[tok * H + j] +
               p("bert.embeddings.position_embeddings.weight")[i * H + j] +
               p("bert.embeddings.token_type_embeddings.weight")[seg * H + j];
      x = layer_norm(x, p("bert.embeddings.LayerNorm.weight"), p("bert.embeddings.LayerNorm.bias"), c.layer_norm_eps);
      for (int j = 0; j < H; ++j) x[j] = dropout(x[j], ph, kOpIdEmbeddingDropout, b, element_hidden(i, j));
      h[b][i] = x;
    }
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string pre = "bert.encoder.layer." + std::to_string(l) + ".";
    auto next = h;
    for (int b = 0; b < B; ++b) {
      std::vector<Row> q(Lmax), k(Lmax), v(Lmax);
      for (int i = 0; i < Lmax; ++i) {
        q[i] = linear(h[b][i], p(pre + "attention.self.query.weight"), p(pre + "attention.self.query.bias"), H);
        k[i] = linear(h[b][i], p(pre + "attention.self.key.weight"), p(pre + "attention.self.key.bias"), H);
        v[i] = linear(h[b][i], p(pre + "attention.self.value.weight"), p(pre + "attention.self.value.bias"), H);
      }
      for (int i = 0; i < Lmax; ++i) {
        Row ctx(H);
        for (int hd = 0; hd < NH; ++hd) {
          std::vector<Var> s(Lmax);
          double mx = -std::numeric_limits<double>::infinity();
          for (int j = 0; j < Lmax; ++j) {
            Var acc = q[i][hd * D] * k[j][hd * D];
            for (int d = 1; d < D; ++d) acc = acc + q[i][hd * D + d] * k[j][hd * D + d];
            s[j] = acc * (1.0 / std::sqrt(static_cast<double>(D))) +
                   (j < len[b] ? 0.0 : -std::numeric_limits<double>::infinity());
            mx = std::max(mx, s[j].v());
          }
          std::vector<Var> e(Lmax);
          Var sum = leaf(0.0);
          for (int j = 0; j < Lmax; ++j) {
            e[j] = exp(s[j] + (-mx));
            sum = sum + e[j];
          }
          for (int d = 0; d < D; ++d) ctx[hd * D + d] = leaf(0.0);
          for (int j = 0; j < Lmax; ++j) {
            const Var prob = dropout(e[j] / sum, pa, op_id_attention_probs(l), b, element_attention(hd, i, j),
                                      /*attention=*/true);
            for (int d = 0; d < D; ++d) ctx[hd * D + d] = ctx[hd * D + d] + prob * v[j][hd * D + d];
          }
        }
        Row a = linear(ctx, p(pre + "attention.output.dense.weight"), p(pre + "attention.output.dense.bias"), H);
        for (int j = 0; j < H; ++j)
          a[j] = dropout(a[j], ph, op_id_attention_output(l), b, element_hidden(i, j)) + h[b][i][j];
        a = layer_norm(a, p(pre + "attention.output.LayerNorm.weight"), p(pre + "attention.output.LayerNorm.bias"),
                       c.layer_norm_eps);
        Row f = linear(a, p(pre + "intermediate.dense.weight"), p(pre + "intermediate.dense.bias"), I);
        for (auto& x : f) x = gelu(x);
        Row o = linear(f, p(pre + "output.dense.weight"), p(pre + "output.dense.bias"), H);
        for (int j = 0; j < H; ++j) o[j] = dropout(o[j], ph, op_id_ffn_output(l), b, element_hidden(i, j)) + a[j];
        next[b][i] = layer_norm(o, p(pre + "output.LayerNorm.weight"), p(pre + "output.LayerNorm.bias"),
                                c.layer_norm_eps);
      }
    }
    h = next;
  }
  // MLM head on the masked (b, i) positions.
  Var mlm = leaf(0.0);
  for (int m = 0; m < batch.num_masked(); ++m) {
    const int row = batch.mlm_positions[m];
    int b = 0;
    while (batch.cu_seqlens[b + 1] <= row) ++b;
    Row t = linear(h[b][row - batch.cu_seqlens[b]], p("cls.predictions.transform.dense.weight"),
                   p("cls.predictions.transform.dense.bias"), H);
    for (auto& x : t) x = gelu(x);
    t = layer_norm(t, p("cls.predictions.transform.LayerNorm.weight"), p("cls.predictions.transform.LayerNorm.bias"),
                   c.layer_norm_eps);
    const Row logits = linear(t, p("bert.embeddings.word_embeddings.weight"), p("cls.predictions.bias"), V);
    double mx = logits[0].v();
    for (const auto& z : logits) mx = std::max(mx, z.v());
    Var sum = leaf(0.0);
    for (const auto& z : logits) sum = sum + exp(z + (-mx));
    mlm = mlm + (log(sum) + mx - logits[batch.mlm_labels[m]]);
  }
  // NSP head on the first row of each sequence.
  Var nsp = leaf(0.0);
  for (int b = 0; b < B; ++b) {
    Row pooled = linear(h[b][0], p("bert.pooler.dense.weight"), p("bert.pooler.dense.bias"), H);
    for (auto& x : pooled) x = tanh(x);
    const Row z = linear(pooled, p("cls.seq_relationship.weight"), p("cls.seq_relationship.bias"), 2);
    const double mx = std::max(z[0].v(), z[1].v());
    const Var lse = log(exp(z[0] + (-mx)) + exp(z[1] + (-mx))) + mx;
    nsp = nsp + (lse - z[batch.nsp_labels[b]]);
  }
  return mlm * (1.0 / batch.num_masked()) + nsp * (1.0 / B);
}

void expect_matches_padded_reference(bool train) {
  const BertConfig c = small_config();
  const ParamLayout layout(c);
  const HostBatch batch = make_batch({1, 5, 9, 3}, {5, 1000000007ull, 9, 77}, c.vocab_size, 13);
  ops::CpuBackend<ops::CpuF64> be(2);
  BertModel<ops::CpuF64> model(c, be, 32, 4, 16);
  model.init_params(3);
  std::vector<double> params(model.num_params()), grads(model.num_params());
  model.get_params(params.data());
  model.zero_grad();
  const double loss = model.forward(batch, train, 123, 9).loss;
  model.backward();
  model.get_grads(grads.data());

  Tape tape;
  g_tape = &tape;
  std::vector<Var> P(params.size());
  for (size_t i = 0; i < params.size(); ++i) P[i] = leaf(params[i]);
  const Var ref = padded_bert_loss(c, layout, P, batch, train, 123, 9);
  const std::vector<double> g = tape.gradient(ref.id);
  const double ref_loss = ref.v();
  g_tape = nullptr;
  EXPECT_NEAR(loss, ref_loss, 1e-12 * std::fabs(ref_loss));
  int bad = 0;
  for (size_t i = 0; i < params.size(); ++i)
    if (!(std::fabs(grads[i] - g[P[i].id]) <= 1e-9 * std::fabs(g[P[i].id]) + 1e-12) && bad++ < 8)
      ADD_FAILURE() << "param " << i << ": unpadded " << grads[i] << " padded " << g[P[i].id];
  EXPECT_EQ(bad, 0);
}

TEST(ModelCpu, UnpaddedEqualsPaddedReferenceNoDropout) { expect_matches_padded_reference(false); }
TEST(ModelCpu, UnpaddedEqualsPaddedReferenceWithDropout) { expect_matches_padded_reference(true); }

// ------------------------------------------------------------------------------------------------ batch split

template <class P>
void expect_split_invariance(double tol) {
  using S = typename P::Grad;
  const BertConfig c = small_config();
  ops::CpuBackend<P> be(2);
  const HostBatch full = make_batch({4, 9, 2, 7, 5, 1}, {40, 41, 42, 43, 44, 45}, c.vocab_size, 21);
  // Reordered halves: sequences {3,4,5} then {0,1,2}; the sample ids travel with them.
  const HostBatch a = sub_batch(full, 3, 6), b = sub_batch(full, 0, 3);
  BertModel<P> model(c, be, 64, 8, 32);
  model.init_params(11);
  const size_t n = model.num_params();
  std::vector<S> g_full(n), g_split(n);
  model.zero_grad();
  const StepResult rf = model.forward(full, true, 5, 17);
  model.backward();
  model.get_grads(g_full.data());

  model.zero_grad();
  const LossDenominators denoms{static_cast<double>(full.num_masked()), static_cast<double>(full.num_seqs())};
  const StepResult ra = model.forward(a, true, 5, 17, denoms);
  model.backward();
  const StepResult rb = model.forward(b, true, 5, 17, denoms);
  model.backward();
  model.get_grads(g_split.data());
  EXPECT_NEAR(ra.loss + rb.loss, rf.loss, tol * std::fabs(rf.loss));
  EXPECT_EQ(ra.mlm_correct + rb.mlm_correct, rf.mlm_correct);
  double max_g = 0;
  for (size_t i = 0; i < n; ++i) max_g = std::max(max_g, std::fabs(static_cast<double>(g_full[i])));
  int bad = 0;
  for (size_t i = 0; i < n; ++i)
    if (!(std::fabs(static_cast<double>(g_full[i] - g_split[i])) <= tol * max_g) && bad++ < 8)
      ADD_FAILURE() << "param " << i << ": full " << g_full[i] << " split " << g_split[i];
  EXPECT_EQ(bad, 0);
}
TEST(ModelCpu, GradientDoesNotDependOnBatchSplitDouble) { expect_split_invariance<ops::CpuF64>(1e-12); }
TEST(ModelCpu, GradientDoesNotDependOnBatchSplitFloat) { expect_split_invariance<ops::CpuF32>(1e-5); }

// The sparse last layer (bert.h) against the dense one: same losses, correct counts and gradients, with dropout on
// (the kept rows draw the full rows' masks). The batch has a masked row at a [CLS] row (kept once), a sequence with
// no masked row, a one-token sequence, and masked positions out of row order; backward follows its forward's choice
// even when the switch changes in between.
TEST(ModelCpu, SparseLastLayerEqualsDenseLastLayer) {
  const BertConfig c = small_config();
  ops::CpuBackend<ops::CpuF64> be(2);
  HostBatch batch = make_batch({6, 1, 9, 4, 7}, {11, 12, 13, 14, 15}, c.vocab_size, 8, 0.35);
  batch.mlm_positions.push_back(batch.cu_seqlens[2]);  // sequence 2's [CLS] row, masked too
  batch.mlm_labels.push_back(3);
  // sequence 3 (rows 16..19) keeps no masked row: drop its masked positions
  for (size_t i = batch.mlm_positions.size(); i-- > 0;)
    if (batch.mlm_positions[i] >= batch.cu_seqlens[3] && batch.mlm_positions[i] < batch.cu_seqlens[4]) {
      batch.mlm_positions.erase(batch.mlm_positions.begin() + static_cast<std::ptrdiff_t>(i));
      batch.mlm_labels.erase(batch.mlm_labels.begin() + static_cast<std::ptrdiff_t>(i));
    }
  std::reverse(batch.mlm_positions.begin(), batch.mlm_positions.end());
  std::reverse(batch.mlm_labels.begin(), batch.mlm_labels.end());
  ASSERT_GT(batch.num_masked(), 4);
  BertModel<ops::CpuF64> model(c, be, 32, 8, 32);
  model.init_params(5);
  ASSERT_TRUE(model.sparse_last_layer());  // the default
  const size_t n = model.num_params();
  std::vector<double> g_dense(n), g_sparse(n);
  ASSERT_TRUE(model.sparse_last_attention());  // the default
  for (const bool train : {true, false})
   for (const bool rows_attention : {true, false}) {
    model.set_sparse_last_layer(false);
    model.zero_grad();
    const StepResult rd = model.forward(batch, train, 77, 3);
    model.backward();
    model.get_grads(g_dense.data());
    model.set_sparse_last_layer(true);
    model.set_sparse_last_attention(rows_attention);
    model.zero_grad();
    const StepResult rs = model.forward(batch, train, 77, 3);
    model.set_sparse_last_layer(false);  // backward must still run the forward's sparse layer
    model.set_sparse_last_attention(!rows_attention);  // and its attention
    model.backward();
    model.get_grads(g_sparse.data());
    model.set_sparse_last_attention(true);
    EXPECT_NEAR(rs.mlm_loss, rd.mlm_loss, 1e-12 * std::fabs(rd.mlm_loss)) << "train " << train;
    EXPECT_NEAR(rs.nsp_loss, rd.nsp_loss, 1e-12 * std::fabs(rd.nsp_loss)) << "train " << train;
    EXPECT_EQ(rs.mlm_correct, rd.mlm_correct);
    EXPECT_EQ(rs.nsp_correct, rd.nsp_correct);
    double max_g = 0;
    for (size_t i = 0; i < n; ++i) max_g = std::max(max_g, std::fabs(g_dense[i]));
    ASSERT_GT(max_g, 0);
    int bad = 0;
    for (size_t i = 0; i < n; ++i)
      if (!(std::fabs(g_sparse[i] - g_dense[i]) <= 1e-12 * max_g) && bad++ < 8)
        ADD_FAILURE() << "param " << i << ": sparse " << g_sparse[i] << " dense " << g_dense[i];
    EXPECT_EQ(bad, 0) << "train " << train << " rows_attention " << rows_attention;
  }
  // A batch whose sequences are inconsistent with its token count is an error, not a read past the rows.
  model.set_sparse_last_layer(true);
  HostBatch broken = batch;
  broken.cu_seqlens[2] = broken.cu_seqlens[1];  // an empty sequence
  EXPECT_THROW(model.forward(broken, true, 1, 1), Error);
}

TEST(ModelCpu, GradientsAccumulateAndEvalHasNoDropout) {
  const BertConfig c = small_config();
  ops::CpuBackend<ops::CpuF64> be(2);
  const HostBatch batch = make_batch({3, 8}, {1, 2}, c.vocab_size, 3);
  BertModel<ops::CpuF64> model(c, be, 16, 2, 16);
  model.init_params(1);
  std::vector<double> g1(model.num_params()), g2(model.num_params());
  model.zero_grad();
  model.forward(batch, true, 1, 1);
  model.backward();
  model.get_grads(g1.data());
  model.forward(batch, true, 1, 1);
  model.backward(0.5);
  model.get_grads(g2.data());
  for (size_t i = 0; i < g1.size(); ++i) ASSERT_NEAR(g2[i], 1.5 * g1[i], 1e-12 * (1 + std::fabs(g1[i])));
  EXPECT_THROW(model.backward(), Error);  // once per forward
  // Eval: no dropout, so the seed and step do not matter; training with dropout does depend on them.
  EXPECT_EQ(model.forward(batch, false, 1, 1).loss, model.forward(batch, false, 2, 8).loss);
  EXPECT_NE(model.forward(batch, true, 1, 1).loss, model.forward(batch, true, 2, 8).loss);
  // Float and double backends agree.
  ops::CpuBackend<ops::CpuF32> bef(2);
  BertModel<ops::CpuF32> mf(c, bef, 16, 2, 16);
  mf.init_params(1);
  EXPECT_NEAR(mf.forward(batch, true, 1, 1).loss, model.forward(batch, true, 1, 1).loss, 1e-4);
}

TEST(ModelCpu, BertTinyStepIsFast) {
  const BertConfig c = BertConfig::from_file(config_path("bert-tiny.json"));
  ops::CpuBackend<ops::CpuF32> be(0);
  std::vector<int> lengths;
  std::vector<uint64_t> ids;
  std::mt19937_64 rng(0);
  for (int s = 0; s < 32; ++s) {
    lengths.push_back(64 + static_cast<int>(rng() % 129));  // 64..192, mean ~128
    ids.push_back(1000 + s);
  }
  const HostBatch batch = make_batch(lengths, ids, c.vocab_size, 1, 0.15);
  BertModel<ops::CpuF32> model(c, be, batch.num_tokens(), 32, batch.num_masked());
  model.init_params(0);
  model.zero_grad();
  double best = 1e9;
  StepResult r;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    r = model.forward(batch, true, 1, rep);
    model.backward();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  // At initialisation the predictions are near uniform: MLM loss ~ ln(V) = 10.33, NSP ~ ln 2.
  EXPECT_NEAR(r.mlm_loss, std::log(30522.0), 0.3);
  EXPECT_NEAR(r.nsp_loss, std::log(2.0), 0.2);
  std::vector<float> g(model.num_params());
  model.get_grads(g.data());
  for (float x : g) ASSERT_TRUE(std::isfinite(x));
  std::printf("bert-tiny step: %d tokens, %d sequences, %d masked, %d threads: %.3f s\n", batch.num_tokens(),
              batch.num_seqs(), batch.num_masked(), be.num_threads(), best);
  EXPECT_LT(best, 5.0);  // generous: the target is well under a second on 2 free cores
}

}  // namespace
}  // namespace nopad
