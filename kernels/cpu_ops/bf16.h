// bfloat16 <-> float32 by their bits, scalar: the conversions every kernel file shares.
// bf16_bits rounds half to even as torch's float -> bfloat16 does (NaN -> the quiet NaN
// 0x7FC0), branch-free so that gcc vectorizes the loops that call it; bf16_float is exact.
#pragma once
#include <cstdint>
#include <cstring>

inline uint16_t bf16_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(f != f ? 0x7FC0u : r);
}

inline float bf16_float(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
