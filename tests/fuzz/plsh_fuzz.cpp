// libFuzzer target: plsh's attention kernels against the dense double references, on small
// problems decoded from the fuzzer's bytes.
//
// One input is one configuration: a kernel family (Positional LSH, exact ALiBi, windowed ALiBi or
// fixed blocks); float or double; n_q, n_k in 0..24; H in 1..4 query heads over H_kv key/value
// heads (H_kv divides H); d and d_v in 1..8; s in 1..8; one slope per head from 0 to 1e300; a block
// size from 0 to INT64_MAX; causal or not; a default or explicit scale; query and key positions
// that are small, negative, near kMaxPosition = 2^53, or near INT64_MAX; packed, head-major or
// padded layouts; data from the bytes; up to three non-finite entries (NaN, +Inf, -Inf, one
// element or a whole row) in q, k or v; and a batch size B of 0, 1 or 2 for the batched
// overloads. Positional LSH also takes a near field from 0 to the smallest denormal, independent
// or Latin hypercube draws, and a query or key position moved 2^26 to 2^50 further
// (decode_estimator). One family per input keeps an execution under a millisecond or so.
//
// Checks, for the family's kernels (plsh_attention Fused and Passes and its backward;
// exact_alibi_attention and its backward; windowed_alibi_attention and its backward, against
// the references over the keys it kept; fixed_block_attention and its backward):
// - nothing crashes or hangs, the only exception is std::invalid_argument (then the kernel is
//   skipped), Fused and Passes accept the same inputs, and no
//   accepted input has a position or an end position outside [0, kMaxPosition];
// - the input contract, with "visible" meaning factor > 0 and allowed by causality, and logits
//   S = scale q.k computed here in double: a row with no visible key is zeros; a row with a NaN or
//   +Inf visible logit is NaN; a row whose visible logits are all -Inf is zeros or NaN; otherwise
//   a column is NaN where a visible key with a finite logit has a NaN value (or values of both
//   signs of infinity), non-finite where it has an infinite one, and finite elsewhere;
// - finite elements equal the dense double reference (plsh::reference) within
//   64 eps (1 + E) max|v|, E the largest |S| + |log F| among the keys that carry the row;
//   rows that see no non-finite entry equal the reference computed with every non-finite entry
//   replaced by 0 (a key a query cannot see changes nothing);
// - Fused equals Passes within twice that tolerance, with the same NaN pattern (with and without
//   a near field);
// - the backward kernels equal the dense reference backward when every input is finite; with
//   non-finite inputs, dq of rows that see no non-finite entry and dk, dv of keys seen only by such
//   rows equal the reference on the zeroed inputs; dk and dv of keys no query sees are exactly 0;
// - padding of the output views is untouched;
// - with B = 0 the batched kernels accept exactly the inputs the unbatched ones accept and write
//   nothing; with B = 2 (the element twice, through a batch stride of 0, and a zero-token batch
//   when n_q = 0) they accept the same inputs and each element of every output equals the
//   unbatched result bit for bit.
//
// A failed check prints the configuration and aborts (libFuzzer keeps the input as a crash file).
// With PLSH_FUZZ_VERBOSE set, every input prints its configuration (for replaying one file).
// Built and run by tests/fuzz/run.sh.

#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <plsh/plsh.hpp>
#include <plsh/reference.hpp>

#include "../attention_fixture.hpp"

// 0 leaves the non-finite entries out (for fuzzing a build that predates the input contract).
#ifndef PLSH_FUZZ_NONFINITE
#define PLSH_FUZZ_NONFINITE 1
#endif

namespace {

using plsh::Index;
using plsh_test::Buffer;
using plsh_test::Layout;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr Index kIndexMax = std::numeric_limits<Index>::max();

/// A non-finite entry: element (token, head, e) of tensor 0 (q), 1 (k) or 2 (v), or the whole
/// (token, head) row when `whole_row`.
struct Poison {
  int tensor;
  Index token, head, e;
  bool whole_row;
  double value;
};

/// The kernels one input runs.
enum class Family { Plsh, ExactAlibi, WindowedAlibi, FixedBlock };
constexpr int kFamilies = 4;
const char* const kFamilyNames[kFamilies] = {"plsh", "exact", "windowed", "fixed_block"};

struct Config {
  Family family = Family::Plsh;
  bool use_float = false;
  Index n_q = 0, n_k = 0, heads = 1, kv_heads = 1, dim = 1, value_dim = 1;
  std::vector<double> slopes;
  plsh::PlshOptions options;
  double window_tolerance = 0;
  Index block_size = 1;
  Layout layout = Layout::Packed;
  std::vector<Poison> poisons;
  std::uint64_t fill_seed = 0;
  Index batch = 1;  // of the batched overloads' check (check_batches); 1: not run
};

std::string describe(const Config& c) {
  std::ostringstream s;
  s.precision(17);
  s << kFamilyNames[static_cast<int>(c.family)] << ' ' << (c.use_float ? "float" : "double")
    << " n_q=" << c.n_q << " n_k=" << c.n_k << " H=" << c.heads << " H_kv=" << c.kv_heads
    << " d=" << c.dim << " d_v=" << c.value_dim << " samples=" << c.options.samples
    << " seed=" << c.options.seed << (c.options.causal ? " causal" : " bidirectional")
    << " scale=" << c.options.scale << " query_position=" << c.options.query_position
    << " key_position=" << c.options.key_position << " tolerance=" << c.window_tolerance
    << " block_size=" << c.block_size << " layout=" << c.layout << " batch=" << c.batch
    << " near_field=" << c.options.near_field
    << (c.options.sampling == plsh::Sampling::LatinHypercube ? " latin_hypercube" : " independent")
    << " slopes=";
  for (const double slope : c.slopes) s << slope << ' ';
  for (const Poison& p : c.poisons) {
    s << "\n  "
      << "qkv"[p.tensor] << (p.whole_row ? " row" : " element") << " t=" << p.token
      << " h=" << p.head << " e=" << p.e << " = " << p.value;
  }
  return s.str();
}

const Config* current_config = nullptr;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "plsh_fuzz: FAILED: %s\n  config: %s\n", what.c_str(),
               current_config ? describe(*current_config).c_str() : "?");
  std::abort();
}

