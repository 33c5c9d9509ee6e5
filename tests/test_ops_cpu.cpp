// CPU reference ops: finite-difference gradient checks of every op in double precision (dropout on, since masks are
// deterministic), the GEMM against a naive loop, the sequence isolation of varlen attention, and the += / = contracts.
//
// Tolerance: central differences with h = 1e-6 in double have truncation error ~h^2 |f'''| ~ 1e-12 and rounding
// error ~ eps |L| / h ~ 2e-16 * 10 / 1e-6 = 2e-9 for the O(10) test losses, so |numeric - analytic| <=
// 1e-6 (|numeric| + |analytic|) + 1e-8 holds with margin for a correct gradient, while any wrong term (a missing
// factor, a dropped row) gives errors of order the gradient itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/philox.h"
#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/cpu_gemm.h"

namespace nopad::ops {
namespace {

using Vec = std::vector<double>;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

Vec random_vec(size_t n, std::mt19937_64& rng, double scale = 1.0) {
  std::normal_distribution<double> dist(0.0, scale);
  Vec v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}
Vec poison(size_t n) { return Vec(n, kNaN); }
double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}
bool all_finite(const Vec& v) {
  for (double x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

// Compares analytic[i] with the central difference of loss() in x[i], for every element of x.
void check_gradient(const char* what, Vec& x, const Vec& analytic, const std::function<double()>& loss) {
  ASSERT_EQ(x.size(), analytic.size()) << what;
  const double h = 1e-6;
  int bad = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + h;
    const double up = loss();
    x[i] = saved - h;
    const double down = loss();
    x[i] = saved;
    const double numeric = (up - down) / (2 * h);
    const double tol = 1e-6 * (std::fabs(numeric) + std::fabs(analytic[i])) + 1e-8;
    if (!(std::fabs(numeric - analytic[i]) <= tol) && bad++ < 5)
      ADD_FAILURE() << what << "[" << i << "]: analytic " << analytic[i] << " numeric " << numeric;
  }
  EXPECT_EQ(bad, 0) << what;
}

// Three sequences of lengths 1, 5, 9 (T = 15), H = 8, 2 heads of 4.
struct Seqs {
  std::vector<int32_t> cu{0, 1, 6, 15};
  std::vector<uint64_t> sample_ids{1001, 7, 424242};
  SeqView view() const { return SeqView{15, 3, 9, cu.data(), sample_ids.data()}; }
};
constexpr int32_t kT = 15, kH = 8, kHeads = 2, kHeadDim = 4;

Dropout drop(float p, uint32_t op) {
  Dropout d;
  d.p = p;
  d.seed = 2024;
  d.step = 3;
  d.op_id = op;
  return d;
}

TEST(OpsCpu, GemmMatchesNaiveLoop) {
  std::mt19937_64 rng(1);
  for (bool transposed_a : {false, true}) {
    const int64_t M = 70, N = 300, K = 131;
    Vec A = random_vec(M * K, rng), B = random_vec(K * N, rng), C0 = random_vec(M * N, rng);
    const int64_t a_row = transposed_a ? 1 : K, a_col = transposed_a ? M : 1;  // A stored [K, M] when transposed
    Vec C = C0;
    cpu::gemm<double>(M, N, K, A.data(), a_row, a_col, B.data(), N, C.data(), N, /*accumulate=*/true, 2);
    std::vector<float> Af(A.begin(), A.end()), Bf(B.begin(), B.end()), Cf(M * N, std::nanf(""));
    cpu::gemm<float>(M, N, K, Af.data(), a_row, a_col, Bf.data(), N, Cf.data(), N, /*accumulate=*/false, 2);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double ref = 0;
        for (int64_t k = 0; k < K; ++k) ref += A[i * a_row + k * a_col] * B[k * N + j];
        ASSERT_NEAR(C[i * N + j], C0[i * N + j] + ref, 1e-11) << i << "," << j;
        ASSERT_NEAR(Cf[i * N + j], ref, 1e-4) << i << "," << j;
      }
  }
}

TEST(OpsCpu, EmbedLayernormDropoutGradient) {
  CpuBackend<CpuF64> be(2);
  Seqs s;
  std::mt19937_64 rng(2);
  const int32_t V = 11, P = 12, TV = 2;
  std::vector<int32_t> tokens(kT), positions(kT), segments(kT);
  for (int b = 0; b < 3; ++b)
    for (int t = s.cu[b]; t < s.cu[b + 1]; ++t) {
      tokens[t] = static_cast<int32_t>(rng() % V);
      positions[t] = t - s.cu[b];
      segments[t] = (t - s.cu[b]) > 2 ? 1 : 0;
    }
  Vec word = random_vec(V * kH, rng), pos = random_vec(P * kH, rng), type = random_vec(TV * kH, rng);
  Vec gamma = random_vec(kH, rng), beta = random_vec(kH, rng);
  Vec R = random_vec(kT * kH, rng);
  const Dropout d = drop(0.1f, 0);
  auto weights = [&] {
    EmbeddingWeights<double> w;
    w.word = word.data(), w.position = pos.data(), w.token_type = type.data(), w.ln_gamma = gamma.data(),
    w.ln_beta = beta.data(), w.vocab_size = V, w.max_positions = P, w.type_vocab_size = TV, w.hidden = kH;
    return w;
  };
  Vec out, mean, rstd;
  auto loss = [&] {
    out = poison(kT * kH), mean = poison(kT), rstd = poison(kT);
    be.embed_layernorm_dropout_forward(tokens.data(), positions.data(), segments.data(), s.view(), weights(), d,
                                       out.data(), mean.data(), rstd.data());
    EXPECT_TRUE(all_finite(out) && all_finite(mean) && all_finite(rstd));
    return dot(out, R);
  };
  loss();
  int dropped = 0;
  for (double x : out) dropped += x == 0.0;
  EXPECT_GT(dropped, 0);  // p = 0.1 over 120 elements: some are dropped
  Vec d_word(V * kH, 0), d_pos(P * kH, 0), d_type(TV * kH, 0), d_gamma(kH, 0), d_beta(kH, 0);
  EmbeddingGrads<double> g{d_word.data(), d_pos.data(), d_type.data(), d_gamma.data(), d_beta.data()};
  be.embed_layernorm_dropout_backward(R.data(), tokens.data(), positions.data(), segments.data(), s.view(), weights(),
                                      d, mean.data(), rstd.data(), g);
  check_gradient("d_word", word, d_word, loss);
  check_gradient("d_position", pos, d_pos, loss);
  check_gradient("d_token_type", type, d_type, loss);
  check_gradient("d_gamma", gamma, d_gamma, loss);
  check_gradient("d_beta", beta, d_beta, loss);
  // Parameter gradients accumulate: a second backward doubles them.
  Vec d_gamma1 = d_gamma;
  be.embed_layernorm_dropout_backward(R.data(), tokens.data(), positions.data(), segments.data(), s.view(), weights(),
                                      d, mean.data(), rstd.data(), g);
  for (int j = 0; j < kH; ++j) EXPECT_NEAR(d_gamma[j], 2 * d_gamma1[j], 1e-12);
  // Out-of-range token ids are an error, not a wild read.
  tokens[3] = V;
  EXPECT_THROW(loss(), nopad::Error);
}

TEST(OpsCpu, DenseGradientWithAndWithoutGelu) {
  CpuBackend<CpuF64> be(2);
  std::mt19937_64 rng(3);
  const int64_t rows = 15;
  const int32_t k = 8, n = 6;
  for (Activation act : {Activation::kNone, Activation::kGelu, Activation::kGeluTanh}) {
    Vec x = random_vec(rows * k, rng), W = random_vec(n * k, rng, 0.5), b = random_vec(n, rng), R = random_vec(rows * n, rng);
    Vec y, act_grad;
    auto loss = [&] {
      y = poison(rows * n), act_grad = poison(rows * n);
      be.dense_forward(x.data(), W.data(), b.data(), rows, k, n, act, y.data(), act_grad.data());
      EXPECT_TRUE(all_finite(y));
      if (act != Activation::kNone) {
        EXPECT_TRUE(all_finite(act_grad));
      }
      return dot(y, R);
    };
    loss();
    Vec dx = poison(rows * k), dW(n * k, 0), db(n, 0);
    be.dense_backward(R.data(), x.data(), W.data(), act_grad.data(), rows, k, n, act, dx.data(), false, dW.data(),
                      db.data());
    check_gradient("dx", x, dx, loss);
    check_gradient("dW", W, dW, loss);
    check_gradient("db", b, db, loss);
    // accumulate_dx adds onto what is there (forward again: the checks left act_grad at a perturbed point).
    loss();
    Vec dx2(rows * k, 1.5);
    be.dense_backward(R.data(), x.data(), W.data(), act_grad.data(), rows, k, n, act, dx2.data(), true, nullptr,
                      nullptr);
    for (size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dx2[i], dx[i] + 1.5, 1e-12);
  }
}

// The two GELUs and the derivatives dense_forward saves, at known points against their closed forms: the tanh form
// within 1e-3 of the erf form everywhere (its documented accuracy) but not equal to it.
TEST(OpsCpu, GeluTanhIsTheApproximationNotTheErfForm) {
  CpuBackend<CpuF64> be(1);
  const std::vector<double> xs{-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0};
  const int64_t rows = static_cast<int64_t>(xs.size());
  Vec one{1.0};
  Vec erf_y = poison(rows), erf_grad = poison(rows), tanh_y = poison(rows), tanh_grad = poison(rows);
  be.dense_forward(xs.data(), one.data(), nullptr, rows, 1, 1, Activation::kGelu, erf_y.data(), erf_grad.data());
  be.dense_forward(xs.data(), one.data(), nullptr, rows, 1, 1, Activation::kGeluTanh, tanh_y.data(), tanh_grad.data());
  double max_diff = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const double x = xs[i];
    const double cdf = 0.5 * (1 + std::erf(x / std::sqrt(2.0))), pdf = std::exp(-0.5 * x * x) / std::sqrt(2 * M_PI);
    EXPECT_NEAR(erf_y[i], x * cdf, 1e-14);
    EXPECT_NEAR(erf_grad[i], cdf + x * pdf, 1e-14);
    const double c = std::sqrt(2 / M_PI), th = std::tanh(c * (x + 0.044715 * x * x * x));
    EXPECT_NEAR(tanh_y[i], 0.5 * x * (1 + th), 1e-14);
    EXPECT_NEAR(tanh_grad[i], 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * c * (1 + 3 * 0.044715 * x * x), 1e-14);
    max_diff = std::max(max_diff, std::abs(tanh_y[i] - erf_y[i]));
  }
  EXPECT_GT(max_diff, 1e-5);
  EXPECT_LT(max_diff, 1e-3);
}

