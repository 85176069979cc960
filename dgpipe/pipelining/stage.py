"""``CompressedPipelineStage``: torch's ``PipelineStage`` with dgpipe codecs on its boundaries.

torch's pipeline schedules (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
``ScheduleZBVZeroBubble``, ...) move a stage's tensors by asking it for point-to-point ops --
``get_fwd_send_ops``, ``get_fwd_recv_ops``, ``get_bwd_send_ops``, ``get_bwd_recv_ops`` -- which
they batch and wait on, and then read what arrived through the stage's
``_retrieve_recv_activations`` / ``_retrieve_recv_grads``. This stage keeps torch's ops and
rewrites each one that carries a floating-point tensor:

- a send op sends the codec's payload of the tensor instead, packed into one uint8 message
  (:func:`dgpipe.comm.framing.pack_message`: int64 fields and headers, never pickled),
  activations with the forward codec and their gradients with the backward codec;
- a receive op receives into a uint8 buffer of exactly that message's size, which the
  receiver derives from the tensor's shape and dtype alone (torch pre-allocates its buffers
  from the same metadata): every codec here must be *fixed-rate* -- its payload's size a
  function of the shape and dtype, not of the values. The stage checks this when it is built
  (two unlike inputs must give payloads of one size) and at every send;
- before torch reads a received buffer, the message is validated -- its framing, and its header
  against the codec this stage expects and the shape and dtype of torch's buffer -- and only
  then decoded into it; a lying or corrupt message is refused with a ``ValueError`` that names
  the peer (and the launcher ends every rank).

Integer and boolean tensors (token ids, attention masks) travel as torch sends them (metered
at their own size).
Stages of one rank that pass tensors by function call (the V-shaped schedules) send nothing
and code nothing. Every coded message is recorded in :attr:`CompressedPipelineStage.meter`
(a :class:`~dgpipe.comm.BandwidthMeter`, boundary ``stage{i}->stage{j}``, directions
``forward`` and ``backward``, and ``eval`` for forward traffic while
:attr:`CompressedPipelineStage.evaluating` is set, as dgpipe's runtime names evaluation;
``recv_seconds`` stays 0: the schedule, not the stage, waits).

Codec state (error feedback) is kept per direction, micro-batch and tensor position, as in
dgpipe's own runtime. Refused at construction: codecs whose payload size depends on the
values (``atomo``, whose rank follows the spectrum; a codec that passes this check and
varies later, e.g. ``dgc`` on ties at its threshold, is stopped at its first odd send),
codecs of integers (``intpack``: a stage codes its floating-point
tensors only), and delta coding (it needs the examples'
ids, which torch's schedules do not pass).

torch infers a stage's output shapes by running it once on tensors it materialises, uninitialised, from the
metadata the previous stage sent; integer tensors among them (token ids that index a table on this stage, e.g.
anchored bottlenecks' or a residual subspace's) are materialised as zeros here instead, so that run indexes
in range.

This module holds every use of torch's private pipelining API: three private methods are
wrapped (``_retrieve_recv_activations``, ``_retrieve_recv_grads``, ``_to_tensor``) and four public ones
rewritten; :data:`TESTED_TORCH` names the versions the tests ran against, and another
version gets a warning at construction (:func:`check_torch_version`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from dgpipe.comm import BandwidthMeter
from dgpipe.comm.link import Link
from dgpipe.comm.framing import message_size
from dgpipe.compression import Codec, parse_header
from dgpipe.pipeline.boundary import boundary_name
from dgpipe.pipeline.coders import CodecArg, codec_factory
from dgpipe.pipeline.tied import TiedParameters

__all__ = ["TESTED_TORCH", "UNTESTED_TORCH_ENV", "CompressedPipelineStage", "check_torch_version"]

#: ``major.minor`` versions of torch whose pipelining internals the tests cover (``benchmarks/torch_versions.sh``).
TESTED_TORCH = ("2.13", "2.14", "2.15")

#: Set to 1 to silence the warning about a torch outside :data:`TESTED_TORCH`.
UNTESTED_TORCH_ENV = "DGPIPE_UNTESTED_TORCH"

#: Probe inputs of the fixed-rate check: unlike values, one shape.
_PROBE_SHAPE = (3, 5, 40)


def check_torch_version(version: str | None = None) -> bool:
    """Whether ``version`` (default ``torch.__version__``) is a :data:`TESTED_TORCH` release; warns where not.

    Warns:
        RuntimeWarning: naming the tested versions and how to silence it (``DGPIPE_UNTESTED_TORCH=1``) --
        torch's private pipelining internals may have changed; the run goes on.
    """
    version = torch.__version__ if version is None else version
    tested = ".".join(version.split("+")[0].split(".")[:2]) in TESTED_TORCH
    if not tested and os.environ.get(UNTESTED_TORCH_ENV) != "1":
        warnings.warn(f"CompressedPipelineStage relies on torch.distributed.pipelining internals tested with torch "
                      f"{', '.join(TESTED_TORCH)}; this is torch {version}, so it may fail or differ. Set "
                      f"{UNTESTED_TORCH_ENV}=1 to go on without this warning, or use dgpipe's own runtime "
                      "(dgpipe.pipeline.Pipeline)", RuntimeWarning, stacklevel=3)
    return tested


def _fixed_rate(make: Any, direction: str) -> None:
    """Raise ValueError unless the codec's payload size depends on shape and dtype alone."""
    codec = make()
    if not isinstance(codec, Codec):
        raise ValueError(f"{direction} codec: {codec!r} is not a Codec (delta coding needs the examples' ids, "
                         "which torch's schedules do not pass)")
    g = torch.Generator().manual_seed(0)
    probes = (torch.zeros(_PROBE_SHAPE), torch.randn(_PROBE_SHAPE, generator=g) * 1e3,
              torch.randint(-3, 4, _PROBE_SHAPE, generator=g).float())
    try:
        sizes = {codec.encode(x).nbytes for x in probes}  # one instance: a stateful codec's size may drift
    except (ValueError, TypeError) as e:
        raise ValueError(f"{direction} codec {codec!r} cannot code the floating-point tensors a stage sends: "
                         f"{e}") from None
    if len(sizes) > 1:
        raise ValueError(f"{direction} codec {codec!r}: its payload size depends on the values ({sorted(sizes)} bytes "
                         f"for one shape); torch's schedules post receives of a size fixed by the shape. Use a "
                         "fixed-rate codec (none, fp16, bf16, quant, sortquant, codebook, topk)")


