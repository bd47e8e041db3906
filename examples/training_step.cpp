// Training through Positional LSH attention: forward, loss, backward, SGD.
//
// q, k and v are the parameters (a real model would backpropagate dq, dk, dv further into its
// projections). The target is the output of exact ALiBi attention on a hidden "teacher" q*, k*,
// v*. Each step runs plsh_attention (s = 20 partitions per head), takes the loss
// L = 0.5 ||out - target||^2, its gradient dout = out - target, calls plsh_attention_backward
// for dL/dq, dL/dk, dL/dv, and moves q, k, v against them. The loss goes down step by step.
// Before training it also compares the Positional LSH gradient with the exact ALiBi gradient
// (exact_alibi_attention_backward), which it estimates.
//
// Build it against an installed plsh with
//   find_package(plsh CONFIG REQUIRED)
//   target_link_libraries(my_program PRIVATE plsh::plsh)
// and compile with -O3 -march=native (and -fopenmp for threads).

#include <plsh/plsh.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace {

using plsh::Index;
using Tensor = std::vector<float>;

Tensor random_tensor(Index size, std::uint64_t seed, float amplitude) {
  std::mt19937_64 engine(seed);
  std::uniform_real_distribution<float> uniform(-amplitude, amplitude);
  Tensor tensor(static_cast<std::size_t>(size));
  for (float& x : tensor) x = uniform(engine);
  return tensor;
}

double dot(const Tensor& a, const Tensor& b) {
  double sum = 0;
  for (std::size_t i = 0; i < a.size(); ++i) sum += static_cast<double>(a[i]) * b[i];
  return sum;
}

}  // namespace

int main() {
  const Index n = 512, heads = 4, kv_heads = 2, dim = 32;
  const std::vector<double> slopes = plsh::alibi_slopes(heads);
  plsh::PlshOptions options;  // causal, the default estimator, seed 0
  const auto q_view = [&](const Tensor& x) {
    return plsh::HeadsView<const float>{x.data(), n, heads, dim};
  };
  const auto kv_view = [&](const Tensor& x) {
    return plsh::HeadsView<const float>{x.data(), n, kv_heads, dim};
  };

  // The teacher's output is the target.
  Tensor target(static_cast<std::size_t>(n * heads * dim));
  {
    const Tensor q = random_tensor(n * heads * dim, 1, 2.0f);
    const Tensor k = random_tensor(n * kv_heads * dim, 2, 2.0f);
    const Tensor v = random_tensor(n * kv_heads * dim, 3, 1.0f);
    plsh::exact_alibi_attention<float>(q_view(q), kv_view(k), kv_view(v),
                                       {target.data(), n, heads, dim}, slopes);
  }

  // The student starts elsewhere.
  Tensor q = random_tensor(n * heads * dim, 11, 2.0f);
  Tensor k = random_tensor(n * kv_heads * dim, 12, 2.0f);
  Tensor v = random_tensor(n * kv_heads * dim, 13, 1.0f);
  Tensor out(target.size()), dout(target.size());
  Tensor dq(q.size()), dk(k.size()), dv(v.size());

  const auto forward = [&]() {
    plsh::plsh_attention<float>(q_view(q), kv_view(k), kv_view(v), {out.data(), n, heads, dim},
                                slopes, options);
    double loss = 0;
    for (std::size_t i = 0; i < out.size(); ++i) {
      dout[i] = out[i] - target[i];
      loss += 0.5 * static_cast<double>(dout[i]) * dout[i];
    }
    return loss;
  };
  const auto backward = [&]() {
    plsh::plsh_attention_backward<float>(
        q_view(q), kv_view(k), kv_view(v), q_view(out), q_view(dout), {dq.data(), n, heads, dim},
        {dk.data(), n, kv_heads, dim}, {dv.data(), n, kv_heads, dim}, slopes, options);
  };

  // How close the Positional LSH gradient is to the exact ALiBi gradient at the start.
  {
    forward();
    backward();
    Tensor exact_out(out.size()), exact_dout(out.size());
    plsh::exact_alibi_attention<float>(q_view(q), kv_view(k), kv_view(v),
                                       {exact_out.data(), n, heads, dim}, slopes);
    for (std::size_t i = 0; i < out.size(); ++i) exact_dout[i] = exact_out[i] - target[i];
    Tensor exact_dq(q.size()), exact_dk(k.size()), exact_dv(v.size());
    plsh::exact_alibi_attention_backward<float>(
        q_view(q), kv_view(k), kv_view(v), q_view(exact_out), q_view(exact_dout),
        {exact_dq.data(), n, heads, dim}, {exact_dk.data(), n, kv_heads, dim},
        {exact_dv.data(), n, kv_heads, dim}, slopes);
    std::printf(
        "cosine(PLSH gradient, exact ALiBi gradient), s = %lld: dq %.3f  dk %.3f  dv %.3f\n\n",
        static_cast<long long>(options.samples),
        dot(dq, exact_dq) / std::sqrt(dot(dq, dq) * dot(exact_dq, exact_dq)),
        dot(dk, exact_dk) / std::sqrt(dot(dk, dk) * dot(exact_dk, exact_dk)),
        dot(dv, exact_dv) / std::sqrt(dot(dv, dv) * dot(exact_dv, exact_dv)));
  }

  // The loss sums over n * heads * dim = 65536 outputs; a value row receives the gradients of
  // every query that attends to it, hence a step size well below 1.
  const float learning_rate = 0.2f;
  const int steps = 30;
  std::printf("%4s %14s\n", "step", "loss");
  const double initial_loss = forward();
  for (int step = 0; step < steps; ++step) {
    const double loss = forward();
    if (step % 3 == 0) std::printf("%4d %14.3f\n", step, loss);
    backward();
    for (std::size_t i = 0; i < q.size(); ++i) q[i] -= learning_rate * dq[i];
    for (std::size_t i = 0; i < k.size(); ++i) k[i] -= learning_rate * dk[i];
    for (std::size_t i = 0; i < v.size(); ++i) v[i] -= learning_rate * dv[i];
  }
  const double final_loss = forward();
  std::printf("%4d %14.3f\n", steps, final_loss);
  return final_loss < 0.5 * initial_loss ? 0 : 1;
}