// dense_backward_through_act == dense_backward (no activation) followed by the activation's backward (the saved
// derivative), checked by finite differences through the composition y = act(x_pre) W^T, and against the two-op
// route.
TEST(OpsCpu, DenseBackwardThroughActivation) {
  CpuBackend<CpuF64> be(2);
  std::mt19937_64 rng(13);
  const int64_t rows = 11;
  const int32_t k = 9, n = 5;
  for (Activation act : {Activation::kGelu, Activation::kGeluTanh}) {
    Vec x_pre = random_vec(rows * k, rng, 2.0), W = random_vec(n * k, rng, 0.5), R = random_vec(rows * n, rng);
    Vec x, y, x_grad;
    Vec one_col(k * k, 0.0);
    for (int32_t j = 0; j < k; ++j) one_col[j * k + j] = 1.0;  // identity weights: x = act(x_pre)
    auto loss = [&] {
      x = poison(rows * k), y = poison(rows * n), x_grad = poison(rows * k);
      be.dense_forward(x_pre.data(), one_col.data(), nullptr, rows, k, k, act, x.data(), x_grad.data());
      be.dense_forward(x.data(), W.data(), nullptr, rows, k, n, Activation::kNone, y.data(), nullptr);
      return dot(y, R);
    };
    loss();
    Vec dx_pre = poison(rows * k), dW(n * k, 0), dbias(k, 0.5);
    be.dense_backward_through_act(R.data(), x.data(), x_grad.data(), W.data(), rows, k, n, act, dx_pre.data(),
                                  dW.data(), dbias.data());
    check_gradient("dx_pre", x_pre, dx_pre, loss);
    check_gradient("dW", W, dW, loss);
    for (int32_t j = 0; j < k; ++j) {  // d_x_bias += column sums of dx_pre
      double col = 0;
      for (int64_t r = 0; r < rows; ++r) col += dx_pre[r * k + j];
      EXPECT_NEAR(dbias[j], 0.5 + col, 1e-12);
    }
    // The two-op route: dx = dy W, then dense_backward's activation step is exactly the same arithmetic.
    loss();
    Vec dx = poison(rows * k), dW2(n * k, 0);
    be.dense_backward(R.data(), x.data(), W.data(), nullptr, rows, k, n, Activation::kNone, dx.data(), false,
                      dW2.data(), nullptr);
    for (size_t i = 0; i < dW.size(); ++i) EXPECT_NEAR(dW[i], dW2[i], 1e-12);
    for (size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dx_pre[i], dx[i] * x_grad[i], 1e-12);
    EXPECT_THROW(be.dense_backward_through_act(R.data(), x.data(), x_grad.data(), W.data(), rows, k, n,
                                               Activation::kNone, dx_pre.data(), nullptr, nullptr),
                 nopad::Error);
  }
}

