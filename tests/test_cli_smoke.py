"""End-to-end runs of both main-job CLIs with tiny settings (2 local gloo processes, 2 steps).

Vision: a tiny MobileNetV2 (width 0.25) through the client/server pipeline with sort
quantization (6+2 bits) on a small image folder written here. NLP: a tiny random
RoBERTa with the offline tokenizer on real RTE rows, as the data-parallel baseline
with fp16 gradient exchange. Both check the JSON-lines log the run leaves. Resume: for
both jobs, an interrupted and resumed run ends with the state of an uninterrupted one,
bit for bit (vision: including the random augmentation, with and without a worker).
"""

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dgpipe.train.runlog import BOUNDARY_FIELDS, read_records
from helpers import ROOT, load_cli

RTE = ROOT.parent / "shared" / "data" / "glue" / "RTE"
SUMMARY_FIELDS = {"event", "metric", "value", "samples_per_s", "raw_bytes", "wire_bytes", "wall_seconds", "args"}

pytestmark = pytest.mark.usefixtures("no_torchrun")


def _image_folder(root: Path, per_class: dict[str, int]) -> Path:
    rng = np.random.default_rng(0)
    for split, count in per_class.items():
        for c in range(10):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


def _check_log(path: Path, metric: str) -> tuple[dict, dict]:
    records = read_records(path)
    assert [r["event"] for r in records] == ["epoch", "summary"]
    epoch, summary = records
    assert {"epoch", "train_loss", metric, "samples_per_s", "boundaries"} <= set(epoch)
    assert epoch["epoch"] == 1 and epoch["steps"] == 2 and np.isfinite(epoch["train_loss"])
    assert epoch["boundaries"] and all(set(BOUNDARY_FIELDS) <= set(b) for b in epoch["boundaries"])
    assert SUMMARY_FIELDS <= set(summary) and summary["metric"] == metric and summary["steps"] == 2
    assert 0.0 <= summary["value"] <= 1.0 and summary["samples_per_s"] > 0 and summary["wall_seconds"] > 0
    train = [b for b in epoch["boundaries"] if b["direction"] != "eval"]
    assert summary["raw_bytes"] == sum(b["raw_bytes"] for b in train) > 0
    assert summary["wire_bytes"] == sum(b["wire_bytes"] for b in train) > 0
    return epoch, summary


def test_vision_pipeline_sortquant(tmp_path, capfd):
    data = _image_folder(tmp_path / "images", {"train": 4, "test": 2})
    log = tmp_path / "runs" / "sq8.jsonl"
    code = load_cli("test_vision_dgpipe").main([
        "--data-dir", str(data), "--sortquant", "--quant", "6", "--split", "2", "--chunk", "2",
        "--batch-size", "8", "--epochs", "1", "--max-steps", "2", "--width-mult", "0.25", "--num-workers", "0",
        "--eval-subset", "10", "--log", str(log), "--bandwidth", "--save", str(tmp_path / "ckpt"), "--no-progress",
    ])
    assert code == 0
    out = capfd.readouterr().out
    assert "3 stages with [1, 18, 1] layers on ranks [0, 1, 0]" in out and "== summary ==" in out
    epoch, summary = _check_log(log, "val_acc")
    # Activations (forward) and gradients (backward) cross both boundaries of [client, server, client].
    assert {(b["name"], b["direction"]) for b in epoch["boundaries"]} == {
        (f"stage{i}->stage{i + 1}", d) for i in (0, 1) for d in ("forward", "backward", "eval")}
    # the seconds spent in the codec are logged per boundary (summed over ranks)
    assert all(b["encode_seconds"] > 0 and b["decode_seconds"] > 0 for b in epoch["boundaries"])
    # 8 bits per float32 value plus per-bucket parameters and headers: a bit over 1/4.
    assert 0.25 < summary["wire_bytes"] / summary["raw_bytes"] < 0.27
    assert summary["args"]["quant"] == 6 and summary["args"]["compression"]["forward"]["name"] == "sortquant"
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step-00000002"]
    assert sorted(p.name for p in (tmp_path / "ckpt" / "step-00000002").iterdir()) == [
        "meta.json", "rank0.json", "rank0.pt", "rank1.json", "rank1.pt"]


