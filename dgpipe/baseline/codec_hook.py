"""The generic DDP hook: any dgpipe codec on every parameter's gradient.

See :class:`CodecHook`; the exchanges and meter fields are described in
:mod:`dgpipe.baseline.hooks`.
"""

from __future__ import annotations

import inspect
import time
from typing import Iterable

import torch
import torch.distributed as dist

from dgpipe.comm.meter import timer
from dgpipe.comm.framing import FRAME_PREFIX_BYTES, frame_payloads, unframe_payloads
from dgpipe.comm.transport import wire_device
from dgpipe.compression import CodecSpec
from dgpipe.compression.base import Codec, Payload
from dgpipe.compression.gradients.core import mix_seed

from .hooks import MeteredHook

__all__ = ["LINEAR_CODECS", "CodecHook"]

LINEAR_CODECS = frozenset({"none", "fp16", "bf16", "randomk"})
"""Codecs whose decoded sum equals the sum of decodes (given equal headers on all ranks)."""


def _completed(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


class CodecHook(MeteredHook):
    """Generic hook: a dgpipe codec per parameter gradient, exchanged by all-reduce or all-gather.

    Args:
        named_parameters: ``(name, parameter)`` pairs of the module wrapped by DDP, in
            ``named_parameters()`` order (the order fixes the per-parameter seeds).
        codec: the encoders' :class:`~dgpipe.compression.CodecSpec` (options without
            ``seed``; ``error_feedback=True`` wraps every encoder in ``ErrorFeedback``, a
            residual per parameter).
        seed: base seed. Codecs that take a ``seed`` get ``mix_seed(seed, index)`` on the
            all-reduce exchange (equal on all ranks, as ``randomk`` needs) and
            ``mix_seed(seed, rank, index)`` on the all-gather exchange (independent
            randomness per rank, so that averaging reduces the variance).
        exchange: ``"auto"`` (all-reduce for :data:`LINEAR_CODECS`, else all-gather),
            ``"allreduce"`` (only for :data:`LINEAR_CODECS`) or ``"allgather"``.

    Raises:
        ValueError: ``"allreduce"`` for a non-linear codec, or an unknown ``exchange``.

    State (:meth:`state_dict`): ``{"encoders": {parameter name: encoder state}}`` for
    the encoders that have state (error-feedback residuals, DGC momenta, counters of
    seeded codecs).
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        codec: CodecSpec,
        *,
        seed: int = 0,
        exchange: str = "auto",
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(process_group)
        if exchange not in ("auto", "allreduce", "allgather"):
            raise ValueError(f"exchange must be 'auto', 'allreduce' or 'allgather', got {exchange!r}")
        if exchange == "allreduce" and codec.name not in LINEAR_CODECS:
            raise ValueError(f"codec {codec.name!r} cannot be all-reduced; use exchange='allgather' (or 'auto')")
        self.codec = codec.name
        linear = codec.name in LINEAR_CODECS
        self.exchange = exchange if exchange != "auto" else ("allreduce" if linear else "allgather")
        self.decoder = codec.build(error_feedback=False)
        seeded = "seed" in inspect.signature(type(self.decoder)).parameters
        self.encoders: dict[str, Codec] = {}
        self._names: dict[int, str] = {}
        for index, (name, param) in enumerate(named_parameters):
            if not param.requires_grad:
                continue
            if seeded:
                seed_of = mix_seed(seed, index) if self.exchange == "allreduce" else mix_seed(seed, self.rank, index)
                self.encoders[name] = codec.build(seed=seed_of)
            else:
                self.encoders[name] = codec.build()
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
        stop = timer(device)
        payloads, err = self._encode(grads, names, 1.0)
        blob = frame_payloads(payloads, dev) if payloads is not None else torch.empty(0, dtype=torch.uint8, device=dev)
        encode_seconds, t1 = stop(), time.perf_counter()
        size = torch.tensor([blob.numel() if err is None else -1], dtype=torch.int64, device=dev)
        sizes = [torch.empty_like(size) for _ in range(n)]
        dist.all_gather(sizes, size, group=self.group)
        sizes = [int(s) for s in torch.cat(sizes).tolist()]
        self._peer_failure(err, ", ".join(f"rank {r}" for r, s in enumerate(sizes) if s < 0))
        width = max(sizes)
        padded = torch.nn.functional.pad(blob, (0, width - blob.numel()))
        blobs = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(n)]
        dist.all_gather(blobs, padded, group=self.group)
        recv_seconds, stop = time.perf_counter() - t1, timer(device)
        sums = [torch.zeros(g.shape, dtype=torch.float32, device=device) for g in grads]
        for r in range(n):
            for acc, p in zip(sums, unframe_payloads(blobs[r][: sizes[r]], len(grads), device)):
                acc += self.decoder.decode(p).float()
        for g, acc in zip(grads, sums):
            g.copy_(acc.div_(n))
        decode_seconds = stop()
        fixed = FRAME_PREFIX_BYTES
        wire = sizes[self.rank] - fixed
        self._record(
            "allgather",
            send={
                "raw_bytes": sum(g.numel() * g.element_size() for g in grads),
                "wire_bytes": wire,
                "frame_bytes": fixed + (width - sizes[self.rank]) + 8,
                "encode_seconds": encode_seconds,
            },
            recv={
                "recv_bytes": sum(sizes) - sizes[self.rank] - (n - 1) * fixed,
                "recv_seconds": recv_seconds,
                "decode_seconds": decode_seconds,
            },
        )

    def _allreduce(self, device: torch.device, grads: list[torch.Tensor], names: list[str]) -> None:
        dev = wire_device(self.group)
        stop = timer(device)
        payloads, err = self._encode(grads, names, 1.0 / self.world_size)
        digest = mix_seed(*(v for p in payloads for v in p.header.tolist())) if payloads is not None else 0
        encode_seconds, t1 = stop(), time.perf_counter()
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
        recv_seconds, stop = time.perf_counter() - t1, timer(device)
        pos = 0
        for g, p in zip(grads, payloads):
            k = len(p.tensors)
            g.copy_(self.decoder.decode(Payload(p.header, tuple(tensors[pos : pos + k]))))
            pos += k
        decode_seconds = stop()
        wire = sum(t.numel() * t.element_size() for t in tensors)
        self._record(
            "allreduce",
            send={
                "raw_bytes": sum(g.numel() * g.element_size() for g in grads),
                "wire_bytes": wire,
                "frame_bytes": check.numel() * 8,
                "encode_seconds": encode_seconds,
            },
            recv={"recv_bytes": wire, "recv_seconds": recv_seconds, "decode_seconds": decode_seconds},
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
