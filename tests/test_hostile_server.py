"""A hostile client against the real split-generation server (:func:`dgpipe.generation.serve`, a tiny Llama on
gloo), and a hostile server against the client: crafted meta and payloads, truncated messages and requests past
the server's limits are each refused with one line naming the peer and the field, before the blocks run, and
without allocating past a bound (the server's peak RSS, measured in its process, grows by less than
:data:`RSS_BOUND`; the attacks below asked for 0.5 GiB to 8 TiB before the server checked them). A server whose
pairs are anchored also refuses a message without the token ids, ids of another shape and ids outside its vocabulary.

Every case runs the server on a process group of its own, so that a message the server refused before reading it
whole cannot reach the next case.
"""

from __future__ import annotations

import resource
import sys

import pytest
import torch
import torch.distributed as dist

from dgpipe.comm.framing import pack_message, split_parts
from dgpipe.comm.transport import MIN_CAPACITY, Receiver, Sender
from dgpipe.compression import get_codec
from dgpipe.generation import (
    DECODE, HIDDEN, PREFILL, TAG, ClientStages, RemoteServer, ServerLimits, StageBlocks, generate, serve,
)
from dgpipe.models import client_server_split
from dgpipe.models.bottleneck import insert_bottlenecks
from dgpipe.models.causal_lm import build_causal_lm, causal_lm_layers, preset_config
from helpers import assert_ranks_ok, spawn_checks

CONTEXT, MAX_TOKENS = 64, 256
LIMITS = ServerLimits(max_tokens=MAX_TOKENS)  # max_length: the model's context, 64
RSS_BOUND = 64 << 20
"""Most bytes a refused message may grow the server's peak RSS by."""
NONE, INTPACK = get_codec("none"), get_codec("intpack")
_UNWAITED: list = []  # sends the server refuses before receiving them whole: kept until the process ends


def _model():
    torch.manual_seed(0)
    return build_causal_lm(preset_config("tiny-llama", vocab_size=97, max_length=CONTEXT)).eval()


MODEL = _model()
FRONT, MIDDLE, BACK = client_server_split(causal_lm_layers(MODEL), 1, (1, 1))
H = MODEL.config.hidden_size
_PAIRED = insert_bottlenecks(client_server_split(causal_lm_layers(_model(), carry_ids=True), 1, (1, 1)), 8, H,
                             "orthonormal", anchor=causal_lm_layers(MODEL)[0].embed_tokens)
ANCHORED = list(_PAIRED[1].children())[:1]
"""A server stage of anchored pairs (8 channels; the token ids cross beside them): its decoder alone."""


def _peak_rss() -> int:
    """This process's peak resident memory in bytes (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _prefill(b: int, length: int, dtype=torch.float32, mask: torch.Tensor | None = None) -> list:
    """An honest prefill's payloads: hidden states ``(b, length, H)`` and a full prompt mask."""
    mask = torch.ones(b, length, dtype=torch.long) if mask is None else mask
    return [NONE.encode(torch.randn(b, length, H).to(dtype)), INTPACK.encode(mask)]


def _send_raw(buf: torch.Tensor, group) -> None:
    """Put ``buf`` on the server's stream as it is (a client that does not use the transport's sender); not
    waited for: the server may refuse the message before it receives this part."""
    _UNWAITED.append((buf, dist.isend(buf, 1, group=group, tag=TAG)))


class _Unreachable(StageBlocks):
    """The server's blocks, which a refused message must never reach."""

    def __call__(self, *args):
        raise AssertionError("a refused message reached the blocks")


def _case(send, error: str, middle: list = MIDDLE):
    """A check: rank 0 sends with ``send(group)``; rank 1 serves ``middle``, and must refuse with ``error`` (a regex)
    within the RSS bound. The refusal must come from the checks, not from the blocks."""

    def check(rank: int) -> None:
        group = dist.new_group([0, 1])
        if rank == 0:
            send(group)
        else:
            blocks = _Unreachable(middle, MODEL.config)
            before = _peak_rss()
            with pytest.raises(ValueError, match=error) as info:
                serve(blocks, 0, timeout=20, group=group, limits=LIMITS)
            assert "\n" not in str(info.value)
            assert _peak_rss() - before < RSS_BOUND, f"peak RSS grew by {(_peak_rss() - before) >> 20} MiB"
        dist.barrier(group)
        dist.destroy_process_group(group)

    return check


TRUNCATED = r"corrupt message from rank 0: truncated: the closing word is missing from "


def _message(payloads, meta) -> torch.Tensor:
    return pack_message(payloads, meta)[0]


