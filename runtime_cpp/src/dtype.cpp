#include "moeplug/dtype.h"

#include <stdexcept>

namespace moeplug {

DType dtype_from_code(int code, const char* what) {
  if (code == 0) return DType::kFloat32;
  if (code == 1) return DType::kBFloat16;
  throw std::invalid_argument(std::string(what) + ": dtype code " + std::to_string(code) +
                              " is unknown; expected 0 (float32) or 1 (bfloat16)");
}

}  // namespace moeplug
