#include "core/mlp.hpp"

#include <algorithm>
#include <cmath>
#include <random>

#include "core/error.hpp"

namespace crosskv {

MlpParams MlpParams::initial(const MlpShape& s, uint64_t seed) {
  MlpParams p(s);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const float s1 = static_cast<float>(std::sqrt(2.0 / static_cast<double>(s.in)));
  const float s2 = static_cast<float>(std::sqrt(2.0 / static_cast<double>(s.hidden)));
  for (int64_t i = 0; i < s.in * s.hidden; ++i) p.w1()[i] = s1 * n(rng);
  for (int64_t i = 0; i < s.hidden * s.hidden; ++i) p.w2()[i] = s2 * n(rng);
  return p;  // biases and the last layer stay zero
}

void mlp_forward(AffineKernels& k, const MlpShape& s, const float* p, const float* X, int64_t rows, float* h1,
                 float* h2, float* out) {
  const std::vector<MlpTensor> t = mlp_tensors(s);  // w1 b1 w2 b2 w3 b3
  // C[rows x n] = A[rows x in] W + b, then ReLU when `relu`.
  auto affine = [&](const float* A, int64_t in, const MlpTensor& w, const MlpTensor& b, int64_t n, bool relu,
                    float* C) {
    k.broadcast_rows(p + b.offset, n, rows, C, n);
    DenseMaths::BatchedGemm g;
    g.m = rows, g.n = n, g.k = in, g.beta = 1.0f;
    g.A = A, g.lda = in, g.B = p + w.offset, g.ldb = n, g.C = C, g.ldc = n;
    k.gemm(g);
    if (relu) k.relu(C, rows * n);
  };
  affine(X, s.in, t[0], t[1], s.hidden, true, h1);
  affine(h1, s.hidden, t[2], t[3], s.hidden, true, h2);
  affine(h2, s.hidden, t[4], t[5], s.out, false, out);
}

}  // namespace crosskv
