"""Energy per GB for ``python -m cupy_symbuf.bench`` (``--energy``, the default on GPUs): NVML's energy counter
(``nvmlDeviceGetTotalEnergyConsumption``, millijoules since the driver loaded, **the whole GPU**) read around at
least one second of back-to-back calls, and the idle power beside it.

* Who reads: the lowest rank on each GPU (ranks grouped by the GPU identities the communicator agreed on: UUID, PCI
  bus id, host); the other ranks of that GPU only take part in the barriers. With several ranks on one GPU (MPS)
  the figure is the energy of the whole GPU while all of them run: nothing is split per rank. With several GPUs the
  readings are summed: the energy of every GPU of the run.
* What is divided: ``J/GB = sum over GPUs of the counter's advance (J) / (calls x bytes per call / 1e9)``, the bytes
  per call being **all ranks' input bytes** for an all-to-all (``world_size x`` the per-rank input) and all ranks'
  received token bytes (DeepEP's convention, summed over ranks) for MoE dispatch / combine; every row says which
  (``energy_bytes``).
* How long: the call loop is repeated (a batch sized from the loop time already measured, then the rest) until at
  least ``min_s`` (1 s) has passed on every rank; device synchronised and a barrier before the first and after the
  last reading, so the interval covers every rank's calls. Counted calls, seconds and joules are reported.
* Idle: ``nvmlDeviceGetPowerUsage`` sampled every 25 ms over 0.5 s with nothing running (all ranks in a barrier
  after a device synchronize), summed over the GPUs: ``idle_W``; the energy counter over the same interval gives
  ``idle_energy_W`` (a cross-check: the counter's own resolution). ``energy_above_idle_J_per_GB`` subtracts
  ``idle_W x seconds``.

Never fatal: without ``pynvml`` (``pip install nvidia-ml-py``) or when NVML fails (no counter on this GPU, a
driver error) :func:`setup` returns the reason, printed once, and the columns stay empty (``null`` in the JSON).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional

import numpy as np
from mpi4py import MPI

__all__ = ["EnergyMeter", "setup", "energy_figures", "row_fields", "EMPTY", "A2A_BYTES", "MOE_BYTES"]

#: the JSON fields every row of an energy-capable table carries (None: not measured, ``energy_skipped`` says why)
EMPTY = {"energy_J_per_GB": None, "energy_above_idle_J_per_GB": None, "energy_avg_W": None, "idle_W": None,
         "idle_energy_W": None, "energy_J": None, "energy_s": None, "energy_calls": None, "energy_bytes": None,
         "energy_bytes_kind": None, "energy_scope": None, "energy_skipped": None}
#: what ``energy_bytes`` counts
A2A_BYTES = "all ranks' input bytes (world_size x size per rank) x calls"
MOE_BYTES = ("all ranks' received token bytes (DeepEP convention, summed over ranks) x calls",
             "all ranks' sent token bytes (DeepEP convention, summed over ranks) x calls")


def energy_figures(delta_mj: float, seconds: float, calls: int, bytes_per_call: float,
                   idle_w: Optional[float] = None) -> dict:
    """The figures of one measurement: ``delta_mj`` millijoules (summed over the GPUs) over ``seconds`` for ``calls``
    calls of ``bytes_per_call`` bytes. GB = 1e9 bytes (as every GB/s of the bench)."""
    gb = calls * bytes_per_call / 1e9
    joules = delta_mj / 1e3
    out = {"energy_J": joules, "energy_s": seconds, "energy_calls": int(calls), "energy_bytes": calls * bytes_per_call,
           "energy_avg_W": joules / seconds if seconds > 0 else None,
           "energy_J_per_GB": joules / gb if gb > 0 else None, "energy_above_idle_J_per_GB": None}
    if idle_w is not None and gb > 0:
        out["energy_above_idle_J_per_GB"] = (joules - idle_w * seconds) / gb
    return out


class EnergyMeter:
    """Collective NVML energy readings (see the module docstring). Build with :meth:`open` (or :func:`setup`)."""

    #: the shortest measured interval, seconds
    min_s = 1.0
    #: the idle interval, seconds, and the power sampling period
    idle_s = 0.5
    idle_period_s = 0.025

    def __init__(self, comm, nvml, handle, reader: bool, scope: str, device_sync: Callable[[], None]):
        self.comm = comm
        self.nvml, self.handle, self.reader = nvml, handle, reader
        self.scope = scope
        self.device_sync = device_sync
        self.idle_w: Optional[float] = None
        self.idle_energy_w: Optional[float] = None
        self.failed: Optional[str] = None  # why a later reading failed (the meter is off from then on)

    @classmethod
    def open(cls, comm, reader: bool, pci_bus_id: str, uuid: str, *, num_gpus: int, ranks_per_gpu: int,
             device_sync: Callable[[], None]):
        """``(meter, None)`` or ``(None, reason)``, the same on every rank of ``comm``. Only ``reader`` ranks import
        ``pynvml`` and open their GPU (by PCI bus id, else UUID)."""
        nvml = handle = None
        why = None
        if reader:
            try:
                import pynvml as nvml
            except ImportError:
                why = "pynvml is not installed (pip install nvidia-ml-py, or the extra cupy_symbuf[nvml])"
            except Exception as exc:  # noqa: BLE001 - a broken install: reported, the bench goes on
                why = f"pynvml failed to load ({type(exc).__name__}: {exc})"
            if why is None:
                try:
                    nvml.nvmlInit()
                except Exception as exc:  # noqa: BLE001
                    why = f"nvmlInit failed: {type(exc).__name__}: {exc}"
                    nvml = None
            if why is None:
                try:
                    try:
                        handle = nvml.nvmlDeviceGetHandleByPciBusId(str(pci_bus_id).encode())
                    except Exception:  # noqa: BLE001 - try the UUID (CUDA's raw bytes -> NVML's GPU-xxxxxxxx-... form)
                        u = str(uuid).replace("-", "")
                        u = f"GPU-{u[:8]}-{u[8:12]}-{u[12:16]}-{u[16:20]}-{u[20:32]}"
                        handle = nvml.nvmlDeviceGetHandleByUUID(u.encode())
                    nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
                except Exception as exc:  # noqa: BLE001 - NotSupported on GPUs before Volta, driver errors
                    why = f"NVML has no energy counter for GPU {pci_bus_id}: {type(exc).__name__}: {exc}"
        whys = comm.allgather(why)
        why = next((w for w in whys if w), None)
        if why is not None:
            if nvml is not None:
                try:
                    nvml.nvmlShutdown()
                except Exception:  # noqa: BLE001
                    pass
            return None, why
        if num_gpus == 1 and ranks_per_gpu > 1:
            scope = f"whole GPU: 1 GPU shared by {ranks_per_gpu} ranks, every process on it counted"
        elif num_gpus == 1:
            scope = "whole GPU: 1 GPU"
        else:
            scope = f"whole GPUs: sum over {num_gpus} GPUs ({ranks_per_gpu} rank(s) per GPU), one reading per GPU"
        return cls(comm, nvml, handle, reader, scope, device_sync), None

    def close(self) -> None:
        if self.reader and self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self.nvml = None

    # ---- readings (every rank calls; the readers read) ----------------------------------------------------------
    def _energy_mj(self) -> float:
        if not self.reader:
            return 0.0
        try:
            return float(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except Exception:  # noqa: BLE001 - NaN: summed over the readers, it marks the whole reading failed
            return math.nan

    def _sum(self, v: float) -> float:
        return self.comm.allreduce(float(v), op=MPI.SUM)

    def measure_idle(self) -> Optional[float]:
        """Idle power of the run's GPUs, watts (summed over GPUs), with nothing running. Collective."""
        if self.failed:
            return None
        self.device_sync()
        self.comm.Barrier()
        e0, t0 = self._energy_mj(), time.perf_counter()
        samples = []
        if self.reader:
            while time.perf_counter() - t0 < self.idle_s:
                try:
                    samples.append(float(self.nvml.nvmlDeviceGetPowerUsage(self.handle)) / 1e3)  # mW -> W
                except Exception:  # noqa: BLE001
                    samples.append(math.nan)
                time.sleep(self.idle_period_s)
        e1, t1 = self._energy_mj(), time.perf_counter()
        self.comm.Barrier()
        power = self._sum(float(np.mean(samples)) if samples else 0.0)
        counter = self._sum((e1 - e0) / 1e3 / (t1 - t0) if self.reader else 0.0)
        self.idle_w = power if math.isfinite(power) else None
        self.idle_energy_w = counter if math.isfinite(counter) else None
        if self.idle_w is None and self.idle_energy_w is not None:
            self.idle_w = self.idle_energy_w
        return self.idle_w

    def measure(self, fn: Callable[[], object], sync: Optional[Callable[[], None]], bytes_per_call: float,
                est_s: Optional[float] = None) -> Optional[dict]:
        """``fn`` called back to back until at least :attr:`min_s` seconds have passed on every rank (``est_s``:
        seconds per call already measured, sizes the first batch), the energy counter read before and after.
        Returns :func:`energy_figures` plus ``idle_W``, ``idle_energy_W``, ``energy_scope``; None after a failed
        reading (the reason in :attr:`failed`, the meter off from then on). Collective."""
        if self.failed:
            return None
        comm = self.comm
        self.device_sync()
        comm.Barrier()
        e0, t0 = self._energy_mj(), time.perf_counter()
        calls = 0
        n = max(1, min(10_000_000, int(math.ceil(1.05 * self.min_s / est_s)))) if est_s and est_s > 0 else 1
        while True:
            for _ in range(n):
                fn()
            calls += n
            self.device_sync()
            elapsed = comm.allreduce(time.perf_counter() - t0, op=MPI.MIN)  # the same on every rank
            if elapsed >= self.min_s:
                break
            n = max(1, int(math.ceil(calls * (1.05 * self.min_s / max(elapsed, 1e-9) - 1))))
        comm.Barrier()
        e1, t1 = self._energy_mj(), time.perf_counter()
        if sync is not None:
            sync()
        delta = self._sum(e1 - e0)
        seconds = comm.allreduce(t1 - t0, op=MPI.MAX)
        if not math.isfinite(delta) or delta < 0:
            self.failed = "an NVML energy reading failed" if not math.isfinite(delta) else \
                "the NVML energy counter went backwards"
            if comm.Get_rank() == 0:
                print(f"# energy: off from here: {self.failed}")
            return None
        out = energy_figures(delta, seconds, calls, bytes_per_call, self.idle_w)
        out.update(idle_W=self.idle_w, idle_energy_W=self.idle_energy_w, energy_scope=self.scope)
        return out


