// Tests of KvCache's argument checks (kv_cache.hpp): every rejected argument of the constructor,
// append, attend and decode names the function and the argument, and a rejected call leaves the
// cache as it was.

#include <catch2/catch.hpp>

#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <plsh/kv_cache.hpp>
#include <plsh/limits.hpp>

#include "kernel_instances.hpp"

namespace test_kv_cache_errors {

namespace {

using plsh::HeadsView;
using plsh::Index;

}  // namespace

TEST_CASE("KvCache rejects bad arguments", "[kv_cache][validation]") {
  const std::vector<double> slopes = {0.1, 0.2};
  const auto construct = [&](Index heads, Index kv_heads, Index dim, Index value_dim,
                             std::vector<double> s, plsh::PlshOptions options) {
    plsh::KvCache<float> cache(heads, kv_heads, dim, value_dim, std::move(s), options);
  };
  const plsh::PlshOptions good;
  REQUIRE_NOTHROW(construct(2, 1, 4, 3, slopes, good));
  const auto expect_rejected = [](auto&& call, const std::string& function,
                                  const std::string& argument) {
    INFO(function << " must reject " << argument);
    REQUIRE_THROWS_AS(call(), std::invalid_argument);
    REQUIRE_THROWS_WITH(call(), Catch::Contains(function + ": ") && Catch::Contains(argument));
  };
  const std::string ctor = "KvCache";
  expect_rejected([&] { construct(0, 1, 4, 3, {}, good); }, ctor, "heads");
  expect_rejected([&] { construct(2, 0, 4, 3, slopes, good); }, ctor, "kv_heads");
  expect_rejected(
      [&] {
        construct(3, 2, 4, 3, {0.1, 0.2, 0.3}, good);
      },
      ctor, "heads must be a multiple of kv_heads");
  expect_rejected([&] { construct(2, 1, 0, 3, slopes, good); }, ctor, "dim");
  expect_rejected([&] { construct(2, 1, 4, 0, slopes, good); }, ctor, "value_dim");
  expect_rejected([&] { construct(2, 1, 4, 3, {0.1}, good); }, ctor, "slopes.size()");
  expect_rejected([&] { construct(2, 1, 4, 3, {0.1, -1.0}, good); }, ctor, "slopes[1]");
  plsh::PlshOptions options = good;
  options.samples = 0;
  expect_rejected([&] { construct(2, 1, 4, 3, slopes, options); }, ctor, "options.samples");
  options = good;
  options.causal = false;
  expect_rejected([&] { construct(2, 1, 4, 3, slopes, options); }, ctor, "options.causal");
  options = good;
  options.key_position = -1;
  expect_rejected([&] { construct(2, 1, 4, 3, slopes, options); }, ctor, "options.key_position");
  options = good;
  options.scale = std::numeric_limits<double>::infinity();
  expect_rejected([&] { construct(2, 1, 4, 3, slopes, options); }, ctor, "options.scale");

  plsh::KvCache<float> cache(2, 1, 4, 3, slopes, good);
  std::vector<float> buffer(256, 0.5f);
  using View = HeadsView<const float>;
  using Out = HeadsView<float>;
  const std::string append = "KvCache::append";
  const std::string attend = "KvCache::attend";
  std::vector<float> q(2 * 2 * 4, 0.1f);
  std::vector<float> out(2 * 2 * 3);
  const View q_view{q.data(), 1, 2, 4};
  const Out out_view{out.data(), 1, 2, 3};
  expect_rejected([&] { cache.attend(q_view, out_view); }, attend, "q.tokens (1) must not exceed");
  const View k_view{buffer.data(), 2, 1, 4};
  const View v_view{buffer.data() + 100, 2, 1, 3};
  expect_rejected([&] { cache.append(View{buffer.data(), -1, 1, 4}, v_view); }, append, "k.tokens");
  expect_rejected([&] { cache.append(View{nullptr, 2, 1, 4}, v_view); }, append, "k.data");
  expect_rejected([&] { cache.append(View{buffer.data(), 2, 2, 4}, v_view); }, append, "k.heads");
  expect_rejected([&] { cache.append(View{buffer.data(), 2, 1, 5}, v_view); }, append, "k.dim");
  expect_rejected(
      [&] {
        cache.append(k_view, View{buffer.data(), 2, 1, 3, -1, 3});
      },
      append, "v strides");
  expect_rejected([&] { cache.append(k_view, View{buffer.data(), 2, 2, 3}); }, append, "v.heads");
  expect_rejected([&] { cache.append(k_view, View{buffer.data(), 2, 1, 4}); }, append, "v.dim");
  expect_rejected([&] { cache.append(k_view, View{buffer.data(), 3, 1, 3}); }, append, "v.tokens");

  REQUIRE_NOTHROW(cache.append(k_view.slice(0, 0), v_view.slice(0, 0)));
  CHECK(cache.position() == 0);
  REQUIRE_NOTHROW(cache.append(k_view, v_view));
  CHECK(cache.position() == 2);
  CHECK(cache.resident() == 2);
  REQUIRE_NOTHROW(cache.attend(View{q.data(), 2, 2, 4}, Out{out.data(), 2, 2, 3}));
  REQUIRE_NOTHROW(cache.attend(q_view.slice(0, 0), out_view.slice(0, 0)));
  expect_rejected(
      [&] {
        cache.attend(View{q.data(), 2, 2, 4}.slice(0, 0), Out{nullptr, 0, 0, 3});
      },
      attend, "out.heads");
  expect_rejected([&] { cache.attend(View{nullptr, 1, 2, 4}, out_view); }, attend, "q.data");
  expect_rejected([&] { cache.attend(View{q.data(), 1, 1, 4}, out_view); }, attend, "q.heads");
  expect_rejected([&] { cache.attend(View{q.data(), 1, 2, 3}, out_view); }, attend, "q.dim");
  expect_rejected(
      [&] {
        cache.attend(View{q.data(), 3, 2, 4}, Out{out.data(), 3, 2, 3});
      },
      attend, "q.tokens (3) must not exceed the tokens of the last append (2)");
  expect_rejected([&] { cache.attend(q_view, Out{out.data(), 2, 2, 3}); }, attend, "out.tokens");
  expect_rejected(
      [&] {
        cache.attend(q_view, Out{out.data(), 1, 1, 3});
      },
      attend, "out.heads must equal");
  expect_rejected([&] { cache.attend(q_view, Out{out.data(), 1, 2, 4}); }, attend, "out.dim");
  expect_rejected(
      [&] {
        cache.attend(View{q.data(), 2, 2, 4}, Out{out.data(), 2, 2, 3, 1, 3});
      },
      attend, "out strides make rows overlap");
  expect_rejected(
      [&] {
        cache.attend(View{q.data(), 1, 2, 4}, Out{q.data(), 1, 2, 3});
      },
      attend, "out overlaps q");
  // The cache's own storage cannot be passed as out through the public interface except by
  // casting away const; the check exists for it all the same.
  const View stored = cache.values();
  expect_rejected(
      [&] {
        cache.attend(q_view, Out{const_cast<float*>(stored.data), 1, 2, 3});
      },
      attend, "out overlaps v");

  // decode checks everything before it changes the cache: a rejected step appends nothing.
  const std::string decode = "KvCache::decode";
  plsh::KvCache<float> fresh(2, 1, 4, 3, slopes, good);
  std::vector<float> k_one(4, 0.2f);
  std::vector<float> v_one(3, 0.3f);
  const View q1{q.data(), 1, 2, 4};
  const View k1{k_one.data(), 1, 1, 4};
  const View v1{v_one.data(), 1, 1, 3};
  const Out out1{out.data(), 1, 2, 3};
  const auto expect_decode_rejected = [&](const View& q_arg, const View& k_arg, const View& v_arg,
                                          const Out& out_arg, const std::string& argument) {
    const Index position = fresh.position();
    expect_rejected([&] { fresh.decode(q_arg, k_arg, v_arg, out_arg); }, decode, argument);
    CHECK(fresh.position() == position);
  };
  expect_decode_rejected(q1, View{k_one.data(), 1, 1, 3}, v1, out1, "k.dim");
  expect_decode_rejected(q1, k1, View{v_one.data(), 1, 1, 2}, out1, "v.dim");
  expect_decode_rejected(q1, k1, View{v_one.data(), 0, 1, 3}, out1, "v.tokens");
  expect_decode_rejected(View{q.data(), 1, 1, 4}, k1, v1, out1, "q.heads");
  expect_decode_rejected(View{q.data(), 1, 2, 3}, k1, v1, out1, "q.dim");
  expect_decode_rejected(q1, k1, v1, Out{out.data(), 2, 2, 3}, "out.tokens");
  expect_decode_rejected(q1, k1, v1, Out{out.data(), 1, 2, 2}, "out.dim");
  expect_decode_rejected(View{q.data(), 2, 2, 4}, k1, v1, Out{out.data(), 2, 2, 3},
                         "q.tokens must equal k.tokens");
  expect_decode_rejected(q1, k1, v1, Out{out.data(), 1, 2, 3, 6, 1},
                         "out strides make rows overlap");
  expect_decode_rejected(q1, k1, v1, Out{q.data(), 1, 2, 3}, "out overlaps q");
  expect_decode_rejected(q1, k1, v1, Out{k_one.data(), 1, 1, 3}.slice(0, 1), "out.heads");
  std::vector<float> shared(8, 0.2f);
  expect_decode_rejected(q1, View{shared.data(), 1, 1, 4}, v1, Out{shared.data() + 2, 1, 2, 3},
                         "out overlaps k");
  expect_decode_rejected(q1, k1, View{shared.data(), 1, 1, 3}, Out{shared.data() + 1, 1, 2, 3},
                         "out overlaps v");
  REQUIRE_NOTHROW(fresh.decode(q1, k1, v1, out1));
  CHECK(fresh.position() == 1);
  REQUIRE_NOTHROW(fresh.decode(q1.slice(0, 0), k1.slice(0, 0), v1.slice(0, 0), out1.slice(0, 0)));
  CHECK(fresh.position() == 1);
  expect_decode_rejected(q1, k1, v1, Out{const_cast<float*>(fresh.keys().data), 1, 2, 3},
                         "out overlaps the cache's keys");
  expect_decode_rejected(q1, k1, v1, Out{const_cast<float*>(fresh.values().data), 1, 2, 3},
                         "out overlaps the cache's values");
  plsh::KvCache<float> far(2, 1, 4, 3, slopes, [] {
    plsh::PlshOptions options;
    options.key_position = plsh::kMaxPosition;
    return options;
  }());
  expect_rejected([&] { far.decode(q1, k1, v1, out1); }, decode, "kMaxPosition");
}

}  // namespace test_kv_cache_errors
