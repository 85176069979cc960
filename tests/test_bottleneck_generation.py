"""Split generation of a run trained with boundary bottlenecks (``dgpipe-lm generate --checkpoint``): the run's stages
rebuilt from its checkpoint, each pair at its boundary, and generated through a client and a server.

A tiny Llama trained 2 steps client/server with pairs of different widths at its two boundaries (8 channels out of
the client, 16 back from the server) and ``--save``: the KV-cache path of split generation (prefill, through the
pairs) gives the logits of the run's stages run whole on the sequence; the CLI between two processes, uncompressed,
prints the greedy tokens of those stages run whole, and the meter counts the pairs' channels; bad input -- a
``--client-layers`` elsewhere than the pairs sit, an export, a linear run -- is one line each.

Anchored runs -- pairs on the model's token embedding (``--bottleneck-anchor``), a residual subspace with its fixed
table or with stage tables (``--bottleneck-subspace fixed|stage``) -- trained 2 steps uncompressed and saved: the
stages :func:`load_run` rebuilds score the run's own last validation loss (so the subspace's fixed table, rebuilt
from the seed, and every stage's table are the run's); the KV-cache path through them, the token ids beside the
pairs' channels, gives their logits and meters the ids; the CLI between two processes prints their greedy tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dgpipe.cli import export as export_cli
from dgpipe.cli import generate
from dgpipe.compression import get_codec
from helpers import ROOT, corpus_slice, load_cli, one_line_error

WIKI = ROOT.parent / "shared" / "data" / "text" / "wiki-excerpt"
LM = load_cli("test_lm_dgpipe")
pytestmark = [pytest.mark.usefixtures("no_torchrun"),
              pytest.mark.skipif(not WIKI.is_dir(), reason=f"real text corpus not found at {WIKI}")]
WIDTHS = {0: 8, 1: 16}
PROMPT = "The history of the"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``(checkpoint folder, cache folder)`` of the trained run."""
    folder = tmp_path_factory.mktemp("bottleneck-run")
    corpus = corpus_slice(WIKI, folder / "wiki", {"train": 20_000, "valid": 6_000, "test": 6_000})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DGPIPE_CACHE", str(folder / "cache"))
        code = LM.main(["--data-dir", str(corpus), "--model-config", "tiny-llama", "--tokenizer", "bpe:400",
                        "--block-length", "32", "--batch-size", "4", "--chunk", "2", "--max-steps", "2",
                        "--eval-subset", "4", "--lr", "1e-2", "--num-workers", "0", "--no-progress",
                        "--bottleneck", ",".join(f"{i}:{w}" for i, w in WIDTHS.items()),
                        "--save", str(folder / "ckpt")])
    assert code == 0
    return folder / "ckpt", folder / "cache"


def _whole(stages, ids: torch.Tensor) -> torch.Tensor:
    """The run's stages run one after the other on ``ids`` (training's path, no cache): logits ``(B, L, V)``."""
    value = ids
    with torch.no_grad():
        for stage in stages:
            value = stage(value)
    return value