TEST(OpsCpu, AttentionVarlenGradientWithDropout) {
  CpuBackend<CpuF64> be(2);
  Seqs s;
  std::mt19937_64 rng(4);
  Vec qkv = random_vec(kT * 3 * kH, rng), R = random_vec(kT * kH, rng);
  const Dropout d = drop(0.1f, 5);
  Vec ctx, lse;
  auto loss = [&] {
    ctx = poison(kT * kH), lse = poison(kHeads * kT);
    be.attention_forward(qkv.data(), s.view(), kHeads, kHeadDim, d, ctx.data(), lse.data());
    EXPECT_TRUE(all_finite(ctx) && all_finite(lse));
    return dot(ctx, R);
  };
  loss();
  Vec dqkv = poison(kT * 3 * kH);
  // The bias gradient accumulates (+=) the column sums of d_qkv's q and v blocks: start from a known offset per
  // column. The k block's part stays as it was: the k bias has no gradient (ops.h), i.e. dK's column sums vanish.
  Vec d_bias(3 * kH);
  for (int j = 0; j < 3 * kH; ++j) d_bias[j] = 0.25 * j - 1.0;
  be.attention_backward(R.data(), qkv.data(), ctx.data(), lse.data(), s.view(), kHeads, kHeadDim, d, dqkv.data(),
                        d_bias.data());
  EXPECT_TRUE(all_finite(dqkv));
  check_gradient("dqkv", qkv, dqkv, loss);
  for (int j = 0; j < 3 * kH; ++j) {
    double sum = 0.25 * j - 1.0, mag = 0;
    for (int t = 0; t < kT; ++t) sum += dqkv[t * 3 * kH + j], mag += std::fabs(dqkv[t * 3 * kH + j]);
    if (j >= kH && j < 2 * kH) {
      EXPECT_EQ(d_bias[j], 0.25 * j - 1.0) << "k column " << j - kH << " changed";
      EXPECT_GT(mag, 1e-3) << "k column " << j - kH << ": dK is not zero, its column sums are";
      EXPECT_NEAR(sum, 0.25 * j - 1.0, 1e-12 * mag) << "k column " << j - kH << ": dK's column sum is not zero";
    } else {
      EXPECT_NEAR(d_bias[j], sum, 1e-12) << "column " << j;
    }
  }
  // Without it, d_qkv is the same (ctx and lse again from the unperturbed qkv: check_gradient left them perturbed).
  loss();
  Vec dqkv2 = poison(kT * 3 * kH);
  be.attention_backward(R.data(), qkv.data(), ctx.data(), lse.data(), s.view(), kHeads, kHeadDim, d, dqkv2.data(),
                        nullptr);
  EXPECT_EQ(dqkv, dqkv2);
}

