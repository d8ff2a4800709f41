// The ring protocol's roles as device primitives (NCCL's prims_*.h habit): what the leader, the publisher or one copy
// warp of a (channel, peer) warp group does for one step of a call. ring_exchange.cu strings them into one short
// path per mode. Layer 4 of cuda_src/: primitives.cuh (PTX) < layout.cuh (memory map, row runs) < protocol.cuh
// (ring words, bounded waits, abort word, error record, call header) < this file < one .cu per kernel family.
//
//   call header   call_header_step (leader): send_call_header; or the receiver's check (header_agrees), then
//                 drain_rejected (a rejected call: headers only) or accept_ring / accept_direct / accept_push /
//                 accept_ce (which mode the peer's run takes), each handing its verdict (kGate*) to the copy warps
//   publisher     publish_runs (tail / head over runs of finished chunks), direct_done (head after a direct pull)
//   copy warp     await_verdict; per chunk wait_chunk, move_chunk (send_chunk / push_chunk / recv_chunk), post_chunk
//   direct pull   copy_slice out of the peer's block (a receiver's copy warps, and our sender group's helpers)
//   own rows      copy_own_rows (no ring)
//
// The protocol per (channel c, sender s, receiver d) (protocol.cuh: who writes which word), counters in slots, only
// growing, slot = counter % num_slots; first = the counter the previous call left (the group's state line):
//   call header: counter `first`, every call, for every ring group, also when the channel's share is empty. s's
//             publisher waits for space for it (backpressure as for chunks), writes the HDR_* words into d's ring
//             and releases tail = first + 1 at once; d's publisher waits for it, checks magic, seq, op, then (both
//             sides not rejecting) signature and units of the whole run, before any payload is consumed.
//             A difference is fatal (ERR_MISMATCH, abort word set on every rank); a rejected call moves headers
//             only (FLAG_REJECT: the rejecting rank sends HDR_REJECTED headers and drains what its peers send).
//   sender:   warp 0 of each group publishes, the others copy, each owning every (ring_warps - 1)-th payload
//             chunk k (counter first + 1 + k): lane 0 waits while tail - head == num_slots (backpressure; head
//             read with ld.acquire.sys from our own buffer, where d's receiver writes it); the warp copies the
//             chunk's rows into d's ring; __syncwarp; lane 0 marks the chunk done in shared memory
//             (st.release.cta). The publisher acquires the marks in chunk order (ld.acquire.cta) and publishes each
//             run of finished chunks with one st.release.sys of tail into d's buffer.
//   receiver: the mirror image: warp 0 checks the call header and then publishes head, the other warps wait for
//             its verdict (a shared word, release/acquire at cta scope), then each owns every (ring_warps - 1)-th
//             chunk: lane 0 polls tail with ld.acquire.sys until it covers the chunk, the warp copies it out (.cg
//             loads), lane 0 marks it done (st.release.cta); the publisher releases head over each run of done
//             chunks with one st.release.sys into s's buffer.
// Memory ordering: a copy warp's payload stores (sender) or loads (receiver) of a slot are ordered before its lane
// 0's st.release.cta of the done mark by __syncwarp (bar.warp.sync: the lanes' accesses happen before lane 0's
// release, at cta scope); the publisher's ld.acquire.cta of that mark synchronises with it, and its st.release.sys
// of tail / head is cumulative: every access that happened before it (the acquired warps' included) is visible, at
// system scope, to whoever acquires the counter. So d sees the payload before the tail that announces it, s
// overwrites a slot only after d's reads of it, and copy warps never issue a system fence. The header is stored by
// the publisher itself before its own release of tail = first + 1 (program order). The primitives below leave the
// __syncwarp between a warp's accesses and its lane 0's hand-off to their caller, where it shows.
#pragma once
#include "protocol.cuh"

// The sender's publisher releases tail once at least this many chunks are ready (or the run is complete, or
// nothing new became ready for a while): fewer system-scope releases, each covering more payload.
#ifndef SYMBUF_PUBLISH_BATCH
#define SYMBUF_PUBLISH_BATCH 1
#endif

// 1: the call header's slot is announced together with the first run of payload chunks (one system-scope release
// fewer per group and call, on both sides; a header alone is released at once when no payload follows or no chunk
// got ready for a while). 0: the header is released on its own at once (tail = first + 1, head = first + 1).
#ifndef SYMBUF_HEADER_FOLD
#define SYMBUF_HEADER_FOLD 1
#endif

// Verdict of a group's leader on the call header, for its copy warps (a shared word per group, st.release.cta).
constexpr u64 kGateWait = 0;   // not checked yet
constexpr u64 kGateCopy = 1;   // header verified: copy the payload
constexpr u64 kGateSkip = 2;   // no payload to copy (the peer rejected, or this rank rejects and drains)
constexpr u64 kGateAbort = 3;  // mismatch, failed wait or abort: leave
constexpr u64 kGateDirect = 4; // header verified, MODE_DIRECT: copy the share straight out of the sender's block

