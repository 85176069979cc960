"""The pipeline runtime: a model cut into stages trains across processes as a GPipe pipeline.

Modules (one idea each):

- :mod:`~dgpipe.pipeline.partition` -- cut layers into stages, place stages on ranks:
  ``split_layers(layers, balance) -> list[nn.Sequential]``,
  ``balance_by_params(layers, n)``, ``balance_by_time(layers, n, sample)``,
  ``linear_placement(n) -> [0..n-1]``, ``client_server_placement() -> [0, 1, 0]``,
  ``validate_placement(placement, n_stages, world_size)``.
- :mod:`~dgpipe.pipeline.schedule` -- GPipe fill-drain task order per rank (segment by
  segment); ``bubble_fraction(S, M) = (S-1)/(M+S-1)``.
- :mod:`~dgpipe.pipeline.timeline` -- ``simulate_step(profile, rate, latency)``: the
  seconds of a step on a link, from its measured tasks and messages (``StepProfile``).
- :mod:`~dgpipe.pipeline.microbatch` -- ``batch_size``, ``split_batch``, ``detach`` for
  tensors and tuples.
- :mod:`~dgpipe.pipeline.boundary` -- one stage boundary: tensor or tuple through its
  lanes and a metered :class:`~dgpipe.comm.link.Link`.
- :mod:`~dgpipe.pipeline.spec` -- :class:`BoundarySpec`, the boundaries' options in one frozen
  value: evaluation coded or not, delta coding, sample ids, the row mask, the per-token
  reference, an emulated latency.
- :mod:`~dgpipe.pipeline.lanes` -- one tuple position's way over the wire: lossless,
  coded (a codec), delta (AQ-SGD change against a cache) or delta warm-up; all
  ``encode(t, ctx) -> Payload`` / ``decode(payload, ctx) -> t``.
- :mod:`~dgpipe.pipeline.message` -- :class:`~dgpipe.pipeline.message.Message`, a
  boundary message's meta (lane per position, micro-batch, loss) with
  ``to_meta()``/``from_meta()``.
- :mod:`~dgpipe.pipeline.runtime` -- :class:`Pipeline`, this rank's part of the pipeline.
- :mod:`~dgpipe.pipeline.launch` -- ``spawn(fn, world_size, args=(), backend="gloo",
  timeout=300)`` for one machine; ``init_distributed(backend="auto", timeout=300)``
  under ``torchrun`` (env://, multi-node); ``stop_process_group(proc)`` ends a launched
  command and the ranks it started; ``raise_on_sigterm()`` lets a launcher stop its children
  on SIGTERM; ``exit_without_teardown(status)`` ends a finished rank or CLI safely.

Pipeline API::

    pipe = Pipeline(stages, placement, rank=None, chunks=4, loss_fn=F.cross_entropy,
                    act_codec=("sortquant", {"quant_bits": 6, "split_bits": 2}),
                    grad_codec=None,            # None: same spec as act_codec
                    device="cpu", timeout=300.0,
                    deferred_batchnorm=False,   # default: plain BatchNorm per micro-batch
                    boundary=BoundarySpec())    # compress_eval, delta, row_mask, token_reference, ...
    loss = pipe.train_step(inputs, targets)             # float, same on every rank
    loss, out = pipe.train_step(inputs, targets, return_outputs=True)  # out on last-stage rank
    optimizer.step()                                    # optimizer over pipe.parameters()
    out = pipe.eval_step(inputs)                        # last-stage rank: outputs; else None
    pipe.meter.records(); pipe.meter.gather(dst=0)      # per boundary and direction
    pipe.last_step_totals                               # this rank's traffic in the last step
    pipe.take_task_seconds()                            # its training tasks' seconds, per segment
    pipe.state_dict(); pipe.load_state_dict(sd)         # local stages + codec states
    pipe.holds_first_stage, pipe.holds_last_stage

- ``stages`` is the full partition, the same on every rank; each rank keeps its own.
  A stage gets the previous stage's output as one argument (tensor or tuple).
- ``inputs`` are needed only on the rank holding stage 0, ``targets`` only on the one
  holding the last stage (both: tensor or tuple, batch in dim 0; for training the
  batch must be a multiple of ``chunks``). Every rank calls every step.
- Codec specs: a :class:`~dgpipe.compression.CodecSpec`, a name, ``(name, options)``
  (checked on the spot), a zero-argument factory, a stateless
  codec, or a list with one spec per stage boundary. Stateful codecs get one instance
  per boundary, direction and micro-batch slot.
- A boundary carries a tensor or a tuple; floating tensors that require grad are
  compressed, the rest (integer masks, tensors without grad) pass losslessly. Shapes
  and dtypes travel in headers and may change between steps.
- Boundary names are ``"stage{i}->stage{i+1}"``; meter directions are ``"forward"``,
  ``"backward"`` and ``"eval"``.
- A failed or stalled peer raises :class:`~dgpipe.comm.transport.TransportError` naming
  it within ``timeout`` seconds; under :func:`spawn` the others are terminated and
  :class:`SpawnError` names the failed rank.
"""

from .launch import (SpawnError, exit_without_teardown, free_port, init_distributed, raise_on_sigterm, resolve_backend,
                     spawn, stop_process_group)
from .partition import (
    balance_by_params,
    balance_by_time,
    client_server_placement,
    linear_placement,
    split_layers,
    validate_placement,
)
from .runtime import Pipeline
from .spec import BoundarySpec
from .schedule import bubble_fraction

__all__ = [
    "BoundarySpec",
    "Pipeline",
    "SpawnError",
    "balance_by_params",
    "balance_by_time",
    "bubble_fraction",
    "client_server_placement",
    "free_port",
    "init_distributed",
    "linear_placement",
    "resolve_backend",
    "spawn",
    "split_layers",
    "stop_process_group",
    "raise_on_sigterm",
    "exit_without_teardown",
    "validate_placement",
]
