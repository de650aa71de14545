#include "fit/ridge.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/backend.hpp"
#include "core/error.hpp"
#include "fit/lambda.hpp"
#include "fit/moments.hpp"

namespace crosskv {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Adds the seconds since its construction (or the last lap) to a SolveTimes field, if there is one.
class Lap {
 public:
  explicit Lap(SolveTimes* t) : t_(t) {}
  void to(double SolveTimes::*field) {
    const auto now = std::chrono::steady_clock::now();
    if (t_) t_->*field += std::chrono::duration<double>(now - t0_).count();
    t0_ = now;
  }

 private:
  SolveTimes* t_;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};
// A pivot this small against its diagonal means the system is singular at the precision of fp32 moments.
constexpr double kSingularPivot = 1e-12;

// The order of the first leading minor of a factored system with diagonal `diag` (λ included) that is not
// (numerically) positive definite, or 0.
int64_t first_bad_minor(const DenseMaths::SystemFactor& f, const std::vector<double>& diag) {
  const int64_t ok = f.info > 0 ? f.info - 1 : f.n;
  for (int64_t i = 0; i < ok; ++i) {
    const double p = f.pivots[i];
    if (!(p * p > kSingularPivot * std::max(diag[i], std::numeric_limits<double>::min()))) return i + 1;
  }
  return f.info;
}

// A host system plus λ on its diagonal, factored by the backend; `bad` receives first_bad_minor.
DenseMaths::FactorPtr factor(DenseMaths& be, double* A, int64_t n, double lambda, int64_t& bad) {
  std::vector<double> diag(n);
  for (int64_t i = 0; i < n; ++i) diag[i] = A[i * n + i] += lambda;
  auto f = be.factor_system(n, A, n);
  bad = first_bad_minor(*f, diag);
  return f;
}

}  // namespace

std::vector<double> r2_per_head(const double* W, const double* Cxy, int64_t n, int64_t G, int64_t ld,
                                const std::vector<double>& var_y, double lambda, int heads) {
  std::vector<double> sse(G, 0.0);
  for (int64_t c = 0; c < G; ++c) sse[c] = var_y[c];
  // Column chunks in parallel, rows in order within each: the same sums as a serial loop.
  constexpr int64_t kChunk = 64;
#pragma omp parallel for schedule(static) if (n * G > kParallelMin)
  for (int64_t c0 = 0; c0 < G; c0 += kChunk)
    for (int64_t i = 0; i < n; ++i) {
      const double* w = W + i * ld;
      const double* x = Cxy + i * ld;
      for (int64_t c = c0; c < std::min(G, c0 + kChunk); ++c) sse[c] -= w[c] * x[c] + lambda * w[c] * w[c];
    }
  return r2_from_sse(sse, var_y, heads);
}

std::vector<double> r2_from_sse(const std::vector<double>& sse, const std::vector<double>& var_y, int heads) {
  const int64_t G = static_cast<int64_t>(var_y.size()), D = G / heads;
  // SST = 0 columns are excluded; a column with variance far below the head's is numerically SST = 0 too.
  std::vector<double> r2(heads, kNaN);
  for (int h = 0; h < heads; ++h) {
    double sst = 0, e = 0, vmax = 0;
    for (int64_t c = h * D; c < (h + 1) * D; ++c) vmax = std::max(vmax, var_y[c]);
    for (int64_t c = h * D; c < (h + 1) * D; ++c)
      if (var_y[c] > 1e-12 * vmax && var_y[c] > 0) {
        sst += var_y[c];
        e += sse[c];
      }
    if (sst > 0) r2[h] = 1.0 - e / sst;
  }
  return r2;
}

Factor factor_layers(const Covariances& m, DenseMaths& be, const std::vector<int>& order, double lambda) {
  Factor f;
  factor_layers(m, be, order, lambda, f);
  return f;
}

