// Memory primitives, named after the PTX they emit (the DeepEP / NCCL habit).
// Layer 1 of cuda_src/: primitives here, the memory map in layout.cuh, the ring protocol (call header, bounded
// waits, abort word, error record) in protocol.cuh, one .cu per kernel family.
#pragma once

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// ---- counters (ring head/tail, notify epochs) --------------------------------------------------------------
__device__ __forceinline__ u64 ld_acquire_sys_global(const u64* ptr) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys_global(u64* ptr, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

// CTA-scope hand-off between warps of one block (generic addresses into shared memory).
__device__ __forceinline__ u64 ld_acquire_cta(const u64* ptr) {
  u64 v;
  asm volatile("ld.acquire.cta.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_cta(u64* ptr, u64 v) {
  asm volatile("st.release.cta.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

// Orders every access of this thread before the fence against every access after it, at system scope.
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ i64 ld_volatile_global(const i64* ptr) {
  i64 v;
  asm volatile("ld.volatile.global.s64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
  return v;
}

// A plain store that is not kept in a register or merged away (a word a peer reads after a later release).
__device__ __forceinline__ void st_volatile_global(i64* ptr, i64 v) {
  asm volatile("st.volatile.global.s64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

__device__ __forceinline__ u64 globaltimer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---- payload ------------------------------------------------------------------------------------------------
#ifndef SYMBUF_UNROLL
#define SYMBUF_UNROLL 8
#endif
// Source that no one writes during the kernel (the user's send buffer): non-coherent path, no L1 allocation.
__device__ __forceinline__ int4 ld_nc_global(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ u32 ld_nc_global(const u32* p) {
  u32 v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ u8 ld_nc_global(const u8* p) {
  u32 v;
  asm volatile("ld.global.nc.L1::no_allocate.u8 %0, [%1];" : "=r"(v) : "l"(p));
  return (u8)v;
}

// Ring payload written by a peer GPU during this kernel: cache at L2 only (.cg), never a stale L1 line.
__device__ __forceinline__ int4 ld_cg_global(const int4* p) {
  int4 v;
  asm volatile("ld.global.cg.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u32 ld_cg_global(const u32* p) {
  u32 v;
  asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u8 ld_cg_global(const u8* p) {
  u32 v;
  asm volatile("ld.global.cg.u8 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return (u8)v;
}

__device__ __forceinline__ void st_na_global(int4* p, int4 v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1,%2,%3,%4};"
               ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ void st_na_global(u32* p, u32 v) {
  asm volatile("st.global.L1::no_allocate.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_na_global(u8* p, u8 v) {
  asm volatile("st.global.L1::no_allocate.u8 [%0], %1;" ::"l"(p), "h"((unsigned short)v) : "memory");
}

// Load policies for copy_bytes: kFromRing selects .cg (peer-written ring) over .nc (read-only source).
template <bool kFromRing, typename T>
__device__ __forceinline__ T ld_payload(const T* p) {
  if constexpr (kFromRing) return ld_cg_global(p);
  else return ld_nc_global(p);
}

// One warp copies n bytes (lane = thread index in the warp). 16-byte vectors with SYMBUF_UNROLL loads in flight
// per lane when both ends are 16-byte aligned (bytes in flight decide NVLink bandwidth), else 4-byte words, else
// bytes (14-byte rows). The warp width is a compile-time constant, so the unrolled accesses are one base address
// plus immediate offsets: the loop needs no per-access address registers (1024-thread blocks have 64 per thread).
template <bool kFromRing>
__device__ __forceinline__ void copy_bytes(u8* dst, const u8* src, i64 n, int lane) {
  constexpr int kThreads = 32;
  const u64 misalign = reinterpret_cast<u64>(dst) | reinterpret_cast<u64>(src);
  i64 done = 0;
  if ((misalign & 15) == 0) {
    const i64 nv = n >> 4;
    constexpr int kUnroll = SYMBUF_UNROLL;  // 16 B loads in flight per lane (8: 4 KiB per warp)
    const int4* s = reinterpret_cast<const int4*>(src) + lane;
    int4* d = reinterpret_cast<int4*>(dst) + lane;
    const int4* const s_end = reinterpret_cast<const int4*>(src) + nv;
    for (; s + (kUnroll - 1) * kThreads < s_end; s += kUnroll * kThreads, d += kUnroll * kThreads) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = ld_payload<kFromRing>(s + u * kThreads);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) st_na_global(d + u * kThreads, v[u]);
    }
    for (; s < s_end; s += kThreads, d += kThreads) st_na_global(d, ld_payload<kFromRing>(s));
    done = nv << 4;
  } else if ((misalign & 3) == 0) {
    const u32* s = reinterpret_cast<const u32*>(src);
    u32* d = reinterpret_cast<u32*>(dst);
    const i64 nw = n >> 2;
    for (i64 i = lane; i < nw; i += kThreads) st_na_global(d + i, ld_payload<kFromRing>(s + i));
    done = nw << 2;
  }
  for (i64 i = done + lane; i < n; i += kThreads) st_na_global(dst + i, ld_payload<kFromRing>(src + i));
}