// ---- the cut of a run into chunks --------------------------------------------------------------------------------
// Rows per chunk of an n-row run on one channel: num_copy chunks per round, in as few rounds as whole slots
// allow (a short run is spread over every copy warp instead of one warp copying one slot; a long one ends on a
// full round); at least CHUNK_LEAST_BYTES of rows (one unrolled warp pass), a multiple of CHUNK_GRAIN_BYTES of rows
// (one vector pass; keeps byte runs 16-byte aligned), at most one slot. Sender and receiver compute it from the
// same n (the rows the one sends the other receives) and the same num_copy (same kernel variant on every rank), so
// they cut the run alike. Same formula as cupy_symbuf/wire/channel_layout.py chunk_rows (the host engine uses it
// with one copy worker).
__host__ __device__ __forceinline__ i64 chunk_rows(i64 n, i64 row_bytes, i64 chunk_bytes, int num_copy) {
  const i64 max_rows = chunk_bytes / row_bytes;
  if (n <= 0) return max_rows;  // no chunks
  const i64 grain = min(max_rows, (CHUNK_GRAIN_BYTES + row_bytes - 1) / row_bytes);
  const i64 least = min(max_rows, (CHUNK_LEAST_BYTES + row_bytes - 1) / row_bytes);
  const i64 rounds = (n + num_copy * max_rows - 1) / (num_copy * max_rows);
  const i64 per = (n + num_copy * rounds - 1) / (num_copy * rounds);
  return min(max_rows, max(least, (per + grain - 1) / grain * grain));
}

// ---- publisher (lane 0 of a group's warp 0) ----------------------------------------------------------------------
// Acquires the copy warps' done marks in counter order (ld.acquire.cta; `first` = the first payload counter; copy
// warp i owns every num_copy-th chunk and stores chunk + 1 into done[i] after its last access to it) and releases
// the counter into the peer's buffer with ONE st.release.sys per run of finished chunks: tail for a sender, head for
// a receiver. A run is published once it holds `batch` chunks, reaches `end`, or nothing new got ready for a while.
// The release is cumulative: it covers every access of each warp acquired from. `published0` (<= first) is the
// counter already released: first - 1 when the call header's slot (counter first - 1, written by this lane or
// checked by it) is still to be announced with the first run (SYMBUF_HEADER_FOLD), so that run counts only payload
// chunks towards `batch`. Work sharing (SYMBUF_ADAPTIVE, ring_exchange.cu) passes per-counter marks instead:
// done[(counter - base) % mod] with base = 0 and mod = ADAPT_WINDOW (any warp of the block may copy any chunk).
__device__ __forceinline__ void publish_runs(u64* remote_counter, const u64* done, int mod, u64 base, u64 first,
                                             u64 end, u64 published0, u64 batch, volatile int* abort_flag,
                                             const WaitCtx* ctx, int role, int peer) {
  u64 published = published0, ready = first;
  u32 idle = 0;
  SpinBudget spin(ctx);
  while (published < end && !*abort_flag) {
    const u64 before = ready;
    while (ready < end && ld_acquire_cta(&done[(ready - base) % static_cast<u64>(mod)]) > ready) ++ready;
    idle = ready == before ? idle + 1 : 0;
    const u64 unreleased = published > first ? published : first;  // payload chunks not yet released
    if (ready > published && (ready - unreleased >= batch || ready == end || idle > 32)) {
      st_release_sys_global(remote_counter, ready);  // publish_tail / publish_head (protocol.cuh)
      published = ready;
      spin = SpinBudget(ctx);
    } else if (!spin.ok(role, peer, published, ready)) {
      *abort_flag = 1;
    }
  }
}

// MODE_DIRECT, receiver: once every copy warp has copied its slice out of the sender's block (done[i] == c0 + 1,
// acquired at cta scope; num_copy = 0: the calling warp copied alone), hand the header slot back: head = c0 with
// st.release.sys, cumulative over those loads, so the sender (which waits for it before its kernel ends) never
// lets its CUDA stream overwrite rows still being read. Then this rank's abort word: a sender whose wait for us failed
// has left (and its CUDA stream may reuse the rows), so what we copied is not trusted: ERR_ABORTED.
// With helpers (num_help > 0: this rank's sender group copies the last slices, STATE_HELP_*), also wait until each
// released STATE_HELP_DONE + k = seq in our state line (bounded: they wait for nothing once they have the address).
__device__ __noinline__ void direct_done(u64* head_line, const u64* done, int num_copy, u64 c0, const WaitCtx* ctx,
                                         int peer, volatile int* abort_flag, const u64* state, int num_help, u64 seq) {
  for (int i = 0; i < num_copy; ++i)
    while (ld_acquire_cta(&done[i]) < c0 + 1) {  // copy warps never wait: bounded by their copy
    }
  for (int k = 0; k < num_help; ++k) {
    SpinBudget spin(ctx);
    while (ld_acquire_sys_global(state + STATE_HELP_DONE + k) != seq) {
      if (*abort_flag || !spin.ok(ROLE_RECV, peer, c0, seq)) {
        *abort_flag = 1;
        return;
      }
    }
  }
  publish_head(head_line, c0);
  fence_acq_rel_sys();  // the payload loads above (weak .cg loads of the warps acquired) before the abort poll
  if (poll_abort(*ctx)) {
    report_aborted(*ctx, ROLE_RECV, peer, static_cast<i64>(c0), static_cast<i64>(c0));
    *abort_flag = 1;
  }
}

