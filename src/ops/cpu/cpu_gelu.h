// The GELU activations and their derivatives as the CPU twin computes them, in any floating type S (float in the CPU
// backend, double in the GPU tests' references):
//   gelu(x)      = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))            (Hugging Face "gelu")
//   gelu_grad(x) = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
//   gelu_tanh(x) = 0.5 x (1 + tanh u), u = c (x + 0.044715 x^3), c = sqrt(2 / pi)   ("gelu_new")
//   gelu_tanh_grad(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) c (1 + 3 0.044715 x^2)
#pragma once
#include <cmath>

namespace nopad::ops::cpu {

template <class S>
S gelu(S x) {
  return S(0.5) * x * (S(1) + std::erf(x * S(0.70710678118654752440)));
}
template <class S>
S gelu_grad(S x) {
  const S cdf = S(0.5) * (S(1) + std::erf(x * S(0.70710678118654752440)));
  const S pdf = std::exp(S(-0.5) * x * x) * S(0.39894228040143267794);  // 1/sqrt(2 pi)
  return cdf + x * pdf;
}
template <class S>
S gelu_tanh(S x) {
  const S u = S(0.79788456080286535588) * (x + S(0.044715) * x * x * x);
  return S(0.5) * x * (S(1) + std::tanh(u));
}
template <class S>
S gelu_tanh_grad(S x) {
  const S c = S(0.79788456080286535588);
  const S th = std::tanh(c * (x + S(0.044715) * x * x * x));
  return S(0.5) * (S(1) + th) + S(0.5) * x * (S(1) - th * th) * c * (S(1) + S(3 * 0.044715) * x * x);
}

}  // namespace nopad::ops::cpu
