"""``Communicator``: all-to-all collectives over the channel ring buffers of one :class:`SymBuffer`."""
from __future__ import annotations

from typing import Optional

import numpy as np
from mpi4py import MPI

from . import _compat
from . import moe as _moe
from ._engine import row_signature
from ._validate import as_array, check_counts
from .config import Config
from .errors import SymBufferClosedError, SymBufferError
from .layout import ChannelLayout
from .symbuffer import SymBuffer, _gpu_identity, resolve_backend

__all__ = ["Communicator"]


class Communicator:
    """All-to-all collectives (``alltoall``, ``alltoallv``, MoE ``dispatch``/``combine``) over a SymBuffer.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        Ranks of one node. Construction is collective over ``comm``; so is every method.
    config : Config, optional
        Transport tuning; unset fields (``num_sms``, ``chunk_bytes``) get per-backend defaults (``self.config``
        holds the resolved values).
    backend : {"auto", "cuda", "host"}
        ``"cuda"``: CuPy arrays and GPU kernels on the current CuPy device and stream. ``"host"``: NumPy arrays over
        an MPI shared-memory window. ``"auto"``: cuda when CuPy imports and a GPU is visible.

    Attributes
    ----------
    rank, world_size, backend, config, layout (:class:`~cupy_symbuf.layout.ChannelLayout`), buffer (SymBuffer),
    xp (``numpy`` or ``cupy``).

    Notes
    -----
    Every call checks its arguments on the calling rank before any communication; a rejected call raises
    ``ValueError``/``TypeError`` naming the operation and argument and leaves the communicator usable (all ranks
    must then skip that call alike). A :class:`~cupy_symbuf.SymBufferTimeoutError` instead leaves the ring counters
    inconsistent, and the communicator refuses further calls.

    On the GPU path a collective is queued on the current CuPy stream and returns without waiting for it (like
    NCCL; ``Config.blocking=True`` waits): read the result in stream order, and call :meth:`synchronize` (or any
    later collective) to have a recorded timeout raised. Collectives of one communicator run in call order even
    when issued on different streams (a call on a new stream waits for the previous call's stream). Inputs must
    stay alive, unmodified, until stream order reaches the collective (as with NCCL; with PyTorch tensors from
    another stream, ``tensor.record_stream``).
    """

    def __init__(self, comm: MPI.Comm, config: Optional[Config] = None, *, backend: str = "auto"):
        if config is None:
            config = Config()
        if not isinstance(config, Config):
            raise TypeError(f"Communicator: config must be a cupy_symbuf.Config, got {type(config).__name__}")
        backend = resolve_backend(backend)
        ranks_per_gpu, sm_count = 1, 132
        if backend == "cuda":
            cp = _compat.cupy
            ident = _gpu_identity(cp.cuda.Device().id)
            ids = comm.allgather(ident["uuid"] + "/" + ident["pci_bus_id"])
            ranks_per_gpu = ids.count(ids[comm.Get_rank()])
            sm_count = ident["sm_count"] or sm_count
        self.config = config.resolved(backend, ranks_per_gpu=ranks_per_gpu, gpu_sm_count=sm_count,
                                      world_size=comm.Get_size())
        self.world_size = comm.Get_size()
        self.layout = ChannelLayout.from_config(self.config, self.world_size)
        self.buffer = SymBuffer(comm, self.layout.total_bytes, backend=backend)
        self.rank = self.buffer.rank
        self.backend = self.buffer.backend
        self.xp = _compat.array_module(self.backend)
        self._epoch = 0
        self._ones = np.ones(self.world_size, dtype=np.int64)  # alltoall's counts (read only)
        self._ones.flags.writeable = False
        if self.backend == "cuda":
            from ._cuda import CudaTransport
            self._transport = CudaTransport(self.buffer, self.layout, self.config.timeout_s)
            self._transport.blocking = self.config.blocking
        else:
            from ._host import HostTransport
            self._transport = HostTransport(self.buffer, self.layout, self.config.timeout_s)
        self._broken: Optional[str] = None
        self._closed = False

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the symmetric buffer (collective; idempotent).

        Waits for all work queued on the device first (``cudaDeviceSynchronize``, every stream); raises the
        :class:`~cupy_symbuf.SymBufferTimeoutError` a queued collective recorded if no earlier call raised it (after
        freeing everything).
        """
        if self._closed:
            return
        self._closed = True
        err = None
        try:
            if self.backend == "cuda":
                err = self._transport.close()
        finally:
            self.buffer.close()  # collective: peers wait for it, whatever happened above
        if err is not None and not self._broken:
            raise err  # a queued collective timed out and nothing raised it yet (its results are not valid)

    def synchronize(self) -> None:
        """Wait for this rank's queued collectives (and the current CuPy stream) and raise a timeout they recorded.

        On the GPU path collectives return once queued (``Config.blocking=False``, the default); this is where
        their :class:`~cupy_symbuf.SymBufferTimeoutError` surfaces if no later call raised it first. The results
        of the collective that timed out and of every one queued after it are not valid. Local (no communication);
        a no-op on the host path, whose calls complete before returning.

        Raises
        ------
        SymBufferTimeoutError
            A queued kernel's wait expired (rank, peer, channel, head and tail named); the communicator is then
            unusable.
        """
        self._check_open()
        if self.backend == "cuda":
            self._run(self._transport.synchronize)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise SymBufferClosedError("Communicator is closed")
        if self._broken:
            raise SymBufferError(f"Communicator is unusable after an earlier failure: {self._broken}")

    def describe(self) -> str:
        """The buffer map (:meth:`ChannelLayout.describe`) and the resolved config."""
        return f"{self.layout.describe()}\n  backend={self.backend} config={self.config}"

    # ---- transport ------------------------------------------------------------------------------------------
    @property
    def _engine(self):
        """The internal interface of the collectives (:class:`cupy_symbuf._engine.Engine`), made on first use."""
        eng = self.__dict__.get("_engine_obj")
        if eng is None:
            from ._engine import Engine
            eng = Engine(self, self._transport, self.layout, self.config, rank=self.rank,
                         world_size=self.world_size, backend=self.backend)
            self.__dict__["_engine_obj"] = eng
        return eng

    def _run(self, fn, *args, **kwargs):
        return self._engine._run(fn, *args, **kwargs)

    # ---- collectives ----------------------------------------------------------------------------------------
    def alltoall(self, sendbuf):
        """All-to-all of equal blocks: ``recvbuf[j]`` is what rank ``j`` sent to this rank (``sendbuf[rank]`` there).

        Parameters
        ----------
        sendbuf : numpy.ndarray (host) or cupy.ndarray (cuda), shape ``[world_size, ...]``, any dtype
            ``sendbuf[j]`` goes to rank ``j``. Non-contiguous input is copied. On cuda the transfer runs on the
            current CuPy stream after the work already queued on it.

        Returns
        -------
        recvbuf : same array type, shape and dtype as ``sendbuf``.

        Every rank must pass the same dtype and shape: every receiver checks it in the call header of each peer
        before it takes a byte (a difference raises :class:`~cupy_symbuf.SymBufferMismatchError` on every rank
        involved and the communicator is unusable).

        Raises
        ------
        TypeError
            Wrong array type for the backend, or an array on another GPU.
        ValueError
            ``sendbuf.shape[0] != world_size``. The peers are told: they raise
            :class:`~cupy_symbuf.SymBufferRejectedError` (a ValueError), on the GPU path from this call with
            ``Config.blocking`` or else from :meth:`synchronize`; the communicator stays usable.
        SymBufferMismatchError
            A peer called another collective or passed another dtype / row shape.
        SymBufferTimeoutError, SymBufferAbortedError
            A peer did not take part within ``config.timeout_s``, or a rank aborted (on the GPU path raised by a
            later call or by :meth:`synchronize` unless ``Config.blocking``).
        """
        op = "alltoall"
        eng = self._engine
        with eng.call(op, notify=False):
            x = as_array(op, "sendbuf", sendbuf, self.backend)
            if x.shape[0] != self.world_size:
                raise ValueError(f"{op}: argument 'sendbuf' must have shape[0] == world_size ({self.world_size}), "
                                 f"got shape {tuple(x.shape)}")
            recv = self.xp.empty(x.shape, dtype=x.dtype)
            eng.exchange_rows(op, [x], None, self._ones, [recv], self._ones, row_signature(x))
        return recv

    def alltoallv(self, sendbuf, send_counts, *, recv_counts=None):
        """All-to-all of variable row counts.

        Parameters
        ----------
        sendbuf : numpy.ndarray (host) or cupy.ndarray (cuda), shape ``[num_rows, ...]``, any dtype
            Rows grouped by destination rank: the first ``send_counts[0]`` rows go to rank 0, and so on.
        send_counts : sequence of int, shape ``[world_size]``
            Rows for each destination; >= 0, summing to ``num_rows``.
        recv_counts : sequence of int, shape ``[world_size]``, optional
            Rows from each source, when the caller already knows them (a cached layout): skips the count exchange.
            Must equal what the peers send (checked in every peer's call header before any byte is taken), and
            ``recv_counts[rank] == send_counts[rank]``. Every rank must make the same choice (given or None).

        Returns
        -------
        recvbuf : same array type and dtype, shape ``[sum(recv_counts), ...]``, rows grouped by source rank.
        recv_counts : numpy.ndarray int64 ``[world_size]``.

        Notes
        -----
        Without ``recv_counts`` the counts are exchanged first through the symmetric buffer (the notify step);
        every rank takes part even when it sends or receives nothing, and ranks whose dtype or row shape differ
        all raise ``ValueError`` before any payload moves (the communicator stays usable). Then every
        (channel, peer) ring streams its share of the bytes behind a call header; messages larger than the rings
        stream through them in chunks.

        Raises
        ------
        TypeError, ValueError
            Bad array type/device, counts of the wrong shape, negative, not summing to ``num_rows`` or too large
            to address, ``recv_counts[rank] != send_counts[rank]``. A call rejected on one rank is rejected on
            every rank (the peers raise :class:`~cupy_symbuf.SymBufferRejectedError`; with ``recv_counts`` on the
            GPU path from :meth:`synchronize` unless ``Config.blocking``); the communicator stays usable.
        SymBufferMismatchError
            ``recv_counts`` differ from what a peer sends, or a peer called another collective or passed another
            dtype / row shape: every rank involved raises, the communicator is unusable.
        SymBufferTimeoutError, SymBufferAbortedError
            A peer did not take part within ``config.timeout_s``, or a rank aborted.
        """
        op = "alltoallv"
        eng = self._engine
        with eng.call(op, notify=recv_counts is None):
            x = as_array(op, "sendbuf", sendbuf, self.backend)
            send_counts = check_counts(op, "send_counts", send_counts, self.world_size, total=int(x.shape[0]))
            sig = row_signature(x)
            if recv_counts is None:
                recv_counts = eng.notify(op, send_counts[:, None], sig)[:, 0].copy()
            else:
                recv_counts = check_counts(op, "recv_counts", recv_counts, self.world_size)
                if recv_counts[self.rank] != send_counts[self.rank]:
                    raise ValueError(f"{op}: recv_counts[{self.rank}] ({recv_counts[self.rank]}) must equal "
                                     f"send_counts[{self.rank}] ({send_counts[self.rank]}): the rows this rank sends "
                                     f"to itself")
            recv = self.xp.empty((int(recv_counts.sum()),) + tuple(x.shape[1:]), dtype=x.dtype)
            eng.exchange_rows(op, [x], None, send_counts, [recv], recv_counts, sig)
        return recv, recv_counts

    # ---- MoE (DeepEP normal-mode semantics; see cupy_symbuf.moe) --------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts):
        # docstring: cupy_symbuf.moe.get_dispatch_layout (assigned below)
        return _moe.get_dispatch_layout(self._engine, topk_idx, num_experts)

    def dispatch(self, x, topk_idx=None, topk_weights=None, num_experts=None, *, handle=None, expert_alignment=1):
        # docstring: cupy_symbuf.moe.dispatch (assigned below)
        return _moe.dispatch(self._engine, x, topk_idx, topk_weights, num_experts, handle=handle,
                             expert_alignment=expert_alignment)

    def combine(self, x, handle, topk_weights=None, *, dtype=None):
        # docstring: cupy_symbuf.moe.combine (assigned below)
        return _moe.combine(self._engine, x, handle, topk_weights, dtype=dtype)

    def __repr__(self) -> str:
        return (f"Communicator(backend={self.backend!r}, rank={getattr(self, 'rank', '?')}, "
                f"world_size={self.world_size}, num_channels={self.layout.num_channels})")


# The MoE methods carry the full DeepEP-semantics docstrings of cupy_symbuf.moe (one text, two entry points;
# there the communicator is the first argument ``comm``).
Communicator.get_dispatch_layout.__doc__ = _moe.get_dispatch_layout.__doc__
Communicator.dispatch.__doc__ = _moe.dispatch.__doc__
Communicator.combine.__doc__ = _moe.combine.__doc__
