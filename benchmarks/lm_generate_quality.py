"""Split inference quality through a coded link: SmolLM2-135M-Instruct (offline GGUF), client/server with one
block at each end on the client, the server in process (the codecs applied both ways exactly as between
processes), on held-out Shakespeare.

Per codec setting and prompt set (3 disjoint sets of ``--blocks`` held-out blocks of ``--length`` tokens,
the seeds of the table):

- held-out perplexity: the blocks scored through the link as a prefill (the KV-cache path of
  :func:`dgpipe.generation.score`), exp of the mean next-token NLL, paired with the lossless link's;
- greedy top-1 agreement: the first half of each block is a prompt; the lossless link's greedy continuation of
  ``--new`` tokens is scored, teacher-forced, through the coded link, and the share of positions whose argmax
  is the lossless token is reported;
- bits per value each way, all-in (payload bytes x 8 / values), from the meter.

Settings ``+ means`` code each direction against the running per-channel means both sides keep
(``channel_mean``), ``scaled means`` also weigh the residual's channels by their running variance ** -1/4
(``channel_scale``); their link first carries ``--calibration`` training blocks and then learns on from every
message, as a server that has served before; one link per setting serves all the prompt sets in turn.

With ``--checkpoint DIR`` -- a ``dgpipe-lm`` run of this model trained client/server, e.g. adapted by ``--distill``
-- the settings run through the run's stages while the reference (perplexity and greedy tokens) stays the unsplit
original model: with boundary bottlenecks the settings of :data:`BOTTLENECK_SETTINGS` (the pairs' channels cross,
coded), without them those of :data:`SETTINGS`; bits a value count each direction's bytes over the model's width
(576 channels). A run trained from scratch (``--model-config``, e.g. with its residual stream in a subspace:
``--bottleneck-subspace``) is its own reference: its stages uncoded (the pairs' channels in float32), on its own
corpus with its own tokenizer; the token ids its anchored pairs need cross beside the channels and count in the
bits.

Prints a markdown table (mean over the prompt sets and the 95% t-interval of the perplexity change).

    python benchmarks/lm_generate_quality.py [--blocks 8] [--length 64] [--new 16] [--sets 3] [--only A,B]
        [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

from dgpipe.comm import BandwidthMeter
from dgpipe.data.text import tokenize_corpus
from dgpipe.generation import ClientStages, LocalServer, StageBlocks, generate, score
from dgpipe.models import client_server_split
from dgpipe.models.causal_lm import build_causal_lm, causal_lm_layers, resolve_lm
from dgpipe.experiments.lm_benchmark import mean_interval

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "data" / "text" / "shakespeare"
def _cb(**options) -> tuple[str, dict]:
    """The codebook with per-token scales after a Hadamard rotation (``bits`` or ``count`` levels)."""
    return "codebook", {"group": "token", "rotate": "hadamard", "scale_dtype": "bfloat16", **options}


def _uniform(bits: int) -> tuple[str, dict]:
    """Uniform min-max levels per token after a Hadamard rotation (``quant``): the codebooks' finer neighbours."""
    return "quant", {"bits": bits, "group": "token", "rotate": "hadamard", "scale_dtype": "bfloat16"}


