// MoE combine, the receive-side reduction (DeepEP `Buffer.combine` semantics, deep_ep/buffer.py): after the
// channel rings have brought every rank's rows back (cupy_symbuf/moe/normal.py), out[t] = sum over ranks r in ascending
// order of back[pos[t, r]] (pos = -1: token t was not sent to r), accumulated in float32 from 0 and rounded once
// to the element type, so the result is bitwise the NumPy reference's. One template, one entry point per
// element type; elements are raw bits (no cuda_bf16.h / cuda_fp16.h needed).
#include "primitives.cuh"
#include "moe_layout.cuh"

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

// Where the row of (token t, rank r) is: back[pos[t, r]] (rows returned by the ring), or, for this rank's own rows
// when self_rows is set, straight from the combine's input: self_rows[pos[t, rank] + self_delta] (the ring does not
// copy a rank's rows to itself in a combine: the reverse counts table has no units for self, see symbuf_notify;
// self_delta = recv_first[rank] - send_first[rank] from the dispatch's table). Units of T (an element or 16 bytes).
template <class T>
struct ReduceRows {
  const T* back;
  i64 row;         // units per row of back
  const T* self_rows;
  i64 self_stride;  // units between rows of self_rows
  i64 self_delta;
  int rank;
  bool skip;  // the dispatch was skipped on every rank (its table says CT_SKIP): nothing came back, sums are 0
  __device__ __forceinline__ const T* at(int r, i64 p) const {
    return (self_rows != nullptr && r == rank) ? self_rows + (p + self_delta) * self_stride : back + p * row;
  }
};

// out [num_tokens, hidden] C-contiguous, pos [num_tokens, world_size] int64: token t's row (elements).
template <class E>
__device__ __forceinline__ void combine_row(const ReduceRows<typename E::bits> src, const i64* __restrict__ pt,
                                            typename E::bits* __restrict__ out, i64 t, i64 hidden, int world_size) {
  for (i64 h = threadIdx.x; h < hidden; h += blockDim.x) {
    float acc = 0.0f;
    for (int r = 0; r < world_size; ++r) {
      const i64 p = __ldg(pt + r);
      if (p >= 0 && !src.skip) acc = __fadd_rn(acc, E::load(src.at(r, p)[h]));
    }
    out[t * hidden + h] = E::store(acc);
  }
}

// The same sum, 16 bytes per thread and load (V = 16 / sizeof(bits) elements): rows of hidden * sizeof(bits)
// bytes, a multiple of 16, 16-byte aligned arrays and row strides (the launcher checks). Same order, same rounding:
// bitwise equal.
template <class E>
__device__ __forceinline__ void combine_row_vec(const ReduceRows<uint4> src, const i64* __restrict__ pt,
                                                uint4* __restrict__ out, i64 t, i64 hvec, int world_size) {
  typedef typename E::bits B;
  constexpr int V = 16 / sizeof(B);
  for (i64 h = threadIdx.x; h < hvec; h += blockDim.x) {
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.0f;
    for (int r = 0; r < world_size; ++r) {
      const i64 p = __ldg(pt + r);
      if (p < 0 || src.skip) continue;
      const uint4 v = __ldg(src.at(r, p) + h);
      const B* e = reinterpret_cast<const B*>(&v);
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] = __fadd_rn(acc[j], E::load(e[j]));
    }
    uint4 o;
    B* e = reinterpret_cast<B*>(&o);
#pragma unroll
    for (int j = 0; j < V; ++j) e[j] = E::store(acc[j]);
    out[t * hvec + h] = o;
  }
}