void factor_layers(const Covariances& m, DenseMaths& be, const std::vector<int>& order, double lambda, Factor& f,
                   SolveTimes* times) {
  Lap lap(times);
  f.order = order;
  f.n = static_cast<int64_t>(order.size()) * m.dims().F();
  std::vector<double> diag(f.n);
  const DenseMaths::CovTerms terms = m.cov_xx_terms(order);
  lap.to(&SolveTimes::assemble);
  f.system = be.factor_cov(terms, lambda, diag.data(), std::move(f.system));  // assembled and factored there
  f.bad_minor = first_bad_minor(*f.system, diag);
  lap.to(&SolveTimes::factor);
}

namespace {

[[noreturn]] void throw_singular(const std::string& what, int k, const Factor& f, int64_t nk, int64_t F,
                                 double lambda) {
  const int at = f.order[static_cast<size_t>((f.bad_minor - 1) / F)];
  throw SolveError(what + ", k = " + std::to_string(k) + ": Cxx + lambda*I is singular or not positive definite " +
                   "(lambda = " + std::to_string(lambda) + "; fails at feature " + std::to_string(f.bad_minor) +
                   " of " + std::to_string(nk) + ", source layer " + std::to_string(at) +
                   "); use fit.lambda > 0 or fewer source layers");
}

// R², bias and ascending row order for a solution W [k*F x G] over layers `top` (in factor order), in one pass over
// W and Cxy: each column chunk's rows in order on one thread, so every sum is the serial loop's (the same bits).
LayerFit finish_fit(const Covariances& m, int l, const std::vector<int>& top, const double* W, const double* Cxy,
                    double lambda) {
  const int64_t F = m.dims().F(), G = m.dims().G();
  const int k = static_cast<int>(top.size());
  const int64_t nk = k * F;
  LayerFit f;
  f.k = k;
  // Rows of W go to their layer's place in ascending source-layer order.
  std::vector<int> order(k), place(k);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int x, int y) { return top[x] < top[y]; });
  for (int j = 0; j < k; ++j) {
    place[order[j]] = j;
    f.layers.push_back(top[order[j]]);
  }
  std::vector<double> mx(nk);  // x̄ in factor order
  for (int i = 0; i < k; ++i) {
    const std::vector<double> v = m.mean_x(top[i]);
    std::copy(v.begin(), v.end(), mx.begin() + i * F);
  }
  const std::vector<double> var_y = m.var_y(l);
  // SSE/N = var_y - tr(W^T Cxy) - λ|W|² per column; bias b = ȳ - x̄ W in fp64 (the intercept is not penalised).
  std::vector<double> sse(var_y.begin(), var_y.end()), b = m.mean_y(l);
  f.W.resize(nk * G);
  float* out = f.W.data();
  constexpr int64_t kChunk = 64;
#pragma omp parallel for schedule(static) if (nk * G > kParallelMin)
  for (int64_t c0 = 0; c0 < G; c0 += kChunk) {
    const int64_t c1 = std::min(G, c0 + kChunk);
    for (int64_t r = 0; r < nk; ++r) {
      const double* w = W + r * G;
      const double* x = Cxy + r * G;
      const double xm = mx[r];
      float* dst = out + (place[r / F] * F + r % F) * G;
      for (int64_t c = c0; c < c1; ++c) {
        sse[c] -= w[c] * x[c] + lambda * w[c] * w[c];
        b[c] -= xm * w[c];
        dst[c] = static_cast<float>(w[c]);
      }
    }
  }
  f.r2 = r2_from_sse(sse, var_y, m.dims().Ht);
  f.b.assign(b.begin(), b.end());
  f.lambda = lambda;
  return f;
}

