// The ring exchange (alltoall, alltoallv, MoE dispatch / combine) over the channel ring buffers, and the notify
// (count exchange) step.
//
// Grid: 2 * num_channels blocks. Block 2c sends for channel c, block 2c+1 receives for it (sender and receiver
// on different SMs). Inside a block the warps are split into world_size warp groups, one per peer, so every
// (channel, source, destination) run progresses on its own and no peer can block another.
// What moves is described by the launch descriptor (layout.cuh, DESC_*): per peer a run of rows, each row
// gathered from up to 4 parts on the send side (MoE dispatch: x | scales | topk_idx | weights of the token
// index[r]) and scattered into up to 4 parts on the receive side; plain alltoallv is a byte run (1-byte rows).
// Channel c carries rows [lo, hi) of every run; its ring slots hold rows_per_chunk whole rows each.
//
// The protocol of one (channel, sender, receiver) ring, its memory ordering, and the primitives each role uses
// are in ring_prims.cuh. The kernel's paths, per warp group (lane 0 of warp 0 is the leader and publisher):
//   own rows     (peer == rank) copy_own_rows: half of the channel's rows each in the sender and the receiver
//                block, straight from the send parts to the receive parts (nothing under FLAG_REJECT or FLAG_CE).
//   ring         leader: call_header_step, then publish_runs; copy warps: their chunks, wait_chunk /
//                move_chunk / post_chunk each (a receiver's after await_verdict).
//   push         (MODE_PUSH sender) the same, the copy warps await the receiver's answer and push_chunk.
//   direct pull  (MODE_DIRECT) sender: the header alone, then wait for the hand-back; receiver: its copy warps
//                pull_direct_share (and our sender group's helpers help_pull_direct), the leader direct_done.
//   copy engine  (FLAG_CE) headers only; the host's copy engine moves the rows, symbuf_ce_finish hands back.
//   reject       (FLAG_REJECT) headers only: HDR_REJECTED out, drain_rejected in (an alltoall: or a peer's small
//                header in, accept_small_rejected, when its call went by the small protocol, small_exchange.cu).
// Every wait is bounded by DESC_TIMEOUT_NS and polls this rank's abort word (protocol.cuh, SpinBudget); the first
// failure writes the error record (role, rank, peer, channel, head, tail, kind, field).
#define SYMBUF_BULK_KERNEL 1  // the ring kernel may copy with cp.async.bulk (SYMBUF_BULK, primitives.cuh)
#include "ring_prims.cuh"
#include "moe_layout.cuh"

// 1: channel telemetry (Config(trace=True), wire/protocol.py DESC_TRACE): lane 0 of each copy warp appends a record
// per chunk / direct slice / own-rows share. A build of its own, so a communicator without trace pays nothing.
#ifndef SYMBUF_TRACE
#define SYMBUF_TRACE 0
#endif

// Threads per block (__launch_bounds__): 1024 gives 32 warps but 64 registers per thread; 512 gives 128.
#ifndef SYMBUF_MAX_THREADS
#define SYMBUF_MAX_THREADS 1024
#endif

#if SYMBUF_TRACE
// One trace record (layout: wire/protocol.py DESC_TRACE) of an event that began at t0 (ns) and ends now.
__device__ __forceinline__ void trace_event(const i64* desc, int kind, u64 t0, int channel, int peer, i64 bytes,
                                           u64 head, u64 tail) {
  trace_record(reinterpret_cast<i64*>(desc[DESC_TRACE]), desc[DESC_TRACE_CAP], desc[DESC_SEQ], desc[DESC_OP], kind,
               t0, channel, peer, bytes, head, tail);
}
#define SYMBUF_TRACE_T0(var) const u64 var = globaltimer_ns()
#define SYMBUF_TRACE_EVENT(...) trace_event(__VA_ARGS__)
#else
#define SYMBUF_TRACE_T0(var)
#define SYMBUF_TRACE_EVENT(...)
#endif

// ---- direct pull (MODE_DIRECT), the copy warps' paths --------------------------------------------------------------
// A receiver's copy warp once the verdict is kGateDirect: slice copy_id of num_copy + num_help of the channel's
// share [lo, hi) of the run, straight out of the sender's block (*src_word: where the run starts there, mapped
// here, written by the leader before its release of the verdict; the last num_help slices are the helpers'), then
// the hand-off: its done mark for the leader's direct_done, or (a group of one warp) direct_done itself.
__device__ __forceinline__ void pull_direct_share(const RowRun& recv, const u64* src_word, i64 lo, i64 hi,
                                                  int copy_id, int num_copy, int num_help, bool solo, u64* done,
                                                  u64* remote_counter, u64 c0, const u64* state, u64 call_seq,
                                                  const WaitCtx* ctx, int peer, volatile int* abort_flag, int lane,
                                                  const i64* desc, int channel) {
  const u8* src = reinterpret_cast<const u8*>(__shfl_sync(0xffffffffu, lane == 0 ? *src_word : 0ull, 0));
  __syncwarp();  // lane 0's acquire of the verdict precedes every lane's loads (the shuffle is no barrier)
  SYMBUF_TRACE_T0(t_pull);
  const i64 bytes = copy_slice<true>(recv.at(0, lo), src + lo, hi - lo, copy_id, num_copy + num_help, lane);
  if (lane == 0) SYMBUF_TRACE_EVENT(desc, TRACE_PULL, t_pull, channel, peer, bytes, c0, c0);
  (void)bytes, (void)desc, (void)channel;
  __syncwarp();  // every lane's loads precede lane 0's hand-off
  if (lane == 0) {
    if (solo) direct_done(remote_counter, nullptr, 0, c0, ctx, peer, abort_flag, state, 0, call_seq);
    else st_release_cta(&done[copy_id], c0 + 1);
  }
  __syncwarp();
}

// MODE_DIRECT both ways, a helper (copy warp copy_id < num_help of our sender group: our own rows go direct, so it
// has no chunks to send): wait for our receiver group's leader to say where the peer's run lies (rstate: our
// receiver's state line; STATE_HELP_SEQ == this call, ld.acquire.sys, bounded), copy slice num_copy + copy_id of the
// receiver's share (of the *recv_units units it receives from this peer, read after the wait; the receiver group's
// cut), then release STATE_HELP_DONE + copy_id = call_seq (cumulative over the warp's loads) for its direct_done.
__device__ __forceinline__ void help_pull_direct(const RowRun& recv, u64* rstate, const i64* recv_units,
                                                 int channel, int num_channels, i64 align, int copy_id, int num_copy,
                                                 int num_help, u64 c0, u64 call_seq, const WaitCtx* ctx, int peer,
                                                 volatile int* abort_flag, int lane, const i64* desc) {
  u64 src = 0;
  if (lane == 0) {
    SpinBudget spin(ctx);
    while (ld_acquire_sys_global(rstate + STATE_HELP_SEQ) != call_seq) {
      if (*abort_flag || !spin.ok(ROLE_SEND, peer, call_seq, 0)) {
        *abort_flag = 1;
        break;
      }
    }
    if (!*abort_flag) src = ld_volatile_global(reinterpret_cast<const i64*>(rstate + STATE_HELP_SRC));
  }
  src = __shfl_sync(0xffffffffu, src, 0);
  __syncwarp();  // lane 0's acquire of STATE_HELP_SEQ precedes every lane's loads
  if (src != 0) {
    i64 rlo = 0, rhi = 0;
    channel_range(*recv_units, channel, num_channels, align, rlo, rhi);
    SYMBUF_TRACE_T0(t_help);
    const i64 bytes = copy_slice<true>(recv.at(0, rlo), reinterpret_cast<const u8*>(src) + rlo, rhi - rlo,
                                       num_copy + copy_id, num_copy + num_help, lane);
    if (lane == 0) SYMBUF_TRACE_EVENT(desc, TRACE_PULL, t_help, channel, peer, bytes, c0, c0);
    (void)bytes, (void)desc, (void)c0;
    __syncwarp();
    if (lane == 0) st_release_sys_global(rstate + STATE_HELP_DONE + copy_id, call_seq);
  }
  __syncwarp();
}

