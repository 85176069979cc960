"""Where a run's ranks are and what they run on: torchrun's environment, the device of each rank (``--devices``)
and the process group's backend for the placement."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .config import PipelineConfig

__all__ = ["TORCHRUN_VARS", "DistEnv", "dist_env", "parse_devices", "rank_device", "all_cuda", "shared_gpu",
           "placement_backend"]

#: Environment variables that ``torchrun`` sets for every rank.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: launched by ``torchrun`` or about to spawn its own ranks.

    Attributes:
        torchrun: True when the ``torchrun`` environment variables are set.
        rank, local_rank: this process's ranks under torchrun (0 otherwise).
        world_size: number of processes.
    """

    torchrun: bool
    rank: int
    local_rank: int
    world_size: int


def dist_env(world_size_flag: int | None, environ: os._Environ | dict | None = None) -> DistEnv:
    """Resolve the world size from ``--world-size`` and the ``torchrun`` variables.

    Raises:
        ValueError: ``--world-size`` disagrees with torchrun's ``WORLD_SIZE``, or a
            torchrun variable is missing or not an integer.
    """
    env = os.environ if environ is None else environ
    present = [v for v in TORCHRUN_VARS if v in env]
    if not present:
        return DistEnv(False, 0, 0, 2 if world_size_flag is None else world_size_flag)
    missing = [v for v in TORCHRUN_VARS if v not in env]
    if missing:
        raise ValueError(f"torchrun environment incomplete: {', '.join(missing)} not set "
                         f"(found {', '.join(present)}); launch with torchrun or unset these variables")
    try:
        rank, local_rank, world = int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"])
    except ValueError:
        raise ValueError("torchrun variables RANK, LOCAL_RANK and WORLD_SIZE must be integers") from None
    if world_size_flag is not None and world_size_flag != world:
        raise ValueError(f"--world-size {world_size_flag} but torchrun started {world} processes "
                         f"(WORLD_SIZE={world}); drop --world-size or pass --nproc-per-node/--nnodes to match")
    return DistEnv(True, rank, local_rank, world)


def parse_devices(spec: str | None, world_size: int) -> list[str]:
    """``--devices`` -> one device string per rank (``None``: the default rule)."""
    if spec is None:
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return [f"cuda:{r % n}" for r in range(world_size)]
        return ["cpu"] * world_size
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    if len(devices) == 1:
        devices = devices * world_size
    if len(devices) != world_size:
        raise ValueError(f"--devices lists {len(devices)} devices for {world_size} processes; "
                         f"give one device for all ranks or exactly {world_size}, e.g. --devices cpu")
    for d in devices:
        try:
            dev = torch.device(d)
        except RuntimeError:
            raise ValueError(f"--devices: {d!r} is not a device; use e.g. cpu, cuda, cuda:1") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"--devices {d}: CUDA is not available here; use --devices cpu")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise ValueError(f"--devices {d}: only {torch.cuda.device_count()} CUDA device(s) here")
        elif dev.type not in ("cpu", "mps", "xpu"):
            raise ValueError(f"--devices {d}: unsupported device type {dev.type!r}")
    return devices


def rank_device(pipeline: PipelineConfig, rank: int, local_rank: int) -> torch.device:
    """The device of ``rank`` (under torchrun, by ``local_rank``) of a validated config."""
    devices = parse_devices(pipeline.devices, pipeline.world_size)
    if pipeline.devices is None and devices[0].startswith("cuda"):
        return torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
    return torch.device(devices[rank])


def all_cuda(pipeline: PipelineConfig) -> bool:
    """Every rank of a validated config on a CUDA device."""
    return all(d.startswith("cuda") for d in parse_devices(pipeline.devices, pipeline.world_size))


def shared_gpu(pipeline: PipelineConfig, environ: dict | None = None) -> bool:
    """Two local ranks on one GPU (NCCL refuses that)."""
    devices = parse_devices(pipeline.devices, pipeline.world_size)
    return not dist_env(pipeline.world_size, environ).torchrun and len(set(devices)) < len(devices)


def placement_backend(pipeline: PipelineConfig, environ: dict | None = None) -> str:
    """``--backend`` with ``auto`` resolved for the job's placement: nccl when every rank has a GPU of
    its own, else gloo (which also connects a CPU client to a GPU server). The Pipeline API's
    :func:`dgpipe.pipeline.resolve_backend` knows no placement: there ``auto`` is nccl whenever CUDA
    is present."""
    if pipeline.backend != "auto":
        return pipeline.backend
    return "nccl" if all_cuda(pipeline) and not shared_gpu(pipeline, environ) else "gloo"