// The queries restricted to some rows of each sequence (the sparse last layer): each query row gets what the full
// attention gives its row, and the backward equals the full backward for a d_ctx that is zero outside those rows.
TEST(OpsCpu, AttentionOnQueryRowsMatchesTheFullRows) {
  CpuBackend<CpuF64> be(2);
  Seqs s;
  std::mt19937_64 rng(41);
  const Vec qkv = random_vec(kT * 3 * kH, rng);
  // Sequence 0: its only row; sequence 1: no query; sequence 2: positions out of order.
  const std::vector<int32_t> q_cu{0, 1, 1, 4}, q_pos{0, 7, 0, 3};
  const int32_t N = 4;
  std::vector<int32_t> rows(N);
  for (int b = 0; b < 3; ++b)
    for (int32_t i = q_cu[b]; i < q_cu[b + 1]; ++i) rows[i] = s.cu[b] + q_pos[i];
  SeqView qv{N, 3, 3, q_cu.data(), s.sample_ids.data()};
  qv.row_positions = q_pos.data();
  Vec q_qkv(N * 3 * kH);
  be.gather_rows(qkv.data(), kT, rows.data(), N, 3 * kH, q_qkv.data());
  const Vec d_ctx_rows = random_vec(N * kH, rng);
  for (const float p : {0.0f, 0.3f}) {
    const Dropout d = drop(p, 12);
    Vec ctx = poison(kT * kH), lse = poison(kHeads * kT);
    be.attention_forward(qkv.data(), s.view(), kHeads, kHeadDim, d, ctx.data(), lse.data());
    Vec ctx_r = poison(N * kH), lse_r = poison(kHeads * N);
    be.attention_forward_rows(qkv.data(), s.view(), q_qkv.data(), qv, kHeads, kHeadDim, d, ctx_r.data(),
                              lse_r.data());
    for (int32_t i = 0; i < N; ++i) {
      for (int32_t j = 0; j < kH; ++j) EXPECT_EQ(ctx_r[i * kH + j], ctx[rows[i] * kH + j]) << "query " << i;
      for (int32_t h = 0; h < kHeads; ++h) EXPECT_EQ(lse_r[h * N + i], lse[h * kT + rows[i]]) << "query " << i;
    }
    Vec d_ctx(kT * kH, 0.0);
    for (int32_t i = 0; i < N; ++i)
      for (int32_t j = 0; j < kH; ++j) d_ctx[rows[i] * kH + j] = d_ctx_rows[i * kH + j];
    Vec dqkv = poison(kT * 3 * kH), bias(3 * kH, 0.5);
    be.attention_backward(d_ctx.data(), qkv.data(), ctx.data(), lse.data(), s.view(), kHeads, kHeadDim, d,
                          dqkv.data(), bias.data());
    Vec dqkv_r = poison(kT * 3 * kH), bias_r(3 * kH, 0.5);
    be.attention_backward_rows(d_ctx_rows.data(), qkv.data(), s.view(), q_qkv.data(), qv, ctx_r.data(),
                               lse_r.data(), kHeads, kHeadDim, d, dqkv_r.data(), bias_r.data());
    double max_g = 0;
    for (double v : dqkv) max_g = std::max(max_g, std::fabs(v));
    ASSERT_GT(max_g, 0.0);
    int zero_q = 0;  // in the q block of the rows that are no query: all of it
    for (int32_t t = 0; t < kT; ++t) {
      const bool query = std::find(rows.begin(), rows.end(), t) != rows.end();
      for (int32_t j = 0; j < 3 * kH; ++j) {
        EXPECT_NEAR(dqkv_r[t * 3 * kH + j], dqkv[t * 3 * kH + j], 1e-14 * max_g) << "row " << t << " col " << j;
        zero_q += !query && j < kH && dqkv_r[t * 3 * kH + j] == 0.0;
      }
    }
    EXPECT_EQ(zero_q, (kT - N) * kH);
    for (int32_t j = 0; j < 3 * kH; ++j) EXPECT_NEAR(bias_r[j], bias[j], 1e-14 * max_g * kT);
  }
  // Bad query rows are errors: a position twice, a position past its sequence, too many queries, other sequences.
  const auto run = [&](const std::vector<int32_t>& cu, const std::vector<int32_t>& pos, int32_t B) {
    SeqView bad{cu.back(), B, 9, cu.data(), s.sample_ids.data()};
    bad.row_positions = pos.data();
    Vec c(static_cast<size_t>(cu.back()) * kH), l(kHeads * static_cast<size_t>(cu.back()));
    be.attention_forward_rows(qkv.data(), s.view(), q_qkv.data(), bad, kHeads, kHeadDim, drop(0.0f, 1), c.data(),
                              l.data());
  };
  EXPECT_NO_THROW(run({0, 1, 1, 4}, {0, 7, 0, 3}, 3));
  EXPECT_THROW(run({0, 1, 1, 4}, {0, 7, 0, 7}, 3), Error);
  EXPECT_THROW(run({0, 1, 1, 4}, {0, 7, 0, 9}, 3), Error);
  EXPECT_THROW(run({0, 2, 2, 4}, {0, 0, 0, 3}, 3), Error);
  EXPECT_THROW(run({0, 1, 4}, {0, 1, 2, 3}, 2), Error);
  SeqView no_pos = qv;
  no_pos.row_positions = nullptr;
  Vec c(N * kH), l(kHeads * N);
  EXPECT_THROW(be.attention_forward_rows(qkv.data(), s.view(), q_qkv.data(), no_pos, kHeads, kHeadDim, drop(0.0f, 1),
                                         c.data(), l.data()),
               Error);
}