static_assert(STATE_HELP_DONE + MAX_HELPERS <= LINE_BYTES / 8, "the helpers' words fit the receiver's state line");

// The group's state line at the end of a call that did not abort (leader only): the counter after the call's last
// slot, where the next call's header goes, and the calls made. Read back at the next call's start (the kernel
// boundary orders them).
__device__ __forceinline__ void end_call(u64* state, u64 end, u64 call_seq) {
  state[STATE_COUNTER] = end;
  state[STATE_SEQ] = call_seq;
}

// ---- copy warps: one ring chunk ----------------------------------------------------------------------------------
// A copy warp's wait for its leader's verdict on the call header: lane 0 polls the group's shared word
// (ld.acquire.cta), the warp gets the value by shuffle (no barrier: the caller's __syncwarp orders lane 0's acquire
// before the lanes' accesses). Bounded: the leader sets it on every path, after its own bounded waits.
__device__ __forceinline__ u64 await_verdict(const u64* gate, int lane, u64 go) {
  if (lane == 0) {
    do go = ld_acquire_cta(gate);
    while (go == kGateWait);
  }
  return __shfl_sync(0xffffffffu, go, 0);
}

// The slot of ring counter t.
__device__ __forceinline__ u8* ring_slot(u8* ring, u64 t, i64 num_slots, i64 chunk_bytes) {
  return ring + static_cast<i64>(t % static_cast<u64>(num_slots)) * chunk_bytes;
}

// Lane 0, before its warp touches the slot of counter t (c0 = the call's first payload counter): a sender waits
// for room (head > t - num_slots: backpressure), a receiver for the data (tail > t). `seen` is the last head / tail
// read; the acquire orders the peer's accesses of the slot before ours. A failed wait sets *abort_flag.
__device__ __forceinline__ void wait_chunk(const WaitCtx* ctx, int peer, bool is_sender, const u64* local_counter,
                                           u64 t, u64 c0, i64 num_slots, u64& seen, volatile int* abort_flag) {
  if (is_sender) wait_for_space(ctx, peer, local_counter, t, num_slots, seen, abort_flag);
  else wait_for_data(ctx, peer, local_counter, t + 1, c0, t, num_slots, seen, abort_flag);
}

#if SYMBUF_DEBUG
// Lane 0, after wait_chunk: the access [slot, slot + bytes) lies in one slot of the ring's (channel, peer) region,
// else a fatal ERR_INVARIANT.
__device__ __forceinline__ void check_chunk_slot(const WaitCtx& ctx, int role, int peer, const u8* region,
                                                 const u8* slot, i64 bytes, i64 region_bytes, i64 chunk_bytes,
                                                 volatile int* abort_flag) {
  if (!*abort_flag && !slot_in_region(region, slot, bytes, region_bytes, chunk_bytes)) {
    fail(ctx, role, peer, slot - region, slot - region + bytes, ERR_INVARIANT, FIELD_OFFSET);
    *abort_flag = 1;
  }
}
#endif