class CompressedPipelineStage(PipelineStage):
    """A ``torch.distributed.pipelining.PipelineStage`` whose floating-point boundary tensors cross
    as dgpipe codec payloads (module docstring). Use it wherever torch takes a ``PipelineStage``.
    On a GPU the decoders read nothing back: call :func:`dgpipe.compression.raise_deferred` after each
    ``schedule.step`` (as dgpipe's torch engine does) to raise a payload's refusal (inf/NaN sent).

    Args:
        submodule, stage_index, num_stages, device, group, ...: as ``PipelineStage`` (keywords
            after ``device`` pass through).
        act_codec: forward codec of the activations this stage sends: a
            :class:`~dgpipe.compression.CodecSpec`, a codec name, ``(name, options)``, or a
            factory (see :func:`dgpipe.pipeline.coders.codec_factory`); ``None``: ``"none"``
            (raw float32 payloads).
        grad_codec: backward codec of the gradients this stage sends; ``None``: ``act_codec``.
            Each direction puts its own bits on the wire.
        meter: a :class:`~dgpipe.comm.BandwidthMeter` to record into (default: a new one).
        tied: the parameters this stage shares with stages on other ranks (tied input/output embeddings:
            :class:`~dgpipe.pipeline.tied.TiedParameters` of the full partition, built alike on every rank). The
            stage sums their gradients over the ranks that hold them at the end of every training step (torch's
            ``perform_reduce_grad``, which ``ScheduleGPipe`` and ``Schedule1F1B`` call once the rank's last backward
            is done), so each copy holds the unsplit model's gradient before the optimizer steps. Without it, a
            partition that cuts between tied layers trains two different copies.

    Attributes:
        meter: the traffic (module docstring).
        evaluating: record forward traffic as ``eval`` (set it around ``schedule.eval``).

    Raises:
        RuntimeError: an untested torch (:func:`check_torch_version`).
        ValueError: a codec that is not fixed-rate, an unknown codec or bad options; ``tied`` parameters on a rank
            that holds several stages (torch's multi-stage schedules call no hook at the end of a step there: call
            ``tied.sum_gradients()`` after ``schedule.step`` instead, as dgpipe's torch engine does).
    """

    def __init__(self, submodule: torch.nn.Module, stage_index: int, num_stages: int, device: torch.device,
                 *args: Any, act_codec: CodecArg | None = None, grad_codec: CodecArg | None = None,
                 meter: BandwidthMeter | None = None, tied: TiedParameters | None = None, **kwargs: Any) -> None:
        check_torch_version()
        if tied and tied.stages_here > 1:
            raise ValueError(f"stage {stage_index}: tied parameters across ranks, and this rank holds "
                             f"{tied.stages_here} stages: torch's multi-stage schedules give a stage no end-of-step "
                             "hook; pass tied=None and call tied.sum_gradients() after each schedule.step")
        act = codec_factory("none" if act_codec is None else act_codec)
        grad = act if grad_codec is None else codec_factory(grad_codec)
        _fixed_rate(act, "forward")
        _fixed_rate(grad, "backward")
        super().__init__(submodule, stage_index, num_stages, device, *args, **kwargs)
        self._factories = {"forward": act, "backward": grad}
        self._codecs: dict[tuple[str, int, int], Codec] = {}
        self._sizes: dict[tuple[str, tuple[int, ...], torch.dtype], int] = {}
        self._pending: dict[tuple[str, int], list[tuple[torch.Tensor, torch.Tensor, str, int, int]]] = {}
        self.meter = BandwidthMeter() if meter is None else meter
        self._tied = tied
        self.evaluating = False

    # -- sizes and coding ------------------------------------------------------------------

    def _codec(self, direction: str, chunk: int, position: int) -> Codec:
        key = (direction, chunk, position)
        if key not in self._codecs:
            self._codecs[key] = self._factories[direction]()
        return self._codecs[key]

    def message_nbytes(self, direction: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes of the message that carries a ``shape``/``dtype`` tensor in ``direction``
        (``"forward"`` or ``"backward"``): derived by coding zeros once per shape, with a
        fresh codec (no state is touched)."""
        key = (direction, tuple(shape), dtype)
        if key not in self._sizes:
            payload = self._factories[direction]().encode(torch.zeros(shape, dtype=dtype))
            self._sizes[key] = message_size([payload])
        return self._sizes[key]

    def _label(self, direction: str) -> str:
        return "eval" if self.evaluating and direction == "forward" else direction

    def _boundary(self, upstream: int) -> str:
        """Name of the boundary between stage ``upstream`` and the next, as dgpipe's runtime names it."""
        return boundary_name(upstream)

    def _link(self, name: str) -> Link:
        """The metered link of boundary ``name`` (records into :attr:`meter`)."""
        return Link(name, self.meter, device=self.device)

    def _coded_sends(self, ops: list[dist.P2POp], direction: str, chunk: int, name: str) -> list[dist.P2POp]:
        out, link, label = [], self._link(name), self._label(direction)
        for position, op in enumerate(ops):
            t = op.tensor
            if not t.is_floating_point():  # sent as torch sends it, and metered as such
                n = t.numel() * t.element_size()
                link.sent(label, raw_bytes=n, wire_bytes=n)
                out.append(op)
                continue
            with torch.no_grad(), link.encoding(label) as message:
                message.add(self._codec(direction, chunk, position).encode(t.detach()), t.numel() * t.element_size())
            size, fixed = message_size(message.payloads), self.message_nbytes(direction, t.shape, t.dtype)
            if size != fixed:
                raise ValueError(f"stage {self.stage_index}: the {direction} codec gave a {size}-byte message for a "
                                 f"{tuple(t.shape)} tensor, not the {fixed} bytes its shape implies: it is not "
                                 "fixed-rate")
            buf = link.frame(message, t.device)
            out.append(dist.P2POp(dist.isend, buf, op.peer, op.group, op.tag))
        return out

    def _coded_recvs(self, ops: list[dist.P2POp], direction: str, chunk: int, name: str) -> list[dist.P2POp]:
        out, pending = [], []
        for position, op in enumerate(ops):
            t = op.tensor
            if not t.is_floating_point():
                self._link(name).received(self._label(direction), recv_bytes=t.numel() * t.element_size())
                out.append(op)
                continue
            # zeroed: a message cut short leaves zeros where its closing word belongs (read_message refuses it)
            buf = torch.zeros(self.message_nbytes(direction, t.shape, t.dtype), dtype=torch.uint8, device=t.device)
            pending.append((buf, t, name, op.peer, position))
            out.append(dist.P2POp(dist.irecv, buf, op.peer, op.group, op.tag))
        self._pending[(direction, chunk)] = pending
        return out

    def _decode_pending(self, direction: str, chunk: int) -> None:
        """Decode the received messages of ``(direction, chunk)`` into torch's receive buffers, each
        after its header is checked against what this stage expects: its codec, and the shape and
        dtype of torch's buffer. A refused message is not decoded.

        Raises:
            ValueError: a corrupt or lying message (names the stage, the direction, the peer and the field).
        """
        for buf, target, name, peer, position in self._pending.pop((direction, chunk), []):
            codec, link = self._codec(direction, chunk, position), self._link(name)
            try:
                incoming = link.unframe(buf, peer, target.device)
                with link.decoding(self._label(direction), incoming):
                    (payload,) = incoming.payloads
                    header = parse_header(payload.header, codec.codec_id)
                    if header.shape != tuple(target.shape) or header.dtype != target.dtype:
                        raise ValueError(f"its header declares a {header.dtype} {header.shape} tensor, torch's "
                                         f"buffer is {target.dtype} {tuple(target.shape)}")
                    value = codec.decode(payload)
                    with torch.no_grad():
                        target.copy_(value)
            except ValueError as e:
                raise ValueError(f"stage {self.stage_index}: corrupt {direction} message from rank {peer} "
                                 f"(micro-batch {chunk}): {e}") from None

    # -- torch's hooks ----------------------------------------------------------------------

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """torch's end of a step's backward (the gradients scaled), then the tied parameters' gradients summed
        over the ranks that hold them (``tied``)."""
        super().perform_reduce_grad(grad_scale_factor)
        if self._tied and self.has_backward:
            self._tied.sum_gradients()

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        """torch's forward sends, each floating tensor replaced by its coded message."""
        return self._coded_sends(super().get_fwd_send_ops(fwd_chunk_id), "forward", fwd_chunk_id,
                                 self._boundary(self.stage_index))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        """torch's gradient sends, each floating tensor replaced by its coded message."""
        return self._coded_sends(super().get_bwd_send_ops(bwd_chunk_id), "backward", bwd_chunk_id,
                                 self._boundary(self.stage_index - 1))

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        """torch's activation receives, into message buffers of the size the shape implies."""
        return self._coded_recvs(super().get_fwd_recv_ops(fwd_chunk_id), "forward", fwd_chunk_id,
                                 self._boundary(self.stage_index - 1))

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        """torch's gradient receives, into message buffers of the size the shape implies."""
        return self._coded_recvs(super().get_bwd_recv_ops(bwd_chunk_id), "backward", bwd_chunk_id,
                                 self._boundary(self.stage_index))

    def _to_tensor(self, arg: Any) -> torch.Tensor:
        """torch's tensor of a metadata record for its shape inference, zeros where it is an integer tensor."""
        tensor = super()._to_tensor(arg)  # type: ignore[misc]
        if not isinstance(arg, torch.Tensor) and not tensor.is_floating_point():
            tensor.zero_()
        return tensor

    def _retrieve_recv_activations(self, fwd_chunk_id: int):
        self._decode_pending("forward", fwd_chunk_id)
        return super()._retrieve_recv_activations(fwd_chunk_id)

    def _retrieve_recv_grads(self, bwd_chunk_id: int):
        self._decode_pending("backward", bwd_chunk_id)
        return super()._retrieve_recv_grads(bwd_chunk_id)