// The nested sweep over one system, for both structures: `f` is factored in rank order over the top layers (blocks
// of `width` rows), Cxy [f.n x cols] its right-hand sides. One forward substitution over the rows every valid k
// shares, then per k < Ls of `ks` a back substitution of its leading block, handed to done(i, W) for ks[i].
template <class Done>
void sweep_nested(DenseMaths& be, const Factor& f, const BigVector<double>& Cxy, int64_t width, int64_t cols,
                  const std::vector<int>& ks, int Ls, const std::string& what, double lambda, SolveWorkspace& ws,
                  Lap& lap, Done done) {
  int64_t n_ok = 0;
  for (int k : ks)
    if (k < Ls && (f.bad_minor == 0 || k * width < f.bad_minor)) n_ok = k * width;
  BigVector<double>& Z = ws.z;
  Z.assign(Cxy.begin(), Cxy.end());
  lap.to(&SolveTimes::assemble);
  be.solve_triangular(*f.system, n_ok, false, cols, Z.data(), cols);
  lap.to(&SolveTimes::substitute);
  for (size_t i = 0; i < ks.size() && ks[i] < Ls; ++i) {
    const int64_t nk = ks[i] * width;
    if (f.bad_minor > 0 && f.bad_minor <= nk) throw_singular(what, ks[i], f, nk, width, lambda);
    BigVector<double>& W = ws.w;
    W.assign(Z.begin(), Z.begin() + nk * cols);
    be.solve_triangular(*f.system, nk, true, cols, W.data(), cols);
    lap.to(&SolveTimes::substitute);
    done(i, W.data());
    lap.to(&SolveTimes::finish);
  }
}

// k = Ls: the system over every source layer solved for its right-hand sides Cxy [f.n x cols], handed to done(W).
template <class Done>
void solve_whole(DenseMaths& be, const Factor& f, const BigVector<double>& Cxy, int64_t cols, SolveWorkspace& ws,
                 Lap& lap, Done done) {
  BigVector<double>& W = ws.w;
  W.assign(Cxy.begin(), Cxy.end());
  lap.to(&SolveTimes::assemble);
  be.solve(*f.system, f.n, cols, W.data(), cols);
  lap.to(&SolveTimes::substitute);
  done(W.data());
  lap.to(&SolveTimes::finish);
}

}  // namespace

std::vector<LayerFit> fit_sweep(const Covariances& m, DenseMaths& be, int l, const std::vector<int>& ranking,
                                const std::vector<int>& ks, const LayerLambda& lambda, const std::string& what,
                                const Factor* all_layers, SolveWorkspace* workspace) {
  const PairDims& d = m.dims();
  const int64_t F = d.F(), G = d.G();
  CROSSKV_ASSERT(!ks.empty() && std::is_sorted(ks.begin(), ks.end()), "ks must be ascending");
  CROSSKV_ASSERT(ks.back() <= static_cast<int>(ranking.size()), "k exceeds the ranking");
  SolveWorkspace local_ws;
  SolveWorkspace& ws = workspace ? *workspace : local_ws;
  std::vector<LayerFit> out;
  int kmax_nested = 0;
  for (int k : ks)
    if (k < d.Ls) kmax_nested = k;
  if (kmax_nested > 0) {
    const std::vector<int> top(ranking.begin(), ranking.begin() + kmax_nested);
    Factor& f = ws.nested;
    factor_layers(m, be, top, lambda.nested, f, &ws.times);
    Lap lap(&ws.times);
    BigVector<double>& Cxy = ws.cxy;
    Cxy.resize(f.n * G);
    m.cov_xy(top, l, Cxy.data(), G);
    sweep_nested(be, f, Cxy, F, G, ks, d.Ls, what, lambda.nested, ws, lap, [&](size_t i, const double* W) {
      out.push_back(finish_fit(m, l, std::vector<int>(top.begin(), top.begin() + ks[i]), W, Cxy.data(), lambda.nested));
    });
  }
  if (ks.back() == d.Ls) {
    Factor local;
    if (!all_layers) {
      std::vector<int> asc(d.Ls);
      std::iota(asc.begin(), asc.end(), 0);
      factor_layers(m, be, asc, lambda.all, local, &ws.times);
      all_layers = &local;
    }
    const Factor& f = *all_layers;
    if (f.bad_minor > 0) throw_singular(what, d.Ls, f, f.n, F, lambda.all);
    Lap lap(&ws.times);
    BigVector<double>& Cxy = ws.cxy;
    Cxy.resize(f.n * G);
    m.cov_xy(f.order, l, Cxy.data(), G);
    solve_whole(be, f, Cxy, G, ws, lap,
                [&](const double* W) { out.push_back(finish_fit(m, l, f.order, W, Cxy.data(), lambda.all)); });
  }
  return out;
}

