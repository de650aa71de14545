#include "core/memory.hpp"

#include <sys/mman.h>

#include <cstdlib>

namespace crosskv {
namespace {
constexpr size_t kBig = size_t{8} << 20;  // from here on: mapped pages
}

void* allocate_zeroed(size_t bytes) {
  if (bytes < kBig) {
    void* p = std::calloc(bytes ? bytes : 1, 1);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  madvise(p, bytes, MADV_HUGEPAGE);  // a hint: ignored where the kernel has no transparent huge pages
  return p;
}

void release_zeroed(void* p, size_t bytes) noexcept {
  if (!p) return;
  if (bytes < kBig)
    std::free(p);
  else
    munmap(p, bytes);
}

}  // namespace crosskv
