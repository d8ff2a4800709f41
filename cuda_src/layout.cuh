// The device side of cupy_symbuf/layout.py (ChannelLayout): the same offsets, handed in as scalars by
// ChannelLayout.kernel_args(), and the error record every bounded wait writes on timeout.
#pragma once
#include "primitives.cuh"

// Offsets inside one (channel, peer) region; must match layout.py (TAIL_OFFSET ... RING_OFFSET).
#define SYMBUF_LINE 128
#define SYMBUF_TAIL_OFFSET (0 * SYMBUF_LINE)       // written by the peer's sender (remote), read by our receiver
#define SYMBUF_HEAD_OFFSET (1 * SYMBUF_LINE)       // written by the peer's receiver (remote), read by our sender
#define SYMBUF_SEND_TAIL_OFFSET (2 * SYMBUF_LINE)  // local sender state
#define SYMBUF_RECV_HEAD_OFFSET (3 * SYMBUF_LINE)  // local receiver state
#define SYMBUF_RING_OFFSET (4 * SYMBUF_LINE)       // num_slots * chunk_bytes payload

struct Layout {
  i64 region_bytes;       // 4 lines + ring
  i64 channel_bytes;      // world_size * region_bytes
  i64 num_slots;          // ring capacity in chunks
  i64 chunk_bytes;        // bytes per slot
  i64 notify_offset;      // start of the notify region
  i64 notify_slot_bytes;  // one source rank's notify slot

  __device__ __forceinline__ i64 region(int channel, int peer) const {
    return channel * channel_bytes + peer * region_bytes;
  }
  __device__ __forceinline__ i64 notify_slot(i64 parity, int source, int world_size) const {
    return notify_offset + (parity * world_size + source) * notify_slot_bytes;
  }
};

// Rows [lo, hi) of an n-row stream carried by `channel`, boundaries rounded down to multiples of `align` rows
// (same formula as layout.channel_row_range; byte streams use 1-byte rows and align = 16).
__device__ __forceinline__ void channel_range(i64 n, int channel, int num_channels, i64 align, i64& lo, i64& hi) {
  lo = (n * channel / num_channels) / align * align;
  hi = (channel == num_channels - 1) ? n : (n * (channel + 1) / num_channels) / align * align;
}

// ---- launch descriptor of symbuf_alltoallv ------------------------------------------------------------------
// DESC_WORDS int64 words passed by value as the kernel's first parameter (1416 bytes, inside the 4 KiB parameter
// space), written by cupy_symbuf/_cuda.py (its DESC_* constants must match; tests/test_kernels_compile.py checks)
// and copied into shared memory by every block at launch.
// A "row stream" is the rows one rank sends to (or receives from) one peer. A row is the concatenation of up to
// SYMBUF_MAX_PARTS parts; part i of row r is `width` bytes at base + token(r) * stride, where token(r) is
// index[r] (a device int64 array) or r itself when there is no index. Byte streams are rows of 1 byte.
#define SYMBUF_MAX_PARTS 4
#define SYMBUF_MAX_PEERS 32
enum {
  DESC_RANK = 0, DESC_WORLD_SIZE, DESC_NUM_CHANNELS, DESC_REGION_BYTES, DESC_CHANNEL_BYTES, DESC_NUM_SLOTS,
  DESC_CHUNK_BYTES, DESC_TIMEOUT_NS,                     // static: from ChannelLayout.kernel_args() and Config
  DESC_ROW_BYTES = 8, DESC_ROW_ALIGN, DESC_SEND_INDEX, DESC_RECV_INDEX, DESC_NUM_SEND_PARTS, DESC_NUM_RECV_PARTS,
  DESC_RING_WARPS, DESC_SELF_WARPS,                      // warps of a peer's group and of the rank's own group
  DESC_SEND_PARTS = 16,                                  // SYMBUF_MAX_PARTS x {base, stride, width, offset in row}
  DESC_RECV_PARTS = 32,
  DESC_PEERS = 48,                                       // [4][world_size]: send row offset, send rows,
                                                         //                  recv row offset, recv rows
  DESC_SEQ = DESC_PEERS + 4 * SYMBUF_MAX_PEERS,          // launch number, written into the error record
  DESC_WORDS
};

struct Desc {
  i64 words[DESC_WORDS];
};

struct Part {
  i64 base, stride, width, offset;  // bytes; offset = first byte of the part inside the packed row
};

