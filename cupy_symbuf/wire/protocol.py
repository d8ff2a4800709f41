"""The one source of the wire protocol's constants, shared by the host engine (``transport/host.py``), the GPU launch code
(``transport/cuda.py``) and the kernels (``cuda_src/``): :func:`cuda_header` turns them into the C++ header that
``transport/kernels.py`` puts in front of every CUDA source at NVRTC time, so nothing is copied by hand.

Ring protocol, per call and per (channel c, sender s, receiver d), counters in ring slots (only growing,
slot = counter % num_slots), ``first`` = the counter the previous call left:

* counter ``first`` is the **call header** (``HDR_*`` int64 words at the start of the slot), written by the sender
  before any payload: magic, the per-(channel, peer) call sequence number, operation, row signature, the units the
  sender sends to d in the whole call, the payload chunks that follow on this channel, and a status (``HDR_OK`` or
  ``HDR_REJECTED``: the sender's rank rejected the call; no payload follows). Every call sends it, also with
  nothing to move on that channel, so a receiver always learns what its peer is doing before it consumes a byte.
  (Host engine: a run on fewer channels, ``host_run_channels``, sends headers only on the channels that carry it,
  channel 0 always; channel 0's header says how many, ``HDR_NCHANNELS``; a run of ``host_run_inline`` follows its
  header in the same slot, and the header says 0 chunks.)
* counters ``first + 1 ... first + nchunks`` carry payload chunks.
* the receiver checks the header against its own call (magic, seq, op, signature, units) before any payload is
  consumed. A difference is fatal: an error record with ``ERR_MISMATCH`` and the field (``FIELD_*``), the
  expected and the received value, and the abort word set on every rank, so every rank involved raises. A
  ``HDR_REJECTED`` header is not an error of the ring: the receiver consumes the header, skips nothing (no payload
  follows) and records the rejection (``STATUS_REJECTED_BY``); a rejecting rank's receiver drains what its peers
  send (``nchunks`` of their headers) without copying, so the rings stay in step and the communicator usable.

Per-(channel, peer) state lines (local to a rank, written only by its own sender or receiver group):
``STATE_COUNTER`` = ring counter at the end of the last call, ``STATE_SEQ`` = calls made on this (channel, peer) pair.

Abort word: one line per rank's buffer (``ChannelLayout.abort_offset``), ``ABORT_*`` words. Whoever aborts (a
timeout, a header mismatch, :meth:`Communicator.abort`) writes rank, reason and detail into every rank's line and
then sets ``ABORT_FLAG`` (release); every wait (kernels and host loops) polls its own line and leaves with
``ERR_ABORTED`` naming the aborting rank.

Error record (GPU: a host-mapped int64 array per communicator; host engine: Python exceptions with the same
fields): ``STATUS_*`` words; ``STATUS_FLAG`` is set last with a system-scope release.
"""
from __future__ import annotations

import struct as _struct
import zlib

__all__ = ["cuda_header", "op_code", "op_name", "signature", "float32", "small_flag", "small_epoch",
           "small_zero_next", "form_word", "form_text"]

#: Bytes per metadata line: every counter alone on a 128-byte line (two GPU L2 sectors; no false sharing).
LINE_BYTES = 128
#: (channel, peer) region: four counter lines, then the ring.
TAIL_OFFSET = 0 * LINE_BYTES        # recv side: chunks the peer published into our ring; written by the peer
HEAD_OFFSET = 1 * LINE_BYTES        # send side: chunks of ours the peer consumed; written by the peer
SEND_STATE_OFFSET = 2 * LINE_BYTES  # our sender's state towards the peer (local)
RECV_STATE_OFFSET = 3 * LINE_BYTES  # our receiver's state from the peer (local)
RING_OFFSET = 4 * LINE_BYTES
#: Words of a state line.
STATE_COUNTER = 0
STATE_SEQ = 1
#: GPU direct mode, the receiver's state line (RECV_STATE_OFFSET) of (channel, peer) when this rank's own sendbuf
#: also goes direct (its sender group then has no payload to copy and helps receive): the receiver's leader
#: stores STATE_HELP_SRC = where the peer's run lies (0: not direct, nothing to help with), then releases
#: STATE_HELP_SEQ = the call's sequence number; up to MAX_HELPERS copy warps of the sender group copy the last
#: slices of the share and each releases STATE_HELP_DONE + k = the sequence number; the receiver hands the header
#: slot back (head) only after all of them.
STATE_HELP_SRC, STATE_HELP_SEQ, STATE_HELP_DONE = 2, 3, 4
MAX_HELPERS = 12

