#pragma once
// Large host buffers (moments, assembled fp64 systems): fresh zero pages from the kernel, on huge pages where the
// kernel allows them (the first touch of a multi-GB buffer is then several times faster: docs/PERFORMANCE.md), and
// returned to the kernel when freed. Small requests go to the ordinary heap.
#include <cstddef>
#include <new>
#include <utility>
#include <vector>

namespace crosskv {

// Zeroed memory of `bytes` (throws std::bad_alloc); release with release_zeroed(p, bytes).
void* allocate_zeroed(size_t bytes);
void release_zeroed(void* p, size_t bytes) noexcept;

// std::vector's allocator for such buffers. Elements are default-initialised (resize() writes nothing: the pages
// stay untouched, and zero, until the caller writes them).
template <class T>
struct BigAllocator {
  using value_type = T;
  BigAllocator() = default;
  template <class U>
  BigAllocator(const BigAllocator<U>&) noexcept {}
  T* allocate(size_t n) { return static_cast<T*>(allocate_zeroed(n * sizeof(T))); }
  void deallocate(T* p, size_t n) noexcept { release_zeroed(p, n * sizeof(T)); }
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  template <class U>
  bool operator==(const BigAllocator<U>&) const noexcept {
    return true;
  }
};
template <class T>
using BigVector = std::vector<T, BigAllocator<T>>;

}  // namespace crosskv