// The warp's copy of run rows [r, r + n) between a ring slot and the caller's arrays.
// send_chunk: the rows' parts gathered into the slot (packed rows; the sendbuf is read-only during the kernel).
__device__ __forceinline__ void send_chunk(const RowRun& send, u8* slot, i64 r, i64 n, int lane) {
  send.copy_rows<true>(slot, r, n, lane);
}
// push_chunk (MODE_PUSH sender): the parts in push_mask straight into the receiver's outputs (row0 = the
// receiver's first row of our run, its answer to the header; delta = its block minus ours per part), the others
// into the slot; row0 < 0 (the receiver rejected): the others only.
__device__ __forceinline__ void push_chunk(const RowRun& send, const RowRun& recv, u8* slot, i64 r, i64 n,
                                           i64 row0, u32 push_mask, const i64* delta, int lane) {
  if (row0 >= 0) push_rows(send, recv, slot, r, n, row0, push_mask, delta, lane);
  else send.copy_rows<true>(slot, r, n, lane, push_mask);
}
// recv_chunk: the slot scattered into the receive parts (.cg loads of the peer-written ring); the parts in
// push_mask are not in the slot (the sender wrote them into our outputs itself).
__device__ __forceinline__ void recv_chunk(const RowRun& recv, u8* slot, i64 r, i64 n, u32 push_mask, int lane) {
  recv.copy_rows<false>(slot, r, n, lane, push_mask);
}
// The role's copy of one chunk (push_row0: the shared word holding the receiver's answer, read only when pushing).
__device__ __forceinline__ void move_chunk(bool is_sender, const RowRun& send, const RowRun& recv, u8* slot,
                                           i64 r, i64 n, u32 push_mask, const u64* push_row0, const i64* push_delta,
                                           int lane) {
  if (!is_sender) recv_chunk(recv, slot, r, n, push_mask, lane);
  else if (push_mask) push_chunk(send, recv, slot, r, n, static_cast<i64>(*push_row0), push_mask, push_delta, lane);
  else send_chunk(send, slot, r, n, lane);
}

// Lane 0, after the __syncwarp that follows the warp's accesses to the slot of counter t: hand the chunk over. A
// group of one warp publishes it itself (tail / head = t + 1, st.release.sys, cumulative over the warp's
// accesses: publish_tail / publish_head); a copy warp marks it done for its publisher (st.release.cta).
__device__ __forceinline__ void post_chunk(bool solo, u64* remote_counter, u64* done_mark, u64 t) {
  if (solo) st_release_sys_global(remote_counter, t + 1);
  else st_release_cta(done_mark, t + 1);
}

// ---- direct pull and own rows (no ring slot) ---------------------------------------------------------------------
// One warp's slice k of `total` of an n-byte copy (16-byte aligned cuts; the last slice takes the rest); returns the
// slice's bytes. kFromPeer: .cg loads (the source is a peer's block: MODE_DIRECT), else .nc (our own sendbuf).
template <bool kFromPeer>
__device__ __forceinline__ i64 copy_slice(u8* dst, const u8* src, i64 n, int k, int total, int lane) {
  const i64 a = n * k / total / 16 * 16;
  const i64 b = k == total - 1 ? n : n * (k + 1) / total / 16 * 16;
  if (b <= a) return 0;
  copy_bytes<kFromPeer>(dst + a, src + a, b - a, lane);
  return b - a;
}

// This rank's rows [a, b) to itself (peer == rank: no ring), by one of the group's group_warps warps: one span of
// bytes cut into 16-byte aligned slices, one per warp, when both ends are dense, else one warp per row. Returns the
// bytes this warp copied.
__device__ __forceinline__ i64 copy_own_rows(const RowRun& send, const RowRun& recv, i64 a, i64 b,
                                             i64 row_bytes, int warp_in_group, int group_warps, int lane) {
  if (send.dense() && recv.dense())
    return copy_slice<false>(recv.at(0, a), send.at(0, a), (b - a) * row_bytes, warp_in_group, group_warps, lane);
  i64 bytes = 0;
  for (i64 r = a + warp_in_group; r < b; r += group_warps) {
    for (int i = 0; i < send.num_parts; ++i) copy_bytes<false>(recv.at(i, r), send.at(i, r), send.parts[i].width, lane);
    bytes += row_bytes;
  }
  return bytes;
}

// ---- call header (the group's leader, lane 0 of warp 0) ------------------------------------------------------------
// What the leader's call-header step needs; built by the leader only and handed by reference to a function that
// is not inlined, so that the header's registers do not weigh on the copy loops (64 per thread at 1024 threads).
struct HeaderStep {
  const WaitCtx* ctx;
  u8* ring_region;            // the (channel, peer) region whose ring the group accesses (the peer's for a sender)
  u64* remote_counter;        // sender: tail in the peer's buffer; receiver: head in the peer's buffer
  const u64* local_counter;   // sender: head in our buffer; receiver: tail in our buffer
  volatile int* abort_flag;   // the group's
  u64* gate;                  // the group's verdict word (kGate*)
  u64* direct_src;            // receiver, MODE_DIRECT: where the sender's run to us starts (its block, mapped)
  const i64* sym_table;       // this rank's symmetric table (DESC_SYM_TABLE), or nullptr
  i64 ce_alloc, ce_offset;    // FLAG_CE: where the peer's run must lie (else ce_alloc < 0)
  CallHeader mine;            // sender: the header to send; receiver: what it expects
  // MODE_PUSH (push_mask != 0: receive parts in symmetric allocations header_desc(g, DESC_PUSH_ALLOC + i)):
  // receiver: its first row of the peer's run and the rows its outputs hold; sender: where the receiver's answer goes
  // (push_delta[i] = the receiver's block minus ours for each pushed part; *direct_src = the receiver's first row, or
  // -1)
  u32 push_mask;
  // the launch descriptor's words from DESC_PUSH_ALLOC on (the block's shared copy, s_desc + DESC_PUSH_ALLOC): the
  // push allocations, and later words such as DESC_SMALL_* (header_desc). Not the descriptor's start: the kernel's
  // body computes this address anyway, and another value there changes the body's code (its copy loops included).
  const i64* desc_tail;
  i64* push_delta;
  i64 push_row0, push_rows;
  u64 first, num_slots;       // first: the header's counter
  i64 chunk_bytes, region_bytes, row_bytes;
  int peer, role;
  bool is_sender, reject;
  // receiver of a rank that rejects an alltoall (FLAG_REJECT) while the small protocol is on: the peer's small header
  // word of this call (SMALL_H_OP of its slot in our small region; nullptr otherwise). A peer whose call would go by
  // the small protocol sends that instead of ring headers; we consume it and leave our ring counters alone.
  const u64* small_hdr;
};

