// The wire paths' fp8 block quantiser and dequantiser as one kernel each (alltoallv / dispatch with
// wire_dtype="fp8", DeltaExchange): the device functions of quant.cuh, whose NumPy twin bit for bit is
// cupy_symbuf/quant.py (quantize_fp8 / dequantize_fp8), replacing about a dozen CuPy elementwise kernels and their
// temporaries per call. Rows are whole 128-element blocks (hidden % 128 == 0), so a C-contiguous float32
// [rows, hidden] array is num_blocks = rows * hidden / 128 consecutive blocks: one warp per block, 4 elements per
// lane (block b is elements [128 b, 128 b + 128); its codes are bytes [128 b, 128 b + 128) of q, its scale
// scales[b]). Grid-stride over the blocks; every lane of a warp runs the same iterations (the shuffles in
// warp_amax4 need the whole warp).
#include "quant.cuh"

// q = e4m3(x * (1 / scale)), scale = quant_scale(amax of the block, ue8m0): quant.py's quantize_fp8.
extern "C" __global__ void symbuf_quant_fp8(const float* __restrict__ x, long long num_blocks, int ue8m0,
                                            u32* __restrict__ q, float* __restrict__ scales) {
  const int lane = threadIdx.x & 31;
  const long long first = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const long long step = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
  for (long long b = first; b < num_blocks; b += step) {
    const float4 v4 = reinterpret_cast<const float4*>(x + b * QUANT_BLOCK)[lane];
    const float v[4] = {v4.x, v4.y, v4.z, v4.w};
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
  unsigned short lo = static_cast<unsigned short>(h2 & 0xFFFFu), hi = static_cast<unsigned short>(h2 >> 16);
  float flo, fhi;
  asm("cvt.f32.f16 %0, %1;" : "=f"(flo) : "h"(lo));
  asm("cvt.f32.f16 %0, %1;" : "=f"(fhi) : "h"(hi));
  return make_float2(flo, fhi);
}

// out = float(q) * scale (float32 product): quant.py's dequantize_fp8.
extern "C" __global__ void symbuf_dequant_fp8(const u32* __restrict__ q, const float* __restrict__ scales,
                                              long long num_blocks, float* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const long long first = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const long long step = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
  for (long long b = first; b < num_blocks; b += step) {
    const u32 four = q[b * (QUANT_BLOCK / 4) + lane];
    const float scale = scales[b];
    const float2 a = e4m3x2_to_f32x2(static_cast<unsigned short>(four & 0xFFFFu));
    const float2 c = e4m3x2_to_f32x2(static_cast<unsigned short>(four >> 16));
    reinterpret_cast<float4*>(out + b * QUANT_BLOCK)[lane] =
        make_float4(__fmul_rn(a.x, scale), __fmul_rn(a.y, scale), __fmul_rn(c.x, scale), __fmul_rn(c.y, scale));
  }
}
