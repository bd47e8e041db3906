// output_hashes: one line per kernel, "name hash", the FNV-1a hash of the bytes of its outputs on
// fixed inputs (tests/attention_fixture.hpp problems: grouped heads, offsets, causal and
// bidirectional, float and double, 16-bit storage). Two builds of the same compiler, flags and
// machine print the same lines exactly when every kernel computes the same bits: a refactoring
// that must not change results is checked by running it before and after (diff of the outputs).
// Not a ctest test: the bits depend on the compiler, its flags and the vector units.

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <plsh/plsh.hpp>

#include "../attention_fixture.hpp"

namespace {

using plsh::Index;
using plsh_test::Buffer;
using plsh_test::Problem;
using plsh_test::Shape;

template <class Scalar>
std::uint64_t hash(const std::vector<Scalar>& values, std::uint64_t h = 1469598103934665603ull) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(values.data());
  for (std::size_t i = 0; i < values.size() * sizeof(Scalar); ++i) {
    h = (h ^ bytes[i]) * 1099511628211ull;
  }
  return h;
}

void print(const std::string& name, std::uint64_t h) {
  std::printf("%s %016llx\n", name.c_str(), static_cast<unsigned long long>(h));
}

/// An owning, packed [tokens][heads][dim] tensor of Scalar.
template <class Scalar>
struct Tensor {
  std::vector<Scalar> storage;
  plsh::HeadsView<Scalar> view;

  Tensor(Index tokens, Index heads, Index dim)
      : storage(static_cast<std::size_t>(tokens * heads * dim) + 1, Scalar(0)),
        view{storage.data(), tokens, heads, dim} {}
  /// The values of a double buffer, rounded to Scalar.
  explicit Tensor(const Buffer<double>& from)
      : Tensor(from.view.tokens, from.view.heads, from.view.dim) {
    for (std::size_t i = 0; i + 1 < storage.size(); ++i) {
      storage[i] = static_cast<Scalar>(from.storage[i]);
    }
  }
  Tensor(const Tensor& other) : storage(other.storage), view(other.view) {
    view.data = storage.data();
  }
  plsh::HeadsView<const Scalar> in() const { return view; }
};