// Word w (>= DESC_PUSH_ALLOC) of the launch descriptor, through HeaderStep::desc_tail.
__device__ __forceinline__ i64 header_desc(const HeaderStep& g, int w) { return g.desc_tail[w - DESC_PUSH_ALLOC]; }
static_assert(DESC_SMALL_OFFSET > DESC_PUSH_ALLOC && DESC_SMALL_SLOT_BYTES > DESC_PUSH_ALLOC,
              "header_desc reads the small region's words through desc_tail");

// A fatal difference found by the receiver's leader: recorded, the abort word set on every rank.
__device__ __forceinline__ u64 header_fatal(const HeaderStep& g, i64 expected, i64 received, int kind, int field) {
  fail(*g.ctx, ROLE_RECV, g.peer, expected, received, kind, field);
  *g.abort_flag = 1;
  return kGateAbort;
}

// MODE_PUSH, the sender's leader after its header: wait for the receiver's head = first + 1 (t = first +
// num_slots: free once head > first), take its answer (HEAD_PUSH_ROW of our head line, ordered by that acquire)
// into *direct_src, and the receiver's block of every pushed part's allocation from our symmetric table into
// push_delta. False (abort set) on a failed wait or an allocation not in the table (fatal FIELD_MODE).
__device__ __noinline__ bool push_answer(const HeaderStep& g, u64& head) {
  const WaitCtx& c = *g.ctx;
  if (!wait_for_space(&c, g.peer, g.local_counter, g.first + g.num_slots, g.num_slots, head, g.abort_flag))
    return false;
  (void)ld_acquire_sys_global(g.local_counter);  // head >= first + 1 now: this acquire orders the answer's load
  *g.direct_src = static_cast<u64>(ld_volatile_global(reinterpret_cast<const i64*>(g.local_counter) + HEAD_PUSH_ROW));
  for (int i = 0; i < MAX_PARTS; ++i) {
    if (!((g.push_mask >> i) & 1u)) continue;
    i64 delta = 0;
    bool found = false;
    for (int k = 0; k < SYM_TABLE_ROWS && g.sym_table != nullptr; ++k) {
      const i64* row = g.sym_table + static_cast<i64>(k) * SYM_TABLE_STRIDE;
      if (row[0] == header_desc(g, DESC_PUSH_ALLOC + i) + 1) {
        delta = row[2 + g.peer] - row[2 + c.rank];
        found = row[2 + g.peer] != 0;
        break;
      }
    }
    if (!found) {
      fail(c, ROLE_SEND, g.peer, MODE_PUSH, header_desc(g, DESC_PUSH_ALLOC + i), ERR_MISMATCH, FIELD_MODE);
      *g.abort_flag = 1;
      return false;
    }
    g.push_delta[i] = delta;
  }
  return true;
}

// Sender: wait for space for the header slot, write the header, announce it (tail = first + 1; folded: the first
// run's release covers it; MODE_PUSH: never folded, the receiver answers the header before any chunk is written),
// then MODE_PUSH: the receiver's answer; MODE_DIRECT: the receiver's hand-back of the header slot (head = first + 1)
// after its pull, so that nothing after this kernel in stream order overwrites the rows it still reads (the acquire
// orders its reads before whatever follows; t = first + num_slots: free once head > first). FLAG_CE: not here: the
// peer's copy engine reads after its kernel; symbuf_ce_finish waits instead.
__device__ __forceinline__ u64 send_call_header(const HeaderStep& g, u8* slot) {
  const WaitCtx& c = *g.ctx;
  volatile int* abort_flag = g.abort_flag;
  u64 verdict = kGateAbort;
  u64 head = 0;
  if (wait_for_space(&c, g.peer, g.local_counter, g.first, g.num_slots, head, abort_flag)) {
    write_call_header(slot, g.mine);
    // release: the header's stores are visible before the tail
    if (!SYMBUF_HEADER_FOLD || g.mine.nchunks <= 0 || g.push_mask) publish_tail(g.remote_counter, g.first + 1);
    verdict = kGateCopy;
    if (g.push_mask && !push_answer(g, head)) verdict = kGateAbort;
    if (g.mine.mode == MODE_DIRECT && g.ce_alloc < 0 &&
        !wait_for_space(&c, g.peer, g.local_counter, g.first + g.num_slots, g.num_slots, head, abort_flag))
      verdict = kGateAbort;
  }
  return verdict;
}

