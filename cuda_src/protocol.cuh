// The ring protocol (cupy_symbuf/wire/protocol.py describes it and holds every constant: HDR_*, STATE_*, ABORT_*,
// STATUS_*, ERR_*, FIELD_*, ROLE_*), in the manner of NCCL's primitives: who writes which word, and the helpers
// every ring kernel uses for it: bounded waits that also poll the abort word, the call header, the abort word, the
// error record.
#pragma once
#include "layout.cuh"

// SYMBUF_DEBUG=1 (CUPY_SYMBUF_DEBUG=1): every ring slot access is checked against its (channel, peer) region and
// the ring invariants after every counter read; a violation is an ERR_INVARIANT error. Off: no code at all.
#ifndef SYMBUF_DEBUG
#define SYMBUF_DEBUG 0
#endif
// A bounded wait polls its rank's abort word every 1024 polls and at least this often (ns).
#ifndef SYMBUF_ABORT_POLL_NS
#define SYMBUF_ABORT_POLL_NS 2000
#endif

// ---- the words of one (channel c, sender s, receiver d) ring, and who writes them ------------------------------
// All counters are u64 and only grow; the slot of counter n is n % num_slots. Per call, counter `first` (the
// counter the previous call left) is the call header, counters first + 1 ... first + nchunks the payload chunks.
//
// In d's buffer, region (c, s):
//   TAIL_OFFSET         counters s published into d's ring.   Writer: s's sender publisher (REMOTE, st.release.sys,
//                       after the header / the payload it announces). Reader: d's receiver (LOCAL, ld.acquire.sys).
//   RECV_STATE_OFFSET   d's receiver state: [STATE_COUNTER] head after the last call, [STATE_SEQ] calls made.
//                       Writer and reader: d's receiver group leader only (LOCAL; written at the end of a call, read
//                       at the start of the next: the kernel boundary orders them).
//   RING_OFFSET         num_slots * chunk_bytes. Writer: s's sender (REMOTE: the call header by its publisher, the
//                       payload by its copy warps). Reader: d's receiver (LOCAL: the header by its publisher with
//                       ld.volatile, the payload by its copy warps with ld.cg), only below a tail it acquired.
// In s's buffer, region (c, d):
//   HEAD_OFFSET         counters d consumed from s's run.  Writer: d's receiver publisher (REMOTE,
//                       st.release.sys, after its last read of those slots). Reader: s's sender (LOCAL,
//                       ld.acquire.sys) before it overwrites a slot (backpressure).
//   SEND_STATE_OFFSET   s's sender state: [STATE_COUNTER] tail after the last call, [STATE_SEQ] calls made.
//                       Writer and reader: s's sender group leader only (LOCAL).
// In every rank's buffer, at the abort offset (ChannelLayout.abort_offset, DESC_ABORT_OFFSET):
//   the abort line, ABORT_* words. Writer: any rank (or host) that aborts, into EVERY rank's line (REMOTE and
//   LOCAL): rank, reason, peer, channel first, then ABORT_FLAG = 1 with st.release.sys. Reader: the rank's own
//   waits (LOCAL, ld.acquire.sys of ABORT_FLAG, then the words).
// The error record (host-mapped, STATUS_WORDS int64, one per communicator and rank): claimed by the first failing
// wait of this rank (atomicCAS of STATUS_SEQ), its fields, then STATUS_FLAG = 1 with st.release.sys. Read by the
// host. STATUS_REJECTED_BY / STATUS_REJECTED_SEQ (a peer rejected a call) are not fatal and never set the flag.

