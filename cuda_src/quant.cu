// The wire paths' fp8 block quantiser and dequantiser as one kernel per element type (alltoallv / dispatch with
// wire_dtype="fp8", DeltaExchange): the device functions of quant.cuh, whose NumPy twin bit for bit is
// cupy_symbuf/collectives/quant.py (quantize_fp8 / dequantize_fp8), replacing about a dozen CuPy elementwise
// kernels and their temporaries per call. Rows are whole 128-element blocks (hidden % 128 == 0), so a C-contiguous float32
// [rows, hidden] array is num_blocks = rows * hidden / 128 consecutive blocks: one warp per block, 4 elements per
// lane (block b is elements [128 b, 128 b + 128); its codes are bytes [128 b, 128 b + 128) of q, its scale
// scales[b]). Grid-stride over the blocks; every lane of a warp runs the same iterations (the shuffles in
// warp_amax4 need the whole warp).
#include "quant.cuh"

// The element types the caller's rows may have (quant.py's _GPU_KIND): the quantiser reads them and the
// dequantiser writes them directly, so the float16 / bfloat16 wire paths need no float32 temporary.
enum ElemKind : int { kElemF32, kElemF16, kElemBf16 };

// float16 bits -> float32, exact.
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// float32 -> float16 bits, round to nearest even (CuPy's astype(float16): __float2half_rn).
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// float32 -> bfloat16 bits: dtypes.py's float32_to_bf16_bits bit for bit (round to nearest even by integer
// arithmetic; a NaN keeps its sign and top payload bits and is made quiet).
__device__ __forceinline__ u32 f32_to_bf16(float f) {
  const u32 u = __float_as_uint(f);
  if (f != f) return (u >> 16) | 0x0040u;
  return ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) & 0xFFFFu;
}

// Elements 4 * lane .. 4 * lane + 3 of 128-element block b, widened to float32 (exactly).
template <int KIND>
__device__ __forceinline__ void load4(const void* __restrict__ x, long long b, int lane, float v[4]) {
  if (KIND == kElemF32) {
    const float4 f = reinterpret_cast<const float4*>(static_cast<const float*>(x) + b * QUANT_BLOCK)[lane];
    v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
  } else {
    const uint2 w = reinterpret_cast<const uint2*>(static_cast<const unsigned short*>(x) + b * QUANT_BLOCK)[lane];
    const u32 bits[4] = {w.x & 0xFFFFu, w.x >> 16, w.y & 0xFFFFu, w.y >> 16};
#pragma unroll
    for (int i = 0; i < 4; ++i)
      v[i] = KIND == kElemF16 ? f16_to_f32(static_cast<unsigned short>(bits[i])) : __uint_as_float(bits[i] << 16);
  }
}

// The same four elements stored in the caller's type (narrowed with round to nearest even).
template <int KIND>
__device__ __forceinline__ void store4(void* __restrict__ out, long long b, int lane, const float v[4]) {
  if (KIND == kElemF32) {
    reinterpret_cast<float4*>(static_cast<float*>(out) + b * QUANT_BLOCK)[lane] = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    u32 h[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = KIND == kElemF16 ? static_cast<u32>(f32_to_f16(v[i])) : f32_to_bf16(v[i]);
    reinterpret_cast<uint2*>(static_cast<unsigned short*>(out) + b * QUANT_BLOCK)[lane] =
        make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
  }
}

// q = e4m3(x * (1 / scale)), scale = quant_scale(amax of the block, ue8m0): quant.py's quantize_fp8 of x widened
// to float32 (exact, so the codes and scales do not depend on KIND).
template <int KIND>
__device__ __forceinline__ void quant_fp8(const void* __restrict__ x, long long num_blocks, int ue8m0,
                                          u32* __restrict__ q, float* __restrict__ scales) {
  const int lane = threadIdx.x & 31;
  const long long first = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const long long step = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
  for (long long b = first; b < num_blocks; b += step) {
    float v[4];
    load4<KIND>(x, b, lane, v);
    const float scale = quant_scale(warp_amax4(v), ue8m0 != 0);
    const float inv = __fdiv_rn(1.0f, scale);
    q[b * (QUANT_BLOCK / 4) + lane] = quant4(v, inv);
    if (lane == 0) scales[b] = scale;
  }
}

// Two e4m3 bytes (lo in the low byte) -> two float32, exact (every e4m3 value is a float16; NaN stays NaN).
__device__ __forceinline__ float2 e4m3x2_to_f32x2(unsigned short two) {
  unsigned int h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(two));
  return make_float2(f16_to_f32(static_cast<unsigned short>(h2 & 0xFFFFu)),
                     f16_to_f32(static_cast<unsigned short>(h2 >> 16)));
}

// out = float(q) * scale (float32 product, then narrowed to KIND): quant.py's dequantize_fp8, then
// dtypes.from_float32.
template <int KIND>
__device__ __forceinline__ void dequant_fp8(const u32* __restrict__ q, const float* __restrict__ scales,
                                            long long num_blocks, void* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const long long first = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const long long step = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
  for (long long b = first; b < num_blocks; b += step) {
    const u32 four = q[b * (QUANT_BLOCK / 4) + lane];
    const float scale = scales[b];
    const float2 a = e4m3x2_to_f32x2(static_cast<unsigned short>(four & 0xFFFFu));
    const float2 c = e4m3x2_to_f32x2(static_cast<unsigned short>(four >> 16));
    const float v[4] = {__fmul_rn(a.x, scale), __fmul_rn(a.y, scale), __fmul_rn(c.x, scale), __fmul_rn(c.y, scale)};
    store4<KIND>(out, b, lane, v);
  }
}

// One entry point per element type (names: quant.py's _GPU_KIND); arguments: QuantArgs / DequantArgs
// (cupy_symbuf/wire/kernel_args.py).
#define SYMBUF_QUANT_ENTRY(SUFFIX, KIND)                                                                      \
  extern "C" __global__ void symbuf_quant_fp8##SUFFIX(const __grid_constant__ QuantArgs a) {                 \
    quant_fp8<KIND>(a.x, a.num_blocks, a.ue8m0, a.q, a.scales);                                               \
  }                                                                                                           \
  extern "C" __global__ void symbuf_dequant_fp8##SUFFIX(const __grid_constant__ DequantArgs a) {             \
    dequant_fp8<KIND>(a.q, a.scales, a.num_blocks, a.out);                                                    \
  }
SYMBUF_QUANT_ENTRY(, kElemF32)
SYMBUF_QUANT_ENTRY(_f16, kElemF16)
SYMBUF_QUANT_ENTRY(_bf16, kElemBf16)
