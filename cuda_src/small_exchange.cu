// The small-message protocol (flag in data, NCCL's LL idea): one GPU alltoall of at most small_peer_bytes per peer
// (ChannelLayout.small_peer_bytes; wire/protocol.py SMALL_*) in one launch, with no ring slot, no tail and no head.
//
// Words (protocol.cuh, "the small-message protocol's words"): for call seq, rank s writes into rank d's small
// region, slot (half seq & 1, source s), three header words (op | status << 8, signature, bytes per peer) and one
// word per 4 payload bytes, each one 8-byte relaxed system-scope store (small_store: st.volatile) of
// datum | small_flag(seq) << 32. d polls its words (small_load) until each carries the flag and keeps the datum.
// Memory ordering: every word carries its own flag and is naturally aligned, so it is single-copy atomic (never
// torn): a word with the call's flag holds the call's datum, whatever order the words arrive in, so no fence and no
// release / acquire pair is needed for the payload.
//
// Work: world_size * items_per_peer items, item k = (peer k / items_per_peer, share k % items_per_peer of the
// words), both directions (our share of the run to the peer stored into its slot, its share of the run to us polled
// in ours; our own rank's items copy our own rows). Grid: at most the rank's SM share (Config.num_sms, as the ring
// kernel) blocks of SMALL_THREADS, block b taking items b, b + gridDim.x, ...: first it stores every item of its
// own, then it waits for every item's words, so no block ever waits before its own stores are done and a wait
// depends only on the peer's blocks having been scheduled (as the ring kernel's sender / receiver blocks do).
//
// Sequence numbers: the ring's. Every item of peer p reads seq = STATE_SEQ + 1 of (channel 0, p)'s send and
// receive state lines (send: our flag; receive: the flag we expect); the last item of p to finish (a count per
// peer in the control words, atomicAdd) advances STATE_SEQ of every channel's state lines for p, both directions, and
// leaves STATE_COUNTER alone, so ring calls before and after this one carry the sequence numbers their peers expect.
// Every item reads the lines before it counts itself finished, so none reads an advanced line.
//
// Reuse of a half without acknowledgements: call seq writes half seq & 1 of the peer's slot; the next writer of that
// half is call seq + 2. For s to launch call seq + 2 its call seq + 1 must have ended, and every call (small or ring,
// rejected or not) ends on s only after s received something d sent in that same call (its words, a ring header);
// d sends for call seq + 1 only from a kernel queued after the kernel that read half seq & 1 for call seq (stream
// order: that kernel's loads are done before the next kernel's stores). So d has read call seq before s can write
// call seq + 2 there, and a sender is never two calls ahead of a receiver's reads. The kernel boundaries on both
// streams are the fence this needs; a persistent kernel that ran two calls in one launch would need a
// fence.acq_rel.sys between a call's last poll and the next call's first store instead.
//
// The flag's wrap (protocol.cuh): the block that sends item (peer, 0), the peer's header, zeroes the peer's slot of
// the other half in our buffer first when small_zero_next(seq) (the first two calls of each half in a new epoch of
// 2 M calls); the ring kernel does the same for its calls, so no word of an older epoch can match a flag.
//
// Agreement: the receiver checks the header (op, signature, bytes per peer: ERR_MISMATCH, fatal, on every rank)
// before it keeps any word. A peer whose call went through the rings sends ring headers instead: our receive polls
// (channel 0, peer)'s tail too, and a header of THIS call there (its seq) is a rejection (HDR_REJECTED: the rejecting
// rank's kernel is the ring kernel, FLAG_REJECT; we consume its header on every channel and record the rejection,
// and its receivers consume our small header instead of a ring one: ring_prims.cuh accept_small_rejected) or a
// fatal FIELD_MODE mismatch (the peer's call is another size or operation). A header of a LATER call (the peer
// finished this one, our words are visible after its acquire) is no news. Every wait is bounded by timeout_ns and
// polls the abort word (SpinBudget); the first failure writes the error record (role recv, rank, peer, channel 0;
// a timeout: head = the flag waited for, tail = the flag found; a mismatch: head / tail = expected / received).
// Telemetry (trace != nullptr, Config(trace=True)): a record per item and direction (TRACE_SEND / TRACE_RECV /
// TRACE_SELF, channel 0, the payload bytes).
// Phase stamps (-DSYMBUF_SMALL_PROFILE=1, a profiling build; wire/protocol.py SMALL_PROF_*): thread 0 of a block
// stamps its phases into shared memory and writes them as one record of symbuf_small_prof at its end. Off (the
// default), the SMALL_PROF_* macros are empty and the kernel is the same code.
#include "ring_prims.cuh"