def _tiny_rte(root: Path, train_rows: int, dev_rows: int) -> Path:
    """A GLUE folder holding the first rows of the real RTE files."""
    (root / "RTE").mkdir(parents=True)
    for split, rows in (("train", train_rows), ("dev", dev_rows)):
        lines = (RTE / f"{split}.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
        (root / "RTE" / f"{split}.tsv").write_text("".join(lines[: rows + 1]), encoding="utf-8")
    return root


needs_rte = pytest.mark.skipif(not RTE.is_dir(), reason=f"real RTE data not found at {RTE}")


@needs_rte
def test_nlp_dataparallel_tiny_roberta(tmp_path, capfd):
    log = tmp_path / "rte.jsonl"
    code = load_cli("test_nlp_dgpipe").main([
        "--task", "rte", "--data-dir", str(_tiny_rte(tmp_path / "glue", 64, 16)), "--model-config", "tiny-roberta",
        "--max-length", "48", "--mode", "dataparallel", "--grad-compression", "fp16", "--batch-size", "8",
        "--epochs", "1", "--max-steps", "2", "--lr", "1e-4", "--log", str(log), "--no-progress",
    ])
    assert code == 0
    assert "DDP on 2 processes, gradient exchange fp16" in capfd.readouterr().out
    epoch, summary = _check_log(log, "val_acc")
    assert {b["name"] for b in epoch["boundaries"]} == {"ddp"}
    assert summary["wire_bytes"] * 2 == summary["raw_bytes"]  # fp16 halves every float32 gradient
    (ddp,) = epoch["boundaries"]
    assert ddp["recv_seconds"] > 0 and {"frame_bytes", "encode_seconds", "decode_seconds"} <= set(ddp)


@needs_rte
def test_nlp_pipeline_evaluates_dev_and_heldout_with_lowbit_codecs(tmp_path):
    """--heldout: the summary carries dev and held-out metrics (one evaluation pass over both);
    a rotated per-token codebook forward and error-fed 4-bit gradients backward."""
    log = tmp_path / "rte.jsonl"
    code = load_cli("test_nlp_dgpipe").main([
        "--task", "rte", "--data-dir", str(_tiny_rte(tmp_path / "glue", 96, 16)), "--model-config", "tiny-roberta",
        "--max-length", "48", "--batch-size", "8", "--chunk", "2", "--epochs", "1", "--max-steps", "2", "--lr", "1e-4",
        "--heldout", "24", "--codec", "codebook", "--codec-opt", "bits=2", "--codec-opt", "group=token",
        "--codec-opt", "rotate=hadamard", "--grad-codec", "quant", "--grad-codec-opt", "bits=4",
        "--grad-codec-opt", "group=token", "--grad-codec-opt", "error_feedback=true",
        "--log", str(log), "--no-progress",
    ])
    assert code == 0
    epoch, summary = _check_log(log, "val_acc")
    assert set(summary["metrics"]) == {"val_acc", "heldout_acc"}
    assert epoch["heldout_acc"] == summary["metrics"]["heldout_acc"]
    assert 0 <= summary["metrics"]["heldout_acc"] <= 1 and round(24 * summary["metrics"]["heldout_acc"], 6).is_integer()
    assert summary["wire_bytes"] < summary["raw_bytes"] / 4


@needs_rte
def test_nlp_pipeline_skip_padding_trains_alike_on_fewer_bytes(tmp_path):
    """--skip-padding: the boundaries' row mask is the encoders' attention mask (``BoundarySpec(row_mask=
    ATTENTION_MASK)``); uncompressed, the run's losses and validation accuracy are those of the run that sends
    every row, and its forward messages carry fewer bytes (the padding rows stay behind)."""
    data, logs = _tiny_rte(tmp_path / "glue", 32, 8), {}
    for skip in (False, True):
        logs[skip] = tmp_path / f"rte-{skip}.jsonl"
        code = load_cli("test_nlp_dgpipe").main([
            "--task", "rte", "--data-dir", str(data), "--model-config", "tiny-roberta", "--max-length", "128",
            "--batch-size", "8", "--chunk", "2", "--epochs", "1", "--max-steps", "2", "--lr", "1e-4",
            "--codec", "none", "--log", str(logs[skip]), "--no-progress", *(["--skip-padding"] if skip else [])])
        assert code == 0
    (plain, _), (skipped, _) = (_check_log(logs[skip], "val_acc") for skip in (False, True))
    assert skipped["train_loss"] == pytest.approx(plain["train_loss"], rel=1e-5)
    assert skipped["val_acc"] == plain["val_acc"]
    forward = {run: sum(b["wire_bytes"] for b in epoch["boundaries"] if b["direction"] == "forward")
               for run, epoch in (("plain", plain), ("skipped", skipped))}
    assert forward["skipped"] < 0.9 * forward["plain"], forward


@needs_rte
def test_nlp_pipeline_delta_logs_caches_and_statistics(tmp_path, capfd):
    """--delta: caches in memory-mapped files (one per boundary, side and rank), their size
    printed, forward entries marked delta with the coded change = the activation on the
    first visits (epoch 1) and less on the revisits (epoch 2); sample ids cost wire bytes."""
    log = tmp_path / "rte.jsonl"
    code = load_cli("test_nlp_dgpipe").main([
        "--task", "rte", "--data-dir", str(_tiny_rte(tmp_path / "glue", 16, 8)), "--model-config", "tiny-roberta",
        "--max-length", "48", "--batch-size", "8", "--chunk", "2", "--epochs", "2", "--lr", "1e-4",
        "--codec", "quant", "--codec-opt", "bits=2", "--codec-opt", "group=token", "--delta",
        "--delta-cache-dir", str(tmp_path / "caches"), "--log", str(log), "--no-progress",
    ])
    assert code == 0
    out = capfd.readouterr().out
    assert "rank 0: delta cache stage0->stage1 tensor 0 (sender): 16 examples x 3072 values x 2 bytes" in out
    assert len(list((tmp_path / "caches").iterdir())) == 4
    first, second, summary = read_records(log)
    for epoch, first_visit in ((first, True), (second, False)):
        forward = [b for b in epoch["boundaries"] if b["direction"] == "forward"]
        assert len(forward) == 2 and all(b["delta"] for b in forward)
        assert not any(b["delta"] for b in epoch["boundaries"] if b["direction"] != "forward")
        for b in forward:
            assert (b["delta_change_rel"] == pytest.approx(1.0, abs=1e-12)) if first_visit else b["delta_change_rel"] < 1
            assert 0 < b["delta_error_rel"] < 0.5
    assert summary["args"]["delta"] is True


@needs_rte
def test_nlp_pipeline_delta_cache_over_the_limit_fails_with_the_fix(tmp_path, capfd):
    code = load_cli("test_nlp_dgpipe").main([
        "--task", "rte", "--data-dir", str(_tiny_rte(tmp_path / "glue", 16, 8)), "--model-config", "tiny-roberta",
        "--max-length", "48", "--batch-size", "8", "--chunk", "2", "--epochs", "1", "--codec", "quant",
        "--codec-opt", "bits=2", "--delta", "--delta-cache-limit", "0.00001", "--no-progress",
    ])
    assert code == 1
    err = capfd.readouterr().err
    assert "16 examples x 3072 values x 2 bytes = 0.1 MiB is over the in-memory limit" in err
    assert "--delta-cache-dir" in err


def _in_process(cli: str, job_cls, argv: list[str]) -> None:
    """Run a job's loop as one in-process rank (no process spawned)."""
    import time

    import torch.distributed as dist

    from dgpipe.pipeline import free_port
    from dgpipe.train import loop

    config = loop.parse_config(job_cls, load_cli(cli).build_parser(), argv, environ={})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        loop.worker(0, 1, job_cls, config, 0, time.time())
    finally:
        dist.destroy_process_group()


def _leaves(state, prefix: str = "") -> list:
    """``(path, tensor)`` of every tensor in a nested state dict, in key order."""
    import torch

    if isinstance(state, torch.Tensor):
        return [(prefix, state)]
    if isinstance(state, dict):
        return [leaf for k in sorted(state, key=str) for leaf in _leaves(state[k], f"{prefix}/{k}")]
    if isinstance(state, (list, tuple)):
        return [leaf for i, v in enumerate(state) for leaf in _leaves(v, f"{prefix}/{i}")]
    return []


def _untimed(record: dict, drop: tuple[str, ...] = ()) -> dict:
    """A log record without its timings (seconds, rates, the step profile's task seconds) and the keys ``drop``."""
    return {k: v for k, v in record.items()
            if "seconds" not in k and not k.endswith("_per_s") and k != "profile" and k not in drop}


def _check_resume(tmp_path: Path, monkeypatch, cli: str, job_cls, common: list[str], steps: int, save_every: int,
                  crash_step: int, corrupt: bool = False, drop: tuple[str, ...] = ()) -> None:
    """Two epochs in one go == the same run with step checkpoints, crashed right after the checkpoint
    of ``crash_step`` (inside an epoch) and relaunched with ``--resume auto``: same weights, buffers,
    optimizer state (and error-feedback residuals) to the bit, same epoch records (losses, metrics,
    bytes but ``drop``). With ``corrupt``, the newest checkpoint is truncated after the crash and the one before
    it is used. ``common``: the flags of all the runs (two epochs, one in-process rank)."""
    import torch

    from dgpipe.train import checkpoint

    _in_process(cli, job_cls, [*common, "--save", str(tmp_path / "a"), "--log", str(tmp_path / "a.jsonl")])

    real_save = checkpoint.Writer.save

    def crash_after(writer, step, *a, **k):
        real_save(writer, step, *a, **k)
        if step == crash_step:
            writer.wait()
            raise KeyboardInterrupt(f"simulated crash after the checkpoint of step {step}")

    b = ["--save", str(tmp_path / "b"), "--save-every", str(save_every), "--log", str(tmp_path / "b.jsonl")]
    monkeypatch.setattr(checkpoint.Writer, "save", crash_after)
    with pytest.raises(KeyboardInterrupt):
        _in_process(cli, job_cls, [*common, *b])
    monkeypatch.setattr(checkpoint.Writer, "save", real_save)
    saved = checkpoint.steps(tmp_path / "b")
    assert saved[-1] == crash_step and len(saved) == 2  # the newest two kept
    if corrupt:
        newest = checkpoint.step_dir(tmp_path / "b", crash_step) / "rank0.pt"
        newest.write_bytes(newest.read_bytes()[:-100])
    _in_process(cli, job_cls, [*common, *b, "--resume", "auto"])

    final_a = checkpoint.load_rank(checkpoint.step_dir(tmp_path / "a", steps), 0)
    final_b = checkpoint.load_rank(checkpoint.step_dir(tmp_path / "b", steps), 0)
    assert final_a["progress"]["step"] == final_b["progress"]["step"] == steps
    for part in ("engine", "optimizer"):
        flat_a, flat_b = _leaves(final_a[part]), _leaves(final_b[part])
        assert [k for k, _ in flat_a] == [k for k, _ in flat_b] and flat_a
        for (key, x), (_, y) in zip(flat_a, flat_b):
            assert torch.equal(x, y), key
    records_a, records_b = read_records(tmp_path / "a.jsonl"), read_records(tmp_path / "b.jsonl")
    resumed_at = saved[-2] if corrupt else crash_step
    resume = next(r for r in records_b if r["event"] == "resume")
    assert resume["step"] == resumed_at and resume["restart"] == 0
    epochs_a = [r for r in records_a if r["event"] == "epoch"]
    epochs_b = [r for r in records_b if r["event"] == "epoch"]
    assert len(epochs_a) == 2
    for e, f in zip(epochs_a, epochs_b[-2:]):
        assert _untimed(e | {"boundaries": None}) == _untimed(f | {"boundaries": None})
        assert [_untimed(x, drop) for x in e["boundaries"]] == [_untimed(y, drop) for y in f["boundaries"]]
    summary_a, summary_b = records_a[-1], records_b[-1]
    assert (summary_a["value"], summary_a["raw_bytes"], summary_a["wire_bytes"], summary_a["steps"]) == \
        (summary_b["value"], summary_b["raw_bytes"], summary_b["wire_bytes"], summary_b["steps"])


@needs_rte
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("mode", [["--partition", "linear", "--stages", "3"],
                                  ["--mode", "dataparallel", "--grad-compression", "topk",
                                   "--grad-compression-opt", "ratio=0.1", "--grad-compression-opt", "error_feedback=true"]])
def test_resume_continues_exactly(tmp_path, monkeypatch, mode):
    """NLP: a linear pipeline (its stages all on rank 0 with ``--world-size 1``) and the DDP
    baseline with error feedback; dropout draws from the restored RNG."""
    from dgpipe.train.nlp import GlueJob

    data = _tiny_rte(tmp_path / "glue", 24, 8)
    common = ["--task", "rte", "--data-dir", str(data), "--model-config", "tiny-roberta", "--max-length", "32",
              "--batch-size", "4", "--chunk", "2", "--epochs", "2", "--lr", "1e-3", "--world-size", "1",
              "--no-progress", *mode]
    # DDP buckets the gradients of a new process's first step in parameter order, then by their
    # arrival; the buckets' framing (not the gradients) differs in the resumed epoch
    drop = ("frame_bytes",) if "dataparallel" in mode else ()
    _check_resume(tmp_path, monkeypatch, "test_nlp_dgpipe", GlueJob, common, steps=12, save_every=4, crash_step=8,
                  drop=drop)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("workers", [0, 1])
def test_vision_resume_continues_exactly(tmp_path, monkeypatch, workers):
    """Vision: the random crops and flips of a resumed epoch are those of the uninterrupted
    run, with the augmentation in this process or in a DataLoader worker kept alive across
    epochs (BatchNorm statistics and SGD momentum in the compared state)."""
    from dgpipe.train.vision import VisionJob

    data = _image_folder(tmp_path / "images", {"train": 1, "test": 1})
    common = ["--data-dir", str(data), "--width-mult", "0.25", "--batch-size", "4", "--chunk", "2", "--epochs", "2",
              "--lr", "0.05", "--partition", "linear", "--stages", "2", "--world-size", "1",
              "--num-workers", str(workers), "--no-progress"]
    _check_resume(tmp_path, monkeypatch, "test_vision_dgpipe", VisionJob, common, steps=4, save_every=3, crash_step=3,
                  corrupt=bool(workers))


@pytest.mark.usefixtures("one_thread")
def test_resume_auto_refuses_a_directory_of_damaged_checkpoints(tmp_path):
    """``--resume auto`` over a directory whose every checkpoint is damaged refuses, naming the steps, instead of
    starting again from step 0 into the same log; a directory where no checkpoint was ever finished still starts
    afresh."""
    from dgpipe.train import checkpoint
    from dgpipe.train.lm import LMJob

    corpus = ROOT.parent / "shared" / "data" / "text" / "wiki-excerpt"
    if not corpus.is_dir():
        pytest.skip(f"needs {corpus}")
    save = tmp_path / "ckpt"
    common = ["--data-dir", str(corpus), "--model-config", "tiny-llama", "--partition", "linear", "--stages", "2",
              "--world-size", "1", "--batch-size", "4", "--chunk", "2", "--block-length", "16", "--train-subset", "8",
              "--eval-subset", "4", "--max-steps", "2", "--no-progress", "--save", str(save), "--save-every", "1",
              "--log", str(tmp_path / "run.jsonl")]
    _in_process("test_lm_dgpipe", LMJob, common)
    saved = checkpoint.steps(save)
    assert saved == [1, 2]
    for step in saved:
        file = checkpoint.step_dir(save, step) / "rank0.pt"
        file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"--resume auto: no checkpoint in .* that every rank can load: steps 1, 2 "
                                         r"were written but cannot be loaded"):
        _in_process("test_lm_dgpipe", LMJob, [*common, "--resume", "auto"])
    for step in saved:  # records gone: nothing was ever finished there
        (checkpoint.step_dir(save, step) / "rank0.json").unlink()
    _in_process("test_lm_dgpipe", LMJob, [*common, "--resume", "auto"])
    assert checkpoint.steps(save)[-1] == 2
