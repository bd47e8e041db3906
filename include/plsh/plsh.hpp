#ifndef PLSH_PLSH_HPP
#define PLSH_PLSH_HPP

/// \file plsh.hpp
/// Umbrella header of plsh: attention with linear biases (ALiBi) through Positional LSH.
/// error_norms.hpp and attention_error.hpp include Spectra's Lanczos solver only when its headers
/// are found (and PLSH_NO_SPECTRA is not defined): plsh builds without Spectra.

#include "alibi.hpp"
#include "attention/alibi_attention.hpp"
#include "attention/backward.hpp"
#include "attention/online_softmax.hpp"
#include "attention/options.hpp"
#include "attention/plsh_attention.hpp"
#include "attention/reference.hpp"
#include "attention/regular.hpp"
#include "attention_error.hpp"
#include "batch.hpp"
#include "error_norms.hpp"
#include "kv_cache.hpp"
#include "limits.hpp"
#include "metrics.hpp"
#include "options.hpp"
#include "partition.hpp"
#include "sampler.hpp"
#include "tensor.hpp"

#endif  // PLSH_PLSH_HPP