// Receiver: the header got against what we expect (check_call_header: magic, seq, op; signature and units unless
// a side rejects); a difference is fatal (nothing of this call is consumed; every rank leaves).
__device__ __forceinline__ bool header_agrees(const HeaderStep& g, const CallHeader& got, bool peer_rejects) {
  i64 expected = 0, received = 0;
  const int field = check_call_header(got, g.mine, !peer_rejects && !g.reject, expected, received);
  if (field) header_fatal(g, expected, received, ERR_MISMATCH, field);
  return field == 0;
}

// Receiver, a rejected call. The peer rejected: record it (not fatal), consume its header (no payload follows).
// This rank rejects: drain the header and the got.nchunks payload chunks the peer sends, copying nothing, so the
// rings stay in step. Either way the copy warps have nothing to do: kGateSkip, published before the drain so they
// need not wait for it. `tail` = the last tail read; `end` becomes the counter after the drained slots.
// (a rank that rejects raised its own error already: its peers' rejections are not news to it)
__device__ __forceinline__ u64 drain_rejected(const HeaderStep& g, const CallHeader& got, bool peer_rejects,
                                              u64 tail, u64& end) {
  const WaitCtx& c = *g.ctx;
  if (peer_rejects && !g.reject) record_rejection(c, g.peer);
  const u64 verdict = kGateSkip;
  st_release_cta(g.gate, verdict);
  end = g.first + 1 + (peer_rejects || got.nchunks <= 0 ? 0ull : static_cast<u64>(got.nchunks));
  if (got.mode == MODE_PUSH)  // push nothing into our outputs (before the head release that answers)
    st_volatile_global(reinterpret_cast<i64*>(g.remote_counter) + HEAD_PUSH_ROW, -1);
  u64 head = g.first;
  while (head < end) {  // head released over what arrived (the slots are never read)
    if (!wait_for_data(&c, g.peer, g.local_counter, head + 1, head, head, g.num_slots, tail, g.abort_flag)) break;
    head = min(tail, end);
    publish_head(g.remote_counter, head);
  }
  return verdict;
}

// Receiver, FLAG_CE: the host's copy engine will read where it assumed the peer's rows lie; the header must say
// MODE_DIRECT there. Nothing to copy here: symbuf_ce_finish releases head after the copy.
__device__ __forceinline__ u64 accept_ce(const HeaderStep& g, const CallHeader& got, u64& end) {
  if (got.mode != MODE_DIRECT || got.nchunks != 0 || got.direct_alloc != g.ce_alloc ||
      got.direct_offset != g.ce_offset)
    return header_fatal(g, g.ce_offset, got.mode == MODE_DIRECT ? got.direct_offset : -1, ERR_MISMATCH, FIELD_MODE);
  end = g.first + 1;
  return kGateSkip;
}

// Receiver, MODE_DIRECT: the rows lie in the sender's symmetric allocation got.direct_alloc: find its block in our
// table (the allocations are collective and the same on every rank). Only byte runs go direct (the signature,
// checked before, says both ends move bytes). Not found, or a malformed header: fatal, on every rank. Else
// *direct_src = the run's start there (before the verdict's release: the copy warps acquire it) and the header
// slot is the call's only counter.
__device__ __forceinline__ u64 accept_direct(const HeaderStep& g, const CallHeader& got, u64& end) {
  u64 src = 0;
  // The run [direct_offset, direct_offset + units) must lie inside the block (row: id + 1, bytes, bases).
  if (g.sym_table != nullptr && got.nchunks == 0 && g.row_bytes == 1 && got.direct_alloc >= 0 &&
      got.direct_offset >= 0 && got.units >= 0) {
    for (int i = 0; i < SYM_TABLE_ROWS; ++i) {
      const i64* row = g.sym_table + static_cast<i64>(i) * SYM_TABLE_STRIDE;
      if (row[0] == got.direct_alloc + 1) {
        if (got.direct_offset <= row[1] && got.units <= row[1] - got.direct_offset)
          src = static_cast<u64>(row[2 + g.peer]) + static_cast<u64>(got.direct_offset);
        break;
      }
    }
  }
  if (src == 0) return header_fatal(g, MODE_DIRECT, got.direct_alloc, ERR_MISMATCH, FIELD_MODE);
  *g.direct_src = src;
  end = g.first + 1;
  return kGateDirect;
}

