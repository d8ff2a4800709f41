// alltoallv over the channel ring buffers, and the notify (count exchange) step.
//
// Grid: 2 * num_channels blocks. Block 2c sends for channel c, block 2c+1 receives for it (sender and receiver
// on different SMs). Inside a block the warps are split into world_size warp groups, one per peer, so every
// (channel, source, destination) stream progresses on its own and no peer can block another.
// What moves is described by the launch descriptor (layout.cuh, DESC_*): per peer a stream of rows, each row
// gathered from up to 4 parts on the send side (MoE dispatch: x | scales | topk_idx | weights of the token
// index[r]) and scattered into up to 4 parts on the receive side; plain alltoallv is a byte stream (1-byte rows).
// Channel c carries rows [lo, hi) of every stream; its ring slots hold rows_per_chunk whole rows each.
//
// Ring protocol per (channel c, sender s, receiver d), counters in chunks, only growing, slot = counter % num_slots:
//   sender (v6): warp 0 of each group publishes, the others copy, each owning every (ring_warps - 1)-th
//             chunk: lane 0 waits while tail - head == num_slots (backpressure; head read with ld.acquire.sys from
//             our own buffer, where d's receiver writes it); the warp copies the chunk's rows into d's ring;
//             __syncwarp; lane 0 marks the chunk done in shared memory (st.release.cta). The publisher acquires
//             the marks in chunk order (ld.acquire.cta) and publishes each run of finished chunks with one
//             st.release.sys of tail into d's buffer: cumulative, so it makes every acquired warp's payload
//             visible before the tail that announces it, and the copy warps never wait on a system fence.
//   receiver: the mirror image: warp 0 publishes head, the other warps each own every (ring_warps - 1)-th
//             chunk: lane 0 polls tail with ld.acquire.sys until it covers the chunk, the warp copies it out (.cg
//             loads), lane 0 marks it done (st.release.cta); the publisher releases head over each run of done
//             chunks with one st.release.sys into s's buffer.
// A rank's rows to itself skip the ring: the sender block's and the receiver block's self groups each copy half
// of the channel's rows straight from the send parts to the receive parts.
// Every wait is bounded by timeout_ns; on expiry the error record names rank, peer, channel, head and tail.
#include "layout.cuh"

// The sender's publisher releases tail once at least this many chunks are ready (or the stream is complete, or
// nothing new became ready for a while): fewer system-scope releases, each covering more payload.
#ifndef SYMBUF_PUBLISH_BATCH
#define SYMBUF_PUBLISH_BATCH 1
#endif

// Threads per block (__launch_bounds__): 1024 gives 32 warps but 64 registers per thread; 512 gives 128.
#ifndef SYMBUF_MAX_THREADS
#define SYMBUF_MAX_THREADS 1024
#endif

// The publisher of one warp group (lane 0 of its warp 0): acquires the copy warps' done marks in counter order
// (ld.acquire.cta; copy warp i owns every num_copy-th chunk and stores chunk + 1 into done[i] after its last access
// to it) and releases the counter into the peer's buffer with ONE st.release.sys per run of finished chunks: tail
// for a sender, head for a receiver. A run is published once it holds `batch` chunks, reaches `end`, or nothing new
// got ready for a while. The release is cumulative: it covers every access of each warp acquired from.
__device__ __forceinline__ void publish_runs(u64* remote_counter, const u64* done, int num_copy, u64 first, u64 end,
                                             u64 batch, volatile int* abort_flag, i64* status, int role, int rank,
                                             int peer, int channel, u64 timeout_ns, u64 seq) {
  u64 published = first, ready = first;
  u32 idle = 0;
  SpinBudget spin(timeout_ns, seq);
  while (published < end && !*abort_flag) {
    const u64 before = ready;
    while (ready < end && ld_acquire_cta(&done[(ready - first) % num_copy]) > ready) ++ready;
    idle = ready == before ? idle + 1 : 0;
    if (ready > published && (ready - published >= batch || ready == end || idle > 32)) {
      st_release_sys_global(remote_counter, ready);
      published = ready;
      spin = SpinBudget(timeout_ns, seq);
    } else if (!spin.ok(status, role, rank, peer, channel, published, ready)) {
      *abort_flag = 1;
    }
  }
}