TEST(OpsCpu, AttentionSequencesOnlySeeThemselves) {
  // The batch result equals running each sequence alone (same sample id, so the same dropout mask).
  CpuBackend<CpuF64> be(2);
  Seqs s;
  std::mt19937_64 rng(5);
  Vec qkv = random_vec(kT * 3 * kH, rng);
  const Dropout d = drop(0.1f, 5);
  Vec ctx = poison(kT * kH), lse = poison(kHeads * kT);
  be.attention_forward(qkv.data(), s.view(), kHeads, kHeadDim, d, ctx.data(), lse.data());
  for (int b = 0; b < 3; ++b) {
    const int32_t L = s.cu[b + 1] - s.cu[b];
    std::vector<int32_t> cu{0, L};
    std::vector<uint64_t> ids{s.sample_ids[b]};
    Vec q1(qkv.begin() + s.cu[b] * 3 * kH, qkv.begin() + s.cu[b + 1] * 3 * kH);
    Vec c1 = poison(L * kH), l1 = poison(kHeads * L);
    be.attention_forward(q1.data(), SeqView{L, 1, L, cu.data(), ids.data()}, kHeads, kHeadDim, d, c1.data(), l1.data());
    for (int i = 0; i < L * kH; ++i) EXPECT_NEAR(c1[i], ctx[s.cu[b] * kH + i], 1e-14);
  }
}

TEST(OpsCpu, BiasDropoutResidualLayernormGradient) {
  CpuBackend<CpuF64> be(2);
  Seqs s;
  std::mt19937_64 rng(6);
  Vec x = random_vec(kT * kH, rng), bias = random_vec(kH, rng), res = random_vec(kT * kH, rng);
  Vec gamma = random_vec(kH, rng), beta = random_vec(kH, rng), R = random_vec(kT * kH, rng);
  const Dropout d = drop(0.1f, 9);
  Vec out, mean, rstd;
  auto loss = [&] {
    out = poison(kT * kH), mean = poison(kT), rstd = poison(kT);
    be.bias_dropout_residual_layernorm_forward(x.data(), bias.data(), res.data(), gamma.data(), beta.data(), s.view(),
                                               kH, 1e-12, d, out.data(), mean.data(), rstd.data());
    EXPECT_TRUE(all_finite(out));
    return dot(out, R);
  };
  loss();
  Vec dx = poison(kT * kH), dres = poison(kT * kH), dbias(kH, 0), dgamma(kH, 0), dbeta(kH, 0);
  be.bias_dropout_residual_layernorm_backward(R.data(), x.data(), bias.data(), res.data(), gamma.data(), mean.data(),
                                              rstd.data(), s.view(), kH, d, dx.data(), dres.data(), dbias.data(),
                                              dgamma.data(), dbeta.data());
  check_gradient("dx", x, dx, loss);
  check_gradient("dresidual", res, dres, loss);
  check_gradient("dbias", bias, dbias, loss);
  check_gradient("dgamma", gamma, dgamma, loss);
  check_gradient("dbeta", beta, dbeta, loss);
}