#ifndef SYMBUF_SMALL_PROFILE
#define SYMBUF_SMALL_PROFILE 0
#endif
// SYMBUF_SMALL_PIPELINE (default 1): a thread's words move in batches of SYMBUF_SMALL_BATCH, loads in flight
// together (the sender's source words before their stores; the receiver's words, the first batch before the
// header's verdict, then a re-load of only those without the flag), and the receive state lines are read with the
// send line in phase 1. 0: one source load per store, the header's verdict before any word is loaded, 4 loads in
// flight and a spin per missing word (the same wire, for a same-run comparison).
#ifndef SYMBUF_SMALL_PIPELINE
#define SYMBUF_SMALL_PIPELINE 1
#endif
// SYMBUF_SMALL_FINISH (default 1): an item's end-of-call count is one acq_rel atomic (none with one item per
// peer); 0: two full fences around an atomicAdd and an atomicExch (the same result, for a same-run comparison).
#ifndef SYMBUF_SMALL_FINISH
#define SYMBUF_SMALL_FINISH 1
#endif
// SYMBUF_SMALL_BATCH: 16 fits the block's 128 registers a thread (ptxas, sm_90: 24 spills a few bytes, 32 more).
#ifndef SYMBUF_SMALL_BATCH
#define SYMBUF_SMALL_BATCH 16
#endif
#if SYMBUF_SMALL_PROFILE
// [SMALL_PROF_BLOCKS] launch counters, then [SMALL_PROF_CALLS][SMALL_PROF_BLOCKS][SMALL_PROF_RECORD] records
__device__ u64 symbuf_small_prof[SMALL_PROF_BLOCKS * (1 + SMALL_PROF_CALLS * SMALL_PROF_RECORD)];

// Thread 0: phase w's stamps (%globaltimer ns, clock64 cycles) into the block's record in shared memory.
__device__ __forceinline__ void small_prof_stamp(u64* rec, int w) {
  rec[w] = globaltimer_ns();
  rec[SMALL_PROF_PHASES + w] = static_cast<u64>(clock64());
}

// Thread 0 at the block's end: the record into slot (this block's launches so far) % SMALL_PROF_CALLS. The block's
// own counter: launches on one stream run one after another, so no other thread writes it meanwhile.
__device__ __noinline__ void small_prof_write(const u64* rec) {
  if (blockIdx.x >= SMALL_PROF_BLOCKS) return;
  u64* counter = symbuf_small_prof + blockIdx.x;
  const u64 call = *counter;
  u64* out = symbuf_small_prof + SMALL_PROF_BLOCKS +
             ((call % SMALL_PROF_CALLS) * SMALL_PROF_BLOCKS + blockIdx.x) * SMALL_PROF_RECORD;
  for (int w = 0; w < SMALL_PROF_RECORD; ++w) out[w] = rec[w];
  *counter = call + 1;
}
#define SMALL_PROF_SHARED __shared__ u64 s_prof[SMALL_PROF_RECORD]
#define SMALL_PROF(w)                                  \
  do {                                                 \
    if (threadIdx.x == 0) small_prof_stamp(s_prof, w); \
  } while (0)
#define SMALL_PROF_SYNC() __syncthreads()
#define SMALL_PROF_DO(...) \
  do {                     \
    __VA_ARGS__;           \
  } while (0)
#else
#define SMALL_PROF_SHARED
#define SMALL_PROF(w) \
  do {                \
  } while (0)
#define SMALL_PROF_SYNC() \
  do {                    \
  } while (0)
#define SMALL_PROF_DO(...) \
  do {                     \
  } while (0)
#endif

static_assert(SMALL_H_OP == 0 && SMALL_H_SIG == 1 && SMALL_H_BYTES == 2 && SMALL_DATA_WORD >= 3,
              "the header's three words come first in a slot, thread k stores word k");
static_assert(MAX_PEERS * 4 <= SMALL_CTRL_BYTES, "an int32 per peer in the control words");

// The header step's verdict when the peer rejected this call through the rings (its ring headers are consumed by
// the peer's last item); kGateCopy / kGateSkip (a small header saying HDR_REJECTED) / kGateAbort otherwise.
constexpr u64 kSmallRingRejected = 5;

// 4 payload bytes (word i) of an n-byte run of our sendbuf (read-only during the kernel); the last word of a run
// whose size is not a multiple of 4 holds the bytes that remain, zero-padded.
__device__ __forceinline__ u32 small_pack(const u8* src, i64 i, i64 n, bool aligned) {
  if (aligned && 4 * i + 4 <= n) return ld_nc_global(reinterpret_cast<const u32*>(src) + i);
  u32 v = 0;
  for (int b = 0; b < 4 && 4 * i + b < n; ++b) v |= static_cast<u32>(ld_nc_global(src + 4 * i + b)) << (8 * b);
  return v;
}