#: Call header words (int64) at the start of the header slot.
HDR_MAGIC, HDR_SEQ, HDR_OP, HDR_SIG, HDR_UNITS, HDR_NCHUNKS, HDR_STATUS, HDR_RANK, HDR_CHANNEL = range(9)
#: Direct modes: HDR_MODE says how the rows travel. MODE_RING: payload chunks follow in the ring.
#: MODE_DIRECT: none follow; the receiver copies the run straight out of the sender's symmetric array, then
#: releases ``head`` past the header; the sender returns once every peer did. HDR_DIRECT_ALLOC / HDR_DIRECT_OFFSET:
#: which symmetric segment (the heap ``Communicator.empty`` sub-allocates from; ids agreed, allocation is
#: collective) and the byte offset in it where the run to this receiver starts. MODE_CMA: the same with a plain array, read by cross-memory
#: attach (``process_vm_readv``): HDR_DIRECT_ALLOC is the sender's pid, HDR_DIRECT_OFFSET the run's address
#: there (host engine only). The GPU kernels send MODE_RING or MODE_DIRECT (a byte run out of a symmetric array:
#: the receiver's kernel finds the sender's block of segment HDR_DIRECT_ALLOC in its symmetric table,
#: ``DESC_SYM_TABLE``) and receive both.
HDR_MODE, HDR_DIRECT_ALLOC, HDR_DIRECT_OFFSET = 9, 10, 11
MODE_RING, MODE_DIRECT, MODE_CMA = 0, 1, 2
#: MODE_PUSH (GPU, MoE dispatch into symmetric outputs, ``dispatch(out=...)``): the receive parts named by
#: DESC_PUSH_ALLOC lie in symmetric segments, at the same offsets on every rank (the row signature says where,
#: so a difference is a signature mismatch). The sender releases its header at once and waits for the receiver's
#: ``head = first + 1``, before which the receiver stores, in the sender's head line, word HEAD_PUSH_ROW = the row
#: of its outputs where this sender's run starts (-1: it rejects the call; push nothing). The sender's copy
#: warps then write those parts of every row straight into the receiver's outputs (one copy) and the other parts
#: into the ring as usual; the chunks' tails announce both. The receiver copies only the ring parts. The wait for
#: head also orders the pushes after the receiver's previous use of its outputs (its kernel runs in stream order).
MODE_PUSH = 3
HEAD_PUSH_ROW = 1
#: MODE_SMALL (GPU ``alltoall`` of at most ``ChannelLayout.small_peer_bytes`` per peer, ``Config.small_bytes``): no
#: ring at all; the words travel in the small region (below). Never in a call header: the mode a receiver names
#: in a FIELD_MODE mismatch when it expected small words and found a ring header of the same call.
MODE_SMALL = 4
#: A plain sendbuf goes MODE_CMA from this many bytes per peer (on average) up: below it the rings measured as fast
#: or faster on the 2-core machine (64 KiB: 26 vs 31 us; 256 KiB - 1 MiB equal; 4 MiB: 414 vs 288 us; 16 MiB:
#: 2889 vs 2157 us; docs/perf-notes.md v10).
CMA_MIN_BYTES = 256 * 1024
#: The channels that carry this (sender, receiver) run in this call (host engine; ``host_run_channels``): each of
#: channels ``[0, HDR_NCHANNELS)`` carries a call header for it, the others nothing (their counters and sequence
#: numbers do not move). The receiver learns it from channel 0's header before it looks at another channel.
HDR_NCHANNELS = 12
HDR_WORDS = 16                      # 128 bytes: one line, so chunk_bytes >= 128 always holds it
#: 'SYMB' and the protocol version: a header from an older layout or garbage never matches.
PROTOCOL_VERSION = 13
HDR_MAGIC_VALUE = (0x53594D42 << 32) | PROTOCOL_VERSION
HDR_OK = 0
HDR_REJECTED = 1

#: Operation codes carried by call headers and notify slots.
OPS = {"alltoall": 1, "alltoallv": 2, "dispatch": 3, "combine": 4, "notify": 5}
_OP_NAMES = {v: k for k, v in OPS.items()}

#: Notify (count exchange) slot: these header words, then the values.
NOTIFY_EPOCH, NOTIFY_OP, NOTIFY_STATUS, NOTIFY_SIG = range(4)
NOTIFY_HDR_WORDS = 4

#: Abort line words.
ABORT_FLAG, ABORT_RANK, ABORT_REASON, ABORT_PEER, ABORT_CHANNEL, ABORT_DETAIL = range(6)
#: Why a rank aborted (ABORT_REASON; also the error kinds of the record).
ERR_NONE, ERR_TIMEOUT, ERR_MISMATCH, ERR_ABORTED, ERR_INVARIANT, ERR_USER, ERR_LOCAL, ERR_UNCAUGHT, \
    ERR_LEFT_WITH, ERR_EXITED = range(10)