/// Query and key positions: mostly small, sometimes negative, at or beyond kMaxPosition = 2^53 or
/// near INT64_MAX.
Index decode_position(FuzzedDataProvider& data) {
  const int mode = data.ConsumeIntegralInRange<int>(0, 12);
  const Index offset = data.ConsumeIntegralInRange<Index>(0, 64);
  switch (mode) {
    case 8:
      return plsh::kMaxPosition - offset;
    case 9:
      return plsh::kMaxPosition + offset;
    case 10:
      return (Index{1} << 62) + offset;
    case 11:
      return kIndexMax - offset;
    case 12:
      return -1 - offset;
    default:
      return offset;
  }
}

double decode_slope(FuzzedDataProvider& data, Index heads, Index h) {
  static const double table[] = {0,   1e-300, 1e-9, 1.0 / 256, 1.0 / 16, 0.25,
                                 0.5, 1.0,    2.0,  30.0,      1e3,      1e300};
  constexpr int count = sizeof(table) / sizeof(table[0]);
  const int pick = data.ConsumeIntegralInRange<int>(0, count + 1);
  if (pick < count) return table[pick];
  return plsh::alibi_slopes(heads)[static_cast<std::size_t>(h)];  // the standard list
}

/// The Positional LSH family's estimator, decoded after every other field (the inputs of the
/// other families decode as before): a near field from 0 to the smallest denormal (where 1 / f
/// overflows), independent or Latin hypercube draws, and one position moved 2^26 to 2^50 further
/// (far positions with the table's tiny slopes: a near field that reaches across the gap, or
/// blocks that never do).
void decode_estimator(FuzzedDataProvider& data, Config& c) {
  static const double near_fields[] = {0, 0, 0.05, 0.5, 1, 1e-300, 1e-310, 5e-324};
  c.options.near_field =
      near_fields[data.ConsumeIntegralInRange<int>(0, sizeof(near_fields) / sizeof(double) - 1)];
  if (data.ConsumeBool()) c.options.sampling = plsh::Sampling::LatinHypercube;
  static const Index gaps[] = {
      0, 0, Index{1} << 26, (Index{1} << 31) + 1, Index{1} << 32, Index{1} << 50};
  const Index gap = gaps[data.ConsumeIntegralInRange<int>(0, sizeof(gaps) / sizeof(Index) - 1)];
  Index& position = data.ConsumeBool() ? c.options.query_position : c.options.key_position;
  if (position >= 0 && position <= plsh::kMaxPosition) position += gap;
}

Config decode(FuzzedDataProvider& data) {
  Config c;
  c.family = static_cast<Family>(data.ConsumeIntegralInRange<int>(0, kFamilies - 1));
  c.use_float = data.ConsumeBool();
  c.n_q = data.ConsumeIntegralInRange<Index>(0, 24);
  c.n_k = data.ConsumeIntegralInRange<Index>(0, 24);
  c.kv_heads = data.ConsumeIntegralInRange<Index>(1, 4);
  c.heads = c.kv_heads * data.ConsumeIntegralInRange<Index>(1, 4 / c.kv_heads);
  c.dim = data.ConsumeIntegralInRange<Index>(1, 8);
  c.value_dim = data.ConsumeBool() ? c.dim : data.ConsumeIntegralInRange<Index>(1, 8);
  for (Index h = 0; h < c.heads; ++h) c.slopes.push_back(decode_slope(data, c.heads, h));
  c.options.causal = data.ConsumeBool();
  static const double scales[] = {0, 0, 0, 0.25, 0.5, 1, 2, -0.5, 1e-300, 1e30, 1e300};
  c.options.scale =
      scales[data.ConsumeIntegralInRange<int>(0, sizeof(scales) / sizeof(double) - 1)];
  c.options.query_position = decode_position(data);
  c.options.key_position = decode_position(data);
  c.options.samples = data.ConsumeIntegralInRange<Index>(1, 8);
  c.options.seed = data.ConsumeIntegralInRange<std::uint64_t>(0, 3);
  if (data.ConsumeBool()) c.options.seed = data.ConsumeIntegral<std::uint64_t>();
  // Independent draws and no near field, unless the Positional LSH family's own bytes below say
  // otherwise (the oracles draw what the kernel draws: kernel_grids).
  c.options.sampling = plsh::Sampling::Independent;
  c.options.near_field = 0;
  static const double tolerances[] = {0, 1e-6, 1e-3, 0.1, 0.5, 1};
  c.window_tolerance =
      tolerances[data.ConsumeIntegralInRange<int>(0, sizeof(tolerances) / sizeof(double) - 1)];
  static const Index block_sizes[] = {0,
                                      1,
                                      2,
                                      3,
                                      4,
                                      5,
                                      7,
                                      8,
                                      16,
                                      64,
                                      Index{1} << 26,
                                      (Index{1} << 52) + 1,
                                      plsh::kMaxPosition,
                                      kIndexMax};
  c.block_size =
      block_sizes[data.ConsumeIntegralInRange<int>(0, sizeof(block_sizes) / sizeof(Index) - 1)];
  static const Layout layouts[] = {Layout::Packed, Layout::Packed, Layout::HeadMajor,
                                   Layout::PaddedRows};
  c.layout = layouts[data.ConsumeIntegralInRange<int>(0, 3)];
  const int poisons = PLSH_FUZZ_NONFINITE ? data.ConsumeIntegralInRange<int>(0, 3) : 0;
  for (int p = 0; p < poisons; ++p) {
    Poison poison{};
    poison.tensor = data.ConsumeIntegralInRange<int>(0, 2);
    const Index tokens = poison.tensor == 0 ? c.n_q : c.n_k;
    const Index heads = poison.tensor == 0 ? c.heads : c.kv_heads;
    const Index dim = poison.tensor == 2 ? c.value_dim : c.dim;
    poison.token = data.ConsumeIntegralInRange<Index>(0, std::max<Index>(tokens - 1, 0));
    poison.head = data.ConsumeIntegralInRange<Index>(0, heads - 1);
    poison.e = data.ConsumeIntegralInRange<Index>(0, dim - 1);
    poison.whole_row = data.ConsumeBool();
    static const double values[] = {kNaN, kInf, -kInf};
    poison.value = values[data.ConsumeIntegralInRange<int>(0, 2)];
    if (tokens > 0) c.poisons.push_back(poison);
  }
  c.fill_seed = data.ConsumeIntegral<std::uint8_t>();
  c.batch = data.ConsumeIntegralInRange<Index>(0, 2);
  if (c.family == Family::Plsh) decode_estimator(data, c);
  return c;
}

