// The device side of cupy_symbuf/layout.py (ChannelLayout): the region arithmetic, handed in as scalars by
// ChannelLayout.kernel_args() or the launch descriptor, the launch descriptor's type, the row streams and the
// group barrier. Every protocol constant (offsets TAIL_OFFSET ... RING_OFFSET, DESC_*, MAX_PARTS, MAX_PEERS, ...)
// comes from the header cupy_symbuf/_protocol.py generates and cupy_symbuf/_kernels.py puts in front of every
// source: nothing here copies one by hand. The ring protocol itself is in protocol.cuh.
#pragma once
#include "primitives.cuh"

#ifndef SYMBUF_PROTOCOL_GENERATED
#error "cuda_src/ is compiled through cupy_symbuf.transport.kernels, which prepends the generated protocol header"
#endif

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

// ---- launch descriptor of symbuf_ring_exchange -------------------------------------------------------------
// DESC_WORDS int64 words (_protocol: DESC_*) passed by value as the kernel's first parameter (inside the 4 KiB
// parameter space), written by cupy_symbuf/_cuda.py and copied into shared memory by every block at launch.
// A "row stream" is the rows one rank sends to (or receives from) one peer. A row is the concatenation of up to
// MAX_PARTS parts; part i of row r is `width` bytes at base + token(r) * stride, where token(r) is
// index[r] (a device int64 array) or r itself when there is no index. Byte streams are rows of 1 byte.
// DESC_PEERS is [4][world_size]: send unit offset, send units, recv unit offset, recv units (whole streams).
struct Desc {
  i64 words[DESC_WORDS];
};

struct Part {
  i64 base, stride, width, offset;  // bytes; offset = first byte of the part inside the packed row
};

// One side of one peer's row stream, with its parts in shared memory. Ring chunks hold whole packed rows (at most
// chunk_bytes / row_bytes of them, chunk_rows in ring_prims.cuh); a byte stream has 1-byte rows and one dense part.
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
  // skip: parts (bit i = part i) not copied (MODE_PUSH: the sender wrote them into our outputs itself).
  template <bool kToFlat>
  __device__ __forceinline__ void copy_rows(u8* flat, i64 r, i64 n, int lane, u32 skip = 0) const {
    if (skip != 0) {
      if (dense()) return;  // one part, and it is skipped
      for (i64 j = 0; j < n; ++j)
        for (int i = 0; i < num_parts; ++i) {
          if ((skip >> i) & 1u) continue;
          u8* f = flat + j * row_bytes + parts[i].offset;
          if (kToFlat) copy_bytes<false>(f, at(i, r + j), parts[i].width, lane);
          else copy_bytes<true>(at(i, r + j), f, parts[i].width, lane);
        }
      return;
    }
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

// MODE_PUSH, one sender warp: stream rows [r, r + n) of `send`; the parts in `mask` go straight into the
// receiver's outputs: part i of row r + j at recv.parts[i].base + delta[i] + (row0 + r + j) * recv.parts[i].stride
// (`recv` is this rank's own receive stream, laid out as the receiver's: the row signature agrees on it; delta =
// the receiver's block minus ours, as mapped here; row0 = the receiver's first row of our stream); the other parts
// into the packed rows at `flat` (a ring slot), as copy_rows<true>.
__device__ __forceinline__ void push_rows(const RowStream& send, const RowStream& recv, u8* flat, i64 r, i64 n,
                                          i64 row0, u32 mask, const i64* delta, int lane) {
  for (i64 j = 0; j < n; ++j)
    for (int i = 0; i < send.num_parts; ++i) {
      const u8* src = send.at(i, r + j);
      u8* dst = ((mask >> i) & 1u)
                    ? reinterpret_cast<u8*>(recv.parts[i].base + delta[i]) + (row0 + r + j) * recv.parts[i].stride
                    : flat + j * send.row_bytes + send.parts[i].offset;
      copy_bytes<false>(dst, src, send.parts[i].width, lane);
    }
}

// Synchronise the threads of one warp group (one peer) inside a block: named barrier `id` (1..15) for several
// warps, __syncwarp for one.
__device__ __forceinline__ void group_sync(int id, int nthreads) {
  if (nthreads == 32) {
    __syncwarp();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
  }
}