// ---- the small-message protocol's words (wire/protocol.py SMALL_*; the kernel is small_exchange.cu) ---------------
// In d's buffer, the small region (DESC_SMALL_OFFSET / ChannelLayout.small_offset): control words (local: the
// launch's finished blocks per peer), then half h = seq & 1, slot of source s: header words SMALL_H_*, then one
// word per 4 payload bytes from SMALL_DATA_WORD on. Writer: s's small kernel (REMOTE, small_store, 8 bytes:
// datum | flag << 32). Reader: d's small kernel (LOCAL, small_load until the flag is the call's), and a
// rejecting d's ring kernel (the header word only: the peer's call went by the small protocol).
// The call's sequence number seq is the ring's (STATE_SEQ + 1 of the (channel, peer) state lines, equal on both
// ends of every pair); its flag is never 0 (a zeroed word never matches) and differs from seq - 2's (the previous
// user of the half).
//
// The flag's wrap. The flag of a half repeats every 2 M calls (M = the modulus, odd: seq and seq' of one parity
// have the same flag iff seq' - seq is a multiple of 2 M). A payload word last written at call q and left alone by
// every shorter call since would match call q + 2 M's flag before that call's own store of it landed: wrong data.
// So the calls are cut into epochs of 2 M (epoch = seq / (2 M)): within one epoch no two calls of a half share a
// flag, and a word of an older epoch must be gone before a half is read in a newer one. The kernel of call x, any
// kernel that makes a call on the (rank, peer) pair (the small kernel or the ring kernel, whatever the operation,
// rejected or not, eager or replayed from a graph: the decision is a function of x alone, read from the state
// lines), zeroes the half of call x + 1 in its own buffer (the slot the peer writes) before it sends anything to the
// peer, when small_zero_next(x): call x + 1 or x - 1 is the first call of its half in a new epoch. Why both:
//   - before the peer's stores: the peer stores call x + 1 only after its kernel x ended, which needs something we
//     sent in call x (every call ends only after it received the peer's words or header of that call), sent after
//     the zeroing and a fence.sc.sys; so the zeroing happens before those stores, which land after it.
//   - after the peer's older stores: at the start of our kernel x, the peer's stores of calls <= x - 2 happen
//     before it (our kernel x - 1 received the peer's message of call x - 1, sent after its kernel x - 2 ended; the
//     kernel boundaries are the fences), so the zeroing lands after them. The peer's stores of call x - 1 may still
//     be in flight when we did not read them (we rejected call x - 1 through the rings while the peer went small:
//     our ring kernel read the header word only); they carry flag(x - 1), never flag(x + 1), and the zeroing of the
//     next kernel of the half's parity, x + 2 (small_zero_next(x + 2): x + 1 was the first of the new epoch),
//     lands after them. So from call x + 3 on no word of the old epoch is left, and call x + 1 can only meet words
//     of calls <= x - 3 (zeroed) or of call x - 1 (another flag).
// Cost: 4 slot zeroings per 2 M calls per peer (the first two calls of each half in every epoch), and one test per
// call. The buffer is zeroed at construction, so the first calls (epoch 0) zero nothing.
//
// Test hook: SYMBUF_SMALL_FLAG_MOD (a compile-time define, so in every kernel's build id and in the construction
// fingerprint's "defines": CUPY_SYMBUF_NVRTC_DEFINES="-DSYMBUF_SMALL_FLAG_MOD=7" alike on every rank) replaces
// SMALL_FLAG_MOD by a small odd modulus: the flag then repeats after 2 M calls, so the wrap is tested in a few.
#ifndef SYMBUF_SMALL_FLAG_MOD
#define SYMBUF_SMALL_FLAG_MOD SMALL_FLAG_MOD
#endif
constexpr u64 kSmallFlagMod = static_cast<u64>(SYMBUF_SMALL_FLAG_MOD);
static_assert(kSmallFlagMod >= 3 && kSmallFlagMod % 2 == 1 && kSmallFlagMod <= SMALL_FLAG_MOD,
              "the flag's modulus: odd (so one epoch of 2 M calls has no repeated flag in a half), at least 3 (so it "
              "differs from the flag of seq - 2), at most 2^32 - 1 (it fits the word's 32 bits)");
