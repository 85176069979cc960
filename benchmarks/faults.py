"""Fault benchmark: a run under ``torchrun --max-restarts`` survives killed and stalled ranks.

The language-model job (a tiny random Llama on a slice of wiki-excerpt, client/server on two
ranks, 8-bit boundaries) trains twice under ``torchrun --standalone --nproc-per-node 2``:
uninterrupted, and with faults injected at random steps -- SIGKILL or SIGSTOP of the client
(rank 0) or the server (rank 1) -- under ``--max-restarts N --save DIR --save-every K --resume
auto``. A killed rank ends its peer with a named error at once, a stalled one after
``--timeout``; torchrun's agent then restarts both, and they continue from the newest complete
checkpoint. Printed, and written as JSON beside the logs: whether the step losses, the final
validation loss and every rank's final state are bit-identical to the uninterrupted run's, the
restarts the log shows, the steps repeated, and the wall-clock of both runs.

Linux only (finds torchrun's workers in ``/proc``). Usage::

    python benchmarks/faults.py --out benchmarks/results/faults/DATE [--faults 5] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WIKI = ROOT.parent / "shared" / "data" / "text" / "wiki-excerpt"
KINDS = ("kill", "stop")
RANKS = {0: "client", 1: "server"}


def corpus(folder: Path, chars: int = 40_000) -> Path:
    """The first ``chars`` characters of wiki-excerpt's train split (and 8,000 of valid/test) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", chars), ("valid", 8_000), ("test", 8_000)):
        (folder / f"{split}.txt").write_text((WIKI / f"{split}.txt").read_text(encoding="utf-8")[:n], encoding="utf-8")
    return folder


def command(data: Path, save: Path, log: Path, steps: int, save_every: int, restarts: int,
            timeout: float) -> list[str]:
    """The torchrun command line of one run: two local ranks, the LM job's client/server pipeline."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(restarts), str(ROOT / "test_lm_dgpipe.py"),
            "--data-dir", str(data), "--model-config", "tiny-llama", "--tokenizer", "bpe:600", "--block-length", "32",
            "--batch-size", "8", "--chunk", "2", "--epochs", "100", "--max-steps", str(steps), "--eval-subset", "6",
            "--num-workers", "0", "--quant", "8", "--timeout", str(timeout), "--save", str(save),
            "--save-every", str(save_every), "--resume", "auto", "--log-file", str(log), "--no-progress"]


def records(log: Path) -> list[dict]:
    """The log's complete lines (a line being written is left out)."""
    if not log.is_file():
        return []
    out = []
    for line in log.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def workers(agent: int) -> dict[tuple[int, int], int]:
    """``{(restart, rank): pid}`` of the live worker processes of the torchrun process ``agent``."""
    found = {}
    for task in Path(f"/proc/{agent}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            except OSError:
                continue
            if "RANK" in env:
                found[(int(env.get("TORCHELASTIC_RESTART_COUNT", "0")), int(env["RANK"]))] = int(pid)
    return found


def inject(agent: subprocess.Popen, log: Path, faults: list[tuple[int, str, int]], poll: float = 0.02) -> list[dict]:
    """Inject ``faults`` -- ``(step, kind, rank)``, steps increasing -- into the run of ``agent``: the
    ``i``-th once the log of its ``i``-th attempt shows a step record at or past ``step``. Returns
    what was done (step seen, kind, rank, pid, time)."""
    done = []
    for i, (step, kind, rank) in enumerate(faults):
        while agent.poll() is None:
            recs = records(log)
            attempt = sum(r["event"] == "resume" and r["restart"] > 0 for r in recs)
            seen = max((r["step"] for r in recs if r["event"] == "step"), default=0)
            pid = workers(agent.pid).get((i, rank))
            if attempt == i and seen >= step and pid is not None:
                os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
                done.append({"step": step, "seen": seen, "kind": kind, "rank": rank, "pid": pid, "time": time.time()})
                break
            time.sleep(poll)
    return done


def run(out: Path, name: str, data: Path, steps: int, save_every: int, faults: list[tuple[int, str, int]],
        timeout: float) -> dict:
    """One run (``faults`` empty: uninterrupted); its log ``out/<name>.jsonl``, checkpoints ``out/<name>``."""
    log, save = out / f"{name}.jsonl", out / name
    log.unlink(missing_ok=True)
    shutil.rmtree(save, ignore_errors=True)  # --resume auto would continue an earlier run
    cmd = command(data, save, log, steps, save_every, len(faults), timeout)
    start = time.perf_counter()
    with open(out / f"{name}.out", "w") as stdout:
        agent = subprocess.Popen(cmd, cwd=ROOT, stdout=stdout, stderr=subprocess.STDOUT)
        injected = inject(agent, log, faults)
        code = agent.wait()
    return {"name": name, "command": cmd, "returncode": code, "wall_seconds": time.perf_counter() - start,
            "faults": injected, "log": str(log), "save": str(save)}


def _leaves(state, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, dict):
        return {k: v for key in state for k, v in _leaves(state[key], f"{prefix}/{key}").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, x in enumerate(state) for k, v in _leaves(x, f"{prefix}/{i}").items()}
    return {}


def compare(a: dict, b: dict, steps: int) -> dict:
    """Run ``b`` against ``a``: step losses (every record of ``b``, repeated steps included), the
    final validation loss, every rank's final model and optimizer state, restarts and repeated steps."""
    from dgpipe.train import checkpoint

    ra, rb = records(Path(a["log"])), records(Path(b["log"]))
    losses = {r["step"]: r["loss"] for r in ra if r["event"] == "step"}
    steps_b = [r for r in rb if r["event"] == "step"]
    states = []
    for rank in RANKS:
        sa = checkpoint.load_rank(checkpoint.step_dir(a["save"], steps), rank)
        sb = checkpoint.load_rank(checkpoint.step_dir(b["save"], steps), rank)
        la = _leaves({"engine": sa["engine"], "optimizer": sa["optimizer"]})
        lb = _leaves({"engine": sb["engine"], "optimizer": sb["optimizer"]})
        states.append(la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la))
    resumes = [r for r in rb if r["event"] == "resume"]
    return {
        "step_losses_equal": len(losses) == steps and all(losses.get(r["step"]) == r["loss"] for r in steps_b)
        and {r["step"] for r in steps_b} == set(losses),
        "val_loss": [ra[-1].get("value"), rb[-1].get("value")],
        "val_loss_equal": ra[-1].get("event") == rb[-1].get("event") == "summary"
        and ra[-1]["value"] == rb[-1]["value"],
        "final_state_equal": all(states),
        "restarts": [r["restart"] for r in resumes],
        "resumed_at": [r["step"] for r in resumes],
        "repeated_steps": sum(r["repeated_steps"] or 0 for r in resumes),
        "step_records": len(steps_b),
    }