// Word i's payload into the n-byte run of our output.
__device__ __forceinline__ void small_unpack(u8* dst, i64 i, i64 n, bool aligned, u32 v) {
  if (aligned && 4 * i + 4 <= n) {
    reinterpret_cast<u32*>(dst)[i] = v;
    return;
  }
  for (int b = 0; b < 4 && 4 * i + b < n; ++b) dst[4 * i + b] = static_cast<u8>(v >> (8 * b));
}

// A fatal difference in the peer's header (or its ring header of this call): recorded, the abort word set on every
// rank.
__device__ __noinline__ u64 small_fatal(const WaitCtx* c, int peer, i64 expected, i64 received, int field) {
  fail(*c, ROLE_RECV, peer, expected, received, ERR_MISMATCH, field);
  return kGateAbort;
}

// Thread 0 of a block, before any payload word is kept: the peer's header of call qr (flag small_flag(qr)) in our
// slot `in`, checked against our call; or the peer's ring header of this call (see the file's comment). `local0`:
// our (channel 0, peer) region, `first0`: its receive counter at the start of the call.
__device__ __noinline__ u64 small_header_step(const WaitCtx* c, const u64* in, const u8* local0, i64 num_slots,
                                              i64 chunk_bytes, u64 qr, u64 first0, int peer, i64 op, i64 sig,
                                              i64 n) {
  const u32 flag = small_flag(qr);
  const u64* tail0 = reinterpret_cast<const u64*>(local0 + TAIL_OFFSET);
  SpinBudget spin(c);
  bool later = false;  // the peer's ring header of a later call was seen: this call's words are visible to us now
  u64 h[3];
  while (true) {
    int got = 0;
    for (int k = 0; k < 3; ++k) {
      h[k] = small_load(in + k);
      got += static_cast<u32>(h[k] >> 32) == flag ? 1 : 0;
    }
    if (got == 3) break;
    if (!later && static_cast<u64>(ld_volatile_global(reinterpret_cast<const i64*>(tail0))) > first0) {
      // a ring header at counter first0: the acquire orders its loads (and, when the peer is a call ahead, the
      // words its earlier kernel stored for this call, which happen before that release in its stream order)
      (void)ld_acquire_sys_global(tail0);
      const CallHeader r =
          read_call_header(local0 + RING_OFFSET + static_cast<i64>(first0 % static_cast<u64>(num_slots)) * chunk_bytes);
      if (r.seq == static_cast<i64>(qr)) {  // this very call went through the rings on the peer
        if (r.magic != static_cast<i64>(HDR_MAGIC_VALUE))
          return small_fatal(c, peer, static_cast<i64>(HDR_MAGIC_VALUE), r.magic, FIELD_MAGIC);
        if (r.op != op) return small_fatal(c, peer, op, r.op, FIELD_OP);
        if (r.status == HDR_REJECTED) return kSmallRingRejected;
        return small_fatal(c, peer, MODE_SMALL, r.mode, FIELD_MODE);  // another size: the peer's call is not small
      }
      later = true;
    }
    if (!spin.ok(ROLE_RECV, peer, static_cast<u64>(flag), h[SMALL_H_OP] >> 32)) return kGateAbort;
  }
  const u32 hop = static_cast<u32>(h[SMALL_H_OP]);
  if (static_cast<i64>(hop & 0xFFu) != op) return small_fatal(c, peer, op, hop & 0xFFu, FIELD_OP);
  if (((hop >> 8) & 0xFFu) == HDR_REJECTED) return kGateSkip;  // no payload follows
  if (static_cast<u32>(h[SMALL_H_SIG]) != static_cast<u32>(sig))
    return small_fatal(c, peer, sig, static_cast<u32>(h[SMALL_H_SIG]), FIELD_SIG);
  if (static_cast<i64>(static_cast<u32>(h[SMALL_H_BYTES])) != n)
    return small_fatal(c, peer, n, static_cast<u32>(h[SMALL_H_BYTES]), FIELD_UNITS);
  return kGateCopy;
}

// One payload word that had not arrived at the first load: bounded spin (abort word polled); 0 and *abort_flag set
// when the wait failed.
__device__ __noinline__ u64 small_spin_word(const WaitCtx* c, const u64* w, u32 flag, int peer,
                                            volatile int* abort_flag) {
  SpinBudget spin(c);
  while (true) {
    const u64 v = small_load(w);
    if (static_cast<u32>(v >> 32) == flag) return v;
    if (*abort_flag || !spin.ok(ROLE_RECV, peer, static_cast<u64>(flag), v >> 32)) {
      *abort_flag = 1;
      return 0;
    }
  }
}