__host__ __device__ __forceinline__ u32 small_flag(u64 seq) { return static_cast<u32>(seq % kSmallFlagMod) + 1u; }
// Epoch of call seq - back (calls before the first one, seq - back < 1: epoch 0, the zeroed buffer's).
__host__ __device__ __forceinline__ u64 small_epoch(u64 seq, u64 back) {
  return seq > back ? (seq - back) / (2 * kSmallFlagMod) : 0;
}
// The kernel of call seq zeroes the half of call seq + 1 (our own buffer, every peer's slot it sends to) before it
// sends: call seq + 1 or call seq - 1 is the first call of its half in a new epoch (see above).
__host__ __device__ __forceinline__ bool small_zero_next(u64 seq) {
  const u64 next = small_epoch(seq + 1, 0), prev = small_epoch(seq, 1), prev2 = small_epoch(seq, 3);
  return next != prev || prev != prev2;
}
// One word: a single 8-byte st.volatile / ld.volatile, which the PTX memory model treats as a relaxed access at
// system scope (sm_70 and later: visible to a peer without a fence, never merged or kept in a register). Naturally
// aligned, it is single-copy atomic: a reader sees the whole old word or the whole new one, never a new flag with
// old data.
__device__ __forceinline__ void small_store(u64* word, u64 v) {
  st_volatile_global(reinterpret_cast<i64*>(word), static_cast<i64>(v));
}
__device__ __forceinline__ u64 small_load(const u64* word) {
  return static_cast<u64>(ld_volatile_global(reinterpret_cast<const i64*>(word)));
}
// Byte offset (in a rank's buffer) of the slot source `source` writes for call `seq`.
__host__ __device__ __forceinline__ i64 small_slot(i64 small_offset, i64 slot_bytes, u64 seq, int source,
                                                  int world_size) {
  return small_offset + SMALL_CTRL_BYTES + (static_cast<i64>(seq & 1ull) * world_size + source) * slot_bytes;
}
// Zero one slot of our small region (slot_bytes from `slot`, 8-byte words), thread t of n taking words t, t + n, ...
// (relaxed system-scope stores, as the peer's), then fence.sc.sys (see "The flag's wrap"). Not inlined: it runs
// once per 2 M calls (the ring kernel's call_header_step, one thread; the small kernel, a block).
__device__ __noinline__ void small_zero_slot(u8* slot, i64 slot_bytes, int t, int n) {
  u64* w = reinterpret_cast<u64*>(slot);
  for (i64 i = t; i < slot_bytes / 8; i += n) small_store(w + i, 0ull);
  __threadfence_system();  // fence.sc.sys: the zeros before whatever this thread does next
}

// ---- channel telemetry (Config(trace=True), wire/protocol.py DESC_TRACE) -----------------------------------------
// One record of an event that began at t0 (ns) and ends now into the trace buffer `buf` of `cap` records (nullptr:
// none): word 0 counts the events (records past the capacity are counted, not kept).
__device__ __noinline__ void trace_record(i64* buf, i64 cap, i64 seq, i64 op, int kind, u64 t0, int channel, int peer,
                                         i64 bytes, u64 head, u64 tail) {
  if (buf == nullptr) return;
  const u64 i = atomicAdd(reinterpret_cast<unsigned long long*>(buf), 1ull);
  if (i >= static_cast<u64>(cap)) return;  // counted, not kept
  i64* r = buf + TRACE_HDR_WORDS + static_cast<i64>(i) * TRACE_WORDS;
  r[0] = static_cast<i64>(t0);
  r[1] = static_cast<i64>(globaltimer_ns());
  r[2] = seq;
  r[3] = (op & 0xFF) | (static_cast<i64>(kind) << 8) | (static_cast<i64>(channel & 0xFFFF) << 16) |
         (static_cast<i64>(peer + 1) << 32);
  r[4] = bytes;
  r[5] = static_cast<i64>(head);
  r[6] = static_cast<i64>(tail);
}

// What every bounded wait of a launch needs; one per block in shared memory (the copy loops keep their registers).
struct WaitCtx {
  i64* status;            // the error record
  const u64* peer_bases;  // every rank's buffer
  const u64* my_abort;    // this rank's abort line
  i64 abort_offset;       // of the abort line in every buffer
  u64 timeout_ns;         // bound of every wait (DESC_TIMEOUT_NS)
  u64 seq;                // launch number (>= 1), written into the error record
  int rank, world_size;
  int channel;            // -1: notify
};

__device__ __forceinline__ WaitCtx make_wait_ctx(i64* status, const u64* peer_bases, int rank, int world_size,
                                                 int channel, i64 abort_offset, u64 timeout_ns, u64 seq) {
  return WaitCtx{status, peer_bases, reinterpret_cast<const u64*>(peer_bases[rank] + abort_offset), abort_offset,
                 timeout_ns, seq, rank, world_size, channel};
}

