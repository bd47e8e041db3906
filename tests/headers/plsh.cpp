// plsh/plsh.hpp compiles on its own (it is this file's only include) and holds the module to
// compute attention only: neither the dense references nor the analysis come with it.
#include <plsh/plsh.hpp>

#if defined(PLSH_ATTENTION_REFERENCE_HPP) || defined(PLSH_REFERENCE_HPP)
#error "plsh/plsh.hpp includes the dense references: they belong to plsh/reference.hpp"
#endif
#if defined(PLSH_METRICS_HPP) || defined(PLSH_ERROR_NORMS_HPP) || defined(PLSH_ATTENTION_ERROR_HPP)
#error "plsh/plsh.hpp includes the analysis: it belongs to plsh/analysis.hpp"
#endif

// A use of the module: the declarations are complete.
void plsh_header_check_plsh(const plsh::HeadsView<const float>& q,
                            const plsh::HeadsView<float>& out) {
  plsh::plsh_attention<float>(q, q, q, out, plsh::alibi_slopes(q.heads), plsh::PlshOptions{});
}