/// Element values in [-4, 4) from the remaining bytes, then from CounterRandom(fill_seed).
template <class Scalar>
void fill(Buffer<Scalar>& buffer, FuzzedDataProvider& data, std::uint64_t seed) {
  const plsh::detail::CounterRandom random(seed);
  std::uint64_t counter = 0;
  const auto& view = buffer.view;
  for (Index t = 0; t < view.tokens; ++t)
    for (Index h = 0; h < view.heads; ++h)
      for (Index e = 0; e < view.dim; ++e, ++counter) {
        const double value =
            data.remaining_bytes() > 0
                ? data.ConsumeIntegral<std::int8_t>() / 32.0
                : std::floor(256 * random.unit(counter, 0)) / 32.0 - 4.0;  // same grid of values
        buffer.at(t, h, e) = static_cast<Scalar>(value);
      }
}

template <class Scalar>
void apply_poison(Buffer<Scalar>& buffer, const Poison& p) {
  for (Index e = 0; e < buffer.view.dim; ++e) {
    if (p.whole_row || e == p.e) buffer.at(p.token, p.head, e) = static_cast<Scalar>(p.value);
  }
}

/// Every non-finite element replaced by 0.
template <class Scalar>
Buffer<Scalar> zeroed(const Buffer<Scalar>& buffer) {
  Buffer<Scalar> copy = buffer;
  for (Index t = 0; t < copy.view.tokens; ++t)
    for (Index h = 0; h < copy.view.heads; ++h)
      for (Index e = 0; e < copy.view.dim; ++e)
        if (!std::isfinite(copy.at(t, h, e))) copy.at(t, h, e) = 0;
  return copy;
}

template <class Scalar>
double max_abs_finite(const Buffer<Scalar>& buffer) {
  double largest = 0;
  for (Index t = 0; t < buffer.view.tokens; ++t)
    for (Index h = 0; h < buffer.view.heads; ++h)
      for (Index e = 0; e < buffer.view.dim; ++e) {
        const double x = std::abs(static_cast<double>(buffer.at(t, h, e)));
        if (std::isfinite(x)) largest = std::max(largest, x);
      }
  return largest;
}

/// Calls `kernel()`; false when it throws std::invalid_argument (any other exception escapes and
/// ends the run).
/// The message of the last std::invalid_argument that accepts() caught.
std::string last_rejection;

template <class Kernel>
bool accepts(Kernel&& kernel) {
  try {
    kernel();
    return true;
  } catch (const std::invalid_argument& error) {
    last_rejection = error.what();
    return false;
  }
}

/// The factor of a kernel: visible (factor > 0 before causality) and log F_ij.
struct Factor {
  bool visible;
  double log_factor;
};
using FactorOf = std::function<Factor(Index h, Index query_position, Index key_position)>;

enum class RowKind { Empty, NaNRow, AllMinusInf, Regular };
enum class ColumnKind { Finite, NaNColumn, NonFinite, Unknown };

struct RowExpectation {
  RowKind kind = RowKind::Empty;
  bool clean = true;  // q_i and every visible key's k, v finite
  double tolerance = 0;
  double weight_magnitude = 0;  // E: largest |S| + |log F| among the keys that carry the row
  std::vector<ColumnKind> columns;
};

/// What the contract says about every (row, head) of one kernel's output, and which keys are
/// visible from some query (for the backward's zero gradients).
template <class Scalar>
struct Expectation {
  std::vector<RowExpectation> rows;          // [i * H + h]
  std::vector<char> key_seen;                // [j * H_kv + g]: some query sees key j
  std::vector<char> key_seen_only_by_clean;  // every row that sees key j is clean
  double weight_magnitude = 0;               // the largest E over rows
  bool any_all_minus_inf = false;            // some row has only -Inf visible logits
  Index heads = 1, kv_heads = 1;

  const RowExpectation& row(Index i, Index h) const {
    return rows[static_cast<std::size_t>(i * heads + h)];
  }
};