// Rows per chunk of an n-row stream on one channel: num_copy chunks per round, in as few rounds as whole slots
// allow (a short stream is spread over every copy warp instead of one warp copying one slot; a long one ends on a
// full round); at least 4 KiB of rows (one unrolled warp pass), a multiple of 512 bytes of rows (one vector pass;
// keeps byte streams 16-byte aligned), at most one slot. Sender and receiver compute it from the same n (the rows
// the one sends the other receives) and the same num_copy (same kernel variant on every rank), so they cut the
// stream alike. Same formula as cupy_symbuf/layout.py chunk_rows (the host path uses it with one copy worker).
__host__ __device__ __forceinline__ i64 chunk_rows(i64 n, i64 row_bytes, i64 chunk_bytes, int num_copy) {
  const i64 max_rows = chunk_bytes / row_bytes;
  if (n <= 0) return max_rows;  // no chunks
  const i64 grain = min(max_rows, (512 + row_bytes - 1) / row_bytes);
  const i64 least = min(max_rows, (4096 + row_bytes - 1) / row_bytes);
  const i64 rounds = (n + num_copy * max_rows - 1) / (num_copy * max_rows);
  const i64 per = (n + num_copy * rounds - 1) / (num_copy * rounds);
  return min(max_rows, max(least, (per + grain - 1) / grain * grain));
}

