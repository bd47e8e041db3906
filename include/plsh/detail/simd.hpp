#ifndef PLSH_DETAIL_SIMD_HPP
#define PLSH_DETAIL_SIMD_HPP

/// \file simd.hpp
/// The SIMD configuration of a build, decided once from the compiler's target macros. Every
/// header that has an AVX-512 path tests these macros, never the compiler's own:
/// - PLSH_FUSED_AVX512 (`__AVX512F__`): the fused kernel's walk and weighted sum
///   (OnlineSoftmax::update_counted, attention/online_softmax.hpp);
/// - PLSH_DECODE_AVX512 (`__AVX512F__`, `__AVX512BW__`, `__AVX512VL__`): the row kernels of
///   detail/decode_simd.hpp, and with PLSH_FUSED_AVX512 the causal rows of steep heads
///   (attention/arch/avx512/causal_rows.hpp);
/// - PLSH_DECODE_AVX512_BF16 (PLSH_DECODE_AVX512 and `__AVX512BF16__`): scores of bfloat16 rows by
///   `vdpbf16ps` (detail/arch/avx512/bf16_scores.hpp);
/// - PLSH_CONVERT_AVX512_F16C (`__AVX512F__` and `__F16C__`): float to half conversion of 16
///   values at a time (detail/storage.hpp).
/// Builds without them take the portable code, which the same tests check.

#if defined(__AVX512F__)
#define PLSH_FUSED_AVX512 1
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PLSH_DECODE_AVX512 1
#endif

#if defined(PLSH_DECODE_AVX512) && defined(__AVX512BF16__)
#define PLSH_DECODE_AVX512_BF16 1
#endif

#if defined(__AVX512F__) && defined(__F16C__)
#define PLSH_CONVERT_AVX512_F16C 1
#endif

#if defined(PLSH_FUSED_AVX512) || defined(PLSH_CONVERT_AVX512_F16C)
#include <immintrin.h>
#endif

#endif  // PLSH_DETAIL_SIMD_HPP
