#include "core/error.hpp"

#include <cstdio>
#include <cstdlib>

namespace crosskv {

void assertion_failed(const char* expr, const char* file, int line, const std::string& msg) {
  std::fprintf(stderr, "crosskv: internal error: assertion '%s' failed at %s:%d: %s\n", expr, file, line,
               msg.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace crosskv