ERR_NAMES = {ERR_TIMEOUT: "timeout", ERR_MISMATCH: "call header mismatch", ERR_ABORTED: "abort",
             ERR_INVARIANT: "ring invariant violated", ERR_USER: "Communicator.abort()",
             ERR_LOCAL: "an exception on that rank inside a collective",
             ERR_UNCAUGHT: "an uncaught exception on that rank (its program is ending)",
             ERR_LEFT_WITH: "an exception left its 'with Communicator' block on that rank",
             ERR_EXITED: "its program ended (sys.exit or the end of its script) with the communicator open, and "
                         "this rank had not closed it"}

#: Roles of a wait.
ROLE_SEND, ROLE_RECV, ROLE_NOTIFY = range(3)
ROLE_NAMES = {ROLE_SEND: "send", ROLE_RECV: "recv", ROLE_NOTIFY: "notify"}

#: Header fields a mismatch names (the error record's STATUS_FIELD).
FIELD_MAGIC, FIELD_SEQ, FIELD_OP, FIELD_SIG, FIELD_UNITS, FIELD_OFFSET, FIELD_RING, FIELD_CAPACITY, \
    FIELD_MODE, FIELD_FORM = range(1, 11)
FIELD_NAMES = {FIELD_MAGIC: "magic (not a call header: rings out of step)", FIELD_SEQ: "call sequence number",
               FIELD_OP: "operation", FIELD_SIG: "row signature (dtype / row shape / parts / handle)",
               FIELD_UNITS: "row count sent to this rank", FIELD_OFFSET: "offset outside its region",
               FIELD_RING: "ring counters (head <= tail <= head + capacity)",
               FIELD_CAPACITY: "rows received exceed the output capacity (num_worst_tokens / recv_capacity)",
               FIELD_MODE: "transfer mode (through the rings, from a symmetric array, by cross-memory attach, or "
                           "pushed into symmetric outputs, or by the small-message protocol)",
               FIELD_FORM: "call form (a count exchange first, or call headers at once: alltoallv without or "
                           "with recv_counts)"}
#: FIELD_FORM: the two ranks' calls start differently. One waits in the count exchange (notify slots), the other on
#: the rings (call headers), so neither would ever see the message it waits for. Each wait also watches for the
#: other form's first message of the same call: the count-exchange wait for a ring header of a new call (the
#: peer's channel-0 ring ``tail`` past this rank's receiver state, its notify slot still behind), the ring wait
#: for the peer's notify slot of the next epoch (its channel-0 call header still absent). The values a FIELD_FORM
#: error carries (expected: this rank's, got: the peer's) are :func:`form_word` s: the op code, plus FORM_COUNTS
#: when that call starts with a count exchange.
FORM_COUNTS = 256

#: GPU error record (int64 words, host-mapped).
STATUS_FLAG, STATUS_ROLE, STATUS_RANK, STATUS_PEER, STATUS_CHANNEL, STATUS_HEAD, STATUS_TAIL, STATUS_SEQ, \
    STATUS_KIND, STATUS_FIELD, STATUS_ABORT_RANK, STATUS_REJECTED_BY, STATUS_REJECTED_SEQ, \
    STATUS_REJECTED_WHY, STATUS_REJECTED_OWN, STATUS_REJECTED_PEER = range(16)
STATUS_WORDS = 16
#: STATUS_REJECTED_WHY: a rank rejected its arguments (its own checks, e.g. topk_idx out of range on the device),
#: or (device-count calls) the ranks' row signatures differ; either way nothing moved and the rings are in step.
#: Low-latency mode: REJECT_HANDLE, the ranks' combine handles come from different dispatches (STATUS_REJECTED_OWN /
#: STATUS_REJECTED_PEER: this rank's and the named rank's dispatch ids); REJECT_TOPK, the named rank's combine
#: topk_idx differs from the one its dispatch sent; REJECT_SWITCH, the named rank did not dispatch but announced a
#: switch to another LowLatencyBuffer (``LowLatencyBuffer.announce``; OWN / PEER: the tokens).
REJECT_ARGS, REJECT_SIG, REJECT_HANDLE, REJECT_TOPK, REJECT_SWITCH = range(5)
#: Low-latency mode (``moe/low_latency.py``, ``cuda_src/low_latency.cu``): the token count ``n`` of a call its rank
#: rejected, in that rank's kernel arguments and in the flag lines it publishes (no payload follows; the peers
#: consume nothing of the call and record the rejection).
LL_REJECTED = -1

