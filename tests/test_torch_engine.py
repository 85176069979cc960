"""``--engine torch --schedule ...``: the main jobs through torch's schedules with dgpipe codecs.

A tiny random RoBERTa on real RTE rows (2 local gloo processes, 3 steps, linear partition):
with the raw ``none`` codec the torch engine's 1F1B trains exactly as dgpipe's own GPipe
runtime (same losses and validation metric, to the last digit); each torch schedule runs
and leaves the same log format, its hidden states coded at 8 bits; and the flags that cannot
work with torch's schedules are refused before any process starts.
"""

from __future__ import annotations

import pytest

from dgpipe.train.runlog import read_records
from helpers import ROOT, load_cli

GLUE = ROOT.parent / "shared" / "data" / "glue"
NLP = load_cli("test_nlp_dgpipe")

pytestmark = [pytest.mark.usefixtures("no_torchrun"),
              pytest.mark.skipif(not (GLUE / "RTE").is_dir(), reason=f"needs {GLUE / 'RTE'}")]


def _run(tmp_path, name: str, *extra: str) -> list[dict]:
    log = tmp_path / f"{name}.jsonl"
    argv = ["--task", "rte", "--data-dir", str(GLUE), "--model-config", "tiny-roberta", "--max-length", "64",
            "--padding", "max_length", "--batch-size", "16", "--chunk", "4", "--train-subset", "64",
            "--eval-subset", "40", "--max-steps", "3", "--seed", "3", "--no-progress", "--timeout", "60",
            "--partition", "linear", "--log", str(log), *extra]
    assert NLP.main(argv) == 0
    return read_records(log)


def test_torch_1f1b_trains_exactly_as_dgpipe_gpipe(tmp_path):
    (ours, our_summary), (theirs, their_summary) = (_run(tmp_path, "dgpipe", "--codec", "none"),
                                                    _run(tmp_path, "torch", "--codec", "none", "--engine", "torch"))
    assert theirs["train_loss"] == ours["train_loss"] and theirs["val_acc"] == ours["val_acc"]
    assert their_summary["args"]["engine"] == "torch" and their_summary["args"]["schedule"] == "1f1b"
    # one log format; the step profile (tasks and messages for the link projection) is dgpipe's runtime's own
    assert set(their_summary) == set(our_summary) and set(theirs) | {"profile"} == set(ours)
    hidden = 3 * 16 * 64 * 64 * 4  # steps x batch x max-length x hidden size, float32
    forward = {b["direction"]: b for b in theirs["boundaries"]}["forward"]
    assert forward["raw_bytes"] == hidden + 3 * 16 * 64 * 8  # and the int64 attention mask, sent raw


@pytest.mark.parametrize("schedule, stages", [("gpipe", "2"), ("interleaved", "4"), ("looped-bfs", "4"),
                                             ("interleaved-zb", "6")])
def test_every_schedule_runs_with_8_bit_boundaries(tmp_path, schedule, stages):
    epoch, summary = _run(tmp_path, schedule, "--quant", "8", "--engine", "torch", "--schedule", schedule,
                          "--stages", stages)
    assert summary["steps"] == 3 and 0 <= summary["value"] <= 1
    boundaries = {(b["name"], b["direction"]) for b in epoch["boundaries"]}
    cuts = [f"stage{i}->stage{i + 1}" for i in range(int(stages) - 1)]
    assert boundaries == {(c, d) for c in cuts for d in ("forward", "backward", "eval")}
    assert 0.25 < summary["wire_bytes"] / summary["raw_bytes"] < 0.30  # 8-bit hidden states, raw masks


@pytest.mark.parametrize("extra, message", [
    (["--schedule", "1f1b"], "--schedule 1f1b chooses a torch schedule: add --engine torch"),
    (["--engine", "torch", "--partition", "client-server"], "--engine torch runs a linear partition"),
    (["--engine", "torch", "--delta"], "--delta needs the examples' ids"),
    (["--engine", "torch", "--schedule", "interleaved", "--stages", "3"], "needs a multiple of the world size, at "
                                                                           "least twice it stages, not 3"),
    (["--engine", "torch", "--schedule", "gpipe", "--stages", "4"], "needs one per rank, 2 stages, not 4"),
    (["--engine", "torch", "--schedule", "zbv"], "the eval of torch's V schedules"),
    (["--engine", "torch", "--schedule", "interleaved", "--stages", "4", "--chunk", "3", "--batch-size", "15"],
     "needs --chunk a multiple of the world size 2"),
    (["--engine", "torch", "--padding", "longest"], "--engine torch keeps every activation at one shape"),
    (["--engine", "torch", "--mode", "dataparallel"], "drop them in --mode dataparallel"),
])
def test_flags_torch_schedules_cannot_run_are_refused_before_any_process(tmp_path, capsys, extra, message):
    argv = ["--task", "rte", "--data-dir", str(GLUE), "--model-config", "tiny-roberta", "--max-length", "64",
            "--partition", "linear", *extra]
    with pytest.raises(SystemExit) as exc:
        NLP.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
