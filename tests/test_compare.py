"""``--compare-to``: the same command under several settings, side by side; and the
one-class warning. The table's numbers are checked against values computed here from
the logs' fields; one end-to-end run compares two settings on 2 gloo processes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dgpipe.train import compare
from dgpipe.train.args import run_config
from dgpipe.train.codecs import SETTINGS
from dgpipe.train.loop import top_class
from dgpipe.train.runlog import format_summary, one_class_warning, read_records
from dgpipe.train.vision import VisionOptions
from helpers import ROOT, load_cli

RTE = ROOT.parent / "shared" / "data" / "glue" / "RTE"
pytestmark = pytest.mark.usefixtures("no_torchrun")



def _config(*argv: str):
    """The vision CLI's run config of ``argv`` (the shared checks only)."""
    return run_config(load_cli("test_vision_dgpipe").build_parser().parse_args(list(argv)), VisionOptions, environ={})

def _log(path: Path, value: float, fwd_wire: int, bwd_wire: int, bwd_raw: int, seconds: float, top) -> None:
    boundaries = [{"name": "stage0->stage1", "direction": "forward", "raw_bytes": bwd_raw + 8, "wire_bytes": fwd_wire},
                  {"name": "stage0->stage1", "direction": "backward", "raw_bytes": bwd_raw, "wire_bytes": bwd_wire},
                  {"name": "stage0->stage1", "direction": "eval", "raw_bytes": 999, "wire_bytes": 999}]
    records = [{"event": "epoch", "epoch": 1, "boundaries": boundaries},
               {"event": "summary", "metric": "val_acc", "value": value, "wire_bytes": fwd_wire + bwd_wire,
                "raw_bytes": 2 * bwd_raw + 8, "train_seconds": seconds, "top_class": top}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_rows_and_table_from_the_logs(tmp_path):
    _log(tmp_path / "a.jsonl", 0.80, 4_000_000, 4_000_000, 4_000_000, 10.0, [500, 872])
    _log(tmp_path / "b.jsonl", 0.79, 1_000_000, 500_000, 4_000_000, 11.0, [872, 872])
    runs = [("codebook4", _config("--log", str(tmp_path / "b.jsonl"))), ("none", _config("--log", str(tmp_path / "a.jsonl")))]
    rows = compare.rows(runs)
    assert [r["setting"] for r in rows] == ["none", "codebook4"]  # the uncompressed run first
    none, cb = rows
    assert none["delta"] is None and cb["delta"] == pytest.approx(-0.01)
    assert cb["forward_bits"] == pytest.approx(8 * 1_000_000 / 1_000_000)  # 10^6 float32 values
    assert cb["backward_bits"] == pytest.approx(4.0)
    wire_bits = 8 * 1_500_000 * 1514 / 1448  # with the TCP/IP and Ethernet headers of every 1,448 payload bytes
    assert cb["projected"]["100 Mbit/s"] == pytest.approx(11.0 + wire_bits / 100e6)
    assert cb["projected"]["10 Mbit/s"] == pytest.approx(11.0 + wire_bits / 10e6)
    table = compare.format_table(rows)
    lines = table.splitlines()
    assert lines[2].split()[:7] == ["none", "0.8000", "--", "32.00", "32.00", "8.0", "10.0"]
    assert lines[3].split()[:8] == ["codebook4", "0.7900", "(one", "class!)", "-1.00", "8.00", "4.00", "1.5"]
    se = 100 * math.sqrt(0.8 * 0.2 / 872)
    assert f"standard error of about {se:.1f} pt" in table and "projections" in table


def test_plan_names_a_log_per_setting(tmp_path):
    (tmp_path / "runs").mkdir()
    config = _config("--sortquant", "--quant", "6", "--split", "2", "--compare-to", "none,codebook4",
                     "--log", str(tmp_path / "runs" / "x.jsonl"))
    assert config.codec.compression == SETTINGS["sortquant8"]
    runs = compare.plan(config, tmp_path / "tmp")
    assert [(label, c.codec.compression, Path(c.log.log).name) for label, c in runs] == [
        ("sortquant8", SETTINGS["sortquant8"], "x.jsonl"), ("none", SETTINGS["none"], "x.none.jsonl"),
        ("codebook4", SETTINGS["codebook4"], "x.codebook4.jsonl")]
    config = config.replace(log={"log": None})
    assert [Path(c.log.log) for _, c in compare.plan(config, tmp_path)] == [
        tmp_path / "sortquant8.jsonl", tmp_path / "none.jsonl", tmp_path / "codebook4.jsonl"]
    config = config.replace(codec={"compare_to": ()})
    assert compare.plan(config, tmp_path) == [("sortquant8", config)]


def test_top_class_and_the_one_class_warning():
    logits = torch.tensor([[0.1, 0.9], [0.2, 0.8], [0.7, 0.3]])
    assert top_class(logits) == (2, 3)
    assert top_class(torch.zeros(4, 1)) is None  # regression
    summary = {"metric": "val_acc", "value": 0.5092, "samples_per_s": 1.0, "raw_bytes": 8, "wire_bytes": 8,
               "wall_seconds": 1.0, "top_class": [872, 872]}
    assert "warning: predicted one class for 872/872 examples" in format_summary(summary)
    assert one_class_warning(summary | {"top_class": [871, 872]}) is None
    assert one_class_warning(summary | {"top_class": None}) is None


@pytest.mark.skipif(not RTE.is_dir(), reason=f"real RTE data not found at {RTE}")
def test_compare_to_runs_both_settings_with_the_same_seed(tmp_path, capfd):
    glue = tmp_path / "glue"
    (glue / "RTE").mkdir(parents=True)
    for split, rows in (("train", 32), ("dev", 16)):
        lines = (RTE / f"{split}.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
        (glue / "RTE" / f"{split}.tsv").write_text("".join(lines[: rows + 1]), encoding="utf-8")
    log = tmp_path / "runs" / "q.jsonl"
    code = load_cli("test_nlp_dgpipe").main([
        "--task", "rte", "--data-dir", str(glue), "--model-config", "tiny-roberta", "--max-length", "48",
        "--batch-size", "8", "--chunk", "2", "--epochs", "1", "--max-steps", "2", "--quant", "8",
        "--compare-to", "none", "--log-file", str(log), "--no-progress",
    ])
    assert code == 0
    out = capfd.readouterr().out
    assert "[1/2] quant8" in out and "[2/2] none" in out and "== comparison" in out
    own, none = read_records(log)[-1], read_records(log.with_name("q.none.jsonl"))[-1]
    assert own["args"]["seed"] == none["args"]["seed"] and own["steps"] == none["steps"] == 2
    assert own["args"]["compression"]["forward"]["name"] == "quant"
    assert none["args"]["compression"]["forward"]["name"] == "none"
    assert 0.2 < own["wire_bytes"] / none["wire_bytes"] < 0.3  # 8 of 32 bits plus headers and the mask
    row = next(line for line in out.splitlines() if line.startswith("quant8 "))
    delta = 100 * (own["value"] - none["value"])
    assert f"{delta:+.2f}" in row