#: Launch descriptor of the ring kernel (int64 words, passed by value as its one parameter: ``wire/kernel_args.py``
#: ``RingArgs``).
MAX_PARTS = 4
MAX_PEERS = 32
DESC_RANK, DESC_WORLD_SIZE, DESC_NUM_CHANNELS, DESC_REGION_BYTES, DESC_CHANNEL_BYTES, DESC_NUM_SLOTS, \
    DESC_CHUNK_BYTES, DESC_TIMEOUT_NS, DESC_ROW_BYTES, DESC_ROW_ALIGN, DESC_SEND_INDEX, DESC_RECV_INDEX, \
    DESC_NUM_SEND_PARTS, DESC_NUM_RECV_PARTS, DESC_RING_WARPS, DESC_SELF_WARPS, DESC_OP, DESC_SIG, DESC_FLAGS, \
    DESC_ABORT_OFFSET, DESC_COUNTS, DESC_DIRECT_ALLOC, DESC_DIRECT_OFFSET, DESC_SYM_TABLE = range(24)
DESC_SEND_PARTS = 24                       # MAX_PARTS x {base, stride, width, offset in row}
DESC_RECV_PARTS = DESC_SEND_PARTS + 4 * MAX_PARTS
DESC_PEERS = DESC_RECV_PARTS + 4 * MAX_PARTS   # [4][world_size]: send offset, send units, recv offset, recv units
DESC_SEQ = DESC_PEERS + 4 * MAX_PEERS      # launch number, written into the error record
#: MODE_PUSH: per receive part, the id of the symmetric segment it lies in (-1: through the ring), and the rows
#: the receive parts hold (a sender's run past them is a fatal FIELD_CAPACITY error, checked by the receiver).
DESC_PUSH_ALLOC = DESC_SEQ + 1
DESC_PUSH_ROWS = DESC_PUSH_ALLOC + MAX_PARTS
#: Channel telemetry on the GPU (``Config(trace=True)``; kernels built with SYMBUF_TRACE=1): DESC_TRACE = device
#: address of the trace buffer (0: none), DESC_TRACE_CAP = its capacity in records. Buffer: word 0 = events so far
#: (an atomic counter; records past the capacity are counted, not kept), then from word TRACE_HDR_WORDS on
#: TRACE_WORDS int64 words per record: t0 and t1 (%globaltimer ns: before the event's wait, after its copy), launch
#: number (DESC_SEQ), op | kind << 8 | channel << 16 | (peer + 1) << 32, bytes, head, tail.
DESC_TRACE = DESC_PUSH_ROWS + 1
DESC_TRACE_CAP = DESC_TRACE + 1
#: Adaptive channels (``Config(adaptive=True)``; kernels built with SYMBUF_ADAPTIVE=1): DESC_HOME = the home map,
#: HOME_WORDS int64 words holding one byte per warp of a block, sender block first (warps 0..31: bytes of words
#: DESC_HOME .. +3), then the receiver block's: the peer whose ring run that warp takes chunks of first (0xFF:
#: its own group's, or for the self group's warp i the (i % (world_size - 1))-th peer after this rank);
#: ``adaptive.home_map`` computes it.
#: DESC_LOAD = device address of the load counters (0: none): int64 [2 (send, recv)][num_channels][world_size]
#: [LOAD_WORDS]: bytes of the run's channel share, ring chunks, chunks copied by a warp of another group
#: (work sharing), accumulated by each ring group's leader at the end of every call.
DESC_HOME = DESC_TRACE_CAP + 1
HOME_WORDS = 8
DESC_LOAD = DESC_HOME + HOME_WORDS
LOAD_WORDS = 3
LOAD_BYTES, LOAD_CHUNKS, LOAD_STOLEN = range(3)
#: Work sharing's done marks: one per ring counter modulo this window, per peer of a block. A chunk is copied only
#: once the ring has room for it (sender) or holds it (receiver), at most ``num_slots`` counters past the first
#: one not yet published, so the window must hold ``num_slots`` (``Config(adaptive=True)`` needs ``num_slots <=
#: ADAPT_WINDOW``).
ADAPT_WINDOW = 32
HOME_OWN = 0xFF
#: DESC_PEER_BASES = device address of every rank's buffer base (u64 [world_size]); DESC_STATUS = the host-mapped
#: error record (``STATUS_*``): the descriptor is the kernel's one argument (``wire/kernel_args.py`` ``RingArgs``).
DESC_PEER_BASES = DESC_LOAD + 1
DESC_STATUS = DESC_PEER_BASES + 1
#: The small region (``ChannelLayout.small_offset``, 0: none) and its slot bytes: a rank rejecting an ``alltoall``
#: (FLAG_REJECT) also watches each peer's small header of the call, since a peer whose call would go by the small
#: protocol sends that instead of ring headers (``call_header_step``).
DESC_SMALL_OFFSET = DESC_STATUS + 1
DESC_SMALL_SLOT_BYTES = DESC_SMALL_OFFSET + 1
DESC_WORDS = DESC_SMALL_SLOT_BYTES + 1
TRACE_HDR_WORDS = 16
TRACE_WORDS = 8
#: Trace event kinds (``transport/trace.py``): a chunk written into a peer's ring (or pushed into its outputs), a
#: chunk copied out of our ring, a direct-mode copy out of a peer's memory, a rank's own rows, a spell with nothing to move (host).
TRACE_SEND, TRACE_RECV, TRACE_PULL, TRACE_SELF, TRACE_IDLE = range(5)
#: Device counts table (int64 words; DESC_COUNTS holds its device address, 0 = the units are DESC_PEERS's): written
#: by ``symbuf_notify`` in device-count mode, read by the ring kernel at launch, so a call whose counts never reach
#: the host (worst-case mode, CUDA graphs) still moves exactly the agreed rows. CT_SKIP != 0: the call moves
#: nothing on this rank (a rank rejected it, the signatures differ, or its output capacity is exceeded).
#: CT_RECV_TOTAL: rows received. CT_PEERS: [4][world_size] as DESC_PEERS.
CT_SKIP, CT_RECV_TOTAL = 0, 1
CT_PEERS = 8
CT_WORDS = CT_PEERS + 4 * MAX_PEERS
#: Direct mode on the GPU: DESC_DIRECT_ALLOC = the id of the symmetric segment this rank's sendbuf lies in (-1:
#: ring mode), DESC_DIRECT_OFFSET = the sendbuf's byte offset in it (per call). DESC_SYM_TABLE = device address of
#: this rank's symmetric table: SYM_TABLE_ROWS rows of SYM_TABLE_STRIDE int64 words, one per live segment of the
#: symmetric heap (each holds many symmetric arrays), [id + 1 (0: free row), bytes of the segment per rank,
#: address of rank r's block of it in this process, r = 0 .. world_size - 1]; written by the host when a segment
#: is made or unmapped (no kernel is queued then that reads the row). A receiver takes a header's run only when
#: it lies inside the block (else a fatal FIELD_MODE mismatch).
SYM_TABLE_ROWS = 64
SYM_TABLE_STRIDE = 2 + MAX_PEERS
#: DESC_FLAGS bits.
FLAG_REJECT = 1                            # this rank rejected the call: headers only, drain what peers send
#: Copy-engine alltoall (``Config.mode="copy_engine"``): every rank's sendbuf is the same symmetric segment at
#: the same offset. The ring kernel exchanges and checks the MODE_DIRECT headers only (a receiver expects the peer's
#: run at DESC_DIRECT_ALLOC / DESC_DIRECT_OFFSET + its own rows' offset; anything else is a fatal FIELD_MODE
#: mismatch) and copies nothing off-rank; the host then queues one cudaMemcpyAsync per peer (the copy engines pull
#: the rows), and ``symbuf_ce_finish`` hands every header slot back (head) and waits for the peers' heads, so no
#: run reuses a sendbuf a peer's copy engine still reads.
FLAG_CE = 2
#: MODE_PUSH (above): some receive parts of this dispatch are symmetric; peers push them, this rank pushes to peers.
FLAG_PUSH = 4
#: A copy-engine alltoall moves at least this many bytes per peer; smaller ones run the direct kernel copy.
#: Measured on one H200 under MPS (docs/perf-notes.md v11, ``bench --mode copy_engine`` beside ``--mode auto``):
#: 8 MiB per peer loses (2 ranks x 16 MiB: 62 us against the kernel's 38; 4 ranks x 16 MiB, 4 MiB per peer: 82
#: against 66), 16 MiB per peer and more win (8 ranks x 128 MiB: 582 against 608 us; 4 ranks: 292 against 327;
#: 2 ranks: 149 against 159): the kernel boundaries and the two cross-rank hand-offs cost ~40 us a call.
CE_MIN_BYTES = 16 << 20