// CombineReduceArgs (cupy_symbuf/wire/kernel_args.py), one launch for both parts of a combine:
//   x:       back, out (rows of E::bits), hidden (elements per row), vec != 0: the 16-byte form; self_rows (or
//            null), self_stride (elements);
//   weights: w_back, w_out (float32 rows of num_topk; w_out null: no weights), w_self_rows (or null),
//            w_self_stride (elements);
//   shared:  pos, num_tokens, world_size, table (the dispatch's counts table, read only with self rows, and its
//            skip word), rank: see ReduceRows. Block b reduces tokens b, b + gridDim.x, ...: x's row, then the
//            weights' row.
#define SYMBUF_COMBINE_REDUCE(NAME, E)                                                                            \
  extern "C" __global__ void NAME(const __grid_constant__ CombineReduceArgs a) {                                 \
    typedef E::bits B;                                                                                            \
    constexpr i64 per = 16 / sizeof(B);                                                                           \
    const bool own = a.self_rows != nullptr || a.w_self_rows != nullptr;                                          \
    const i64 delta = own ? a.table[CT_PEERS + 2 * a.world_size + a.rank] - a.table[CT_PEERS + a.rank] : 0;       \
    const bool skip = a.table != nullptr && a.table[CT_SKIP] != 0;                                                \
    const ReduceRows<B> xs{static_cast<const B*>(a.back), a.hidden, static_cast<const B*>(a.self_rows),          \
                           a.self_stride, delta, a.rank, skip};                                                   \
    const ReduceRows<uint4> xv{static_cast<const uint4*>(a.back), a.hidden / per,                                \
                               static_cast<const uint4*>(a.self_rows), a.self_stride / per, delta, a.rank, skip}; \
    const ReduceRows<u32> ws{reinterpret_cast<const u32*>(a.w_back), a.num_topk,                                 \
                             reinterpret_cast<const u32*>(a.w_self_rows), a.w_self_stride, delta, a.rank, skip};  \
    for (i64 t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {                                                  \
      const i64* pt = a.pos + t * a.world_size;                                                                   \
      if (a.vec)                                                                                                  \
        combine_row_vec<E>(xv, pt, static_cast<uint4*>(a.out), t, a.hidden / per, a.world_size);                 \
      else                                                                                                        \
        combine_row<E>(xs, pt, static_cast<B*>(a.out), t, a.hidden, a.world_size);                               \
      if (a.w_out != nullptr)                                                                                     \
        combine_row<F32>(ws, pt, reinterpret_cast<u32*>(a.w_out), t, a.num_topk, a.world_size);                  \
    }                                                                                                             \
  }
SYMBUF_COMBINE_REDUCE(symbuf_combine_reduce_bf16, Bf16)
SYMBUF_COMBINE_REDUCE(symbuf_combine_reduce_f16, F16)
SYMBUF_COMBINE_REDUCE(symbuf_combine_reduce_f32, F32)

// ---- MoE layout on the device: the body and its comment are in moe_layout.cuh ---------------------------------
extern "C" __global__ void __launch_bounds__(1024) symbuf_moe_layout(const __grid_constant__ MoeLayoutArgs a) {
  moe_layout_body(a.idx, a.num_tokens, a.num_topk, a.num_experts, a.world_size, a.per_rank, a.per_expert, a.in_rank,
                  a.meta, a.bad, a.bad_sticky, a.pos, a.send_idx);
}

// After a dispatch's row exchange: recv_gidx [rows, num_topk] (the senders' global expert ids) becomes the local
// expert index (e - first_expert, where e lives on this rank) or -1, recv_w [rows, num_topk] (optional) keeps the
// weight where the slot is local, else 0. Rows at or past the real count (table[CT_RECV_TOTAL], when table is not
// null: worst-case mode, whatever the memory held) get -1 / 0. Threads < epr also write counts_out[j] = the
// received (token, slot) pairs of local expert j (sums[1 + j], from the count exchange) rounded up to `align`.
extern "C" __global__ void symbuf_moe_recv_fixup(const __grid_constant__ MoeFixupArgs a) {
  i64* const gidx = a.gidx;
  float* const w = a.w;
  const i64* const table = a.table;
  const i64 valid = table != nullptr ? table[CT_RECV_TOTAL] : a.rows;
  const i64 n = a.rows * a.num_topk;
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<i64>(gridDim.x) * blockDim.x) {
    const bool live = i / a.num_topk < valid;
    const i64 local = gidx[i] - a.first_expert;
    const bool mine = live && gidx[i] >= 0 && local >= 0 && local < a.epr;
    gidx[i] = mine ? local : -1;
    if (w != nullptr) w[i] = mine ? w[i] : 0.0f;
  }
  if (a.counts_out != nullptr && blockIdx.x == 0) {
    const bool skip = table != nullptr && table[CT_SKIP] != 0;
    for (int j = threadIdx.x; j < a.epr; j += blockDim.x)
      a.counts_out[j] = skip ? 0 : (a.sums[1 + j] + a.align - 1) / a.align * a.align;
  }
}