// One side of one peer's row stream, with its parts in shared memory. Ring chunks hold whole packed rows (at most
// chunk_bytes / row_bytes of them, chunk_rows in alltoall.cu); a byte stream has 1-byte rows and one dense part.
struct RowStream {
  const Part* parts;
  int num_parts;
  i64 row_bytes;
  const i64* index;  // row -> token, or nullptr (identity)
  i64 row0;          // first row of this peer's stream (into index, or into the parts' rows)

  // One contiguous part, rows in order: any run of rows is one span of bytes.
  __device__ __forceinline__ bool dense() const {
    return num_parts == 1 && index == nullptr && parts[0].stride == parts[0].width;
  }
  // Address of part i of stream row r.
  __device__ __forceinline__ u8* at(int i, i64 r) const {
    const i64 token = index ? __ldg(index + row0 + r) : row0 + r;
    return reinterpret_cast<u8*>(parts[i].base) + token * parts[i].stride;
  }
  // One warp copies stream rows [r, r + n) between the parts and packed rows at `flat` (a ring slot).
  // kToFlat: parts -> flat (sender; the source is read-only during the kernel); else flat -> parts (receiver).
  template <bool kToFlat>
  __device__ __forceinline__ void copy_rows(u8* flat, i64 r, i64 n, int lane) const {
    if (dense()) {
      u8* p = reinterpret_cast<u8*>(parts[0].base) + (row0 + r) * row_bytes;
      if (kToFlat) copy_bytes<false>(flat, p, n * row_bytes, lane);
      else copy_bytes<true>(p, flat, n * row_bytes, lane);
      return;
    }
    for (i64 j = 0; j < n; ++j) {
      for (int i = 0; i < num_parts; ++i) {
        u8* f = flat + j * row_bytes + parts[i].offset;
        if (kToFlat) copy_bytes<false>(f, at(i, r + j), parts[i].width, lane);
        else copy_bytes<true>(at(i, r + j), f, parts[i].width, lane);
      }
    }
  }
};

// Error record (i64[8], host-mapped): [1..6] role, rank, peer, channel, head, tail of the first failing wait,
// which claims the record by writing its launch number `seq` (>= 1) into [7] and then sets [0] = 1 with a
// system-scope release, so a host that reads [0] == 1 while kernels still run (calls return without waiting)
// finds the fields written, and knows which queued call failed.
// Roles: 0 = send (waiting for space), 1 = recv (waiting for data), 2 = notify.
enum { SYMBUF_ROLE_SEND = 0, SYMBUF_ROLE_RECV = 1, SYMBUF_ROLE_NOTIFY = 2 };

__device__ __forceinline__ void report_timeout(i64* status, u64 seq, int role, int rank, int peer, int channel,
                                               u64 head, u64 tail) {
  if (atomicCAS(reinterpret_cast<unsigned long long*>(status + 7), 0ull, seq) == 0ull) {
    status[1] = role;
    status[2] = rank;
    status[3] = peer;
    status[4] = channel;
    status[5] = static_cast<i64>(head);
    status[6] = static_cast<i64>(tail);
    st_release_sys_global(reinterpret_cast<u64*>(status), 1ull);
  }
}

// Bounded spin: true while the wait may go on; false (and the error record written) once it expired or
// another wait already failed (this launch or an earlier one: the record stays set, so queued launches of a
// failed communicator give up at their first wait).
struct SpinBudget {
  u64 start, timeout_ns, seq;
  u32 polls;
  __device__ __forceinline__ SpinBudget(u64 t, u64 s) : start(globaltimer_ns()), timeout_ns(t), seq(s), polls(0) {}
  __device__ __forceinline__ bool ok(i64* status, int role, int rank, int peer, int channel, u64 head, u64 tail) {
    if ((++polls & 1023u) == 0 && ld_volatile_global(status + 7) != 0) return false;  // someone else failed
    if (globaltimer_ns() - start > timeout_ns) {
      report_timeout(status, seq, role, rank, peer, channel, head, tail);
      return false;
    }
    return true;
  }
};

// Synchronise the threads of one warp group (one peer) inside a block: named barrier `id` (1..15) for several
// warps, __syncwarp for one.
__device__ __forceinline__ void group_sync(int id, int nthreads) {
  if (nthreads == 32) {
    __syncwarp();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
  }
}
