// The one fp8 quantiser of cupy_symbuf (low-latency dispatch today; any low-precision path later). Its NumPy twin,
// bit for bit, is cupy_symbuf/collectives/quant.py (quantize_fp8 / dequantize_fp8); tests/test_low_latency.py
// checks both against ml_dtypes.float8_e4m3fn.
//
// Per block of QUANT_BLOCK = 128 consecutive elements of a row:
//   amax  = max(max |x|, 1e-4)                      (float32; the floor keeps an all-zero block finite)
//   scale = amax / 448                              (IEEE float32 division, round to nearest even)
//   ue8m0: scale = 2^ceil(log2(scale))              (round the scale UP to a power of two: exponent + 1 when any
//                                                    mantissa bit is set; scale stays >= amax / 448)
//   inv   = 1 / scale                               (IEEE float32 division)
//   q     = e4m3(x * inv)                           (float32 product, then round to nearest even, saturating to
//                                                    +-448: PTX cvt.rn.satfinite.e4m3x2.f32)
// Dequantised x' = float(q) * scale. Error bound (finite x): |x - x'| <= |x| * 2^-4 + scale * 2^-10 (half an e4m3
// ulp: 3 mantissa bits in the normal range, spacing 2^-9 in the subnormal range), plus float32 rounding of inv
// and of the product (relative 2^-23 each). With ue8m0, inv is exact.
// QUANT_BLOCK, QUANT_FP8_MAX, QUANT_AMAX_FLOOR: the generated header (cupy_symbuf/wire/protocol.py).
#pragma once
#include "primitives.cuh"

__device__ __forceinline__ float quant_scale(float amax, bool ue8m0) {
  amax = fmaxf(amax, QUANT_AMAX_FLOOR);
  float s = __fdiv_rn(amax, QUANT_FP8_MAX);
  if (ue8m0) s = __uint_as_float((__float_as_uint(s) + 0x7fffffu) & 0xff800000u);
  return s;
}

// Two float32 -> two e4m3 bytes (lo in the low byte), round to nearest even, saturating finite.
__device__ __forceinline__ u32 f32x2_to_e4m3x2(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// Four consecutive elements -> four e4m3 bytes (little endian: element 0 in the low byte).
__device__ __forceinline__ u32 quant4(const float v[4], float inv) {
  const u32 a = f32x2_to_e4m3x2(__fmul_rn(v[0], inv), __fmul_rn(v[1], inv));
  const u32 b = f32x2_to_e4m3x2(__fmul_rn(v[2], inv), __fmul_rn(v[3], inv));
  return a | (b << 16);
}

// Warp-wide amax of one 128-element block whose lane holds 4 elements.
__device__ __forceinline__ float warp_amax4(const float v[4]) {
  float m = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}
