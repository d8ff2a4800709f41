"""The tuning table (cupy_symbuf.transport.tuning) and ``bench --tune``: entries become the defaults of unset Config fields,
explicit fields win, a broken table fails on every rank, and --tune writes an entry the library then reads."""
import json
import os
import pathlib
import tempfile
import types

import numpy as np
import pytest
from mpi4py import MPI

import cupy_symbuf as cs
from cupy_symbuf import bench
from cupy_symbuf.transport import tuning


@pytest.fixture
def table_path(monkeypatch):
    """A fresh table file name (made by rank 0, the same on every rank), as CUPY_SYMBUF_TUNING."""
    world = MPI.COMM_WORLD
    path = world.bcast(tempfile.mkstemp(suffix=".json")[1] if world.Get_rank() == 0 else None)
    world.Barrier()
    if world.Get_rank() == 0:
        os.remove(path)  # an absent file: no table (CUPY_SYMBUF_TUNING set: no other table is read)
    world.Barrier()
    monkeypatch.setenv("CUPY_SYMBUF_TUNING", path)
    yield path
    world.Barrier()
    if world.Get_rank() == 0 and os.path.exists(path):
        os.remove(path)


def test_entry_sets_unset_fields(comm, table_path):
    key = tuning.table_key("host", comm.size)
    if comm.rank == 0:
        tuning.save_entry(table_path, key, {"default": {"num_sms": 6, "chunk_bytes": 131072, "num_slots": 5}})
        tuning.save_entry(table_path, "host/x/world=999", {"default": {"num_sms": 8}})  # other entries are kept
    comm.Barrier()
    assert set(json.loads(pathlib.Path(table_path).read_text())["entries"]) == {key, "host/x/world=999"}
    assert key.startswith("host/") and key.endswith(f"/cores={os.cpu_count()}/world={comm.size}")
    with cs.Communicator(comm, backend="host") as c:
        assert (c.config.num_sms, c.config.chunk_bytes, c.config.num_slots) == (6, 131072, 5)
        assert key in c.describe() and table_path in c.describe()
        x = np.arange(comm.size * 3, dtype=np.int64).reshape(comm.size, 3) + 100 * comm.rank
        y = c.alltoall(x)
        np.testing.assert_array_equal(y, np.stack([np.arange(comm.size * 3).reshape(comm.size, 3)[comm.rank]
                                                   + 100 * j for j in range(comm.size)]))
    # a layout field set by the caller: none of the table's values apply (they were measured together)
    with cs.Communicator(comm, cs.Config(num_sms=2), backend="host") as c:
        builtin = cs.Config(num_sms=2).resolved("host", world_size=comm.size)
        assert (c.config.num_sms, c.config.chunk_bytes, c.config.num_slots) == \
            (2, builtin.chunk_bytes, builtin.num_slots)
        assert "tuning table" not in c.describe()


def test_broken_table_fails_on_every_rank(comm, table_path):
    if comm.rank == 0:
        with open(table_path, "w") as f:
            f.write('{"version": 1, "entries": {"%s": {"default": {"num_sms": "many"}}}}' %
                    tuning.table_key("host", comm.size))
    comm.Barrier()
    with pytest.raises(ValueError, match="must be an int"):
        cs.Communicator(comm, backend="host")
    if comm.rank == 0:
        tuning.save_entry(table_path, tuning.table_key("host", comm.size), {"default": {"num_sms": 3}})
    comm.Barrier()
    with pytest.raises(ValueError, match="from the tuning table"):  # an invalid value names the table
        cs.Communicator(comm, backend="host")
    if comm.rank == 0:
        with open(table_path, "w") as f:
            f.write("not json")
    comm.Barrier()
    with pytest.raises(ValueError, match="unreadable"):
        cs.Communicator(comm, backend="host")


