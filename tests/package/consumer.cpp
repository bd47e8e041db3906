// A user's program: it compiles against the three module headers, links nothing but plsh::plsh,
// and calls every public kernel (and a reference and a metric) on a tiny problem, checking each
// result against attention computed here from its definition, so that a broken header cannot
// install and pass. With PLSH_CONSUMER_FIRST_KERNELS (the installed package's test) it calls only
// the first kernel, the reference and the metric: it still includes every installed header, and
// the subdirectory test, which compiles the same headers, calls every kernel.
#include <plsh/analysis.hpp>
#include <plsh/plsh.hpp>
#include <plsh/reference.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#ifndef PLSH_CONSUMER_MODE
#define PLSH_CONSUMER_MODE "consumer"
#endif

namespace {

using plsh::Index;
using Tensor = std::vector<double>;

constexpr Index kTokens = 6, kHeads = 2, kKvHeads = 1, kDim = 4, kValueDim = 3;

Tensor make_tensor(Index size, double phase) {
  Tensor tensor(static_cast<std::size_t>(size));
  for (std::size_t i = 0; i < tensor.size(); ++i) tensor[i] = std::sin(0.7 * double(i) + phase);
  return tensor;
}

/// Causal softmax(q k^T / sqrt(d) - m_h |i - j|) v, straight from the definition.
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v,
                 const std::vector<double>& slopes) {
  Tensor out(static_cast<std::size_t>(kTokens * kHeads * kValueDim), 0.0);
  for (Index h = 0; h < kHeads; ++h) {
    const Index g = h / (kHeads / kKvHeads);
    for (Index i = 0; i < kTokens; ++i) {
      std::vector<double> weights(static_cast<std::size_t>(i + 1));
      double total = 0;
      for (Index j = 0; j <= i; ++j) {
        double dot = 0;
        for (Index e = 0; e < kDim; ++e) {
          dot += q[std::size_t((i * kHeads + h) * kDim + e)] *
                 k[std::size_t((j * kKvHeads + g) * kDim + e)];
        }
        weights[std::size_t(j)] =
            std::exp(dot / std::sqrt(double(kDim)) - slopes[std::size_t(h)] * double(i - j));
        total += weights[std::size_t(j)];
      }
      for (Index j = 0; j <= i; ++j)
        for (Index e = 0; e < kValueDim; ++e) {
          out[std::size_t((i * kHeads + h) * kValueDim + e)] +=
              weights[std::size_t(j)] / total * v[std::size_t((j * kKvHeads + g) * kValueDim + e)];
        }
    }
  }
  return out;
}

double max_difference(const Tensor& a, const Tensor& b) {
  double largest = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double difference = std::abs(a[i] - b[i]);
    if (!(difference <= largest)) largest = difference;  // NaN propagates
  }
  return largest;
}

int failures = 0;

void check(const char* what, double difference) {
  const bool ok = difference <= 1e-12;
  std::printf("plsh consumer (%s): %-40s max |difference| = %.2e %s\n", PLSH_CONSUMER_MODE, what,
              difference, ok ? "ok" : "WRONG");
  if (!ok) ++failures;
}

}  // namespace

