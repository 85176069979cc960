"""The data-parallel (DDP) baseline: a model under ``DistributedDataParallel`` whose
gradient exchange is optionally compressed, metered and checkpointable.

Usage (in every rank, after ``torch.distributed.init_process_group``)::

    from dgpipe.baseline import GradCompression, build_ddp
    spec = GradCompression("topk", {"ratio": 0.01, "error_feedback": True})  # checked here: parent, before spawning
    dp = build_ddp(model, torch.device("cpu"), spec, seed=0)
    loss_fn(dp.module(x), y).backward()        # gradients averaged through the hook
    optimizer.step()
    dp.step_records()                          # meter records of this step
    dp.meter.records(); dp.meter.reset()       # per epoch
    ckpt["hook"] = dp.hook_state_dict()        # ... and dp.load_hook_state_dict(ckpt["hook"])

:class:`GradCompression` names (options in parentheses):

- ``None`` / ``"none"``: plain all-reduce, metered (no options).
- ``"fp16"``, ``"bf16"``: PyTorch's cast hooks (no options; ``bf16`` needs a backend
  that reduces bfloat16).
- ``"none"``, ``"fp16"``, ``"bf16"`` *with* ``exchange`` or ``error_feedback``: the
  generic hook below with that cast codec instead (to measure the generic exchange).
- ``"powersgd"``: PyTorch's PowerSGD hook (:data:`~dgpipe.baseline.hooks.POWERSGD_OPTIONS`:
  ``matrix_approximation_rank``, ``start_powerSGD_iter``, ``use_error_feedback``,
  ``warm_start``, ``min_compression_rate``, ``orthogonalization_epsilon``).
- any other registered codec (``dgpipe.compression.available_codecs()``: ``topk``,
  ``randomk``, ``onebit``, ``qsgd``, ``terngrad``, ``dgc``, ``atomo``, ``quant``,
  ``sortquant``, ``lowrank`` ...): the generic
  :class:`~dgpipe.baseline.codec_hook.CodecHook`; options are the codec's keyword options
  (no ``seed``: ``build_ddp`` derives the seeds) plus ``error_feedback`` (bool) and
  ``exchange`` (``"auto"``, ``"allreduce"``, ``"allgather"``). For ``dgc``,
  ``world_size`` defaults to the group's size (local clipping threshold) and
  ``error_feedback`` is refused (DGC accumulates the residual itself).

Hook state is per rank (error-feedback residuals, DGC momenta and seeded counters
differ between ranks): every rank saves and restores its own ``hook_state_dict()``.
For ``powersgd`` the DDP model keeps all gradients in one bucket (see
:class:`~dgpipe.baseline.hooks.PowerSGDHook`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from dgpipe.compression import CodecSpec, available_codecs
from dgpipe.compression.spec import NamedOptions

from .codec_hook import LINEAR_CODECS, CodecHook
from .hooks import POWERSGD_OPTIONS, AllReduceHook, CastHook, MeteredHook, PowerSGDHook

__all__ = ["DataParallel", "GradCompression", "build_ddp", "grad_compression_names"]

_TORCH_CASTS = ("fp16", "bf16")
_HOOK_OPTIONS = ("error_feedback", "exchange")
_ONE_BUCKET_MB = 1 << 20


def grad_compression_names() -> list[str]:
    """Every accepted :class:`GradCompression` name (for a CLI's ``choices``)."""
    return sorted(set(available_codecs()) | {"powersgd"})


def _check_powersgd(options: dict) -> None:
    unknown = sorted(set(options) - set(POWERSGD_OPTIONS))
    if unknown:
        raise ValueError(f"unknown powersgd options {unknown}; valid: {sorted(POWERSGD_OPTIONS)}")
    merged = {**POWERSGD_OPTIONS, **options}
    rank = merged["matrix_approximation_rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"powersgd: matrix_approximation_rank must be an int >= 1, got {rank!r}")
    start = merged["start_powerSGD_iter"]
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"powersgd: start_powerSGD_iter must be an int >= 0, got {start!r}")
    for flag in ("use_error_feedback", "warm_start"):
        if not isinstance(merged[flag], bool):
            raise ValueError(f"powersgd: {flag} must be True or False, got {merged[flag]!r}")
    powerSGD_hook.PowerSGDState(None, **merged)  # its own checks (start_powerSGD_iter > 1 with EF/warm start)


@dataclass(frozen=True)
class GradCompression(NamedOptions):
    """The gradient exchange :func:`build_ddp` installs: a name and its options, checked at
    construction (no process group needed: make it in the parent, before spawning ranks).

    Attributes:
        name: a name of :func:`grad_compression_names` (module docstring); ``None`` and
            ``"none"`` both mean plain all-reduce.
        options: its options (module docstring); ``None``: none.
        kind: ``"none"`` (all-reduce), ``"cast"`` (torch's fp16/bf16 hook), ``"powersgd"``
            (torch's PowerSGD hook) or ``"codec"`` (the generic hook).
        codec: for ``"codec"``, the :class:`~dgpipe.compression.CodecSpec` of each
            parameter's encoder (``error_feedback`` included); else ``None``.
        exchange: for ``"codec"``, ``"auto"``, ``"allreduce"`` or ``"allgather"``.

    Raises:
        ValueError: unknown name (the message lists the valid ones), unknown or invalid
            options (the message says what is valid).
    """

    name: str | None = "none"
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    kind: str = field(init=False)
    codec: CodecSpec | None = field(init=False, compare=False)
    exchange: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        name, options = self.name or "none", dict(self.options or {})
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "options", MappingProxyType(dict(options)))
        codec, exchange = None, "auto"
        if name in ("none", *_TORCH_CASTS) and options and set(options) <= set(_HOOK_OPTIONS):
            kind = "codec"  # the generic hook with a cast codec (e.g. to measure the generic exchange)
        elif name == "none":
            kind = "none"
        elif name in _TORCH_CASTS:
            kind = "cast"
        elif name == "powersgd":
            kind = "powersgd"
        elif name in available_codecs():
            kind = "codec"
        else:
            raise ValueError(f"unknown grad compression {name!r}; choose one of: {', '.join(grad_compression_names())}")
        if kind in ("none", "cast") and options:
            raise ValueError(f"grad compression {name!r} takes no options except {list(_HOOK_OPTIONS)}, "
                             f"got {sorted(options)}")
        if kind == "powersgd":
            _check_powersgd(options)
        if kind == "codec":
            if "seed" in options:
                raise ValueError("grad compression options must not contain 'seed': pass seed= to build_ddp")
            exchange = options.pop("exchange", "auto")
            if name == "dgc" and options.get("error_feedback"):
                raise ValueError("dgc accumulates its own residual: drop error_feedback for dgc")
            if exchange not in ("auto", "allreduce", "allgather"):
                raise ValueError(f"exchange must be 'auto', 'allreduce' or 'allgather', got {exchange!r}")
            if exchange == "allreduce" and name not in LINEAR_CODECS:
                raise ValueError(f"codec {name!r} cannot be all-reduced (its decode is not linear in the payload); "
                                 "use exchange='allgather' or 'auto'")
            codec = CodecSpec(name, options)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "codec", codec)
        object.__setattr__(self, "exchange", exchange)


