"""The link projection against runs that really wait, and the compute per step of every setting of the
pretraining benchmark measured side by side on a quiet machine (docs/lm.md).

For the small Llama of the pretraining benchmark (``small-llama``, 16 x 128 tokens a step, 4
micro-batches): every setting of ``LM_SETTINGS`` on 4 linear stages on loopback (the compute per step
that ``benchmarks/lm_pretrain.py`` prices T with, ``4stages_<setting>_loopback.jsonl``); and,
uncompressed and at ~2.4 bits a value (``codebook5lv_gsub1lv4``), in the same run:

1. a run on loopback without delay: its measured step time and its step profile (the tasks' compute and
   the messages' bytes) give the projected step time on each link (:func:`dgpipe.train.compare.project`,
   which plays the link out on the step's timeline, :mod:`dgpipe.pipeline.timeline`);
2. the same command on a link that waits -- client/server with the latency alone and across a real
   ``tc tbf``-shaped link of ``bandwidth/slow_link.py`` (root), every boundary message held back by the
   latency (``--link-delay``, as this kernel has no ``netem``); 4 linear stages on loopback with the
   latency alone (``slow_link.py`` connects two ranks) --

and prints, per setting and link, the measured seconds per step, the projection from the loopback run
and its error, the same timeline played out with the waiting run's own measured tasks (which separates the
link model from the run-to-run drift of the compute on a shared machine), and the formula the projection
used before the timeline (bytes with no overlap + 2 latencies per boundary). Resumable: a run whose log
holds a summary is not run again.

    sudo python benchmarks/lm_link_latency.py [--out DIR] [--steps 60]
    python benchmarks/lm_link_latency.py --only none,sub32ch_codebook3 --out DIR   # compute per step only

``--only`` times the settings it names (of ``LM_SETTINGS`` or ``LM_BOTTLENECK_SETTINGS``) on 4 stages on loopback
and runs nothing on a waiting link.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from dgpipe.pipeline.timeline import simulate_step
from dgpipe.experiments.ablation import has_summary
from dgpipe.experiments.settings import LM_BOTTLENECK_SETTINGS, LM_SETTINGS
from dgpipe.train.compare import TCP_FRAMING, Link, project, run_profile
from dgpipe.train.runlog import read_records

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "data" / "text" / "wiki-excerpt"
#: (label, partition flags, boundaries, links run through slow_link.py (rate shaped) or on loopback)
LAYOUTS = (
    ("client-server", ["--partition", "client-server"], 2,
     (Link("loopback + 50 ms", float("inf"), 0.05), Link("200 Mbit/s + 50 ms", 200e6, 0.05),
      Link("10 Mbit/s + 50 ms", 10e6, 0.05))),
    ("4 stages", ["--partition", "linear", "--stages", "4", "--world-size", "4"], 3,
     (Link("loopback + 50 ms", float("inf"), 0.05), Link("loopback + 20 ms", float("inf"), 0.02))),
)
#: The settings whose projection is checked against runs that wait.
DELAYED = ("none", "codebook5lv_gsub1lv4")
#: The pretraining benchmark's settings, timed on 4 stages.
TIMED = ("none", "sortquant8", "quant8", "codebook4", "codebook5lv_gsub1lv4", "ref_codebook5lv_gsub1lv4",
         "codebook1_gsub4")


def _rate(link: Link) -> str:
    return f"{int(link.rate / 1e6)}mbit"


def _run(cmd: list[str], log: Path) -> None:
    if has_summary(log):
        print(f"[{log.stem}] already done", flush=True)
        return
    print(f"[{log.stem}] {' '.join(cmd)}", flush=True)
    with open(log.with_suffix(".out"), "w") as out:
        subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=True)


def _error(want: float, got: float) -> str:
    return f"{want:.3f} ({100 * (want - got) / got:+.1f}%)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lm_link_latency"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--only", help="comma-separated settings to time on 4 stages, nothing on a waiting link")
    args = p.parse_args(argv)
    named = {**LM_SETTINGS, **LM_BOTTLENECK_SETTINGS}
    timed = args.only.split(",") if args.only else TIMED
    unknown = [k for k in timed if k not in named]
    if unknown:
        p.error(f"--only: unknown settings {', '.join(unknown)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--data-dir", str(CORPUS), "--model-config", "small-llama", "--batch-size", "16", "--chunk", "4",
              "--block-length", "128", "--max-steps", str(args.steps), "--eval-subset", "16", "--num-workers", "0",
              "--no-progress"]
    lines = ["| layout | setting | link | measured s/step | projected from loopback (error) | "
             "timeline with the run's own tasks (error) | formula without timeline (error) |",
             "|---|---|---|---|---|---|---|"]
    for layout, flags, boundaries, links in LAYOUTS:
        if layout == "4 stages":
            settings = timed
        else:  # the client/server layout runs only to check the projection against waiting links
            settings = () if args.only else DELAYED
        for setting in settings:
            job = [sys.executable, str(ROOT / "test_lm_dgpipe.py"), *common, *flags, *named[setting]]
            name = f"{layout.replace(' ', '')}_{setting}"
            _run(job + ["--log-file", str(out / f"{name}_loopback.jsonl")], out / f"{name}_loopback.jsonl")
            free = read_records(out / f"{name}_loopback.jsonl")
            fs, profile = free[-1], run_profile(free)
            overhead = fs["train_seconds"] / fs["steps"] - simulate_step(profile)  # the step outside its tasks
            for link in links if setting in DELAYED and not args.only else ():
                tag = link.label.replace(" ", "").replace("/", "").replace("+", "_")
                log = out / f"{name}_{tag}.jsonl"
                delayed = job + ["--link-delay", f"{1000 * link.latency:g}", "--log-file", str(log)]
                shaped = link.rate != float("inf")
                _run(([sys.executable, str(ROOT / "bandwidth" / "slow_link.py"), "--rate", _rate(link), "--"]
                      if shaped else []) + delayed, log)
                waited = read_records(log)
                got = waited[-1]["train_seconds"] / waited[-1]["steps"]
                steps, wire = fs["steps"], fs["wire_bytes"]
                want = project(fs["train_seconds"], wire, steps, boundaries, link, profile) / steps
                own = overhead + simulate_step(run_profile(waited), link.rate / TCP_FRAMING, link.latency)
                formula = project(fs["train_seconds"], wire, steps, boundaries, link) / steps
                lines.append(f"| {layout} | {setting} | {link.label} | {got:.3f} | {_error(want, got)} | "
                             f"{_error(own, got)} | {_error(formula, got)} |")
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
