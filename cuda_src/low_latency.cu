// Low-latency MoE dispatch / combine (DeepEP low_latency_dispatch / low_latency_combine semantics, decode sizes),
// one kernel each, no host synchronisation, graph-capturable. cupy_symbuf/moe/low_latency.py is the reference text
// (the low-latency regions, arithmetic, the NumPy twin); this file is its GPU form.
//
// Symmetric buffer of a LowLatencyBuffer (its own SymBuffer), per rank:
//   ctrl lines (LOCAL only): dispatch [-, -, exit], combine [-, -, exit]: exit counts the blocks that left, over
//   all launches (u64, only growing; a fire-and-forget red.add per block). A launch's sequence number is
//   seq = exit / grid + 1 (the previous launch on the stream has completed, so every block of it has counted).
//   dispatch halves 0/1, chosen by the parity of seq: per source rank s: a flag line [count, n_s, sig, tag, why],
//   meta int32 [N][K] (s's topk_idx, global expert ids, -1 for entries ignored like -1) and rows [N][R] (token t of
//   s at row t: the x row, or fp8 bytes + scales). count: blocks of s done with their stores into this half, over
//   all calls on this half (every block of s adds 1 per call), so call seq is complete at count == ((seq + 1) >> 1)
//   * grid. tag / why: 0 unless n_s is LL_REJECTED (then the announced token and the REJECT_* reason).
//   combine halves 0/1: per source s: weights flag [seq, n_s, sig, dispatch id, why] + float32 weights [N][K]; per
//   expert rank d: partials flag [count, 0, sig] (counted like dispatch's) + rows [N][RC] (the weighted sum of d's
//   local experts' outputs for token t, x's dtype).
// Handle agreement (combine): a dispatch's receive stores its seq (the dispatch id, the same on every rank) into its
// output set's dispatch_id word; a combine publishes the id of its handle's set in its weights line, and every rank,
// having read every rank's weights line, compares each id with its own: ids that differ make the call rejected on
// every rank alike (every rank reads the same lines; REJECT_HANDLE), before any partial is sent. Before publishing,
// block 0 compares this rank's topk_idx with the meta its handle's dispatch sent (this rank's own meta lines of that
// dispatch's half, which stay until the dispatch after the next one: as long as the handle is valid); a difference
// publishes the weights line as rejected (REJECT_TOPK), so every rank rejects the call. Nothing of this is a host
// value: CUDA-graph replays compare the ids the replayed dispatches wrote.
// Ordering: payload stores of every block, __syncthreads, then (thread 0; block 0 first writes n and sig into
// every destination's line) fence.acq_rel.sys (SYMBUF_LL_FENCE) + one red.relaxed.sys.add per destination line:
// the fence then relaxed RMW is a release pattern, and the RMWs of all blocks form one release sequence, so the
// acquire load that reads the full count synchronises with every block's stores. No block waits for another before
// publishing (no last-block round trip). Receivers poll with ld.acquire.sys inside a SpinBudget (bounded, abort
// word polled).
// Double buffering: a kernel waits for every peer's flag of its own call, so when call i+2 starts on a rank, every
// peer has finished call i and no longer reads that half.
// Rejection (the shared call protocol: a rank whose host rejected its arguments still takes part in the call): the
// rejecting rank launches the kernel with n = LL_REJECTED (no inputs). It sends no payload and publishes its flag
// lines as usual (every block counts itself), with n = LL_REJECTED, and still waits for every source's line (the
// double-buffering argument above holds for every call) without comparing the lines' signatures: its own arguments
// failed its checks, so it has no signature (its struct's sig is 0; wait_line skips the check for n = LL_REJECTED,
// as the host twin waits with sig None). Every rank sees the same lines, so every rank decides alike:
// a line marked LL_REJECTED (its signature is not checked) makes the call consume nothing; a rank that did not
// reject records the lowest rejecting rank (STATUS_REJECTED_BY: SymBufferRejectedError from synchronize()) and
// leaves empty outputs (dispatch: zero counts; combine: zero rows). Combine decides after the weights lines, before
// any partial is sent; every block of every rank still counts itself in the partials lines, so those counts stay
// at full_count(seq) for the next call on the half.
// Phases (the `phase` argument, LL_PHASE_* bits; DeepEP's send / receive split behind return_recv_hook): a call
// launches its kernel once with LL_PHASE_BOTH, or twice on one stream: LL_PHASE_SEND (dispatch: the payload and meta
// stores, then the flag-line counts that announce them; combine: A, the wait for the weights lines, B and the
// partials counts: the partial sums are made on the expert side, so combine's send already waits for the peers'
// weights, which their send launches publish first), then LL_PHASE_RECV (dispatch: the flag waits and the unpacking;
// combine: the weights lines read again (they hold seq until this rank's next call), the partials wait and C). Only
// the launch with LL_PHASE_RECV counts its blocks in LL_CTRL_EXIT, so both launches of a call read the same seq; the
// host allows one send-only launch outstanding per buffer (the next call of either kind waits for its receive),
// which keeps the double-buffering argument below.
#include "protocol.cuh"
#include "quant.cuh"

// 1: a flag line's release is fence.acq_rel.sys then the relaxed counts (block_sent), or the st.release.sys of the
// weights line alone (combine A; the __syncthreads before it orders the block's weight stores, the release is
// cumulative); 0: fence.sc.sys (__threadfence_system) in both places, for a same-run comparison. The PTX memory
// model's release pattern is a fence.sc or fence.acq_rel followed by a strong write: the acquire loads that read
// the count or the seq synchronise with it either way; the SC fence adds a total order nothing here needs.
#ifndef SYMBUF_LL_FENCE
#define SYMBUF_LL_FENCE 1
#endif
// 1: a one-launch dispatch without fp8 reads this rank's own tokens from x in its receive instead of storing them
// into its own staging rows first (dispatch_body); 0: through the staging rows like every other source's.
#ifndef SYMBUF_LL_SELF
#define SYMBUF_LL_SELF 1
#endif

