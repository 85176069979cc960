"""Checks of received values that a device defers: the decoder's refusal without a read back, or a launch, per
message.

A codec on a GPU does not read its input's range back to the host (the host would wait for the device):
inf/NaN values, or a range past what float32 or the scale dtype holds, make the grid or scales it sends
not finite, and the decoder refuses them. On CPU that refusal is immediate (:func:`refuse_unless`
raises). On any other device the decoder only keeps the tensor it checks (a grid: a few values; no kernel
runs): :func:`raise_deferred` checks all of them at once, one read back per device, and raises the first
refusal's ``ValueError``. The runtimes call it where they wait for the device anyway -- at the end of a step
(the pipeline, torch's schedules, data-parallel), and after each generated token's states are decoded -- so a
bad payload still ends the run with the decoder's one-line error, one step late at most.

What is kept is per process (behind a lock: a decode may run on another thread than the runtime's wait) and
bounded: per (device, message), every :data:`FOLD_AT` tensors are folded into one float64 sum, which is finite
exactly when all their values are (float32 values cannot overflow a float64 sum of this size).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["FOLD_AT", "on_host", "refuse_unless", "pending", "raise_deferred"]

FOLD_AT = 64
"""Tensors kept per device and message before they are folded into one (a few kernels, once per that many)."""

_lock = threading.Lock()
_held: dict[tuple[torch.device, str], list[torch.Tensor]] = {}


def on_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s values can be read without waiting for a device (a CPU tensor): where the codecs check
    their input's range and a decoder its grid at once. The tests replace it to run a device's deferred path
    on CPU."""
    return t.is_cpu


def _sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """float64 ``(1,)``: the sum of every value of ``tensors`` (any float dtypes, one device); finite exactly when
    all of them are (module docstring)."""
    return torch.cat([t.reshape(-1).double() for t in tensors]).sum().reshape(1)


def refuse_unless(t: torch.Tensor, message: str) -> None:
    """Refuse a received ``t`` (any float dtype, any shape) unless all its values are finite.

    On CPU the check runs now; elsewhere ``t`` is kept for :func:`raise_deferred` (module docstring): do not
    modify it in place.

    Raises:
        ValueError: ``message``, on CPU, when ``t`` holds inf or NaN.
    """
    if on_host(t):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(message)
        return
    with _lock:
        held = _held.setdefault((t.device, message), [])
        held.append(t.detach())
        if len(held) >= FOLD_AT:
            held[:] = [_sum(held)]


def pending() -> int:
    """The number of (device, message) pairs with checks not yet made."""
    return len(_held)


def raise_deferred() -> None:
    """Make the deferred checks (one read back per device, only where there are any) and forget them.

    Raises:
        ValueError: the message of the first refusal whose values were not all finite.
    """
    if not _held:
        return
    with _lock:
        taken = list(_held.items())
        _held.clear()
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for (device, message), held in taken:
        by_device.setdefault(device, []).append((message, _sum(held)))
    for checks in by_device.values():
        finite = torch.isfinite(torch.cat([s for _, s in checks])).tolist()
        for (message, _), ok in zip(checks, finite):
            if not ok:
                raise ValueError(message)