// ---- work sharing (SYMBUF_ADAPTIVE=1: Config(adaptive=True)) ----------------------------------------------------------
// The static kernel gives each (channel, peer) ring run its own warp group, so under skewed routing the hot
// peer's group works while the others idle. With work sharing the chunks of every ring run of a block are
// claimed from a per-peer counter in shared memory (atomicAdd, in counter order) by any warp of the block: the
// group's own copy warps, copy warps of other groups once they are done with their own run (or whose home, the
// re-balanced map DESC_HOME, is another peer), and the self group's warps once they copied this rank's own rows.
// What goes on the wire is unchanged (the same chunks, cut by the agreed plan; the same counters and headers), so
// received rows land exactly where they do without it, and the ranks need not agree on the map.
//  * Done marks: per peer a window of ADAPT_WINDOW words, mark[t % ADAPT_WINDOW] = t + 1 (st.release.cta) once the
//    chunk of counter t is copied; the group's publisher acquires them in counter order (publish_runs). A chunk is
//    copied only when the ring has room for it (sender: head > t - num_slots) or holds it (receiver: tail > t), and
//    either needs every counter <= t - num_slots published by this block, so the previous user of the mark (t -
//    ADAPT_WINDOW <= t - num_slots) was acquired before it is overwritten (the host checks num_slots <= window).
//  * Progress: copy warp 0 of each group (the "dedicated" warp) takes only its own run's chunks until none are
//    left, so every run always has a warp; a warp holds one claimed chunk at a time and waits only for that
//    chunk's ring condition, so the lowest unfinished counter of a run can always move: sharing can delay a
//    run, never deadlock it (the waits stay bounded as before).
//  * A group's leader describes its run (ShareWork) and releases s_ready before its call-header step; a warp of
//    another group acquires it, and a receiver's (or a MODE_PUSH sender's) also acquires the header verdict before
//    touching a slot, as the group's own warps do.
#ifndef SYMBUF_ADAPTIVE
#define SYMBUF_ADAPTIVE 0
#endif

struct ShareWork {
  u8* ring;                  // the ring the run's chunks go into (sender: the peer's) or come out of
  const u64* local_counter;  // sender: head in our buffer; receiver: tail in our buffer
  u64 c0;                    // counter of payload chunk 0
  i64 lo, hi, rows_per_chunk, todo;  // the channel's share, units per chunk, chunks to claim
  u32 push;                  // MODE_PUSH: the pushed receive parts (sender: wait for the receiver's answer)
};

// The block's shared state (the kernel's __shared__ arrays), handed to the sharing loops by pointer.
struct ShareCtx {
  ShareWork* work;
  u64* ready;
  u64* gate;
  unsigned int* next;
  unsigned int* stolen;
  u64* marks;
  volatile int* abort;
  const RowRun* runs;
  const u64* src;
  const i64* push_delta;
  const i64* desc;
  const WaitCtx* ctx;
  i64 num_slots, chunk_bytes, row_bytes, region_bytes;
  int channel, rank, world_size;
  bool is_sender;
};

// Bounded wait of lane 0 for a shared word another warp of the block sets (q's leader: s_ready before any wait of
// its own, the gate after its bounded header step): the abort word is polled and the wait times out like every
// other (SpinBudget); true once *word != kGateWait, false (q's abort flag set) when the wait failed.
__device__ __noinline__ bool share_wait_word(const ShareCtx& S, int q, const u64* word) {
  if (ld_acquire_cta(word) != kGateWait) return true;
  SpinBudget spin(S.ctx);
  while (ld_acquire_cta(word) == kGateWait) {
    if (S.abort[q] || !spin.ok(S.is_sender ? ROLE_SEND : ROLE_RECV, q, 0, 0)) {
      S.abort[q] = 1;
      return false;
    }
  }
  return true;
}

// One warp claims and copies chunks of peer q's run until none are left (or the run aborted). `polite`: a
// helper's first pass: leave the run (returns false) instead of claiming a chunk whose ring condition does not
// hold yet (sender: the ring is full; receiver: the chunk has not arrived), so that it helps elsewhere rather than
// park on a throttled run; the second pass (polite = false) claims and waits as the dedicated warp does.
// Returns kShareDone once no chunk of q is left to claim (or q aborted, or its verdict is not to copy), else
// kShareLater (polite only), or kShareMoved when it copied chunks before leaving.
constexpr int kShareLater = 0, kShareMoved = 1, kShareDone = 2;
__device__ __noinline__ int share_chunks(const ShareCtx& S, int q, int own_peer, int lane, bool polite) {
  bool ok = true;
  if (lane == 0) ok = share_wait_word(S, q, &S.ready[q]);  // q's leader writes it before any wait of its own
  __syncwarp();  // lane 0's acquire precedes every lane's reads of the work descriptor
  if (!__shfl_sync(0xffffffffu, ok ? 1 : 0, 0)) return kShareDone;
  const ShareWork& w = S.work[q];
  if (w.todo <= 0) return kShareDone;
  if (!S.is_sender || w.push) {  // the header verdict first, as for the group's own warps
    u64 go = kGateWait;
    if (lane == 0) {
      if (polite && ld_acquire_cta(&S.gate[q]) == kGateWait) go = kGateWait;  // not yet: come back later
      else go = share_wait_word(S, q, &S.gate[q]) ? ld_acquire_cta(&S.gate[q]) : kGateAbort;
    }
    go = __shfl_sync(0xffffffffu, go, 0);
    __syncwarp();
    if (go == kGateWait) return kShareLater;
    if (go != kGateCopy) return kShareDone;
  }
  volatile int* abort_flag = &S.abort[q];
  const RowRun& send = S.runs[2 * q];
  const RowRun& recv = S.runs[2 * q + 1];
  u64* marks = S.marks + q * ADAPT_WINDOW;
  u64 seen = S.is_sender ? 0 : w.c0;  // the last head (sender) / tail (receiver) read
  int moved = kShareLater;
  while (true) {
    unsigned int claimed = 0;
    if (lane == 0) {
      if (polite) {  // only a chunk whose ring condition holds now (a lower bound: it may hold by the time we copy)
        const u64 next = w.c0 + static_cast<u64>(*reinterpret_cast<volatile unsigned int*>(&S.next[q]));
        const u64 counter = ld_volatile_global(reinterpret_cast<const i64*>(w.local_counter));
        const bool can = S.is_sender ? next + 1 - counter <= static_cast<u64>(S.num_slots) : counter > next;
        claimed = can ? atomicAdd(&S.next[q], 1u) : 0xFFFFFFFFu;
      } else {
        claimed = atomicAdd(&S.next[q], 1u);
      }
    }
    claimed = __shfl_sync(0xffffffffu, claimed, 0);
    if (claimed == 0xFFFFFFFFu) return moved;  // polite: the ring condition does not hold; come back later
    const i64 k = static_cast<i64>(claimed);
    if (k >= w.todo) return kShareDone;
    const u64 t = w.c0 + static_cast<u64>(k);
    SYMBUF_TRACE_T0(t_chunk);
    u8* slot = ring_slot(w.ring, t, S.num_slots, S.chunk_bytes);
    if (lane == 0) {
      wait_chunk(S.ctx, q, S.is_sender, w.local_counter, t, w.c0, S.num_slots, seen, abort_flag);
#if SYMBUF_DEBUG
      check_chunk_slot(*S.ctx, S.is_sender ? ROLE_SEND : ROLE_RECV, q, w.ring - RING_OFFSET, slot,
                       min(w.rows_per_chunk, w.hi - w.lo - k * w.rows_per_chunk) * S.row_bytes, S.region_bytes,
                       S.chunk_bytes, abort_flag);
#endif
    }
    __syncwarp();  // lane 0's acquire precedes every lane's accesses to the slot
    if (__shfl_sync(0xffffffffu, *abort_flag, 0)) return kShareDone;
    const i64 r = w.lo + k * w.rows_per_chunk;
    const i64 n = min(w.rows_per_chunk, w.hi - r);
    move_chunk(S.is_sender, send, recv, slot, r, n, w.push, &S.src[q], S.push_delta + q * MAX_PARTS, lane);
    __syncwarp();  // every lane's accesses to the slot precede lane 0's mark
    if (lane == 0) {
      if (q != own_peer) atomicAdd(&S.stolen[q], 1u);  // before the mark: the leader reads it after the last one
      st_release_cta(&marks[t % ADAPT_WINDOW], t + 1);
      SYMBUF_TRACE_EVENT(S.desc, S.is_sender ? TRACE_SEND : TRACE_RECV, t_chunk, S.channel, q, n * S.row_bytes,
                         S.is_sender ? seen : t, S.is_sender ? t + 1 : seen);
    }
    __syncwarp();
    moved = kShareMoved;
  }
}

