#ifndef PLSH_PLSH_HPP
#define PLSH_PLSH_HPP

/// \file plsh.hpp
/// Umbrella header of plsh: attention with linear biases (ALiBi) through Positional LSH.

#include "alibi.hpp"
#include "attention/alibi_attention.hpp"
#include "attention/backward.hpp"
#include "attention/online_softmax.hpp"
#include "attention/options.hpp"
#include "attention/plsh_attention.hpp"
#include "attention/reference.hpp"
#include "attention/regular.hpp"
#include "kv_cache.hpp"
#include "limits.hpp"
#include "metrics.hpp"
#include "options.hpp"
#include "partition.hpp"
#include "sampler.hpp"
#include "tensor.hpp"

#endif  // PLSH_PLSH_HPP