#: The small-message protocol (flag in data, NCCL's LL idea; ``cuda_src/small_exchange.cu``,
#: ``symbuf_small_alltoall``). A GPU ``alltoall`` of at most ``ChannelLayout.small_peer_bytes`` per peer (decided
#: from the call's size, which is part of the agreed call, so alike on every rank) moves through the small region of
#: the RECEIVER's buffer (``ChannelLayout.small_offset``): SMALL_CTRL_BYTES of control words (int32 per peer: the
#: work items of the current launch that finished with that peer, local), then two halves (h = call sequence number
#: & 1), each with one slot of ``small_slot_bytes`` per source rank. A slot: a header line of SMALL_HDR_WORDS words,
#: then one word per 4 bytes of payload from word SMALL_DATA_WORD on. Every word is 8 bytes stored at once (a
#: relaxed system-scope st.volatile, naturally aligned, so single-copy atomic): low 32 bits the datum, high 32 bits
#: the flag of the call, ``small_flag(seq)``, never 0 (so a zeroed word never matches) and different for seq and
#: seq - 2 (the previous user of the half).
#: Header words: SMALL_H_OP = op | status << 8, SMALL_H_SIG = the call's row signature, SMALL_H_BYTES = bytes per
#: peer. The call's sequence number is the ring's: a small call advances STATE_SEQ of every (channel, peer) state
#: line on both sides and leaves STATE_COUNTER alone, so ring calls before and after it carry the same numbers as
#: their peers expect.
SMALL_CTRL_BYTES = 2 * LINE_BYTES
SMALL_H_OP, SMALL_H_SIG, SMALL_H_BYTES = range(3)
SMALL_HDR_WORDS = 16
SMALL_DATA_WORD = SMALL_HDR_WORDS
SMALL_FLAG_MOD = 0xFFFFFFFF
#: Threads per block of the small kernel, and payload words per work item (a (peer, share) pair; a thread stores and
#: polls this / SMALL_THREADS words of it): a run of w words is cut into ceil(w / SMALL_WORDS_PER_ITEM) items, at most
#: as many as the rank's blocks (``Config.num_sms``) allow per peer.
SMALL_THREADS = 512
SMALL_WORDS_PER_ITEM = 4096
#: Phase stamps of the small kernel, a build option for profiling (``-DSYMBUF_SMALL_PROFILE=1`` in
#: ``CUPY_SYMBUF_NVRTC_DEFINES``; no code without it; ``tests/device/small_profile.py`` reads them). Thread 0 of each
#: of the first SMALL_PROF_BLOCKS blocks stamps its phases (``%globaltimer`` ns in words SMALL_PROF_START ..
#: SMALL_PROF_END of a record, ``clock64`` cycles in the same words + SMALL_PROF_PHASES; 0: the block had no such
#: phase) and at its end writes the record into the module's array ``symbuf_small_prof`` (u64): SMALL_PROF_BLOCKS
#: launch counters (one per block), then SMALL_PROF_CALLS x SMALL_PROF_BLOCKS records of SMALL_PROF_RECORD words
#: ([call % SMALL_PROF_CALLS][block]). Phases: the block's first instruction; its send item's state line read (after
#: the block barrier); its self rows copied; every send of the block issued; the receive item's state lines read;
#: the peer's header checked (thread 0); thread 0's first words in; every word of the item in (block barrier); the
#: item's bookkeeping done (the block's end). SMALL_PROF_INFO: items | peer items << 8 | (last peer + 1) << 16 |
#: header verdict << 32; SMALL_PROF_SEQ_NO: the receive sequence number of the block's last peer item (the same call
#: on every rank). A block with several items keeps the stamps of its last one.
SMALL_PROF_START, SMALL_PROF_SEQ, SMALL_PROF_COPY, SMALL_PROF_SENT, SMALL_PROF_RSEQ, SMALL_PROF_HEADER, \
    SMALL_PROF_FIRST, SMALL_PROF_RECEIVED, SMALL_PROF_END = range(9)