template <class Scalar>
Expectation<Scalar> expect(const Config& c, const Buffer<Scalar>& q, const Buffer<Scalar>& k,
                           const Buffer<Scalar>& v, const FactorOf& factor_of) {
  constexpr double eps = std::numeric_limits<Scalar>::epsilon();
  const double scale = plsh::detail::resolved_scale(c.options, c.dim);
  const Index group = c.heads / c.kv_heads;
  Expectation<Scalar> x;
  x.heads = c.heads;
  x.kv_heads = c.kv_heads;
  x.rows.resize(static_cast<std::size_t>(c.n_q * c.heads));
  x.key_seen.assign(static_cast<std::size_t>(c.n_k * c.kv_heads), 0);
  x.key_seen_only_by_clean.assign(x.key_seen.size(), 1);
  std::vector<double> logits(static_cast<std::size_t>(c.n_k));
  std::vector<double> magnitudes(logits.size());
  std::vector<char> visible(logits.size());
  for (Index i = 0; i < c.n_q; ++i) {
    const Index query_position = c.options.query_position + i;
    for (Index h = 0; h < c.heads; ++h) {
      const Index g = h / group;
      RowExpectation& row = x.rows[static_cast<std::size_t>(i * c.heads + h)];
      row.columns.assign(static_cast<std::size_t>(c.value_dim), ColumnKind::Finite);
      bool any_visible = false, nan_or_plus_inf = false, any_finite = false;
      double max_logit = -kInf;
      for (Index j = 0; j < c.n_k; ++j) {
        const Index key_position = c.options.key_position + j;
        const Factor f = factor_of(h, query_position, key_position);
        const auto jj = static_cast<std::size_t>(j);
        visible[jj] = f.visible && !(c.options.causal && key_position > query_position);
        if (!visible[jj]) continue;
        any_visible = true;
        double dot = 0, dot_abs = 0;
        for (Index e = 0; e < c.dim; ++e) {
          const double a = static_cast<double>(q.at(i, h, e));
          const double b = static_cast<double>(k.at(j, g, e));
          dot += a * b;
          dot_abs += std::abs(a * b);
        }
        logits[jj] = scale * dot + f.log_factor;
        magnitudes[jj] = std::abs(scale) * dot_abs + std::abs(f.log_factor);
        if (std::isnan(logits[jj]) || logits[jj] == kInf) nan_or_plus_inf = true;
        if (std::isfinite(logits[jj])) {
          any_finite = true;
          max_logit = std::max(max_logit, logits[jj]);
        }
        const auto cell = static_cast<std::size_t>(j * c.kv_heads + g);
        x.key_seen[cell] = 1;
        if (!row_finite(q, i, h) || !row_finite(k, j, g) || !row_finite(v, j, g)) row.clean = false;
      }
      if (!any_visible) {
        row.kind = RowKind::Empty;
      } else if (nan_or_plus_inf) {
        row.kind = RowKind::NaNRow;
      } else if (!any_finite) {
        row.kind = RowKind::AllMinusInf;
        x.any_all_minus_inf = true;
      } else {
        row.kind = RowKind::Regular;
        double value_max = 0;
        for (Index j = 0; j < c.n_k; ++j) {
          const auto jj = static_cast<std::size_t>(j);
          if (!visible[jj]) continue;
          // A logit below -max<Scalar> is -Inf in the kernel's scalar type: weight 0, and its
          // non-finite values may or may not reach the row.
          const bool carries =
              std::isfinite(logits[jj]) &&
              logits[jj] >= -static_cast<double>(std::numeric_limits<Scalar>::max());
          if (carries && logits[jj] >= max_logit - 60) {
            row.weight_magnitude = std::max(row.weight_magnitude, magnitudes[jj]);
          }
          for (Index e = 0; e < c.value_dim; ++e) {
            const double value = static_cast<double>(v.at(j, g, e));
            ColumnKind& column = row.columns[static_cast<std::size_t>(e)];
            if (std::isfinite(value)) {
              if (carries) value_max = std::max(value_max, std::abs(value));
            } else if (!carries) {
              // A -Inf logit: its weight is 0, and 0 times a non-finite value is NaN unless the
              // kernel skips the key.
              if (column == ColumnKind::Finite) column = ColumnKind::Unknown;
            } else if (std::isnan(value) || column == ColumnKind::NaNColumn) {
              column = ColumnKind::NaNColumn;
            } else if (column == ColumnKind::NonFinite || column == ColumnKind::Unknown) {
              column = ColumnKind::NonFinite;  // infinities of both signs give NaN; one sign
                                               // gives Inf, or NaN when a weight underflows
            } else {
              column = ColumnKind::NonFinite;
            }
          }
        }
        row.tolerance = 64 * eps * (1 + row.weight_magnitude) * value_max;
        x.weight_magnitude = std::max(x.weight_magnitude, row.weight_magnitude);
        // No visible logit within the range of Scalar: in the kernel's type every one is -Inf or
        // overflowed (a score beyond max<Scalar>), or kept finite only by the linear bias's shift
        // to the nearest key; which keys win is not the double reference's choice. Such a row's
        // values are not checked.
        bool any_carries = false;
        for (Index j = 0; j < c.n_k; ++j) {
          const auto jj = static_cast<std::size_t>(j);
          any_carries = any_carries ||
                        (visible[jj] && std::isfinite(logits[jj]) &&
                         logits[jj] >= -static_cast<double>(std::numeric_limits<Scalar>::max()));
        }
        if (!any_carries) row.columns.assign(row.columns.size(), ColumnKind::Unknown);
      }
      if (!row.clean) {
        for (Index j = 0; j < c.n_k; ++j) {
          if (visible[static_cast<std::size_t>(j)]) {
            x.key_seen_only_by_clean[static_cast<std::size_t>(j * c.kv_heads + g)] = 0;
          }
        }
      }
    }
  }
  return x;
}

std::string where(const char* name, Index t, Index h, Index e) {
  std::ostringstream s;
  s << name << " (t=" << t << ", h=" << h << ", e=" << e << ")";
  return s.str();
}

std::string values(double got, double want, double tolerance) {
  std::ostringstream s;
  s.precision(17);
  s << ": got " << got << ", want " << want << " (tolerance " << tolerance << ")";
  return s.str();
}

/// The kernel's output against the contract and the references: `reference` on the actual inputs,
/// `zeroed_reference` on the inputs with non-finite entries replaced by 0.
template <class Scalar>
void check_output(const char* name, const Buffer<Scalar>& out, const Buffer<Scalar>& reference,
                  const Buffer<Scalar>& zeroed_reference, const Expectation<Scalar>& x) {
  if (out.touched_padding() != 0) fail(std::string(name) + " wrote into the padding of out");
  for (Index i = 0; i < out.view.tokens; ++i)
    for (Index h = 0; h < out.view.heads; ++h) {
      const RowExpectation& row = x.row(i, h);
      const bool first_is_nan = out.view.dim > 0 && std::isnan(out.at(i, h, 0));
      for (Index e = 0; e < out.view.dim; ++e) {
        const double got = static_cast<double>(out.at(i, h, e));
        const double want = static_cast<double>(reference.at(i, h, e));
        switch (row.kind) {
          case RowKind::Empty:
            if (got != 0) fail(where(name, i, h, e) + " sees no key" + values(got, 0, 0));
            if (want != 0) fail(where("reference", i, h, e) + " sees no key" + values(want, 0, 0));
            break;
          case RowKind::NaNRow:
            if (!std::isnan(got)) {
              fail(where(name, i, h, e) + " has a NaN or +Inf visible logit" +
                   values(got, kNaN, 0));
            }
            if (!std::isnan(want)) {
              fail(where("reference", i, h, e) + " has a NaN or +Inf visible logit" +
                   values(want, kNaN, 0));
            }
            break;
          case RowKind::AllMinusInf:
            if (!(got == 0 || std::isnan(got)) || std::isnan(got) != first_is_nan) {
              fail(where(name, i, h, e) +
                   " (all visible logits -Inf) is neither a zero nor a NaN row" +
                   values(got, 0, 0));
            }
            break;
          case RowKind::Regular: {
            const ColumnKind column = row.columns[static_cast<std::size_t>(e)];
            if (column == ColumnKind::NaNColumn && !std::isnan(got)) {
              fail(where(name, i, h, e) + " averages a NaN value" + values(got, kNaN, 0));
            } else if (column == ColumnKind::NonFinite && std::isfinite(got)) {
              fail(where(name, i, h, e) + " averages an infinite value" + values(got, kInf, 0));
            } else if (column == ColumnKind::Finite) {
              const double target =
                  row.clean ? static_cast<double>(zeroed_reference.at(i, h, e)) : want;
              if (!std::isfinite(target)) {
                fail(where("reference", i, h, e) + " is not finite" + values(target, 0, 0));
              }
              if (!(std::abs(got - target) <= row.tolerance)) {
                fail(where(name, i, h, e) + " differs from the reference" +
                     values(got, target, row.tolerance));
              }
            }
            break;
          }
        }
      }
    }
}