// Kernel arguments: LLDispatchArgs / LLCombineArgs (cupy_symbuf/wire/kernel_args.py, generated), every field an
// i64 word, passed by value.
// prof: 0, or a device array u64 [grid][LL_PROF_STAMPS]: thread 0 of each block stores %globaltimer at the phase
// boundaries (dispatch: start, sent, flags seen, layout built, end; combine: start, weights seen, partials sent,
// partials seen, end). bench_low_latency(profile=True) reads it.
// LL_CTRL_EXIT, LL_LINE_SEQ / LL_LINE_N / LL_LINE_SIG, LL_SEG_ELEMS, LL_KIND_*: the generated header
// (cupy_symbuf/wire/protocol.py).

template <class T>
__device__ __forceinline__ T* at(i64 base, i64 off) { return reinterpret_cast<T*>(base + off); }

// ---- element types (raw bits; no cuda_bf16.h) --------------------------------------------------------------------
__device__ __forceinline__ float bf16_load(u32 b) { return __uint_as_float(b << 16); }
__device__ __forceinline__ u32 bf16_store(float f) {  // round to nearest even, NaN stays a quiet NaN
  const u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ float f16_load(u32 b) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<unsigned short>(b)));
  return f;
}
__device__ __forceinline__ u32 f16_store(float f) {
  unsigned short b;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(f));
  return b;
}
// kind: LL_KIND_BF16, LL_KIND_F16, LL_KIND_F32. Elements of a 16-byte vector: 8, 8, 4.
template <int KIND>
struct Elem {
  static constexpr int kPerVec = KIND == LL_KIND_F32 ? 4 : 8;
  __device__ static void unpack(const int4& v, float* f) {
    const u32 w[4] = {static_cast<u32>(v.x), static_cast<u32>(v.y), static_cast<u32>(v.z), static_cast<u32>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (KIND == LL_KIND_F32) {
        f[i] = __uint_as_float(w[i]);
      } else if constexpr (KIND == LL_KIND_BF16) {
        f[2 * i] = bf16_load(w[i] & 0xffffu), f[2 * i + 1] = bf16_load(w[i] >> 16);
      } else {
        f[2 * i] = f16_load(w[i] & 0xffffu), f[2 * i + 1] = f16_load(w[i] >> 16);
      }
    }
  }
  __device__ static int4 pack(const float* f) {
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (KIND == LL_KIND_F32) w[i] = __float_as_uint(f[i]);
      else if constexpr (KIND == LL_KIND_BF16) w[i] = bf16_store(f[2 * i]) | (bf16_store(f[2 * i + 1]) << 16);
      else w[i] = f16_store(f[2 * i]) | (f16_store(f[2 * i + 1]) << 16);
    }
    return make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]), static_cast<int>(w[3]));
  }
};

// Four elements starting at element i of a row (for the quantiser).
template <int KIND>
__device__ __forceinline__ void load4(const u8* row, i64 i, float v[4]) {
  if constexpr (KIND == LL_KIND_F32) {
    const int4 q = ld_nc_global(reinterpret_cast<const int4*>(row + 4 * i));
    v[0] = __int_as_float(q.x), v[1] = __int_as_float(q.y), v[2] = __int_as_float(q.z), v[3] = __int_as_float(q.w);
  } else {
    const u32* p = reinterpret_cast<const u32*>(row + 2 * i);
    const u32 a = ld_nc_global(p), b = ld_nc_global(p + 1);
    if constexpr (KIND == LL_KIND_BF16)
      v[0] = bf16_load(a & 0xffffu), v[1] = bf16_load(a >> 16), v[2] = bf16_load(b & 0xffffu),
      v[3] = bf16_load(b >> 16);
    else v[0] = f16_load(a & 0xffffu), v[1] = f16_load(a >> 16), v[2] = f16_load(b & 0xffffu), v[3] = f16_load(b >> 16);
  }
}

// ---- flags and counters ----------------------------------------------------------------------------------------------
// Word w (LL_LINE_*) of a flag line, after the wait that acquired the line's seq.
__device__ __forceinline__ i64 line_word(const u64* line, int w) {
  return ld_volatile_global(reinterpret_cast<const i64*>(line) + w);
}

// Wait until flag line `line` holds `seq` (a sequence number or a block count), then read its n word into *ns; a
// line whose n is not LL_REJECTED must carry the signature `sig`, unless `n` (the waiting rank's own n) is
// LL_REJECTED: a rank that rejected its call has no signature to compare (its arguments failed its checks; the
// host twin waits with sig None alike), so it only counts the lines. False when the wait failed (timeout, abort:
// recorded) or on a protocol mismatch (a line ahead of seq, another signature: recorded, abort word set).
__device__ __noinline__ bool wait_line(const WaitCtx* c, int peer, const u64* line, u64 seq, i64 sig, i64 n,
                                       i64* ns) {
  SpinBudget spin(c);
  while (true) {
    const u64 v = ld_acquire_sys_global(line + LL_LINE_SEQ);
    if (v == seq) break;
    if (v > seq) {
      fail(*c, ROLE_RECV, peer, static_cast<i64>(seq), static_cast<i64>(v), ERR_MISMATCH, FIELD_SEQ);
      return false;
    }
    if (!spin.ok(ROLE_RECV, peer, seq, v)) return false;
  }
  *ns = ld_volatile_global(reinterpret_cast<const i64*>(line) + LL_LINE_N);
  if (*ns == LL_REJECTED || n == LL_REJECTED) return true;
  const i64 got = ld_volatile_global(reinterpret_cast<const i64*>(line) + LL_LINE_SIG);
  if (got != sig) {
    fail(*c, ROLE_RECV, peer, sig, got, ERR_MISMATCH, FIELD_SIG);
    return false;
  }
  return true;
}

