"""Checks of received values that a device defers: the decoder's refusal without a read back per message.

A codec on a GPU does not read its input's range back to the host (the host would wait for the device):
inf/NaN values, or a range past what float32 or the scale dtype holds, make the grid or scales it sends
not finite, and the decoder refuses them. On CPU that refusal is immediate (:func:`refuse_unless`
raises). On any other device a refusal is a device-side flag, ``torch.isfinite(t).all()``, folded into
one flag per device and message (``&``, no read back): :func:`raise_deferred` reads the flags once and
raises the first refusal's ``ValueError``. The runtimes call it where they wait for the device anyway --
at the end of a step (the pipeline, torch's schedules, data-parallel), and after each generated token --
so a bad payload still ends the run with the decoder's one-line error, one step late at most.

The flags are kept per process (behind a lock: a decode may run on another thread than the runtime's
wait) and are bounded: one per (device, message), whatever the number of messages.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["on_host", "refuse_unless", "pending", "raise_deferred"]

_lock = threading.Lock()
_flags: dict[tuple[torch.device, str], torch.Tensor] = {}


def on_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s values can be read without waiting for a device (a CPU tensor): where the codecs check
    their input's range and a decoder its grid at once. The tests replace it to run a device's deferred path
    on CPU."""
    return t.is_cpu


def refuse_unless(t: torch.Tensor, message: str) -> None:
    """Refuse a received ``t`` (any float dtype, any shape) unless all its values are finite.

    On CPU the check runs now; elsewhere it is deferred to :func:`raise_deferred` (module docstring).

    Raises:
        ValueError: ``message``, on CPU, when ``t`` holds inf or NaN.
    """
    ok = torch.isfinite(t).all()
    if on_host(t):
        if not bool(ok):
            raise ValueError(message)
        return
    key = (t.device, message)
    with _lock:
        _flags[key] = ok if key not in _flags else _flags[key] & ok


def pending() -> int:
    """The number of deferred flags not yet read (one per device and message)."""
    return len(_flags)


def raise_deferred() -> None:
    """Read the deferred flags (one read back per device, only where there are any) and clear them.

    Raises:
        ValueError: the message of the first refusal whose values were not all finite.
    """
    if not _flags:
        return
    with _lock:
        taken = list(_flags.items())
        _flags.clear()
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for (device, message), ok in taken:
        by_device.setdefault(device, []).append((message, ok))
    for checks in by_device.values():
        for (message, _), ok in zip(checks, torch.stack([ok for _, ok in checks]).tolist()):
            if not ok:
                raise ValueError(message)