def row_fields(timer, fn, sync, bytes_per_call: float, est_s: Optional[float], kind: str) -> dict:
    """The energy fields of one bench row (:data:`EMPTY`'s keys): measured with ``timer.energy`` (the run's
    :class:`EnergyMeter`, set by ``bench.main``) when there is one, else empty with ``timer.energy_skip``'s reason.
    Collective."""
    out = dict(EMPTY)
    meter = getattr(timer, "energy", None)
    if meter is None:
        out["energy_skipped"] = getattr(timer, "energy_skip", None) or "not measured"
        return out
    got = meter.measure(fn, sync, bytes_per_call, est_s)
    if got is None:
        out["energy_skipped"] = meter.failed
        return out
    out.update({k: got.get(k) for k in EMPTY if k in got})
    out["energy_bytes_kind"] = kind
    return out


def setup(c, comm, enabled: bool = True):
    """``(meter or None, reason or None)`` for the bench's communicator ``c``: the idle power measured once when a
    meter is made. Collective; the reason is the same on every rank (rank 0 prints it)."""
    if not enabled:
        return None, "--no-energy"
    if c.backend != "cuda":
        return None, "host backend: NVML's energy counter is a GPU's (run with --backend cuda)"
    from ..common import backend as _compat
    cp = _compat.cupy
    idents = c.buffer.gpu_identities
    keys = [(i.get("hostname"), i["uuid"], i["pci_bus_id"]) for i in idents]
    me = c.rank
    reader = keys.index(keys[me]) == me  # the lowest rank on this GPU
    meter, why = EnergyMeter.open(comm, reader, idents[me]["pci_bus_id"], idents[me]["uuid"],
                                  num_gpus=len(set(keys)), ranks_per_gpu=c.buffer.ranks_per_gpu,
                                  device_sync=lambda: cp.cuda.Device().synchronize())
    if meter is not None and meter.measure_idle() is None:
        meter.close()
        return None, "NVML's power / energy readings failed while idle"
    return meter, why