def plan(n: int, steps: int, seed: int) -> list[tuple[int, str, int]]:
    """``n`` faults at random steps in ``[steps/10, 9 steps/10)``, at least ``steps / (2 n + 2)`` apart,
    kinds and ranks alternating so that both kinds hit both ranks."""
    rng = random.Random(seed)
    gap = max(1, steps // (2 * n + 2))
    while True:
        at = sorted(rng.sample(range(steps // 10, 9 * steps // 10), n))
        if all(b - a >= gap for a, b in zip(at, at[1:])):
            break
    return [(s, KINDS[(i // 2) % 2], i % 2) for i, s in enumerate(at)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the logs, checkpoints and result.json")
    p.add_argument("--faults", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--timeout", type=float, default=10.0, help="dgpipe's --timeout: how soon a stall is an error")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault plan")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    data = corpus(args.out / "wiki")
    faults = plan(args.faults, args.steps, args.seed)
    print(f"faults (step, kind, rank): {faults}", flush=True)
    clean = run(args.out, "uninterrupted", data, args.steps, args.save_every, [], args.timeout)
    faulted = run(args.out, "faulted", data, args.steps, args.save_every, faults, args.timeout)
    result = {"command": [sys.executable, *sys.argv], "date": time.strftime("%Y-%m-%d"), "plan": faults,
              "runs": [clean, faulted], **compare(clean, faulted, args.steps)}
    result["wall_overhead_seconds"] = faulted["wall_seconds"] - clean["wall_seconds"]
    (args.out / "result.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    print(f"uninterrupted {clean['wall_seconds']:.1f} s, with {len(faulted['faults'])} faults "
          f"{faulted['wall_seconds']:.1f} s (exit {faulted['returncode']})")
    ok = result["step_losses_equal"] and result["val_loss_equal"] and result["final_state_equal"]
    return 0 if ok and clean["returncode"] == faulted["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
