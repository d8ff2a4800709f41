// MoE combine, the receive-side reduction (DeepEP `Buffer.combine` semantics, deep_ep/buffer.py): after the
// channel rings have brought every rank's rows back (cupy_symbuf/moe.py), out[t] = sum over ranks r in ascending
// order of back[pos[t, r]] (pos = -1: token t was not sent to r), accumulated in float32 from 0 and rounded once
// to the element type, so the result is bitwise the NumPy reference's. One template, one entry point per
// element type; elements are raw bits (no cuda_bf16.h / cuda_fp16.h needed).
#include "primitives.cuh"

struct Bf16 {  // bfloat16: the high half of a float32; narrowing rounds to nearest even, NaN stays a quiet NaN
  typedef u16 bits;
  __device__ static float load(u16 b) { return __uint_as_float(static_cast<u32>(b) << 16); }
  __device__ static u16 store(float f) {
    const u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<u16>((u >> 16) | 0x40u);
    return static_cast<u16>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};
struct F16 {  // IEEE half through the PTX conversions
  typedef u16 bits;
  __device__ static float load(u16 b) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b));
    return f;
  }
  __device__ static u16 store(float f) {
    u16 b;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(f));
    return b;
  }
};
struct F32 {
  typedef u32 bits;
  __device__ static float load(u32 b) { return __uint_as_float(b); }
  __device__ static u32 store(float f) { return __float_as_uint(f); }
};

// back [num_back, hidden], pos [num_tokens, world_size] int64, out [num_tokens, hidden]; all C-contiguous.
template <class E>
__device__ __forceinline__ void combine_reduce(const typename E::bits* __restrict__ back, const i64* __restrict__ pos,
                                               typename E::bits* __restrict__ out, i64 num_tokens, i64 hidden,
                                               int world_size) {
  for (i64 t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    const i64* pt = pos + t * world_size;
    for (i64 h = threadIdx.x; h < hidden; h += blockDim.x) {
      float acc = 0.0f;
      for (int r = 0; r < world_size; ++r) {
        const i64 p = __ldg(pt + r);
        if (p >= 0) acc = __fadd_rn(acc, E::load(back[p * hidden + h]));
      }
      out[t * hidden + h] = E::store(acc);
    }
  }
}

#define SYMBUF_COMBINE_REDUCE(NAME, E)                                                                            \
  extern "C" __global__ void NAME(const E::bits* back, const i64* pos, E::bits* out, i64 num_tokens, i64 hidden, \
                                  int world_size) {                                                               \
    combine_reduce<E>(back, pos, out, num_tokens, hidden, world_size);                                           \
  }
SYMBUF_COMBINE_REDUCE(symbuf_combine_reduce_bf16, Bf16)
SYMBUF_COMBINE_REDUCE(symbuf_combine_reduce_f16, F16)
SYMBUF_COMBINE_REDUCE(symbuf_combine_reduce_f32, F32)