// A view of a subset of each sequence's rows with row_positions (the sparse last layer's view) computes, row for
// row, what the full view computes on those rows: outputs, statistics, both gradients (its dropout masks are the
// full rows'), and the parameter gradients are the full view's restricted to the kept rows' contributions.
TEST(OpsCpu, ResidualLayernormOnARowSubsetMatchesTheFullRows) {
  CpuBackend<CpuF64> be(2);
  Seqs s;
  std::mt19937_64 rng(16);
  const Vec x = random_vec(kT * kH, rng), bias = random_vec(kH, rng), res = random_vec(kT * kH, rng);
  const Vec gamma = random_vec(kH, rng), beta = random_vec(kH, rng);
  Vec d_out = random_vec(kT * kH, rng);
  // Kept rows: sequence 0's only row; positions 0, 2, 3 of sequence 1 (rows 1, 3, 4); positions 0 and 8 of
  // sequence 2 (rows 6 and 14).
  const std::vector<int32_t> rows{0, 1, 3, 4, 6, 14}, positions{0, 0, 2, 3, 0, 8}, cu{0, 1, 4, 6};
  const int32_t N = static_cast<int32_t>(rows.size());
  for (int32_t t = 0; t < kT; ++t)  // the rows left out carry no gradient, as in the model
    if (std::find(rows.begin(), rows.end(), t) == rows.end())
      for (int32_t j = 0; j < kH; ++j) d_out[t * kH + j] = 0;
  SeqView sub{N, 3, 3, cu.data(), s.sample_ids.data()};
  sub.row_positions = positions.data();
  const Dropout d = drop(0.3f, 5);

  Vec out = poison(kT * kH), mean = poison(kT), rstd = poison(kT);
  be.bias_dropout_residual_layernorm_forward(x.data(), bias.data(), res.data(), gamma.data(), beta.data(), s.view(),
                                             kH, 1e-12, d, out.data(), mean.data(), rstd.data());
  Vec dx = poison(kT * kH), dres = poison(kT * kH), dbias(kH, 0), dgamma(kH, 0), dbeta(kH, 0);
  be.bias_dropout_residual_layernorm_backward(d_out.data(), x.data(), bias.data(), res.data(), gamma.data(),
                                              mean.data(), rstd.data(), s.view(), kH, d, dx.data(), dres.data(),
                                              dbias.data(), dgamma.data(), dbeta.data());

  Vec xs(N * kH), res_s(N * kH), d_out_s(N * kH);
  be.gather_rows(x.data(), kT, rows.data(), N, kH, xs.data());
  be.gather_rows(res.data(), kT, rows.data(), N, kH, res_s.data());
  be.gather_rows(d_out.data(), kT, rows.data(), N, kH, d_out_s.data());
  Vec out_s = poison(N * kH), mean_s = poison(N), rstd_s = poison(N);
  be.bias_dropout_residual_layernorm_forward(xs.data(), bias.data(), res_s.data(), gamma.data(), beta.data(), sub, kH,
                                             1e-12, d, out_s.data(), mean_s.data(), rstd_s.data());
  Vec dx_s = poison(N * kH), dres_s = poison(N * kH), dbias_s(kH, 0), dgamma_s(kH, 0), dbeta_s(kH, 0);
  be.bias_dropout_residual_layernorm_backward(d_out_s.data(), xs.data(), bias.data(), res_s.data(), gamma.data(),
                                              mean_s.data(), rstd_s.data(), sub, kH, d, dx_s.data(), dres_s.data(),
                                              dbias_s.data(), dgamma_s.data(), dbeta_s.data());
  int dropped = 0;
  for (int32_t i = 0; i < N; ++i) {
    const int32_t t = rows[i];
    EXPECT_EQ(mean_s[i], mean[t]) << "row " << t;
    EXPECT_EQ(rstd_s[i], rstd[t]) << "row " << t;
    for (int32_t j = 0; j < kH; ++j) {
      EXPECT_EQ(out_s[i * kH + j], out[t * kH + j]) << "row " << t << " feature " << j;
      EXPECT_EQ(dx_s[i * kH + j], dx[t * kH + j]) << "row " << t << " feature " << j;
      EXPECT_EQ(dres_s[i * kH + j], dres[t * kH + j]) << "row " << t << " feature " << j;
      dropped += dx[t * kH + j] == 0.0;
    }
  }
  EXPECT_GT(dropped, 0);  // the masks were on (p = 0.3 over 48 elements)
  for (int32_t j = 0; j < kH; ++j) {
    EXPECT_NEAR(dbias_s[j], dbias[j], 1e-12 * (1 + std::fabs(dbias[j])));
    EXPECT_NEAR(dgamma_s[j], dgamma[j], 1e-12 * (1 + std::fabs(dgamma[j])));
    EXPECT_NEAR(dbeta_s[j], dbeta[j], 1e-12 * (1 + std::fabs(dbeta[j])));
  }
  // Attention and embeddings need whole sequences.
  Vec qkv = random_vec(N * 3 * kH, rng), ctx(N * kH), lse(kHeads * N);
  EXPECT_THROW(be.attention_forward(qkv.data(), sub, kHeads, kHeadDim, drop(0.0f, 1), ctx.data(), lse.data()), Error);
}

TEST(OpsCpu, GatherAndScatterRows) {
  CpuBackend<CpuF32> be(1);
  const int32_t T = 6, W = 3;
  std::vector<float> src(T * W);
  for (int i = 0; i < T * W; ++i) src[i] = static_cast<float>(i) + 0.5f;
  const std::vector<int32_t> rows{4, 0, 5};
  std::vector<float> g(3 * W, std::nanf(""));
  be.gather_rows(src.data(), T, rows.data(), 3, W, g.data());
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < W; ++j) EXPECT_EQ(g[i * W + j], src[rows[i] * W + j]);
  std::vector<float> dst(T * W, -1.0f);
  be.scatter_rows(g.data(), rows.data(), 3, W, dst.data(), T, /*accumulate=*/false);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < W; ++j)
      EXPECT_EQ(dst[t * W + j], (t == 0 || t == 4 || t == 5) ? src[t * W + j] : -1.0f) << t;
  be.scatter_rows(g.data(), rows.data(), 3, W, dst.data(), T, /*accumulate=*/true);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < W; ++j)
      EXPECT_EQ(dst[t * W + j], (t == 0 || t == 4 || t == 5) ? 2 * src[t * W + j] : -1.0f) << t;
  // Rows outside the matrix, or a row twice in a scatter, are errors.
  const std::vector<int32_t> bad{1, 6}, twice{2, 2};
  EXPECT_THROW(be.gather_rows(src.data(), T, bad.data(), 2, W, g.data()), Error);
  EXPECT_THROW(be.scatter_rows(g.data(), bad.data(), 2, W, dst.data(), T, false), Error);
  EXPECT_THROW(be.scatter_rows(g.data(), twice.data(), 2, W, dst.data(), T, true), Error);
}