// The peer rejected this call through the rings (its kernel is the ring kernel with FLAG_REJECT): on every channel,
// wait for its call header (bounded), check it is this call's rejected header, hand the slot back (head = first + 1
// into its buffer, st.release.sys) and advance our receive state line over it, as the ring's drain_rejected does.
// False (the record written, the abort word set) when a wait failed or a header is not the expected one.
__device__ __noinline__ bool small_consume_rejection(const WaitCtx* c, const SmallArgs& a, const Layout& L,
                                                     int peer, u64 qr) {
  u8* my_base = reinterpret_cast<u8*>(a.peer_bases[a.rank]);
  u8* peer_base = reinterpret_cast<u8*>(a.peer_bases[peer]);
  for (int ch = 0; ch < a.num_channels; ++ch) {
    u8* local = my_base + L.region(ch, peer);
    u64* rs = reinterpret_cast<u64*>(local + RECV_STATE_OFFSET);
    const u64 first = rs[STATE_COUNTER];
    WaitCtx ctx = *c;
    ctx.channel = ch;
    int abort_flag = 0;
    u64 tail = 0;
    if (!wait_for_data(&ctx, peer, reinterpret_cast<const u64*>(local + TAIL_OFFSET), first + 1, first, first,
                       L.num_slots, tail, &abort_flag))
      return false;
    const CallHeader h =
        read_call_header(local + RING_OFFSET + static_cast<i64>(first % static_cast<u64>(L.num_slots)) * L.chunk_bytes);
    int field = 0;
    i64 expected = 0, received = 0;
    if (h.magic != static_cast<i64>(HDR_MAGIC_VALUE))
      field = FIELD_MAGIC, expected = static_cast<i64>(HDR_MAGIC_VALUE), received = h.magic;
    else if (h.seq != static_cast<i64>(qr)) field = FIELD_SEQ, expected = static_cast<i64>(qr), received = h.seq;
    else if (h.op != a.op) field = FIELD_OP, expected = a.op, received = h.op;
    else if (h.status != HDR_REJECTED || h.nchunks != 0) field = FIELD_MODE, expected = MODE_SMALL, received = h.mode;
    if (field) {
      fail(ctx, ROLE_RECV, peer, expected, received, ERR_MISMATCH, field);
      return false;
    }
    publish_head(reinterpret_cast<u64*>(peer_base + L.region(ch, a.rank) + HEAD_OFFSET), first + 1);
    rs[STATE_COUNTER] = first + 1;
    rs[STATE_SEQ] = qr;
  }
  return true;
}

// Thread 0 of a block at the end of an item of a peer: count the item finished (or failed) in the peer's control
// word; the last item of the peer does the call's bookkeeping: the control word back to 0 for the next launch, and
// unless an item of the peer failed (the record says why; nothing moves: the communicator is broken anyway) the
// rejection's ring headers consumed, every channel's state lines of the peer advanced to call qs (send) / qr
// (receive) with their counters unchanged, and a rejection recorded (STATUS_REJECTED_BY, not fatal).
__device__ __noinline__ void small_finish(const WaitCtx* c, const SmallArgs& a, const Layout& L, int peer,
                                          u64 verdict, bool failed, u64 qs, u64 qr) {
  u8* my_base = reinterpret_cast<u8*>(a.peer_bases[a.rank]);
  unsigned int* ctrl = reinterpret_cast<unsigned int*>(my_base + a.small_offset) + peer;
  const unsigned int inc = failed ? 0x10000u : 1u;
#if SYMBUF_SMALL_FINISH
  // One item per peer: its thread 0 read the state lines earlier in program order, nothing to count. Several:
  // one acq_rel add (release: this item's reads of the state lines before its count; acquire, in the last item:
  // every other item's reads before the lines change below), then the last item resets the count with a plain
  // store (no other item of this call touches it again; the next call's kernel runs after this one ends).
  unsigned int now = inc;
  if (a.items_per_peer > 1) {
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(now) : "l"(ctrl), "r"(inc) : "memory");
    now += inc;
    if (static_cast<int>((now & 0xFFFFu) + (now >> 16)) != a.items_per_peer) return;  // not the last one
    *ctrl = 0u;
  }
#else
  __threadfence();  // this item's reads of the state lines (and its loads) before its count
  const unsigned int now = atomicAdd(ctrl, inc) + inc;
  if (static_cast<int>((now & 0xFFFFu) + (now >> 16)) != a.items_per_peer) return;  // not the last one
  atomicExch(ctrl, 0u);
  __threadfence();  // every item's count (after its reads of the state lines) before the lines change