// Receiver, MODE_PUSH (the signature, checked before, says both ends lay the outputs out alike): the run must fit
// our outputs; answer with our first row of it, then hand the header slot back at once (never folded: the sender
// writes nothing before it; the release makes the answer visible first).
__device__ __forceinline__ u64 accept_push(const HeaderStep& g, const CallHeader& got) {
  if (got.mode != MODE_PUSH || !g.push_mask || got.nchunks != g.mine.nchunks)
    return header_fatal(g, g.push_mask ? MODE_PUSH : MODE_RING, got.mode, ERR_MISMATCH, FIELD_MODE);
  if (g.push_row0 < 0 || got.units < 0 || g.push_row0 + got.units > g.push_rows)
    return header_fatal(g, g.push_rows, g.push_row0 + got.units, ERR_MISMATCH, FIELD_CAPACITY);
  st_volatile_global(reinterpret_cast<i64*>(g.remote_counter) + HEAD_PUSH_ROW, g.push_row0);
  publish_head(g.remote_counter, g.first + 1);
  return kGateCopy;
}

// Receiver, MODE_RING: same units cut alike (another chunking: the kernels differ); the header slot goes back to
// the sender at once, or (folded) with the first run of consumed chunks.
__device__ __forceinline__ u64 accept_ring(const HeaderStep& g, const CallHeader& got) {
  if (got.mode != MODE_RING) return header_fatal(g, MODE_RING, got.mode, ERR_MISMATCH, FIELD_MODE);
  if (got.nchunks != g.mine.nchunks) return header_fatal(g, g.mine.nchunks, got.nchunks, ERR_INVARIANT, FIELD_RING);
  if (!SYMBUF_HEADER_FOLD || g.mine.nchunks <= 0) publish_head(g.remote_counter, g.first + 1);
  return kGateCopy;
}

// Receiver with g.small_hdr (a rejecting rank, see HeaderStep): wait for the peer's call header of this call in the
// ring (tail >= first + 1 at `slot`: *ring = true) or for its small header of this call (its flag is the call's:
// *ring = false); bounded, polling the abort word. `tail` = the last tail read. False (abort set) when the wait
// failed.
// A moved tail alone does not say the peer's call went through the rings: when it went small, its small kernel
// ended once our rejection headers arrived, and its NEXT call may have gone through the rings and put its header
// at `first` (our counters do not move for a call the peer made small) before we looked. So the small header is
// tested first, and again after an acquire that saw the tail move; the ring is taken only when it is still absent:
//   - the header at `first` is of a later call: the peer stored its small header of this call in its earlier
//     kernel, before (its stream order: the kernel boundary) the release of the tail we acquired, so the second
//     test sees that store or a later one to the word; the next is the peer's call seq + 2, which needs our call
//     seq + 1 (we are still in call seq), and our own zeroing of this half is in our kernels seq - 1 and seq + 1
//     (protocol.cuh, "The flag's wrap"). So it finds the flag: *ring = false.
//   - the header is of this call: the peer wrote no small header for it, and an older word with this call's flag
//     is gone (the flag's wrap), so the test never finds the flag: *ring = true.
// As a further guard, a well-formed ring header whose seq is ahead of this call's sends us back to polling the small
// header alone (the mirror image of small_header_step's `later`).
__device__ __noinline__ bool wait_ring_or_small(const HeaderStep& g, const u8* slot, u64& tail, bool& ring) {
  const u32 flag = small_flag(static_cast<u64>(g.mine.seq));
  SpinBudget spin(g.ctx);
  bool later = false;  // the ring holds the peer's header of a later call: its small header of this one is due
  while (true) {
    if (static_cast<u32>(small_load(g.small_hdr) >> 32) == flag) {
      ring = false;
      return true;
    }
    if (!later) {
      tail = ld_acquire_sys_global(g.local_counter);
      if (tail >= g.first + 1) {
        if (static_cast<u32>(small_load(g.small_hdr) >> 32) == flag) {  // after the acquire (see above)
          ring = false;
          return true;
        }
        const CallHeader h = read_call_header(slot);
        if (h.magic != static_cast<i64>(HDR_MAGIC_VALUE) || h.seq <= g.mine.seq) {
          ring = true;  // this call's header (or a malformed one: the caller's check reports it)
          return true;
        }
        later = true;
      }
    }
    if (*g.abort_flag || !spin.ok(ROLE_RECV, g.peer, g.first, tail)) {
      *g.abort_flag = 1;
      return false;
    }
  }
}

