"""The training loop shared by the main jobs: launch, epochs, evaluation, logs, checkpoints.

:func:`main` is a main-job CLI's body (:func:`parse_config`: parse, validate, freeze into a
:class:`~dgpipe.train.config.RunConfig`; then :func:`run`). :func:`run` starts
the ranks -- in this process under ``torchrun`` (its environment variables are set), else
``--world-size`` local processes through :func:`dgpipe.pipeline.spawn` -- and each rank
runs :func:`worker`:

1. seed torch, build the job's layers (identical on every rank), the data loaders (on
   the ranks that read data) and the engine (:mod:`dgpipe.train.engine`: the compressed
   pipeline or the DDP baseline; rank 0 broadcasts the training set's size, which
   ``--delta`` caches are allocated for);
2. per epoch: train for ``len(train loader)`` steps (fewer with ``--max-steps``), with
   a tqdm bar on rank 0 (loss, samples/s); evaluate; gather the traffic meter on rank
   0; rank 0 writes an ``epoch`` record (:mod:`dgpipe.train.runlog`) and prints a line
   (and the per-boundary table with ``--bandwidth``); every rank checkpoints with ``--save``
   (:mod:`dgpipe.train.checkpoint`: after every epoch, and every ``--save-every`` steps);
3. rank 0 writes the ``summary`` record and prints it.

The batches of an epoch -- order and augmentation -- depend only on ``--seed`` and the
epoch (:mod:`dgpipe.data.loading`), and a checkpoint holds the RNG states, the codec and meter
state and where the run stands inside its epoch, so a run resumed from any checkpoint
(``--resume DIR``, or ``--resume auto`` under torchrun's restarts) trains exactly as an
uninterrupted one; rank 0 then appends a ``resume`` record to the log.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from dgpipe.comm import wire_device
from dgpipe.data.loading import EpochBatchSampler
from dgpipe.pipeline import SpawnError, init_distributed, spawn

from . import checkpoint, memory, runlog
from .report import Progress, announce, report_epoch, write_summary
from .args import check_resume, run_config
from .placement import dist_env, placement_backend, rank_device
from .config import RunConfig
from .engine import make_engine, reads_data
from .job import Job

__all__ = ["main", "parse_config", "run", "launch", "run_settings", "worker", "top_class"]

def parse_config(job_cls: type[Job], parser: argparse.ArgumentParser, argv: Sequence[str] | None = None,
                 environ: dict | None = None, own: Sequence[str] = ()) -> RunConfig:
    """Parse ``argv`` with the job's ``parser``, validate it (:func:`~.args.run_config`, then
    ``job_cls.check``, whose resolved options replace the job part) and return the frozen config
    (``environ``: the torchrun variables, default ``os.environ``; ``own``: destinations of flags
    a caller added to the parser for itself, left out of the config).

    Raises:
        SystemExit: status 2 through ``parser.error``, with the message of the first
            problem found -- before any process starts.
    """
    try:
        flags = {k: v for k, v in vars(parser.parse_args(argv)).items() if k not in own}
        config = run_config(argparse.Namespace(**flags), job_cls.options, environ)
        config = dataclasses.replace(config, job=job_cls.check(config))
        check_resume(config)
        return config
    except ValueError as e:
        parser.error(str(e))


def main(job_cls: type[Job], parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """A main-job CLI: :func:`parse_config`, then :func:`run`.

    Returns:
        the exit status: 0, or 1 when a rank failed (the error is printed on stderr).
    Raises:
        SystemExit: status 2 for bad flags (see :func:`parse_config`).
    """
    config = parse_config(job_cls, parser, argv)
    try:
        run(job_cls, config)
    except SpawnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def run(job_cls: type[Job], config: RunConfig) -> None:
    """Train ``job_cls(config)`` on ``config.pipeline.world_size`` ranks.

    With ``--compare-to``, every setting (:func:`dgpipe.train.compare.plan`) trains in turn in
    the same ranks, and the launching process (rank 0 under torchrun) prints the
    side-by-side table (:func:`dgpipe.train.compare.format_table`).

    Raises:
        dgpipe.pipeline.SpawnError: a rank failed (names it, with its traceback).
    """
    from . import compare

    with tempfile.TemporaryDirectory(prefix="dgpipe-compare-") as tmp:
        runs = compare.plan(config, tmp)
        env = launch(job_cls, runs)
        if len(runs) > 1 and env.rank == 0:
            print(compare.format_table(compare.rows(runs, job_cls.links)), flush=True)


def launch(job_cls: type[Job], runs: list[tuple[str, RunConfig]], capture: bool = False):
    """Run :func:`run_settings` on the ranks: in this process under ``torchrun``, else in
    ``world_size`` spawned processes (settings from ``runs[0]``: world size, backend, timeout).

    Returns:
        the :class:`~dgpipe.train.placement.DistEnv` of this process (rank 0 when it spawned the ranks).
    Raises:
        dgpipe.pipeline.SpawnError: a spawned rank failed (names it, with its traceback).
    """
    first = runs[0][1].pipeline
    env = dist_env(first.world_size)
    backend = placement_backend(first)
    if env.torchrun:
        init_distributed(backend, first.timeout)
        try:
            run_settings(env.rank, env.world_size, job_cls, runs, env.local_rank, capture)
        finally:
            dist.destroy_process_group()
    else:
        spawn(run_settings, env.world_size, (job_cls, runs, None, capture), backend=backend, timeout=first.timeout)
    return env


def run_settings(rank: int, world_size: int, job_cls: type[Job], runs: list[tuple[str, RunConfig]],
                 local_rank: int | None = None, capture: bool = False) -> None:
    """Rank body: :func:`worker` once per ``(label, config)`` of ``runs``, in order.

    With several runs rank 0 prints one line per setting before it trains; with ``capture``
    it sends each worker's printout to ``<log>.out`` beside the setting's log instead of
    stdout.
    """
    local_rank = rank if local_rank is None else local_rank
    for i, (label, config) in enumerate(runs, 1):
        launch_time = time.time()
        if rank == 0 and len(runs) > 1:
            steps = f", {config.train.max_steps} steps" if config.train.max_steps else ""
            print(f"[{i}/{len(runs)}] {label}: {config.codec.compression}{steps}", flush=True)
        if rank != 0 or not capture:
            worker(rank, world_size, job_cls, config, local_rank, launch_time)
            continue
        with open(Path(config.log.log).with_suffix(".out"), "w") as out, contextlib.redirect_stdout(out):
            worker(rank, world_size, job_cls, config, local_rank, launch_time)


def _set_threads(device: torch.device) -> None:
    """Share the CPU cores among the local ranks (set by spawn and torchrun) instead of
    oversubscribing them."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if device.type == "cpu" and local is not None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(local)))


