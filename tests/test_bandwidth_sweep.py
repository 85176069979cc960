"""The compression sweep's table (dgpipe/train/sweep.py) from synthetic run logs, its argument
handling (nothing is spawned), and the ideal model of benchmarks/slow_link_speedup.py."""

import json
import math
import sys
from pathlib import Path

import pytest
from helpers import ROOT, load_benchmark, load_cli

from dgpipe.train.runlog import boundary_record, epoch_record, summary_record
from dgpipe.train.codecs import SETTINGS
from dgpipe.train.sweep import add_sweep_flags, format_table, prepare_runs, table_rows
from dgpipe.train.vision import VisionJob


def _log(samples_per_s: float, epochs: list[list[tuple]]) -> list[dict]:
    """Records of a run: one epoch record per list of (name, direction, raw, wire, recv s), then a summary."""
    recs = [epoch_record(i + 1, 1.0, {"val_acc": 0.5}, 999.0,
                         [boundary_record(n, d, raw, wire, wire, secs) for n, d, raw, wire, secs in bounds])
            for i, bounds in enumerate(epochs)]
    recs.append(summary_record("val_acc", 0.5, samples_per_s, 0, 0, 1.0, {}))
    return recs


A, B = "stage0->stage1", "stage1->stage2"
RECORDS = {
    "none": _log(40.0, [[(A, "forward", 1000, 1010, 0.5), (A, "backward", 1000, 1010, 0.25),
                         (A, "eval", 500, 505, 9.0)],
                        [(A, "forward", 1000, 1010, 1.5), (A, "backward", 1000, 1010, 0.75)]]),
    "sortquant8": _log(120.0, [[(B, "forward", 400, 100, 0.0), (A, "forward", 2000, 510, 0.5)]]),
}


def test_rows_sum_epochs_per_boundary_and_leave_out_eval():
    rows = table_rows(RECORDS)
    assert [(r["setting"], r["boundary"], r["direction"]) for r in rows] == [
        ("none", A, "backward"), ("none", A, "forward"), ("sortquant8", A, "forward"), ("sortquant8", B, "forward")]
    fwd = rows[1]
    assert (fwd["raw_bytes"], fwd["wire_bytes"], fwd["recv_bytes"]) == (2000, 2020, 2020)
    assert fwd["recv_seconds"] == pytest.approx(2.0)
    assert fwd["ratio"] == pytest.approx(1.01)
    assert fwd["recv_bytes_per_s"] == pytest.approx(1010.0)
    assert fwd["samples_per_s"] == 40.0  # the summary's, not an epoch's
    assert rows[3]["recv_bytes_per_s"] is None  # no receive time measured
    assert rows[2]["ratio"] == pytest.approx(0.255)


def test_rows_per_setting_total_all_boundaries():
    rows = table_rows(RECORDS, per_boundary=False)
    assert [(r["setting"], r["boundary"], r["direction"]) for r in rows] == [("none", "all", "all"),
                                                                              ("sortquant8", "all", "all")]
    assert (rows[0]["raw_bytes"], rows[0]["wire_bytes"]) == (4000, 4040)
    assert rows[0]["recv_bytes_per_s"] == pytest.approx(4040 / 3.0)
    assert (rows[1]["raw_bytes"], rows[1]["wire_bytes"], rows[1]["ratio"]) == (2400, 610, pytest.approx(610 / 2400))
    assert rows[1]["samples_per_s"] == 120.0


def test_unfinished_run_is_an_error():
    with pytest.raises(ValueError, match="sortquant8.*no summary"):
        table_rows({"sortquant8": RECORDS["sortquant8"][:-1]})


def test_format_table_shows_exact_bytes_and_dashes():
    lines = format_table(table_rows(RECORDS)).splitlines()
    assert lines[0].split() == ["setting", "boundary", "direction", "raw", "bytes", "wire", "bytes", "wire/raw",
                                "recv", "s", "recv", "MB/s", "samples/s"]
    assert lines[2].split() == ["none", A, "forward", "2000", "2020", "1.0100", "2.000", "0.001", "40.0"]
    assert lines[4].split() == ["sortquant8", B, "forward", "400", "100", "0.2500", "0.000", "-", "120.0"]
    assert len(lines) == 5 and len({len(line) for line in lines}) == 1  # fixed width