#: label -> (client -> server codec, server -> client codec, code against the running channel means, weigh the
#: residual's channels too), codecs as ``(name, options)``
SETTINGS = {
    "none": (("none", {}), ("none", {}), False, False),
    "quant8": (("quant", {"bits": 8}), ("quant", {"bits": 8}), False, False),
    "codebook4": (_cb(bits=4), _cb(bits=4), False, False),
    "codebook5lv": (_cb(count=5), _cb(count=5), False, False),
    "codebook2": (_cb(bits=2), _cb(bits=2), False, False),
    "codebook4 + means": (_cb(bits=4), _cb(bits=4), True, False),
    "codebook3 + means": (_cb(bits=3), _cb(bits=3), True, False),
    "codebook3lv/8lv + means": (_cb(count=3), _cb(count=8), True, False),
    "codebook4lv/7lv + means": (_cb(count=4), _cb(count=7), True, False),
    "codebook5lv + means": (_cb(count=5), _cb(count=5), True, False),
    "codebook2 + means": (_cb(bits=2), _cb(bits=2), True, False),
    "codebook4 + scaled means": (_cb(bits=4), _cb(bits=4), True, True),
    "codebook3 + scaled means": (_cb(bits=3), _cb(bits=3), True, True),
    "codebook5lv + scaled means": (_cb(count=5), _cb(count=5), True, True),
    "codebook5lv/6lv + scaled means": (_cb(count=5), _cb(count=6), True, True),
    "codebook4lv/7lv + scaled means": (_cb(count=4), _cb(count=7), True, True),
    "codebook2 + scaled means": (_cb(bits=2), _cb(bits=2), True, True),
    "codebook1 + scaled means": (_cb(bits=1), _cb(bits=1), True, True),
    "quant5 + scaled means": (_uniform(5), _uniform(5), True, True),
    "quant6 + scaled means": (_uniform(6), _uniform(6), True, True),
    "quant8 + scaled means": (_uniform(8), _uniform(8), True, True),
}


def _rows(bits: int) -> tuple[str, dict]:
    """Uniform min-max levels per token (``quant``) without a rotation: a bottleneck's channels are not a power of
    two (the rotation would pad them)."""
    return "quant", {"bits": bits, "group": "token", "scale_dtype": "bfloat16"}


#: The settings of a run with bottlenecks (``--checkpoint``): its pairs' channels, coded.
BOTTLENECK_SETTINGS = {
    "pairs float32": (("none", {}), ("none", {}), False, False),
    "pairs bf16": (("bf16", {}), ("bf16", {}), False, False),
    "pairs quant8": (_rows(8), _rows(8), False, False),
    "pairs quant6": (_rows(6), _rows(6), False, False),
    "pairs quant4": (_rows(4), _rows(4), False, False),
    "pairs quant2": (_rows(2), _rows(2), False, False),
}


def _adapted(directory: str):
    """``((client, server stage, widths), run)`` of a run: its client/server stages (LoRA adapters merged; with
    bottlenecks, the run's stages, else cut as the run was), the channels each direction carries, and the run
    (:class:`dgpipe.train.export.Run`)."""
    from dgpipe.train.export import load_run

    run = load_run(directory)
    if run.peft_model is not None:
        run.peft_model.merge_and_unload()  # in place: the stages hold the same layers
    stages = run.stages or client_server_split(causal_lm_layers(run.model), int(run.args["client_layers"]), (1, 1))
    front, middle, back = (list(stage.children()) for stage in stages)
    client = ClientStages(front, back, run.model.config)
    return (client, StageBlocks(middle, run.model.config), (client.first.width_out, client.last.width_in)), run


