"""The grid a quantizer codes with: its input as float32, its options, and per-group grids as sent.

- :func:`flat_float32`: any floating tensor as the 1-D float32 values the steps take;
- :func:`grouping_options`: a quantizer's keyword options as a validated :class:`.grouping.Grouping`,
  and :data:`GROUP_PARAM`, its header field;
- :func:`grid_meta`: per-group ``(lo, step)`` rounded into the metadata dtype so that the
  grid still covers each group's range, and the float32 start and divisor to code with.

Policy for inf/NaN (all lossy quantizers of this package): on CPU ``encode`` raises ``ValueError``
(:func:`.kernels.finite_range`) -- a range with an infinite or undefined end would turn
every decoded value into garbage. So does a finite range wider than float32 can hold. Off the CPU
the encoder reads nothing back: the grid it sends is not finite, and the decoder refuses it
(:func:`.kernels.finite_grid`, at the runtime's next wait: :mod:`..kernels.deferred`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..base import MAX_NUMEL
from ..kernels.uniform import grid_divisor, grid_step, tame
from .grouping import Grouping, round_meta

__all__ = ["GROUP_PARAM", "flat_float32", "grouping_options", "grid_meta"]

#: Header param of the grouping options, after a codec's own (see :meth:`.grouping.Grouping.param`).
GROUP_PARAM = ("grouping", 0, (MAX_NUMEL << 15) | ((1 << 15) - 1))


def flat_float32(x: torch.Tensor, codec_name: str) -> torch.Tensor:
    """``x`` flattened to 1-D float32 (a view of ``x`` when it already is; never modify it).

    Raises:
        ValueError: ``x`` is not a floating tensor.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{codec_name} codec needs a floating tensor (float32/float16/bfloat16/float64), got {got}")
    return x.reshape(-1).to(torch.float32)


def grouping_options(codec: str, group: str, group_size: int, axis: int, rotate: str, scale_dtype: str) -> Grouping:
    """The validated :class:`.grouping.Grouping` of a quantizer's keyword options.

    ``group_size > 0`` with the default ``group="tensor"`` means tiles (the original
    ``quant`` option). Raises ``ValueError`` naming ``codec`` for bad options.
    """
    if group == "tensor" and isinstance(group_size, int) and not isinstance(group_size, bool) and group_size > 0:
        group = "tile"
    return Grouping(group, group_size, axis, rotate, scale_dtype).validate(codec)


def grid_meta(
    lo: torch.Tensor, hi: torch.Tensor, levels: int, grouping: Grouping, codec: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group grid ``(lo, step)`` as sent (``grouping.meta_dtype``) and the float32 ``lo`` and divisor to code with.

    ``lo`` is rounded down and the step up (:func:`.grouping.round_meta`), so the grid
    ``lo + k * step``, ``k < levels``, still covers ``[lo, hi]``.

    Returns:
        ``(meta, lo32, div32)``: ``meta`` 1-D ``cat(lo, step)`` in the metadata dtype;
        ``lo32``/``div32`` float32 of ``lo``'s shape (:func:`.kernels.uniform.grid_divisor`).
    """
    if grouping.meta_dtype == lo.dtype == hi.dtype == torch.float32 and lo.is_cpu:
        lo32, hi32 = lo.detach().numpy(), hi.detach().numpy()
        if tame(lo32, hi32):  # numpy: a fraction of torch's per-call cost
            step = grid_step(lo32, hi32, levels)
            meta = torch.from_numpy(np.concatenate((lo32.reshape(-1), step.reshape(-1))))
            return meta, lo.detach(), torch.from_numpy(grid_divisor(step))
    lo_m = round_meta(lo, grouping.meta_dtype, False, "min", codec)
    lo32 = lo_m.float()
    step_m = round_meta(grid_step(lo32, hi, levels), grouping.meta_dtype, True, "step", codec)
    return torch.cat((lo_m.reshape(-1), step_m.reshape(-1))), lo32, grid_divisor(step_m.float())