namespace {

// Head h's share of a per-head fit: W_h [nk x Dt] over layers `top` (factor order) goes to f.W's head block in
// ascending layer order; its columns' SSE/N (in `sse`) and biases b = ȳ - x̄ W (in `b`, fp64) are of the layer's
// width G, so the heads fill them in turn.
void finish_head(const Covariances& m, int h, const std::vector<int>& top, const double* W, const double* Cxy,
                 double lambda, LayerFit& f, std::vector<double>& sse, std::vector<double>& b) {
  const PairDims& d = m.dims();
  const int64_t Ds = d.Ds, Dt = d.Dt;
  const int k = static_cast<int>(top.size());
  const int64_t nk = k * Ds;
  std::vector<int> order(k), place(k);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int x, int y) { return top[x] < top[y]; });
  for (int j = 0; j < k; ++j) place[order[j]] = j;
  float* out = f.W.data() + h * nk * Dt;
  for (int i = 0; i < k; ++i) {
    const std::vector<double> mx = m.mean_x(top[i]);
    for (int64_t p = 0; p < Ds; ++p) {
      const int64_t r = i * Ds + p;
      const double xm = mx[h * Ds + p];
      const double* w = W + r * Dt;
      const double* x = Cxy + r * Dt;
      float* dst = out + (place[i] * Ds + p) * Dt;
      for (int64_t c = 0; c < Dt; ++c) {
        sse[h * Dt + c] -= w[c] * x[c] + lambda * w[c] * w[c];
        b[h * Dt + c] -= xm * w[c];
        dst[c] = static_cast<float>(w[c]);
      }
    }
  }
}

}  // namespace

std::vector<LayerFit> fit_sweep_per_head(const Covariances& m, DenseMaths& be, int l, const std::vector<int>& ranking,
                                         const std::vector<int>& ks, const LayerLambda& lambda, const std::string& what,
                                         std::vector<Factor>* all_layers, SolveWorkspace* workspace) {
  const PairDims& d = m.dims();
  CROSSKV_ASSERT(d.Hs == d.Ht, "per_head needs equal KV head counts");
  const int H = d.Ht;
  const int64_t Ds = d.Ds, Dt = d.Dt;
  CROSSKV_ASSERT(!ks.empty() && std::is_sorted(ks.begin(), ks.end()), "ks must be ascending");
  CROSSKV_ASSERT(ks.back() <= static_cast<int>(ranking.size()), "k exceeds the ranking");
  SolveWorkspace local_ws;
  SolveWorkspace& ws = workspace ? *workspace : local_ws;
  const std::vector<double> var_y = m.var_y(l), mean_y = m.mean_y(l);
  std::vector<int> asc(d.Ls);
  std::iota(asc.begin(), asc.end(), 0);
  // Per k: the fit, its columns' SSE/N and biases, filled head by head.
  std::vector<LayerFit> out(ks.size());
  std::vector<std::vector<double>> sse(ks.size(), var_y), bias(ks.size(), mean_y);
  std::vector<std::vector<int>> tops(ks.size());
  for (size_t i = 0; i < ks.size(); ++i) {
    tops[i] = ks[i] < d.Ls ? std::vector<int>(ranking.begin(), ranking.begin() + ks[i]) : asc;
    out[i].k = ks[i];
    out[i].structure = Structure::per_head;
    out[i].layers = tops[i];
    std::sort(out[i].layers.begin(), out[i].layers.end());
    out[i].W.resize(int64_t{H} * ks[i] * Ds * Dt);
    out[i].lambda = lambda.of(ks[i], d.Ls);
  }
  int kmax_nested = 0;
  for (int k : ks)
    if (k < d.Ls) kmax_nested = k;
  if (all_layers && all_layers->size() != static_cast<size_t>(H)) {
    all_layers->clear();
    all_layers->resize(H);
  }
  std::vector<double> diag;
  for (int h = 0; h < H; ++h) {
    const std::string head = what + ", head " + std::to_string(h);
    auto factor_heads = [&](const std::vector<int>& order, Factor& f, double lambda) {
      Lap lap(&ws.times);
      f.order = order;
      f.n = static_cast<int64_t>(order.size()) * Ds;
      diag.assign(f.n, 0.0);
      const DenseMaths::CovTerms terms = m.head_cov_xx_terms(order, h);
      lap.to(&SolveTimes::assemble);
      f.system = be.factor_cov(terms, lambda, diag.data(), std::move(f.system));
      f.bad_minor = first_bad_minor(*f.system, diag);
      lap.to(&SolveTimes::factor);
    };
    auto finish = [&](size_t i, const std::vector<int>& top, const double* W, const double* Cxy) {
      finish_head(m, h, top, W, Cxy, out[i].lambda, out[i], sse[i], bias[i]);
    };
    if (kmax_nested > 0) {
      const std::vector<int> top(ranking.begin(), ranking.begin() + kmax_nested);
      Factor& f = ws.nested;
      factor_heads(top, f, lambda.nested);
      Lap lap(&ws.times);
      BigVector<double>& Cxy = ws.cxy;
      Cxy.resize(f.n * Dt);
      m.head_cov_xy(top, l, h, Cxy.data(), Dt);
      sweep_nested(be, f, Cxy, Ds, Dt, ks, d.Ls, head, lambda.nested, ws, lap,
                   [&](size_t i, const double* W) { finish(i, tops[i], W, Cxy.data()); });
    }
    if (ks.back() == d.Ls) {
      Factor local;
      Factor& f = all_layers ? (*all_layers)[h] : local;
      if (!f.system) factor_heads(asc, f, lambda.all);
      if (f.bad_minor > 0) throw_singular(head, d.Ls, f, f.n, Ds, lambda.all);
      Lap lap(&ws.times);
      BigVector<double>& Cxy = ws.cxy;
      Cxy.resize(f.n * Dt);
      m.head_cov_xy(asc, l, h, Cxy.data(), Dt);
      solve_whole(be, f, Cxy, Dt, ws, lap, [&](const double* W) { finish(ks.size() - 1, asc, W, Cxy.data()); });
    }
  }
  for (size_t i = 0; i < ks.size(); ++i) {
    out[i].r2 = r2_from_sse(sse[i], var_y, H);
    out[i].b.assign(bias[i].begin(), bias[i].end());
  }
  return out;
}

