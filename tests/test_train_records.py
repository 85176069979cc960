"""Run logs (JSON lines, readable summary), checkpoints, and the ablation plot script."""

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from dgpipe.train import checkpoint, runlog

ROOT = Path(__file__).resolve().parents[1]


def _load_script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _summary(path: Path, value: float, raw: int, wire: int, metric: str = "val_acc") -> None:
    with runlog.JsonlLog(path) as log:
        log.write(runlog.epoch_record(1, 2.0, {metric: value / 2}, 10.0, []))
        log.write(runlog.summary_record(metric, value, 11.0, raw, wire, 3.0, {"quant": 8}))


def test_boundary_record_rate_and_null_without_time():
    b = runlog.boundary_record("0->1", "forward", 4000, 1000, 1000, 0.5)
    assert list(b) == list(runlog.BOUNDARY_FIELDS)
    assert b["recv_bytes_per_s"] == 2000.0
    assert runlog.boundary_record("0->1", "backward", 1, 1, 0, 0.0)["recv_bytes_per_s"] is None


def test_jsonl_roundtrip_schema_and_append(tmp_path):
    path = tmp_path / "sub" / "run.jsonl"
    b = runlog.boundary_record("1->0", "backward", 800, 200, 200, 0.25)
    with runlog.JsonlLog(path) as log:
        log.write(runlog.epoch_record(1, 1.5, {"val_acc": 0.25}, 123.0, [b], steps=7))
        log.write(runlog.summary_record("val_acc", 0.25, 120.0, 800, 200, 9.5, {"lr": 0.1}, val_loss=float("nan")))
    records = runlog.read_records(path)
    assert [r["event"] for r in records] == ["epoch", "summary"]
    assert records[0] == {"event": "epoch", "epoch": 1, "train_loss": 1.5, "val_acc": 0.25, "samples_per_s": 123.0,
                          "boundaries": [b], "steps": 7}
    s = runlog.read_summary(path)
    assert (s["metric"], s["value"], s["raw_bytes"], s["wire_bytes"], s["args"]) == ("val_acc", 0.25, 800, 200,
                                                                                       {"lr": 0.1})
    assert s["val_loss"] is None  # NaN is not JSON: written as null
    with runlog.JsonlLog(path, append=True) as log:
        log.write({"event": "epoch", "epoch": 2})
    assert len(runlog.read_records(path)) == 3
    with runlog.JsonlLog(path) as log:  # a new run starts a new file
        pass
    assert runlog.read_records(path) == []