@pytest.fixture()
def vision_parser(tmp_path, no_torchrun):
    """The vision CLI's parser with the sweep flags, and a CIFAR-10-shaped folder (20 train images)."""
    from PIL import Image

    for split, count in (("train", 2), ("test", 1)):
        for c in range(10):
            (tmp_path / split / f"c{c}").mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (32, 32), (c * 20, i * 50, 0)).save(tmp_path / split / f"c{c}" / f"{i}.png")
    cli = load_cli("test_vision_dgpipe")
    return add_sweep_flags(cli.build_parser(), steps=2), tmp_path


def test_prepare_runs_one_codec_and_log_per_setting(vision_parser):
    parser, data = vision_parser
    argv = ["--data-dir", str(data), "--batch-size", "4", "--chunk", "2", "--settings", "sortquant8,none"]
    base, runs = prepare_runs(parser, VisionJob, argv, data / "logs")
    assert [label for label, _ in runs] == ["sortquant8", "none"]
    for label, config in runs:
        assert config.codec.compression == SETTINGS[label]
        assert Path(config.log.log) == data / "logs" / f"{label}.jsonl"
        assert (config.train.max_steps, config.data.train_subset, config.data.eval_subset,
                config.pipeline.chunk) == (2, 8, 4, 2)
        assert not config.log.bandwidth and not config.log.progress
    assert runs[0][1].codec.compression.forward.options == {"quant_bits": 6, "split_bits": 2}


@pytest.mark.parametrize("extra, message", [
    (["--sortquant", "--quant", "6", "--split", "2"], "--sortquant, --quant, --split: the sweep sets"),
    (["--log", "x.jsonl"], "--log: the sweep sets"),
    (["--mode", "dataparallel"], "drop --mode dataparallel"),
    (["--settings", "none,bogus"], "give distinct labels"),
    (["--chunk", "3"], "not divisible by --chunk 3"),
])
def test_prepare_runs_rejects_flags_before_any_process(vision_parser, extra, message, capsys):
    parser, data = vision_parser
    with pytest.raises(SystemExit) as exc:
        prepare_runs(parser, VisionJob, ["--data-dir", str(data), "--batch-size", "4", *extra], data / "logs")
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# -- the ideal model of benchmarks/slow_link_speedup.py -------------------------------------

SPEEDUP = load_benchmark("slow_link_speedup")


def _flow_shop(times: list[float], jobs: int) -> float:
    """Makespan of identical jobs through machines in order (unlimited buffers), by recurrence."""
    done = [0.0] * len(times)
    for _ in range(jobs):
        for i, t in enumerate(times):
            done[i] = max(done[i], done[i - 1] if i else 0.0) + t
    return done[-1]


@pytest.mark.parametrize("times", [[0.0, 3.0, 1.0, 2.0, 0.5], [0.0, 0.1, 0.2, 0.1, 0.3], [0.0, 1.0, 5.0, 1.0, 0.0]])
@pytest.mark.parametrize("micro", [1, 4, 7])
def test_phase_formula_is_the_flow_shop_makespan(times, micro):
    # with the first client task free, the client's CPU is no shared resource: a plain flow shop
    assert SPEEDUP.phase_seconds(*times, micro) == pytest.approx(_flow_shop(times, micro))


def test_ideal_speedup_is_the_byte_ratio_on_a_link_bound_run():
    comp = dict.fromkeys(SPEEDUP.PIECES, 0.0)
    keys = (SPEEDUP.UP_FWD, SPEEDUP.DOWN_FWD, SPEEDUP.UP_BWD, SPEEDUP.DOWN_BWD)
    raw = dict(zip(keys, (4000.0, 1000.0, 1000.0, 4000.0)))
    eighth = {k: v / 8 for k, v in raw.items()}
    t_raw = SPEEDUP.predict_step_seconds(comp, raw, 0.0, 1000.0, 4)
    assert t_raw == pytest.approx(2 * (4 + 1 + 3 * 4))  # per phase: both transfers once, then 3 more big ones
    assert t_raw / SPEEDUP.predict_step_seconds(comp, eighth, 0.0, 1000.0, 4) == pytest.approx(8.0)
    assert SPEEDUP.predict_step_seconds(dict(comp, s=1.0, sb=2.0), raw, 0.0, math.inf, 4) == pytest.approx(12.0)


# -- benchmarks/ddp_slow_link.py: the epoch-2 measurement and its table -----------------------

DDP = load_benchmark("ddp_slow_link")