// A warp's sharing: every ring run of the block, from `start` on in peer order. `dedicated` (copy warp 0 of a
// group, start = its own peer): its own run first, claiming and waiting until none is left, so that every
// run always has a warp. Then (and for every other warp from the start) polite passes, which skip a run whose
// next chunk cannot move yet, as long as a pass moves something, then a last pass that claims and waits (bounded).
__device__ __forceinline__ void share_all(const ShareCtx& S, int start, int own_peer, int lane, bool dedicated) {
  if (dedicated) share_chunks(S, start, own_peer, lane, false);
  u32 open = 0;  // bit q: q's run may still have chunks to claim
  for (int q = 0; q < S.world_size; ++q)
    if (q != S.rank && !(dedicated && q == start)) open |= 1u << q;
  bool progress = true;
  while (open != 0 && progress) {
    progress = false;
    for (int i = 0; i < S.world_size; ++i) {
      const int q = (start + i) % S.world_size;
      if (!((open >> q) & 1u)) continue;
      const int r = share_chunks(S, q, own_peer, lane, true);
      if (r == kShareDone) open &= ~(1u << q);
      if (r != kShareLater) progress = true;
    }
  }
  for (int i = 0; i < S.world_size; ++i) {
    const int q = (start + i) % S.world_size;
    if ((open >> q) & 1u) share_chunks(S, q, own_peer, lane, false);
  }
}