CASES = {
    "batch_0": (lambda g: Sender(1, g, TAG).send(_prefill(1, 4), [PREFILL, 0, 0, 1 << 26]).wait(20),
                r"client \(rank 0\) sent a batch of 0 sequences of 67108864 tokens: both must be >= 1"),
    "length_0": (lambda g: Sender(1, g, TAG).send(_prefill(1, 4), [PREFILL, 0, 2, 0]).wait(20),
                 r"client \(rank 0\) sent a batch of 2 sequences of 0 tokens"),
    "past_the_context": (lambda g: Sender(1, g, TAG).send(_prefill(1, 4), [PREFILL, 0, 1, 1 << 40]).wait(20),
                         r"client \(rank 0\) sent 1099511627776 tokens at past 0: .* past the 64 tokens per "
                         r"sequence served \(max_length\)"),
    "over_the_token_budget": (lambda g: Sender(1, g, TAG).send(_prefill(1, 4), [PREFILL, 0, 8, 64]).wait(20),
                              r"client \(rank 0\) sent a batch of 8 at 64 tokens: 512 tokens, more than the 256 "
                              r"served \(max_tokens\)"),
    "foreign_dtype": (lambda g: Sender(1, g, TAG).send(_prefill(2, 4, torch.float64), [PREFILL, 0, 2, 4]).wait(20),
                      r"client \(rank 0\) sent hidden states of dtype torch.float64, want torch.float32"),
    "hidden_shape": (lambda g: Sender(1, g, TAG).send(_prefill(2, 5), [PREFILL, 0, 2, 4]).wait(20),
                     r"client \(rank 0\) sent hidden states of shape \(2, 5, 64\), want \(2, 4, 64\)"),
    "wrong_codec": (lambda g: Sender(1, g, TAG).send([get_codec("fp16").encode(torch.randn(2, 4, H)),
                                                      INTPACK.encode(torch.ones(2, 4, dtype=torch.long))],
                                                     [PREFILL, 0, 2, 4]).wait(20),
                    r"client \(rank 0\) sent hidden states with a corrupt header: field 'codec_id' = \d+ \(fp16\) "
                    r"but this codec is 0 \(none\)"),
    # a 32 KiB bit-packed mask that declares 2^18 values: refused by its header, never expanded
    "mask_shape": (lambda g: Sender(1, g, TAG).send([NONE.encode(torch.randn(2, 4, H)),
                                                     INTPACK.encode(torch.ones(256, 1024, dtype=torch.long))],
                                                    [PREFILL, 0, 2, 4]).wait(20),
                   r"client \(rank 0\) sent a prompt mask of shape \(256, 1024\), want \(2, 4\)"),
    # a message past what the limits allow (here 256 tokens of 64 float32 values): refused by its size word,
    # before the rest of it is allocated
    "message_size": (lambda g: _UNWAITED.append(Sender(1, g, TAG).send(
                         [NONE.encode(torch.randn(2, 300, H)), INTPACK.encode(torch.ones(2, 300, dtype=torch.long))],
                         [PREFILL, 0, 2, 300])),  # its second part is never received
                     r"corrupt message from rank 0: its size word says \d+ bytes, outside \[\d+, 133120\]"),
    "empty_prompt": (lambda g: Sender(1, g, TAG).send(_prefill(2, 4, mask=torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])),
                                                      [PREFILL, 0, 2, 4]).wait(20),
                     r"client \(rank 0\) sent a prompt mask with an empty row"),
    "decode_before_prefill": (lambda g: Sender(1, g, TAG).send([NONE.encode(torch.randn(3, 1, H))],
                                                               [DECODE, 0, 3, 1]).wait(20),
                              r"client \(rank 0\) sent a decode step with meta \[2, 0, 3, 1\]"),
    "payload_count": (lambda g: Sender(1, g, TAG).send(_prefill(2, 4)[:1], [PREFILL, 0, 2, 4]).wait(20),
                      r"client \(rank 0\) sent 1 payloads with meta \[1, 0, 2, 4\]; a prefill has 2"),
    # fewer bytes than the size word, in a message of one part or in either part of two: the receive buffer's
    # zeros never reach the blocks
    "truncated": (lambda g: _send_raw(_message(_prefill(1, 1)[:1], [PREFILL, 0, 1, 1])[:-100], g),
                  TRUNCATED + r"its \d+ bytes"),
    "truncated_first_part": (lambda g: _send_parts(_prefill(2, 4), [PREFILL, 0, 2, 4], 0, g),
                             TRUNCATED + r"its first part of 512 bytes"),
    "truncated_second_part": (lambda g: _send_parts(_prefill(2, 4), [PREFILL, 0, 2, 4], 1, g),
                              TRUNCATED + r"its \d+ bytes"),
    # a size word of 8 GiB behind 600 bytes of headers (more than the first part holds): bounded by the
    # largest message the limits allow, before anything is allocated for the rest
    "size_word": (lambda g: _send_raw(_lying_size(), g),
                  r"corrupt message from rank 0: its size word says 8589934592 bytes, outside \[\d+, \d+\]"),
}
#: To a server whose pairs are anchored: every message carries the token ids last, checked against the vocabulary.
ANCHORED_CASES = {
    "ids_missing": (lambda g: Sender(1, g, TAG).send([NONE.encode(torch.randn(2, 4, 8)),
                                                      INTPACK.encode(torch.ones(2, 4, dtype=torch.long))],
                                                     [PREFILL, 0, 2, 4]).wait(20),
                    r"client \(rank 0\) sent 2 payloads with meta \[1, 0, 2, 4\]; a prefill has 3 \(hidden states, "
                    r"the prompt mask at prefill, token ids\)"),
    "ids_shape": (lambda g: Sender(1, g, TAG).send([NONE.encode(torch.randn(2, 4, 8)),
                                                    INTPACK.encode(torch.ones(2, 4, dtype=torch.long)),
                                                    INTPACK.encode(torch.ones(2, 5, dtype=torch.long))],
                                                   [PREFILL, 0, 2, 4]).wait(20),
                  r"client \(rank 0\) sent token ids of shape \(2, 5\), want \(2, 4\)"),
    "ids_outside_the_vocabulary": (lambda g: Sender(1, g, TAG).send([NONE.encode(torch.randn(1, 2, 8)),
                                                                     INTPACK.encode(torch.ones(1, 2, dtype=torch.long)),
                                                                     INTPACK.encode(torch.tensor([[5, 97]]))],
                                                                    [PREFILL, 0, 1, 2]).wait(20),
                                   r"client \(rank 0\) sent token ids outside the vocabulary \[0, 97\)"),
}