/// Fused against Passes: within twice the reference tolerance, the same NaN pattern (except where
/// an infinite value may or may not meet an underflowed weight).
template <class Scalar>
void check_same(const Buffer<Scalar>& fused, const Buffer<Scalar>& passes,
                const Expectation<Scalar>& x) {
  for (Index i = 0; i < fused.view.tokens; ++i)
    for (Index h = 0; h < fused.view.heads; ++h) {
      const RowExpectation& row = x.row(i, h);
      for (Index e = 0; e < fused.view.dim; ++e) {
        const double a = static_cast<double>(fused.at(i, h, e));
        const double b = static_cast<double>(passes.at(i, h, e));
        const bool loose = row.kind == RowKind::Regular &&
                           (row.columns[static_cast<std::size_t>(e)] == ColumnKind::NonFinite ||
                            row.columns[static_cast<std::size_t>(e)] == ColumnKind::Unknown);
        if (loose) continue;
        if (std::isnan(a) != std::isnan(b) || std::isinf(a) != std::isinf(b)) {
          fail(where("Fused vs Passes", i, h, e) + values(a, b, 0));
        }
        if (std::isfinite(a) && !(std::abs(a - b) <= 2 * row.tolerance)) {
          fail(where("Fused vs Passes", i, h, e) + values(a, b, 2 * row.tolerance));
        }
      }
    }
}

/// Gradients of one backward kernel against the reference backward.
template <class Scalar>
void check_gradients(const char* name, const Config& c, const Buffer<Scalar>& q,
                     const Buffer<Scalar>& k, const Buffer<Scalar>& v, const Buffer<Scalar>& dout,
                     const Expectation<Scalar>& x, const std::vector<Buffer<Scalar>>& got,
                     const std::vector<Buffer<Scalar>>& want, bool all_finite) {
  constexpr double eps = std::numeric_limits<Scalar>::epsilon();
  const double scale = std::abs(plsh::detail::resolved_scale(c.options, c.dim));
  const double rows = static_cast<double>(c.n_q * (c.heads / c.kv_heads));
  const double score_gradient =
      2 * static_cast<double>(c.value_dim) * max_abs_finite(v) * max_abs_finite(dout);
  const double bounds[3] = {scale * score_gradient * max_abs_finite(k),
                            scale * rows * score_gradient * max_abs_finite(q),
                            rows * max_abs_finite(dout)};
  const char* names[3] = {"dq", "dk", "dv"};
  // A row whose visible factors all underflow to 0 (log F = -Inf) has no defined gradient.
  all_finite = all_finite && !x.any_all_minus_inf;
  for (std::size_t g = 0; g < 3; ++g) {
    if (got[g].touched_padding() != 0) fail(std::string(name) + " wrote into padding");
    const double tolerance = 64 * eps * (1 + x.weight_magnitude) * bounds[g];
    const auto& view = got[g].view;
    for (Index t = 0; t < view.tokens; ++t)
      for (Index h = 0; h < view.heads; ++h) {
        bool compare = all_finite;
        if (g == 0) {
          compare = compare || x.row(t, h).clean;
        } else {
          const auto cell = static_cast<std::size_t>(t * c.kv_heads + h);
          compare = compare ||
                    (x.key_seen_only_by_clean[cell] && row_finite(k, t, h) && row_finite(v, t, h));
          if (!x.key_seen[cell]) {
            for (Index e = 0; e < view.dim; ++e) {
              if (got[g].at(t, h, e) != 0) {
                fail(where((std::string(name) + " " + names[g]).c_str(), t, h, e) +
                     " of a key no query sees" + values(got[g].at(t, h, e), 0, 0));
              }
            }
          }
        }
        if (!compare) continue;
        for (Index e = 0; e < view.dim; ++e) {
          const double a = static_cast<double>(got[g].at(t, h, e));
          const double b = static_cast<double>(want[g].at(t, h, e));
          if (!std::isfinite(b)) {
            fail(where((std::string("reference ") + names[g]).c_str(), t, h, e) + " not finite" +
                 values(b, 0, 0));
          }
          if (!(std::abs(a - b) <= tolerance)) {
            fail(where((std::string(name) + " " + names[g]).c_str(), t, h, e) +
                 values(a, b, tolerance));
          }
        }
      }
  }
}

template <class Scalar>
struct Inputs {
  Buffer<Scalar> q, k, v, dout;
};

/// Runs `backward(q, k, v, out, dout, dq, dk, dv)` and `reference(q, k, v, dout, dq, dk, dv)`
/// (on the zeroed inputs) and compares them.
template <class Scalar, class Backward, class Reference>
void run_backward(const char* name, const Config& c, const Inputs<Scalar>& in,
                  const Inputs<Scalar>& clean, const Buffer<Scalar>& out,
                  const Expectation<Scalar>& x, bool all_finite, Backward&& backward,
                  Reference&& reference) {
  const auto gradients = [&] {
    return std::vector<Buffer<Scalar>>{Buffer<Scalar>(c.n_q, c.heads, c.dim, c.layout),
                                       Buffer<Scalar>(c.n_k, c.kv_heads, c.dim, c.layout),
                                       Buffer<Scalar>(c.n_k, c.kv_heads, c.value_dim, c.layout)};
  };
  std::vector<Buffer<Scalar>> got = gradients(), want = gradients();
  if (!accepts([&] {
        backward(in.q.in(), in.k.in(), in.v.in(), out.in(), in.dout.in(), got[0].view, got[1].view,
                 got[2].view);
      })) {
    fail(std::string(name) + " rejects what its forward accepted: " + last_rejection);
  }
  if (!accepts([&] {
        reference(clean.q.in(), clean.k.in(), clean.v.in(), clean.dout.in(), want[0].view,
                  want[1].view, want[2].view);
      })) {
    fail(std::string("reference of ") + name +
         " rejects what the kernel accepted: " + last_rejection);
  }
  check_gradients(name, c, in.q, in.k, in.v, in.dout, x, got, want, all_finite);
}