def _broadcast(values: list[float], src: int) -> list[float]:
    """``values`` of rank ``src`` on every rank (float64 tensor collective)."""
    buf = torch.tensor(values, dtype=torch.float64, device=wire_device())
    dist.broadcast(buf, src=src)
    return buf.tolist()


def _start_epoch(loader: DataLoader | None, epoch: int, start: int = 0):
    """The iterator over ``epoch``'s batches from batch ``start`` on (None without a loader): order
    and augmentation draws are a function of the loader's seed and ``epoch``
    (:class:`dgpipe.data.EpochBatchSampler`, or a ``DistributedSampler`` in a job's own loader,
    whose first ``start`` batches are then loaded and dropped)."""
    if loader is None:
        return None
    sampler = loader.batch_sampler
    if isinstance(sampler, EpochBatchSampler):
        sampler.set_epoch(epoch, start)
        return iter(loader)
    for part in (sampler, loader.sampler):
        if hasattr(part, "set_epoch"):
            part.set_epoch(epoch)
    return itertools.islice(iter(loader), start, None)


def top_class(outputs: torch.Tensor) -> tuple[int, int] | None:
    """How many examples the most predicted class got, of how many: ``(count, n)`` for
    classifier outputs float ``(n, classes)`` with ``classes >= 2`` (argmax), else None
    (regression)."""
    if outputs.dim() != 2 or outputs.shape[1] < 2 or not len(outputs):
        return None
    return int(torch.bincount(outputs.argmax(dim=1)).max()), len(outputs)