TEST(OpsCpu, MlmHeadLossGradient) {
  CpuBackend<CpuF64> be(2);
  std::mt19937_64 rng(7);
  const int32_t V = 11, M = 4;
  std::vector<int32_t> positions{3, 0, 14, 3}, labels{2, 10, 0, 7};  // a repeated row: its gradients add up
  Vec hidden = random_vec(kT * kH, rng), Wt = random_vec(kH * kH, rng, 0.5), bt = random_vec(kH, rng);
  Vec gamma = random_vec(kH, rng), beta = random_vec(kH, rng), word = random_vec(V * kH, rng), obias = random_vec(V, rng);
  Vec gathered, pre, act, mean, rstd, ln_out, probs;
  auto weights = [&] {
    MlmHeadWeights<double> w;
    w.transform_weight = Wt.data(), w.transform_bias = bt.data(), w.ln_gamma = gamma.data(), w.ln_beta = beta.data(),
    w.word_embeddings = word.data(), w.output_bias = obias.data(), w.hidden = kH, w.vocab_size = V;
    return w;
  };
  auto saved = [&] {
    return MlmHeadSaved<double, double>{gathered.data(), pre.data(), act.data(), mean.data(),
                                        rstd.data(), ln_out.data(), probs.data()};
  };
  int32_t correct = -1;
  auto loss = [&] {
    gathered = poison(M * kH), pre = poison(M * kH), act = poison(M * kH), mean = poison(M), rstd = poison(M),
    ln_out = poison(M * kH), probs = poison(M * V);
    double loss_sum = kNaN;
    be.mlm_head_loss_forward(hidden.data(), positions.data(), labels.data(), M, weights(), saved(), &loss_sum,
                             &correct);
    EXPECT_TRUE(all_finite(probs) && all_finite(ln_out));
    return 0.5 * loss_sum;
  };
  const double l0 = loss();
  EXPECT_GT(l0, 0);
  EXPECT_GE(correct, 0);
  EXPECT_LE(correct, M);
  Vec d_hidden(kT * kH, 0.25), dWt(kH * kH, 0), dbt(kH, 0), dgamma(kH, 0), dbeta(kH, 0), dword(V * kH, 0), dob(V, 0);
  MlmHeadGrads<double> g{dWt.data(), dbt.data(), dgamma.data(), dbeta.data(), dword.data(), dob.data()};
  be.mlm_head_loss_backward(0.5, positions.data(), labels.data(), M, weights(), saved(), g, d_hidden.data());
  for (auto& v : d_hidden) v -= 0.25;  // d_hidden is added to
  for (int t = 0; t < kT; ++t) {  // rows not in mlm_positions get nothing
    if (t != 3 && t != 0 && t != 14) {
      for (int j = 0; j < kH; ++j) EXPECT_EQ(d_hidden[t * kH + j], 0.0);
    }
  }
  check_gradient("d_hidden", hidden, d_hidden, loss);
  check_gradient("d_transform_weight", Wt, dWt, loss);
  check_gradient("d_transform_bias", bt, dbt, loss);
  check_gradient("d_ln_gamma", gamma, dgamma, loss);
  check_gradient("d_ln_beta", beta, dbeta, loss);
  check_gradient("d_word_embeddings", word, dword, loss);
  check_gradient("d_output_bias", obias, dob, loss);
}

TEST(OpsCpu, MlmHeadCountsCorrectPredictions) {
  // Make the decoder predict token (row index + 1) by construction: bias dominates.
  CpuBackend<CpuF32> be(1);
  const int32_t H = 4, V = 6, M = 3;
  std::vector<float> hidden(5 * H, 0.1f), Wt(H * H, 0), bt(H, 0), gamma(H, 1), beta(H, 0), word(V * H, 0), ob(V, 0);
  ob[4] = 10;  // every row predicts 4
  std::vector<int32_t> positions{0, 2, 4}, labels{4, 1, 4};
  std::vector<float> gathered(M * H), pre(M * H), act(M * H), mean(M), rstd(M), ln_out(M * H), probs(M * V);
  MlmHeadWeights<float> w{Wt.data(), bt.data(), gamma.data(), beta.data(), word.data(), ob.data(), H, V, 1e-12};
  MlmHeadSaved<float, float> s{gathered.data(), pre.data(), act.data(), mean.data(),
                               rstd.data(), ln_out.data(), probs.data()};
  float loss = 0;
  int32_t correct = 0;
  be.mlm_head_loss_forward(hidden.data(), positions.data(), labels.data(), M, w, s, &loss, &correct);
  EXPECT_EQ(correct, 2);
  // Rows labelled 4 cost ~0, the row labelled 1 costs ~10.
  EXPECT_NEAR(loss, 10.0, 1e-3);
}

