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

// Bytes [lo, hi) of an n-byte message carried by `channel` (same formula as layout.channel_byte_range).
__device__ __forceinline__ void channel_range(i64 n, int channel, int num_channels, i64& lo, i64& hi) {
  lo = (n * channel / num_channels) / 16 * 16;
  hi = (channel == num_channels - 1) ? n : (n * (channel + 1) / num_channels) / 16 * 16;
}

// Error record (i64[8], host-mapped): [0] set to 1 by the first failing wait; then role, rank, peer, channel,
// head, tail. Roles: 0 = send (waiting for space), 1 = recv (waiting for data), 2 = notify.
enum { SYMBUF_ROLE_SEND = 0, SYMBUF_ROLE_RECV = 1, SYMBUF_ROLE_NOTIFY = 2 };

__device__ __forceinline__ void report_timeout(i64* status, int role, int rank, int peer, int channel, u64 head,
                                               u64 tail) {
  if (atomicCAS(reinterpret_cast<unsigned long long*>(status), 0ull, 1ull) == 0ull) {
    status[1] = role;
    status[2] = rank;
    status[3] = peer;
    status[4] = channel;
    status[5] = static_cast<i64>(head);
    status[6] = static_cast<i64>(tail);
    __threadfence_system();
  }
}

// Bounded spin: true while the wait may go on; false (and the error record written) once it expired or
// another wait of this launch already failed.
struct SpinBudget {
  u64 start, timeout_ns;
  u32 polls;
  __device__ __forceinline__ SpinBudget(u64 t) : start(globaltimer_ns()), timeout_ns(t), polls(0) {}
  __device__ __forceinline__ bool ok(i64* status, int role, int rank, int peer, int channel, u64 head, u64 tail) {
    if ((++polls & 1023u) == 0 && ld_volatile_global(status) != 0) return false;  // someone else failed
    if (globaltimer_ns() - start > timeout_ns) {
      report_timeout(status, role, rank, peer, channel, head, tail);
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