// The descriptor (RingArgs, cupy_symbuf/wire/kernel_args.py: DESC_WORDS words) is the kernel's one parameter,
// passed by value: the driver copies it at launch, so the host may rewrite its own copy for the next call while
// this one is still queued (calls return without waiting).
extern "C" __global__ void __launch_bounds__(SYMBUF_MAX_THREADS)
symbuf_ring_exchange(const __grid_constant__ RingArgs desc) {
  __shared__ i64 s_desc[DESC_WORDS];
  __shared__ u64 s_done[32];  // per warp of the block
  __shared__ int s_abort[MAX_PEERS];
  __shared__ u64 s_gate[MAX_PEERS];  // receiver: the publisher's verdict on the call header (kGate*)
  __shared__ u64 s_src[MAX_PEERS];   // receiver, MODE_DIRECT: the sender's run in its block (mapped here);
                                     // sender, MODE_PUSH: the receiver's first row of our run (-1: push nothing)
  __shared__ i64 s_push_delta[MAX_PEERS * MAX_PARTS];  // sender, MODE_PUSH: receiver's block minus ours, per part
  __shared__ WaitCtx s_ctx;
#if SYMBUF_ADAPTIVE
  __shared__ ShareWork s_work[MAX_PEERS];     // per peer: its run, for warps of other groups (work sharing)
  __shared__ u64 s_ready[MAX_PEERS];          // != 0: s_work[peer] written (st.release.cta by the group's leader)
  __shared__ unsigned int s_next[MAX_PEERS];  // next chunk of the peer's run to claim
  __shared__ unsigned int s_stolen[MAX_PEERS];  // its chunks copied by warps of other groups (load counters)
  __shared__ u64 s_marks[MAX_PEERS * ADAPT_WINDOW];  // done marks per ring counter (publish_runs)
  for (int i = threadIdx.x; i < MAX_PEERS; i += blockDim.x) {
    s_ready[i] = 0;
    s_next[i] = 0;
    s_stolen[i] = 0;
    s_gate[i] = kGateWait;  // read by other groups' warps, perhaps before this peer's leader starts
    s_abort[i] = 0;         // likewise (share_wait_word polls it while it waits for s_ready)
  }
#else
  u64* const s_marks = nullptr;
#endif
  const u64* __restrict__ peer_bases = reinterpret_cast<const u64*>(desc.words[DESC_PEER_BASES]);
  for (int i = threadIdx.x; i < DESC_WORDS; i += blockDim.x) s_desc[i] = desc.words[i];  // constant bank
  if (threadIdx.x == 0)
    s_ctx = make_wait_ctx(reinterpret_cast<i64*>(desc.words[DESC_STATUS]), peer_bases,
                          static_cast<int>(desc.words[DESC_RANK]), static_cast<int>(desc.words[DESC_WORLD_SIZE]),
                          static_cast<int>(blockIdx.x >> 1),
                          desc.words[DESC_ABORT_OFFSET], static_cast<u64>(desc.words[DESC_TIMEOUT_NS]),
                          static_cast<u64>(desc.words[DESC_SEQ]));
  bulk_init();  // SYMBUF_BULK on sm_90: each warp's stages of the dynamic shared memory and their mbarriers
  __syncthreads();
  // Device-count call (DESC_COUNTS != 0): the per-peer units come from the counts table the notify kernel wrote
  // before this launch in stream order (plain loads: the kernel boundary orders them), not from the descriptor;
  // a table that says CT_SKIP (a rank rejected the call, the signatures differ, or the capacity is exceeded) ends
  // the call on every block before any ring word is touched, alike on every rank, so the rings stay in step.
  if (s_desc[DESC_COUNTS] != 0) {
    __shared__ int s_skip;
    const i64* table = reinterpret_cast<const i64*>(s_desc[DESC_COUNTS]);
    const int w = static_cast<int>(s_desc[DESC_WORLD_SIZE]);
    for (int i = threadIdx.x; i < 4 * w; i += blockDim.x) s_desc[DESC_PEERS + i] = table[CT_PEERS + i];
    if (threadIdx.x == 0) s_skip = table[CT_SKIP] != 0;
    __syncthreads();
    if (s_skip) return;
  }
  const int rank = static_cast<int>(s_desc[DESC_RANK]);
  const int world_size = static_cast<int>(s_desc[DESC_WORLD_SIZE]);
  const int num_channels = static_cast<int>(s_desc[DESC_NUM_CHANNELS]);
  const Layout L{s_desc[DESC_REGION_BYTES], s_desc[DESC_CHANNEL_BYTES], s_desc[DESC_NUM_SLOTS],
                 s_desc[DESC_CHUNK_BYTES], 0, 0};
  const i64 num_slots = L.num_slots, chunk_bytes = L.chunk_bytes;
  const i64 row_bytes = s_desc[DESC_ROW_BYTES];
  const i64 align = s_desc[DESC_ROW_ALIGN];
  // FLAG_REJECT: this rank rejected the call: ring groups send HDR_REJECTED headers and drain what peers send;
  // nothing is copied (the parts, row size and alignment of the descriptor are not read).
  const bool reject = (s_desc[DESC_FLAGS] & FLAG_REJECT) != 0;
  const bool moves = !reject && row_bytes > 0 && row_bytes <= chunk_bytes;
  const bool my_send_direct = moves && s_desc[DESC_DIRECT_ALLOC] >= 0;
  const bool ce = my_send_direct && (s_desc[DESC_FLAGS] & FLAG_CE) != 0;  // copy-engine alltoall (FLAG_CE)
  // MODE_PUSH (FLAG_PUSH, MoE dispatch into symmetric outputs): the receive parts peers write into themselves
  u32 push_mask = 0;
  if (moves && (s_desc[DESC_FLAGS] & FLAG_PUSH) != 0)
    for (int i = 0; i < static_cast<int>(s_desc[DESC_NUM_RECV_PARTS]); ++i)
      if (s_desc[DESC_PUSH_ALLOC + i] >= 0) push_mask |= 1u << i;

  const int channel = blockIdx.x >> 1;
  const bool is_sender = (blockIdx.x & 1) == 0;
  // Warp groups in peer order: ring_warps warps for every other rank, self_warps for our own rows
  // (wire/plan.py warp_groups)
  const int warp = threadIdx.x >> 5;
  const int ring_warps = static_cast<int>(s_desc[DESC_RING_WARPS]);
  const int self_warps = static_cast<int>(s_desc[DESC_SELF_WARPS]);
  const int self_first = rank * ring_warps;  // first warp of the self group
  int peer, first_warp, group_warps;
  if (warp < self_first) {
    peer = warp / ring_warps;
    first_warp = peer * ring_warps;
    group_warps = ring_warps;
  } else if (warp < self_first + self_warps) {
    peer = rank;
    first_warp = self_first;
    group_warps = self_warps;
  } else {
    const int k = (warp - self_first - self_warps) / ring_warps;
    peer = rank + 1 + k;
    first_warp = self_first + self_warps + k * ring_warps;
    group_warps = ring_warps;
  }
  if (peer >= world_size) return;
  const int nthreads = group_warps * 32;
  const int tid = threadIdx.x - first_warp * 32;
  const int lane = tid & 31;
  const int warp_in_group = tid >> 5;
  const bool leader = tid == 0;
  const int bar_id = 1 + peer;
  // Work sharing (SYMBUF_ADAPTIVE): groups of several warps only (a one-warp group publishes its own chunks)
  // (and a ring of at most ADAPT_WINDOW slots: the done-mark window; the host checks it, this is the fallback)
  const bool share = SYMBUF_ADAPTIVE && ring_warps > 1 && s_desc[DESC_NUM_SLOTS] <= ADAPT_WINDOW;

  const i64* peers = s_desc + DESC_PEERS;  // [4][world_size]: send unit offset, send units, recv offset, recv units
  // The two row runs of this group live in shared memory (read on use, not held in registers: the copy
  // loops need the registers; 1024-thread blocks get 64 per thread).
  __shared__ RowRun s_runs[2 * MAX_PEERS];
  if (lane == 0 && warp_in_group == 0) {
    s_runs[2 * peer] = RowRun{reinterpret_cast<const Part*>(s_desc + DESC_SEND_PARTS),
                              static_cast<int>(s_desc[DESC_NUM_SEND_PARTS]), row_bytes,
                              reinterpret_cast<const i64*>(s_desc[DESC_SEND_INDEX]), peers[peer]};
    s_runs[2 * peer + 1] = RowRun{reinterpret_cast<const Part*>(s_desc + DESC_RECV_PARTS),
                                  static_cast<int>(s_desc[DESC_NUM_RECV_PARTS]), row_bytes,
                                  reinterpret_cast<const i64*>(s_desc[DESC_RECV_INDEX]),
                                  peers[2 * world_size + peer]};
  }
  group_sync(bar_id, nthreads);
  const RowRun& send = s_runs[2 * peer];
  const RowRun& recv = s_runs[2 * peer + 1];
#if SYMBUF_ADAPTIVE
  // this warp's home in the re-balanced map (HOME_OWN: its own group's run; a self warp: the next peer's)
  const int home = static_cast<int>((s_desc[DESC_HOME + (is_sender ? 0 : 4) + warp / 8] >> (8 * (warp % 8))) & 0xFF);
  const bool home_ok = home != HOME_OWN && home < world_size && home != rank;
  // a self warp without a home starts on the peers in turn (warp i of the group: the (i % (W - 1))-th after us)
  const int self_start = home_ok ? home : (rank + 1 + warp_in_group % max(1, world_size - 1)) % world_size;
  const ShareCtx share_ctx{s_work, s_ready, s_gate, s_next, s_stolen, s_marks, s_abort, s_runs, s_src,
                           s_push_delta, s_desc, &s_ctx, s_desc[DESC_NUM_SLOTS], s_desc[DESC_CHUNK_BYTES],
                           s_desc[DESC_ROW_BYTES], s_desc[DESC_REGION_BYTES], channel, rank, world_size, is_sender};
#endif
  // Units of the whole run to (sender) or from (receiver) this peer: the call header carries / checks them.
  const i64 rows = is_sender ? peers[world_size + peer] : peers[3 * world_size + peer];
  i64 lo = 0, hi = 0;
  if (moves) channel_range(rows, channel, num_channels, align, lo, hi);

  if (peer == rank) {  // to ourselves: no ring; the sender block copies the first half, the receiver block the rest
    if (ce) return;      // FLAG_CE: a copy engine copies them too (after this kernel, beside the peers' rows)
#if SYMBUF_ADAPTIVE
    // work sharing: once our own rows are copied, this warp helps the ring runs (the hot one first)
    if (hi <= lo) {
      if (share) share_all(share_ctx, self_start, rank, lane, false);
      return;
    }
#else
    if (hi <= lo) return;  // an empty share, or FLAG_REJECT: nothing to copy, no header
#endif
    const i64 mid = lo + (hi - lo) / 2 / align * align;
    SYMBUF_TRACE_T0(t_self);
    const i64 self_bytes = copy_own_rows(send, recv, is_sender ? lo : mid, is_sender ? mid : hi, row_bytes,
                                         warp_in_group, group_warps, lane);
    if (lane == 0 && self_bytes > 0) SYMBUF_TRACE_EVENT(s_desc, TRACE_SELF, t_self, channel, -1, self_bytes, 0, 0);
    (void)self_bytes;
#if SYMBUF_ADAPTIVE
    if (share) share_all(share_ctx, self_start, rank, lane, false);
#endif
    return;
  }

  // A ring group goes on even with an empty share: the call header is exchanged on every call.
#if !SYMBUF_ADAPTIVE  // the work-sharing build set both before __syncthreads: other groups' warps may use them now
  if (leader) {
    s_abort[peer] = 0;
    s_gate[peer] = kGateWait;
  }
#endif
  // Sender: copy warps write chunks into the peer's ring and the publisher releases tail there; backpressure reads
  // head from our own region, where the peer's receiver releases it. Receiver: the mirror image (tail read from our
  // region, head released into the peer's). Warp 0 of a group publishes, the others copy, each owning every
  // num_copy-th chunk and handing it over with st.release.cta of done = chunk + 1 (no system-scope fence on the
  // copy path; one release per run of chunks, see publish_runs). A group of one warp (world_size > 15) copies and
  // releases each chunk itself. Lane 0 of warp 0 (the leader) also handles the call header.
  u8* local_region = reinterpret_cast<u8*>(peer_bases[rank]) + L.region(channel, peer);
  u8* remote_region = reinterpret_cast<u8*>(peer_bases[peer]) + L.region(channel, rank);
  u8* ring_region = is_sender ? remote_region : local_region;  // the region whose ring this group accesses
  u8* ring = ring_region + RING_OFFSET;
  u64* remote_counter = reinterpret_cast<u64*>(remote_region + (is_sender ? TAIL_OFFSET : HEAD_OFFSET));
  const u64* local_counter = reinterpret_cast<const u64*>(local_region + (is_sender ? HEAD_OFFSET : TAIL_OFFSET));
  // Our side's state line: [STATE_COUNTER] the counter the previous call left, [STATE_SEQ] calls made on this
  // run; written by the leader at the end of a call that did not abort (end_call).
  u64* state = reinterpret_cast<u64*>(local_region + (is_sender ? SEND_STATE_OFFSET : RECV_STATE_OFFSET));
  const bool solo = group_warps == 1;
  const int num_copy = solo ? 1 : group_warps - 1;
  const int copy_id = solo ? 0 : warp_in_group - 1;
  // MODE_DIRECT (this rank's sendbuf lies in symmetric allocation DESC_DIRECT_ALLOC, a byte run): the sender
  // sends the call header alone, saying where the run lies; the receiver copies its share out of our block
  const bool direct_send = is_sender && my_send_direct;
  const i64 rows_per_chunk = hi > lo ? chunk_rows(hi - lo, row_bytes, chunk_bytes, num_copy) : 1;
  const i64 nchunks = hi > lo && !direct_send ? (hi - lo + rows_per_chunk - 1) / rows_per_chunk : 0;
  const u64 first = state[STATE_COUNTER];  // the call header's counter
  const u64 call_seq = state[STATE_SEQ] + 1;
  const u64 c0 = first + 1;                // payload chunk k has counter c0 + k
  // GPU direct mode with our own sendbuf direct too: our sender group's copy warps have nothing to send and help
  // our receiver group copy the peer's run (STATE_HELP_*); both groups compute the same count. Not for a group
  // of one warp (it is its own leader, which waits for head).
  const int num_help = my_send_direct && !solo && !ce ? min(num_copy, static_cast<int>(MAX_HELPERS)) : 0;
  u64 end = c0 + static_cast<u64>(nchunks);  // after this call's last slot (a draining receiver: from the header)
  u64* done = &s_done[first_warp + (solo ? 0 : 1)];  // [num_copy]: last chunk + 1 each copy warp finished
  volatile int* abort_flag = &s_abort[peer];
  const int role = is_sender ? ROLE_SEND : ROLE_RECV;
  if (lane == 0 && copy_id >= 0) st_release_cta(&done[copy_id], c0);
#if SYMBUF_ADAPTIVE
  if (share && warp_in_group == 0) {  // the marks of this call, then the run for the other groups' warps
    for (int i = lane; i < ADAPT_WINDOW; i += 32) s_marks[peer * ADAPT_WINDOW + i] = 0;
    __syncwarp();
    if (lane == 0) {
      s_work[peer] = ShareWork{ring, local_counter, c0, lo, hi, rows_per_chunk, nchunks, push_mask};
      st_release_cta(&s_ready[peer], 1);
    }
  }
#endif
  group_sync(bar_id, nthreads);

  u64 verdict = kGateAbort;  // the leader's: header sent (sender) / checked (receiver)
  if (leader) {
    // rejecting an alltoall with the small protocol on: a peer whose call would go by it sends its small header
    // instead of ring headers (HeaderStep::small_hdr)
    const u64* small_hdr = nullptr;
    if (reject && !is_sender && s_desc[DESC_OP] == OP_ALLTOALL && s_desc[DESC_SMALL_OFFSET] != 0)
      small_hdr = reinterpret_cast<const u64*>(reinterpret_cast<const u8*>(peer_bases[rank]) +
                                               small_slot(s_desc[DESC_SMALL_OFFSET], s_desc[DESC_SMALL_SLOT_BYTES],
                                                          call_seq, peer, world_size)) +
                  SMALL_H_OP;
    const HeaderStep h{&s_ctx, ring_region, remote_counter, local_counter, abort_flag, &s_gate[peer], &s_src[peer],
                       reinterpret_cast<const i64*>(s_desc[DESC_SYM_TABLE]),
                       ce ? s_desc[DESC_DIRECT_ALLOC] : -1, ce ? s_desc[DESC_DIRECT_OFFSET] + peers[rank] : 0,
                       CallHeader{static_cast<i64>(HDR_MAGIC_VALUE), static_cast<i64>(call_seq), s_desc[DESC_OP],
                                  s_desc[DESC_SIG], rows, nchunks, reject ? HDR_REJECTED : HDR_OK, rank, channel,
                                  direct_send ? MODE_DIRECT : (push_mask ? MODE_PUSH : MODE_RING),
                                  direct_send ? s_desc[DESC_DIRECT_ALLOC] : -1,
                                  direct_send ? s_desc[DESC_DIRECT_OFFSET] + peers[peer] : 0},
                       push_mask, s_desc + DESC_PUSH_ALLOC, s_push_delta + peer * MAX_PARTS, recv.row0,
                       s_desc[DESC_PUSH_ROWS],
                       first, static_cast<u64>(num_slots), chunk_bytes, L.region_bytes, row_bytes, peer, role,
                       is_sender, reject, small_hdr};
    verdict = call_header_step(h, end);
    if (!is_sender && num_help > 0) {  // tell our sender group's helpers (STATE_HELP_*) what to copy
      state[STATE_HELP_SRC] = verdict == kGateDirect ? s_src[peer] : 0ull;
      st_release_sys_global(state + STATE_HELP_SEQ, call_seq);
    }
  }

  if (copy_id < 0) {  // the publisher (lane 0 of warp 0); a receiver hands each slot back as soon as it is read
    if (lane == 0 && verdict == kGateCopy)
      publish_runs(remote_counter, share ? s_marks + peer * ADAPT_WINDOW : done, share ? ADAPT_WINDOW : num_copy,
                   share ? 0 : c0, c0, end, SYMBUF_HEADER_FOLD && nchunks > 0 && !push_mask ? first : c0,
                   is_sender ? SYMBUF_PUBLISH_BATCH : 1, abort_flag, &s_ctx, role, peer);
    else if (lane == 0 && verdict == kGateDirect)
      direct_done(remote_counter, done, num_copy, c0, &s_ctx, peer, abort_flag, state, num_help, call_seq);
    __syncwarp();
  } else {
    // A receiver's copy warps touch no payload slot before the leader verified the call header (its
    // st.release.cta of the verdict, acquired here). A sender's copy warps need no verdict: their slots are
    // counters >= first + 1, which the receiver reads only after the header; a failed header wait shows in
    // *abort_flag below. MODE_PUSH: a sender's copy warps wait for it too (the receiver's answer: where to write).
    u64 go = kGateCopy;
    if (!is_sender || push_mask) go = await_verdict(&s_gate[peer], lane, go);
    if (go == kGateDirect)  // our share of the run, straight out of the sender's block
      pull_direct_share(recv, &s_src[peer], lo, hi, copy_id, num_copy, num_help, solo, done, remote_counter, c0,
                        state, call_seq, &s_ctx, peer, abort_flag, lane, s_desc, channel);
    if (direct_send && copy_id < num_help)  // a helper: our own rows go direct, so we have none to copy
      help_pull_direct(recv, reinterpret_cast<u64*>(local_region + RECV_STATE_OFFSET), &peers[3 * world_size + peer],
                       channel, num_channels, align, copy_id, num_copy, num_help, c0, call_seq, &s_ctx, peer,
                       abort_flag, lane, s_desc);
#if SYMBUF_ADAPTIVE
    // work sharing: the dedicated warp (copy warp 0) starts with its own run, the others with their home
    if (share) share_all(share_ctx, copy_id == 0 || !home_ok ? peer : home, peer, lane, copy_id == 0);
#endif
    // ring (and push): this warp's chunks k = copy_id, copy_id + num_copy, ...
    const i64 todo = go == kGateCopy && !share ? nchunks : 0;
    u64 seen = is_sender ? 0 : c0;  // sender: the last head read; receiver: the last tail read
    for (i64 k = copy_id; k < todo; k += num_copy) {
      const u64 t = c0 + static_cast<u64>(k);  // ring counter of this chunk
      SYMBUF_TRACE_T0(t_chunk);
      if (lane == 0) {
        wait_chunk(&s_ctx, peer, is_sender, local_counter, t, c0, num_slots, seen, abort_flag);
#if SYMBUF_DEBUG
        check_chunk_slot(s_ctx, role, peer, ring_region, ring_slot(ring, t, num_slots, chunk_bytes),
                         min(rows_per_chunk, hi - lo - k * rows_per_chunk) * row_bytes, L.region_bytes, chunk_bytes,
                         abort_flag);
#endif
      }
      __syncwarp();  // lane 0's acquire precedes every lane's accesses to the slot
      if (__shfl_sync(0xffffffffu, *abort_flag, 0)) break;  // lane 0's view: the whole warp leaves together
      const i64 r = lo + k * rows_per_chunk;
      const i64 n = min(rows_per_chunk, hi - r);
      move_chunk(is_sender, send, recv, ring_slot(ring, t, num_slots, chunk_bytes), r, n, push_mask, &s_src[peer],
                 s_push_delta + peer * MAX_PARTS, lane);
      __syncwarp();  // every lane's accesses to the slot precede lane 0's hand-off below
      if (lane == 0) {
        post_chunk(solo, remote_counter, &done[copy_id], t);
        SYMBUF_TRACE_EVENT(s_desc, is_sender ? TRACE_SEND : TRACE_RECV, t_chunk, channel, peer, n * row_bytes,
                           is_sender ? seen : t, is_sender ? t + 1 : seen);
      }
      __syncwarp();
    }
  }
  group_sync(bar_id, nthreads);
  if (leader && !*abort_flag) {
    end_call(state, end, call_seq);
#if SYMBUF_ADAPTIVE
    // load counters (DESC_LOAD): this (role, channel, peer) entry is written by this leader alone, kernels in
    // stream order; s_stolen[peer] is final: every chunk's mark (released after its count) was acquired above
    // (bytes of the share when it moved, through the ring or directly; ring chunks only when they carried it)
    if (s_desc[DESC_LOAD] != 0 && moves && (verdict == kGateCopy || verdict == kGateDirect)) {
      i64* load = reinterpret_cast<i64*>(s_desc[DESC_LOAD]) +
                  ((static_cast<i64>(is_sender ? 0 : 1) * num_channels + channel) * world_size + peer) * LOAD_WORDS;
      load[LOAD_BYTES] += (hi - lo) * row_bytes;
      load[LOAD_CHUNKS] += verdict == kGateCopy ? nchunks : 0;
      load[LOAD_STOLEN] += share ? static_cast<i64>(s_stolen[peer]) : 0;
    }
#endif
  }
}