/// The family's forward kernel on views of one element (HeadsView) or of a batch
/// (BatchedHeadsView).
template <class Scalar, class In, class Out>
void family_forward(const Config& c, const In& q, const In& k, const In& v, const Out& out) {
  switch (c.family) {
    case Family::Plsh:
      return plsh::plsh_attention<Scalar>(q, k, v, out, c.slopes, c.options);
    case Family::ExactAlibi:
      return plsh::exact_alibi_attention<Scalar>(q, k, v, out, c.slopes, c.options);
    case Family::WindowedAlibi:
      return plsh::windowed_alibi_attention<Scalar>(q, k, v, out, c.slopes, c.window_tolerance,
                                                    c.options);
    case Family::FixedBlock:
      return plsh::fixed_block_attention<Scalar>(q, k, v, out, c.block_size, c.options);
  }
}

/// The family's backward kernel as family_forward; false for a family without one.
template <class Scalar, class In, class Out>
bool family_backward(const Config& c, const In& q, const In& k, const In& v, const In& out,
                     const In& dout, const Out& dq, const Out& dk, const Out& dv) {
  switch (c.family) {
    case Family::Plsh:
      plsh::plsh_attention_backward<Scalar>(q, k, v, out, dout, dq, dk, dv, c.slopes, c.options);
      return true;
    case Family::ExactAlibi:
      plsh::exact_alibi_attention_backward<Scalar>(q, k, v, out, dout, dq, dk, dv, c.slopes,
                                                   c.options);
      return true;
    case Family::FixedBlock:
      plsh::fixed_block_attention_backward<Scalar>(q, k, v, out, dout, dq, dk, dv, c.block_size,
                                                   c.options);
      return true;
    case Family::WindowedAlibi:
      return false;
  }
  return false;
}

/// `count` copies of one element: an input view with batch stride 0.
template <class Scalar>
plsh::BatchedHeadsView<const Scalar> repeated(const Buffer<Scalar>& buffer, Index count) {
  return plsh::BatchedHeadsView<const Scalar>(count, buffer.in(), 0);
}

/// An output of `count` elements shaped like `like`, and its batched view.
template <class Scalar>
struct BatchOutput {
  Buffer<Scalar> buffer;
  plsh::BatchedHeadsView<Scalar> view;

  BatchOutput(const Buffer<Scalar>& like, Index count, Layout layout)
      : buffer(like.view.tokens * count, like.view.heads, like.view.dim, layout),
        view(count, buffer.view.slice(0, like.view.tokens),
             like.view.tokens * buffer.view.token_stride) {}

  /// Fails unless element b equals `element` bit for bit, or both are NaN (the sign and payload
  /// of a NaN made by an invalid operation depend on the instruction that made it).
  void require_element(Index b, Buffer<Scalar>& element, const char* name) {
    const Index tokens = element.view.tokens;
    for (Index t = 0; t < tokens; ++t)
      for (Index h = 0; h < element.view.heads; ++h)
        for (Index e = 0; e < element.view.dim; ++e) {
          const Scalar got = buffer.at(b * tokens + t, h, e), want = element.at(t, h, e);
          if (std::memcmp(&got, &want, sizeof(Scalar)) != 0 &&
              !(std::isnan(got) && std::isnan(want))) {
            fail(where(name, t, h, e) + " of batch element " + std::to_string(b) +
                 values(got, want, 0) + " (want: one element's)");
          }
        }
  }
};

/// The batched overloads against the unbatched kernels, with the batch size of the input:
/// B = 0 accepts what one element accepts and writes nothing; B = 2 accepts the same and repeats
/// the element's result bit for bit, in the forward and the backward.
template <class Scalar>
void check_batches(const Config& c, const Buffer<Scalar>& q, const Buffer<Scalar>& k,
                   const Buffer<Scalar>& v, const Buffer<Scalar>& dout) {
  if (c.batch == 1) return;
  Buffer<Scalar> out(c.n_q, c.heads, c.value_dim, c.layout);
  const bool accepted =
      accepts([&] { family_forward<Scalar>(c, q.in(), k.in(), v.in(), out.view); });
  BatchOutput<Scalar> batched(out, c.batch, c.layout);
  const std::vector<Scalar> before = batched.buffer.storage;
  const bool batch_accepted = accepts([&] {
    family_forward<Scalar>(c, repeated(q, c.batch), repeated(k, c.batch), repeated(v, c.batch),
                           batched.view);
  });
  if (batch_accepted != accepted) {
    fail("the batched forward of B = " + std::to_string(c.batch) +
         (accepted ? " rejects what one element accepts: " + last_rejection
                   : " accepts what one element rejects"));
  }
  if (!accepted) return;
  for (Index b = 0; b < c.batch; ++b) batched.require_element(b, out, "batched forward");
  if (c.batch == 0 && batched.buffer.storage != before) fail("an empty batch wrote its output");
  Buffer<Scalar> dq(c.n_q, c.heads, c.dim, c.layout), dk(c.n_k, c.kv_heads, c.dim, c.layout),
      dv(c.n_k, c.kv_heads, c.value_dim, c.layout);
  bool has_backward = false;
  if (!accepts([&] {
        has_backward = family_backward<Scalar>(c, q.in(), k.in(), v.in(), out.in(), dout.in(),
                                               dq.view, dk.view, dv.view);
      })) {
    fail("the backward rejects what its forward accepted: " + last_rejection);
  }
  if (!has_backward) return;
  BatchOutput<Scalar> dq_batch(dq, c.batch, c.layout), dk_batch(dk, c.batch, c.layout),
      dv_batch(dv, c.batch, c.layout);
  if (!accepts([&] {
        family_backward<Scalar>(c, repeated(q, c.batch), repeated(k, c.batch), repeated(v, c.batch),
                                repeated(out, c.batch), repeated(dout, c.batch), dq_batch.view,
                                dk_batch.view, dv_batch.view);
      })) {
    fail("the batched backward rejects what one element accepts: " + last_rejection);
  }
  for (Index b = 0; b < c.batch; ++b) {
    dq_batch.require_element(b, dq, "batched dq");
    dk_batch.require_element(b, dk, "batched dk");
    dv_batch.require_element(b, dv, "batched dv");
  }
}

