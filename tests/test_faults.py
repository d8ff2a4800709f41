"""Fault tests: each case of ``tests/faults/fault_cases.py`` runs as its own MPI job in a subprocess, so
this pytest process stays alive whatever the job does (as CuPy's distributed tests do)::

    mpiexec -n N python tests/faults/fault_cases.py <case> --marker <unique>     (CUPY_SYMBUF_TIMEOUT_S=3)

Every case runs twice: with the library's default (``abort_on_failure``: a failure that reaches interpreter exit
ends the job) and with ``CUPY_SYMBUF_ABORT_ON_FAILURE=0`` (the script catches, prints ``CAUGHT``, closes). For each
run we assert: the job ends within ``timeout_s + 5`` s of the fault (``FAULT t=`` line), the exit status is nonzero
where a failure is expected (zero where every rank recovers), the expected ranks print the expected exception
classes with messages naming rank/peer and operation, no rank printed ``WRONG DATA`` / ``NO ERROR`` (a call that
returned although ranks disagree), and no process with the run's marker is left.

The tests run only from a pytest process that is not itself an MPI rank of a launched job (the single-process pass
of ``make test``): a nested mpiexec inside ``mpiexec -n N pytest`` would run every case N times. Environment:
``MPIEXEC`` (launcher command, default the venv's ``mpiexec`` next to ``sys.executable``), ``CUPY_SYMBUF_FAULT_BACKEND``
(``host``, or ``cuda`` on a GPU machine), ``FAULT_TIMEOUT_S`` (default 3).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "faults", "fault_cases.py")
TIMEOUT_S = float(os.environ.get("FAULT_TIMEOUT_S", "3"))
END_BOUND_S = TIMEOUT_S + 5          # the whole job ends within timeout_s + 5 s of the fault
LIMIT_S = TIMEOUT_S + 15             # we kill the job after this (startup included); a hang then fails the test
BACKEND = os.environ.get("CUPY_SYMBUF_FAULT_BACKEND", "host")

from _jobs import KIND, LAUNCHER, UNDER_MPIEXEC, clean_env, mpi_command, run_job  # noqa: E402

pytestmark = pytest.mark.skipif(UNDER_MPIEXEC, reason="fault tests launch their own mpiexec jobs; they run from "
                                                      "the single-process pytest pass")

# ---- what a run printed -----------------------------------------------------------------------------------------

# Searched, not matched at the line's start: the launcher merges every rank's stdout and stderr, so a record can
# follow another process's unfinished line (e.g. the "RuntimeError" a dying rank's traceback writes before its ": ...").
_RECORD = re.compile(r"(CAUGHT|RAISING) (\w+) (.*) \[on rank (\d+) during (.*?) t=([0-9.]+)(?: isa ([\w,-]+))?\]\s*$")
TIMEOUT, MISMATCH, ABORTED, REJECTED = ("SymBufferTimeoutError", "SymBufferMismatchError", "SymBufferAbortedError",
                                        "SymBufferRejectedError")


@dataclass
class Run:
    rc: Optional[int]
    out: str
    wall_s: float
    end_after_fault_s: Optional[float]
    killed: bool
    leftovers: list

    def records(self):
        recs = []
        for line in self.out.splitlines():
            m = _RECORD.search(line.strip())
            if m:
                recs.append(dict(how=m[1], cls=m[2], msg=m[3], rank=int(m[4]), during=m[5], t=float(m[6]),
                                 isa=set((m[7] or "").split(",")) | {m[2]}))
        return recs


def launch(case: str, n: int, *, handled: bool, cleanup: bool = True) -> Run:
    if not LAUNCHER:
        pytest.skip("no mpiexec found (set MPIEXEC)")
    marker = f"faultrun-{uuid.uuid4().hex[:12]}"
    env = clean_env(CUPY_SYMBUF_TIMEOUT_S=str(TIMEOUT_S), CUPY_SYMBUF_FAULT_BACKEND=BACKEND)
    env.pop("CUPY_SYMBUF_ABORT_ON_FAILURE", None)
    if handled:
        env["CUPY_SYMBUF_ABORT_ON_FAILURE"] = "0"
    cmd = mpi_command(n, [sys.executable, SCRIPT, case, "--marker", marker], cleanup=cleanup)
    t0 = time.time()
    rc, out, killed = run_job(cmd, env, LIMIT_S)
    t_end = time.time()
    faults = [float(m) for m in re.findall(r"FAULT t=([0-9.]+)", out)]  # anywhere: lines of ranks interleave
    time.sleep(0.2)
    leftovers = _pids_with(marker)
    for pid in leftovers:                        # ours (they carry our unique marker): do not leave them running
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return Run(rc=None if killed else rc, out=out, wall_s=t_end - t0,
               end_after_fault_s=(t_end - min(faults)) if faults else None, killed=killed, leftovers=leftovers)


def _pids_with(marker: str) -> list:
    r = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split() if int(p) != os.getpid()]


# ---- cases ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Expect:
    """``records``: (ranks, exception classes, message regex, phase regex): each listed rank prints a record of one
    of the classes whose message matches (case-insensitive) during a phase matching the phase regex."""
    rc: str                                  # "zero", "nonzero" or "any"
    records: Tuple = ()
    output: Tuple[str, ...] = ()             # regexes the whole output must contain
    no_records: bool = False                 # nothing at all may be caught/raised


@dataclass(frozen=True)
class Case:
    name: str
    n: int
    default: Expect                          # CUPY_SYMBUF_ABORT_ON_FAILURE unset
    handled: Expect                          # CUPY_SYMBUF_ABORT_ON_FAILURE=0
    script_case: str = ""                    # fault_cases.py case (default: name)
    cleanup: bool = True                     # the launcher kills the job when a rank dies (hydra's default)
    xfail: str = ""                          # reason, while the feature is missing
    xfail_default: str = ""                  # reason for the default mode only
    xfail_handled: str = ""                  # reason for the handled mode only
    max_after_abort_s: Optional[float] = None  # the peers' records during `left_during` end within this many
    fault_line: str = "Communicator.abort"      # seconds of rank 1's "FAULT t=... rank 1: <fault_line>"
    left_during: str = "alltoall"
    #: the other ranks' records (in the phases of ``records``) come at most this long after rank 1's FAULT line
    max_after_fault_s: Optional[float] = None

    @property
    def script(self) -> str:
        return self.script_case or self.name


PEER1 = r"\b(peer|rank)s? \[?1\b"            # the message names rank 1 (as the peer or the rank)
ANY_RANK = r"\b(peer|rank)s? \[?\d"
FAILED = (TIMEOUT, ABORTED, MISMATCH)
DISAGREE = (MISMATCH, ABORTED)


def _both(rc_default: str, rc_handled: str, records=(), output=()):
    return dict(default=Expect(rc_default, records, output), handled=Expect(rc_handled, records, output))


# rank 0's recv_counts differ from what rank 1 sends: rank 0 raises; rank 1's call returns right data (checked)
# and (handled mode: by default rank 0's MPI.Abort may end the job first) its next call raises, naming rank 0
RECV_0 = ((0,), DISAGREE, r"alltoallv.*" + ANY_RANK, r"^alltoallv$")
RECV_COUNTS_OFF = dict(default=Expect("nonzero", (RECV_0,)),
                       handled=Expect("zero", (RECV_0, ((1,), DISAGREE, r"alltoallv.*rank 0", r"^call after failure$"))))


# close() with a peer that never closes: handled, a SymBufferTimeoutError naming rank 1; by default closing the failed
# communicator ends the job (MPI.Abort) with that message
CLOSE_HANDLED = Expect("nonzero", records=(((0,), (TIMEOUT,), PEER1, r"^close$"),))
CLOSE_DEFAULT = Expect("nonzero", output=(r"(?i)close[^\n]*timeout[^\n]*" + PEER1,))


def _surv(n):
    return tuple(r for r in range(n) if r != 1)


RAISE_WITH_RECORDS = ((_surv(2), (ABORTED,), r"alltoall.*" + PEER1 + r".*'with Communicator'", r"^alltoall$"),)


CASES = [
    Case("ok", 2, default=Expect("zero", no_records=True), handled=Expect("zero", no_records=True)),
    Case("ok4", 4, script_case="ok", default=Expect("zero", no_records=True),
         handled=Expect("zero", no_records=True)),
    # an exception leaves rank 1's 'with' block before a collective: its peers leave the collective within 1 s
    # naming it (the abort word), then close()
    # (by default its traceback is printed by the library before a peer's MPI_Abort can end it)
    Case("raise_with", 2,
         default=Expect("nonzero", records=RAISE_WITH_RECORDS,
                        output=(r"injected failure on rank 1", r"rank 1: Traceback \(most recent call last\)",
                                r"rank 1: +raise RuntimeError")),
         handled=Expect("nonzero", records=RAISE_WITH_RECORDS, output=(r"injected failure on rank 1",)),
         max_after_fault_s=1.0),
    # ... while the peers are already in close(): their close() raises it (by default the job ends with it)
    Case("raise_with_peer_closing", 2,
         default=Expect("nonzero", output=(r"injected failure on rank 1",
                                           r"Communicator\.close: rank 0: [^\n]*aborted by rank 1: an exception left "
                                           r"its 'with Communicator' block")),
         handled=Expect("nonzero", records=(((0,), (ABORTED,), PEER1 + r".*'with Communicator'", r"^close$"),),
                        output=(r"injected failure on rank 1",)),
         max_after_fault_s=1.0),
    Case("raise_nowith", 2, **_both("nonzero", "nonzero",
                                    records=((_surv(2), (TIMEOUT, ABORTED), r"alltoall.*" + PEER1, r"^alltoall$"),),
                                    output=(r"injected failure on rank 1",))),
    # a rank dies in the middle of a large alltoallv: the launcher ends the job ...
    Case("exit_mid_alltoallv", 2, **_both("nonzero", "nonzero")),
    # ... or, without the launcher's cleanup, the survivors leave on their own
    Case("exit_mid_alltoallv_nocleanup", 2, script_case="exit_mid_alltoallv", cleanup=False,
         **_both("nonzero", "nonzero",
                 records=((_surv(2), (TIMEOUT, ABORTED), r"alltoallv.*" + PEER1, r"^alltoallv$"),))),
    # cross-memory attach: a rank dies after announcing its rows; the survivors find it gone when they read
    Case("exit_after_cma_header", 3, cleanup=False, **_both("nonzero", "nonzero", records=(
        (_surv(3), ("SymBufferError",), r"cross-memory attach.*rank 1's process .* is gone|aborted by rank \d: an "
         r"exception on that rank inside a collective with peer 1", r"^alltoall$"),))),
    # ranks call different collectives
    Case("diff_op_notify", 2, **_both("nonzero", "zero",
                                      records=(((0, 1), FAILED, r"alltoall.*" + ANY_RANK, r"^alltoallv?$"),))),
    Case("diff_op_same_bytes", 4, **_both("nonzero", "zero",
                                          records=(((0, 1, 2, 3), DISAGREE, r"alltoall", r"^alltoallv?$"),)),),
    # rank 1 passes recv_counts to alltoallv, the others do not: each form's wait sees the other's first message
    Case("diff_form_alltoallv", 4, **_both("nonzero", "zero", records=(
        ((0, 1, 2, 3), DISAGREE, r"alltoallv.*(form of the call|call form).*recv_counts", r"^alltoallv$"),)),
         max_after_fault_s=1.0),
    # inconsistent counts
    Case("recv_more", 2, **RECV_COUNTS_OFF),
    Case("recv_fewer", 2, **RECV_COUNTS_OFF),
    Case("recv_self_off", 2, **_both("zero", "zero",
                                     records=(((0, 1), ("ValueError",), r"recv_counts\[\d\].*send_counts",
                                               r"^alltoallv$"),))),
    Case("wrap_counts", 4, **_both("zero", "zero",
                                   records=(((1,), ("ValueError",), r"send_counts", r"^alltoallv$"),
                                            ((0, 2, 3), (REJECTED,), r"alltoallv.*rank 1", r"^alltoallv$")))),
    # a call rejected on one rank only: every rank raises ValueError, the next valid calls are correct
    Case("reject_alltoallv", 2, **_both("zero", "zero",
                                        records=(((1,), ("ValueError",), r"send_counts", r"^alltoallv$"),
                                                 ((0,), (REJECTED,), r"alltoallv.*rank 1", r"^alltoallv$")))),
    Case("reject_alltoallv_rc", 2, **_both("zero", "zero",
                                           records=(((1,), ("ValueError",), r"send_counts", r"^alltoallv$"),
                                                    ((0,), (REJECTED,), r"alltoallv.*rank 1", r"^alltoallv$")))),
    Case("reject_alltoall", 4, **_both("zero", "zero",
                                       records=(((1,), ("ValueError",), r"sendbuf", r"^alltoall$"),
                                                ((0, 2, 3), (REJECTED,), r"alltoall.*rank 1", r"^alltoall$")))),
    # alltoall with another dtype / row shape / row size on one rank
    *[Case(f"{k}_alltoall", 2, **_both("nonzero", "zero",
                                       records=(((0, 1), DISAGREE, r"alltoall", r"^alltoall$"),)))
      for k in ("dtype", "shape", "rowbytes")],
    # a peer that never calls: timeout naming it, bounded close, the job ends
    Case("never_calls", 2, **_both("nonzero", "nonzero",
                                   records=(((0,), (TIMEOUT, ABORTED), r"alltoall.*" + PEER1, r"^alltoall$"),))),
    # a mismatched Config: ValueError at construction on every rank naming the field
    Case("config_mismatch", 2, **_both("nonzero", "zero",
                                       records=(((0, 1), ("ValueError",), r"chunk_bytes|num_slots",
                                                 r"^Communicator\(\)$"),))),
    # close() with a peer that never closes / died
    Case("close_peer_sleeps", 2, default=CLOSE_DEFAULT, handled=CLOSE_HANDLED),
    Case("close_peer_exits_nocleanup", 2, script_case="close_peer_exits", cleanup=False,
         default=CLOSE_DEFAULT, handled=CLOSE_HANDLED),
    # Communicator.abort() on one rank: the others leave within ~1 s naming it
    Case("abort", 2, **_both("nonzero", "zero",
                             records=(((0,), (ABORTED,), r"\brank 1\b", r"^alltoall$"),)),
         max_after_abort_s=1.5),
    # low-latency mode on the same call protocol: a dispatch rejected on rank 1 only is told to the peers, the
    # next calls are right; a KeyboardInterrupt inside rank 1's dispatch releases the peers within 1 s
    Case("ll_reject", 2, **_both("zero", "zero",
                                 records=(((1,), ("ValueError",), r"num_max_dispatch_tokens_per_rank",
                                           r"^low_latency_dispatch$"),
                                          ((0,), (REJECTED,), r"low_latency_dispatch.*rank 1",
                                           r"^low_latency_dispatch$")))),
    Case("ll_interrupt", 2, **_both("nonzero", "zero",
                                    records=(((0,), (ABORTED,), r"low_latency_dispatch.*\brank 1\b",
                                              r"^low_latency_dispatch$"),)),
         max_after_abort_s=1.0, fault_line="KeyboardInterrupt inside low_latency_dispatch",
         left_during="low_latency_dispatch"),
]
CASES_BY_NAME = {c.name: c for c in CASES}


def _params():
    out = []
    for c in CASES:
        for mode in ("default", "handled"):
            marks = []
            reason = c.xfail or (c.xfail_default if mode == "default" else c.xfail_handled)
            if reason:
                marks.append(pytest.mark.xfail(strict=False, reason=reason))
            out.append(pytest.param(c.name, mode, id=f"{c.name}-{mode}", marks=marks))
    return out


def _explain(run: Run) -> str:
    tail = "\n".join(run.out.splitlines()[-40:])
    return (f"rc={run.rc} killed={run.killed} wall={run.wall_s:.1f}s end_after_fault={run.end_after_fault_s} "
            f"leftovers={run.leftovers}\n--- output (last 40 lines) ---\n{tail}")


@pytest.mark.parametrize("name,mode", _params())
def test_fault(name, mode):
    case = CASES_BY_NAME[name]
    if not case.cleanup and KIND != "hydra":
        pytest.skip("needs MPICH hydra's -disable-auto-cleanup")
    exp: Expect = getattr(case, mode)
    run = launch(case.script, case.n, handled=(mode == "handled"), cleanup=case.cleanup)
    if "CASE SKIPPED" in run.out and run.rc == 0:
        pytest.skip(re.search(r"CASE SKIPPED: ([^\[]*)", run.out)[1].strip())
    why = _explain(run)
    assert not run.killed, f"job did not end within {LIMIT_S:g} s (killed)\n{why}"
    assert not run.leftovers, f"processes left behind\n{why}"
    assert "WRONG DATA" not in run.out, f"a rank received wrong data silently\n{why}"
    assert "NO ERROR" not in run.out, f"a call returned although ranks disagree\n{why}"
    assert "NOT A REJECTION" not in run.out, f"a rejected call was not reported as a rejection\n{why}"
    assert run.end_after_fault_s is not None, f"no FAULT line: the case did not get to its fault\n{why}"
    assert run.end_after_fault_s <= END_BOUND_S, \
        f"job ended {run.end_after_fault_s:.1f} s after the fault (bound {END_BOUND_S:g} s)\n{why}"
    if exp.rc == "zero":
        assert run.rc == 0, f"expected exit status 0\n{why}"
    elif exp.rc == "nonzero":
        assert run.rc != 0, f"expected a nonzero exit status\n{why}"
    recs = run.records()
    # calls made before the fault ("warm-up") and valid calls after a rejection ("valid ...") must succeed
    bad = [x for x in recs if x["during"].startswith(("warm-up", "valid"))]
    assert not bad, f"a valid call failed: {[(x['rank'], x['during'], x['cls'], x['msg'][:160]) for x in bad]}\n{why}"
    if exp.no_records:
        assert not recs, f"no exception expected\n{why}"
    for ranks, classes, msg_re, during_re in exp.records:
        # By default the first rank to fail ends the job (MPI.Abort), which may kill the others before their lines
        # reach the launcher: there one of the ranks must show it; handled, every listed rank must.
        need = 1 if mode == "default" else len(ranks)
        found, seen = 0, []
        for r in ranks:
            hits = [x for x in recs if x["rank"] == r and re.search(during_re, x["during"])]
            seen += [(r, x["cls"], x["msg"][:160]) for x in hits]
            if any(x["isa"] & set(classes) and re.search(msg_re, x["msg"], re.I) for x in hits):
                found += 1
            elif mode != "default":
                assert hits, f"rank {r} printed no CAUGHT/RAISING record during /{during_re}/\n{why}"
        assert found >= need, (f"ranks {ranks}: expected one of {classes} matching /{msg_re}/ during /{during_re}/ "
                               f"on {need} of them, got {seen}\n{why}")
    for rx in exp.output:
        assert re.search(rx, run.out), f"output lacks /{rx}/\n{why}"
    if case.max_after_fault_s is not None and exp.records:
        fault_t = [float(t) for t in re.findall(r"FAULT t=([0-9.]+) rank 1:", run.out)]
        left = [x["t"] for x in recs if x["rank"] != 1 and any(re.search(p[3], x["during"]) for p in exp.records)]
        assert fault_t and left, f"no fault / leave times\n{why}"
        assert max(left) - fault_t[0] <= case.max_after_fault_s, \
            f"peers raised {max(left) - fault_t[0]:.2f} s after rank 1's fault (bound {case.max_after_fault_s} s)\n{why}"
    if case.max_after_abort_s is not None:
        aborted = [float(t) for t in re.findall(r"FAULT t=([0-9.]+) rank 1: " + re.escape(case.fault_line),
                                                run.out)]
        left = [x["t"] for x in recs if x["rank"] != 1 and x["during"] == case.left_during]
        assert aborted and left, f"no fault / leave times\n{why}"
        assert max(left) - aborted[0] <= case.max_after_abort_s, \
            f"peers left {max(left) - aborted[0]:.2f} s after the fault ({case.fault_line}; bound " \
            f"{case.max_after_abort_s} s)\n{why}"


# ---- the short soak (examples/soak.py) --------------------------------------------------------------------------

def _example(n: int, script: str, *args: str, timeout_s: float = 120) -> str:
    """``examples/<script>`` as a job of ``n`` ranks; its output (a job that fails or hangs fails the test)."""
    if not LAUNCHER:
        pytest.skip("no mpiexec found (set MPIEXEC)")
    env = clean_env()
    env.setdefault("CUPY_SYMBUF_TIMEOUT_S", "20")
    rc, out, killed = run_job(mpi_command(n, [sys.executable, os.path.join(ROOT, "examples", script), *args]), env,
                              timeout_s)
    if killed:
        pytest.fail(f"{script} did not end within {timeout_s:g} s\n{out[-4000:]}")
    assert rc == 0, out[-4000:]
    return out


def test_soak_short():
    """The soak script, short: 200 mixed iterations on 2 ranks (host path), sampled bitwise checks."""
    out = _example(2, "soak.py", "--iters", "200", "--backend", BACKEND, "--check-every", "4")
    m = re.search(r"soak: (\d+) iterations, (\d+) checked, (\d+) mismatches", out)
    assert m, out[-4000:]
    assert int(m[1]) == 200 and int(m[2]) > 0 and int(m[3]) == 0, m[0]


def test_symmetric_example():
    """examples/symmetric_alltoall.py on 2 ranks (host path): correct, and says so."""
    out = _example(2, "symmetric_alltoall.py", "--mib", "1", "--iters", "3", "--backend", BACKEND)
    assert "correct" in out, out[-4000:]
