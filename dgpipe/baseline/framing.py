"""Framing of several payloads into one byte tensor, for collectives that move bytes.

An all-gather moves one tensor per rank; :func:`frame_payloads` packs the payloads of
one DDP bucket (one per parameter) into a 1-D ``uint8`` tensor, and
:func:`unframe_payloads` validates and splits it again. Nothing is pickled: the frame
is integers and raw tensor bytes, and every header is checked with
:func:`~dgpipe.compression.base.parse_header`.
"""

from __future__ import annotations

from typing import Iterable

import torch

from dgpipe.compression.base import Payload, parse_header

__all__ = ["FRAME_MAGIC", "frame_overhead", "frame_payloads", "unframe_payloads"]

FRAME_MAGIC = 0x64677066  # "dgpf"
_MAX_HEADER_NUMEL = 1 << 12


def frame_overhead(count: int) -> int:
    """Bytes a frame of ``count`` payloads adds to their ``nbytes``: ``8 * (2 + count)``."""
    return 8 * (2 + count)


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
    fixed = frame_overhead(count)
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