TEST(OpsCpu, NspHeadLossGradient) {
  CpuBackend<CpuF64> be(2);
  Seqs s;
  std::mt19937_64 rng(8);
  std::vector<int32_t> labels{1, 0, 1};
  Vec hidden = random_vec(kT * kH, rng), Wp = random_vec(kH * kH, rng, 0.5), bp = random_vec(kH, rng);
  Vec Wc = random_vec(2 * kH, rng), bc = random_vec(2, rng);
  Vec cls, pooled, probs;
  auto weights = [&] { return NspHeadWeights<double>{Wp.data(), bp.data(), Wc.data(), bc.data(), kH}; };
  auto saved = [&] { return NspHeadSaved<double>{cls.data(), pooled.data(), probs.data()}; };
  auto loss = [&] {
    cls = poison(3 * kH), pooled = poison(3 * kH), probs = poison(6);
    double loss_sum = kNaN;
    int32_t correct = -1;
    be.nsp_head_loss_forward(hidden.data(), s.view(), labels.data(), weights(), saved(), &loss_sum, &correct);
    EXPECT_TRUE(correct >= 0 && correct <= 3);
    return loss_sum;
  };
  loss();
  Vec d_hidden(kT * kH, 0), dWp(kH * kH, 0), dbp(kH, 0), dWc(2 * kH, 0), dbc(2, 0);
  NspHeadGrads<double> g{dWp.data(), dbp.data(), dWc.data(), dbc.data()};
  be.nsp_head_loss_backward(1.0, s.view(), labels.data(), weights(), saved(), g, d_hidden.data());
  check_gradient("d_hidden", hidden, d_hidden, loss);
  check_gradient("d_pooler_weight", Wp, dWp, loss);
  check_gradient("d_pooler_bias", bp, dbp, loss);
  check_gradient("d_classifier_weight", Wc, dWc, loss);
  check_gradient("d_classifier_bias", bc, dbc, loss);
}

TEST(OpsCpu, ResidualLayernormWithoutDropoutAndMaskRate) {
  CpuBackend<CpuF32> be(2);
  const int32_t T = 512, H = 64;
  std::vector<int32_t> cu{0, 200, 512};
  std::vector<uint64_t> ids{3, 4};
  SeqView sv{T, 2, 312, cu.data(), ids.data()};
  std::vector<float> x(T * H, 1.0f), bias(H, 0.0f), res(T * H, 0.0f), gamma(H, 1.0f), beta(H, 0.0f);
  for (int i = 0; i < T * H; ++i) x[i] = static_cast<float>(i % 7);
  std::vector<float> out(T * H), mean(T), rstd(T), out_p(T * H);
  be.bias_dropout_residual_layernorm_forward(x.data(), bias.data(), res.data(), gamma.data(), beta.data(), sv, H, 1e-12,
                                             drop(0.0f, 1), out.data(), mean.data(), rstd.data());
  // With p = 0, the LN input is x itself.
  for (int t = 0; t < T; t += 97) {
    float m = 0;
    for (int j = 0; j < H; ++j) m += x[t * H + j];
    EXPECT_NEAR(mean[t], m / H, 1e-5);
  }
  // With p = 0.1 and a zero residual, dropped elements are exactly the zero LN inputs (x + bias = 0 only if dropped
  // or x = 0): count the rate on elements with x != 0 through the mask function directly.
  int kept = 0, total = 0;
  for (int b = 0; b < 2; ++b)
    for (int t = cu[b]; t < cu[b + 1]; ++t)
      for (int j = 0; j < H; ++j, ++total)
        kept += dropout_keep(2024, 3, 1, ids[b], element_hidden(t - cu[b], j), 0.1f, kPhiloxRounds);
  EXPECT_NEAR(static_cast<double>(kept) / total, 1.0 - dropout_threshold(0.1f) / 65536.0, 0.01);
  // The dropped LN inputs are exactly those elements (x != 0 there), and the kept ones carry the contract's scale:
  // z = x * 65536 / (65536 - 6554) (float) + 0; checked through mean = sum(z) / H of one row.
  const float scale = dropout_keep_scale(dropout_threshold(0.1f));
  be.bias_dropout_residual_layernorm_forward(x.data(), bias.data(), res.data(), gamma.data(), beta.data(), sv, H, 1e-12,
                                             drop(0.1f, 1), out_p.data(), mean.data(), rstd.data());
  for (int t : {0, 199, 200, 511}) {
    const int b = t < 200 ? 0 : 1;
    float m = 0;
    for (int j = 0; j < H; ++j)
      if (dropout_keep(2024, 3, 1, ids[b], element_hidden(t - cu[b], j), 0.1f, kPhiloxRounds))
        m += x[t * H + j] * scale;
    EXPECT_NEAR(mean[t], m / H, 1e-5) << "row " << t;
  }
  // A p whose threshold would be 65536 (nothing kept) is rejected with a clear error; 1 - 2^-16 is still accepted.
  EXPECT_THROW(be.bias_dropout_residual_layernorm_forward(x.data(), bias.data(), res.data(), gamma.data(), beta.data(),
                                                          sv, H, 1e-12, drop(0.99999f, 1), out_p.data(), mean.data(),
                                                          rstd.data()),
               Error);
  EXPECT_NO_THROW(be.bias_dropout_residual_layernorm_forward(x.data(), bias.data(), res.data(), gamma.data(),
                                                             beta.data(), sv, H, 1e-12, drop(kDropoutMaxP, 1),
                                                             out_p.data(), mean.data(), rstd.data()));
}

}  // namespace
}  // namespace nopad::ops
