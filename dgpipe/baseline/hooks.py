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
- :class:`CodecHook`: any dgpipe codec, applied to each parameter's gradient in the
  bucket (layer-wise, as the gradient compression papers do; matrix codecs such as
  ``atomo`` and ``lowrank`` see the parameter's own matrix), with one encoder per
  parameter (keyed by parameter name, so its state survives DDP's bucket rebuild after
  the first iteration and a resume in a new process), optionally wrapped in
  :class:`~dgpipe.compression.feedback.ErrorFeedback`. Two exchanges:

  * ``"allreduce"`` for codecs whose decode is linear in the payload and whose headers
    agree on every rank (``none``, ``fp16``, ``bf16``, ``randomk`` with a shared seed):
    each rank encodes ``gradient / world_size``, the payload tensors are summed by one
    all-reduce per dtype, and the sum is decoded. The headers do not travel; a 3-value
    all-reduce checks that all ranks made identical headers (a digest) and that none
    failed to encode.
  * ``"allgather"`` for all the others (``topk``, ``onebit``, ``qsgd``, ``terngrad``,
    ``dgc``, ``atomo``, ``quant``, ``sortquant``, ``lowrank``): every rank frames its
    bucket's payloads into one byte buffer (:func:`frame_payloads`), the byte counts are
    all-gathered, the buffers are padded to the largest and all-gathered, and every
    rank decodes every rank's payloads (headers validated) and averages them in rank
    order -- so all ranks end with bit-identical gradients. ``lowrank`` goes here: its
    per-rank factors ``P_r Q_r^T`` do not sum to a low-rank factorisation of the sum
    (PowerSGD's shared ``Q`` is what makes that work; use ``powersgd`` for it).

  A rank whose encode fails still joins the first exchange with an error flag, so
  every rank raises a clear error instead of waiting forever in a collective.

:class:`CodecHook` runs synchronously (it returns a completed future); the others
return PyTorch's asynchronous futures, and their seconds run from the hook call to
the completion of the future.

Meter fields per bucket exchange (``direction`` is ``"allreduce"`` or ``"allgather"``):
``raw_bytes`` the bucket's gradients uncompressed; ``wire_bytes`` the bytes this rank
contributes: the payloads (``Payload.nbytes``) for all-gather, the payload tensors
(headers stay home) for the generic all-reduce, the (cast or PowerSGD-factor) buffer
for the others; ``frame_bytes`` sizes, framing, padding and header digests;
``recv_bytes`` the payload bytes received from the other ranks (all-gather) or the
size of the reduced buffer (all-reduce; the collective's algorithm, e.g. a ring that
moves ``2 (N-1)/N`` times the buffer, is not modelled); ``recv_seconds`` seconds in
the collectives; ``encode_seconds``/``decode_seconds`` seconds in the codec.
"""

from __future__ import annotations

import inspect
import time
from typing import Iterable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from dgpipe.comm.meter import BandwidthMeter
from dgpipe.comm.transport import wire_device
from dgpipe.compression.base import Codec, Payload, get_codec, parse_header
from dgpipe.compression.feedback import ErrorFeedback
from dgpipe.compression.gradbase import mix_seed

__all__ = [
    "METER_NAME",
    "LINEAR_CODECS",
    "FRAME_MAGIC",
    "AllReduceHook",
    "CastHook",
    "PowerSGDHook",
    "POWERSGD_OPTIONS",
    "CodecHook",
    "frame_payloads",
    "unframe_payloads",
]

METER_NAME = "ddp"
LINEAR_CODECS = frozenset({"none", "fp16", "bf16", "randomk"})
"""Codecs whose decoded sum equals the sum of decodes (given equal headers on all ranks)."""
FRAME_MAGIC = 0x64677066  # "dgpf"
_MAX_HEADER_NUMEL = 1 << 12


def _now(device: torch.device) -> float:
    """Wall clock in seconds, after the device's queued work (CUDA) has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _completed(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def frame_payloads(payloads: Iterable[Payload], device: torch.device) -> torch.Tensor:
    """Frame several payloads into one 1-D ``uint8`` tensor on ``device`` (no pickling).

    Layout: ``int64 [FRAME_MAGIC, count, header_numel_1..count, header_1, ..., header_count]``
    followed by every payload's tensors' bytes, in order. Frame bytes beyond the
    payloads: ``8 * (2 + count)``.
    """
    payloads = list(payloads)
    ints = [FRAME_MAGIC, len(payloads)] + [p.header.numel() for p in payloads]
    head = torch.cat([torch.tensor(ints, dtype=torch.int64)] + [p.header for p in payloads])
    parts = [head.view(torch.uint8).to(device)]
    parts += [t.reshape(-1).contiguous().view(torch.uint8).to(device) for p in payloads for t in p.tensors]
    return torch.cat(parts)


def unframe_payloads(blob: torch.Tensor, count: int, device: torch.device) -> list[Payload]:
    """Inverse of :func:`frame_payloads`: ``count`` payloads, tensors on ``device``.

    Every header is validated with :func:`~dgpipe.compression.base.parse_header`
    and the byte count must match exactly.

    Raises:
        ValueError: naming the field that is corrupt or inconsistent.
    """
    nbytes = blob.numel()
    fixed = 8 * (2 + count)
    if blob.dtype != torch.uint8 or nbytes < fixed:
        raise ValueError(f"corrupt frame: {nbytes} bytes, need at least {fixed} for {count} payloads")
    prefix = blob[:fixed].cpu().clone().view(torch.int64).tolist()
    if prefix[0] != FRAME_MAGIC or prefix[1] != count:
        raise ValueError(f"corrupt frame: field 'magic/count' = {prefix[:2]}, expected [{FRAME_MAGIC}, {count}]")
    lengths = prefix[2:]
    if any(not 4 <= n <= _MAX_HEADER_NUMEL for n in lengths) or fixed + 8 * sum(lengths) > nbytes:
        raise ValueError(f"corrupt frame: field 'header_numel' = {lengths} out of range")
    pos = fixed + 8 * sum(lengths)
    ints = blob[fixed:pos].cpu().clone().view(torch.int64)
    headers, sizes = [], []
    for h in torch.split(ints, lengths):
        spec = parse_header(h)
        headers.append(h)
        sizes.append([(dt, n * torch.empty(0, dtype=dt).element_size()) for dt, n in spec.tensor_specs])
    if pos + sum(b for s in sizes for _, b in s) != nbytes:
        raise ValueError(f"corrupt frame: {nbytes} bytes but the headers announce a different total")
    payloads = []
    for h, spec in zip(headers, sizes):
        tensors = []
        for dt, b in spec:
            tensors.append(blob[pos : pos + b].to(device).clone().view(dt))
            pos += b
        payloads.append(Payload(h, tuple(tensors)))
    return payloads


class _MeteredHook:
    """Common part of the hooks: process group, meters, registration, state API."""

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.meter = BandwidthMeter()
        self.step_meter = BandwidthMeter()

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Register this hook on ``ddp`` (once, before the first backward)."""
        ddp.register_comm_hook(state=self, hook=_run_hook)

    def _record(self, direction: str, *, send: dict, recv: dict) -> None:
        for m in (self.meter, self.step_meter):
            m.record_send(METER_NAME, direction, **send)
            m.record_recv(METER_NAME, direction, **recv)

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future:
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


class AllReduceHook(_MeteredHook):
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
    "orthogonalization_epsilon": 0,
}
"""PowerSGD options and dgpipe's defaults (PyTorch's, except ``start_powerSGD_iter``:
2, the smallest it allows, instead of 1000, so that short runs are compressed)."""


class CastHook(_MeteredHook):
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


class PowerSGDHook(_MeteredHook):
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


class CodecHook(_MeteredHook):
    """Generic hook: a dgpipe codec per parameter gradient, exchanged by all-reduce or all-gather.

    Args:
        named_parameters: ``(name, parameter)`` pairs of the module wrapped by DDP, in
            ``named_parameters()`` order (the order fixes the per-parameter seeds).
        codec: registered codec name (``dgpipe.compression.available_codecs()``).
        codec_options: keyword options of the codec, without ``seed``.
        seed: base seed. Codecs that take a ``seed`` get ``mix_seed(seed, index)`` on the
            all-reduce exchange (equal on all ranks, as ``randomk`` needs) and
            ``mix_seed(seed, rank, index)`` on the all-gather exchange (independent
            randomness per rank, so that averaging reduces the variance).
        error_feedback: wrap every encoder in ``ErrorFeedback`` (residual per parameter).
        exchange: ``"auto"`` (all-reduce for :data:`LINEAR_CODECS`, else all-gather),
            ``"allreduce"`` (only for :data:`LINEAR_CODECS`) or ``"allgather"``.

    Raises:
        ValueError: unknown codec or options, or ``"allreduce"`` for a non-linear codec.

    State (:meth:`state_dict`): ``{"encoders": {parameter name: encoder state}}`` for
    the encoders that have state (error-feedback residuals, DGC momenta, counters of
    seeded codecs).
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        codec: str,
        codec_options: dict,
        *,
        seed: int = 0,
        error_feedback: bool = False,
        exchange: str = "auto",
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(process_group)
        if exchange not in ("auto", "allreduce", "allgather"):
            raise ValueError(f"exchange must be 'auto', 'allreduce' or 'allgather', got {exchange!r}")
        if exchange == "allreduce" and codec not in LINEAR_CODECS:
            raise ValueError(f"codec {codec!r} cannot be all-reduced; use exchange='allgather' (or 'auto')")
        self.codec = codec
        self.exchange = exchange if exchange != "auto" else ("allreduce" if codec in LINEAR_CODECS else "allgather")
        self.decoder = get_codec(codec, **codec_options)
        seeded = "seed" in inspect.signature(type(self.decoder)).parameters
        self.encoders: dict[str, Codec] = {}
        self._names: dict[int, str] = {}
        for index, (name, param) in enumerate(named_parameters):
            if not param.requires_grad:
                continue
            opts = dict(codec_options)
            if seeded:
                opts["seed"] = mix_seed(seed, index) if self.exchange == "allreduce" else mix_seed(seed, self.rank, index)
            encoder = get_codec(codec, **opts)
            self.encoders[name] = ErrorFeedback(encoder) if error_feedback else encoder
            self._names[id(param)] = name

    def _bucket_names(self, bucket: dist.GradBucket) -> list[str]:
        try:
            return [self._names[id(p)] for p in bucket.parameters()]
        except KeyError:
            raise ValueError("a DDP bucket holds a parameter this hook was not built for") from None

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        grads, names = bucket.gradients(), self._bucket_names(bucket)
        if self.exchange == "allreduce":
            self._allreduce(buffer.device, grads, names)
        else:
            self._allgather(buffer.device, grads, names)
        return _completed(buffer)

    def _encode(self, grads: list[torch.Tensor], names: list[str], scale: float):
        """Encode every gradient (times ``scale``); returns ``(payloads, None)`` or ``(None, error)``."""
        try:
            return [self.encoders[n].encode(g * scale if scale != 1 else g) for g, n in zip(grads, names)], None
        except Exception as err:  # noqa: BLE001 -- reported to the peers, then re-raised
            return None, err

    def _peer_failure(self, err: BaseException | None, failed: str) -> None:
        """Raise on every rank once any rank failed to encode (``failed`` names the peers)."""
        if err is not None:
            raise RuntimeError(f"rank {self.rank} failed to encode its gradients ({self.codec}): {err}") from err
        if failed:
            raise RuntimeError(
                f"{failed} failed to encode its gradients ({self.codec}); see its error. Rank {self.rank} stops too."
            )

    def _allgather(self, device: torch.device, grads: list[torch.Tensor], names: list[str]) -> None:
        dev = wire_device(self.group)
        n = self.world_size
        t0 = _now(device)
        payloads, err = self._encode(grads, names, 1.0)
        blob = frame_payloads(payloads, dev) if payloads is not None else torch.empty(0, dtype=torch.uint8, device=dev)
        t1 = _now(device)
        size = torch.tensor([blob.numel() if err is None else -1], dtype=torch.int64, device=dev)
        sizes = [torch.empty_like(size) for _ in range(n)]
        dist.all_gather(sizes, size, group=self.group)
        sizes = [int(s) for s in torch.cat(sizes).tolist()]
        self._peer_failure(err, ", ".join(f"rank {r}" for r, s in enumerate(sizes) if s < 0))
        width = max(sizes)
        padded = torch.nn.functional.pad(blob, (0, width - blob.numel()))
        blobs = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(n)]
        dist.all_gather(blobs, padded, group=self.group)
        t2 = _now(device)
        sums = [torch.zeros(g.shape, dtype=torch.float32, device=device) for g in grads]
        for r in range(n):
            for acc, p in zip(sums, unframe_payloads(blobs[r][: sizes[r]], len(grads), device)):
                acc += self.decoder.decode(p).float()
        for g, acc in zip(grads, sums):
            g.copy_(acc.div_(n))
        t3 = _now(device)
        fixed = 8 * (2 + len(grads))
        wire = sizes[self.rank] - fixed
        self._record(
            "allgather",
            send={
                "raw_bytes": sum(g.numel() * g.element_size() for g in grads),
                "wire_bytes": wire,
                "frame_bytes": fixed + (width - sizes[self.rank]) + 8,
                "encode_seconds": t1 - t0,
            },
            recv={
                "recv_bytes": sum(sizes) - sizes[self.rank] - (n - 1) * fixed,
                "recv_seconds": t2 - t1,
                "decode_seconds": t3 - t2,
            },
        )

    def _allreduce(self, device: torch.device, grads: list[torch.Tensor], names: list[str]) -> None:
        dev = wire_device(self.group)
        t0 = _now(device)
        payloads, err = self._encode(grads, names, 1.0 / self.world_size)
        digest = mix_seed(*(v for p in payloads for v in p.header.tolist())) if payloads is not None else 0
        t1 = _now(device)
        check = torch.tensor([int(err is not None), digest, -digest], dtype=torch.int64, device=dev)
        dist.all_reduce(check, op=dist.ReduceOp.MAX, group=self.group)
        failed, hi, neg_lo = check.tolist()
        self._peer_failure(err, "another rank" if failed else "")
        if hi != digest or -neg_lo != digest:
            raise RuntimeError(
                f"ranks encoded {self.codec} payloads with different headers (seeds, steps or shapes differ); "
                "they cannot be all-reduced -- use exchange='allgather'"
            )
        tensors = [t for p in payloads for t in p.tensors]
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            group = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            flat = torch.cat([tensors[i].reshape(-1) for i in group]).to(dev)
            dist.all_reduce(flat, group=self.group)
            for i, part in zip(group, torch.split(flat, [tensors[i].numel() for i in group])):
                tensors[i] = part.to(device)
        t2 = _now(device)
        pos = 0
        for g, p in zip(grads, payloads):
            k = len(p.tensors)
            g.copy_(self.decoder.decode(Payload(p.header, tuple(tensors[pos : pos + k]))))
            pos += k
        t3 = _now(device)
        wire = sum(t.numel() * t.element_size() for t in tensors)
        self._record(
            "allreduce",
            send={
                "raw_bytes": sum(g.numel() * g.element_size() for g in grads),
                "wire_bytes": wire,
                "frame_bytes": check.numel() * 8,
                "encode_seconds": t1 - t0,
            },
            recv={"recv_bytes": wire, "recv_seconds": t2 - t1, "decode_seconds": t3 - t2},
        )

    def set_epoch(self, epoch: int) -> None:
        for encoder in self.encoders.values():
            if hasattr(encoder, "set_epoch"):
                encoder.set_epoch(epoch)

    def state_dict(self) -> dict:
        encoders = {n: e.state_dict() for n, e in self.encoders.items() if hasattr(e, "state_dict")}
        return {**super().state_dict(), "codec": self.codec, "encoders": encoders}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if state.get("codec") != self.codec:
            raise ValueError(f"hook state is for codec {state.get('codec')!r}, this run uses {self.codec!r}")
        saved = state.get("encoders", {})
        mine = {n for n, e in self.encoders.items() if hasattr(e, "state_dict")}
        if set(saved) != mine:
            raise ValueError(
                f"hook state does not fit this model: missing {sorted(mine - set(saved))[:5]}, "
                f"unexpected {sorted(set(saved) - mine)[:5]}"
            )
        for name, s in saved.items():
            self.encoders[name].load_state_dict(s)