def _evaluate(engine, job: Job, loader: DataLoader | None, steps: int
              ) -> tuple[dict[str, float], tuple[int, int] | None]:
    """Run the evaluation set through the engine; every rank returns the metrics and (for a
    classifier) :func:`top_class` of the outputs."""
    outputs, targets = [], []
    batches = iter(loader) if engine.reads_data else None
    for _ in range(steps):
        inputs, target = next(batches) if batches is not None else (None, None)
        out = engine.eval_step(inputs, target)
        if out is not None and dist.get_rank() == engine.output_rank:
            outputs.append(job.eval_outputs(out, target.to(out.device)).float().cpu())
            targets.append(target)
    values = [0.0] * (len(job.metric_names) + 2)
    if dist.get_rank() == engine.output_rank:
        out = torch.cat(outputs)
        metrics = job.metrics(out, torch.cat(targets))
        top = top_class(out) if job.classifier else None
        values = [metrics[name] for name in job.metric_names] + list(top or (-1, -1))
    *values, count, n = _broadcast(values, engine.output_rank)
    return dict(zip(job.metric_names, values)), (int(count), int(n)) if n >= 0 else None


def _train_epoch(engine, optimizer, scheduler, batches, progress: Progress, steps: int, batch_size: int, desc: str,
                 show: bool, after_step=None) -> tuple[int, float]:
    """Train the current epoch of ``progress`` up to its ``steps``-th step, advancing ``progress``;
    returns the steps trained and their seconds.

    ``after_step(loss, lr)``, if given, runs after every step and returns the seconds it took that are
    not training time (an evaluation)."""
    bar = tqdm(total=steps, initial=progress.epoch_step, desc=desc, disable=not show, unit="step",
               dynamic_ncols=True)
    done, seconds = 0, 0.0
    while progress.epoch_step < steps:
        start = time.perf_counter()
        inputs, targets, *ids = next(batches) if batches is not None else (None, None)
        optimizer.zero_grad(set_to_none=True)
        loss = engine.train_step(inputs, targets, ids[0] if ids else None)
        engine.loss_scale.step(optimizer, wire_device())
        scheduler.step()
        progress.loss_sum += loss
        progress.recent.append(loss)
        progress.epoch_step += 1
        progress.step += 1
        progress.samples += batch_size
        done += 1
        paused = after_step(loss, scheduler.get_last_lr()[0]) if after_step is not None else 0.0
        step_seconds = time.perf_counter() - start - paused
        progress.train_seconds += step_seconds
        seconds += step_seconds
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{done * batch_size / seconds:.1f}")
    bar.close()
    return done, seconds


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """Torch's CPU (and this rank's CUDA) random state, for dropout after a resume."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"].cpu())
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _step_hook(engine, job: Job, eval_loader: DataLoader | None, eval_steps: int, log: runlog.JsonlLog,
               progress: Progress, steps: int, eval_every: int | None, save_every: int | None, save):
    """The ``after_step`` of :func:`_train_epoch` for an epoch of ``steps`` steps: a ``step`` record
    per step for a job with ``step_records``; with ``eval_every`` an evaluation and an ``eval`` record
    every ``eval_every`` steps of the run, and with ``save_every`` a checkpoint (``save()``) every
    ``save_every`` steps -- neither at the epoch's last step, which the epoch's own evaluation and
    checkpoint cover. None when there is nothing to do."""
    if not job.step_records and not eval_every and not save_every:
        return None

    def after_step(loss: float, lr: float) -> float:
        step, last = progress.step, progress.epoch_step == steps
        if job.step_records:
            log.write({"event": "step", "step": step, "epoch": progress.epoch + 1, "loss": float(loss),
                       "lr": float(lr)})
        paused = 0.0
        if eval_every and not step % eval_every and not last:
            start = time.perf_counter()
            metrics, _ = _evaluate(engine, job, eval_loader, eval_steps)
            log.write({"event": "eval", "step": step, "epoch": progress.epoch + 1,
                       "train_loss": sum(progress.recent) / len(progress.recent), **metrics})
            if dist.get_rank() == 0:
                tqdm.write(f"step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            progress.recent.clear()
            paused = time.perf_counter() - start
        if save_every and not step % save_every and not last:
            save()
        return paused

    return after_step


def _checkpoint_state(engine, optimizer, scheduler, device: torch.device, progress: Progress) -> dict[str, Any]:
    """Everything a rank needs to continue exactly (see :mod:`dgpipe.train.checkpoint`)."""
    return {"engine": engine.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "rng": _rng_state(device), "meter": engine.meter.state_dict(), "progress": dataclasses.asdict(progress),
            "loss_scale": engine.loss_scale.state_dict()}


def _resume(config: RunConfig, rank: int, device: torch.device, engine, optimizer, scheduler) -> Progress | None:
    """Load the newest checkpoint every rank can read (``--resume DIR``, or ``--save``'s with
    ``--resume auto``); returns where it left the run, or None when there is none (``auto``: a
    fresh start).

    Raises:
        ValueError: ``--resume DIR`` and no checkpoint complete on every rank; ``--resume auto`` and a directory
            whose checkpoints are all damaged (a fresh start only where no rank finished writing one).
    """
    resume = config.log.resume
    if resume is None:
        return None
    directory = str(config.log.save if resume == "auto" else resume)  # auto: --save is checked before launch
    found = checkpoint.agree(directory, rank, wire_device(), map_location=device)
    if found is None:
        written = checkpoint.written_anywhere(directory, rank, wire_device())
        if resume == "auto" and not written:
            return None
        why = (f": steps {', '.join(map(str, written))} were written but cannot be loaded on every rank (each "
               "one's reason above); repair or remove them to start again" if written else "")
        raise ValueError(f"--resume {resume}: no checkpoint in {directory} that every rank can load{why}")
    step, state = found
    if config.log.save is not None and Path(directory).resolve() == Path(config.log.save).resolve():
        checkpoint.discard_after(directory, rank, step)  # where this run writes: no mixing with the next steps
    engine.load_state_dict(state["engine"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"], device)
    engine.meter.load_state_dict(state["meter"])
    engine.loss_scale.load_state_dict(state["loss_scale"])
    return Progress(**state["progress"])


def _repeated_steps(path: str | None, step: int) -> int | None:
    """Steps the log shows past ``step`` (work an interrupted attempt did after its last checkpoint,
    which the resumed run repeats): the largest ``step`` of its records minus ``step``; None without
    a log."""
    if path is None or not Path(path).is_file():
        return None
    done = [r["step"] for r in runlog.read_records(path) if isinstance(r.get("step"), int)]
    return max(0, max(done, default=step) - step)


def _peak_memory(device: torch.device, start_bytes: int, world_size: int) -> list[dict[str, Any]]:
    """Every rank's memory (a collective; :mod:`~dgpipe.train.memory`): ``{"rank", "kind", "peak_bytes",
    "start_bytes"}`` -- the peak since the engine was built, and the process's resident set before the model
    was (the interpreter and libraries)."""
    kinds = ("cuda_allocated", "rss", "rss_lifetime")
    mine = torch.tensor([memory.peak_bytes(device), start_bytes, kinds.index(memory.memory_kind(device))],
                        dtype=torch.int64, device=wire_device())
    every = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    return [{"rank": r, "kind": kinds[int(t[2])], "peak_bytes": int(t[0]), "start_bytes": int(t[1])}
            for r, t in enumerate(every)]


def worker(rank: int, world_size: int, job_cls: type[Job], config: RunConfig, local_rank: int,
           launch_time: float) -> None:
    """Body of one rank (torch.distributed initialised); see the module docstring. ``launch_time``:
    ``time.time()`` when the run started (the summary's wall seconds count from it)."""
    pipe, train, log_cfg = config.pipeline, config.train, config.log
    device = rank_device(pipe, rank, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _set_threads(device)
    torch.manual_seed(train.seed)
    start_bytes = memory.resident_bytes()
    job = job_cls(config)
    layers = job.build_layers()
    dp_shards = world_size if pipe.mode == "dataparallel" else 1
    train_loader = eval_loader = None
    if reads_data(pipe, rank):
        train_loader, eval_loader = job.loaders(rank if dp_shards > 1 else 0, dp_shards)
    sizes = [len(train_loader), len(eval_loader), len(train_loader.dataset)] if rank == 0 else [0, 0, 0]
    steps_per_epoch, eval_steps, train_examples = (int(x) for x in _broadcast(sizes, 0))
    engine = make_engine(job, layers, config, rank, device, train_examples)
    del layers  # the other ranks' layers: freed, so that this rank's peak memory counts what it holds
    memory.reset_peak(device)
    total_steps = train.epochs * steps_per_epoch
    if train.max_steps is not None:
        total_steps = min(total_steps, train.max_steps)
    optimizer, scheduler = job.optimizer(engine.parameters(), total_steps, steps_per_epoch, engine.momentum_in_codec)

    resumed = _resume(config, rank, device, engine, optimizer, scheduler)
    progress = resumed or Progress()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    lead = rank == 0
    repeated = _repeated_steps(log_cfg.log, progress.step) if lead and (resumed or restart) else None
    log = runlog.JsonlLog(log_cfg.log if lead else None, append=bool(log_cfg.resume or restart))
    writer = checkpoint.Writer(log_cfg.save, rank, log_cfg.keep_checkpoints) if log_cfg.save else None

    def save() -> None:
        meta = {"world_size": world_size, "mode": pipe.mode, "epoch": progress.epoch,
                "args": config.to_json()} if lead else None
        writer.save(progress.step, _checkpoint_state(engine, optimizer, scheduler, device, progress), meta)

    if lead:
        announce(log, config, engine, progress, steps_per_epoch, resumed=bool(resumed or restart), restart=restart,
                 repeated=repeated)
    metrics: dict[str, float] = {}
    top: tuple[int, int] | None = None
    while progress.epoch < train.epochs and progress.step < total_steps:
        epoch = progress.epoch
        if progress.epoch_step == 0:
            engine.meter.reset()
        engine.set_epoch(epoch)
        batches = _start_epoch(train_loader, epoch, progress.epoch_step) if engine.reads_data else None
        n = min(steps_per_epoch, total_steps - progress.step + progress.epoch_step)
        after_step = _step_hook(engine, job, eval_loader, eval_steps, log, progress, n, train.eval_every,
                                log_cfg.save_every if writer else None, save)
        done, seconds = _train_epoch(engine, optimizer, scheduler, batches, progress, n, config.data.batch_size,
                                     f"epoch {epoch + 1}/{train.epochs}", lead and log_cfg.progress, after_step)
        train_loss = engine.mean_loss(progress.loss_sum, n)
        delta_stats = engine.delta_stats()
        merged = engine.meter.gather(dst=0)
        profile = engine.step_profile(merged.records() if merged is not None else None)
        metrics, top = _evaluate(engine, job, eval_loader, eval_steps)
        eval_traffic = engine.meter.gather(dst=0)
        if lead:
            report_epoch(log, job, config, progress, epoch=epoch + 1, steps=n, train_loss=train_loss,
                         rate=done * config.data.batch_size / seconds if seconds else 0.0,
                         lr=scheduler.get_last_lr()[0], metrics=metrics, merged=merged, eval_traffic=eval_traffic,
                         delta_stats=delta_stats, profile=profile)
        progress.epoch, progress.epoch_step, progress.loss_sum = epoch + 1, 0, 0.0
        progress.recent.clear()
        if writer is not None:
            save()
    if writer is not None:
        writer.wait()
    peaks = _peak_memory(device, start_bytes, world_size)
    if lead:
        write_summary(log, job, config, progress, metrics, top, peaks, time.time() - launch_time)
