#pragma once
// fp32 <-> bf16 / fp16 conversions (round to nearest even; NaN preserved).
#include <cstdint>
#include <cstring>

namespace crosskv {

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE binary16 in software (no compiler extension): round to nearest even, overflow to inf, NaN quieted.
inline uint16_t float_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint32_t o;
  if (x >= (127u + 16u) << 23) {  // >= 65536, inf or NaN
    o = x > (255u << 23) ? 0x7e00u : 0x7c00u;
  } else if (x < 113u << 23) {  // subnormal or zero in fp16: let the fp32 adder round at the right bit
    const uint32_t magic_u = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    float v, magic;
    std::memcpy(&v, &x, 4);
    std::memcpy(&magic, &magic_u, 4);
    v += magic;
    uint32_t u;
    std::memcpy(&u, &v, 4);
    o = u - magic_u;
  } else {
    const uint32_t odd = (x >> 13) & 1u;
    x += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + odd;  // rebias, round half to even
    o = x >> 13;
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    std::memcpy(&u, &v, 4);
    u |= sign;
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace crosskv
