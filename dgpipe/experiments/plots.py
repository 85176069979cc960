"""Ablation plot: validation metric against measured wire ratio, one point per run log.

Run it as ``python benchmarks/plot_ablation.py`` (a thin wrapper of :func:`main`).

Reads the ``summary`` record of each JSON-lines log written by ``--log`` (see
:mod:`dgpipe.train.runlog`) and draws its metric (``value``) against its measured
wire ratio ``wire_bytes / raw_bytes`` (log scale; 1.0 = uncompressed), like the
ablation figure of the sort-quantization paper. Points are labelled by the log's
file name unless ``--labels`` is given.

Usage::

    python benchmarks/plot_ablation.py benchmarks/results/vision_*.jsonl \\
        --out benchmarks/results/vision_ablation.png --title "MobileNetV2, CIFAR-10"
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from dgpipe.train.runlog import read_summary  # noqa: E402


@dataclass(frozen=True)
class Point:
    """One run: its label, measured ``wire_bytes / raw_bytes``, metric name and value."""

    label: str
    wire_ratio: float
    metric: str
    value: float


def ablation_points(paths: list[str | Path], labels: list[str] | None = None) -> list[Point]:
    """One :class:`Point` per log, from its summary record.

    Raises:
        ValueError: a log without summary or without measured bytes, logs reporting
            different metrics, or a label count that does not match.
    """
    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"{len(labels)} labels for {len(paths)} logs")
    points = []
    for i, path in enumerate(paths):
        s = read_summary(path)
        if s["raw_bytes"] <= 0:
            raise ValueError(f"{path}: raw_bytes is {s['raw_bytes']}; nothing crossed a boundary")
        label = labels[i] if labels is not None else Path(path).stem
        points.append(Point(label, s["wire_bytes"] / s["raw_bytes"], s["metric"], float(s["value"])))
    metrics = sorted({p.metric for p in points})
    if len(metrics) > 1:
        raise ValueError(f"the logs report different metrics ({', '.join(metrics)}); plot one metric at a time")
    return points


#: Label placements tried in turn: (offset in points, horizontal alignment).
_PLACEMENTS = tuple(((dx, dy), "left" if dx > 0 else "right") for dy in (4, -11, 15, -22) for dx in (4, -4))


def _annotate(fig, ax, points: list[Point]) -> None:
    """Label every point at the first of :data:`_PLACEMENTS` whose text box lies inside the
    axes and overlaps no label drawn before it (the first placement if none is free)."""
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)

    def label(p: Point, placement: tuple) -> tuple:
        (offset, ha) = placement
        text = ax.annotate(p.label, (p.wire_ratio, p.value), textcoords="offset points", xytext=offset,
                           fontsize=8, ha=ha)
        return text, text.get_window_extent(renderer)

    boxes = []
    for p in points:
        for placement in _PLACEMENTS:
            text, box = label(p, placement)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not any(box.overlaps(b) for b in boxes):
                break
            text.remove()
        else:
            text, box = label(p, _PLACEMENTS[0])
        boxes.append(box)


def plot(points: list[Point], out: str | Path, title: str | None = None) -> Path:
    """Draw ``points`` (metric vs wire ratio, log x) into the PNG ``out``; returns its path."""
    if not points:
        raise ValueError("no points to plot")
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    ax.scatter([p.wire_ratio for p in points], [p.value for p in points], zorder=3)
    ax.set_xscale("log")
    ax.set_xlabel("measured wire ratio (wire bytes / raw bytes)")
    ax.set_ylabel(points[0].metric)
    ax.grid(True, which="both", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    _annotate(fig, ax, points)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="JSON-lines logs written by --log")
    parser.add_argument("--out", default="ablation.png", help="PNG file to write")
    parser.add_argument("--labels", help="comma-separated point labels, one per log (default: file names)")
    parser.add_argument("--title")
    args = parser.parse_args(argv)
    try:
        points = ablation_points(args.logs, args.labels.split(",") if args.labels else None)
        out = plot(points, args.out, args.title)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    for p in sorted(points, key=lambda p: p.wire_ratio):
        print(f"{p.label:>24}  wire/raw {p.wire_ratio:.4f}  {p.metric} {p.value:.4f}")
    print(f"wrote {out}")
    return 0