// Count exchange through the symmetric buffer. Every rank writes, into rank p's notify slot for this rank, the
// slot header [NOTIFY_OP, NOTIFY_STATUS, NOTIFY_SIG] = op, call_status, sig and the values send_meta[p, :]
// (num_values int64), then publishes NOTIFY_EPOCH = epoch there with st.release.sys (after a __syncthreads: the
// release is cumulative over the block's stores); then waits until every source s has published `epoch` in our
// slot for it and copies its header and values, [op, status, sig, values...] (NOTIFY_HDR_WORDS - 1 + num_values
// words), into recv_meta[s, :] (host-mapped: the host checks op / status / sig). Slots are double-buffered by
// epoch parity: a rank can be at most one call ahead of a peer that has not read its values yet. The epoch is kept
// in device memory (*epoch_word, advanced by this kernel), so a call captured in a CUDA graph counts its replays.
// The waits are bounded and poll this rank's abort word (abort_offset) like the ring's. One block;
// blockDim.x >= world_size.
// Optional (null pointers: off): local_reject (device word; != 0 makes this call HDR_REJECTED, e.g. the layout
// kernel found a topk_idx out of range), send_echo (host-mapped copy of send_meta), sums (int64 [num_values]:
// each value summed over the sources), table (device-count mode: two CT_* tables, [0] this call's, [1] the
// reverse call's (combine: send and receive swapped, and no units to itself: the combine's reduction reads its own
// rows from its input), units = the first value * scale). device_checks: the kernel
// itself checks every source's status, op and signature (the host never sees them): a rejection or another
// signature sets CT_SKIP and records the rejection (STATUS_REJECTED_BY / _WHY, raised by synchronize), another op
// is a fatal mismatch, and rows received beyond `capacity` (>= 0) are a fatal FIELD_CAPACITY error. done
// (host-mapped, optional): `ticket` is stored there last, when every output above is written (or the wait failed).
// A skipped call (rejected, signatures differ, capacity exceeded, a failed wait): both tables say CT_SKIP and hold
// no rows at all, so whatever reads them (ring kernel, fix-up, combine's reduction, alltoallv's returned counts)
// sees a call that moved nothing.
__device__ __forceinline__ void skip_tables(i64* table, int world_size) {
  for (int t = 0; t < 2; ++t) {
    i64* tab = table + t * CT_WORDS;
    tab[CT_SKIP] = 1;
    tab[CT_RECV_TOTAL] = 0;
    for (int i = 0; i < 4 * world_size; ++i) tab[CT_PEERS + i] = 0;
  }
}