// Block done with its stores into every destination's half: count it in each destination's line `me` (block 0
// first stores n, sig, tag and why there). Thread 0 only, after a __syncthreads that follows the block's stores.
__device__ __forceinline__ void block_sent(const u64* ll_bases, i64 line_off, int me, int W, i64 n, i64 sig,
                                           i64 tag, i64 why) {
  if (blockIdx.x == 0) {
    for (int r = 0; r < W; ++r) {
      volatile i64* w = reinterpret_cast<volatile i64*>(ll_bases[r] + line_off + static_cast<i64>(me) * LINE_BYTES);
      w[LL_LINE_N] = n;
      w[LL_LINE_SIG] = sig;
      w[LL_LINE_TAG] = tag;
      w[LL_LINE_WHY] = why;
    }
  }
#if SYMBUF_LL_FENCE
  fence_acq_rel_sys();  // the block's stores (ordered before by bar.sync) and n/sig before the counts
#else
  __threadfence_system();  // (fence.sc.sys)
#endif
  for (int r = 0; r < W; ++r) {
    u64* line = reinterpret_cast<u64*>(ll_bases[r] + line_off + static_cast<i64>(me) * LINE_BYTES);
    asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(line + LL_LINE_SEQ), "l"(1ull) : "memory");
  }
}

// Block leaving: count it (no return value awaited). Thread 0 only, after a __syncthreads.
__device__ __forceinline__ void block_exit(u64* ctrl) {
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(ctrl + LL_CTRL_EXIT), "l"(1ull) : "memory");
}

// This launch's sequence number (1, 2, ...): the launches before it on the stream have completed.
__device__ __forceinline__ u64 read_seq(const u64* ctrl, i64 grid) {
  return static_cast<u64>(ld_volatile_global(reinterpret_cast<const i64*>(ctrl) + LL_CTRL_EXIT)) /
             static_cast<u64>(grid) + 1;
}

// Block count that completes call `seq` on its half.
__device__ __forceinline__ u64 full_count(u64 seq, i64 grid) { return ((seq + 1) >> 1) * static_cast<u64>(grid); }

__device__ __forceinline__ void prof_stamp(i64 prof, int k) {
  if (prof && threadIdx.x == 0) reinterpret_cast<u64*>(prof)[blockIdx.x * LL_PROF_STAMPS + k] = globaltimer_ns();
}

// Rank of expert id e (or -1 when e is -1 or out of range: ignored like -1).
__device__ __forceinline__ int expert_rank(i64 e, i64 L, i64 W) { return (e < 0 || e >= L * W) ? -1 : int(e / L); }

// ---- the common set-up of both kernels ------------------------------------------------------------------------------
// Per block, in shared memory: the wait context, this launch's sequence number, and the verdict of the flag waits
// (fail: a wait failed, recorded: leave without counting the block; rejected: the lowest rank whose line said
// LL_REJECTED or, combine, carried another dispatch id, or MAX_PEERS for none; why / theirs: per such rank the
// REJECT_* reason and its word (the announced token, the other dispatch id); own: this rank's dispatch id).
struct LLBlockState {
  WaitCtx ctx;
  u64 seq;
  int fail;
  int rejected;
  i64 own;
  int why[MAX_PEERS];
  i64 theirs[MAX_PEERS];
};
// What every thread derives from the arguments: the block state, the launch's sequence number and the half it
// selects, the warp coordinates of the grid-stride loops.
struct LLLaunch {
  LLBlockState* sh;
  const u64* ll_bases;
  u64* ctrl;
  u64 seq;
  i64 half;
  int W, me, lane;
  i64 gwarp, total_warps;
};

// Args: LLDispatchArgs or LLCombineArgs (the fields of the same names). Every thread calls it once, first.
template <class Args>
__device__ __forceinline__ LLLaunch ll_prologue(const Args& a) {
  __shared__ LLBlockState sh;
  const int W = static_cast<int>(a.W), me = static_cast<int>(a.rank);
  u64* ctrl = reinterpret_cast<u64*>(a.ctrl);
  if (threadIdx.x == 0) {
    sh.seq = read_seq(ctrl, a.grid);
    sh.ctx = make_wait_ctx(reinterpret_cast<i64*>(a.status), reinterpret_cast<const u64*>(a.comm_bases), me, W, -1,
                           a.abort_offset, static_cast<u64>(a.timeout_ns), static_cast<u64>(a.launch_seq));
    sh.fail = 0;
    sh.rejected = MAX_PEERS;
    sh.own = 0;
  }
  __syncthreads();
  LLLaunch l;
  l.sh = &sh;
  l.ll_bases = reinterpret_cast<const u64*>(a.ll_bases);
  l.ctrl = ctrl;
  l.seq = sh.seq;
  l.half = a.half0 + static_cast<i64>(l.seq & 1) * a.half_bytes;
  l.W = W, l.me = me, l.lane = threadIdx.x & 31;
  const i64 warps = static_cast<i64>(blockDim.x >> 5);
  l.gwarp = blockIdx.x * warps + (threadIdx.x >> 5);
  l.total_warps = a.grid * warps;
  return l;
}

// The call is rejected because of source `s` (reason why, its word theirs): noted; the lowest rank wins. Thread s.
__device__ __forceinline__ void note_rejection(LLBlockState* sh, int s, int why, i64 theirs) {
  sh->why[s] = why;
  sh->theirs[s] = theirs;
  atomicMin(&sh->rejected, s);
}

// Source `s`'s flag line `line` said n = ns: a rejection is noted with the reason and token the line carries.
__device__ __forceinline__ void note_line(LLBlockState* sh, int s, i64 ns, const u64* line) {
  if (ns == LL_REJECTED)
    note_rejection(sh, s, static_cast<int>(line_word(line, LL_LINE_WHY)), line_word(line, LL_LINE_TAG));
}

// A rank rejected this call (sh->rejected < MAX_PEERS, after the __syncthreads that follows the waits): a rank that
// did not reject itself (n >= 0) records it with its reason (block 0); the caller then leaves empty outputs and
// counts the block.
__device__ __forceinline__ bool call_rejected(const LLLaunch& l, i64 n) {
  const int who = l.sh->rejected;
  if (who >= MAX_PEERS) return false;
  if (n >= 0 && blockIdx.x == 0 && threadIdx.x == 0)
    record_rejection(l.sh->ctx, who, l.sh->why[who], l.sh->own, l.sh->theirs[who]);
  return true;
}