def _models(checkpoint: str | None):
    """``(reference, adapted, tokenizer, corpus, title, bottlenecks)``: the reference's and the adapted run's
    ``(client, server stage, widths)`` (None without ``--checkpoint``), and whether the run has bottlenecks. The
    reference is SmolLM2 unsplit-equivalent (its client/server stages uncoded) on Shakespeare, or -- for a run trained
    from scratch (``--model-config``, with or without bottlenecks) -- the run's own stages uncoded on its own corpus
    and tokenizer."""
    from transformers import AutoTokenizer

    adapted, run = _adapted(checkpoint) if checkpoint else (None, None)
    if run is not None and run.args.get("model_config"):
        name = f"{run.args['model_config']} trained from scratch ({checkpoint})"
        return adapted, adapted, run.tokenizer, Path(run.args["data_dir"]), name, run.stages is not None
    source = resolve_lm("smollm2-135m-instruct")
    model = build_causal_lm(source).eval()
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    front, middle, back = client_server_split(causal_lm_layers(model), 1, (1, 1))
    hidden = model.config.hidden_size
    reference = (ClientStages(front, back, model.config), StageBlocks(middle, model.config), (hidden, hidden))
    return reference, adapted, tokenizer, CORPUS, "SmolLM2-135M-Instruct", run is not None and run.stages is not None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=8, help="held-out blocks per prompt set")
    p.add_argument("--length", type=int, default=64, help="tokens per block")
    p.add_argument("--new", type=int, default=16, help="greedy tokens per prompt (agreement)")
    p.add_argument("--sets", type=int, default=3, help="prompt sets (disjoint)")
    p.add_argument("--calibration", type=int, default=32,
                   help="training blocks sent through a link with channel means before the first prompt set")
    p.add_argument("--only", help="comma-separated settings (default: all; none is always run)")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="a run with boundary bottlenecks: its settings through its stages")
    args = p.parse_args()
    reference, adapted, tokenizer, corpus, name, paired = _models(args.checkpoint)
    ids = tokenize_corpus(str(corpus), "valid", tokenizer)
    train = tokenize_corpus(str(corpus), "train", tokenizer)[: args.calibration * args.length]
    table = BOTTLENECK_SETTINGS if paired else SETTINGS
    settings = {"none": SETTINGS["none"], **{k: v for k, v in table.items()
                                             if args.only is None or k in args.only.split(",")}}
    n = args.blocks * args.length
    client, stage, _ = reference
    hidden = reference[0].embeddings.embed_tokens.weight.shape[1]
    # (client, server stage, channels each way) per setting
    through = {k: reference if k == "none" or adapted is None else adapted for k in settings}
    results: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in settings}
    # one link per setting for all prompt sets, as a server serves one client: the channel means learn from
    # the calibration text first and then from every message (both sides alike)
    links = {k: LocalServer(through[k][1], act, ret, channel_mean=means, channel_scale=scaled)
             for k, (act, ret, means, scaled) in settings.items()}
    for label, (_, _, means, _) in settings.items():
        for i in range(0, args.calibration if means else 0, args.blocks):
            text = train[i * args.length: (i + args.blocks) * args.length]
            score(through[label][0], links[label], text.reshape(-1, args.length))
    for s in range(args.sets):
        blocks = ids[s * n: (s + 1) * n].reshape(args.blocks, args.length)
        prompts = blocks[:, : args.length // 2]
        reference = generate(client, LocalServer(stage), prompts, None, args.new)
        for label in settings:
            meter = BandwidthMeter()  # the bits of the held-out blocks' messages
            server, links[label].meter = links[label], meter
            user, _, widths = through[label]
            logits = score(user, server, blocks)
            nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                    blocks[:, 1:].reshape(-1))
            server.meter = None
            forced = score(user, server, reference)
            start = prompts.shape[1] - 1
            agree = (forced[:, start:-1].argmax(-1) == reference[:, start + 1:]).float().mean()
            rec = {r["name"]: r for r in meter.records()}
            bits = [32 * rec[k]["wire_bytes"] / rec[k]["raw_bytes"] * w / hidden  # over the model's width
                    for k, w in zip(("client->server", "server->client"), widths)]
            results[label].append((math.exp(float(nll)), float(agree), *bits))
            print(f"set {s} {label}: ppl {math.exp(float(nll)):.3f} agreement {float(agree):.4f} bits "
                  f"{bits[0]:.2f}/{bits[1]:.2f}", file=sys.stderr, flush=True)
    base = [r[0] for r in results["none"]]
    print(f"{name}, client/server (1 block each end on the client), {corpus.name} valid: {args.sets} "
          f"prompt sets x {args.blocks} blocks of {args.length} tokens; agreement over {args.new} greedy tokens")
    print("| setting | bits c->s / s->c (avg) | held-out ppl | Δ ppl % [95% CI] | greedy top-1 agreement |")
    print("|---|---|---|---|---|")
    for label, rows in results.items():
        mean, low, high = mean_interval([100 * (r[0] / b - 1) for r, b in zip(rows, base)])
        c2s, s2c = statistics.mean(r[2] for r in rows), statistics.mean(r[3] for r in rows)
        print(f"| {label} | {c2s:.2f} / {s2c:.2f} ({(c2s + s2c) / 2:.2f}) | {statistics.mean(r[0] for r in rows):.3f} "
              f"| {mean:+.2f} [{low:+.2f}, {high:+.2f}] "
              f"| {statistics.mean(r[1] for r in rows):.4f} (min {min(r[1] for r in rows):.4f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
