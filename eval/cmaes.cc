#include "eval/cmaes.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace kvtier::eval {
namespace {

using Matrix = std::vector<std::vector<double>>;

// Jacobi eigen-decomposition of a symmetric matrix: a = v diag(w) v^T.
void SymmetricEigen(Matrix a, std::vector<double>* w, Matrix* v) {
  const size_t n = a.size();
  *v = Matrix(n, std::vector<double>(n, 0.0));
  for (size_t i = 0; i < n; ++i) (*v)[i][i] = 1.0;
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0;
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = i + 1; j < n; ++j) off += a[i][j] * a[i][j];
    }
    if (off < 1e-30) break;
    for (size_t p = 0; p < n; ++p) {
      for (size_t q = p + 1; q < n; ++q) {
        if (std::fabs(a[p][q]) < 1e-300) continue;
        const double theta = (a[q][q] - a[p][p]) / (2.0 * a[p][q]);
        const double t =
            (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1.0));
        const double c = 1.0 / std::sqrt(t * t + 1.0), s = t * c;
        for (size_t k = 0; k < n; ++k) {
          const double akp = a[k][p], akq = a[k][q];
          a[k][p] = c * akp - s * akq;
          a[k][q] = s * akp + c * akq;
        }
        for (size_t k = 0; k < n; ++k) {
          const double apk = a[p][k], aqk = a[q][k];
          a[p][k] = c * apk - s * aqk;
          a[q][k] = s * apk + c * aqk;
        }
        for (size_t k = 0; k < n; ++k) {
          const double vkp = (*v)[k][p], vkq = (*v)[k][q];
          (*v)[k][p] = c * vkp - s * vkq;
          (*v)[k][q] = s * vkp + c * vkq;
        }
      }
    }
  }
  w->resize(n);
  for (size_t i = 0; i < n; ++i) (*w)[i] = std::max(a[i][i], 1e-20);
}

}  // namespace