@pytest.mark.parametrize("transport", [[], ["--transport", "staged"]])
def test_bench_tune_writes_an_entry_the_library_reads(comm, table_path, transport):
    """(--transport: the sweep's communicators take it; on the host the key has no transport.)"""
    assert bench.main(["--backend", "host", "--tune", "--sizes", "8K,64K", "--tune-rounds", "1", "--iters", "2",
                       "--warmup", "1", "--tune-out", table_path] + transport) == 0
    comm.Barrier()
    entry = json.loads(pathlib.Path(table_path).read_text())["entries"][tuning.table_key("host", comm.size)]
    chosen = entry["default"]
    cands = [dict(cfg) for cfg in (r["config"] for r in entry["rows"])]
    assert {k: chosen[k] for k in ("num_sms", "chunk_bytes")} in cands
    assert all(len(r["us"]) == 2 and min(r["us"]) > 0 for r in entry["rows"])
    assert {r["send"] for r in entry["rows"]} == {"out", "sym"}
    with cs.Communicator(comm, backend="host") as c:
        assert (c.config.num_sms, c.config.chunk_bytes, c.config.num_slots) == \
            (chosen["num_sms"], chosen["chunk_bytes"], chosen["num_slots"])


def test_packaged_table_is_valid(monkeypatch):
    """The table shipped with the package loads, and each entry's default is a valid Config (for its backend)."""
    table = tuning._read(tuning.packaged_path())
    assert table is not None and table["entries"]
    for key, entry in table["entries"].items():
        backend = key.split("/")[0]
        world = int(key.split("world=", 1)[1].split("/")[0])  # keys may end in /transport=staged
        cfg = cs.Config(**{k: entry["default"][k] for k in tuning.FIELDS if k in entry["default"]})
        assert cfg.resolved(backend, world_size=world).num_sms == entry["default"]["num_sms"]
        assert entry["measured"] and entry["command"].split()[0] in ("mpiexec", "mpirun")
    monkeypatch.delenv("CUPY_SYMBUF_TUNING")
    monkeypatch.setattr(tuning, "user_path", lambda: "/nonexistent/cupy_symbuf/tuning.json")
    for key in table["entries"]:
        assert tuning.lookup(key)[0] == {k: table["entries"][key]["default"][k] for k in tuning.FIELDS}


def test_entry_shape_is_checked(comm, table_path):
    key = tuning.table_key("host", comm.size)
    for bad, msg in (("just a string", "must be an object"), ({"default": {"num_sms": 2, "chunk": 4096}},
                                                              "unknown fields")):
        if comm.rank == 0:
            with open(table_path, "w") as f:
                json.dump({"version": 1, "entries": {key: bad}}, f)
        comm.Barrier()
        with pytest.raises(ValueError, match=msg):
            cs.Communicator(comm, backend="host")
        comm.Barrier()


def test_entry_of_the_staged_transport_applies_to_it_alone(comm, table_path):
    """cuda keys carry the transport (a layout per link class): the staged entry sets a staged
    communicator's layout, the IPC entry an IPC one's, and an explicit layout field still wins over both."""
    ipc = tuning.table_key("cuda", 2, "Fake GPU", 1)
    staged = tuning.table_key("cuda", 2, "Fake GPU", 1, "staged")
    if comm.rank == 0:
        tuning.save_entry(table_path, ipc, {"default": {"num_sms": 8, "chunk_bytes": 65536, "num_slots": 4}})
        tuning.save_entry(table_path, staged, {"default": {"num_sms": 4, "chunk_bytes": 1 << 20, "num_slots": 3}})
    comm.Barrier()
    got = {}
    for transport in ("ipc", "staged"):
        me = types.SimpleNamespace(tuning_source=None)
        cfg = cs.Communicator._tuned(me, cs.Config(), "cuda", 2, "Fake GPU", 1, transport)
        got[transport] = (cfg.num_sms, cfg.chunk_bytes, cfg.num_slots, me.tuning_source)
    assert got["ipc"][:3] == (8, 65536, 4) and got["ipc"][3].endswith(f"[{ipc}]: " + str(
        {"num_sms": 8, "chunk_bytes": 65536, "num_slots": 4}))
    assert got["staged"][:3] == (4, 1 << 20, 3) and f"[{staged}]" in got["staged"][3]
    me = types.SimpleNamespace(tuning_source=None)
    cfg = cs.Communicator._tuned(me, cs.Config(chunk_bytes=131072), "cuda", 2, "Fake GPU", 1, "staged")
    assert (cfg.num_sms, cfg.chunk_bytes, me.tuning_source) == (None, 131072, None)
    # another GPU kind, or world size: no entry
    me = types.SimpleNamespace(tuning_source=None)
    assert cs.Communicator._tuned(me, cs.Config(), "cuda", 4, "Fake GPU", 1, "staged").num_sms is None
