// A user's program: it compiles against the public header and links nothing but
// plsh::plsh.
#include <plsh/plsh.hpp>

#include <cstdio>

int main() {
  const auto slopes = plsh::alibi_slopes(8);
  if (slopes.size() != 8 || slopes[0] != 0.5) {
    std::fprintf(stderr, "plsh consumer (installed): alibi_slopes(8) is wrong\n");
    return 1;
  }
  std::printf("plsh consumer (installed): alibi_slopes(8)[0] = %g\n", slopes[0]);
  return 0;
}
