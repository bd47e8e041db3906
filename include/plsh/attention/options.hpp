#ifndef PLSH_ATTENTION_OPTIONS_HPP
#define PLSH_ATTENTION_OPTIONS_HPP

/// \file options.hpp
/// Forwards to plsh/options.hpp, where AttentionOptions, Kernel and PlshOptions live.

#include "../options.hpp"

#endif  // PLSH_ATTENTION_OPTIONS_HPP