CmaesResult CmaesMinimize(const std::function<double(const std::vector<double>&)>& f,
                          std::vector<double> x0, const CmaesOptions& o,
                          const std::function<void(int, double)>& progress) {
  const int n = static_cast<int>(x0.size());
  const int lambda = o.lambda > 0 ? o.lambda : 4 + static_cast<int>(std::floor(3.0 * std::log(n)));
  const int mu = lambda / 2;
  std::vector<double> w(mu);
  for (int i = 0; i < mu; ++i) w[i] = std::log(mu + 0.5) - std::log(i + 1.0);
  const double wsum = std::accumulate(w.begin(), w.end(), 0.0);
  for (double& x : w) x /= wsum;
  double w2 = 0;
  for (double x : w) w2 += x * x;
  const double mueff = 1.0 / w2;
  const double cc = (4.0 + mueff / n) / (n + 4.0 + 2.0 * mueff / n);
  const double cs = (mueff + 2.0) / (n + mueff + 5.0);
  const double c1 = 2.0 / ((n + 1.3) * (n + 1.3) + mueff);
  const double cmu =
      std::min(1.0 - c1, 2.0 * (mueff - 2.0 + 1.0 / mueff) / ((n + 2.0) * (n + 2.0) + mueff));
  const double damps = 1.0 + 2.0 * std::max(0.0, std::sqrt((mueff - 1.0) / (n + 1.0)) - 1.0) + cs;
  const double chin =
      std::sqrt(static_cast<double>(n)) * (1.0 - 1.0 / (4.0 * n) + 1.0 / (21.0 * n * n));

  std::mt19937_64 rng(o.seed);
  std::normal_distribution<double> gauss(0.0, 1.0);
  std::vector<double> m = std::move(x0), pc(n, 0.0), ps(n, 0.0), eig(n, 1.0);
  Matrix c(n, std::vector<double>(n, 0.0)), b(n, std::vector<double>(n, 0.0));
  for (int i = 0; i < n; ++i) c[i][i] = b[i][i] = 1.0;
  double sigma = o.sigma0;
  auto clamp = [&](std::vector<double>* x) {
    for (int i = 0; i < n; ++i) {
      if (!o.lower.empty()) (*x)[i] = std::max((*x)[i], o.lower[i]);
      if (!o.upper.empty()) (*x)[i] = std::min((*x)[i], o.upper[i]);
    }
  };
  CmaesResult r;
  r.best_x = m;
  clamp(&r.best_x);
  r.best_f = f(r.best_x);
  r.evals = 1;
  std::vector<std::vector<double>> xs(lambda), ys(lambda);
  std::vector<double> fs(lambda);
  std::vector<int> idx(lambda);
  while (r.evals + lambda <= o.max_evals) {
    std::vector<double> d(n);
    for (int i = 0; i < n; ++i) d[i] = std::sqrt(eig[i]);
    for (int k = 0; k < lambda; ++k) {
      std::vector<double> z(n), y(n, 0.0);
      for (double& v : z) v = gauss(rng);
      for (int i = 0; i < n; ++i) {
        for (int j = 0; j < n; ++j) y[i] += b[i][j] * d[j] * z[j];
      }
      xs[k].resize(n);
      for (int i = 0; i < n; ++i) xs[k][i] = m[i] + sigma * y[i];
      clamp(&xs[k]);
      ys[k].resize(n);
      for (int i = 0; i < n; ++i) ys[k][i] = (xs[k][i] - m[i]) / sigma;
      fs[k] = f(xs[k]);
      ++r.evals;
      if (fs[k] < r.best_f) {
        r.best_f = fs[k];
        r.best_x = xs[k];
      }
    }
    ++r.generations;
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b2) { return fs[a] < fs[b2]; });
    std::vector<double> yw(n, 0.0);
    for (int k = 0; k < mu; ++k) {
      for (int i = 0; i < n; ++i) yw[i] += w[k] * ys[idx[k]][i];
    }
    for (int i = 0; i < n; ++i) m[i] += sigma * yw[i];
    // C^{-1/2} yw = B D^-1 B^T yw.
    std::vector<double> t(n, 0.0), cinv(n, 0.0);
    for (int j = 0; j < n; ++j) {
      for (int i = 0; i < n; ++i) t[j] += b[i][j] * yw[i];
      t[j] /= d[j];
    }
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) cinv[i] += b[i][j] * t[j];
    }
    double psn = 0;
    for (int i = 0; i < n; ++i) {
      ps[i] = (1.0 - cs) * ps[i] + std::sqrt(cs * (2.0 - cs) * mueff) * cinv[i];
      psn += ps[i] * ps[i];
    }
    psn = std::sqrt(psn);
    const double hsig_lhs = psn / std::sqrt(1.0 - std::pow(1.0 - cs, 2.0 * r.generations)) / chin;
    const double hsig = hsig_lhs < 1.4 + 2.0 / (n + 1.0) ? 1.0 : 0.0;
    for (int i = 0; i < n; ++i)
      pc[i] = (1.0 - cc) * pc[i] + hsig * std::sqrt(cc * (2.0 - cc) * mueff) * yw[i];
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        double rank_mu = 0;
        for (int k = 0; k < mu; ++k) rank_mu += w[k] * ys[idx[k]][i] * ys[idx[k]][j];
        c[i][j] = (1.0 - c1 - cmu) * c[i][j] +
                  c1 * (pc[i] * pc[j] + (1.0 - hsig) * cc * (2.0 - cc) * c[i][j]) + cmu * rank_mu;
      }
    }
    sigma *= std::exp((cs / damps) * (psn / chin - 1.0));
    SymmetricEigen(c, &eig, &b);
    if (progress) progress(r.generations, r.best_f);
    if (fs[idx[lambda - 1]] - fs[idx[0]] < o.ftol && r.generations > 10) break;
  }
  return r;
}

}  // namespace kvtier::eval