// Receiver of a rejecting rank, the peer's call went by the small protocol (its small header of this call arrived):
// the same operation or a fatal FIELD_OP mismatch, as a ring header is checked under a rejection (no signature or
// size: nothing moves). No ring slot is consumed: our state line keeps its counter (end = first) and counts the
// call, as the peer's small kernel does with its own; the peer's payload words are never read.
__device__ __forceinline__ u64 accept_small_rejected(const HeaderStep& g, u64& end) {
  const i64 op = static_cast<i64>(static_cast<u32>(small_load(g.small_hdr)) & 0xFFu);
  if (op != g.mine.op) return header_fatal(g, g.mine.op, op, ERR_MISMATCH, FIELD_OP);
  end = g.first;
  return kGateSkip;
}

// The call header, by the leader of a ring group, every call. Sender: send_call_header. Receiver: waits for tail
// >= first + 1, checks the header (header_agrees), then: the call rejected on either side -> drain_rejected;
// FLAG_CE -> accept_ce; else the mode the peer's header says: accept_direct, accept_push, accept_ring. Publishes the
// verdict to the copy warps (st.release.cta; drain_rejected publishes its own first) and returns it; `end` becomes
// the counter after the call's last slot when the step changes it.
// The small protocol's flag wrap (protocol.cuh, small_zero_next; a ring call makes a call on the pair as a small one
// does): channel 0's sender leader zeroes, first of all, the slot the peer writes in our small region for its call
// seq + 1, and fences (small_zero_slot) before its call header goes out (the same thread's release of the tail; the
// peer's kernel ends only after it acquired that tail). The sender line's seq is the receiver line's: every kernel
// advances both. Here, in a function of its own, and not in the kernel's body: code there changes ptxas's code for
// the whole body, copy loops included (docs/perf-notes.md has the SASS comparison, tests/device/ring_sass_diff.py).
__device__ __noinline__ u64 call_header_step(const HeaderStep& g, u64& end) {
  const WaitCtx& c = *g.ctx;
  if (g.is_sender && c.channel == 0 && header_desc(g, DESC_SMALL_OFFSET) != 0 &&
      small_zero_next(static_cast<u64>(g.mine.seq))) {
    const i64 slot_bytes = header_desc(g, DESC_SMALL_SLOT_BYTES);
    const u64 next = static_cast<u64>(g.mine.seq) + 1;
    small_zero_slot(reinterpret_cast<u8*>(c.peer_bases[c.rank]) +
                        small_slot(header_desc(g, DESC_SMALL_OFFSET), slot_bytes, next, g.peer, c.world_size),
                    slot_bytes, 0, 1);
  }
  u8* slot = g.ring_region + RING_OFFSET + static_cast<i64>(g.first % g.num_slots) * g.chunk_bytes;
  u64 verdict = kGateAbort;
  volatile int* abort_flag = g.abort_flag;
  if (!g.reject && g.row_bytes > g.chunk_bytes) {  // a row that fits no slot (the host checks it: never here)
    fail(c, g.role, g.peer, g.chunk_bytes, g.row_bytes, ERR_INVARIANT, FIELD_OFFSET);
    *abort_flag = 1;
  }
#if SYMBUF_DEBUG
  if (!*abort_flag && !slot_in_region(g.ring_region, slot, HDR_WORDS * 8, g.region_bytes, g.chunk_bytes)) {
    fail(c, g.role, g.peer, slot - g.ring_region, slot - g.ring_region + HDR_WORDS * 8, ERR_INVARIANT,
         FIELD_OFFSET);
    *abort_flag = 1;
  }
#endif
  if (*abort_flag) {
    // leave: kGateAbort
  } else if (g.is_sender) {
    verdict = send_call_header(g, slot);
  } else {  // wait for the header, check it, consume it
    u64 tail = 0;
    bool ring = true;
    const bool arrived =
        g.small_hdr != nullptr
            ? wait_ring_or_small(g, slot, tail, ring)
            : wait_for_data(&c, g.peer, g.local_counter, g.first + 1, g.first, g.first, g.num_slots, tail, abort_flag);
    if (arrived && !ring) {
      verdict = accept_small_rejected(g, end);
    } else if (arrived) {
      const CallHeader got = read_call_header(slot);  // after the acquire of tail >= first + 1
      const bool peer_rejects = got.status == HDR_REJECTED;
      if (!header_agrees(g, got, peer_rejects)) verdict = kGateAbort;
      else if (peer_rejects || g.reject) return drain_rejected(g, got, peer_rejects, tail, end);
      else if (g.ce_alloc >= 0) verdict = accept_ce(g, got, end);
      else if (got.mode == MODE_DIRECT) verdict = accept_direct(g, got, end);
      else if (got.mode == MODE_PUSH || g.push_mask) verdict = accept_push(g, got);
      else verdict = accept_ring(g, got);
    }
  }
  st_release_cta(g.gate, verdict);
  return verdict;
}
