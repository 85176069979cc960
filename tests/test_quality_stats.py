"""The quality benchmark's statistics (dgpipe.experiments.ablation, run as benchmarks/ablation.py): paired differences with a
Student-t interval, bits per value of each direction (dgpipe.train.runlog), and the multi-seed table, on
synthetic logs whose numbers are computed here by hand."""

from __future__ import annotations

import json
import math
import sys

import pytest

from dgpipe.experiments import ablation
from dgpipe.train.runlog import direction_bits, read_records


def test_paired_difference_and_interval_by_hand():
    values, base = [0.80, 0.83, 0.79], [0.81, 0.82, 0.82]
    d = [-0.01, 0.01, -0.03]
    mean = sum(d) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    half = 4.3026527297 * sd / math.sqrt(3)  # t(0.975, 2), from a t table
    got = ablation.paired(values, base)
    assert got == pytest.approx((mean, mean - half, mean + half), abs=1e-10)
    one = ablation.paired([0.5], [0.25])
    assert one[0] == 0.25 and math.isnan(one[1]) and math.isnan(one[2])
    with pytest.raises(ValueError, match="equally many"):
        ablation.paired([0.1, 0.2], [0.1])
    with pytest.raises(ValueError, match="equally many"):
        ablation.paired([], [])


def _log(path, fwd_wire, bwd_wire, bwd_raw, acc, heldout):
    boundaries = [
        {"name": "stage0->stage1", "direction": "forward", "raw_bytes": bwd_raw + 64, "wire_bytes": fwd_wire},
        {"name": "stage0->stage1", "direction": "backward", "raw_bytes": bwd_raw, "wire_bytes": bwd_wire},
    ]
    records = [
        {"event": "epoch", "epoch": 1, "boundaries": boundaries},
        {"event": "summary", "metric": "val_acc", "value": acc, "raw_bytes": 2 * bwd_raw + 64,
         "wire_bytes": fwd_wire + bwd_wire, "samples_per_s": 1.0, "wall_seconds": 1.0,
         "metrics": {"val_acc": acc, "heldout_acc": heldout}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_direction_bits_counts_values_from_the_float32_gradients(tmp_path):
    _log(tmp_path / "x.jsonl", fwd_wire=520, bwd_wire=1000, bwd_raw=4000, acc=0.5, heldout=0.5)
    bits = direction_bits(read_records(tmp_path / "x.jsonl"))
    assert bits == {"forward": 8 * 520 / 1000, "backward": 8.0}  # 1000 values


def test_seeds_table_pairs_each_seed_with_its_own_baseline(tmp_path):
    heldout = {"none": [0.84, 0.85, 0.83], "q": [0.83, 0.85, 0.81]}
    for label, fwd in (("none", 4000), ("q", 500)):
        for k in range(3):
            _log(tmp_path / f"{label}_seed{k}.jsonl", fwd, 500, 4000, 0.8, heldout[label][k])
    _log(tmp_path / "q_seed3.jsonl", 500, 500, 4000, 0.8, 0.10)  # no baseline for seed 3: left out of the pairs
    metrics, rows = ablation.seeds_results(tmp_path, ["none", "q"], [0, 1, 2, 3])
    assert metrics == ["heldout_acc", "val_acc"]
    none, q = rows
    assert none["delta"]["heldout_acc"] is None and none["forward"] == 32.0
    assert q["seeds"] == 3 and q["forward"] == 4.0 and q["backward"] == 4.0
    assert q["delta"]["heldout_acc"] == pytest.approx(ablation.paired(heldout["q"], heldout["none"]))
    assert q["delta"]["val_acc"][0] == pytest.approx(0.0)
    table = ablation.seeds_table(tmp_path, ["none", "q"], [0, 1, 2, 3]).splitlines()
    d, lo, hi = (100 * v for v in ablation.paired(heldout["q"], heldout["none"]))
    assert table[3].startswith("| q | 3 | 4.00 | 4.00 | ")
    assert f"{d:+.2f} [{lo:+.2f}, {hi:+.2f}]" in table[3]
    assert ablation.seeds_plot(tmp_path, ["none", "q"], [0, 1, 2]).is_file()


def test_no_run_tabulates_the_logs_present_and_runs_nothing(tmp_path, monkeypatch, capsys):
    """``--no-run`` starts no process: it tables the finished logs and exits 1 while some are missing."""
    monkeypatch.setattr(ablation, "run_setting", lambda *a: pytest.fail("--no-run started a run"))
    for k in range(2):
        _log(tmp_path / f"none_seed{k}.jsonl", 4000, 500, 4000, 0.8, 0.84)
        _log(tmp_path / f"quant4_seed{k}.jsonl", 500, 500, 4000, 0.8, 0.80)
    argv = ["--job", "nlp", "--settings", "lowbit", "--only", "none,quant4", "--out", str(tmp_path), "--no-run"]
    assert ablation.main(argv + ["--seeds", "0,1"]) == 0
    assert "| quant4 | 2 | 4.00 | 4.00 | " in capsys.readouterr().out
    assert ablation.main(argv + ["--seeds", "0,1,2"]) == 1  # seed 2 has no logs: not complete, still tabled
    assert "| quant4 | 2 | " in (tmp_path / "table.md").read_text()


def test_stopping_the_runner_ends_the_run_in_progress_and_starts_no_other(tmp_path):
    """SIGTERM to the runner ends the CLI it started (and what that CLI started: the run has its
    own process group) instead of leaving it running, and the next setting never starts."""
    import os
    import signal
    import subprocess
    import textwrap
    import time

    sleeper = tmp_path / "sleeper.py"  # stands in for a job's CLI: a child of its own, then sleeps
    sleeper.write_text(textwrap.dedent("""
        import subprocess, sys, time
        from pathlib import Path
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        log = Path(sys.argv[sys.argv.index("--log") + 1])
        log.with_suffix(".pid").write_text(f"{child.pid}")
        time.sleep(120)
    """))
    driver = textwrap.dedent(f"""
        import sys
        from dgpipe.experiments import ablation
        ablation.CLIS["nlp"] = [{str(sleeper)!r}]
        sys.exit(ablation.main(["--job", "nlp", "--settings", "lowbit", "--only", "none,codebook4",
                                "--out", {str(tmp_path)!r}]))
    """)
    runner = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pid_file = tmp_path / "none.pid"
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and runner.poll() is None, runner.stdout.read() if runner.poll() else ""
        time.sleep(0.1)
    grandchild = int(pid_file.read_text())
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=30) == 143
    deadline = time.monotonic() + 10
    while True:  # the run's own child is gone too (reaped by init once its parent was ended)
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "the run's child outlived the stopped runner"
        time.sleep(0.1)
    assert not (tmp_path / "codebook4.out").exists()  # the next setting never started