// ---- dispatch --------------------------------------------------------------------------------------------------------
// Send: work item (token t, segment g of LL_SEG_ELEMS elements), one warp each: the destinations of t are the
// ranks of its experts; the segment is read once and stored into every destination's row t of source `rank`
// (fp8: quantised once, bytes then the block scales at row + H). Segment 0 also writes t's topk_idx (int32).
// Receive: every block builds, in shared memory, bit masks mask[local expert][source][token] from all sources'
// meta, and prefix counts base[e][s] (rows of expert e from sources before s): recv_x[e] holds its rows ordered by
// (source rank, token index). Work item (entry (s, t, j), segment): the first j of token t naming local expert e
// copies that segment of staging row (s, t) to recv_x[e][pos]; every j naming e gets inv[s][t][j] = e * W * N + pos.
template <int KIND>
__device__ void dispatch_body(const LLDispatchArgs& a, u32* smem) {
  const LLLaunch l = ll_prologue(a);
  LLBlockState* sh = l.sh;
  const int W = l.W, me = l.me, lane = l.lane, K = static_cast<int>(a.k);
  const i64 N = a.N, H = a.H, L = a.L, n = a.n, R = a.row_bytes;
  const u64* ll_bases = l.ll_bases;
  const u64 seq = l.seq;
  const i64 half = l.half, gwarp = l.gwarp, total_warps = l.total_warps;
  __shared__ int s_ntok[MAX_PEERS];
  const i64 elem = KIND == LL_KIND_F32 ? 4 : 2;
  const i64 segs = (H + LL_SEG_ELEMS - 1) / LL_SEG_ELEMS;
  const i64* topk = reinterpret_cast<const i64*>(a.topk);
#if SYMBUF_LL_SELF
  // One launch (LL_PHASE_BOTH), no fp8: this rank's own tokens are not stored into its own staging rows; the
  // receive reads them from x (this launch's input, unchanged until it ends): 1.8 MB less written a rank at 128 x
  // 7168 bf16. (A send-only launch stores them: the caller may reuse x before the receive launch.)
  const bool self_from_x = a.phase == LL_PHASE_BOTH && !a.use_fp8;
#else
  constexpr bool self_from_x = false;
#endif

  // ---- send ----
  prof_stamp(a.prof, 0);
  for (i64 item = gwarp; item < ((a.phase & LL_PHASE_SEND) ? n * segs : 0); item += total_warps) {
    const i64 t = item / segs, g = item % segs;
    const i64 lo = g * LL_SEG_ELEMS, hi = lo + LL_SEG_ELEMS < H ? lo + LL_SEG_ELEMS : H;
    const u8* src = reinterpret_cast<const u8*>(a.x) + t * a.x_stride;
    // the segment's loads first (they do not depend on topk_idx): one memory latency per item, not two
    constexpr int kVec = LL_SEG_ELEMS * (KIND == LL_KIND_F32 ? 4 : 2) / 16 / 32;  // 16-byte vectors per lane
    int4 v[kVec];
    const i64 nvec = (hi - lo) * elem / 16;
    if (!a.use_fp8) {
      const int4* s4 = reinterpret_cast<const int4*>(src + lo * elem);
#pragma unroll
      for (int u = 0; u < kVec; ++u)
        if (lane + u * 32 < nvec) v[u] = ld_nc_global(s4 + lane + u * 32);
    }
    const i64 e = lane < K ? topk[t * K + lane] : -1;
    const int r = expert_rank(e, L, a.W);
    const u32 dests = __reduce_or_sync(0xffffffffu, r >= 0 ? (1u << r) : 0u);
    if (g == 0 && lane < K) {  // (an entry ignored like -1 travels as -1)
      for (int d = 0; d < W; ++d)
        *at<int>(ll_bases[d], half + a.meta_off + ((static_cast<i64>(me) * N + t) * K + lane) * 4) =
            r >= 0 ? static_cast<int>(e) : -1;
    }
    if (!dests) continue;
    const i64 row_off = half + a.rows_off + (static_cast<i64>(me) * N + t) * R;
    if (!a.use_fp8) {
      // the segment loaded once (above), then a store per destination
      for (int d = 0; d < W; ++d) {
        if (!(dests >> d & 1) || (self_from_x && d == me)) continue;
        int4* d4 = at<int4>(ll_bases[d], row_off + lo * elem);
#pragma unroll
        for (int u = 0; u < kVec; ++u)
          if (lane + u * 32 < nvec) st_na_global(d4 + lane + u * 32, v[u]);
      }
    } else {
      constexpr int kBlocks = LL_SEG_ELEMS / QUANT_BLOCK;
      float fv[kBlocks][4];
      const int nb = static_cast<int>((hi - lo) / QUANT_BLOCK);
#pragma unroll
      for (int b = 0; b < kBlocks; ++b)
        if (b < nb) load4<KIND>(src, lo + b * QUANT_BLOCK + lane * 4, fv[b]);
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
        if (b >= nb) break;
        const float scale = quant_scale(warp_amax4(fv[b]), a.ue8m0 != 0);
        const float inv = __fdiv_rn(1.0f, scale);
        const u32 q = quant4(fv[b], inv);
        const i64 blk = lo / QUANT_BLOCK + b;
        for (int d = 0; d < W; ++d) {
          if (!(dests >> d & 1)) continue;
          st_na_global(at<u32>(ll_bases[d], row_off + lo + b * QUANT_BLOCK + lane * 4), q);
          if (lane == 0) st_na_global(at<u32>(ll_bases[d], row_off + H + blk * 4), __float_as_uint(scale));
        }
      }
    }
  }
  if (a.phase & LL_PHASE_SEND) {
    __syncthreads();
    if (threadIdx.x == 0) block_sent(ll_bases, half + a.flags_off, me, W, n, a.sig, a.tag, a.why);
    prof_stamp(a.prof, 1);
  }
  if (!(a.phase & LL_PHASE_RECV)) return;  // a send-only launch does not count its blocks (the receive will)

  // ---- receive ----
  if (threadIdx.x < W) {
    const int s = threadIdx.x;
    const u64* line = at<u64>(ll_bases[me], half + a.flags_off + static_cast<i64>(s) * LINE_BYTES);
    i64 ns = 0;
    if (!wait_line(&sh->ctx, s, line, full_count(seq, a.grid), a.sig, n, &ns)) sh->fail = 1;
    else if (ns != LL_REJECTED && (ns < 0 || ns > N)) {
      fail(sh->ctx, ROLE_RECV, s, N, ns, ERR_MISMATCH, FIELD_UNITS);
      sh->fail = 1;
    }
    note_line(sh, s, ns, line);
    s_ntok[s] = static_cast<int>(ns);
  }
  const i64 NW = (N + 31) / 32;
  u32* mask = smem;                                         // [L][W][NW]
  int* base = reinterpret_cast<int*>(smem + L * W * NW);    // [L][W]
  for (i64 i = threadIdx.x; i < L * W * NW; i += blockDim.x) mask[i] = 0;
  __syncthreads();
  if (sh->fail) return;
  if (call_rejected(l, n)) {  // nothing consumed; a rank that did not reject returns zero counts
    if (n >= 0 && blockIdx.x == 0) {
      for (i64 i = threadIdx.x; i < L * W; i += blockDim.x) reinterpret_cast<i64*>(a.layout_range)[i] = 0;
      for (i64 i = threadIdx.x; i < L; i += blockDim.x) reinterpret_cast<int*>(a.recv_count)[i] = 0;
      if (threadIdx.x < W) reinterpret_cast<int*>(a.recv_ntok)[threadIdx.x] = 0;
      // -seq: the id of a rejected dispatch, so a combine with its handle publishes a rejected line (below)
      if (threadIdx.x == 0) *reinterpret_cast<i64*>(a.dispatch_id) = -static_cast<i64>(seq);
    }
    __syncthreads();
    if (threadIdx.x == 0) block_exit(l.ctrl);
    return;
  }
  prof_stamp(a.prof, 2);
  const int* meta = at<int>(ll_bases[me], half + a.meta_off);
  constexpr int kBatch = 4;  // meta loads in flight per thread
  for (i64 i0 = threadIdx.x; i0 < W * N * K; i0 += kBatch * blockDim.x) {
    int ev[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const i64 i = i0 + b * blockDim.x;
      ev[b] = i < W * N * K && (i / K) % N < s_ntok[i / (N * K)]
                  ? static_cast<int>(ld_cg_global(reinterpret_cast<const u32*>(meta + i))) : -1;
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const i64 i = i0 + b * blockDim.x;
      if (ev[b] < 0 || expert_rank(ev[b], L, a.W) != me) continue;
      const i64 s = i / (N * K), t = (i / K) % N;
      atomicOr(mask + ((ev[b] - me * L) * W + s) * NW + t / 32, 1u << (t % 32));
    }
  }
  __syncthreads();
  for (i64 el = threadIdx.x; el < L; el += blockDim.x) {
    int acc = 0;
    for (int s = 0; s < W; ++s) {
      base[el * W + s] = acc;
      int c = 0;
      for (i64 w = 0; w < NW; ++w) c += __popc(mask[(el * W + s) * NW + w]);
      if (blockIdx.x == 0) reinterpret_cast<i64*>(a.layout_range)[el * W + s] = (static_cast<i64>(acc) << 32) | c;
      acc += c;
    }
    if (blockIdx.x == 0) reinterpret_cast<int*>(a.recv_count)[el] = acc;
  }
  if (blockIdx.x == 0 && threadIdx.x < W) reinterpret_cast<int*>(a.recv_ntok)[threadIdx.x] = s_ntok[threadIdx.x];
  if (blockIdx.x == 0 && threadIdx.x == 0) *reinterpret_cast<i64*>(a.dispatch_id) = static_cast<i64>(seq);
  __syncthreads();
  prof_stamp(a.prof, 3);
  // copies: work item (source s, token t, 4 KB segment of its staging row), one warp: lanes j < K read t's meta,
  // the first lane naming each local expert computes its row; the segment is read once and stored into every one of
  // those rows (fp8: the last segment is the scales).
  const i64 RB = a.use_fp8 ? H : H * elem;
  constexpr i64 kSegB = 4096;
  const i64 bsegs = (RB + kSegB - 1) / kSegB + (a.use_fp8 ? 1 : 0);
  const i64 WN = static_cast<i64>(W) * N;
  for (i64 item = gwarp; item < WN * bsegs; item += total_warps) {
    const i64 st = item / bsegs, g = item % bsegs, s = st / N, t = st % N;
    if (t >= s_ntok[s]) continue;
    const u8* srow = self_from_x && s == me ? reinterpret_cast<const u8*>(a.x) + t * a.x_stride
                                            : at<u8>(ll_bases[me], half + a.rows_off + st * R);
    // the segment's loads first, with the meta load (independent): one memory latency per item
    constexpr int kVec = kSegB / 16 / 32;
    const bool scales_seg = a.use_fp8 && g == bsegs - 1;
    const i64 off = g * kSegB, nvec = scales_seg ? 0 : ((RB - off < kSegB) ? RB - off : kSegB) / 16;
    const int4* s4 = reinterpret_cast<const int4*>(srow + off);
    int4 v[kVec];
#pragma unroll
    for (int u = 0; u < kVec; ++u)
      if (lane + u * 32 < nvec) v[u] = ld_cg_global(s4 + lane + u * 32);
    const int e = lane < K ? static_cast<int>(ld_cg_global(reinterpret_cast<const u32*>(meta + st * K + lane))) : -1;
    const bool local = lane < K && expert_rank(e, L, a.W) == me;
    bool first = local;
    for (int jj = 0; jj < K; ++jj) {
      const int ej = __shfl_sync(0xffffffffu, e, jj);
      if (jj < lane && ej == e) first = false;
    }
    i64 row = -1;
    if (local) {
      const i64 el = e - me * L;
      const u32* m = mask + (el * W + s) * NW;
      int pos = base[el * W + s];
      for (i64 w = 0; w < t / 32; ++w) pos += __popc(m[w]);
      pos += __popc(m[t / 32] & ((1u << (t % 32)) - 1u));
      row = el * WN + pos;
    }
    if (g == 0 && lane < K) reinterpret_cast<int*>(a.inv)[st * K + lane] = static_cast<int>(row);
    if (g == 0 && first) reinterpret_cast<int*>(a.src_info)[row] = static_cast<int>(t);
    u32 firsts = __ballot_sync(0xffffffffu, first);
    if (!firsts) continue;
    if (scales_seg) {
      const i64 sb = (H / QUANT_BLOCK) * 4;
      while (firsts) {
        const int j = __ffs(firsts) - 1;
        firsts &= firsts - 1;
        const i64 r = __shfl_sync(0xffffffffu, row, j);
        copy_bytes<true>(reinterpret_cast<u8*>(a.recv_scales) + r * sb, srow + H, sb, lane);
      }
      continue;
    }
    while (firsts) {
      const int j = __ffs(firsts) - 1;
      firsts &= firsts - 1;
      const i64 r = __shfl_sync(0xffffffffu, row, j);
      int4* d4 = reinterpret_cast<int4*>(reinterpret_cast<u8*>(a.recv_x) + r * RB + off);
#pragma unroll
      for (int u = 0; u < kVec; ++u)
        if (lane + u * 32 < nvec) st_na_global(d4 + lane + u * 32, v[u]);
    }
  }
  __syncthreads();
  prof_stamp(a.prof, 4);
  if (threadIdx.x == 0) block_exit(l.ctrl);
}

