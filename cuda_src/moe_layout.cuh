// The MoE layout's body (DeepEP `get_dispatch_layout` + the send positions of `notify_dispatch`), shared by
// symbuf_moe_layout (cuda_src/moe.cu: the layout alone, and get_dispatch_layout) and symbuf_moe_layout_notify
// (cuda_src/ring_exchange.cu: the layout and the count exchange of an eager dispatch in one launch).
#pragma once
#include "primitives.cuh"

// ---- MoE layout on the device (DeepEP `get_dispatch_layout` + the send positions of `notify_dispatch`) -----------
// One block of 1024 threads (one token per thread per tile of 1024 tokens; cheap next to the exchange for the
// batch sizes of an MoE layer, and deterministic). For idx [num_tokens, num_topk] int64 (C-contiguous; -1 = no
// expert; expert e lives on rank e / epr):
//   pass 1: per_rank[r] (int32: tokens with at least one expert on rank r), per_expert[e] (int32: (token, slot)
//           pairs), in_rank [num_tokens, world_size] (bool bytes), meta [world_size, 1 + epr] int64 (the count
//           exchange's values: [tokens to rank p, per-expert counts of p's experts]), bad[0] = values outside
//           [-1, num_experts) (ignored in the counts), bad[1] = flat index of the first one (or -1); bad_sticky
//           (host-mapped) gets the same only when there are such values and it holds none yet (the host clears it);
//   pass 2 (pos != nullptr): pos [num_tokens, world_size] int64 = row of token t in the send rows (grouped by
//           destination rank, ascending tokens within a rank) or -1, and send_idx[pos[t, r]] = t.
// Null outputs are skipped. Dynamic shared memory: num_experts int32 counters.
__device__ __forceinline__ u32 layout_mask(const i64* __restrict__ idx, i64 t, int num_topk, int num_experts, int epr,
                                           int* s_exp, int* s_bad, unsigned long long* s_bad_first, bool count) {
  u32 m = 0;
  for (int k = 0; k < num_topk; ++k) {
    const i64 e = __ldg(idx + t * num_topk + k);
    if (e >= 0 && e < num_experts) {
      m |= 1u << static_cast<int>(e / epr);
      if (count) atomicAdd(s_exp + e, 1);
    } else if (e != -1 && count) {
      atomicAdd(s_bad, 1);
      atomicMin(s_bad_first, static_cast<unsigned long long>(t * num_topk + k));
    }
  }
  return m;
}

// The whole block runs it (every thread reaches its barriers; it returns with the block's writes done and a barrier
// behind them, so a caller may read meta / bad right after it in the same block).
__device__ __forceinline__ void moe_layout_body(const i64* __restrict__ idx, const i64 num_tokens, const int num_topk,
                                                const int num_experts, const int world_size, int* const per_rank,
                                                int* const per_expert, u8* const in_rank, i64* const meta,
                                                i64* const bad, i64* const bad_sticky, i64* const pos,
                                                i64* const send_idx) {
  extern __shared__ int s_exp[];
  __shared__ int s_warp[32][MAX_PEERS];
  __shared__ i64 s_total[MAX_PEERS], s_first[MAX_PEERS], s_run[MAX_PEERS], s_tile[MAX_PEERS];
  __shared__ i64 s_woff[32][MAX_PEERS];
  __shared__ int s_bad;
  __shared__ unsigned long long s_bad_first;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int W = world_size, epr = num_experts / world_size;
  for (int e = tid; e < num_experts; e += blockDim.x) s_exp[e] = 0;
  if (tid < W) s_total[tid] = 0, s_run[tid] = 0;
  if (tid == 0) s_bad = 0, s_bad_first = ~0ull;
  __syncthreads();
  for (i64 t0 = 0; t0 < num_tokens; t0 += blockDim.x) {
    const i64 t = t0 + tid;
    const u32 m = t < num_tokens ? layout_mask(idx, t, num_topk, num_experts, epr, s_exp, &s_bad, &s_bad_first, true)
                                 : 0u;
    if (t < num_tokens && in_rank != nullptr)
      for (int r = 0; r < W; ++r) in_rank[t * W + r] = (m >> r) & 1u;
    for (int r = 0; r < W; ++r) {
      const u32 b = __ballot_sync(0xffffffffu, (m >> r) & 1u);
      if (lane == 0) s_warp[warp][r] = __popc(b);
    }
    __syncthreads();
    if (tid < W) {
      i64 acc = 0;
      for (int w = 0; w < nwarps; ++w) acc += s_warp[w][tid];
      s_total[tid] += acc;
    }
    __syncthreads();
  }
  const int M = 1 + epr;
  if (tid == 0) {
    i64 f = 0;
    for (int r = 0; r < W; ++r) s_first[r] = f, f += s_total[r];
    if (bad != nullptr) bad[0] = s_bad, bad[1] = s_bad ? static_cast<i64>(s_bad_first) : -1;
    if (bad_sticky != nullptr && s_bad && bad_sticky[0] == 0)
      bad_sticky[1] = static_cast<i64>(s_bad_first), bad_sticky[0] = s_bad;
  }
  if (tid < W) {
    if (per_rank != nullptr) per_rank[tid] = static_cast<int>(s_total[tid]);
    if (meta != nullptr) meta[tid * M] = s_total[tid];
  }
  for (int e = tid; e < num_experts; e += blockDim.x) {
    if (per_expert != nullptr) per_expert[e] = s_exp[e];
    if (meta != nullptr) meta[(e / epr) * M + 1 + e % epr] = s_exp[e];
  }
  __syncthreads();
  if (pos == nullptr) return;
  const u32 lt = (1u << lane) - 1u;
  for (i64 t0 = 0; t0 < num_tokens; t0 += blockDim.x) {
    const i64 t = t0 + tid;
    const u32 m = t < num_tokens ? layout_mask(idx, t, num_topk, num_experts, epr, nullptr, nullptr, nullptr, false)
                                 : 0u;
    for (int r = 0; r < W; ++r) {
      const u32 b = __ballot_sync(0xffffffffu, (m >> r) & 1u);
      if (lane == 0) s_warp[warp][r] = __popc(b);
    }
    __syncthreads();
    if (warp < W) {  // warp r scans the per-warp counts of rank r over the tile (lane w = warp w's count)
      const int r = warp;
      const i64 v = lane < nwarps ? s_warp[lane][r] : 0;
      i64 incl = v;
      for (int d = 1; d < 32; d <<= 1) {
        const i64 o = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += o;
      }
      if (lane < nwarps) s_woff[lane][r] = s_first[r] + s_run[r] + incl - v;
      if (lane == 31) s_tile[r] = incl;
    }
    __syncthreads();
    for (int r = 0; r < W; ++r) {
      const bool bit = (m >> r) & 1u;
      const u32 b = __ballot_sync(0xffffffffu, bit);
      if (t < num_tokens) {
        const i64 p = bit ? s_woff[warp][r] + __popc(b & lt) : -1;
        pos[t * W + r] = p;
        if (bit) send_idx[p] = t;
      }
    }
    __syncthreads();
    if (tid < W) s_run[tid] += s_tile[tid];
    __syncthreads();
  }
}