def _send_parts(payloads, meta, short: int, group=None) -> None:
    """Send a message in the transport's two parts (a new stream: 512 bytes), part ``short`` 100 bytes short."""
    parts = split_parts(_message(payloads, meta), MIN_CAPACITY)
    assert len(parts) == 2
    parts[short] = parts[short][:-100]
    for part in parts:
        _send_raw(part, group)


def _lying_size() -> torch.Tensor:
    buf = _message([NONE.encode(torch.zeros(1)) for _ in range(40)], [PREFILL, 0, 1, 1])[:512].clone()
    buf.view(torch.int64)[1] = 1 << 33
    return buf


def check_honest_client_within_the_limits(rank: int) -> None:
    """The limits do not refuse what they allow: a batch of 4 prompts of 8 tokens and 56 new ones fills the
    64-token context, 4 x 64 = 256 tokens, the budget, exactly."""
    group = dist.new_group([0, 1])
    if rank == 1:
        assert serve(StageBlocks(MIDDLE, MODEL.config), 0, timeout=20, group=group, limits=LIMITS) == 56
    else:
        ids = torch.randint(3, 97, (4, 8), generator=torch.Generator().manual_seed(0))
        server = RemoteServer(1, timeout=20, group=group)
        out = generate(ClientStages(FRONT, BACK, MODEL.config), server, ids, max_new_tokens=56, max_length=CONTEXT)
        server.close()
        assert out.shape == (4, 64)
    dist.barrier(group)


def check_lying_server_is_refused(rank: int) -> None:
    """A server that answers a prefill with hidden states of another shape: the client refuses it before
    decoding, naming the server."""
    group = dist.new_group([0, 1])
    if rank == 1:
        Receiver(0, group, TAG).recv("cpu", 20)
        Sender(0, group, TAG + 1).send([NONE.encode(torch.randn(1, 3, H))], [HIDDEN, 0, 1, 2]).wait(20)
    else:
        with pytest.raises(ValueError, match=r"server \(rank 1\) sent hidden states of shape \(1, 3, 64\), want "
                                             r"\(1, 2, 64\)"):
            generate(ClientStages(FRONT, BACK, MODEL.config), RemoteServer(1, timeout=20, group=group),
                     torch.tensor([[5, 6]]), max_new_tokens=1)
    dist.barrier(group)


CHECKS = {f"check_{name}": _case(*case) for name, case in CASES.items()}
CHECKS |= {f"check_{name}": _case(*case, middle=ANCHORED) for name, case in ANCHORED_CASES.items()}
CHECKS |= {c.__name__: c for c in (check_honest_client_within_the_limits, check_lying_server_is_refused)}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return spawn_checks(CHECKS, 2, tmp_path_factory.mktemp("hostile_server"))


@pytest.mark.parametrize("name", list(CHECKS))
def test_hostile_peer(outcomes, name):
    assert_ranks_ok(outcomes, name, 2)


def test_limits_are_checked_when_made():
    with pytest.raises(ValueError, match="max_length and max_tokens must be >= 1"):
        ServerLimits(max_tokens=0)
    assert ServerLimits(max_length=32).context(MODEL.config) == 32
    assert ServerLimits(max_length=1 << 20).context(MODEL.config) == CONTEXT  # never past the model's context