#endif
  if (now >> 16) return;
  if (verdict == kSmallRingRejected && !small_consume_rejection(c, a, L, peer, qr)) return;
  for (int ch = 0; ch < a.num_channels; ++ch) {
    u8* local = my_base + L.region(ch, peer);
    reinterpret_cast<u64*>(local + SEND_STATE_OFFSET)[STATE_SEQ] = qs;
    reinterpret_cast<u64*>(local + RECV_STATE_OFFSET)[STATE_SEQ] = qr;  // (consumed: already so)
  }
  if (verdict != kGateCopy) record_rejection(*c, peer);
}

#if SYMBUF_SMALL_PIPELINE
// How many of words i, i + SMALL_THREADS, ... (at most K) lie below w1: a thread's share of a batch.
template <int K>
__device__ __forceinline__ int small_batch_count(i64 i, i64 w1) {
  return i >= w1 ? 0 : static_cast<int>(min(static_cast<i64>(K), (w1 - i + SMALL_THREADS - 1) / SMALL_THREADS));
}

// The first cnt of words w[0], w[SMALL_THREADS], ... loaded at once: cnt loads in flight per thread.
template <int K>
__device__ __forceinline__ void small_load_batch(u64 (&v)[K], const u64* w, int cnt) {
#pragma unroll
  for (int u = 0; u < K; ++u) v[u] = u < cnt ? small_load(w + u * SMALL_THREADS) : 0;
}

// The batch small_load_batch loaded into v (words i, i + SMALL_THREADS, ... of the item, cnt of them, from w =
// words + i): the words without the call's flag are loaded again, all at once, until every one has it (a bounded
// wait: SpinBudget polls the abort word; *abort_flag stops it when another thread of the block failed), then every
// datum goes to dst. False when the wait failed (*abort_flag set; the error record names the flag waited for and
// the one found in the first word still missing).
template <int K>
__device__ __forceinline__ bool small_take_batch(u64 (&v)[K], const u64* w, i64 i, int cnt, u32 flag, u8* dst, i64 n,
                                                 bool aligned, const WaitCtx* c, int peer, volatile int* abort_flag) {
  static_assert(K >= 1 && K <= 32, "a bit per word of the batch");
  u32 missing = 0;
#pragma unroll
  for (int u = 0; u < K; ++u)
    if (u < cnt && static_cast<u32>(v[u] >> 32) != flag) missing |= 1u << u;
  if (missing) {
    SpinBudget spin(c);
    do {
#pragma unroll
      for (int u = 0; u < K; ++u)
        if ((missing >> u) & 1u) v[u] = small_load(w + u * SMALL_THREADS);
      u64 found = 0;
#pragma unroll
      for (int u = K - 1; u >= 0; --u)
        if ((missing >> u) & 1u) {
          if (static_cast<u32>(v[u] >> 32) == flag) missing &= ~(1u << u);
          else found = v[u] >> 32;
        }
      if (missing && (*abort_flag || !spin.ok(ROLE_RECV, peer, static_cast<u64>(flag), found))) {
        *abort_flag = 1;
        return false;
      }
    } while (missing);
  }
  if (aligned && 4 * (i + static_cast<i64>(cnt - 1) * SMALL_THREADS) + 4 <= n) {  // whole words only
    u32* d = reinterpret_cast<u32*>(dst) + i;
#pragma unroll
    for (int u = 0; u < K; ++u)
      if (u < cnt) d[u * SMALL_THREADS] = static_cast<u32>(v[u]);
  } else {
#pragma unroll
    for (int u = 0; u < K; ++u)
      if (u < cnt) small_unpack(dst, i + static_cast<i64>(u) * SMALL_THREADS, n, aligned, static_cast<u32>(v[u]));
  }
  return true;
}
#endif