int main() {
  const Tensor q = make_tensor(kTokens * kHeads * kDim, 0.1);
  const Tensor k = make_tensor(kTokens * kKvHeads * kDim, 1.3);
  const Tensor v = make_tensor(kTokens * kKvHeads * kValueDim, 2.9);
  const plsh::HeadsView<const double> q_view{q.data(), kTokens, kHeads, kDim};
  const plsh::HeadsView<const double> k_view{k.data(), kTokens, kKvHeads, kDim};
  const plsh::HeadsView<const double> v_view{v.data(), kTokens, kKvHeads, kValueDim};
  Tensor out(static_cast<std::size_t>(kTokens * kHeads * kValueDim));
  const plsh::HeadsView<double> out_view{out.data(), kTokens, kHeads, kValueDim};

  const std::vector<double> slopes = plsh::alibi_slopes(kHeads);
  if (slopes.size() != 2 || slopes[0] != 0.0625 || slopes[1] != 0.00390625) {
    std::fprintf(stderr, "plsh consumer (%s): alibi_slopes(2) is wrong\n", PLSH_CONSUMER_MODE);
    return 1;
  }
  const Tensor alibi = attention(q, k, v, slopes);

  plsh::exact_alibi_attention<double>(q_view, k_view, v_view, out_view, slopes);
  check("exact_alibi_attention", max_difference(out, alibi));
  plsh::reference::alibi_attention<double>(q_view, k_view, v_view, out_view, slopes);
  check("reference::alibi_attention", max_difference(out, alibi));
  // One block holding everything (infinite pitch): the mean mask is the factor of slope 0.
  const plsh::MaskError mask = plsh::mask_error(kTokens, 0.0, {plsh::fixed_grid(1e300)});
  check("mask_error, slope 0, one block", std::max(mask.max, mask.spectral));

#ifndef PLSH_CONSUMER_FIRST_KERNELS
  const std::vector<double> flat{0.0, 0.0};  // slope 0: every plsh kernel is plain attention
  const Tensor plain = attention(q, k, v, flat);
  plsh::windowed_alibi_attention<double>(q_view, k_view, v_view, out_view, slopes, 0.0);
  check("windowed_alibi_attention, tolerance 0", max_difference(out, alibi));
  plsh::PlshOptions options;  // near_field 0.05: at slope 0 every key is near (exact)
  options.samples = 3;
  for (const plsh::Kernel kernel : {plsh::Kernel::Fused, plsh::Kernel::Passes}) {
    options.kernel = kernel;
    plsh::plsh_attention<double>(q_view, k_view, v_view, out_view, flat, options);
    check(kernel == plsh::Kernel::Fused ? "plsh_attention (fused), slope 0"
                                        : "plsh_attention (passes), slope 0",
          max_difference(out, plain));
  }
  plsh::fixed_block_attention<double>(q_view, k_view, v_view, out_view, 1000);
  check("fixed_block_attention, one block", max_difference(out, plain));

  // Backward at slope 0: both functions are plain attention, so their gradients agree, and every
  // row of P sums to 1, so the values' gradients sum to the output gradients' sum.
  const Tensor dout = make_tensor(kTokens * kHeads * kValueDim, 4.1);
  const plsh::HeadsView<const double> dout_view{dout.data(), kTokens, kHeads, kValueDim};
  Tensor dq[2], dk[2], dv[2];
  for (int which = 0; which < 2; ++which) {
    dq[which].assign(q.size(), 7.0);
    dk[which].assign(k.size(), 7.0);
    dv[which].assign(v.size(), 7.0);
    const plsh::HeadsView<double> dq_view{dq[which].data(), kTokens, kHeads, kDim};
    const plsh::HeadsView<double> dk_view{dk[which].data(), kTokens, kKvHeads, kDim};
    const plsh::HeadsView<double> dv_view{dv[which].data(), kTokens, kKvHeads, kValueDim};
    const plsh::HeadsView<const double> plain_view{plain.data(), kTokens, kHeads, kValueDim};
    if (which == 0) {
      plsh::exact_alibi_attention_backward<double>(q_view, k_view, v_view, plain_view, dout_view,
                                                   dq_view, dk_view, dv_view, flat);
    } else {
      plsh::plsh_attention_backward<double>(q_view, k_view, v_view, plain_view, dout_view, dq_view,
                                            dk_view, dv_view, flat, options);
    }
  }
  double dv_sum_error = 0;
  for (Index e = 0; e < kValueDim; ++e) {
    double dv_sum = 0, dout_sum = 0;
    for (Index j = 0; j < kTokens; ++j) dv_sum += dv[0][std::size_t(j * kValueDim + e)];
    for (Index i = 0; i < kTokens * kHeads; ++i) dout_sum += dout[std::size_t(i * kValueDim + e)];
    dv_sum_error = std::max(dv_sum_error, std::abs(dv_sum - dout_sum));
  }
  check("exact_alibi_attention_backward: sum dv", dv_sum_error);
  check("plsh_attention_backward = exact, dq", max_difference(dq[0], dq[1]));
  check("plsh_attention_backward = exact, dk", max_difference(dk[0], dk[1]));
  check("plsh_attention_backward = exact, dv", max_difference(dv[0], dv[1]));

  // KvCache, one token at a time: each attended row is the row of plain attention.
  plsh::KvCache<double> cache(kHeads, kKvHeads, kDim, kValueDim, flat, options);
  Tensor rows(out.size());
  for (Index t = 0; t < kTokens; ++t) {
    cache.append(k_view.slice(t, 1), v_view.slice(t, 1));
    cache.attend(q_view.slice(t, 1), {rows.data() + t * kHeads * kValueDim, 1, kHeads, kValueDim});
  }
  check("KvCache, slope 0", max_difference(rows, plain));
#endif

  if (failures > 0) {
    std::fprintf(stderr, "plsh consumer (%s): %d wrong results\n", PLSH_CONSUMER_MODE, failures);
    return 1;
  }
  return 0;
}
