"""Point-to-point transport of a :class:`~dgpipe.compression.base.Payload` over torch.distributed.

One payload from rank A to rank B is a sequence of plain tensor messages on one tag
(``torch.distributed.isend``/``irecv``); nothing is ever pickled::

    1. preamble  int64[2]            [PREAMBLE_MAGIC, header_numel]
    2. header    int64[header_numel] layout in dgpipe.compression.base
    3. tensors   one message per payload tensor with numel > 0, dtype and numel
                 as the header's tensor specs say

The receiver checks the preamble, then validates the header
(:func:`~dgpipe.compression.base.parse_header`) and the total size before it
allocates anything. Messages between one pair of ranks on one tag arrive in the
order they were sent, so a receiver that posts receives in the sender's order never
confuses two payloads.

Tensors travel on the *wire device* of the process group: CUDA with NCCL, CPU
otherwise. CUDA payloads over gloo are staged through CPU memory; received tensors
are moved to the caller's ``device``.

Every blocking wait takes a timeout (seconds); a peer that fails or stalls raises
:class:`TransportError` naming that peer instead of hanging.
"""

from __future__ import annotations

import datetime
import time
from typing import Sequence

import torch
import torch.distributed as dist

from dgpipe.compression.base import MAX_NDIM, MAX_PARAMS, MAX_TENSORS, Payload, parse_header

__all__ = [
    "PREAMBLE_MAGIC",
    "PREAMBLE_BYTES",
    "DEFAULT_MAX_BYTES",
    "TransportError",
    "SendWork",
    "wire_device",
    "send_payload",
    "recv_payload",
]

PREAMBLE_MAGIC = 0x64677770  # "dgwp"
PREAMBLE_BYTES = 16  # two int64 values
# Longest header parse_header can accept: magic, codec, dtype, ndim, shape, params, tensors.
_MAX_HEADER_NUMEL = 4 + MAX_NDIM + 1 + MAX_PARAMS + 1 + 2 * MAX_TENSORS
DEFAULT_MAX_BYTES = 1 << 34  # 16 GiB: refuse to allocate more for one received payload


class TransportError(RuntimeError):
    """A send or receive with a peer rank failed or timed out.

    Attributes:
        peer: global rank of the peer.
    """

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


def wire_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Device that tensors must be on for ``group``'s backend: CUDA for NCCL, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _timedelta(seconds: float | None) -> datetime.timedelta | None:
    return None if seconds is None else datetime.timedelta(seconds=max(seconds, 0.001))


def _explain(peer: int, action: str, err: BaseException, timeout: float | None) -> TransportError:
    text = str(err)
    if "timed out" in text.lower() or "timeout" in text.lower():
        why = f"timed out after {timeout:g} s: rank {peer} is stalled or has failed"
    else:
        why = f"rank {peer} closed the connection or failed"
    return TransportError(f"{action} rank {peer} failed ({why}). Check rank {peer}'s log. [{text.splitlines()[0] if text else type(err).__name__}]", peer)


def _wait(works: Sequence, peer: int, action: str, timeout: float | None, start: float) -> None:
    for work in works:
        remaining = None if timeout is None else timeout - (time.monotonic() - start)
        try:
            if remaining is None:
                work.wait()
            else:
                work.wait(timeout=_timedelta(remaining))
        except RuntimeError as err:
            raise _explain(peer, action, err, timeout) from err


class SendWork:
    """Handle of an asynchronous :func:`send_payload`; keeps the sent tensors alive.

    Attributes:
        dst: global rank of the receiver.
    """

    def __init__(self, works: list, tensors: list[torch.Tensor], dst: int) -> None:
        self._works = works
        self._tensors = tensors
        self.dst = dst

    def wait(self, timeout: float | None = None) -> None:
        """Block until every message of the payload has been handed to the receiver.

        Args:
            timeout: seconds; ``None`` uses the process group's timeout.

        Raises:
            TransportError: the receiver failed or did not receive within ``timeout``.
        """
        _wait(self._works, self.dst, "sending to", timeout, time.monotonic())
        self._works, self._tensors = [], []


def send_payload(payload: Payload, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0) -> SendWork:
    """Start sending ``payload`` to global rank ``dst``; returns at once.

    Args:
        payload: header (int64, CPU) and tensors (any device) as made by a codec.
        dst: global rank of the receiver.
        group: process group (default: the world).
        tag: message tag; the receiver must use the same tag (NCCL ignores tags).

    Returns:
        A :class:`SendWork`; call ``wait`` before reusing or freeing anything it holds
        (it keeps references itself, so dropping the payload is safe).
    """
    dev = wire_device(group)
    header = payload.header
    preamble = torch.tensor([PREAMBLE_MAGIC, header.numel()], dtype=torch.int64)
    tensors = [preamble.to(dev), header.to(dev)]
    tensors += [t.reshape(-1).contiguous().to(dev) for t in payload.tensors if t.numel() > 0]
    works = [dist.isend(t, dst, group=group, tag=tag) for t in tensors]
    return SendWork(works, tensors, dst)


def recv_payload(
    src: int,
    device: torch.device | str,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    timeout: float | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Payload:
    """Receive one payload from global rank ``src``; blocks until it is complete.

    Args:
        src: global rank of the sender.
        device: where the returned payload's tensors are placed.
        group: process group (default: the world).
        tag: message tag, as given to :func:`send_payload`.
        timeout: seconds for the whole payload; ``None`` uses the process group's timeout.
        max_bytes: refuse payloads whose tensors would take more bytes than this.

    Returns:
        The payload: header as a 1-D int64 CPU tensor, tensors on ``device``.

    Raises:
        TransportError: the sender failed or nothing arrived within ``timeout``.
        ValueError: the preamble or header is corrupt, or the payload exceeds ``max_bytes``.
    """
    start = time.monotonic()
    dev = wire_device(group)
    action = "receiving from"

    def recv_all(bufs: list[torch.Tensor]) -> None:
        works = [dist.irecv(b, src, group=group, tag=tag) for b in bufs]
        _wait(works, src, action, timeout, start)

    preamble = torch.empty(2, dtype=torch.int64, device=dev)
    recv_all([preamble])
    magic, header_numel = preamble.tolist()
    if magic != PREAMBLE_MAGIC or not 4 <= header_numel <= _MAX_HEADER_NUMEL:
        raise ValueError(
            f"corrupt preamble from rank {src}: [{magic:#x}, {header_numel}]; expected "
            f"[{PREAMBLE_MAGIC:#x}, 4..{_MAX_HEADER_NUMEL}] (sender and receiver out of step?)"
        )
    header = torch.empty(header_numel, dtype=torch.int64, device=dev)
    recv_all([header])
    header = header.cpu()
    spec = parse_header(header)
    nbytes = sum(n * torch.empty(0, dtype=dt).element_size() for dt, n in spec.tensor_specs)
    if nbytes > max_bytes:
        raise ValueError(f"payload from rank {src} announces {nbytes} bytes, over max_bytes={max_bytes}")
    tensors = [torch.empty(n, dtype=dt, device=dev) for dt, n in spec.tensor_specs]
    recv_all([t for t in tensors if t.numel() > 0])
    return Payload(header, tuple(t.to(device) for t in tensors))