extern "C" __global__ void __launch_bounds__(512) symbuf_ll_dispatch(const __grid_constant__ LLDispatchArgs a) {
  extern __shared__ u32 smem[];
  if (a.kind == LL_KIND_BF16) dispatch_body<LL_KIND_BF16>(a, smem);
  else if (a.kind == LL_KIND_F16) dispatch_body<LL_KIND_F16>(a, smem);
  else dispatch_body<LL_KIND_F32>(a, smem);
}

// ---- combine ---------------------------------------------------------------------------------------------------------
// A: block 0 compares this rank's topk_idx with the meta its handle's dispatch sent (a difference: the weights flag
//    says LL_REJECTED, REJECT_TOPK), stores this rank's topk_weights (float32 [n][K]) into every rank's weights area
//    of source `rank`, then the weights flag [seq, n, sig, the handle's dispatch id, why].
// B: after every source's weights flag: work item (source s, token t < n_s, segment), one warp: partial =
//    sum over j = 0..K-1 with inv[s][t][j] >= 0 of w[s][t][j] * x[inv[s][t][j]] (float32, multiply then add, no
//    fma, from 0), rounded once to x's dtype, stored into s's partial row t of expert rank `rank`. Tokens with no
//    local expert send nothing. Then the partials flag to every rank.
// C: after every rank's partials flag: work item (token t < n, segment): out[t] = sum over the ranks d holding one
//    of t's experts, in ascending order, of float(partial_d[t]) (float32 from 0), rounded once; 0 when t has none.
template <int KIND>
__device__ void combine_body(const LLCombineArgs& a) {
  using E = Elem<KIND>;
  const LLLaunch l = ll_prologue(a);
  LLBlockState* sh = l.sh;
  const int W = l.W, me = l.me, lane = l.lane, K = static_cast<int>(a.k);
  const i64 N = a.N, H = a.H, L = a.L, n = a.n, RC = a.row_bytes;
  const u64* ll_bases = l.ll_bases;
  const u64 seq = l.seq;
  const i64 half = l.half, gwarp = l.gwarp, total_warps = l.total_warps;
  const i64 elem = KIND == LL_KIND_F32 ? 4 : 2;
  constexpr i64 kSeg = LL_SEG_ELEMS;
  const i64 segs = (H + kSeg - 1) / kSeg;
  const i64* topk = reinterpret_cast<const i64*>(a.topk);

  prof_stamp(a.prof, 0);
  const bool sending = (a.phase & LL_PHASE_SEND) != 0;
  // The id of the dispatch whose handle this call uses (a rejecting rank has no handle); negative: that dispatch was
  // rejected (it delivered nothing; its handle is refused on every rank, REJECT_HANDLE, never a count mismatch).
  const i64 did = n >= 0 ? ld_volatile_global(reinterpret_cast<const i64*>(a.dispatch_id)) : 0;
  const bool handle_rejected = did < 0;
  // ---- A: topk_idx check, weights ----
  if (sending && blockIdx.x == 0) {
    // this rank's meta lines of the handle's dispatch: what that dispatch sent (ignored entries -1); read with the
    // weights, so the check adds no round trip (a rejecting rank, n < 0, reads nothing)
    const i64 did_half = (handle_rejected ? -did : did) & 1;
    const u32* sent = at<u32>(ll_bases[me], a.d_half0 + did_half * a.d_half_bytes + a.d_meta_off +
                                                static_cast<i64>(me) * N * K * 4);
    const u32* w = reinterpret_cast<const u32*>(a.weights);
    int differs = 0;
    for (i64 i = threadIdx.x; i < n * K; i += blockDim.x) {
      const u32 wi = ld_nc_global(w + i);
      const i64 e = topk[i];
      const int mine = expert_rank(e, L, a.W) >= 0 ? static_cast<int>(e) : -1;
      differs |= mine != static_cast<int>(ld_cg_global(sent + i));
      for (int d = 0; d < W; ++d)
        *at<u32>(ll_bases[d], half + a.weights_off + (static_cast<i64>(me) * N * K + i) * 4) = wi;
    }
    // (the barrier also orders every thread's weights stores before the flag below)
    const bool topk_differs = __syncthreads_or(differs) != 0;
    const i64 n_line = topk_differs || handle_rejected ? LL_REJECTED : n;
    const i64 why = handle_rejected ? REJECT_HANDLE : topk_differs ? REJECT_TOPK : REJECT_ARGS;
    if (threadIdx.x < W) {
      const int d = threadIdx.x;
#if !SYMBUF_LL_FENCE
      __threadfence_system();
#endif
      u64* line = at<u64>(ll_bases[d], half + a.wflags_off + static_cast<i64>(me) * LINE_BYTES);
      volatile i64* lw = reinterpret_cast<volatile i64*>(line);
      lw[LL_LINE_N] = n_line;
      lw[LL_LINE_SIG] = a.sig;
      lw[LL_LINE_TAG] = did;
      lw[LL_LINE_WHY] = why;
      st_release_sys_global(line + LL_LINE_SEQ, seq);
    }
  }
  // ---- B: partial sums of this rank's experts, back to their source ----
  const int* inv = reinterpret_cast<const int*>(a.inv);
  const int* ntok = reinterpret_cast<const int*>(a.recv_ntok);
  // While the weights travel: the warp's first item's rows (inv and x are this rank's, valid before any flag)
  // are looked up and their segments prefetched into L2.
  int row_first = -1;
  if (sending && n >= 0 && gwarp < W * N * segs) {  // (a rejecting rank has no handle: inv and recv_ntok are not read)
    const i64 st = gwarp / segs, g = gwarp % segs, s = st / N, t = st % N;
    if (t < ntok[s]) {
      row_first = lane < K ? inv[st * K + lane] : -1;
      u32 js = __ballot_sync(0xffffffffu, row_first >= 0);
      const i64 lo = g * kSeg, bytes = ((lo + kSeg < H ? lo + kSeg : H) - lo) * elem;
      while (js) {
        const int j = __ffs(js) - 1;
        js &= js - 1;
        const i64 r = __shfl_sync(0xffffffffu, row_first, j);
        const u8* p = reinterpret_cast<const u8*>(a.x) + (r * H + lo) * elem;
        for (i64 b = static_cast<i64>(lane) * 128; b < bytes; b += 32 * 128)
          asm volatile("prefetch.global.L2 [%0];" ::"l"(p + b));
      }
    }
  }
  if (threadIdx.x < W) {
    const int s = threadIdx.x;
    const u64* line = at<u64>(ll_bases[me], half + a.wflags_off + static_cast<i64>(s) * LINE_BYTES);
    i64 ns = 0;
    if (s == 0) sh->own = did;
    if (!wait_line(&sh->ctx, s, line, seq, a.sig, n, &ns)) sh->fail = 1;
    else if (ns != LL_REJECTED && n >= 0) {
      const i64 theirs = line_word(line, LL_LINE_TAG);
      if (theirs != did) {  // the ranks' handles come from different dispatches: every rank sees it, rejects alike
        note_rejection(sh, s, REJECT_HANDLE, theirs);
      } else if (ns != reinterpret_cast<const int*>(a.recv_ntok)[s]) {  // one dispatch, other counts: broken
        fail(sh->ctx, ROLE_RECV, s, reinterpret_cast<const int*>(a.recv_ntok)[s], ns, ERR_MISMATCH, FIELD_UNITS);
        sh->fail = 1;
      }
    }
    note_line(sh, s, ns, line);
  }
  __syncthreads();
  if (sh->fail) return;
  // A rejected call sends no partial (every block still counts itself in the partials lines below, so their counts
  // stay at full_count(seq) for the next call on the half); the receive leaves zero rows on a rank that did not
  // reject. (A receive-only launch waits on the weights lines again: they hold seq until this rank's next call.)
  const bool rejected = sh->rejected < MAX_PEERS;
  prof_stamp(a.prof, 1);
  const u32* wts = at<u32>(ll_bases[me], half + a.weights_off);
  constexpr int kVec = kSeg / E::kPerVec / 32;  // 16-byte vectors per lane per segment
  for (i64 item = gwarp; item < (sending && !rejected ? W * N * segs : 0); item += total_warps) {
    const i64 st = item / segs, g = item % segs, s = st / N, t = st % N;
    if (t >= ntok[s]) continue;
    const int row = item == gwarp ? row_first : (lane < K ? inv[st * K + lane] : -1);
    const float w = lane < K ? __uint_as_float(ld_cg_global(wts + st * K + lane)) : 0.f;
    if (!__any_sync(0xffffffffu, row >= 0)) continue;
    const i64 lo = g * kSeg, nvec = ((lo + kSeg < H ? lo + kSeg : H) - lo) / E::kPerVec;
    float acc[kVec][E::kPerVec];
#pragma unroll
    for (int u = 0; u < kVec; ++u)
#pragma unroll
      for (int q = 0; q < E::kPerVec; ++q) acc[u][q] = 0.f;
    u32 js = __ballot_sync(0xffffffffu, row >= 0);
    while (js) {  // two expert rows in flight, accumulated in ascending j
      const int j0 = __ffs(js) - 1;
      js &= js - 1;
      const int j1 = js ? __ffs(js) - 1 : -1;
      if (js) js &= js - 1;
      const int r0 = __shfl_sync(0xffffffffu, row, j0), r1 = __shfl_sync(0xffffffffu, row, j1 < 0 ? j0 : j1);
      const float w0 = __shfl_sync(0xffffffffu, w, j0), w1 = __shfl_sync(0xffffffffu, w, j1 < 0 ? j0 : j1);
      const int4* s0 = reinterpret_cast<const int4*>(reinterpret_cast<const u8*>(a.x) + r0 * H * elem + lo * elem);
      const int4* s1 = reinterpret_cast<const int4*>(reinterpret_cast<const u8*>(a.x) + r1 * H * elem + lo * elem);
      int4 v0[kVec], v1[kVec];
#pragma unroll
      for (int u = 0; u < kVec; ++u)
        if (lane + u * 32 < nvec) {
          v0[u] = ld_nc_global(s0 + lane + u * 32);
          if (j1 >= 0) v1[u] = ld_nc_global(s1 + lane + u * 32);
        }
#pragma unroll
      for (int u = 0; u < kVec; ++u) {
        float f[E::kPerVec];
        E::unpack(v0[u], f);
#pragma unroll
        for (int q = 0; q < E::kPerVec; ++q) acc[u][q] = __fadd_rn(acc[u][q], __fmul_rn(w0, f[q]));
        if (j1 >= 0) {
          E::unpack(v1[u], f);
#pragma unroll
          for (int q = 0; q < E::kPerVec; ++q) acc[u][q] = __fadd_rn(acc[u][q], __fmul_rn(w1, f[q]));
        }
      }
    }
    int4* dst = at<int4>(ll_bases[s], half + a.prows_off + (static_cast<i64>(me) * N + t) * RC + lo * elem);
#pragma unroll
    for (int u = 0; u < kVec; ++u)
      if (lane + u * 32 < nvec) st_na_global(dst + lane + u * 32, E::pack(acc[u]));
  }
  if (sending) {
    __syncthreads();
    if (threadIdx.x == 0) block_sent(ll_bases, half + a.pflags_off, me, W, 0, a.sig, 0, 0);
    prof_stamp(a.prof, 2);
  }
  if (!(a.phase & LL_PHASE_RECV)) return;  // a send-only launch does not count its blocks (the receive will)
  if (call_rejected(l, n)) {  // a rank that did not reject returns zero rows
    if (n >= 0) {
      int4* out4 = reinterpret_cast<int4*>(a.out);
      for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < n * H * elem / 16;
           i += a.grid * static_cast<i64>(blockDim.x))
        out4[i] = make_int4(0, 0, 0, 0);
    }
    __syncthreads();
    if (threadIdx.x == 0) block_exit(l.ctrl);
    return;
  }
  // ---- C: sum the partials of every rank, in rank order ----
  // the warp's first token's topk_idx is read before the wait (this rank's input)
  const i64 e_first = gwarp < n * segs && lane < K ? topk[(gwarp / segs) * K + lane] : -1;
  if (threadIdx.x < W) {
    const int d = threadIdx.x;
    const u64* line = at<u64>(ll_bases[me], half + a.pflags_off + static_cast<i64>(d) * LINE_BYTES);
    i64 nd = 0;
    if (!wait_line(&sh->ctx, d, line, full_count(seq, a.grid), a.sig, n, &nd)) sh->fail = 1;
  }
  __syncthreads();
  if (sh->fail) return;
  prof_stamp(a.prof, 3);
  for (i64 item = gwarp; item < n * segs; item += total_warps) {
    const i64 t = item / segs, g = item % segs;
    const i64 e = item == gwarp ? e_first : (lane < K ? topk[t * K + lane] : -1);
    const int r = expert_rank(e, L, a.W);
    const u32 ranks = __reduce_or_sync(0xffffffffu, r >= 0 ? (1u << r) : 0u);
    const i64 lo = g * kSeg, nvec = ((lo + kSeg < H ? lo + kSeg : H) - lo) / E::kPerVec;
    float acc[kVec][E::kPerVec];
#pragma unroll
    for (int u = 0; u < kVec; ++u)
#pragma unroll
      for (int q = 0; q < E::kPerVec; ++q) acc[u][q] = 0.f;
    u32 ds = ranks;
    while (ds) {  // two partial rows in flight, summed in ascending rank order
      const int d0 = __ffs(ds) - 1;
      ds &= ds - 1;
      const int d1 = ds ? __ffs(ds) - 1 : -1;
      if (ds) ds &= ds - 1;
      const int4* p0 = at<int4>(ll_bases[me], half + a.prows_off + (static_cast<i64>(d0) * N + t) * RC + lo * elem);
      const int4* p1 = at<int4>(ll_bases[me], half + a.prows_off + (static_cast<i64>(d1 < 0 ? d0 : d1) * N + t) * RC +
                                                  lo * elem);
      int4 v0[kVec], v1[kVec];
#pragma unroll
      for (int u = 0; u < kVec; ++u)
        if (lane + u * 32 < nvec) {
          v0[u] = ld_cg_global(p0 + lane + u * 32);
          if (d1 >= 0) v1[u] = ld_cg_global(p1 + lane + u * 32);
        }
#pragma unroll
      for (int u = 0; u < kVec; ++u) {
        float f[E::kPerVec];
        E::unpack(v0[u], f);
#pragma unroll
        for (int q = 0; q < E::kPerVec; ++q) acc[u][q] = __fadd_rn(acc[u][q], f[q]);
        if (d1 >= 0) {
          E::unpack(v1[u], f);
#pragma unroll
          for (int q = 0; q < E::kPerVec; ++q) acc[u][q] = __fadd_rn(acc[u][q], f[q]);
        }
      }
    }
    int4* dst = reinterpret_cast<int4*>(reinterpret_cast<u8*>(a.out) + t * H * elem + lo * elem);
#pragma unroll
    for (int u = 0; u < kVec; ++u)
      if (lane + u * 32 < nvec) st_na_global(dst + lane + u * 32, E::pack(acc[u]));
  }
  __syncthreads();
  prof_stamp(a.prof, 4);
  if (threadIdx.x == 0) block_exit(l.ctrl);
}

extern "C" __global__ void __launch_bounds__(512) symbuf_ll_combine(const __grid_constant__ LLCombineArgs a) {
  if (a.kind == LL_KIND_BF16) combine_body<LL_KIND_BF16>(a);
  else if (a.kind == LL_KIND_F16) combine_body<LL_KIND_F16>(a);
  else combine_body<LL_KIND_F32>(a);
}