// ---- error record ------------------------------------------------------------------------------------------------
// The first failing wait of this rank claims the record with its launch number and writes the fields; the flag
// goes last with a system-scope release, so a host that reads STATUS_FLAG == 1 while kernels still run (calls
// return without waiting) finds every field written and knows which queued launch failed. Later failures (other
// waits leaving because of the first one) find the record claimed and change nothing.
__device__ __noinline__ void report_error(const WaitCtx& c, int role, int peer, i64 head, i64 tail, int kind,
                                          int field, int abort_rank) {
  i64* st = c.status;
  if (atomicCAS(reinterpret_cast<unsigned long long*>(st + STATUS_SEQ), 0ull, c.seq) == 0ull) {
    st[STATUS_ROLE] = role;
    st[STATUS_RANK] = c.rank;
    st[STATUS_PEER] = peer;
    st[STATUS_CHANNEL] = c.channel;
    st[STATUS_HEAD] = head;
    st[STATUS_TAIL] = tail;
    st[STATUS_KIND] = kind;
    st[STATUS_FIELD] = field;
    st[STATUS_ABORT_RANK] = abort_rank;
    st_release_sys_global(reinterpret_cast<u64*>(st + STATUS_FLAG), 1ull);
  }
}

// A peer's call header said HDR_REJECTED: not an error of the ring; the first one of the record's life is kept,
// with its reason (STATUS_REJECTED_WHY, REJECT_*) and two words the reason names (STATUS_REJECTED_OWN / _PEER).
__device__ __forceinline__ void record_rejection(const WaitCtx& c, int peer, i64 why = REJECT_ARGS, i64 own = 0,
                                                 i64 theirs = 0) {
  i64* st = c.status;
  if (atomicCAS(reinterpret_cast<unsigned long long*>(st + STATUS_REJECTED_BY), 0ull,
                static_cast<unsigned long long>(peer + 1)) == 0ull) {
    st[STATUS_REJECTED_SEQ] = static_cast<i64>(c.seq);
    st[STATUS_REJECTED_WHY] = why;
    st[STATUS_REJECTED_OWN] = own;
    st[STATUS_REJECTED_PEER] = theirs;
  }
}

// ---- abort word ------------------------------------------------------------------------------------------------
// Set on EVERY rank (this one included): the detail words first, then the flag with st.release.sys, so a rank
// that acquires the flag reads the words of a completed write. A line whose flag is already set is left alone (the
// first aborter's detail is kept; two aborters racing on one line may mix their words, the flag is set either way).
__device__ __noinline__ void set_abort_all(const WaitCtx& c, int reason, int peer, int detail = 0) {
  for (int r = 0; r < c.world_size; ++r) {
    u64* line = reinterpret_cast<u64*>(c.peer_bases[r] + c.abort_offset);
    if (ld_acquire_sys_global(line + ABORT_FLAG) != 0) continue;
    volatile i64* w = reinterpret_cast<volatile i64*>(line);
    w[ABORT_RANK] = c.rank;
    w[ABORT_REASON] = reason;
    w[ABORT_PEER] = peer;
    w[ABORT_CHANNEL] = c.channel;
    w[ABORT_DETAIL] = detail;  // ERR_MISMATCH: the FIELD_* (the peers' SymBufferAbortedError names it)
    st_release_sys_global(line + ABORT_FLAG, 1ull);
  }
}

// This rank's abort flag (its own buffer: a local load).
__device__ __forceinline__ bool poll_abort(const WaitCtx& c) {
  return ld_acquire_sys_global(c.my_abort + ABORT_FLAG) != 0;
}

// A fatal error found by this rank (timeout, header mismatch, broken invariant): record it and make every rank
// leave (their waits see the abort word within SYMBUF_ABORT_POLL_NS instead of each waiting for its own timeout).
__device__ __noinline__ void fail(const WaitCtx& c, int role, int peer, i64 head, i64 tail, int kind, int field) {
  report_error(c, role, peer, head, tail, kind, field, -1);
  set_abort_all(c, kind, peer, field);
}

// This rank's abort word is set (by any rank): record ERR_ABORTED naming the aborting rank; set nothing further.
__device__ __noinline__ void report_aborted(const WaitCtx& c, int role, int peer, i64 head, i64 tail) {
  const int by = static_cast<int>(ld_volatile_global(reinterpret_cast<const i64*>(c.my_abort) + ABORT_RANK));
  report_error(c, role, peer, head, tail, ERR_ABORTED, 0, by);
}

