"""The device script's bench summariser (``tests/device/bench_compare.py``) on saved bench output: the host logs are
real runs of ``python -m cupy_symbuf.bench --backend host`` at 2 ranks, the gpu ones follow the bench's GPU format
(skip notes, the copy row, the low-latency and energy tables). Pure Python, no MPI traffic."""
import importlib.util
import os
import pathlib
import shutil
import tempfile

import pytest

HERE = os.path.dirname(__file__)
SAMPLES = os.path.join(HERE, "device", "samples")
_spec = importlib.util.spec_from_file_location("bench_compare", os.path.join(HERE, "device", "bench_compare.py"))
bench_compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_compare)


def _rows(name):
    with open(os.path.join(SAMPLES, name)) as f:
        return bench_compare.parse(f.read())


def test_parse_alltoall_tables():
    host = _rows("host_alltoall.log")
    assert len(host) == 18
    assert host["64 KiB ours call"]["time_us"] == 313.9
    assert host["1 MiB ours-sym loop"]["vs_peer"] == 0.75 and host["1 MiB copy loop"]["copy_share"] == 100.0
    gpu = _rows("gpu_alltoall.log")
    assert set(gpu) == {f"{s} {e} {t}" for s in ("64 KiB", "128 MiB") for e, t in
                        [("ours", "call"), ("ours-sym", "call"), ("ours", "loop"), ("ours-sym", "loop"),
                         ("copy", "loop")]}
    assert "vs_peer" not in gpu["128 MiB ours-sym loop"]  # '-' is no number
    assert gpu["128 MiB ours-sym loop"]["time_us"] == 389.9


def test_parse_moe_alltoallv_control():
    moe = _rows("host_dispatch.log")
    assert moe["32 ll-combine"]["p50_us"] == 6948.3 and moe["64 dispatch-cached-sym"]["loop_us"] == 478.0
    gpu = _rows("gpu_dispatch.log")
    assert gpu["128 ll-dispatch"] == {"p50_us": 24.6, "p99_us": 28.1, "loop_us": 22.9, "nvl_GB/s": 35.39,
                                      "deepep_GB/s": 70.78}
    assert gpu["4096 dispatch"]["J/GB"] == 1.234 and gpu["4096 dispatch"]["p50_us"] == 512.3  # two tables merged
    assert "J/GB" not in gpu["4096 dispatch-cached"]
    a2av = _rows("host_alltoallv.log")
    assert len(a2av) == 6 and a2av["64 KiB zipf ours"]["p99_us"] == 480.4
    control = _rows("host_control.log")
    assert len(control) == 11
    assert control["alltoall 64 KiB, host time to issue one call"] == {"us": 68.7}


def test_compare_medians_ratio_and_flags(capsys):
    # its own folder per rank (pytest's tmp_path would have every rank of an mpiexec run clean one shared base)
    with tempfile.TemporaryDirectory() as d:
        _check_summary(pathlib.Path(d), capsys)


def _check_summary(tmp_path, capsys):
    with open(os.path.join(SAMPLES, "gpu_dispatch.log")) as f:
        text = f.read()
    for run in (1, 2, 3):
        (tmp_path / f"cmp_dispatch_old_{run}.log").write_text(text)
        # the new tree: ll-dispatch 10% slower in runs 1 and 2 (the median), 50% faster in run 3; dispatch 2% slower
        new = text.replace("24.6       28.1", ("27.1" if run < 3 else "12.3") + "       28.1")
        new = new.replace("512.3", "522.5")
        (tmp_path / f"cmp_dispatch_new_{run}.log").write_text(new)
    # a fourth new run that has one row the old tree lacks and none of the others
    (tmp_path / "cmp_dispatch_new_4.log").write_text(" tokens op p50_us p99_us loop_us\n 128 ll-extra 1.0 1.0 1.0\n")
    shutil.copy(os.path.join(SAMPLES, "host_control.log"), tmp_path / "cmp_control_old_1.log")
    shutil.copy(os.path.join(SAMPLES, "host_control.log"), tmp_path / "cmp_control_new_1.log")
    (tmp_path / "unrelated.log").write_text("garbage\n")
    out = tmp_path / "summary.txt"
    assert bench_compare.main([str(tmp_path), "--out", str(out)]) == 0
    text_out = capsys.readouterr().out
    assert out.read_text().strip() == text_out.strip()
    lines = {tuple(line.split()[:3]): line for line in text_out.splitlines()}
    ll = lines[("128", "ll-dispatch", "p50_us")]
    assert "27.1" in ll and "1.102" in ll and "3/3 * slower" in ll
    d = lines[("4096", "dispatch", "p50_us")]
    assert "1.020" in d and "*" not in d
    assert "0/1 (only in the new tree)" in lines[("128", "ll-extra", "p50_us")]
    assert "J/GB" not in text_out  # only time columns are compared
    assert "## control" in text_out and "# control: 11 values, 0 off by more than 5%" in text_out
    assert bench_compare.main([str(tmp_path), "--brief", "--out", str(out)]) == 0
    brief = capsys.readouterr().out
    assert "ll-dispatch" in brief and "ll-extra" in brief and "4096 dispatch " not in brief
    assert "4096 dispatch " in out.read_text()  # the file keeps every row


def test_compare_explicit_files_and_bad_arguments(capsys):
    a = os.path.join(SAMPLES, "host_alltoall.log")
    assert bench_compare.main(["--old", a, "--new", a, "--threshold", "0.01"]) == 0
    assert "18 values, 0 off by more than 1%" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_compare.main(["--old", a])
    with pytest.raises(SystemExit):
        bench_compare.main([SAMPLES])  # no cmp_* logs there