SMALL_PROF_PHASES = 9
SMALL_PROF_INFO = 2 * SMALL_PROF_PHASES
SMALL_PROF_SEQ_NO = SMALL_PROF_INFO + 1
SMALL_PROF_RECORD = SMALL_PROF_INFO + 2
SMALL_PROF_CALLS = 64
SMALL_PROF_BLOCKS = 64

#: Ring chunk rule (``layout.chunk_rows``): a chunk is a multiple of this many bytes of units (one vector pass of
#: a warp; keeps byte runs 16-byte aligned) and at least CHUNK_LEAST_BYTES (one unrolled warp pass).
CHUNK_GRAIN_BYTES = 512
CHUNK_LEAST_BYTES = 4096
#: The host engine's smallest chunk: below this a chunk's fixed cost (a Python step, a fence, a tail store) outweighs
#: what pipelining smaller pieces gains (measured on the 2-core CI machine, docs/perf-notes.md v10).
HOST_CHUNK_LEAST_BYTES = 32768
#: Byte runs are cut between channels on this alignment (bytes).
BYTE_RUN_ALIGN = 16


def host_run_channels(run_bytes: int, single: bool, num_channels: int, chunk_bytes: int) -> int:
    """Channels the host engine spreads one (sender, receiver) run over in a call: 1 (channel 0, one call header)
    when ``single`` (the run goes direct or by cross-memory attach: the receiver copies it whole at the first
    header; or the sender rejected the call: no payload) or the run's bytes fit one ring slot (``chunk_bytes``),
    else ``num_channels``. The host engine drives every channel from one loop on one core, so a second channel
    adds a header round trip and no copying in parallel (measured: one channel as fast or faster at every size on
    the 2-core machine, docs/perf-notes.md "Host rows, third pass"). Sender and receiver compute it from the
    run's agreed bytes; a direct or rejected run they learn from channel 0's header (``HDR_NCHANNELS``)."""
    if single or run_bytes <= chunk_bytes:
        return 1
    return num_channels