template <class Scalar>
void run(const Config& c, FuzzedDataProvider& data) {
  Inputs<Scalar> in{Buffer<Scalar>(c.n_q, c.heads, c.dim, c.layout),
                    Buffer<Scalar>(c.n_k, c.kv_heads, c.dim, c.layout),
                    Buffer<Scalar>(c.n_k, c.kv_heads, c.value_dim, c.layout),
                    Buffer<Scalar>(c.n_q, c.heads, c.value_dim, c.layout)};
  fill(in.q, data, c.fill_seed * 4 + 0);
  fill(in.k, data, c.fill_seed * 4 + 1);
  fill(in.v, data, c.fill_seed * 4 + 2);
  fill(in.dout, data, c.fill_seed * 4 + 3);
  for (const Poison& p : c.poisons)
    apply_poison(p.tensor == 0 ? in.q : p.tensor == 1 ? in.k : in.v, p);
  const Inputs<Scalar> clean{zeroed(in.q), zeroed(in.k), zeroed(in.v), in.dout};
  const bool all_finite = c.poisons.empty();
  check_batches(c, in.q, in.k, in.v, in.dout);

  const auto output = [&] { return Buffer<Scalar>(c.n_q, c.heads, c.value_dim, c.layout); };
  // Every position and every end `position + tokens` in [0, kMaxPosition] (overflow-free test).
  const auto positions_in_range = [&] {
    return c.options.query_position >= 0 && c.options.key_position >= 0 &&
           c.options.query_position <= plsh::kMaxPosition - c.n_q &&
           c.options.key_position <= plsh::kMaxPosition - c.n_k;
  };
  // Runs a forward kernel and its reference on the actual and the zeroed inputs; false when the
  // kernel rejects the input.
  const auto forward = [&](const char* name, Buffer<Scalar>& out, Buffer<Scalar>& reference,
                           Buffer<Scalar>& zeroed_reference, auto&& kernel, auto&& oracle) {
    if (!accepts([&] { kernel(in, out); })) return false;
    if (!positions_in_range()) {
      fail(std::string(name) + " accepts positions outside [0, kMaxPosition]");
    }
    if (!accepts([&] { oracle(in, reference); }) ||
        !(all_finite || accepts([&] { oracle(clean, zeroed_reference); }))) {
      fail(std::string("the reference of ") + name +
           " rejects what the kernel accepts: " + last_rejection);
    }
    if (all_finite) zeroed_reference = reference;
    return true;
  };
  // ALiBi relative to the row's nearest key (the kernels' bias): a row whose every m|p_i - p_j|
  // overflows double still has its nearest keys.
  const auto alibi_log_factor = plsh::reference::alibi_row_log_factor(c.slopes, c.options, c.n_k);
  const auto alibi_factor = [&](Index h, Index i, Index j) {
    return Factor{true, alibi_log_factor(h, i, j)};
  };

  switch (c.family) {
    case Family::Plsh: {
      // Positional LSH: Fused, Passes, the dense reference with the same draws, the backward.
      plsh::PlshOptions fused_options = c.options, passes_options = c.options;
      fused_options.kernel = plsh::Kernel::Fused;
      passes_options.kernel = plsh::Kernel::Passes;
      Buffer<Scalar> fused = output(), passes = output(), reference = output(),
                     zeroed_reference = output();
      const auto oracle = [&](const Inputs<Scalar>& x, Buffer<Scalar>& out) {
        plsh::reference::plsh_attention<Scalar>(x.q.in(), x.k.in(), x.v.in(), out.view, c.slopes,
                                                c.options);
      };
      const bool fused_ok = forward(
          "plsh_attention (Fused)", fused, reference, zeroed_reference,
          [&](const Inputs<Scalar>& x, Buffer<Scalar>& out) {
            plsh::plsh_attention<Scalar>(x.q.in(), x.k.in(), x.v.in(), out.view, c.slopes,
                                         fused_options);
          },
          oracle);
      const bool passes_ok = accepts([&] {
        plsh::plsh_attention<Scalar>(in.q.in(), in.k.in(), in.v.in(), passes.view, c.slopes,
                                     passes_options);
      });
      const bool near = c.options.near_field != 0;
      if (fused_ok != passes_ok) fail("Fused and Passes disagree on accepting the input");
      if (!fused_ok) return;
      const auto grids = plsh::kernel_grids(c.slopes, c.options);
      const auto log_mask = plsh::reference::mean_mask_log_factor(grids);
      const auto [first, last] = plsh::reference::call_positions(in.q.in(), in.k.in(), c.options);
      const auto log_near = plsh::reference::near_field_log_factor(
          grids, c.slopes, c.options.near_field, first, last);
      const Expectation<Scalar> x = expect(c, in.q, in.k, in.v, [&](Index h, Index i, Index j) {
        const double log_factor = near ? log_near(h, i, j) : log_mask(h, i, j);
        return Factor{log_factor > -kInf, log_factor};
      });
      check_output("plsh_attention (Fused)", fused, reference, zeroed_reference, x);
      check_output("plsh_attention (Passes)", passes, reference, zeroed_reference, x);
      check_same(fused, passes, x);
      run_backward(
          "plsh_attention_backward", c, in, clean, fused, x, all_finite,
          [&](auto q, auto k, auto v, auto out, auto dout, auto dq, auto dk, auto dv) {
            plsh::plsh_attention_backward<Scalar>(q, k, v, out, dout, dq, dk, dv, c.slopes,
                                                  c.options);
          },
          [&](auto q, auto k, auto v, auto dout, auto dq, auto dk, auto dv) {
            plsh::reference::plsh_attention_backward<Scalar>(q, k, v, dout, dq, dk, dv, c.slopes,
                                                             c.options);
          });
      return;
    }
    case Family::ExactAlibi: {
      Buffer<Scalar> out = output(), reference = output(), zeroed_reference = output();
      const bool ok = forward(
          "exact_alibi_attention", out, reference, zeroed_reference,
          [&](const Inputs<Scalar>& x, Buffer<Scalar>& o) {
            plsh::exact_alibi_attention<Scalar>(x.q.in(), x.k.in(), x.v.in(), o.view, c.slopes,
                                                c.options);
          },
          [&](const Inputs<Scalar>& x, Buffer<Scalar>& o) {
            plsh::reference::alibi_attention<Scalar>(x.q.in(), x.k.in(), x.v.in(), o.view, c.slopes,
                                                     c.options);
          });
      if (!ok) return;
      const Expectation<Scalar> x = expect(c, in.q, in.k, in.v, alibi_factor);
      check_output("exact_alibi_attention", out, reference, zeroed_reference, x);
      run_backward(
          "exact_alibi_attention_backward", c, in, clean, out, x, all_finite,
          [&](auto q, auto k, auto v, auto o, auto dout, auto dq, auto dk, auto dv) {
            plsh::exact_alibi_attention_backward<Scalar>(q, k, v, o, dout, dq, dk, dv, c.slopes,
                                                         c.options);
          },
          [&](auto q, auto k, auto v, auto dout, auto dq, auto dk, auto dv) {
            plsh::reference::alibi_attention_backward<Scalar>(q, k, v, dout, dq, dk, dv, c.slopes,
                                                              c.options);
          });
      return;
    }
    case Family::WindowedAlibi: {
      // The reference over the key rows each query tile of the kernel kept (the kernel's
      // certificate is checked against dense weights in tests/test_windowed.cpp).
      std::vector<plsh::Block> kept;
      const Index tiles = (c.n_q + plsh::detail::kQueryTile - 1) / plsh::detail::kQueryTile;
      const auto window = [&](Index h, Index p) {
        if (c.window_tolerance == 0)
          return plsh::Block{-plsh::kMaxPosition, plsh::kMaxPosition + 1};
        const Index tile = (p - c.options.query_position) / plsh::detail::kQueryTile;
        const plsh::Block rows = kept[static_cast<std::size_t>(h * tiles + tile)];
        return plsh::Block{c.options.key_position + rows.begin, c.options.key_position + rows.end};
      };
      Buffer<Scalar> out = output(), reference = output(), zeroed_reference = output();
      const bool ok = forward(
          "windowed_alibi_attention", out, reference, zeroed_reference,
          [&](const Inputs<Scalar>& x, Buffer<Scalar>& o) {
            plsh::windowed_alibi_attention<Scalar>(x.q.in(), x.k.in(), x.v.in(), o.view, c.slopes,
                                                   c.window_tolerance, c.options);
            if (c.window_tolerance > 0) {
              plsh::detail::batched_windowed_alibi_attention<Scalar>(
                  plsh::detail::batch_of_one(x.q.in()), plsh::detail::batch_of_one(x.k.in()),
                  plsh::detail::batch_of_one(x.v.in()), nullptr, c.slopes, c.window_tolerance,
                  c.options, {}, &kept);
            }
          },
          [&](const Inputs<Scalar>& x, Buffer<Scalar>& o) {
            plsh::reference::windowed_alibi_attention<Scalar>(x.q.in(), x.k.in(), x.v.in(), o.view,
                                                              c.slopes, window, c.options);
          });
      if (!ok) return;
      const Expectation<Scalar> x = expect(c, in.q, in.k, in.v, [&](Index h, Index i, Index j) {
        const plsh::Block rows = window(h, i);
        return Factor{j >= rows.begin && j < rows.end, alibi_log_factor(h, i, j)};
      });
      check_output("windowed_alibi_attention", out, reference, zeroed_reference, x);
      run_backward(
          "windowed_alibi_attention_backward", c, in, clean, out, x, all_finite,
          [&](auto q, auto k, auto v, auto o, auto dout, auto dq, auto dk, auto dv) {
            plsh::windowed_alibi_attention_backward<Scalar>(q, k, v, o, dout, dq, dk, dv, c.slopes,
                                                            c.window_tolerance, c.options);
          },
          [&](auto q, auto k, auto v, auto dout, auto dq, auto dk, auto dv) {
            plsh::reference::windowed_alibi_attention_backward<Scalar>(q, k, v, dout, dq, dk, dv,
                                                                       c.slopes, window, c.options);
          });
      return;
    }
    case Family::FixedBlock: {
      Buffer<Scalar> out = output(), reference = output(), zeroed_reference = output();
      const bool ok = forward(
          "fixed_block_attention", out, reference, zeroed_reference,
          [&](const Inputs<Scalar>& x, Buffer<Scalar>& o) {
            plsh::fixed_block_attention<Scalar>(x.q.in(), x.k.in(), x.v.in(), o.view, c.block_size,
                                                c.options);
          },
          [&](const Inputs<Scalar>& x, Buffer<Scalar>& o) {
            plsh::reference::fixed_block_attention<Scalar>(x.q.in(), x.k.in(), x.v.in(), o.view,
                                                           c.block_size, c.options);
          });
      if (!ok) return;
      // Blocks [0, b), [b, 2b), ... of absolute positions, by integer division.
      const Expectation<Scalar> x = expect(c, in.q, in.k, in.v, [&](Index, Index i, Index j) {
        return i / c.block_size == j / c.block_size ? Factor{true, 0.0} : Factor{false, -kInf};
      });
      check_output("fixed_block_attention", out, reference, zeroed_reference, x);
      run_backward(
          "fixed_block_attention_backward", c, in, clean, out, x, all_finite,
          [&](auto q, auto k, auto v, auto o, auto dout, auto dq, auto dk, auto dv) {
            plsh::fixed_block_attention_backward<Scalar>(q, k, v, o, dout, dq, dk, dv, c.block_size,
                                                         c.options);
          },
          [&](auto q, auto k, auto v, auto dout, auto dq, auto dk, auto dv) {
            plsh::reference::fixed_block_attention_backward<Scalar>(q, k, v, dout, dq, dk, dv,
                                                                    c.block_size, c.options);
          });
      return;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* bytes, std::size_t size) {
  FuzzedDataProvider data(bytes, size);
  const Config config = decode(data);
  current_config = &config;
  if (std::getenv("PLSH_FUZZ_VERBOSE") != nullptr) {
    std::fprintf(stderr, "plsh_fuzz: %s\n", describe(config).c_str());
  }
  if (config.use_float) {
    run<float>(config, data);
  } else {
    run<double>(config, data);
  }
  current_config = nullptr;
  return 0;
}