// The descriptor is the kernel's parameter, passed by value: the driver copies it at launch, so the host may
// rewrite its own copy for the next call while this one is still queued (calls return without waiting).
extern "C" __global__ void __launch_bounds__(SYMBUF_MAX_THREADS)
symbuf_alltoallv(const __grid_constant__ Desc desc, const u64* __restrict__ peer_bases, i64* status) {
  __shared__ i64 s_desc[DESC_WORDS];
  __shared__ u64 s_done[32];  // per warp of the block
  __shared__ int s_abort[SYMBUF_MAX_PEERS];
  for (int i = threadIdx.x; i < DESC_WORDS; i += blockDim.x) s_desc[i] = desc.words[i];  // constant bank
  __syncthreads();
  const int rank = static_cast<int>(s_desc[DESC_RANK]);
  const int world_size = static_cast<int>(s_desc[DESC_WORLD_SIZE]);
  const int num_channels = static_cast<int>(s_desc[DESC_NUM_CHANNELS]);
  const Layout L{s_desc[DESC_REGION_BYTES], s_desc[DESC_CHANNEL_BYTES], s_desc[DESC_NUM_SLOTS],
                 s_desc[DESC_CHUNK_BYTES], 0, 0};
  const i64 num_slots = L.num_slots, chunk_bytes = L.chunk_bytes;
  const u64 timeout_ns = static_cast<u64>(s_desc[DESC_TIMEOUT_NS]);
  const u64 seq = static_cast<u64>(s_desc[DESC_SEQ]);
  const i64 row_bytes = s_desc[DESC_ROW_BYTES];
  const i64 align = s_desc[DESC_ROW_ALIGN];

  const int channel = blockIdx.x >> 1;
  const bool is_sender = (blockIdx.x & 1) == 0;
  // Warp groups in peer order: ring_warps warps for every other rank, self_warps for our own rows (_cuda.warp_groups)
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
  if (peer >= world_size || row_bytes <= 0 || row_bytes > chunk_bytes) return;
  const int nthreads = group_warps * 32;
  const int tid = threadIdx.x - first_warp * 32;
  const int lane = tid & 31;
  const int warp_in_group = tid >> 5;
  const bool leader = tid == 0;
  const int bar_id = 1 + peer;

  const i64* peers = s_desc + DESC_PEERS;  // [4][world_size]: send row offset, send rows, recv row offset, recv rows
  // The two row streams of this group live in shared memory (read on use, not held in registers: the copy
  // loops need the registers; 1024-thread blocks get 64 per thread).
  __shared__ RowStream s_streams[2 * SYMBUF_MAX_PEERS];
  if (lane == 0 && warp_in_group == 0) {
    s_streams[2 * peer] = RowStream{reinterpret_cast<const Part*>(s_desc + DESC_SEND_PARTS),
                                    static_cast<int>(s_desc[DESC_NUM_SEND_PARTS]), row_bytes,
                                    reinterpret_cast<const i64*>(s_desc[DESC_SEND_INDEX]), peers[peer]};
    s_streams[2 * peer + 1] = RowStream{reinterpret_cast<const Part*>(s_desc + DESC_RECV_PARTS),
                                        static_cast<int>(s_desc[DESC_NUM_RECV_PARTS]), row_bytes,
                                        reinterpret_cast<const i64*>(s_desc[DESC_RECV_INDEX]),
                                        peers[2 * world_size + peer]};
  }
  group_sync(bar_id, nthreads);
  const RowStream& send = s_streams[2 * peer];
  const RowStream& recv = s_streams[2 * peer + 1];
  const i64 rows = is_sender ? peers[world_size + peer] : peers[3 * world_size + peer];
  i64 lo, hi;
  channel_range(rows, channel, num_channels, align, lo, hi);
  if (hi <= lo) return;

  if (peer == rank) {  // to ourselves: no ring; the sender block copies the first half, the receiver block the rest
    const i64 mid = lo + (hi - lo) / 2 / align * align;
    const i64 a = is_sender ? lo : mid, b = is_sender ? mid : hi;
    if (send.dense() && recv.dense()) {  // one span of bytes, cut into 16-byte aligned slices, one per warp
      const i64 n = (b - a) * row_bytes;
      const i64 lo_b = n * warp_in_group / group_warps / 16 * 16;
      const i64 hi_b = warp_in_group == group_warps - 1 ? n : n * (warp_in_group + 1) / group_warps / 16 * 16;
      copy_bytes<false>(recv.at(0, a) + lo_b, send.at(0, a) + lo_b, hi_b - lo_b, lane);
    } else {  // one warp per row
      for (i64 r = a + warp_in_group; r < b; r += group_warps)
        for (int i = 0; i < send.num_parts; ++i)
          copy_bytes<false>(recv.at(i, r), send.at(i, r), send.parts[i].width, lane);
    }
    return;
  }

  if (leader) s_abort[peer] = 0;
  // Sender: copy warps write chunks into the peer's ring and the publisher releases tail there; backpressure reads
  // head from our own region, where the peer's receiver releases it. Receiver: the mirror image (tail read from our
  // region, head released into the peer's). Warp 0 of a group publishes, the others copy, each owning every
  // num_copy-th chunk and handing it over with st.release.cta of done = chunk + 1 (no system-scope fence on the
  // copy path; one release per run of chunks, see publish_runs). A group of one warp (world_size > 15) copies and
  // releases each chunk itself.
  u8* local_region = reinterpret_cast<u8*>(peer_bases[rank]) + L.region(channel, peer);
  u8* remote_region = reinterpret_cast<u8*>(peer_bases[peer]) + L.region(channel, rank);
  u64* remote_counter = reinterpret_cast<u64*>(remote_region + (is_sender ? SYMBUF_TAIL_OFFSET : SYMBUF_HEAD_OFFSET));
  const u64* local_counter =
      reinterpret_cast<const u64*>(local_region + (is_sender ? SYMBUF_HEAD_OFFSET : SYMBUF_TAIL_OFFSET));
  // Our side's counter at the end of the previous launch (written by this group's leader below).
  u64* state = reinterpret_cast<u64*>(local_region + (is_sender ? SYMBUF_SEND_TAIL_OFFSET : SYMBUF_RECV_HEAD_OFFSET));
  const bool solo = group_warps == 1;
  const int num_copy = solo ? 1 : group_warps - 1;
  const int copy_id = solo ? 0 : warp_in_group - 1;
  const i64 rows_per_chunk = chunk_rows(hi - lo, row_bytes, chunk_bytes, num_copy);
  const i64 nchunks = (hi - lo + rows_per_chunk - 1) / rows_per_chunk;
  const u64 first = *state;
  const u64 end = first + static_cast<u64>(nchunks);
  u64* done = &s_done[first_warp + (solo ? 0 : 1)];  // [num_copy]: last chunk + 1 each copy warp finished
  volatile int* abort_flag = &s_abort[peer];
  const int role = is_sender ? SYMBUF_ROLE_SEND : SYMBUF_ROLE_RECV;
  if (lane == 0 && copy_id >= 0) st_release_cta(&done[copy_id], first);
  group_sync(bar_id, nthreads);
  if (copy_id < 0) {  // the publisher (lane 0 of warp 0); a receiver hands each slot back as soon as it is read
    if (lane == 0)
      publish_runs(remote_counter, done, num_copy, first, end, is_sender ? SYMBUF_PUBLISH_BATCH : 1, abort_flag,
                   status, role, rank, peer, channel, timeout_ns, seq);
    __syncwarp();
  } else {
    u8* ring = (is_sender ? remote_region : local_region) + SYMBUF_RING_OFFSET;
    u64 seen = is_sender ? 0 : first;  // sender: the last head read; receiver: the last tail read
    if (is_sender && lane == 0) seen = ld_acquire_sys_global(local_counter);
    for (i64 k = copy_id; k < nchunks; k += num_copy) {
      const u64 t = first + static_cast<u64>(k);  // ring counter of this chunk
      if (lane == 0) {  // sender: wait while the ring is full (backpressure); receiver: wait until tail covers t
        SpinBudget spin(timeout_ns, seq);
        while ((is_sender ? t + 1 - seen > static_cast<u64>(num_slots) : seen <= t) && !*abort_flag) {
          seen = ld_acquire_sys_global(local_counter);
          if (!spin.ok(status, role, rank, peer, channel, is_sender ? seen : t, is_sender ? t : seen)) {
            *abort_flag = 1;
            break;
          }
        }
      }
      __syncwarp();  // lane 0's acquire precedes every lane's accesses to the slot
      if (__shfl_sync(0xffffffffu, *abort_flag, 0)) break;  // lane 0's view: the whole warp leaves together
      const i64 r = lo + k * rows_per_chunk;
      u8* slot = ring + static_cast<i64>(t % static_cast<u64>(num_slots)) * chunk_bytes;
      if (is_sender) send.copy_rows<true>(slot, r, min(rows_per_chunk, hi - r), lane);
      else recv.copy_rows<false>(slot, r, min(rows_per_chunk, hi - r), lane);
      __syncwarp();  // every lane's accesses to the slot precede lane 0's hand-off below
      if (lane == 0) {
        if (solo) st_release_sys_global(remote_counter, t + 1);
        else st_release_cta(&done[copy_id], t + 1);
      }
      __syncwarp();
    }
  }
  group_sync(bar_id, nthreads);
  if (leader && !*abort_flag) *state = end;
}

