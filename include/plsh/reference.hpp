#ifndef PLSH_REFERENCE_HPP
#define PLSH_REFERENCE_HPP

/// \file reference.hpp
/// plsh's reference module, namespace plsh::reference: slow, obvious, dense double references of
/// every kernel and its backward (exact, windowed and truncated ALiBi, Positional LSH with and
/// without a near field, fixed blocks), the oracles plsh's tests check the kernels against. For
/// tests: O(n_q n_k d) time per head. Self-contained; not part of plsh/plsh.hpp.

#include "attention/reference.hpp"

#endif  // PLSH_REFERENCE_HPP
