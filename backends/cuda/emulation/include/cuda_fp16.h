#pragma once
// crosskv's CUDA emulation: the binary16 subset cuda/ uses, on the compiler's _Float16 (IEEE, round to nearest even).
#include <cstring>

#include "cuda_runtime.h"

struct __half {
  unsigned short bits;
};
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.bits, 2);
  return static_cast<float>(f);
}
inline __half __float2half_rn(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  __half out;
  std::memcpy(&out.bits, &h, 2);
  return out;
}