def host_run_inline(run_bytes: int, chunk_bytes: int) -> bool:
    """Whether the host engine carries a ring run of ``run_bytes`` (on channel 0 alone) in its call header's slot,
    right after the header words (``HDR_WORDS``), instead of in payload chunks after it: a run of at most
    ``HOST_CHUNK_LEAST_BYTES`` (one chunk anyway, so no pipelining is lost) that fits the slot. The header then
    says 0 chunks; the sender fills the slot and publishes it with one ``tail`` store, the receiver checks the
    header and copies the payload out in the same step. Sender and receiver compute it from the run's agreed
    bytes (a receiver whose call the peer's header contradicts raises before it reads a byte)."""
    return 0 < run_bytes <= HOST_CHUNK_LEAST_BYTES and run_bytes + 8 * HDR_WORDS <= chunk_bytes

#: The fp8 (e4m3) block quantiser of the wire (``collectives/quant.py`` and ``cuda_src/quant.cuh``, bit for bit):
#: one float32 scale per QUANT_BLOCK consecutive elements of a row (DeepEP's 1x128 blocks; MoE ``x_fp8`` scales and
#: ``wire_dtype="fp8"`` rows alike), scale = max(amax, QUANT_AMAX_FLOOR) / QUANT_FP8_MAX (float32; the largest
#: finite e4m3 value).
QUANT_BLOCK = 128
QUANT_FP8_MAX = 448.0
QUANT_AMAX_FLOOR = 1e-4

#: Low-latency mode's symmetric buffer (``moe/low_latency.py`` describes it; ``cuda_src/low_latency.cu``). Each
#: kind's ctrl line (u64 words, local only): word LL_CTRL_EXIT counts the kernel blocks that left, over all launches
#: (a launch's sequence number is that count / grid + 1). Flag lines (dispatch, weights, partials): word LL_LINE_SEQ
#: = blocks done (dispatch, partials) or the sequence number (weights), LL_LINE_N = the source's token count,
#: LL_LINE_SIG = the call's row signature, LL_LINE_TAG = the weights line's dispatch id (the sequence number of the
#: dispatch whose handle the combine uses; every rank compares every rank's), or in a line whose n is LL_REJECTED the
#: announced token (``LowLatencyBuffer.announce``; 0 otherwise), LL_LINE_WHY = in a line whose n is LL_REJECTED the
#: reason (``REJECT_ARGS``, ``REJECT_TOPK``, ``REJECT_SWITCH``).
LL_CTRL_EXIT = 2
LL_LINE_SEQ, LL_LINE_N, LL_LINE_SIG, LL_LINE_TAG, LL_LINE_WHY = range(5)
#: Element types of ``x`` (the kernels' ``kind`` argument).
LL_KIND_BF16, LL_KIND_F16, LL_KIND_F32 = range(3)
#: Elements of x per work item of a warp (8 fp8 blocks).
LL_SEG_ELEMS = 1024
#: ``bench_low_latency(profile=True)``: %globaltimer stamps per kernel block (u64 [grid][LL_PROF_STAMPS]).
LL_PROF_STAMPS = 8
#: The kernels' ``phase`` argument (bits): a launch with LL_PHASE_SEND stores this rank's payload and publishes the
#: flag lines that announce it; with LL_PHASE_RECV it waits for every source's lines and unpacks. A call launches
#: LL_PHASE_BOTH once, or (with a receive hook) LL_PHASE_SEND, then LL_PHASE_RECV from the hook.
LL_PHASE_SEND, LL_PHASE_RECV = 1, 2
LL_PHASE_BOTH = LL_PHASE_SEND | LL_PHASE_RECV


def op_code(op: str) -> int:
    """Code of operation ``op`` (``OPS``); ``ValueError`` for an unknown name."""
    try:
        return OPS[op]
    except KeyError:
        raise ValueError(f"unknown operation {op!r}; known: {sorted(OPS)}") from None


def op_name(code: int) -> str:
    return _OP_NAMES.get(int(code), f"op#{int(code)}")


def signature(*fields) -> int:
    """A 31-bit signature of what both ends of a run must agree on (wire format, row bytes, parts, dtype,
    row shape): CRC-32 of their text, so it is the same on every rank and every run."""
    return zlib.crc32("|".join(str(f) for f in fields).encode()) & 0x7FFFFFFF


#: Odd, so ``tag * _TAG_MIX`` modulo 2**31 is a bijection: distinct tags below 2**31 never fold alike.
_TAG_MIX = 0x5BD1E995
_TAG_UNMIX = pow(_TAG_MIX, -1, 1 << 31)