template <class Scalar>
void run(const char* type) {
  const Shape shapes[] = {{300, 300, 8, 2, 16, 12}, {1, 257, 4, 4, 8, 8}, {97, 60, 6, 3, 5, 7}};
  int shape_index = 0;
  for (const Shape& shape : shapes) {
    const std::vector<double> slopes = plsh::alibi_slopes(shape.heads);
    const Problem<double> problem(shape, 23 + static_cast<std::uint64_t>(shape_index));
    const Tensor<Scalar> q_tensor(problem.q), k_tensor(problem.k), v_tensor(problem.v);
    Buffer<double> dout_values = problem.output();
    dout_values.fill_random(77);
    const Tensor<Scalar> dout(dout_values);
    for (const bool causal : {true, false}) {
      plsh::PlshOptions options;
      options.causal = causal;
      options.query_position = shape.n_q == 1 ? shape.n_k - 1 : 11;
      options.key_position = shape.n_q == 1 ? 0 : 4;
      options.samples = 7;
      options.seed = 5;
      options.sampling = plsh::Sampling::Independent;
      options.near_field = 0;
      const std::string tag = std::string(type) + " shape" + std::to_string(shape_index) +
                              (causal ? " causal" : " bidirectional");
      const auto q = q_tensor.in();
      const auto k = k_tensor.in();
      const auto v = v_tensor.in();
      const auto output = [&] { return Tensor<Scalar>(shape.n_q, shape.heads, shape.value_dim); };
      const auto forward = [&](const std::string& name, const auto& kernel) {
        Tensor<Scalar> out = output();
        kernel(out.view);
        print(name + " " + tag, hash(out.storage));
        return out;
      };
      const Tensor<Scalar> exact = forward("exact_alibi_attention", [&](auto out) {
        plsh::exact_alibi_attention<Scalar>(q, k, v, out, slopes, options);
      });
      forward("windowed_alibi_attention", [&](auto out) {
        plsh::windowed_alibi_attention<Scalar>(q, k, v, out, slopes, 1e-3, options);
      });
      const Tensor<Scalar> truncated = forward("truncated_alibi_attention", [&](auto out) {
        plsh::truncated_alibi_attention<Scalar>(q, k, v, out, slopes, 0.05, options);
      });
      const Tensor<Scalar> fused = forward("plsh_attention(fused)", [&](auto out) {
        plsh::plsh_attention<Scalar>(q, k, v, out, slopes, options);
      });
      plsh::PlshOptions passes = options;
      passes.kernel = plsh::Kernel::Passes;
      forward("plsh_attention(passes)",
              [&](auto out) { plsh::plsh_attention<Scalar>(q, k, v, out, slopes, passes); });
      plsh::PlshOptions latin = options;
      latin.sampling = plsh::Sampling::LatinHypercube;
      forward("plsh_attention(latin_hypercube)",
              [&](auto out) { plsh::plsh_attention<Scalar>(q, k, v, out, slopes, latin); });
      // The default estimator (Latin hypercube, near field 0.05) with these draws.
      plsh::PlshOptions near = latin;
      near.near_field = 0.05;
      const Tensor<Scalar> near_out = forward("plsh_attention(near_field)", [&](auto out) {
        plsh::plsh_attention<Scalar>(q, k, v, out, slopes, near);
      });
      const Tensor<Scalar> fixed = forward("fixed_block_attention", [&](auto out) {
        plsh::fixed_block_attention<Scalar>(q, k, v, out, 16, options);
      });
      const auto backward = [&](const std::string& name, const Tensor<Scalar>& out,
                                const auto& kernel) {
        Tensor<Scalar> dq = q_tensor, dk = k_tensor, dv = v_tensor;
        kernel(out.in(), dq.view, dk.view, dv.view);
        print(name + " " + tag, hash(dv.storage, hash(dk.storage, hash(dq.storage))));
      };
      backward("exact_alibi_attention_backward", exact, [&](auto out, auto dq, auto dk, auto dv) {
        plsh::exact_alibi_attention_backward<Scalar>(q, k, v, out, dout.in(), dq, dk, dv, slopes,
                                                     options);
      });
      backward("truncated_alibi_attention_backward", truncated,
               [&](auto out, auto dq, auto dk, auto dv) {
                 plsh::truncated_alibi_attention_backward<Scalar>(q, k, v, out, dout.in(), dq, dk,
                                                                  dv, slopes, 0.05, options);
               });
      backward("plsh_attention_backward", fused, [&](auto out, auto dq, auto dk, auto dv) {
        plsh::plsh_attention_backward<Scalar>(q, k, v, out, dout.in(), dq, dk, dv, slopes, options);
      });
      backward("fixed_block_attention_backward", fixed, [&](auto out, auto dq, auto dk, auto dv) {
        plsh::fixed_block_attention_backward<Scalar>(q, k, v, out, dout.in(), dq, dk, dv, 16,
                                                     options);
      });
      backward("plsh_attention_backward(near_field)", near_out,
               [&](auto out, auto dq, auto dk, auto dv) {
                 plsh::plsh_attention_backward<Scalar>(q, k, v, out, dout.in(), dq, dk, dv, slopes,
                                                       near);
               });
      if (causal && shape.n_q == shape.n_k) {
        // Decoding: the first half of the sequence at once, then one token at a time; the
        // estimator of `options`, then the default one.
        for (const plsh::PlshOptions* estimator : {&options, &near}) {
          plsh::PlshOptions cache_options = *estimator;
          cache_options.key_position = 0;
          plsh::KvCache<Scalar> cache(shape.heads, shape.kv_heads, shape.dim, shape.value_dim,
                                      slopes, cache_options);
          Tensor<Scalar> out = output();
          const Index prompt = shape.n_q / 2;
          cache.append(k.slice(0, prompt), v.slice(0, prompt));
          cache.attend(q.slice(0, prompt), out.view.slice(0, prompt));
          for (Index t = prompt; t < shape.n_q; ++t) {
            cache.decode(q.slice(t, 1), k.slice(t, 1), v.slice(t, 1), out.view.slice(t, 1));
          }
          print(std::string(estimator == &near ? "KvCache(near_field) " : "KvCache ") + tag,
                hash(out.storage));
        }
      }
    }
    ++shape_index;
  }
}

}  // namespace

int main() {
  run<float>("float");
  run<double>("double");
  run<Eigen::bfloat16>("bfloat16");
  run<Eigen::half>("half");
  return 0;
}