// ---- bounded waits -----------------------------------------------------------------------------------------------
// Bounded spin: ok() is true while the wait may go on. False once
//   * this rank's abort word is set (polled every 1024 polls and at least every SYMBUF_ABORT_POLL_NS): ERR_ABORTED;
//   * the error record is already claimed (every 1024 polls; host-mapped, so not more often): this launch or an
//     earlier one failed (the record stays set, so queued launches of a failed communicator give up at once);
//   * the wait ran past timeout_ns: ERR_TIMEOUT, and the abort word set on every rank.
struct SpinBudget {
  const WaitCtx* c;
  u64 start, last;
  u32 polls;
  __device__ __forceinline__ explicit SpinBudget(const WaitCtx* ctx)
      : c(ctx), start(globaltimer_ns()), last(start), polls(0) {}
  __device__ __forceinline__ bool ok(int role, int peer, u64 head, u64 tail) {
    const u64 now = globaltimer_ns();
    const bool nth = (++polls & 1023u) == 0;
    if (nth || now - last > SYMBUF_ABORT_POLL_NS) {
      last = now;
      if (poll_abort(*c)) {
        report_aborted(*c, role, peer, static_cast<i64>(head), static_cast<i64>(tail));
        return false;
      }
      if (nth && ld_volatile_global(c->status + STATUS_SEQ) != 0) return false;  // another wait failed
    }
    if (now - start > c->timeout_ns) {
      fail(*c, role, peer, static_cast<i64>(head), static_cast<i64>(tail), ERR_TIMEOUT, 0);
      return false;
    }
    return true;
  }
};

// Sender: wait until the slot of counter t may be written: the receiver consumed counter t - num_slots, i.e.
// t + 1 - head <= num_slots. `head` is the last value read (any older value is a lower bound: it only delays);
// the acquire orders the receiver's reads of the slot before our writes to it. False (and *abort_flag set) when
// the wait failed or the group aborted. The error record names head and t (the counter waited for, as tail).
// The spinning itself is a function of its own (not inlined): its registers do not weigh on the copy loops.
__device__ __noinline__ u64 spin_for_space(const WaitCtx* c, int peer, const u64* head_line, u64 t, u64 num_slots,
                                           volatile int* abort_flag) {
  SpinBudget spin(c);
  while (true) {
    const u64 head = ld_acquire_sys_global(head_line);
#if SYMBUF_DEBUG
    if (head > t) {  // head <= the tail we published <= t (counter t is not published yet)
      fail(*c, ROLE_SEND, peer, static_cast<i64>(head), static_cast<i64>(t), ERR_INVARIANT, FIELD_RING);
      *abort_flag = 1;
      return head;
    }
#endif
    if (t + 1 - head <= num_slots) return head;
    if (*abort_flag || !spin.ok(ROLE_SEND, peer, head, t)) {
      *abort_flag = 1;
      return head;
    }
  }
}
__device__ __forceinline__ bool wait_for_space(const WaitCtx* c, int peer, const u64* head_line, u64 t, u64 num_slots,
                                               u64& head, volatile int* abort_flag) {
  if (t + 1 - head <= num_slots) return true;
  head = spin_for_space(c, peer, head_line, t, num_slots, abort_flag);
  return !*abort_flag;
}

// Receiver: wait until tail >= need (the slot of counter need - 1 holds data); the acquire orders the sender's
// writes of every slot below tail before our reads. `tail` is the last value read. head_lo <= the head we published
// <= head_hi (for the debug invariants: tail >= head, tail - head <= num_slots). The record names need - 1 (as
// head) and tail. False (and *abort_flag set) when the wait failed or the group aborted.
__device__ __noinline__ u64 spin_for_data(const WaitCtx* c, int peer, const u64* tail_line, u64 need, u64 head_lo,
                                          u64 head_hi, u64 num_slots, volatile int* abort_flag) {
  SpinBudget spin(c);
  while (true) {
    const u64 tail = ld_acquire_sys_global(tail_line);
#if SYMBUF_DEBUG
    if (tail < head_lo || tail > head_hi + num_slots) {
      fail(*c, ROLE_RECV, peer, static_cast<i64>(head_lo), static_cast<i64>(tail), ERR_INVARIANT, FIELD_RING);
      *abort_flag = 1;
      return tail;
    }
#else
    (void)head_lo, (void)head_hi, (void)num_slots;
#endif
    if (tail >= need) return tail;
    if (*abort_flag || !spin.ok(ROLE_RECV, peer, need - 1, tail)) {
      *abort_flag = 1;
      return tail;
    }
  }
}
__device__ __forceinline__ bool wait_for_data(const WaitCtx* c, int peer, const u64* tail_line, u64 need, u64 head_lo,
                                              u64 head_hi, u64 num_slots, u64& tail, volatile int* abort_flag) {
  if (tail >= need) return true;
  tail = spin_for_data(c, peer, tail_line, need, head_lo, head_hi, num_slots, abort_flag);
  return !*abort_flag;
}

