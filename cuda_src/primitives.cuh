// Memory primitives, named after the PTX they emit (the DeepEP / NCCL habit).
// Layer 1 of cuda_src/: primitives here, the memory map in layout.cuh, the ring protocol (call header, bounded
// waits, abort word, error record) in protocol.cuh, the ring's roles (send / receive chunk, direct pull, push, own
// rows, the call-header step) in ring_prims.cuh, then one .cu per kernel family.
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

// ---- bulk copies (TMA engine, sm_90 and newer) ------------------------------------------------------------------
// SYMBUF_BULK=1: a copy warp moves 16-byte aligned spans of at least SYMBUF_BULK_MIN bytes with cp.async.bulk
// through its own slice of the block's dynamic shared memory (SYMBUF_BULK_STAGES stages): lane 0 issues global ->
// shared loads that complete on an mbarrier, then shared -> global stores (bulk groups); no payload passes through
// registers, so more bytes are in flight per warp (stages x stage bytes, against SYMBUF_UNROLL x 512 B). Only where
// the kernel was launched with dynamic shared memory (the ring kernel, transport/cuda.py) and bulk_init ran; elsewhere, and
// on sm_80 (no cp.async.bulk), the register copy below. Memory ordering: fence.proxy.async before the first load
// (bytes this thread acquired through the generic proxy, e.g. a peer's ring chunk after the tail acquire, are what
// the async proxy reads) and after the last store has completed (cp.async.bulk.wait_group 0; the lanes' later
// generic accesses and lane 0's release of the done mark then come after the bulk writes).
#ifndef SYMBUF_BULK
#define SYMBUF_BULK 0
#endif
#ifndef SYMBUF_BULK_STAGES
#define SYMBUF_BULK_STAGES 3
#endif
#ifndef SYMBUF_BULK_MIN
#define SYMBUF_BULK_MIN 4096
#endif
// Only in a source that defines SYMBUF_BULK_KERNEL (ring_exchange.cu, whose ring kernel calls bulk_init).
#if SYMBUF_BULK && defined(SYMBUF_BULK_KERNEL) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define SYMBUF_BULK_ON 1
#else
#define SYMBUF_BULK_ON 0
#endif

#if SYMBUF_BULK_ON
static_assert(SYMBUF_BULK_STAGES >= 2 && SYMBUF_BULK_STAGES <= 8, "2..8 bulk stages");
extern __shared__ __align__(128) u8 g_bulk_smem[];
__shared__ __align__(8) u64 g_bulk_bar[32 * SYMBUF_BULK_STAGES];  // per warp and stage
__shared__ u32 g_bulk_parity[32];                                  // per warp: bit s = parity stage s waits for
__shared__ u32 g_bulk_stage;                                       // bytes per stage (0: no bulk copies)

__device__ __forceinline__ u32 smem_u32(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

// Once per block, every thread, before any copy (the caller synchronises the block after it).
__device__ __forceinline__ void bulk_init() {
  u32 dyn;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  const u32 warps = blockDim.x >> 5;
  const u32 stage = warps ? dyn / warps / SYMBUF_BULK_STAGES / 128 * 128 : 0;
  if (threadIdx.x == 0) g_bulk_stage = stage >= 1024 ? stage : 0;
  if ((threadIdx.x & 31) == 0 && stage >= 1024) {
    const int w = threadIdx.x >> 5;
    for (int s = 0; s < SYMBUF_BULK_STAGES; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&g_bulk_bar[w * SYMBUF_BULK_STAGES + s]))
                   : "memory");
    g_bulk_parity[w] = 0;
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
}

// One warp, lane 0 working: n bytes (a multiple of 16; dst, src 16-byte aligned global addresses).
__device__ __noinline__ void copy_bulk(u8* dst, const u8* src, i64 n, u32 stage) {
  const int w = threadIdx.x >> 5;
  u8* buf = g_bulk_smem + static_cast<u64>(w) * SYMBUF_BULK_STAGES * stage;
  const u32 bar0 = smem_u32(&g_bulk_bar[w * SYMBUF_BULK_STAGES]);
  u32 parity = g_bulk_parity[w];
  const i64 nk = (n + stage - 1) / stage;
  asm volatile("fence.proxy.async;" ::: "memory");
  for (i64 k = 0; k <= nk; ++k) {
    if (k < nk) {  // load chunk k into stage k % S, once the store of chunk k - S has read it
      const int s = static_cast<int>(k % SYMBUF_BULK_STAGES);
      const u32 bytes = static_cast<u32>(min(static_cast<i64>(stage), n - k * stage));
      asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(SYMBUF_BULK_STAGES - 2) : "memory");
      asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}"
                   ::"r"(bar0 + 8 * s), "r"(bytes) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(smem_u32(buf + static_cast<u64>(s) * stage)), "l"(__cvta_generic_to_global(src + k * stage)),
                   "r"(bytes), "r"(bar0 + 8 * s) : "memory");
    }
    if (k >= 1) {  // store chunk j = k - 1 once its load completed
      const i64 j = k - 1;
      const int s = static_cast<int>(j % SYMBUF_BULK_STAGES);
      const u32 bytes = static_cast<u32>(min(static_cast<i64>(stage), n - j * stage));
      const u32 want = (parity >> s) & 1u;
      u32 ok = 0;
      while (!ok)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(ok) : "r"(bar0 + 8 * s), "r"(want) : "memory");
      parity ^= 1u << s;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   ::"l"(__cvta_generic_to_global(dst + j * stage)), "r"(smem_u32(buf + static_cast<u64>(s) * stage)),
                   "r"(bytes) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async;" ::: "memory");
  g_bulk_parity[w] = parity;
}
#else
__device__ __forceinline__ void bulk_init() {}
#endif

// One warp copies n bytes (lane = thread index in the warp). 16-byte vectors with SYMBUF_UNROLL loads in flight
// per lane when both ends are 16-byte aligned (bytes in flight decide NVLink bandwidth), else 4-byte words, else
// bytes (14-byte rows). The warp width is a compile-time constant, so the unrolled accesses are one base address
// plus immediate offsets: the loop needs no per-access address registers (1024-thread blocks have 64 per thread).
template <bool kFromRing>
__device__ __forceinline__ void copy_bytes(u8* dst, const u8* src, i64 n, int lane) {
  constexpr int kThreads = 32;
  const u64 misalign = reinterpret_cast<u64>(dst) | reinterpret_cast<u64>(src);
  i64 done = 0;
#if SYMBUF_BULK_ON
  if ((misalign & 15) == 0 && n >= SYMBUF_BULK_MIN && g_bulk_stage != 0) {  // the TMA engine moves the span
    const i64 nb = n & ~static_cast<i64>(15);
    if (lane == 0) copy_bulk(dst, src, nb, g_bulk_stage);
    __syncwarp();  // lane 0's completed bulk stores (and its proxy fence) before every lane's next access
    if (nb == n) return;
    dst += nb, src += nb, n -= nb;
  }
#endif
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