static_assert(NOTIFY_EPOCH == 0 && NOTIFY_STATUS == NOTIFY_OP + 1 && NOTIFY_SIG == NOTIFY_OP + 2 &&
                  NOTIFY_HDR_WORDS == NOTIFY_SIG + 1,
              "symbuf_notify copies the slot words from NOTIFY_OP on as one run");
// The body, for any argument struct with NotifyArgs' fields (symbuf_notify's, symbuf_moe_layout_notify's).
template <class A>
__device__ __forceinline__ void notify_body(const A& a) {
  const Layout L{a.region_bytes, a.channel_bytes, a.num_slots, a.chunk_bytes, a.notify_offset, a.notify_slot_bytes};
  __shared__ WaitCtx s_ctx;
  __shared__ int s_abort;
  __shared__ i64 s_send0[MAX_PEERS], s_op[MAX_PEERS], s_status[MAX_PEERS], s_sig[MAX_PEERS], s_recv0[MAX_PEERS];
  if (threadIdx.x == 0) {
    s_ctx = make_wait_ctx(a.status, a.peer_bases, a.rank, a.world_size, -1, a.abort_offset, a.timeout_ns, a.seq);
    s_abort = 0;
  }
  const i64 epoch = *a.epoch_word + 1;  // every thread reads it before thread 0 advances it (after a barrier)
  const i64 call_status =
      (a.local_reject != nullptr && *a.local_reject != 0) ? static_cast<i64>(HDR_REJECTED) : a.call_status;
  const i64 parity = epoch & 1;
  const i64 total = static_cast<i64>(a.world_size) * a.num_values;
  for (i64 i = threadIdx.x; i < total; i += blockDim.x) {
    const int p = static_cast<int>(i / a.num_values);
    const i64 m = i % a.num_values;
    i64* slot = reinterpret_cast<i64*>(reinterpret_cast<u8*>(a.peer_bases[p]) +
                                       L.notify_slot(parity, a.rank, a.world_size));
    const i64 v = a.send_meta[i];
    slot[NOTIFY_HDR_WORDS + m] = v;
    if (m == 0) s_send0[p] = v;
    if (a.send_echo != nullptr) a.send_echo[i] = v;
  }
  __syncthreads();
  if (threadIdx.x < a.world_size) {
    const int p = threadIdx.x;
    u64* slot = reinterpret_cast<u64*>(reinterpret_cast<u8*>(a.peer_bases[p]) +
                                       L.notify_slot(parity, a.rank, a.world_size));
    i64* words = reinterpret_cast<i64*>(slot);
    words[NOTIFY_OP] = a.op;
    words[NOTIFY_STATUS] = call_status;
    words[NOTIFY_SIG] = a.sig;
    st_release_sys_global(slot + NOTIFY_EPOCH, static_cast<u64>(epoch));
  }
  __syncthreads();
  u8* my_base = reinterpret_cast<u8*>(a.peer_bases[a.rank]);
  if (threadIdx.x < a.world_size) {
    const int s = threadIdx.x;
    const u64* slot = reinterpret_cast<const u64*>(my_base + L.notify_slot(parity, s, a.world_size));
    // FIELD_FORM: a peer whose call has no count exchange sends its channel-0 call header instead (ring kernel):
    // its tail past what this rank's receiver consumed, while its slot of this epoch is still absent (a peer in
    // this form publishes the slot before any header of the call), is a fatal mismatch, found at once
    const u8* region0 = my_base + L.region(0, s);
    const u64* tail_line = reinterpret_cast<const u64*>(region0 + TAIL_OFFSET);
    const u64 consumed = static_cast<u64>(ld_volatile_global(reinterpret_cast<const i64*>(region0 + RECV_STATE_OFFSET) +
                                                             STATE_COUNTER));
    SpinBudget spin(&s_ctx);
    u64 seen = ld_acquire_sys_global(slot + NOTIFY_EPOCH);
    while (seen < static_cast<u64>(epoch)) {
      if (s != a.rank && ld_acquire_sys_global(tail_line) > consumed) {
        seen = ld_acquire_sys_global(slot + NOTIFY_EPOCH);  // after the tail: a slot published before it is seen
        if (seen >= static_cast<u64>(epoch)) break;
        const i64* hdr = reinterpret_cast<const i64*>(
            region0 + RING_OFFSET + static_cast<i64>(consumed % static_cast<u64>(L.num_slots)) * L.chunk_bytes);
        const i64 theirs = ld_volatile_global(hdr + HDR_MAGIC) == static_cast<i64>(HDR_MAGIC_VALUE)
                               ? ld_volatile_global(hdr + HDR_OP) : 0;
        fail(s_ctx, ROLE_NOTIFY, s, a.op | FORM_COUNTS, theirs, ERR_MISMATCH, FIELD_FORM);
        s_abort = 1;
        break;
      }
      if (!spin.ok(ROLE_NOTIFY, s, static_cast<u64>(epoch), seen)) {
        s_abort = 1;
        break;
      }
      seen = ld_acquire_sys_global(slot + NOTIFY_EPOCH);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *a.epoch_word = epoch;
  if (s_abort) {
    if (a.table != nullptr && threadIdx.x == 0) skip_tables(a.table, a.world_size);
    if (a.done != nullptr && threadIdx.x == 0) st_release_sys_global(a.done, a.ticket);  // the record says why
    return;
  }
  const i64 row = NOTIFY_HDR_WORDS - 1 + a.num_values;  // recv_meta[s, :] = [op, status, sig, values...]
  const i64 total_in = static_cast<i64>(a.world_size) * row;
  for (i64 i = threadIdx.x; i < total_in; i += blockDim.x) {
    const int s = static_cast<int>(i / row);
    const i64 j = i % row;
    const u8* slot = my_base + L.notify_slot(parity, s, a.world_size);
    const i64 v = static_cast<i64>(ld_acquire_sys_global(reinterpret_cast<const u64*>(slot) + NOTIFY_OP + j));
    a.recv_meta[i] = v;
    if (j == 0) s_op[s] = v;
    else if (j == 1) s_status[s] = v;
    else if (j == 2) s_sig[s] = v;
    else if (j == 3) s_recv0[s] = v;
  }
  if (a.sums != nullptr) {
    for (int j = threadIdx.x; j < a.num_values; j += blockDim.x) {
      i64 acc = 0;
      for (int s = 0; s < a.world_size; ++s) {
        const u8* slot = my_base + L.notify_slot(parity, s, a.world_size);
        acc += static_cast<i64>(ld_acquire_sys_global(reinterpret_cast<const u64*>(slot) + NOTIFY_HDR_WORDS + j));
      }
      a.sums[j] = acc;
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (a.table != nullptr) {
  i64 skip = 0;
  if (a.device_checks) {
    for (int s = 0; s < a.world_size; ++s) {
      if (s_status[s] == HDR_REJECTED) {
        skip = 1;
        if (atomicCAS(reinterpret_cast<unsigned long long*>(a.status + STATUS_REJECTED_BY), 0ull,
                      static_cast<unsigned long long>(s + 1)) == 0ull) {
          a.status[STATUS_REJECTED_SEQ] = static_cast<i64>(a.seq);
          a.status[STATUS_REJECTED_WHY] = REJECT_ARGS;
        }
      } else if (s_op[s] != a.op) {
        skip = 1;
        fail(s_ctx, ROLE_NOTIFY, s, a.op, s_op[s], ERR_MISMATCH, FIELD_OP);
      } else if (s_sig[s] != a.sig) {
        skip = 1;
        if (atomicCAS(reinterpret_cast<unsigned long long*>(a.status + STATUS_REJECTED_BY), 0ull,
                      static_cast<unsigned long long>(s + 1)) == 0ull) {
          a.status[STATUS_REJECTED_SEQ] = static_cast<i64>(a.seq);
          a.status[STATUS_REJECTED_WHY] = REJECT_SIG;
        }
      }
    }
  }
  i64* fwd = a.table;
  i64* rev = a.table + CT_WORDS;
  const int W = a.world_size;
  i64 send_first = 0, recv_first = 0, recv_rows = 0;
  for (int p = 0; p < W; ++p) {
    const i64 su = s_send0[p] * a.scale, ru = s_recv0[p] * a.scale;
    fwd[CT_PEERS + p] = send_first;
    fwd[CT_PEERS + W + p] = su;
    fwd[CT_PEERS + 2 * W + p] = recv_first;
    fwd[CT_PEERS + 3 * W + p] = ru;
    rev[CT_PEERS + p] = recv_first;  // the reverse call (combine) moves no rows to itself: its reduction reads
    rev[CT_PEERS + W + p] = p == a.rank ? 0 : ru;  // this rank's rows straight from the combine's input
    rev[CT_PEERS + 2 * W + p] = send_first;
    rev[CT_PEERS + 3 * W + p] = p == a.rank ? 0 : su;
    send_first += su;
    recv_first += ru;
    recv_rows += s_recv0[p];
  }
  if (!skip && a.capacity >= 0 && recv_rows > a.capacity) {
    skip = 1;
    fail(s_ctx, ROLE_NOTIFY, -1, a.capacity, recv_rows, ERR_MISMATCH, FIELD_CAPACITY);
  }
  fwd[CT_SKIP] = rev[CT_SKIP] = 0;
  fwd[CT_RECV_TOTAL] = recv_rows;
  i64 send_rows = 0;
  for (int p = 0; p < W; ++p) send_rows += s_send0[p];
  rev[CT_RECV_TOTAL] = send_rows;
  if (skip) skip_tables(a.table, W);
  }
  // done (host-mapped): the host spins on it instead of synchronising the stream (eager calls): the release
  // covers this thread's stores and, through the __syncthreads above, the block's (recv_meta, send_echo, sums)
  if (a.done != nullptr) st_release_sys_global(a.done, a.ticket);
}

extern "C" __global__ void __launch_bounds__(1024) symbuf_notify(const __grid_constant__ NotifyArgs a) {
  notify_body(a);
}

// An eager MoE dispatch's layout and count exchange in one launch (MoeNotifyArgs: NotifyArgs' fields and the
// layout's): the layout body (moe_layout.cuh) writes is_token_in_rank, pos, send_idx, the count exchange's values
// at send_meta and the bad-value count at local_reject, then (after its closing barrier: the block's writes are
// visible to the block) the count exchange sends those values, exactly as symbuf_notify after symbuf_moe_layout on
// one stream. Dynamic shared memory: num_experts int32 counters (the launcher keeps num_experts within what fits
// next to both bodies' static arrays).
extern "C" __global__ void __launch_bounds__(1024) symbuf_moe_layout_notify(const __grid_constant__ MoeNotifyArgs a) {
  moe_layout_body(a.idx, a.num_tokens, a.num_topk, a.num_experts, a.world_size, nullptr, nullptr, a.in_rank,
                  const_cast<i64*>(a.send_meta), const_cast<i64*>(a.local_reject), nullptr, a.pos, a.send_idx);
  notify_body(a);
}

// FLAG_CE, after the host's copy-engine copies (stream order: they are complete): for every (channel, peer), hand
// the header slot of the peer's run back (head = our receiver's state counter, which the ring kernel left at
// the call's end, into the peer's buffer; st.release.sys), then wait until the peer did the same for ours (head in
// our buffer >= our sender's state counter: its copy engine has finished reading our sendbuf), bounded, polling
// the abort word. One thread per (channel, peer) pair, any block size.
extern "C" __global__ void symbuf_ce_finish(const __grid_constant__ CeFinishArgs a) {
  const Layout L{a.region_bytes, a.channel_bytes, 0, 0, 0, 0};
  const u64* __restrict__ peer_bases = a.peer_bases;
  const int rank = a.rank, world_size = a.world_size;
  __shared__ WaitCtx s_ctx;
  if (threadIdx.x == 0)
    s_ctx = make_wait_ctx(a.status, peer_bases, rank, world_size, 0, a.abort_offset, a.timeout_ns, a.seq);
  __syncthreads();
  for (int i = threadIdx.x; i < a.num_channels * world_size; i += blockDim.x) {
    const int channel = i / world_size, peer = i % world_size;
    if (peer == rank) continue;
    const u8* local_region = reinterpret_cast<const u8*>(peer_bases[rank]) + L.region(channel, peer);
    u8* remote_region = reinterpret_cast<u8*>(peer_bases[peer]) + L.region(channel, rank);
    const u64 recv_end = reinterpret_cast<const u64*>(local_region + RECV_STATE_OFFSET)[STATE_COUNTER];
    const u64 send_end = reinterpret_cast<const u64*>(local_region + SEND_STATE_OFFSET)[STATE_COUNTER];
    publish_head(reinterpret_cast<u64*>(remote_region + HEAD_OFFSET), recv_end);
    const u64* head_line = reinterpret_cast<const u64*>(local_region + HEAD_OFFSET);
    WaitCtx ctx = s_ctx;  // the error record names this pair's channel
    ctx.channel = channel;
    SpinBudget spin(&ctx);
    u64 head = ld_acquire_sys_global(head_line);
    while (head < send_end) {
      if (!spin.ok(ROLE_SEND, peer, head, send_end)) break;
      head = ld_acquire_sys_global(head_line);
    }
  }
}

// alltoallv with device-side counts: counts [world_size] int64 (rows per destination, on the device) become the
// count exchange's values meta [world_size, 1], and bad[0] = 1 when one is negative or they do not sum to `rows`
// (the rows of sendbuf): the count exchange then rejects the call on every rank (local_reject) before any byte
// moves. bad[1] = the first negative destination, or -1 (a wrong sum). One warp.
extern "C" __global__ void symbuf_counts_meta(const __grid_constant__ CountsMetaArgs a) {
  if (threadIdx.x != 0) return;
  i64 sum = 0, first_negative = -1;
  for (int p = 0; p < a.world_size; ++p) {
    const i64 c = a.counts[p];
    if (c < 0 && first_negative < 0) first_negative = p;
    sum += c;
    a.meta[p] = c;
  }
  a.bad[0] = (first_negative >= 0 || sum != a.rows) ? 1 : 0;
  a.bad[1] = first_negative;
}
