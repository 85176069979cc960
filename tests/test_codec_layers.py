"""A codec's encode reads as its layers: codec -> steps -> kernels -> payload, never back.

The call trace of one encode (``sys.setprofile``, calls into ``dgpipe`` only) is reduced to
the rooms of :mod:`dgpipe.compression` it enters; a room entered again after another one
is a layer calling back up. The per-group codecs (token groups, a Hadamard rotation) still
alternate between steps and kernels (rotate, then scale, then code); the whole-tensor
codecs below do not.
"""

import sys

import pytest
import torch

from dgpipe.compression import get_codec


def rooms_entered(codec, x: torch.Tensor) -> list[str]:
    codec.encode(x)  # compile and cache outside the trace
    rooms: list[str] = []

    def on_call(frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module.startswith("dgpipe.compression."):
            room = module.split(".")[2]
            if not rooms or rooms[-1] != room:
                rooms.append(room)

    sys.setprofile(on_call)
    try:
        codec.encode(x)
    finally:
        sys.setprofile(None)
    return rooms


@pytest.mark.parametrize("name, options", [("quant", {"bits": 8}), ("quant", {"bits": 2}),
                                           ("sortquant", {"quant_bits": 6, "split_bits": 2}),
                                           ("sortquant", {"quant_bits": 3, "split_bits": 1})])
def test_encode_goes_down_the_layers_once(name, options):
    x = torch.randn(16, 64, 96)
    assert rooms_entered(get_codec(name, **options), x) == ["codecs", "steps", "kernels", "base"]