extern "C" __global__ void __launch_bounds__(SMALL_THREADS) symbuf_small_alltoall(const __grid_constant__ SmallArgs a) {
  __shared__ WaitCtx s_ctx;
  __shared__ u64 s_seq, s_first0, s_verdict;
  __shared__ int s_abort;
#if SYMBUF_SMALL_PIPELINE
  __shared__ u64 s_qr, s_first0_cached, s_qr_cached;  // see phase 1
  __shared__ int s_rk;
  if (threadIdx.x == 0) s_abort = 0;  // then thread 0 again at the end of each item (phase 2)
#endif
  SMALL_PROF_SHARED;
  const int rank = a.rank, world_size = a.world_size, per = a.items_per_peer;
  const int items = world_size * per;  // (peer, share) items, item k = peer k / per, share k % per
  const i64 n = a.bytes;               // per peer
  const i64 nw = (n + 3) / 4;
  const Layout L{a.region_bytes, a.channel_bytes, a.num_slots, a.chunk_bytes, 0, 0};
  u8* const my_base = reinterpret_cast<u8*>(a.peer_bases[rank]);
  SMALL_PROF_DO(if (threadIdx.x == 0) {
    for (int w = 0; w < SMALL_PROF_RECORD; ++w) s_prof[w] = 0;
    small_prof_stamp(s_prof, SMALL_PROF_START);
  });
  if (threadIdx.x == 0)
    s_ctx = make_wait_ctx(a.status, a.peer_bases, rank, world_size, 0, a.abort_offset, a.timeout_ns, a.seq);

  // Phase 1, every item of this block: send (or copy our own rows). No wait here, so every block's stores are
  // done before any of its waits: a wait depends only on the peer's blocks having run, never on another wait.
  for (int k = blockIdx.x; k < items; k += gridDim.x) {
    const int peer = k / per, part = k % per;
    const i64 w0 = nw * part / per, w1 = nw * (part + 1) / per;  // this item's words
    if (peer == rank) {  // our own rows: the item's share, a plain copy (warp slices, 16-byte cuts)
      const i64 b0 = min(4 * w0, n), b1 = min(4 * w1, n);
      const u64 t0 = globaltimer_ns();
      copy_slice<false>(a.recv + rank * n + b0, a.send + rank * n + b0, b1 - b0, static_cast<int>(threadIdx.x >> 5),
                        static_cast<int>(blockDim.x >> 5), static_cast<int>(threadIdx.x & 31));
      SMALL_PROF_SYNC();
      SMALL_PROF(SMALL_PROF_COPY);
      SMALL_PROF_DO(if (threadIdx.x == 0) s_prof[SMALL_PROF_INFO] += 1);
      if (a.trace != nullptr) {
        __syncthreads();
        if (threadIdx.x == 0 && b1 > b0)
          trace_record(a.trace, a.trace_cap, a.seq, a.op, TRACE_SELF, t0, 0, -1, b1 - b0, 0, 0);
      }
      continue;
    }
    __syncthreads();  // the previous item's reads of s_seq are done
#if SYMBUF_SMALL_PIPELINE
    if (threadIdx.x == 0) {
      // the receive lines of the same item in the same round trip, kept for phase 2 when this is the block's last
      // send item (its last receive item too: one item per block in the usual grid, so the block's only one);
      // read, as phase 2 would, before the item counts itself finished
      const u8* local0 = my_base + L.region(0, peer);
      s_seq = reinterpret_cast<const u64*>(local0 + SEND_STATE_OFFSET)[STATE_SEQ] + 1;
      s_qr_cached = reinterpret_cast<const u64*>(local0 + RECV_STATE_OFFSET)[STATE_SEQ] + 1;
      s_first0_cached = reinterpret_cast<const u64*>(local0 + RECV_STATE_OFFSET)[STATE_COUNTER];
      s_rk = k;
    }
#else
    if (threadIdx.x == 0)
      s_seq = reinterpret_cast<const u64*>(my_base + L.region(0, peer) + SEND_STATE_OFFSET)[STATE_SEQ] + 1;
#endif
    __syncthreads();
    SMALL_PROF(SMALL_PROF_SEQ);
    const u64 t0 = globaltimer_ns();
    const u64 qs = s_seq;
    u64* out = reinterpret_cast<u64*>(reinterpret_cast<u8*>(a.peer_bases[peer]) +
                                      small_slot(a.small_offset, a.slot_bytes, qs, rank, world_size));
    const u64 fs = static_cast<u64>(small_flag(qs)) << 32;
    if (part == 0 && small_zero_next(qs)) {
      // the flag's wrap (protocol.cuh): the slot the peer writes in our buffer for its call qs + 1, zeroed before
      // our header of this call goes out (every thread fences its zeros; the barrier, then the header threads'
      // fence, order them before the header stores: the peer stores call qs + 1 only after its kernel read this
      // header). The block of item (peer, 0) zeroes the whole slot: the peer's rejecting ring kernel reads our
      // header alone, so a zeroing by another item's block would be ordered before nothing the peer waits for.
      small_zero_slot(my_base + small_slot(a.small_offset, a.slot_bytes, qs + 1, peer, world_size), a.slot_bytes,
                      static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
      __syncthreads();
      if (threadIdx.x < 3) __threadfence_system();
    }
    if (part == 0 && threadIdx.x < 3) {
      const u64 op_status = (static_cast<u64>(a.op) & 0xFFull) | (static_cast<u64>(HDR_OK) << 8);
      const u64 info = threadIdx.x == SMALL_H_OP    ? op_status
                       : threadIdx.x == SMALL_H_SIG ? static_cast<u64>(a.sig) & 0xFFFFFFFFull
                                                    : static_cast<u64>(n);
      small_store(out + threadIdx.x, fs | info);
    }
    const u8* src = a.send + peer * n;
    const bool aligned = (reinterpret_cast<u64>(src) & 3) == 0;
#if SYMBUF_SMALL_PIPELINE
    // a thread's SYMBUF_SMALL_BATCH source words loaded before the first of their stores (word i, i +
    // SMALL_THREADS, ...: the launch's block size), so the loads wait once per batch instead of once per word
    for (i64 i = w0 + threadIdx.x; i < w1; i += SYMBUF_SMALL_BATCH * SMALL_THREADS) {
      const int cnt = small_batch_count<SYMBUF_SMALL_BATCH>(i, w1);
      u32 d[SYMBUF_SMALL_BATCH];
      if (aligned && 4 * (i + static_cast<i64>(cnt - 1) * SMALL_THREADS) + 4 <= n) {  // whole words only
        const u32* s = reinterpret_cast<const u32*>(src) + i;
#pragma unroll
        for (int u = 0; u < SYMBUF_SMALL_BATCH; ++u) d[u] = u < cnt ? ld_nc_global(s + u * SMALL_THREADS) : 0u;
      } else {
#pragma unroll
        for (int u = 0; u < SYMBUF_SMALL_BATCH; ++u)
          d[u] = u < cnt ? small_pack(src, i + static_cast<i64>(u) * SMALL_THREADS, n, aligned) : 0u;
      }
      u64* o = out + SMALL_DATA_WORD + i;
#pragma unroll
      for (int u = 0; u < SYMBUF_SMALL_BATCH; ++u)
        if (u < cnt) small_store(o + u * SMALL_THREADS, fs | d[u]);
    }
#else
    for (i64 i = w0 + threadIdx.x; i < w1; i += blockDim.x)
      small_store(out + SMALL_DATA_WORD + i, fs | small_pack(src, i, n, aligned));
#endif
    if (a.trace != nullptr) {  // the item's payload bytes (the words: twice as many on the wire)
      __syncthreads();
      if (threadIdx.x == 0)
        trace_record(a.trace, a.trace_cap, a.seq, a.op, TRACE_SEND, t0, 0, peer, min(4 * w1, n) - min(4 * w0, n), qs,
                     qs);
    }
  }

  // Phase 2, every item of this block: the peer's header (thread 0), then every thread its words, then the count.
  for (int k = blockIdx.x; k < items; k += gridDim.x) {
    const int peer = k / per, part = k % per;
    if (peer == rank) continue;
    const i64 w0 = nw * part / per, w1 = nw * (part + 1) / per;
    const u8* const local0 = my_base + L.region(0, peer);
    __syncthreads();  // the previous item is finished with the shared words
    SMALL_PROF(SMALL_PROF_SENT);
#if SYMBUF_SMALL_PIPELINE
    // the item whose receive lines phase 1 read (s_rk, written before a barrier: the same test in every thread)
    // needs no read of its own; s_abort is 0 (the kernel's start or the previous item's end)
    const bool cached = k == s_rk;
    if (!cached) {
      if (threadIdx.x == 0) {
        s_qr = reinterpret_cast<const u64*>(local0 + RECV_STATE_OFFSET)[STATE_SEQ] + 1;
        s_first0 = reinterpret_cast<const u64*>(local0 + RECV_STATE_OFFSET)[STATE_COUNTER];
      }
      __syncthreads();
    }
    SMALL_PROF(SMALL_PROF_RSEQ);
    const u64 qr = cached ? s_qr_cached : s_qr;
    const u64 t0 = globaltimer_ns();
    const u64* in =
        reinterpret_cast<const u64*>(my_base + small_slot(a.small_offset, a.slot_bytes, qr, peer, world_size));
    // the item's first batch of words is loaded before the header is looked at (kept only after its verdict:
    // a word with the call's flag holds the call's datum whenever it was loaded), so their round trip overlaps
    // thread 0's wait for the header
    const u32 flag = small_flag(qr);
    const u64* words = in + SMALL_DATA_WORD;
    i64 i = w0 + threadIdx.x;
    int cnt = small_batch_count<SYMBUF_SMALL_BATCH>(i, w1);
    u64 v[SYMBUF_SMALL_BATCH];
    small_load_batch(v, words + i, cnt);
    if (threadIdx.x == 0) {
      s_verdict = small_header_step(&s_ctx, in, local0, L.num_slots, L.chunk_bytes, qr,
                                    cached ? s_first0_cached : s_first0, peer, a.op, a.sig, n);
      if (s_verdict == kGateAbort) s_abort = 1;
      SMALL_PROF(SMALL_PROF_HEADER);
    }
    __syncthreads();
    const u64 verdict = s_verdict;
    volatile int* abort_flag = &s_abort;
    if (verdict == kGateCopy && cnt > 0) {
      u8* dst = a.recv + peer * n;
      const bool aligned = (reinterpret_cast<u64>(dst) & 3) == 0;
      while (small_take_batch(v, words + i, i, cnt, flag, dst, n, aligned, &s_ctx, peer, abort_flag)) {
        SMALL_PROF_DO(if (i == w0 + threadIdx.x) SMALL_PROF(SMALL_PROF_FIRST));
        i += SYMBUF_SMALL_BATCH * SMALL_THREADS;
        cnt = small_batch_count<SYMBUF_SMALL_BATCH>(i, w1);
        if (cnt == 0 || *abort_flag) break;
        small_load_batch(v, words + i, cnt);
      }
    }
#else
    if (threadIdx.x == 0) {
      s_seq = reinterpret_cast<const u64*>(local0 + RECV_STATE_OFFSET)[STATE_SEQ] + 1;
      s_first0 = reinterpret_cast<const u64*>(local0 + RECV_STATE_OFFSET)[STATE_COUNTER];
      s_abort = 0;
    }
    __syncthreads();
    SMALL_PROF(SMALL_PROF_RSEQ);
    const u64 qr = s_seq;
    const u64 t0 = globaltimer_ns();
    const u64* in =
        reinterpret_cast<const u64*>(my_base + small_slot(a.small_offset, a.slot_bytes, qr, peer, world_size));
    if (threadIdx.x == 0) {
      s_verdict = small_header_step(&s_ctx, in, local0, L.num_slots, L.chunk_bytes, qr, s_first0, peer, a.op, a.sig, n);
      if (s_verdict == kGateAbort) s_abort = 1;
      SMALL_PROF(SMALL_PROF_HEADER);
    }
    __syncthreads();
    const u64 verdict = s_verdict;
    volatile int* abort_flag = &s_abort;
    if (verdict == kGateCopy) {
      u8* dst = a.recv + peer * n;
      const bool aligned = (reinterpret_cast<u64>(dst) & 3) == 0;
      const u32 flag = small_flag(qr);
      const u64* words = in + SMALL_DATA_WORD;
      constexpr int kBatch = 4;  // loads in flight per thread before the first flag is looked at
      const i64 stride = blockDim.x;
      for (i64 i = w0 + threadIdx.x; i < w1 && !*abort_flag; i += kBatch * stride) {
        u64 v[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) v[u] = i + u * stride < w1 ? small_load(words + i + u * stride) : 0;
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const i64 j = i + u * stride;
          if (j >= w1) break;
          if (static_cast<u32>(v[u] >> 32) != flag) {
            v[u] = small_spin_word(&s_ctx, words + j, flag, peer, abort_flag);
            if (*abort_flag) break;
          }
          small_unpack(dst, j, n, aligned, static_cast<u32>(v[u]));
        }
        SMALL_PROF_DO(if (i == w0 + threadIdx.x) SMALL_PROF(SMALL_PROF_FIRST));
      }
    }
#endif
    __syncthreads();
    SMALL_PROF(SMALL_PROF_RECEIVED);
    // the send state line is read in phase 1 by the item's block before this count (program order), the receive
    // line above: the last item's bookkeeping comes after every item's reads of both
    if (threadIdx.x == 0 && verdict == kGateCopy && !*abort_flag)
      trace_record(a.trace, a.trace_cap, a.seq, a.op, TRACE_RECV, t0, 0, peer, min(4 * w1, n) - min(4 * w0, n), qr, qr);
    if (threadIdx.x == 0) {
#if SYMBUF_SMALL_PIPELINE
      // (the cached item's send line: read in phase 1 into s_seq, which no later item of the block rewrote)
      const u64 qs = cached ? s_seq : reinterpret_cast<const u64*>(local0 + SEND_STATE_OFFSET)[STATE_SEQ] + 1;
#else
      const u64 qs = reinterpret_cast<const u64*>(local0 + SEND_STATE_OFFSET)[STATE_SEQ] + 1;
#endif
      small_finish(&s_ctx, a, L, peer, verdict, *abort_flag != 0, qs, qr);
      SMALL_PROF_DO(s_prof[SMALL_PROF_INFO] = ((s_prof[SMALL_PROF_INFO] & 0xFFFFull) + 0x101ull) |
                                              (static_cast<u64>(peer + 1) << 16) | (verdict << 32);
                    s_prof[SMALL_PROF_SEQ_NO] = qr);
#if SYMBUF_SMALL_PIPELINE
      s_abort = 0;  // for the block's next item (the others read it only after that item's barriers)
#endif
    }
  }
  SMALL_PROF(SMALL_PROF_END);
  SMALL_PROF_DO(if (threadIdx.x == 0) small_prof_write(s_prof));
}
