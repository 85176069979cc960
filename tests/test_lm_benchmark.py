"""The language-model benchmark's report: steps to a target loss, paired differences, T on a link --
checked against numbers worked out here from synthetic logs."""

from __future__ import annotations

import json
import math

import pytest

from dgpipe.experiments import lm_benchmark
from dgpipe.train.compare import Link


def test_steps_to_target_interpolates_the_crossing():
    points = [(50, 6.0), (100, 5.0), (150, 4.0)]
    assert lm_benchmark.steps_to_target(points, 5.0) == 100.0
    assert lm_benchmark.steps_to_target(points, 4.5) == pytest.approx(125.0)
    assert lm_benchmark.steps_to_target(points, 6.5) == 50.0
    assert lm_benchmark.steps_to_target(points, 3.9) is None


def _log(path, losses, final, wire, seconds=100.0, steps=200):
    records = [{"event": "eval", "step": 50 * (i + 1), "val_loss": v} for i, v in enumerate(losses[:-1])]
    records.append({"event": "epoch", "step": steps, "val_loss": losses[-1], "boundaries": [
        {"name": "stage0->stage1", "direction": "forward", "raw_bytes": 4000, "wire_bytes": wire // 2},
        {"name": "stage0->stage1", "direction": "backward", "raw_bytes": 4000, "wire_bytes": wire // 2}]})
    records.append({"event": "summary", "metric": "val_loss", "value": final, "wire_bytes": wire,
                    "train_seconds": seconds, "steps": steps, "args": {"partition": "linear", "stages": 2}})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_results_pair_seeds_and_price_the_steps(tmp_path):
    # uncompressed reaches 5.0 at step 200; the codec at 175 (seed 0) and 150 (seed 1), half the bytes
    _log(tmp_path / "none_seed0.jsonl", [6.0, 5.5, 5.2, 5.0], 5.0, 4000)
    _log(tmp_path / "none_seed1.jsonl", [6.0, 5.5, 5.2, 5.0], 5.0, 4000)
    _log(tmp_path / "c_seed0.jsonl", [6.0, 5.4, 5.1, 4.9], 4.9, 2000)
    _log(tmp_path / "c_seed1.jsonl", [6.0, 5.2, 5.0, 4.8], 4.8, 2000)
    link = Link("1 Mbit/s + 10 ms", 1e6, 0.01)
    rows = {r["label"]: r for r in lm_benchmark.results(tmp_path, ["none", "c"], [0, 1], links=[link])}
    none, c = rows["none"], rows["c"]
    assert none["ratios"] == [1.0, 1.0] and none["delta"] is None
    assert c["ratios"] == pytest.approx([175 / 200, 150 / 200])
    assert c["delta"][0] == pytest.approx(-0.15) and c["delta_pct"][0] == pytest.approx(-3.0)
    assert c["forward"] == pytest.approx(8 * 1000 / 1000)  # 1000 float32 values a direction
    framing = 1514 / 1448  # TCP/IP and Ethernet headers on the line rate
    step_none = (100.0 + 8 * 4000 * framing / 1e6 + 200 * 2 * 0.01) / 200  # one boundary: 2 latencies a step
    step_c = (100.0 + 8 * 2000 * framing / 1e6 + 200 * 2 * 0.01) / 200
    assert none["T"][link.label] == pytest.approx(200 * step_none)
    assert c["T"][link.label] == pytest.approx((175 + 150) / 2 * step_c)
    timed = {r["label"]: r for r in lm_benchmark.results(tmp_path, ["none", "c"], [0, 1], links=[link],
                                                         compute_seconds={"c": 0.25})}
    assert timed["c"]["step_seconds"] == 0.25 and timed["none"]["step_seconds"] == 0.5
    assert timed["c"]["T"][link.label] == pytest.approx((175 + 150) / 2 * (step_c - 0.5 + 0.25))
    text = lm_benchmark.table(list(rows.values()))
    assert "| c | 2 |" in text and "ProtocolNanoGPT subspace" in text and "1.62x" in text


def test_a_target_never_reached(tmp_path):
    _log(tmp_path / "none_seed0.jsonl", [6.0, 5.5, 5.2, 5.0], 5.0, 4000)
    _log(tmp_path / "c_seed0.jsonl", [6.0, 5.8, 5.6, 5.4], 5.4, 2000)
    (row,) = [r for r in lm_benchmark.results(tmp_path, ["none", "c"], [0]) if r["label"] == "c"]
    assert row["ratio"] is None and math.isinf(row["ratios"][0])
    assert "not reached in 200 steps by 1 of 1 seeds" in lm_benchmark.table([row])


def test_a_target_at_a_step_of_the_uncompressed_run(tmp_path):
    # the target is the uncompressed loss at step 100 (5.5), not its final one: the codec's seed-0 curve
    # crosses it between steps 50 (6.0) and 100 (5.4); its final difference stays against the final loss
    _log(tmp_path / "none_seed0.jsonl", [6.0, 5.5, 5.2, 5.0], 5.0, 4000)
    _log(tmp_path / "c_seed0.jsonl", [6.0, 5.4, 5.3, 5.1], 5.1, 2000)
    rows = {r["label"]: r for r in lm_benchmark.results(tmp_path, ["none", "c"], [0], target_step=100)}
    assert rows["none"]["ratios"] == [1.0]
    assert rows["c"]["ratios"] == pytest.approx([(50 + 50 * 0.5 / 0.6) / 100])
    assert rows["c"]["delta"][0] == pytest.approx(0.1)
    assert lm_benchmark.results(tmp_path, ["none", "c"], [0])[1]["ratios"] == [math.inf]
    with pytest.raises(ValueError, match="no evaluation at step 120"):
        lm_benchmark.results(tmp_path, ["none", "c"], [0], target_step=120)
