"""All-to-all across nodes: our channels inside a node, MPI between nodes (DeepEP's internode design on an existing
engine). Host backend for now.

:class:`HierarchicalCommunicator` splits the ranks into nodes of ``node_size`` consecutive ranks (the real nodes,
``MPI.COMM_TYPE_SHARED``, by default; ``node_size=k`` or ``CUPY_SYMBUF_NODE_SIZE=k`` makes *virtual* nodes on one
machine, which use no shared window between them, so the inter-node path really runs in tests). Rank ``g`` is
``(node n, local index l)`` with ``g = n * k + l``. An ``alltoallv``:

1. exchanges the counts of every rank with every rank (``MPI.Alltoall`` of ``W`` int64: what each will receive);
2. **crosses nodes once**: rank ``(n, l)`` sends every row meant for a rank of node ``m`` to ``(m, l)``, the rank
   with its own local index there, in one ``MPI.Alltoallv`` over the "rail" of ranks sharing ``l``;
3. **fans out inside the node** through a :class:`~cupy_symbuf.Communicator` of the node's ranks
   (``alltoallv`` over its symmetric buffer): ``(m, l)`` forwards each row to its destination ``(m, l')``;
4. puts the rows in source-rank order (the order of a flat ``alltoallv``).

So a row crosses the network at most once, and every row crosses a node's shared memory at most once more. The
result is exactly a flat ``alltoallv``'s. Design: DeepEP's internode dispatch (RDMA to the same-index GPU, then
NVLink); the model of what it buys at scale is ``docs/scaling.md``.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
from mpi4py import MPI

from . import _agree

__all__ = ["HierarchicalCommunicator", "node_size_from_env"]


def node_size_from_env() -> Optional[int]:
    """``CUPY_SYMBUF_NODE_SIZE`` as an int >= 1, or None when unset; ``ValueError`` naming it otherwise."""
    v = os.environ.get("CUPY_SYMBUF_NODE_SIZE", "").strip()
    if not v:
        return None
    try:
        k = int(v)
    except ValueError:
        raise ValueError(f"CUPY_SYMBUF_NODE_SIZE must be an int >= 1, got {v!r}") from None
    if k < 1:
        raise ValueError(f"CUPY_SYMBUF_NODE_SIZE must be an int >= 1, got {v!r}")
    return k


class HierarchicalCommunicator:
    """``alltoall`` / ``alltoallv`` over nodes (see the module docstring). Collective to build and to close.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        All the ranks.
    config : Config, optional
        For the node's :class:`~cupy_symbuf.Communicator`.
    node_size : int, optional
        Ranks per node (virtual nodes of consecutive ranks); default ``CUPY_SYMBUF_NODE_SIZE``, else the real
        nodes (then every node must hold the same number of consecutive ranks).
    backend : {"host"}
        The node communicator's backend (the GPU form is issue 14's next step).

    Attributes
    ----------
    node, local_rank, num_nodes, node_size : int
        This rank's node and index in it, the number of nodes and ranks per node.
    node_comm : Communicator
        The node's communicator (our channels).

    Raises
    ------
    ValueError
        ``node_size`` not dividing the world size, ranks disagreeing on it, real nodes of unequal size or of
        non-consecutive ranks, a backend other than "host" (on every rank).
    """

    def __init__(self, comm, config=None, *, node_size: Optional[int] = None, backend: str = "host"):
        from .communicator import Communicator
        W, me = comm.Get_size(), comm.Get_rank()
        err = None
        k = node_size
        try:
            if backend != "host":
                raise ValueError(f"HierarchicalCommunicator: backend must be 'host' for now, got {backend!r}")
            if k is None:
                k = node_size_from_env()
            if k is None:  # the real nodes: consecutive ranks of equal count
                node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=me)
                k = node.Get_size()
                members = node.allgather(me)
                node.Free()
                first = members[0]
                if members != list(range(first, first + k)) or first % k:
                    raise ValueError(f"HierarchicalCommunicator: the ranks of a node must be consecutive and "
                                     f"aligned (node of rank {me}: ranks {members}); pass node_size")
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1 or W % k:
                raise ValueError(f"HierarchicalCommunicator: node_size must be an int >= 1 dividing the world size "
                                 f"{W}, got {k!r}")
        except ValueError as exc:
            err = str(exc)
        everyone = _agree.exchange_all(comm, (None if err else int(k), err), 60.0, "HierarchicalCommunicator")
        bad = [(r, e) for r, (_, e) in enumerate(everyone) if e]
        if bad:
            raise ValueError(bad[0][1] if bad[0][0] == me else f"HierarchicalCommunicator: rank {bad[0][0]} "
                             f"rejected its arguments ({bad[0][1]})")
        if len({v for v, _ in everyone}) != 1:
            raise ValueError(f"HierarchicalCommunicator: ranks disagree on node_size: {[v for v, _ in everyone]}")
        k = int(k)
        self.world = comm
        self.world_size, self.rank = W, me
        self.node_size, self.num_nodes = k, W // k
        self.node, self.local_rank = divmod(me, k)
        self._node_mpi = comm.Split(self.node, self.local_rank)
        self._rail = comm.Split(self.local_rank, self.node)  # ranks with this local index, one per node
        try:
            self.node_comm = Communicator(self._node_mpi, config, backend=backend)
        except BaseException:
            self._node_mpi.Free()
            self._rail.Free()
            raise
        self._closed = False

    # ---- collectives ----------------------------------------------------------------------------------------
    def alltoallv(self, sendbuf, send_counts):
        """Variable all-to-all over the nodes: the same arguments and result as :meth:`Communicator.alltoallv`
        (the counts, dtype and row shape of every rank travel in one bounded exchange first). ``sendbuf`` NumPy
        ``[rows, ...]`` grouped by destination global rank, ``send_counts`` int ``[world_size]``. Returns
        ``(recvbuf [sum(recv_counts), ...], recv_counts int64 [world_size])``, rows in source-rank order.
        Raises ``ValueError`` for bad arguments or ranks disagreeing on dtype / row shape, on every rank (the first
        step is a bounded exchange of every rank's counts), and what the node communicator raises. The step between
        nodes is MPI's own ``Alltoallv`` (its waits are MPI's)."""
        return self._alltoallv(sendbuf, send_counts, None)

    def _alltoallv(self, sendbuf, send_counts, err):
        """The body of :meth:`alltoallv`; ``err``: an error the caller already found (told to every rank)."""
        self._check_open()
        op = "HierarchicalCommunicator.alltoallv"
        k, N, W = self.node_size, self.num_nodes, self.world_size
        mine = None
        try:
            if err is not None:
                raise err
            x = np.ascontiguousarray(sendbuf)
            try:
                counts = np.asarray(send_counts, dtype=np.int64)
            except (TypeError, ValueError):
                raise ValueError(f"{op}: send_counts must be {W} ints >= 0, got {send_counts!r}") from None
            if x.ndim < 1 or counts.shape != (W,) or (counts < 0).any() or int(counts.sum()) != x.shape[0]:
                raise ValueError(f"{op}: send_counts must be {W} ints >= 0 summing to the rows of sendbuf "
                                 f"({x.shape[0] if x.ndim else 0}), got {np.asarray(send_counts).tolist()}")
            mine = (counts.tolist(), x.dtype.str, tuple(x.shape[1:]))
        except (TypeError, ValueError) as exc:
            err = exc
        # 1. every rank's counts, dtype and row shape (a bounded exchange; a rank's bad arguments fail every rank)
        everyone = _agree.exchange_all(self.world, (mine, None if err is None else str(err)),
                                       self.node_comm.config.timeout_s, op)
        if err is not None:
            raise err
        bad = [(r, e) for r, (_, e) in enumerate(everyone) if e]
        if bad:
            raise ValueError(f"{op}: rank {bad[0][0]} rejected its arguments ({bad[0][1]}); nothing was exchanged")
        if len({(d, rs) for (_, d, rs), _ in everyone}) != 1:
            raise ValueError(f"{op}: every rank must send the same dtype and row shape, got "
                             f"{[(d, rs) for (_, d, rs), _ in everyone]}")
        C = np.array([c for (c, _, _), _ in everyone], np.int64)  # C[s, d] = rows s sends to d
        row_shape = x.shape[1:]
        row_bytes = x.dtype.itemsize * int(np.prod(row_shape))
        recv_counts = C[:, self.rank].copy()
        # 2. across nodes: to (m, l) the rows for node m's ranks, in destination order
        by_node = counts.reshape(N, k).sum(axis=1)
        rail_recv = np.array([C[m * k + self.local_rank, self.node * k: (self.node + 1) * k].sum()
                              for m in range(N)], np.int64)  # what (m, l) sends to us
        flat = x.reshape(x.shape[0], -1).view(np.uint8).reshape(-1) if x.size else np.zeros(0, np.uint8)
        landed = np.empty(int(rail_recv.sum()) * row_bytes, np.uint8)
        sdispl = np.concatenate([[0], np.cumsum(by_node)[:-1]]) * row_bytes
        rdispl = np.concatenate([[0], np.cumsum(rail_recv)[:-1]]) * row_bytes
        self._rail.Alltoallv([flat, (by_node * row_bytes, sdispl), MPI.BYTE],
                             [landed, (rail_recv * row_bytes, rdispl), MPI.BYTE])
        landed = landed.reshape(-1, row_bytes) if row_bytes else np.zeros((int(rail_recv.sum()), 0), np.uint8)
        # landed holds, per source node m (rank (m, l)), rows for our node's ranks l' = 0..k-1 in order
        # 3. inside the node: forward each row to its local destination, grouped by destination, then by source node
        pieces, fwd_counts = [], np.zeros(k, np.int64)
        starts = np.concatenate([[0], np.cumsum(rail_recv)])
        for lp in range(k):
            for m in range(N):
                src = m * k + self.local_rank
                block = C[src, self.node * k: (self.node + 1) * k]
                lo = int(starts[m] + block[:lp].sum())
                pieces.append(landed[lo: lo + int(block[lp])])
                fwd_counts[lp] += int(block[lp])
        fwd = np.concatenate(pieces) if pieces else np.zeros((0, row_bytes), np.uint8)
        got, got_counts = self.node_comm.alltoallv(fwd, fwd_counts)
        # got: from each local rank l (in order), rows of sources (m, l) for m = 0..N-1, in that order
        # 4. source-rank order: global source g = m * k + l
        out = np.empty((int(recv_counts.sum()), row_bytes), np.uint8)
        dst_start = np.concatenate([[0], np.cumsum(recv_counts)])
        pos = 0
        for lsrc in range(k):
            for m in range(N):
                g = m * k + lsrc
                n = int(recv_counts[g])
                out[dst_start[g]: dst_start[g] + n] = got[pos: pos + n]
                pos += n
        if pos != got.shape[0]:
            raise AssertionError(f"internal: {got.shape[0]} rows forwarded, {pos} expected")
        return out.view(x.dtype).reshape((out.shape[0],) + row_shape), recv_counts

    def alltoall(self, sendbuf):
        """Equal blocks (``sendbuf [world_size, ...]``, block ``j`` to rank ``j``): :meth:`alltoallv` with one row
        each; returns ``[world_size, ...]``, block ``j`` from rank ``j``."""
        err = None
        try:
            x = np.ascontiguousarray(sendbuf)
        except Exception as exc:  # noqa: BLE001 - told to every rank by the count exchange
            x, err = np.zeros((self.world_size, 0)), TypeError(f"HierarchicalCommunicator.alltoall: sendbuf: {exc}")
        if err is None and (x.ndim < 1 or x.shape[0] != self.world_size):  # told to every rank likewise
            err = ValueError(f"HierarchicalCommunicator.alltoall: sendbuf must have shape[0] == world_size "
                             f"({self.world_size}), got {x.shape}")
        y, _ = self._alltoallv(x, np.ones(self.world_size, np.int64), err)
        return y

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            from .errors import SymBufferClosedError
            raise SymBufferClosedError("HierarchicalCommunicator is closed")

    def close(self) -> None:
        """Close the node communicator and free the MPI communicators (collective); idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.node_comm.close()
        finally:
            self._node_mpi.Free()
            self._rail.Free()

    def __enter__(self) -> "HierarchicalCommunicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
