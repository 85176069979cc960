"""``Pipeline``: runs this rank's part of a GPipe micro-batch pipeline with compressed boundaries.

Every rank builds the same ``Pipeline`` from the same full partition; each keeps only
the stages its placement gives it. ``train_step`` splits the mini-batch into
``chunks`` micro-batches, runs this rank's forward tasks, then its backward tasks
(:mod:`dgpipe.pipeline.schedule`), exchanging activations and gradients with the
neighbouring ranks through :class:`~dgpipe.pipeline.boundary.Boundary` objects;
gradients accumulate in the local stages' parameters, and the caller steps its
optimizer on :meth:`Pipeline.parameters`.

Semantics (GPipe, Huang et al. 2019): the loss is the mean over micro-batches of
``loss_fn(output_m, target_m)``, so with equal micro-batches and a mean-reduced loss
it equals the loss of the whole mini-batch, and -- uncompressed -- the gradients
equal those of the unsplit model run micro-batch by micro-batch with gradient
accumulation. The loss travels from the last stage to every other rank inside the
backward messages (no collective). Plain BatchNorm normalises and tracks statistics
per micro-batch; ``deferred_batchnorm=True`` (torchgpipe's ``DeferredBatchNorm``)
still normalises per micro-batch but updates the running statistics once per
mini-batch.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torchgpipe.batchnorm import DeferredBatchNorm
from torchgpipe.microbatch import Batch, gather

from dgpipe.comm import BandwidthMeter
from dgpipe.comm.delay import DelayLine
from dgpipe.compression import raise_deferred
from dgpipe.compression.wrappers.delta import check_ids
from dgpipe.models.example_dropout import example_ids

from .boundary import Boundary, boundary_name
from .coders import CodecArg, codec_factories, coder_states, load_coder_states
from .microbatch import batch_size, detach, split_batch
from .partition import validate_placement
from .schedule import StepState, Task, gpipe_tasks, segments
from .spec import BoundarySpec
from .tied import TiedParameters, unique_parameters

__all__ = ["Pipeline"]


def _check_options(chunks, timeout) -> None:
    """Check :class:`Pipeline`'s ``chunks`` and ``timeout``.

    Raises:
        ValueError: the first that is out of range.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int (micro-batches per mini-batch), got {chunks!r}")
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