ProbeR2 probe_same_head(const Covariances& m, DenseMaths& be, double lambda, Kind kind,
                        const ProbeShare& mine, double curve_tokens) {
  const bool curves = curve_tokens > 0;
  const PairDims& d = m.dims();
  CROSSKV_ASSERT(d.Hs == d.Ht, "same-head probe needs equal head counts");
  const int Ds = d.Ds, Dt = d.Dt, H = d.Hs;
  const int64_t Y = int64_t{d.Lt} * Dt;
  ProbeR2 r{d.Ls, d.Lt, H, std::vector<double>(int64_t{d.Ls} * d.Lt), std::vector<double>(int64_t{d.Ls} * d.Lt * H),
            {}, {}};
  std::vector<std::vector<double>> var(d.Lt);
  for (int l = 0; l < d.Lt; ++l) var[l] = m.var_y(l);
  std::vector<double> A(int64_t{Ds} * Ds), C(Ds * Y), W(Ds * Y), vy(Dt);
  if (curves) size_probe_curves(r);
  const int64_t P = static_cast<int64_t>(lambda_grid().size());
  for (int a = 0; a < d.Ls; ++a)
    for (int h = 0; h < H; ++h) {
      bool any = false;
      for (int l = 0; l < d.Lt && !any; ++l) any = !mine || mine(a, l, h);
      if (!any) continue;
      m.head_cov_xx(a, h, A.data());
      m.head_cov_xy(a, h, C.data());
      if (curves) {  // every target layer's head h at once: one group per target layer
        std::vector<double> vys;
        for (int l = 0; l < d.Lt; ++l) vys.insert(vys.end(), var[l].begin() + int64_t{h} * Dt, var[l].begin() + int64_t{h + 1} * Dt);
        const RidgeCurves c = ridge_curves(be, ridge_eigen(be, Ds, A.data()), C.data(), Y, Y, vys.data(), d.Lt,
                                           curve_tokens);
        for (int l = 0; l < d.Lt; ++l) {
          if (mine && !mine(a, l, h)) continue;
          const int64_t at = ((int64_t{a} * d.Lt + l) * H + h) * P;
          std::copy_n(c.gcv.begin() + int64_t{l} * P, P, r.gcv.begin() + at);
          std::copy_n(c.r2.begin() + int64_t{l} * P, P, r.r2_grid.begin() + at);
        }
        continue;
      }
      int64_t bad = 0;
      const auto f = factor(be, A.data(), Ds, lambda, bad);
      if (bad > 0)
        throw SolveError("probe (" + std::string(kind_name(kind)) + "), source layer " + std::to_string(a) + " head " + std::to_string(h) +
                         ": Cxx + lambda*I is singular (lambda = " + std::to_string(lambda) + "); use fit.lambda > 0");
      W = C;
      be.solve(*f, Ds, Y, W.data(), Y);
      for (int l = 0; l < d.Lt; ++l) {
        if (mine && !mine(a, l, h)) continue;
        std::copy_n(var[l].begin() + int64_t{h} * Dt, Dt, vy.begin());
        auto r2 = r2_per_head(W.data() + int64_t{l} * Dt, C.data() + int64_t{l} * Dt, Ds, Dt, Y, vy, lambda, 1);
        r.per_head[(int64_t{a} * d.Lt + l) * H + h] = r2[0];
      }
    }
  probe_means(r);
  return r;
}