// Sender: announce counters below `tail` in the receiver's buffer. The release is cumulative: it makes visible
// every write this thread issued and every write of the copy warps it acquired (ld.acquire.cta) before it.
__device__ __forceinline__ void publish_tail(u64* tail_line, u64 tail) { st_release_sys_global(tail_line, tail); }
// Receiver: hand counters below `head` back to the sender, after every read of those slots (same cumulativity).
__device__ __forceinline__ void publish_head(u64* head_line, u64 head) { st_release_sys_global(head_line, head); }

// SYMBUF_DEBUG: the access [p, p + n) lies in one ring slot of its (channel, peer) region (a "channel overflow"
// otherwise: it would land in another peer's or channel's region).
__device__ __forceinline__ bool slot_in_region(const u8* region, const u8* p, i64 n, i64 region_bytes,
                                               i64 chunk_bytes) {
  const i64 off = p - (region + RING_OFFSET);
  return off >= 0 && off % chunk_bytes == 0 && n >= 0 && n <= chunk_bytes &&
         RING_OFFSET + off + n <= region_bytes;
}

// ---- call header ---------------------------------------------------------------------------------------------------
struct CallHeader {
  i64 magic, seq, op, sig, units, nchunks, status, rank, channel;
  i64 mode, direct_alloc, direct_offset;  // MODE_RING, or MODE_DIRECT: the run lies in symmetric allocation
                                          // direct_alloc at byte direct_offset of the sender's block
};

// Sender's publisher: the header into the slot of counter `first` in the receiver's ring (after wait_for_space),
// before publish_tail(first + 1), whose release makes these plain stores visible first.
__device__ __forceinline__ void write_call_header(u8* slot, const CallHeader& h) {
  i64* w = reinterpret_cast<i64*>(slot);
  w[HDR_MAGIC] = h.magic;
  w[HDR_SEQ] = h.seq;
  w[HDR_OP] = h.op;
  w[HDR_SIG] = h.sig;
  w[HDR_UNITS] = h.units;
  w[HDR_NCHUNKS] = h.nchunks;
  w[HDR_STATUS] = h.status;
  w[HDR_RANK] = h.rank;
  w[HDR_CHANNEL] = h.channel;
  w[HDR_MODE] = h.mode;
  w[HDR_DIRECT_ALLOC] = h.direct_alloc;
  w[HDR_DIRECT_OFFSET] = h.direct_offset;
}

// Receiver's publisher: the header, read after the acquire of tail >= first + 1 (ld.volatile: never an old line).
__device__ __forceinline__ CallHeader read_call_header(const u8* slot) {
  const i64* w = reinterpret_cast<const i64*>(slot);
  return CallHeader{ld_volatile_global(w + HDR_MAGIC),   ld_volatile_global(w + HDR_SEQ),
                    ld_volatile_global(w + HDR_OP),      ld_volatile_global(w + HDR_SIG),
                    ld_volatile_global(w + HDR_UNITS),   ld_volatile_global(w + HDR_NCHUNKS),
                    ld_volatile_global(w + HDR_STATUS),  ld_volatile_global(w + HDR_RANK),
                    ld_volatile_global(w + HDR_CHANNEL), ld_volatile_global(w + HDR_MODE),
                    ld_volatile_global(w + HDR_DIRECT_ALLOC), ld_volatile_global(w + HDR_DIRECT_OFFSET)};
}

// The received header against what this receiver expects, in this order: magic, seq, op, then (`full`: the
// peer sent HDR_OK and this rank is not rejecting) signature and units of the whole run. 0 when they agree,
// else the FIELD_* of the first difference with the expected and the received value.
__device__ __forceinline__ int check_call_header(const CallHeader& got, const CallHeader& want, bool full,
                                                 i64& expected, i64& received) {
  int field = 0;
  if (got.magic != want.magic) field = FIELD_MAGIC, expected = want.magic, received = got.magic;
  else if (got.seq != want.seq) field = FIELD_SEQ, expected = want.seq, received = got.seq;
  else if (got.op != want.op) field = FIELD_OP, expected = want.op, received = got.op;
  else if (full && got.sig != want.sig) field = FIELD_SIG, expected = want.sig, received = got.sig;
  else if (full && got.units != want.units) field = FIELD_UNITS, expected = want.units, received = got.units;
  return field;
}
