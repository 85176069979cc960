"""DDP communication hooks that compress, exchange and meter the gradient buckets.

``DistributedDataParallel.register_comm_hook`` hands each hook one gradient *bucket*
(a flat buffer holding the local gradients of a few parameters) and expects a future
of the averaged buffer. The hooks here are all metered in a
:class:`~dgpipe.comm.meter.BandwidthMeter` under the name ``"ddp"``:

- :class:`AllReduceHook`: plain all-reduce of the buffer (no compression), as DDP
  does by default, with bytes and seconds recorded.
- :class:`CastHook` and :class:`PowerSGDHook`: PyTorch's own hooks -- ``fp16``/``bf16``
  (``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``) and ``powersgd``
  (``powerSGD_hook.powerSGD_hook`` with a ``PowerSGDState``; Vogels et al., "PowerSGD:
  Practical Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019).
- :class:`~dgpipe.baseline.codec_hook.CodecHook`: any dgpipe codec, applied to each
  parameter's gradient in the bucket (layer-wise, as the gradient compression papers do; matrix codecs such as
  ``atomo`` and ``lowrank`` see the parameter's own matrix), with one encoder per
  parameter (keyed by parameter name, so its state survives DDP's bucket rebuild after
  the first iteration and a resume in a new process), optionally wrapped in
  :class:`~dgpipe.compression.wrappers.feedback.ErrorFeedback`. Two exchanges:

  * ``"allreduce"`` for codecs whose decode is linear in the payload and whose headers
    agree on every rank (``none``, ``fp16``, ``bf16``, ``randomk`` with a shared seed):
    each rank encodes ``gradient / world_size``, the payload tensors are summed by one
    all-reduce per dtype, and the sum is decoded. The headers do not travel; a 3-value
    all-reduce checks that all ranks made identical headers (a digest) and that none
    failed to encode.
  * ``"allgather"`` for all the others (``topk``, ``onebit``, ``qsgd``, ``terngrad``,
    ``dgc``, ``atomo``, ``quant``, ``sortquant``, ``lowrank``): every rank frames its
    bucket's payloads into one byte buffer (:mod:`dgpipe.comm.framing`), the byte
    counts are all-gathered, the buffers are padded to the largest and all-gathered, and every
    rank decodes every rank's payloads (headers validated) and averages them in rank
    order -- so all ranks end with bit-identical gradients. ``lowrank`` goes here: its
    per-rank factors ``P_r Q_r^T`` do not sum to a low-rank factorisation of the sum
    (PowerSGD's shared ``Q`` is what makes that work; use ``powersgd`` for it).

  A rank whose encode fails still joins the first exchange with an error flag, so
  every rank raises a clear error instead of waiting forever in a collective.

``CodecHook`` runs synchronously (it returns a completed future); the others
return PyTorch's asynchronous futures, and their seconds run from the hook call to
the completion of the future.

Meter fields per bucket exchange (``direction`` is ``"allreduce"`` or ``"allgather"``):
``raw_bytes`` the bucket's gradients uncompressed; ``wire_bytes`` the bytes this rank
contributes: the framed payloads (tensors plus varint headers, see
:mod:`~dgpipe.comm.framing`; a payload's int64 header would be ``Payload.nbytes``) for all-gather, the
payload tensors (headers stay home) for the generic all-reduce, the (cast or PowerSGD-factor) buffer
for the others; ``frame_bytes`` sizes, framing, padding and header digests;
``recv_bytes`` the framed payload bytes received from the other ranks (all-gather) or the
size of the reduced buffer (all-reduce; the collective's algorithm, e.g. a ring that
moves ``2 (N-1)/N`` times the buffer, is not modelled); ``recv_seconds`` seconds in
the collectives; ``encode_seconds``/``decode_seconds`` seconds in the codec.
"""

from __future__ import annotations

import time
from typing import Iterable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from dgpipe.comm.link import Link
from dgpipe.comm.meter import BandwidthMeter

__all__ = [
    "METER_NAME",
    "POWERSGD_OPTIONS",
    "MeteredHook",
    "AllReduceHook",
    "CastHook",
    "PowerSGDHook",
]

METER_NAME = "ddp"