ProbeR2 probe_all_heads(const Covariances& m, DenseMaths& be, double lambda, Kind kind,
                        const ProbeShare& mine, double curve_tokens) {
  const bool curves = curve_tokens > 0;
  const PairDims& d = m.dims();
  const int64_t F = d.F(), G = d.G();
  const int H = d.Ht;
  ProbeR2 r{d.Ls, d.Lt, H, std::vector<double>(int64_t{d.Ls} * d.Lt), std::vector<double>(int64_t{d.Ls} * d.Lt * H),
            {}, {}};
  std::vector<double> A(F * F), C(F * G), W(F * G);
  if (curves) size_probe_curves(r);
  for (int a = 0; a < d.Ls; ++a) {
    bool any = false;
    for (int l = 0; l < d.Lt && !any; ++l) any = !mine || mine(a, l, -1);
    if (!any) continue;
    m.cov_xx({a}, A.data(), F);
    if (curves) {  // per target layer: one system, its heads the groups
      const int64_t P = static_cast<int64_t>(lambda_grid().size());
      const RidgeEigen e = ridge_eigen(be, F, A.data());  // once for every target layer
      for (int l = 0; l < d.Lt; ++l) {
        if (mine && !mine(a, l, -1)) continue;
        m.cov_xy({a}, l, C.data(), G);
        const std::vector<double> vy = m.var_y(l);
        const RidgeCurves c = ridge_curves(be, e, C.data(), G, G, vy.data(), H, curve_tokens);
        std::copy(c.gcv.begin(), c.gcv.end(), r.gcv.begin() + (int64_t{a} * d.Lt + l) * H * P);
        std::copy(c.r2.begin(), c.r2.end(), r.r2_grid.begin() + (int64_t{a} * d.Lt + l) * H * P);
      }
      continue;
    }
    int64_t bad = 0;
    const auto f = factor(be, A.data(), F, lambda, bad);
    if (bad > 0)
      throw SolveError("probe (" + std::string(kind_name(kind)) + "), source layer " + std::to_string(a) +
                       ": Cxx + lambda*I is singular (lambda = " + std::to_string(lambda) + "); use fit.lambda > 0");
    for (int l = 0; l < d.Lt; ++l) {
      if (mine && !mine(a, l, -1)) continue;
      m.cov_xy({a}, l, C.data(), G);
      W = C;
      be.solve(*f, F, G, W.data(), G);
      auto r2 = r2_per_head(W.data(), C.data(), F, G, G, m.var_y(l), lambda, H);
      std::copy(r2.begin(), r2.end(), r.per_head.begin() + (int64_t{a} * d.Lt + l) * H);
      r.mean[int64_t{a} * d.Lt + l] = mean_ignoring_nan(r2);
    }
  }
  return r;
}

}  // namespace crosskv