// Count exchange through the symmetric buffer. Every rank writes send_meta[p, :] (num_values int64) into rank
// p's notify slot for this rank, then publishes `epoch` there with st.release.sys; then waits until every source
// has published `epoch` in our slots and copies their values to recv_meta[s, :]. Slots are double-buffered by
// epoch parity: a rank can be at most one call ahead of a peer that has not read its values yet.
// One block; blockDim.x >= world_size.
extern "C" __global__ void __launch_bounds__(1024)
symbuf_notify(const i64* __restrict__ send_meta, i64* __restrict__ recv_meta, int num_values, i64 epoch,
              const u64* __restrict__ peer_bases, int rank, int world_size,
              i64 region_bytes, i64 channel_bytes, i64 num_slots, i64 chunk_bytes,
              i64 notify_offset, i64 notify_slot_bytes, u64 timeout_ns, i64* status, u64 seq) {
  const Layout L{region_bytes, channel_bytes, num_slots, chunk_bytes, notify_offset, notify_slot_bytes};
  const i64 parity = epoch & 1;
  const i64 total = static_cast<i64>(world_size) * num_values;
  for (i64 i = threadIdx.x; i < total; i += blockDim.x) {
    const int p = static_cast<int>(i / num_values);
    const i64 m = i % num_values;
    i64* slot = reinterpret_cast<i64*>(reinterpret_cast<u8*>(peer_bases[p]) + L.notify_slot(parity, rank, world_size));
    slot[1 + m] = send_meta[i];
  }
  __syncthreads();
  __shared__ int s_abort;
  if (threadIdx.x == 0) s_abort = 0;
  if (threadIdx.x < world_size) {
    const int p = threadIdx.x;
    u64* slot = reinterpret_cast<u64*>(reinterpret_cast<u8*>(peer_bases[p]) + L.notify_slot(parity, rank, world_size));
    st_release_sys_global(slot, static_cast<u64>(epoch));
  }
  __syncthreads();
  u8* my_base = reinterpret_cast<u8*>(peer_bases[rank]);
  if (threadIdx.x < world_size) {
    const int s = threadIdx.x;
    const u64* slot = reinterpret_cast<const u64*>(my_base + L.notify_slot(parity, s, world_size));
    SpinBudget spin(timeout_ns, seq);
    u64 seen = ld_acquire_sys_global(slot);
    while (seen < static_cast<u64>(epoch)) {
      seen = ld_acquire_sys_global(slot);
      if (!spin.ok(status, SYMBUF_ROLE_NOTIFY, rank, s, -1, static_cast<u64>(epoch), seen)) { s_abort = 1; break; }
    }
  }
  __syncthreads();
  if (s_abort) return;
  for (i64 i = threadIdx.x; i < total; i += blockDim.x) {
    const int s = static_cast<int>(i / num_values);
    const i64 m = i % num_values;
    const u8* slot = my_base + L.notify_slot(parity, s, world_size);
    recv_meta[i] = static_cast<i64>(ld_acquire_sys_global(reinterpret_cast<const u64*>(slot) + 1 + m));
  }
}