class MeteredHook:
    """Common part of the hooks: process group, meters, registration, state API."""

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.meter = BandwidthMeter()
        self.step_meter = BandwidthMeter()
        self.link = Link(METER_NAME, self.meter, self.step_meter)

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Register this hook on ``ddp`` (once, before the first backward)."""
        ddp.register_comm_hook(state=self, hook=_run_hook)

    def _record(self, direction: str, *, send: dict, recv: dict) -> None:
        self.link.sent(direction, **send)
        self.link.received(direction, **recv)

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Exchange one DDP bucket (DDP's comm-hook contract): returns a future of the
        flat gradient buffer averaged over the ranks (``bucket.buffer()``'s shape and
        dtype), recording the traffic in ``meter`` and ``step_meter``."""
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        """Tell stateful encoders (DGC warm-up) the 0-based epoch; no-op by default."""

    def state_dict(self) -> dict:
        """Checkpointable state (tensors, ints, floats, dicts; nothing that needs pickle)."""
        return {"kind": type(self).__name__}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output; ``ValueError`` if it is from another hook."""
        if not isinstance(state, dict) or state.get("kind") != type(self).__name__:
            got = state.get("kind") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"hook state is for {got!r}, this run uses {type(self).__name__!r}")


def _run_hook(state, bucket):  # no annotations: DDP compares them with the real classes
    """The function registered with DDP: ``state`` is the hook object."""
    return state.run(bucket)


class AllReduceHook(MeteredHook):
    """No compression: average the bucket with one all-reduce (DDP's default), metered."""

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        nbytes = buffer.numel() * buffer.element_size()
        start = time.perf_counter()
        buffer.div_(self.world_size)
        fut = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            self._record(
                "allreduce",
                send={"raw_bytes": nbytes, "wire_bytes": nbytes},
                recv={"recv_bytes": nbytes, "recv_seconds": time.perf_counter() - start},
            )
            return f.value()[0]

        return fut.then(done)


POWERSGD_OPTIONS = {
    "matrix_approximation_rank": 1,
    "start_powerSGD_iter": 2,
    "min_compression_rate": 2,
    "use_error_feedback": True,
    "warm_start": True,
    "orthogonalization_epsilon": 1e-8,
}
"""PowerSGD options and dgpipe's defaults (PyTorch's, except ``start_powerSGD_iter``:
2, the smallest it allows, instead of 1000, so that short runs are compressed, and
``orthogonalization_epsilon``: 1e-8 instead of 0, since Gram-Schmidt on an all-zero
column gave NaN losses on MobileNetV2 at rank 2)."""


class CastHook(MeteredHook):
    """PyTorch's ``fp16``/``bf16`` hooks (``default_hooks.fp16_compress_hook`` /
    ``bf16_compress_hook``: cast, divide by the world size, all-reduce), metered.

    Wire bytes: the cast buffer, 2 bytes per value.
    """

    def __init__(self, kind: str, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(process_group)
        hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
        if kind not in hooks:
            raise ValueError(f"CastHook kind must be 'fp16' or 'bf16', got {kind!r}")
        self._hook = hooks[kind]

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        raw, wire = buffer.numel() * buffer.element_size(), buffer.numel() * 2
        start = time.perf_counter()

        def done(f: torch.futures.Future) -> torch.Tensor:
            self._record(
                "allreduce",
                send={"raw_bytes": raw, "wire_bytes": wire},
                recv={"recv_bytes": wire, "recv_seconds": time.perf_counter() - start},
            )
            return f.value()

        return self._hook(self.group, bucket).then(done)


class _OrderedBucket:
    """Stand-in for ``dist.GradBucket`` handed to PyTorch's PowerSGD hook: the same
    gradients, copied into one buffer in parameter order, always as bucket 0."""

    def __init__(self, buffer: torch.Tensor, gradients: list[torch.Tensor], is_last: bool) -> None:
        self._buffer, self._gradients, self._is_last = buffer, gradients, is_last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return self._is_last


class PowerSGDHook(MeteredHook):
    """PyTorch's PowerSGD hook (``powerSGD_hook.powerSGD_hook`` with a ``PowerSGDState``),
    metered and checkpointable.

    PowerSGD keys its memories (error feedback, warm-start ``P``/``Q``) by bucket index
    and layout, but DDP rebuilds its buckets after the first iteration of every process
    -- so after a resume the first step would see another layout. This hook therefore
    needs DDP to put all gradients in one bucket (:func:`dgpipe.baseline.ddp.build_ddp`
    sets ``bucket_cap_mb`` accordingly) and hands PowerSGD a copy of it in
    ``named_parameters()`` order, always as bucket 0: the layout PowerSGD sees never
    changes, and the state restores exactly.

    Args:
        named_parameters: ``(name, parameter)`` pairs of the module wrapped by DDP.
        options: any of :data:`POWERSGD_OPTIONS`.
        seed: seeds PowerSGD's random ``Q`` initialisation (equal on all ranks).

    Wire bytes: the growth of ``PowerSGDState.total_numel_after_compression`` in the
    call (the ``P`` and ``Q`` factors plus the tensors all-reduced uncompressed) times
    the element size; the whole buffer before ``start_powerSGD_iter``.

    State: ``iter``, ``error_dict``, ``p_memory_dict``, ``q_memory_dict``, the numpy RNG
    and the compression counters, as tensors and ints.
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        options: dict,
        seed: int = 0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(process_group)
        trainable = [p for _, p in named_parameters if p.requires_grad]
        self._order = {id(p): i for i, p in enumerate(trainable)}
        self.powersgd = powerSGD_hook.PowerSGDState(
            process_group, random_seed=seed % (1 << 32), **{**POWERSGD_OPTIONS, **options}
        )

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future:
        grads = bucket.gradients()
        try:
            positions = [self._order[id(p)] for p in bucket.parameters()]
        except KeyError:
            raise ValueError("a DDP bucket holds a parameter this hook was not built for") from None
        if len(positions) != len(self._order):
            raise ValueError(
                "PowerSGDHook needs all gradients in one DDP bucket; build DDP with a large bucket_cap_mb "
                "(dgpipe.baseline.build_ddp does)"
            )
        ordered = [grads[i] for i in sorted(range(len(grads)), key=positions.__getitem__)]
        flat = torch.cat([g.reshape(-1) for g in ordered])
        views = [v.view_as(g) for v, g in zip(torch.split(flat, [g.numel() for g in ordered]), ordered)]
        raw = flat.numel() * flat.element_size()
        state = self.powersgd
        before, compressing = state.total_numel_after_compression, state.iter >= state.start_powerSGD_iter
        start = time.perf_counter()
        fut = powerSGD_hook.powerSGD_hook(state, _OrderedBucket(flat, views, bucket.is_last()))
        wire = (state.total_numel_after_compression - before) * flat.element_size() if compressing else raw

        def done(f: torch.futures.Future) -> torch.Tensor:
            for g, v in zip(ordered, views):
                g.copy_(v)
            self._record(
                "allreduce",
                send={"raw_bytes": raw, "wire_bytes": wire},
                recv={"recv_bytes": wire, "recv_seconds": time.perf_counter() - start},
            )
            return bucket.buffer()

        return fut.then(done)

    def state_dict(self) -> dict:
        s = self.powersgd
        clone = lambda d: {int(k): v.detach().clone() for k, v in d.items()}  # noqa: E731
        _, keys, pos, has_gauss, cached = s.rng.get_state()
        return {
            **super().state_dict(),
            "iter": s.iter,
            "error_dict": clone(s.error_dict),
            "p_memory_dict": clone(s.p_memory_dict),
            "q_memory_dict": clone(s.q_memory_dict),
            "rng": {
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "total_numel_before_compression": s.total_numel_before_compression,
            "total_numel_after_compression": s.total_numel_after_compression,
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        s = self.powersgd
        try:
            rng = state["rng"]
            s.rng.set_state(
                ("MT19937", rng["keys"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"], rng["cached_gaussian"])
            )
            s.iter = int(state["iter"])
            for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
                setattr(s, name, {int(k): v.detach().clone() for k, v in state[name].items()})
            s.total_numel_before_compression = int(state["total_numel_before_compression"])
            s.total_numel_after_compression = int(state["total_numel_after_compression"])
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"corrupt powersgd hook state: {e!r}") from None