def test_the_kv_cache_path_through_the_pairs_gives_the_stages_logits(run, monkeypatch):
    from dgpipe.comm import BandwidthMeter
    from dgpipe.generation import ClientStages, LocalServer, StageBlocks, score
    from dgpipe.train.export import load_run

    monkeypatch.setenv("DGPIPE_CACHE", str(run[1]))
    loaded = load_run(str(run[0]))
    front, middle, back = (list(stage.children()) for stage in loaded.stages)
    client = ClientStages(front, back, loaded.model.config)
    server = StageBlocks(middle, loaded.model.config)
    assert (client.first.width_out, server.width_in, server.width_out, client.last.width_in) == (8, 8, 16, 16)
    ids = torch.randint(0, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    local = LocalServer(server)
    local.meter = BandwidthMeter()  # replaced between calls, as a benchmark does per prompt set
    got = score(client, local, ids, mask)
    records = {r["name"]: r for r in local.meter.records()}  # the pairs' channels, 8 out and 16 back, float32
    assert (records["client->server"]["raw_bytes"], records["server->client"]["raw_bytes"]) == (2 * 12 * 8 * 4,
                                                                                                2 * 12 * 16 * 4)
    want = torch.stack([_whole(loaded.stages, ids[0:1])[0], torch.cat([got[1, :3], _whole(loaded.stages,
                                                                                           ids[1:2, 3:])[0]])])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_generate_between_two_processes_prints_the_stages_greedy_tokens(run, monkeypatch, capfd, tmp_path):
    from dgpipe.train.export import load_run

    monkeypatch.setenv("DGPIPE_CACHE", str(run[1]))
    loaded = load_run(str(run[0]))
    ids = loaded.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    prompt_length = ids.shape[1]
    for _ in range(8):
        ids = torch.cat([ids, _whole(loaded.stages, ids)[:, -1:].argmax(-1)], 1)
    text = loaded.tokenizer.decode(ids[0, -8:], skip_special_tokens=True)
    log = tmp_path / "generate.json"
    assert generate.main(["--checkpoint", str(run[0]), "--prompt", PROMPT, "--max-new-tokens", "8",
                          "--timeout", "120", "--log-file", str(log)]) == 0
    printed = capfd.readouterr().out  # the client is a spawned process
    assert f"--- {PROMPT!r}\n{text}\n" in printed
    # what crossed: the pairs' channels, 8 out and 16 back, float32, for the prompt and 7 decode steps
    sent = {r["name"]: r for r in json.loads(log.read_text())["meter"]}["client->server"]
    assert sent["raw_bytes"] == (prompt_length + 7) * WIDTHS[0] * 4 and sent["count"] == 8
    bits = 32 * sent["wire_bytes"] / sent["raw_bytes"] * WIDTHS[0] / 64  # a value of the model's width, all-in
    assert f"({bits:.2f} bits/value of float32 over the model's 64 channels)" in printed


def _broken(run, tmp_path, **changes) -> Path:
    """A copy of the run whose recorded arguments say ``changes``."""
    copy = tmp_path / "ckpt"
    shutil.copytree(run[0], copy)
    for meta in copy.glob("step-*/meta.json"):
        data = json.loads(meta.read_text())
        data["args"].update(changes)
        meta.write_text(json.dumps(data))
    return copy


def test_refusals(run, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DGPIPE_CACHE", str(run[1]))
    base = ["--prompt", PROMPT, "--max-new-tokens", "2", "--world-size", "1"]
    err = one_line_error(generate.main, ["--checkpoint", str(run[0]), "--client-layers", "2", *base], capsys)
    assert "--client-layers 2: the run's bottlenecks sit after the client's 1 block(s) at each end" in err
    err = one_line_error(export_cli.main, [str(run[0]), str(tmp_path / "hf")], capsys)
    assert "the run has boundary bottlenecks (--bottleneck 0:8,1:16), layers no transformers architecture" in err
    linear = _broken(run, tmp_path / "linear", partition="linear")
    err = one_line_error(generate.main, ["--checkpoint", str(linear), *base], capsys)
    assert "bottlenecks sit at the boundaries of a linear partition; split generation takes a run cut" in err


ANCHORED = {"anchor": ["--bottleneck-anchor"], "fixed": ["--bottleneck-subspace", "fixed"],
            "stage": ["--bottleneck-subspace", "stage"]}
WIDTH, BLOCK, EVAL = 16, 32, 4
NONE, INTS = get_codec("none"), get_codec("intpack")


@pytest.fixture(scope="module")
def anchored_runs(tmp_path_factory):
    """``{kind: (checkpoint folder, log)}`` of the anchored runs, and their cache folder."""
    folder = tmp_path_factory.mktemp("anchored-runs")
    corpus = corpus_slice(WIKI, folder / "wiki", {"train": 20_000, "valid": 6_000, "test": 6_000})
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DGPIPE_CACHE", str(folder / "cache"))
        for kind, flags in ANCHORED.items():
            code = LM.main(["--data-dir", str(corpus), "--model-config", "tiny-llama", "--tokenizer", "bpe:400",
                            "--block-length", str(BLOCK), "--batch-size", "4", "--chunk", "2", "--max-steps", "2",
                            "--eval-subset", str(EVAL), "--lr", "1e-2", "--num-workers", "0", "--no-progress",
                            "--seed", "3", "--bottleneck", str(WIDTH), *flags, "--save", str(folder / kind),
                            "--log", str(folder / f"{kind}.jsonl")])
            assert code == 0
            out[kind] = (folder / kind, folder / f"{kind}.jsonl")
    return out, folder / "cache"


@pytest.mark.parametrize("kind", list(ANCHORED))
def test_anchored_stages_score_the_runs_validation_loss(anchored_runs, kind, monkeypatch):
    from dgpipe.train.export import load_run
    from dgpipe.train.lm import token_blocks
    from dgpipe.train.runlog import read_summary

    done, cache = anchored_runs
    monkeypatch.setenv("DGPIPE_CACHE", str(cache))
    loaded = load_run(str(done[kind][0]))
    args = loaded.args
    blocks = token_blocks(args["data_dir"], args["eval_split"], loaded.tokenizer, BLOCK, EVAL)
    x = torch.stack([blocks[i][0] for i in range(len(blocks))])
    y = torch.stack([blocks[i][1] for i in range(len(blocks))])
    loss = float(torch.nn.functional.cross_entropy(_whole(loaded.stages, x).flatten(0, 1), y.flatten()))
    assert loss == pytest.approx(read_summary(done[kind][1])["value"], rel=1e-5)


@pytest.mark.parametrize("kind", list(ANCHORED))
def test_the_kv_cache_path_through_anchored_pairs_gives_the_stages_logits(anchored_runs, kind, monkeypatch):
    from dgpipe.comm import BandwidthMeter
    from dgpipe.generation import ClientStages, LocalServer, StageBlocks, score
    from dgpipe.train.export import load_run

    monkeypatch.setenv("DGPIPE_CACHE", str(anchored_runs[1]))
    loaded = load_run(str(anchored_runs[0][kind][0]))
    front, middle, back = (list(stage.children()) for stage in loaded.stages)
    client, server = ClientStages(front, back, loaded.model.config), StageBlocks(middle, loaded.model.config)
    assert client.sends_ids and server.needs_ids
    ids = torch.randint(0, 400, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    local = LocalServer(server, meter=BandwidthMeter())
    got = score(client, local, ids, mask)
    want = torch.stack([_whole(loaded.stages, ids[0:1])[0], torch.cat([got[1, :3], _whole(loaded.stages,
                                                                                           ids[1:2, 3:])[0]])])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    sent = {r["name"]: r for r in local.meter.records()}["client->server"]  # the pair's channels, the mask, the ids
    assert sent["wire_bytes"] == _channels(ids) + INTS.encode(mask).nbytes + INTS.encode(ids).nbytes
    with pytest.raises(ValueError, match="anchored: call it with the new tokens' ids"):
        server(torch.zeros(1, 1, WIDTH), None, torch.zeros(1, 1, dtype=torch.long))


def test_generate_an_anchored_run_between_two_processes(anchored_runs, monkeypatch, capfd, tmp_path):
    from dgpipe.train.export import load_run

    ckpt = anchored_runs[0]["stage"][0]
    monkeypatch.setenv("DGPIPE_CACHE", str(anchored_runs[1]))
    loaded = load_run(str(ckpt))
    ids = loaded.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    prompt = ids
    for _ in range(6):
        ids = torch.cat([ids, _whole(loaded.stages, ids)[:, -1:].argmax(-1)], 1)
    text = loaded.tokenizer.decode(ids[0, -6:], skip_special_tokens=True)
    log = tmp_path / "generate.json"
    assert generate.main(["--checkpoint", str(ckpt), "--prompt", PROMPT, "--max-new-tokens", "6",
                          "--timeout", "120", "--log-file", str(log)]) == 0
    assert f"--- {PROMPT!r}\n{text}\n" in capfd.readouterr().out
    # forward: the pair's 16 float32 channels, the prompt mask once and every step's ids (intpack)
    sent = {r["name"]: r for r in json.loads(log.read_text())["meter"]}["client->server"]
    steps = [prompt] + [ids[:, i: i + 1] for i in range(prompt.shape[1], ids.shape[1] - 1)]
    assert sent["count"] == 6 and sent["wire_bytes"] == sum(_channels(s) + INTS.encode(s).nbytes for s in steps) \
        + INTS.encode(torch.ones_like(prompt)).nbytes


def _channels(ids: torch.Tensor) -> int:
    """Payload bytes of the pair's float32 channels for the tokens ``ids`` ``(B, L)`` (codec ``none``)."""
    return NONE.encode(torch.zeros(*ids.shape, WIDTH)).nbytes