class Pipeline:
    """This rank's part of a GPipe pipeline over ``stages`` placed on ranks by ``placement``.

    Args:
        stages: the full partition, identical on every rank (e.g. from
            :func:`~dgpipe.pipeline.partition.split_layers`). Stage i receives stage
            i-1's output as its one argument (a tensor or a tuple of tensors, as in
            ``nn.Sequential``). Only this rank's stages are kept and moved to ``device``.
        placement: ``placement[i]`` = global rank holding stage i; every rank of the
            world must hold a stage.
        rank: this process's global rank (default: ``torch.distributed.get_rank()``;
            0 when torch.distributed is not initialised, which allows a one-process
            pipeline with every stage on rank 0).
        chunks: micro-batches per mini-batch (M).
        loss_fn: ``(output, target) -> scalar`` mean loss of one micro-batch; needed
            on the rank holding the last stage.
        act_codec: codec for activations crossing a boundary: a
            :class:`~dgpipe.compression.CodecSpec`, a name, a ``(name, options)`` tuple
            (made a ``CodecSpec``), a zero-argument factory, a stateless codec, or
            a list with one such spec per stage boundary (``len(stages) - 1``).
        grad_codec: the same for gradients; ``None`` means the same as ``act_codec``.
        device: this rank's device (CPU client and GPU server may differ).
        timeout: seconds any receive or send may block before the step fails with
            an error naming the peer.
        deferred_batchnorm: convert BatchNorm layers to torchgpipe's
            ``DeferredBatchNorm`` (running statistics per mini-batch; inputs must be
            at least 3-D). Default off: plain BatchNorm per micro-batch.
        boundary: what every boundary carries besides its codecs and how (a
            :class:`~dgpipe.pipeline.spec.BoundarySpec`: evaluation coded or not, delta coding, sample ids, the
            row mask of padding rows left behind, the per-token reference, an emulated link latency). The same
            on every rank.
        delta_report: with ``boundary.delta``, called with one line per cache allocation (size in examples x
            values x bytes); default ``print``.

    Raises:
        ValueError: bad placement, ``chunks``, ``timeout``, rank, codec or delta spec.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        placement: Sequence[int],
        rank: int | None = None,
        chunks: int = 1,
        loss_fn: Callable | None = None,
        act_codec: CodecArg | list = "none",
        grad_codec: CodecArg | list | None = None,
        device: torch.device | str = "cpu",
        timeout: float = 300.0,
        deferred_batchnorm: bool = False,
        boundary: BoundarySpec = BoundarySpec(),
        delta_report: Callable[[str], None] | None = print,
    ) -> None:
        stages = list(stages)
        if not stages or any(not isinstance(s, nn.Module) for s in stages):
            raise ValueError("stages must be a non-empty list of nn.Module")
        initialized = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size() if initialized else 1
        actual_rank = dist.get_rank() if initialized else 0
        if rank is None:
            rank = actual_rank
        if rank != actual_rank:
            raise ValueError(f"rank={rank} but this process is rank {actual_rank} of torch.distributed")
        self._placement = validate_placement(placement, len(stages), world_size)
        n_boundaries = len(stages) - 1
        _check_options(chunks, timeout)
        if not isinstance(boundary, BoundarySpec):
            raise ValueError(f"boundary must be a BoundarySpec, got {type(boundary).__name__}")
        boundary.check(n_boundaries)
        delay = DelayLine(boundary.link_delay) if boundary.link_delay > 0 else None
        # gloo keeps one TCP connection per pair of ranks, and on it a message each way at once takes as long as
        # the two one after the other (benchmarks/gloo_duplex.py over tbf links: 1.9-2.0x the one-way time; on
        # two connections 1.0-1.3x): messages to a lower rank take a second process group, with connections of
        # their own, so a link busy both ways (activations one way, answers the other) keeps its rate each way.
        down = (dist.new_group(list(range(world_size))) if initialized and world_size > 1
                and dist.get_backend() == "gloo" else None)
        acts = codec_factories(act_codec, n_boundaries, "act_codec")
        grads = acts if grad_codec is None else codec_factories(grad_codec, n_boundaries, "grad_codec")

        self.rank, self.world_size, self.chunks = rank, world_size, chunks
        self.loss_fn, self.timeout = loss_fn, float(timeout)
        self.device = torch.device(device)
        #: The boundaries' options (:class:`~dgpipe.pipeline.spec.BoundarySpec`).
        self.boundary = boundary
        #: With a delta spec: send delta-coded tensors losslessly and store them (AQ-SGD's
        #: full-precision warm-up), instead of coding their change. Read by the sending rank.
        self.delta_warmup = False
        self.meter = BandwidthMeter()
        self.n_stages = len(stages)
        self._segs = segments(self._placement)
        self._stages: dict[int, nn.Module] = {}
        for i, stage in enumerate(stages):
            if self._placement[i] == rank:
                stage = stage.to(self.device)
                if deferred_batchnorm:
                    stage = DeferredBatchNorm.convert_deferred_batch_norm(stage, chunks)
                self._stages[i] = stage
        # Boundaries touching this rank, keyed by the index of the segment before them.
        self._bounds: dict[int, Boundary] = {}
        for a, b in zip(self._segs, self._segs[1:]):
            if rank in (a.rank, b.rank):
                self._bounds[a.index] = Boundary(
                    a.last, a.rank, b.rank, acts[a.last], grads[a.last], self.meter, self.device, self.timeout,
                    rank=rank, spec=boundary, report=delta_report, delay=delay, down_group=down,
                )
        self.last_step_totals: dict = self.meter.totals()
        # Seconds and count of this rank's training tasks, [forward, backward] x segment (take_task_seconds).
        self._task_seconds = torch.zeros(2, 2, len(self._segs), dtype=torch.float64)
        #: Parameters shared by stages on different ranks (tied embeddings), summed after each backward.
        self.tied = TiedParameters(stages, self._placement, rank)

    # -- properties ------------------------------------------------------------------------

    @property
    def holds_first_stage(self) -> bool:
        """Whether this rank holds stage 0 (and needs ``inputs``)."""
        return self._placement[0] == self.rank

    @property
    def holds_last_stage(self) -> bool:
        """Whether this rank holds the last stage (and needs ``targets``, computes the loss)."""
        return self._placement[-1] == self.rank

    @property
    def stages(self) -> dict[int, nn.Module]:
        """This rank's stages, keyed by stage index."""
        return dict(self._stages)

    def parameters(self):
        """Parameters of this rank's stages (for the optimizer), each once: stages on this rank that
        share a parameter (tied embeddings) share one object."""
        return unique_parameters([self._stages[i] for i in sorted(self._stages)])

    @property
    def delta_boundaries(self) -> list[str]:
        """Names of the boundaries whose activations are delta-coded (all of the pipeline's)."""
        delta = self.boundary.delta
        if delta is None:
            return []
        return [boundary_name(i) for i in range(self.n_stages - 1) if delta.covers(i)]

    def take_delta_stats(self) -> torch.Tensor:
        """float64 ``(len(delta_boundaries), 3)``: per delta-coded boundary, the sums
        ``[sum a^2, sum (a - m)^2, sum (a - r)^2]`` over the activations this rank sent since
        the last call (activation energy, coded change, reconstruction error; zeros for
        boundaries this rank does not send on). Sum over ranks for the whole pipeline."""
        names = self.delta_boundaries
        out = torch.zeros(len(names), 3, dtype=torch.float64)
        for b in self._bounds.values():
            if b.delta_coded:
                out[names.index(b.name)] += b.coders.take_delta_stats()
        return out

    def take_task_seconds(self) -> torch.Tensor:
        """This rank's training tasks since the last call, then forgets them: float64 ``(2, 2, S)`` for the ``S``
        segments -- ``[0]`` the seconds (wall time less the time blocked in receives; encoding and decoding
        included), ``[1]`` the number of tasks; ``[:, 0]`` forward, ``[:, 1]`` backward. Zero for segments other
        ranks hold, so the sum over ranks is the whole pipeline's (:mod:`dgpipe.pipeline.timeline`)."""
        out, self._task_seconds = self._task_seconds, torch.zeros_like(self._task_seconds)
        return out

    def reference_digests(self) -> dict[str, dict[int, str]]:
        """SHA-256 of this rank's token tables: ``{boundary name: {tuple position: hex}}``; the two ranks
        of a boundary hold equal digests."""
        return {b.name: b.coders.reference_digests() for b in self._bounds.values() if b.token_reference is not None}

    def delta_digests(self) -> dict[str, dict[int, str]]:
        """SHA-256 of this rank's delta caches: ``{boundary name: {tuple position: hex}}``; the
        two ranks of a boundary hold equal digests."""
        return {b.name: b.coders.delta_digests() for b in self._bounds.values() if b.delta_coded}

    def state_dict(self) -> dict:
        """``{"stages": {index: stage state}, "codecs": {boundary name: codec states},
        "delta": {boundary name: cache states}, "reference": {boundary name: token tables}}`` of this rank."""
        return {"stages": {str(i): s.state_dict() for i, s in sorted(self._stages.items())},
                **coder_states(self._bounds.values())}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output of the same rank and placement.

        Raises:
            ValueError: the saved stages are not exactly this rank's stages, or a
            codec state names an unknown boundary.
        """
        saved = set(state.get("stages", {}))
        mine = {str(i) for i in self._stages}
        if saved != mine:
            raise ValueError(f"state holds stages {sorted(saved)} but this rank holds stages {sorted(mine)}")
        for i, s in self._stages.items():
            s.load_state_dict(state["stages"][str(i)])
        load_coder_states(self._bounds.values(), state)

    # -- steps -----------------------------------------------------------------------------

    def train_step(self, inputs=None, targets=None, return_outputs: bool = False, sample_ids=None):
        """One GPipe step: forward all micro-batches, backward them in reverse.

        Gradients accumulate into :meth:`parameters` (call ``optimizer.zero_grad()``
        and ``optimizer.step()`` around it); a parameter that stages on several ranks share
        (tied embeddings) ends with the sum of their gradients on each of them
        (:class:`~dgpipe.pipeline.tied.TiedParameters`). A collective: every rank must call it.

        Args:
            inputs: mini-batch (tensor or tuple, batch in dim 0) on the rank holding
                stage 0; ignored elsewhere. Its batch size must be a multiple of
                ``chunks``.
            targets: tensor or tuple on the rank holding the last stage; ignored elsewhere.
            return_outputs: also return the last stage's outputs (detached,
                concatenated over micro-batches) on the last-stage rank, ``None`` elsewhere.
            sample_ids: on the rank holding stage 0, the dataset index of every example
                of ``inputs`` (int64 ``(B,)``, distinct, in ``[0, boundary.id_examples)``); needed
                with ``boundary.delta`` or ``boundary.example_ids``, ignored
                without them and on other ranks. They are split with the micro-batches and
                travel with the forward messages.

        Returns:
            The mean loss over micro-batches (float, the same on every rank), or
            ``(loss, outputs)`` with ``return_outputs``.

        Raises:
            ValueError: a batch smaller than or not divisible by ``chunks``, missing
                inputs/targets/loss_fn, missing or bad ``sample_ids`` with a delta spec.
            TransportError: a peer failed or stalled (the message names it).
        """
        micro_in = micro_tg = None
        if self.holds_first_stage:
            if inputs is None:
                raise ValueError(f"rank {self.rank} holds stage 0 and needs inputs")
            batch = batch_size(inputs, "inputs")
            if batch < self.chunks:
                raise ValueError(f"chunks={self.chunks} is larger than the batch of {batch}; use chunks <= batch size")
            if batch % self.chunks:
                raise ValueError(
                    f"a batch of {batch} does not split into chunks={self.chunks} equal micro-batches; use a "
                    f"batch size that is a multiple of {self.chunks} (e.g. drop_last=True in the DataLoader)"
                )
            micro_in = split_batch(inputs, self.chunks, self.device)
            micro_ids = None
            if self.boundary.id_examples is not None:
                if sample_ids is None:
                    why = ("delta-codes activations against per-example caches" if self.boundary.delta is not None
                           else "sends sample ids with every micro-batch (example_ids)")
                    raise ValueError(f"this pipeline {why}: train_step needs sample_ids (the dataset index "
                                     "of every example)")
                check_ids(sample_ids, self.boundary.id_examples, batch)
                micro_ids = split_batch(sample_ids, self.chunks, torch.device("cpu"))
        if self.holds_last_stage:
            if self.loss_fn is None:
                raise ValueError(f"rank {self.rank} holds the last stage and needs loss_fn")
            if targets is None:
                raise ValueError(f"rank {self.rank} holds the last stage and needs targets")
            batch = batch_size(targets, "targets")
            if batch % self.chunks or batch < self.chunks:
                raise ValueError(f"targets batch of {batch} does not split into chunks={self.chunks} micro-batches")
            micro_tg = split_batch(targets, self.chunks, self.device)
        for s in self._stages.values():
            s.train()
        with torch.enable_grad():
            step = self._run("forward", micro_in, micro_tg, return_outputs,
                             micro_ids if self.holds_first_stage else None)
        self.tied.sum_gradients()
        if return_outputs:
            return step.loss, gather([Batch(o) for o in step.outputs]) if step.outputs else None
        return step.loss

    def eval_step(self, inputs=None):
        """Forward only, without gradients, in eval mode (BatchNorm uses running statistics).

        Any batch size >= 1 works: it is split into ``min(chunks, batch)`` micro-batches.
        Floating activations are compressed if ``boundary.compress_eval`` (metered as direction
        ``"eval"``). A collective: every rank must call it.

        Args:
            inputs: tensor or tuple on the rank holding stage 0; ignored elsewhere.

        Returns:
            The last stage's outputs concatenated over micro-batches on the rank holding
            the last stage; ``None`` elsewhere.
        """
        micro_in = None
        if self.holds_first_stage:
            if inputs is None:
                raise ValueError(f"rank {self.rank} holds stage 0 and needs inputs")
            batch = batch_size(inputs, "inputs")
            if batch < 1:
                raise ValueError("eval_step needs a batch of at least one sample")
            micro_in = split_batch(inputs, min(self.chunks, batch), self.device)
        for s in self._stages.values():
            s.eval()
        with torch.no_grad():
            step = self._run("eval", micro_in, None, True)
        return gather([Batch(o) for o in step.outputs]) if self.holds_last_stage else None

    # -- execution -------------------------------------------------------------------------

    def _run(self, direction: str, micro_in, micro_tg, keep_outputs: bool, micro_ids=None) -> StepState:
        """Run this rank's tasks of one step."""
        before = self.meter.totals()
        training = direction == "forward"
        step = StepState(direction, 0, micro_in, micro_tg, keep_outputs, micro_ids)
        for seg in self._segs:  # every incoming boundary brings at least one message this step
            if seg.rank == self.rank and seg.index > 0:
                self._bounds[seg.index - 1].expect_forward()
        if micro_in is not None:
            step.n_micro = len(micro_in)
        else:  # learn the number of micro-batches from the first message
            first = next(s for s in self._segs if s.rank == self.rank)
            value, leaves, step.n_micro, ids = self._bounds[first.index - 1].recv_forward(0, direction)
            step.received[(0, first.index)] = (value, leaves, ids)
        if training and step.n_micro != self.chunks:
            raise ValueError(f"rank {self.rank}: peer sent {step.n_micro} micro-batches, expected chunks={self.chunks}")
        for task in gpipe_tasks(self._segs, self.rank, step.n_micro, backward=training):
            start, waited = time.perf_counter(), self.meter.totals()["recv_seconds"] if training else 0.0
            if task.phase == "forward":
                self._forward(step, task)
            else:
                self._backward(step, task)
            if training:  # the task's compute: its wall time less the time blocked in a receive
                busy = time.perf_counter() - start - (self.meter.totals()["recv_seconds"] - waited)
                phase = int(task.phase == "backward")
                self._task_seconds[0, phase, task.segment] += busy
                self._task_seconds[1, phase, task.segment] += 1
        for work in step.works:
            work.wait(self.timeout)
        raise_deferred()  # a grid received on a device that was not finite (the decoders read nothing back)
        after = self.meter.totals()
        self.last_step_totals = {k: after[k] - before[k] for k in after if k not in ("ratio", "recv_bytes_per_s")}
        return step

    def _forward(self, step: StepState, task: Task) -> None:
        seg, m = self._segs[task.segment], task.micro
        if seg.first == 0:
            x, leaves, ids = step.inputs[m], [], step.ids[m] if step.ids else None
        elif (m, seg.index) in step.received:
            x, leaves, ids = step.received.pop((m, seg.index))
        else:
            x, leaves, n, ids = self._bounds[seg.index - 1].recv_forward(m, step.direction)
            if n != step.n_micro:
                raise ValueError(f"rank {self.rank}: peer sent micro-batch count {n}, expected {step.n_micro}")
        training = step.direction == "forward"
        with example_ids(ids if training else None):
            for i in range(seg.first, seg.last + 1):
                x = self._stages[i](x)
        if seg.last == self.n_stages - 1:
            if training:
                loss = self.loss_fn(x, step.targets[m])
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} "
                                     f"{tuple(getattr(loss, 'shape', ()))}")  # fmt: skip
                step.saved[(m, seg.index)] = (leaves, loss, [])
                step.losses.append(loss.detach().reshape(()))
            if step.keep_outputs:
                step.outputs.append(detach(x))
        else:
            works, out_rg = self._bounds[seg.index].send_forward(m, x, step.n_micro, step.direction, ids=ids,
                                                                 refresh=self.delta_warmup)
            step.works.extend(works)
            if training:
                step.saved[(m, seg.index)] = (leaves, None, out_rg)

    def _backward(self, step: StepState, task: Task) -> None:
        seg, m = self._segs[task.segment], task.micro
        leaves, loss, out_rg = step.saved.pop((m, seg.index))
        if loss is not None:
            if step.loss is None:  # every forward is done: the step's loss is known
                step.loss = float(torch.stack(step.losses).mean())
            (loss / step.n_micro).backward()
        else:
            grads, step.loss = self._bounds[seg.index].recv_backward(m, len(out_rg))
            pairs = [(t, g) for t, g in zip(out_rg, grads) if g is not None]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if seg.first > 0:  # answer the forward message, with the gradients it needs (if any) and the loss
            step.works.extend(self._bounds[seg.index - 1].send_backward(m, [x.grad for x in leaves], step.loss))