def call_signature(sig: int, tag: int) -> int:
    """The signature one call's headers carry: the plan's ``sig`` with the call's ``tag`` folded in (the id of the
    dispatch whose handle a combine or cached dispatch uses, the same on every rank; 0: nothing, ``sig`` itself).
    Calls of one plan with different tags never carry the same signature (for tags below 2**31)."""
    return sig ^ ((tag * _TAG_MIX) & 0x7FFFFFFF) if tag else sig


def call_tag(sig: int, call_sig: int) -> int:
    """The tag :func:`call_signature` folded into ``sig`` to give ``call_sig`` (modulo 2**31); meaningful only when
    ``call_sig`` was made from this very ``sig`` (a peer with other rows gives an arbitrary number)."""
    return (((sig ^ call_sig) & 0x7FFFFFFF) * _TAG_UNMIX) & 0x7FFFFFFF


def form_word(op_code: int, counts: bool) -> int:
    """What a FIELD_FORM error says about one rank's call: ``op_code`` (``OPS``), plus ``FORM_COUNTS`` when the call
    starts with a count exchange (``counts``)."""
    return int(op_code) | (FORM_COUNTS if counts else 0)


def form_text(word: int) -> str:
    """A :func:`form_word` in the caller's terms, e.g. ``"alltoallv without recv_counts (a count exchange
    first)"``."""
    op, counts = op_name(word & (FORM_COUNTS - 1)), bool(word & FORM_COUNTS)
    if op == "alltoallv":
        return ("alltoallv without recv_counts (or with recv_capacity: a count exchange first)" if counts else
                "alltoallv with recv_counts (no count exchange: call headers at once)")
    if op == "dispatch":
        return ("dispatch (eager: a count exchange first)" if counts else
                "dispatch with a handle (cached: no count exchange)")
    return f"{op} ({'a count exchange first' if counts else 'no count exchange: call headers at once'})"


def small_flag(seq: int, mod: int = SMALL_FLAG_MOD) -> int:
    """The flag of call ``seq`` (>= 1) in every word of the small protocol: ``seq % mod + 1``, never 0 and never the
    flag of ``seq - 2`` (the same in ``cuda_src/protocol.cuh``). ``mod``: ``SMALL_FLAG_MOD``, or the odd modulus
    (>= 3) a build's ``-DSYMBUF_SMALL_FLAG_MOD`` test hook sets (``transport.kernels.small_flag_mod``)."""
    return seq % mod + 1


def small_epoch(seq: int, mod: int = SMALL_FLAG_MOD) -> int:
    """The flag epoch of call ``seq``: ``seq // (2 * mod)`` (0 for ``seq < 1``, the calls before the first). Within
    one epoch no two calls of one half (``seq & 1``) have the same flag (``mod`` is odd)."""
    return max(seq, 0) // (2 * mod)


def small_zero_next(seq: int, mod: int = SMALL_FLAG_MOD) -> bool:
    """Whether the kernel of call ``seq`` (small or ring) zeroes, before it sends, the slots of its own small region
    that the peers write for call ``seq + 1``: when call ``seq + 1`` or call ``seq - 1`` is the first call of its
    half in a new epoch (``cuda_src/protocol.cuh``, "The flag's wrap"; the same function there)."""
    return small_epoch(seq + 1, mod) != small_epoch(seq - 1, mod) or \
        small_epoch(seq - 1, mod) != small_epoch(seq - 3, mod)


def _constants() -> list:
    """``(name, value)`` of every public upper-case int or float constant above, in order."""
    g = globals()
    return [(n, g[n]) for n in g if n.isupper() and not n.startswith("_") and type(g[n]) in (int, float)]


def float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (round to nearest even), as a Python float (exact)."""
    return _struct.unpack("<f", _struct.pack("<f", value))[0]


def cuda_header() -> str:
    """C++ text defining every constant above for the kernels (``constexpr``; floats as float32), plus the op
    codes as ``OP_<NAME>``. ``transport/kernels.py`` prepends it to each source; kernels include no hand copy."""
    lines = ["// Generated from cupy_symbuf/wire/protocol.py at NVRTC time: do not edit; change the Python.",
             "#ifndef SYMBUF_PROTOCOL_GENERATED", "#define SYMBUF_PROTOCOL_GENERATED"]
    for name, value in _constants():
        if isinstance(value, float):  # float32, as an exact hexadecimal literal (no second rounding)
            lines.append(f"constexpr float {name} = {float32(value).hex()}f;  // {value!r}")
            continue
        ctype = "unsigned long long" if value >= 2 ** 31 else "int"
        suffix = "ull" if ctype != "int" else ""
        lines.append(f"constexpr {ctype} {name} = {value}{suffix};")
    for name, value in OPS.items():
        lines.append(f"constexpr int OP_{name.upper()} = {value};")
    lines.append("#endif")
    return "\n".join(lines) + "\n"