class DataParallel:
    """A DDP-wrapped model plus its gradient-exchange hook.

    Attributes:
        module: the ``DistributedDataParallel`` model (call it, backward through it).
        grad_compression: the name it was built with (``"none"`` for none).
        meter: :class:`~dgpipe.comm.meter.BandwidthMeter` summing every bucket exchange
            (name ``"ddp"``, direction ``"allreduce"`` or ``"allgather"``) until the
            caller resets it (e.g. once per epoch).
        codec_applies_momentum: True when the codec applies the momentum itself (``dgc``
            with ``momentum > 0``): build the optimizer without momentum then.
    """

    def __init__(self, module: DistributedDataParallel, hook: MeteredHook, grad_compression: str) -> None:
        self.module = module
        self.grad_compression = grad_compression
        self._hook = hook
        self.meter = hook.meter
        self.codec_applies_momentum = isinstance(hook, CodecHook) and hook.codec == "dgc" and hook.decoder.momentum > 0

    def step_records(self) -> list[dict]:
        """Meter records (same keys as ``BandwidthMeter.records()``) of the exchanges
        since the previous call -- call it once per optimizer step."""
        records = self._hook.step_meter.records()
        self._hook.step_meter.reset()
        return records

    def set_epoch(self, epoch: int) -> None:
        """Tell the hook the 0-based epoch (DGC's density warm-up); other hooks ignore it."""
        self._hook.set_epoch(epoch)

    def hook_state_dict(self) -> dict:
        """The hook's state for a checkpoint: tensors, ints, floats and dicts only
        (loadable with ``torch.load(weights_only=True)``). Each rank saves its own."""
        return self._hook.state_dict()

    def load_hook_state_dict(self, state: dict) -> None:
        """Restore :meth:`hook_state_dict`'s output of the same rank.

        Raises:
            ValueError: the state is from another compression or another model.
        """
        self._hook.load_state_dict(state)


def build_ddp(
    model: torch.nn.Module,
    device: torch.device | str,
    compression: GradCompression | None,
    seed: int,
    process_group: dist.ProcessGroup | None = None,
) -> DataParallel:
    """Wrap ``model`` in DDP with the gradient exchange ``compression``.

    Args:
        model: the full model; moved to ``device``.
        device: this rank's device (``cuda:i`` gives ``device_ids=[i]``).
        compression: the exchange; ``None``: plain all-reduce.
        seed: base seed of the codecs' randomness (equal on all ranks; each rank
            derives its own where the exchange needs independent draws).
        process_group: default: the world.

    Returns:
        A :class:`DataParallel`.
    """
    compression = compression or GradCompression()
    kind = compression.kind
    device = torch.device(device)
    model = model.to(device)
    device_ids = None
    if device.type == "cuda":
        device_ids = [device.index if device.index is not None else torch.cuda.current_device()]
    # PowerSGDHook needs every gradient in one bucket (see its docstring): a 1 TiB cap.
    ddp = DistributedDataParallel(
        model, device_ids=device_ids, process_group=process_group,
        bucket_cap_mb=_ONE_BUCKET_MB if kind == "powersgd" else None,
    )
    if kind == "none":
        hook: MeteredHook = AllReduceHook(process_group)
    elif kind == "cast":
        hook = CastHook(compression.name, process_group)
    elif kind == "powersgd":
        hook = PowerSGDHook(model.named_parameters(), dict(compression.options), seed, process_group)
    else:
        codec = compression.codec
        if codec.name == "dgc" and "world_size" not in codec.options:
            codec = CodecSpec("dgc", {**codec.options, "world_size": dist.get_world_size(process_group)})
        hook = CodecHook(model.named_parameters(), codec, seed=seed, exchange=compression.exchange,
                         process_group=process_group)
    hook.register(ddp)
    return DataParallel(ddp, hook, compression.name)