def _ddp_log(path: Path, epoch2_samples_per_s: float, wire_per_step: int, steps: int = 5) -> Path:
    """A DDP run log: epoch 1 (warm-up, different numbers) and epoch 2, wire bytes summed over 2 ranks."""
    recs = [epoch_record(e, 1.0, {"val_acc": 0.1}, s, [boundary_record("ddp", "allgather", 8 * w, w, w, 0.1)],
                         steps=steps)
            for e, s, w in ((1, 1.0, 999_999), (2, epoch2_samples_per_s, wire_per_step * steps * 2))]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_ddp_slow_link_reads_epoch_two_per_step_per_rank(tmp_path):
    got = DDP.measured_epoch(_ddp_log(tmp_path / "a.jsonl", 40.0, 3_000_000))
    assert got == {"samples_per_s": 40.0, "wire_mb": pytest.approx(3.0)}
    (tmp_path / "b.jsonl").write_text(json.dumps(epoch_record(1, 1.0, {}, 5.0, [])) + "\n")
    with pytest.raises(ValueError, match="no epoch-2 record; see .*b.out"):
        DDP.measured_epoch(tmp_path / "b.jsonl")


def test_ddp_slow_link_table_speedup_is_the_median_of_per_round_ratios():
    def entry(slow, free, wire=1.0):
        return {"slow": {"samples_per_s": slow, "wire_mb": wire}, "free": {"samples_per_s": free, "wire_mb": wire}}

    results = {"ddp_none": [entry(10, 100), entry(20, 100), entry(30, 100)],
               "ddp_fp16": [entry(40, 80, 0.5), entry(20, 80, 0.5), entry(90, 80, 0.5)]}
    rows = DDP.table(results, ["ddp_none", "ddp_fp16"], "8mbit").splitlines()
    assert rows[2] == "| ddp_none | 1.000 | 20.0 | 1.00x | 100.0 | 0.20 |"
    # per-round ratios 4, 1, 3 -> median 3 (not 40/20 = 2, the ratio of the medians)
    assert rows[3] == "| ddp_fp16 | 0.500 | 40.0 | 3.00x | 80.0 | 0.50 |"


def test_ddp_slow_link_runs_the_main_job_with_the_ablation_flags(tmp_path):
    import argparse

    args = argparse.Namespace(data_dir="D", batch_size=32, steps=3)
    cmd = DDP.job_command("ddp_topk_ef", args, ["--world-size", "2"], tmp_path / "x.jsonl")
    assert cmd[1] == str(ROOT / "test_vision_dgpipe.py")
    joined = " ".join(cmd)
    assert " ".join(DDP.DDP_SETTINGS["ddp_topk_ef"]) in joined
    assert "--train-subset 96 " in joined and "--epochs 2 " in joined and joined.endswith("x.jsonl --no-progress")


RUNS = load_benchmark("slow_link_runs")


