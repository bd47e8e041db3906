// plsh/reference.hpp compiles on its own (it is this file's only include).
#include <plsh/reference.hpp>

void plsh_header_check_reference(const plsh::HeadsView<const double>& q,
                                 const plsh::HeadsView<double>& out) {
  plsh::reference::plsh_attention(q, q, q, out, std::vector<double>(q.heads, 0.5),
                                  plsh::PlshOptions{});
}
