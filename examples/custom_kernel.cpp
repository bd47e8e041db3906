// Bring your own attention kernel.
//
// Positional LSH turns ALiBi attention into regular (unbiased) attention restricted to random
// contiguous blocks. plsh_attention accepts any callable with the regular kernel's contract, so a
// kernel you already trust (a vendor library, a quantised kernel, ...) computes the blocks. With
// the default near field the keys near each query (exact ALiBi factors) are computed by plsh, and
// the callable gets the block keys beyond them. Here the callable is a deliberately plain loop;
// the program checks that it gives the same output as the built-in kernels and counts how often
// it was called.

#include <plsh/plsh.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

namespace {

// The contract: q is rows x d, k is keys x d, v is keys x d_v (Eigen row-major maps), positions
// are absolute (options.query_position + i, options.key_position + j), options.scale is already
// resolved. Write the normalised rows of softmax(scale q k^T + causal mask) v to `out`, and each
// row's log-sum-exp to `lse` (zeros and -inf for a row that sees no key).
struct PlainAttention {
  std::atomic<long>* calls;

  void operator()(const plsh::ConstHeadMap<float>& q, const plsh::ConstHeadMap<float>& k,
                  const plsh::ConstHeadMap<float>& v, const plsh::AttentionOptions& options,
                  plsh::HeadMap<float> out, plsh::LseMap<float> lse) const {
    ++*calls;
    for (plsh::Index i = 0; i < q.rows(); ++i) {
      const plsh::Index query_position = options.query_position + i;
      double max_logit = -std::numeric_limits<double>::infinity();
      std::vector<double> logits(static_cast<std::size_t>(k.rows()));
      for (plsh::Index j = 0; j < k.rows(); ++j) {
        const bool visible = !options.causal || options.key_position + j <= query_position;
        logits[j] = visible ? options.scale * double(q.row(i).dot(k.row(j)))
                            : -std::numeric_limits<double>::infinity();
        max_logit = std::max(max_logit, logits[j]);
      }
      out.row(i).setZero();
      if (max_logit == -std::numeric_limits<double>::infinity()) {
        lse[i] = -std::numeric_limits<float>::infinity();
        continue;
      }
      double total = 0;
      for (plsh::Index j = 0; j < k.rows(); ++j) {
        const double weight = std::exp(logits[j] - max_logit);
        total += weight;
        out.row(i) += float(weight) * v.row(j);
      }
      out.row(i) /= float(total);
      lse[i] = float(max_logit + std::log(total));
    }
  }
};

}  // namespace

int main() {
  const plsh::Index n = 512, heads = 4, dim = 32;
  std::mt19937_64 engine(7);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> q(n * heads * dim), k(q.size()), v(q.size()), mine(q.size()),
      builtin(q.size());
  for (std::size_t i = 0; i < q.size(); ++i) {
    q[i] = uniform(engine);
    k[i] = uniform(engine);
    v[i] = uniform(engine);
  }
  const plsh::HeadsView<const float> q_view{q.data(), n, heads, dim};
  const plsh::HeadsView<const float> k_view{k.data(), n, heads, dim};
  const plsh::HeadsView<const float> v_view{v.data(), n, heads, dim};
  const std::vector<double> slopes = plsh::alibi_slopes(heads);

  plsh::PlshOptions options;  // near_field 0.05: exact factors down to 0.05, blocks beyond
  options.samples = 8;
  options.seed = 1;
  std::atomic<long> calls{0};
  plsh::plsh_attention<float>(q_view, k_view, v_view, {mine.data(), n, heads, dim}, slopes, options,
                              PlainAttention{&calls});

  // The built-in kernels compute the same function: Kernel::Passes with RegularAttention inside,
  // and Kernel::Fused (the default), each score once.
  float difference = 0;
  for (const plsh::Kernel kernel : {plsh::Kernel::Passes, plsh::Kernel::Fused}) {
    options.kernel = kernel;
    plsh::plsh_attention<float>(q_view, k_view, v_view, {builtin.data(), n, heads, dim}, slopes,
                                options);
    for (std::size_t i = 0; i < mine.size(); ++i) {
      difference = std::max(difference, std::abs(mine[i] - builtin[i]));
    }
  }
  std::printf("custom kernel called %ld times (on block keys beyond a head's near field)\n",
              calls.load());
  std::printf("max |custom - built-in| = %.3g\n", double(difference));
  return difference < 1e-4f ? 0 : 1;
}