def test_slow_link_run_stops_the_whole_process_group_at_its_timeout(tmp_path):
    import time

    pid_file = tmp_path / "child.pid"
    parent = ("import subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    start = time.monotonic()
    assert RUNS.run([sys.executable, "-c", parent], tmp_path / "out.txt", 2.0) == 124
    assert time.monotonic() - start < 20
    child = int(pid_file.read_text())
    stat = Path(f"/proc/{child}/stat")
    for _ in range(50):  # the grandchild (a "rank") got the signal too: gone, or a zombie
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the child process outlived the timeout")
    assert RUNS.run([sys.executable, "-c", "print('hi')"], tmp_path / "ok.txt", 30.0) == 0
    assert (tmp_path / "ok.txt").read_text() == "hi\n"


def test_slow_link_rounds_reuse_finished_logs_and_keep_complete_rounds_only(tmp_path):
    """A finished log is measured, not run again; an unfinished one is deleted and run; a run that leaves no
    measurement is reported and its round left out of the results."""
    def measure(log: Path) -> dict:
        if not log.exists() or log.read_text() != "done":
            raise ValueError(f"{log.name}: unfinished")
        return {"log": log.name}

    (tmp_path / "a_free_r0.jsonl").write_text("done")  # finished earlier: reused
    (tmp_path / "a_slow_r0.jsonl").write_text("half")  # cut short earlier: run again
    ran = []

    def command(label: str, place: str, log: Path) -> list[str]:
        ran.append(log.name)
        text = "half" if (label, place) == ("b", "slow") else "done"  # this run fails every time
        return [sys.executable, "-c", f"open({str(log)!r}, 'w').write({text!r})"]

    results, failed = RUNS.run_rounds(tmp_path, ["a", "b"], 2, ["slow", "free"], command, measure,
                                      lambda m: m["log"], 30.0)
    assert ran == ["a_slow_r0.jsonl", "b_slow_r0.jsonl", "b_free_r0.jsonl",
                   "a_slow_r1.jsonl", "a_free_r1.jsonl", "b_slow_r1.jsonl", "b_free_r1.jsonl"]
    assert results == {"a": [{"slow": {"log": "a_slow_r0.jsonl"}, "free": {"log": "a_free_r0.jsonl"}},
                             {"slow": {"log": "a_slow_r1.jsonl"}, "free": {"log": "a_free_r1.jsonl"}}],
                       "b": []}
    assert failed == ["b_slow_r0.jsonl: unfinished (exit 0)", "b_slow_r1.jsonl: unfinished (exit 0)"]


@pytest.mark.parametrize("argv, message", [([], "got none"), (["bogus", "--max-steps", "2"], "got 'bogus'")])
def test_sweep_entry_point_needs_a_job(argv, message, capsys):
    """``dgpipe-sweep`` (and both bandwidth scripts) take the job first; none or an unknown one is a one-line
    error and exit status 2, before any process starts."""
    from dgpipe.cli.sweep import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: the first argument names the job (vision or nlp)" in err and message in err


def test_sweep_entry_point_hands_the_job_its_flags(vision_parser, capsys):
    """The job's own flags reach its parser: a bad setting list fails there, before any process starts."""
    from dgpipe.cli.sweep import main

    _, data = vision_parser
    with pytest.raises(SystemExit) as exc:
        main(["vision", "--data-dir", str(data), "--batch-size", "4", "--settings", "none,bogus"])
    assert exc.value.code == 2 and "dgpipe-sweep vision" in capsys.readouterr().err


# -- benchmarks/nlp_slow_link.py: the last epoch's bytes per link direction, the ideal epoch --------------------

NLP_LINK = load_benchmark("nlp_slow_link")


def test_nlp_slow_link_sums_each_link_direction_of_the_last_epoch(tmp_path):
    def b(name, direction, wire, frame):
        return {**boundary_record(name, direction, 10 * wire, wire, wire, 0.1), "frame_bytes": frame}

    last = [b("stage0->stage1", "forward", 1000, 10), b("stage1->stage2", "backward", 200, 2),  # client sends
            b("stage1->stage2", "forward", 3000, 30), b("stage0->stage1", "backward", 400, 4),  # server sends
            b("stage0->stage1", "eval", 99_999, 0)]  # evaluation: not training traffic
    recs = [epoch_record(1, 1.0, {}, 1.0, [b("stage0->stage1", "forward", 7, 0)]), epoch_record(2, 1.0, {}, 8.0, last)]
    log = tmp_path / "a.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert NLP_LINK.last_epoch(log, 2, 256) == {"seconds": 32.0, "up": 1212, "down": 3434}
    with pytest.raises(ValueError, match="no epoch-3 record; see .*a.out"):
        NLP_LINK.last_epoch(log, 3, 256)


def test_nlp_slow_link_ideal_is_the_larger_of_compute_and_the_busier_direction():
    def entry(free, slow, up, down):
        return {"free": {"seconds": free}, "10mbit": {"seconds": slow, "up": up, "down": down}}

    results = {"none": [entry(20.0, 60.0, 50e6, 40e6)], "codebook4": [entry(22.0, 30.0, 6e6, 7e6)]}
    rows = NLP_LINK.table(results, ["none", "codebook4"], ["10mbit"]).splitlines()
    # link 8 * 50e6 / 1e7 = 40 s > 20 s of compute: ideal 40, serial 60, measured 60 -> 0.67 of ideal
    assert rows[2] == "| none | 50.00 / 40.00 | 20.0 | 10mbit | 60.0 | 40.0 | 40.0 | 60.0 | 0.67 | 1.00x |"
    # link 5.6 s < 22 s of compute: ideal 22, serial 27.6
    assert rows[3] == "| codebook4 | 6.00 / 7.00 | 22.0 | 10mbit | 30.0 | 5.6 | 22.0 | 27.6 | 0.73 | 2.00x |"
