// plsh/analysis.hpp compiles on its own (it is this file's only include).
#include <plsh/analysis.hpp>

plsh::MaskError plsh_header_check_analysis(plsh::Index n, double slope) {
  return plsh::mask_error(n, slope, plsh::RandomBinning(slope).draw(4));
}
