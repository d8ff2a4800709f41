"""SymBuffer: allocation, peer mapping, views, close; on every available backend."""
import numpy as np
import pytest
from mpi4py import MPI

import cupy_symbuf as cs
from _util import RankChecks, to_numpy


def test_peer_views_see_peer_writes(backend, comm):
    with cs.SymBuffer(comm, 4096, backend=backend) as buf:
        assert (buf.rank, buf.world_size, buf.backend, buf.nbytes) == (comm.rank, comm.size, backend, 4096)
        mine = buf.peer_view(buf.rank, np.int32, (1024,))
        pattern = (np.arange(1024, dtype=np.int32) * 7919 + 1000003 * (buf.rank + 1)).astype(np.int32)
        if backend == "cuda":
            import cupy
            mine[...] = cupy.asarray(pattern)
            cupy.cuda.runtime.deviceSynchronize()
        else:
            mine[...] = pattern
            buf.sync()
        comm.Barrier()
        checks = RankChecks()  # what this rank sees of its peers' writes: every rank still makes the Barrier
        with checks.local("the peers' writes seen here"):
            for r in range(buf.world_size):
                expected = (np.arange(1024, dtype=np.int32) * 7919 + 1000003 * (r + 1)).astype(np.int32)
                got = to_numpy(buf.peer_view(r, np.int32, (16, 64), offset_bytes=0)).reshape(-1)
                np.testing.assert_array_equal(got, expected, err_msg=f"rank {r}'s part")
                tail = to_numpy(buf.peer_view(r, np.int32, offset_bytes=4000))
                np.testing.assert_array_equal(tail, expected[1000:], err_msg=f"rank {r}'s part from byte 4000")
        comm.Barrier()
        checks.gather()


def test_self_entry_of_peer_table_is_local_pointer(backend, comm):
    with cs.SymBuffer(comm, 1 << 16, backend=backend) as buf:
        if backend == "cuda":
            assert buf.peer_ptrs[buf.rank] == buf.local_ptr != 0
            assert len(set(buf.peer_ptrs)) == buf.world_size  # each peer mapped at its own address
            assert to_numpy(buf.peer_ptrs_device).tolist() == buf.peer_ptrs
        else:
            assert buf.host_view(buf.rank).ctypes.data == buf.peer_view(buf.rank).ctypes.data


def test_gpu_identity_by_uuid_not_ordinal(backend, comm):
    """Ranks are grouped by GPU UUID/PCI bus id: under per-rank CUDA_VISIBLE_DEVICES every rank sees ordinal 0,
    yet ranks on different GPUs must not be counted as sharing one."""
    if backend != "cuda":
        pytest.skip("GPU identity only on cuda")
    import cupy
    with cs.SymBuffer(comm, 1 << 12, backend=backend) as buf:
        ords = comm.allgather(cupy.cuda.Device().id)
        ids = [(i["uuid"], i["pci_bus_id"]) for i in buf.gpu_identities]
        assert all(i[0] and i[1] for i in ids)
        assert buf.ranks_per_gpu == ids.count(ids[buf.rank])
        # same ordinal does not imply same GPU: check consistency of UUID and bus id instead
        for a, b in zip(ids, ids[1:]):
            assert (a[0] == b[0]) == (a[1] == b[1])
        if len(set(ords)) == 1 and len(set(ids)) > 1:
            print(f"rank {buf.rank}: all ranks use ordinal {ords[0]} but {len(set(ids))} distinct GPUs")


def test_nbytes_mismatch_names_both_sizes(backend, comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    n = 1024 * (comm.rank + 1)
    with pytest.raises(ValueError, match=r"rank \d+ asked for \d+ bytes but rank \d+ asked for \d+ bytes"):
        cs.SymBuffer(comm, n, backend=backend)
    # the communicator is still usable afterwards
    with cs.SymBuffer(comm, 1024, backend=backend) as buf:
        assert buf.nbytes == 1024


def test_zero_bytes_and_one_rank_communicator(backend, comm):
    with cs.SymBuffer(comm, 0, backend=backend) as buf:  # every rank contributes 0 bytes to the window
        assert buf.peer_view((buf.rank + 1) % buf.world_size, np.float32).shape == (0,)
    with cs.SymBuffer(MPI.COMM_SELF, 256, backend=backend) as buf:
        assert buf.world_size == 1 and buf.rank == 0
        assert to_numpy(buf.peer_view(0, np.uint8)).sum() == 0  # zero-initialised


def test_close_is_idempotent_and_use_after_close_raises(backend, comm):
    buf = cs.SymBuffer(comm, 512, backend=backend)
    buf.close()
    buf.close()
    with pytest.raises(cs.SymBufferClosedError):
        buf.peer_view(0)


def test_bad_arguments(backend, comm):
    with pytest.raises(ValueError, match="nbytes"):
        cs.SymBuffer(comm, -1, backend=backend)
    with pytest.raises(ValueError, match="backend"):
        cs.SymBuffer(comm, 16, backend="tpu")
    with cs.SymBuffer(comm, 64, backend=backend) as buf:
        with pytest.raises(IndexError):
            buf.peer_view(comm.size)
        with pytest.raises(IndexError):
            buf.peer_view(0, np.float64, (9,))
        with pytest.raises(ValueError, match="multiple of the itemsize"):
            buf.peer_view(0, np.float32, (1,), offset_bytes=2)


def test_view_and_size_edge_cases(backend, comm):
    with pytest.raises(ValueError, match="nbytes"):
        cs.SymBuffer(comm, True, backend=backend)
    with cs.SymBuffer(comm, 64, backend=backend) as buf:
        with pytest.raises(ValueError, match="negative"):
            buf.peer_view(0, np.float32, (-1,))
        if backend == "host":
            with pytest.raises(IndexError):
                buf.host_view(-1)
            with pytest.raises(IndexError):
                buf.host_view(comm.size)
