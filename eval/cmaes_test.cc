#include "eval/cmaes.h"

#include <cmath>

#include "gtest/gtest.h"

namespace kvtier::eval {
namespace {

double Sphere(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += (v - 1.5) * (v - 1.5);
  return s;
}

double Rosenbrock(const std::vector<double>& x) {
  double s = 0;
  for (size_t i = 0; i + 1 < x.size(); ++i) {
    s += 100.0 * std::pow(x[i + 1] - x[i] * x[i], 2) + std::pow(1.0 - x[i], 2);
  }
  return s;
}

TEST(CmaesTest, SolvesTheSphere) {
  CmaesOptions o;
  o.sigma0 = 1.0;
  o.max_evals = 4000;
  const CmaesResult r = CmaesMinimize(Sphere, std::vector<double>(6, -2.0), o);
  EXPECT_LT(r.best_f, 1e-10);
  for (double v : r.best_x) EXPECT_NEAR(v, 1.5, 1e-4);
}

TEST(CmaesTest, SolvesRosenbrock) {
  CmaesOptions o;
  o.sigma0 = 0.5;
  o.max_evals = 20000;
  const CmaesResult r = CmaesMinimize(Rosenbrock, std::vector<double>(5, 0.0), o);
  EXPECT_LT(r.best_f, 1e-8);
  for (double v : r.best_x) EXPECT_NEAR(v, 1.0, 1e-3);
}

TEST(CmaesTest, DeterministicForASeedAndHonoursBounds) {
  CmaesOptions o;
  o.max_evals = 300;
  o.seed = 42;
  o.lower = std::vector<double>(3, 2.0);
  o.upper = std::vector<double>(3, 5.0);
  int calls = 0;
  const CmaesResult a = CmaesMinimize(Sphere, {3, 3, 3}, o, [&](int, double) { ++calls; });
  const CmaesResult b = CmaesMinimize(Sphere, {3, 3, 3}, o);
  EXPECT_EQ(a.best_x, b.best_x);
  EXPECT_EQ(a.best_f, b.best_f);
  EXPECT_GT(calls, 0);
  EXPECT_LE(a.evals, 300);
  // The optimum 1.5 lies outside the box: the best is its corner at 2.
  for (double v : a.best_x) EXPECT_NEAR(v, 2.0, 1e-3);
}

}  // namespace
}  // namespace kvtier::eval