def test_read_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"event": "epoch"}\n\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: a record must be a JSON object"):
        runlog.read_records(path)
    path.write_text('{"event": "epoch"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        runlog.read_records(path)
    path.write_text('{"event": "epoch"}\n')
    with pytest.raises(ValueError, match="no summary record"):
        runlog.read_summary(path)


def test_readable_summary_and_table():
    s = runlog.summary_record("val_mcc", 0.125, 50.0, 4 << 20, 1 << 20, 12.0, {})
    text = runlog.format_summary(s)
    assert "val_mcc: 0.1250" in text and "wire/raw 0.2500 (x4.00 smaller)" in text
    assert "raw 4.0 MiB, wire 1.0 MiB" in text
    table = runlog.format_boundaries([runlog.boundary_record("0->1", "forward", 2048, 512, 512, 0.001)])
    header, row = table.splitlines()
    assert header.split()[:4] == ["boundary", "direction", "raw", "wire"]
    assert row.split() == ["0->1", "forward", "2.0", "KiB", "512", "B", "0.250", "512", "B", "0.001", "0.51"]


def test_checkpoint_roundtrip_and_errors(tmp_path):
    """Files written in the background, the newest two kept, the index checked; a truncated or
    corrupt rank file is refused by its SHA-256."""
    directory = tmp_path / "ckpt"
    state = {"stages": {"1": {"weight": torch.arange(6.0).view(2, 3)}}, "progress": {"step": 40},
             "optimizer": torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9).state_dict()}
    writer = checkpoint.Writer(directory, 1, keep=2)
    writer.save(40, state)
    state["stages"]["1"]["weight"] += 1  # training goes on: the checkpoint holds the values at save()
    writer.save(80, state, {"world_size": 2, "mode": "pipeline", "epoch": 2, "args": {"lr": 0.1}})
    writer.save(120, state)
    writer.wait()
    assert checkpoint.steps(directory) == [80, 120]  # the oldest deleted
    assert sorted(p.name for p in checkpoint.step_dir(directory, 80).iterdir()) == ["meta.json", "rank1.json",
                                                                                    "rank1.pt"]  # no temp files
    meta = checkpoint.latest_meta(directory)
    assert (meta["world_size"], meta["mode"], meta["epoch"], meta["step"]) == (2, "pipeline", 2, 80)
    loaded = checkpoint.load_rank(checkpoint.step_dir(directory, 80), 1)
    assert torch.equal(loaded["stages"]["1"]["weight"], torch.arange(6.0).view(2, 3) + 1)
    assert loaded["optimizer"]["param_groups"][0]["momentum"] == 0.9
    with pytest.raises(checkpoint.CorruptCheckpoint, match="rank 0 not found or incomplete"):
        checkpoint.load_rank(checkpoint.step_dir(directory, 80), 0)
    newest = checkpoint.step_dir(directory, 120) / "rank1.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[:-1])
    with pytest.raises(checkpoint.CorruptCheckpoint, match=rf"{len(data) - 1} bytes that do not match its record "
                       rf"\({len(data)} bytes, sha256 [0-9a-f]{{12}}\.\.\.\): truncated or corrupt"):
        checkpoint.load_rank(checkpoint.step_dir(directory, 120), 1)
    newest.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])  # one bit flipped
    with pytest.raises(checkpoint.CorruptCheckpoint, match="truncated or corrupt"):
        checkpoint.load_rank(checkpoint.step_dir(directory, 120), 1)
    checkpoint.discard_after(directory, 1, 80)
    assert not (checkpoint.step_dir(directory, 120) / "rank1.pt").exists()
    (checkpoint.step_dir(directory, 80) / "meta.json").write_text(json.dumps({"format": 2, "world_size": "2"}))
    with pytest.raises(ValueError, match="'world_size' missing or not int"):
        checkpoint.read_meta(checkpoint.step_dir(directory, 80))
    assert checkpoint.latest_meta(directory) is None
    with pytest.raises(ValueError, match="keep must be >= 1"):
        checkpoint.Writer(directory, 0, keep=0)


def test_checkpoint_config_difference():
    saved = {"lr": 0.1, "quant": 8, "log": "a.jsonl", "timeout": 300.0, "stages": None}
    assert checkpoint.config_difference(saved, saved | {"log": "b.jsonl", "timeout": 9.0}) is None
    assert checkpoint.config_difference(saved, saved | {"quant": 4, "stages": 3}) == "quant 8 -> 4, stages null -> 3"


def test_plot_ablation_points_and_png(tmp_path, capsys):
    plot = _load_script(ROOT / "benchmarks" / "plot_ablation.py")
    _summary(tmp_path / "none.jsonl", 0.50, 1000, 1010)
    _summary(tmp_path / "sq8.jsonl", 0.48, 1000, 260)
    points = plot.ablation_points([tmp_path / "none.jsonl", tmp_path / "sq8.jsonl"])
    assert [(p.label, p.wire_ratio, p.value) for p in points] == [("none", 1.01, 0.5), ("sq8", 0.26, 0.48)]
    out = tmp_path / "fig" / "ablation.png"
    assert plot.main([str(tmp_path / "none.jsonl"), str(tmp_path / "sq8.jsonl"), "--out", str(out),
                      "--labels", "fp32,8 bit"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "8 bit  wire/raw 0.2600  val_acc 0.4800" in printed and math.isclose(points[1].wire_ratio, 0.26)
    _summary(tmp_path / "cola.jsonl", 0.3, 1000, 500, metric="val_mcc")
    with pytest.raises(ValueError, match="different metrics"):
        plot.ablation_points([tmp_path / "sq8.jsonl", tmp_path / "cola.jsonl"])


def test_pruning_passes_over_a_step_folder_another_rank_removed(tmp_path, monkeypatch):
    """Every rank prunes its old steps at once: when another rank removes a step's folder between this
    rank's look at it and its listing, the write still succeeds (it raised FileNotFoundError once)."""
    writer = checkpoint.Writer(tmp_path, 1, keep=1)
    writer.save(10, {"x": torch.zeros(2)})
    writer.wait()
    real = Path.iterdir

    def other_rank_first(self):
        if self.name == "step-00000010":
            shutil.rmtree(self)  # rank 0 got there first
        return real(self)

    monkeypatch.setattr(Path, "iterdir", other_rank_first)
    writer.save(20, {"x": torch.ones(2)})
    writer.wait()  # raised the other rank's FileNotFoundError before
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000020"]
