"""The language-model job: a decoder LM pretrained or fine-tuned on a text corpus or on instruction data.

Data from :mod:`dgpipe.data.text` (a local corpus folder with train/valid/test ``.txt`` files, or
a Hugging Face dataset online) or :mod:`dgpipe.data.chat` (a folder of ``.jsonl`` conversations, the loss on
the assistant's tokens), tokenized and packed into blocks of ``--block-length`` tokens; the
model from :mod:`dgpipe.models.causal_lm` -- pretrained weights (``--model``: a local directory, a
GGUF file, an offline package name such as ``smollm2-135m-instruct``, or a hub name online) or a
random initialisation (``--model-config``: a preset of :data:`~dgpipe.models.causal_lm.LM_PRESETS`
or a config path). AdamW (betas 0.9/0.95) with a linear warm-up and cosine decay
(``transformers.get_cosine_schedule_with_warmup``), as GPT-style pretraining uses.

The loss is the mean next-token cross-entropy over a micro-batch's tokens; the metric is the
validation loss -- the mean token negative log-likelihood, in nats, over every held-out block
(the corpus's ``valid`` split, or ``test`` with ``--eval-split test``) -- and its perplexity
``exp(val_loss)``. Evaluation runs through the boundary codecs unless ``--no-compress-eval``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset

from dgpipe.data.chat import IGNORE, is_chat_corpus, read_conversations, tokenize_chat
from dgpipe.data.loading import make_dataloader
from dgpipe.data.text import TokenBlocks, load_tokenizer, read_corpus, tokenize_corpus
from dgpipe.models.bottleneck import (BottleneckDecoder, BottleneckEncoder, describe_pairs, fit_bottlenecks,
                                      insert_bottlenecks, parse_width, parse_widths)
from dgpipe.models.subspace import constrain_layers, residual_subspace, subspace_pairs
from dgpipe.pipeline.boundary import boundary_name
from dgpipe.models.causal_lm import (FAMILIES, LM_PRESETS, CausalEmbeddings, CausalLMHead, build_causal_lm,
                                     causal_lm_layers, preset_config, resolve_lm)

from .compare import LM_LINKS
from .config import RunConfig
from .engine import placement
from .job import Job, check_partition, decay_groups
from .lora import add_adapters, check_lora, lora_config
from .precision import PRECISIONS

__all__ = ["LMJob", "LMOptions", "DEFAULT_BPE", "lm_tokenizer", "random_config", "token_blocks"]

#: Tokenizer of a randomly initialised preset unless ``--tokenizer`` says otherwise.
DEFAULT_BPE = "bpe:4096"


@dataclass(frozen=True)
class LMOptions:
    """The LM job's own flags (``RunConfig.job``); see ``test_lm_dgpipe.py --help``.

    Attributes:
        model: pretrained weights (name, directory, ``.gguf`` file), or ``None`` with ``model_config``.
        model_config: a preset name or a config path (random initialisation), or ``None``.
        tokenizer: ``bpe:N``, a tokenizer folder or name; ``None`` until :meth:`LMJob.check` (then the
            model's own, or :data:`DEFAULT_BPE` for a random model).
        block_length: tokens per training and evaluation block.
        eval_split: the held-out split, ``"valid"`` or ``"test"``.
        weight_decay: AdamW weight decay (matrices only).
        warmup_ratio: fraction of the steps of linear warm-up.
        bottleneck: ``--bottleneck`` as given: the width of a trained encoder/decoder pair at every boundary
            (``D`` channels or a ratio ``1/N`` of the model's width) or at some (``I:W,J:W``); ``None``: none
            (:mod:`dgpipe.models.bottleneck`).
        bottleneck_anchor: the bottlenecks code the residual stream less the model's token embedding of the ids,
            which the decoder adds back (the ids then cross every boundary).
        bottleneck_subspace: the residual stream of a model trained from scratch is kept in one shared subspace of
            the ``--bottleneck`` width, so the pairs code it exactly (:mod:`dgpipe.models.subspace`): beside one fixed
            token table (``"fixed"``) or each stage's own trained one (``"stage"``); None: no subspace.
        bottleneck_init: how the pairs start: ``"pca"`` (the principal components of what crosses each boundary
            on :data:`PCA_BLOCKS` training blocks), ``"orthonormal"`` (a random basis), or ``"auto"``: PCA for
            pretrained weights (``--model``), orthonormal for a random model.
        lora: rank of LoRA adapters (``peft``) on the targeted modules of every block; 0: none (every weight
            trains). With adapters only they (and any bottleneck) train; the base weights are frozen.
        lora_alpha: LoRA's scale numerator (``None``: peft's default, 8).
        lora_dropout: dropout on the adapters' input.
        lora_targets: comma-separated module names the adapters attach to (``None``: peft's defaults for the
            family, e.g. ``q_proj,v_proj`` for Llama).
        distill: train to the unsplit model's own next-token distributions (KL divergence from a frozen copy
            of the model as it was built, on the training text) instead of the text's tokens; the model's
            weights frozen, only the bottlenecks and LoRA adapters train.
    """

    model: str | None
    model_config: str | None
    tokenizer: str | None
    block_length: int
    eval_split: str
    weight_decay: float
    warmup_ratio: float
    bottleneck: str | None = None
    bottleneck_anchor: bool = False
    bottleneck_subspace: str | None = None
    bottleneck_init: str = "auto"
    lora: int = 0
    lora_alpha: int | None = None
    lora_dropout: float = 0.0
    lora_targets: str | None = None
    distill: bool = False


PCA_BLOCKS = 32
"""Training blocks whose boundary states start the bottlenecks of a pretrained model (``--bottleneck-init pca``)."""


def token_blocks(corpus: str, split: str, tokenizer, length: int, limit: int | None = None) -> TokenBlocks:
    """A split's blocks of ``length`` tokens: packed text (``.txt`` splits), or packed conversations whose targets
    are the assistant's tokens only (``.jsonl`` chat splits, :mod:`dgpipe.data.chat`).

    Raises:
        ValueError: see :func:`~dgpipe.data.text.tokenize_corpus`, :func:`~dgpipe.data.chat.tokenize_chat` and
            :class:`~dgpipe.data.text.TokenBlocks`.
    """
    if is_chat_corpus(corpus):
        ids, labels = tokenize_chat(corpus, split, tokenizer)
        return TokenBlocks(ids, length, limit, labels)
    return TokenBlocks(tokenize_corpus(corpus, split, tokenizer), length, limit)


#: Sequences whose logits and float32 log-probabilities the loss and the evaluation hold at once (a whole
#: micro-batch's are ``B x L x vocab x 4`` bytes: 100 MB for 4 x 128 tokens of a 49k vocabulary).
LOSS_ROWS = 1


class _Windows(Dataset):
    """Training blocks whose target is the whole window of ``L + 1`` tokens (``--distill``: the teacher reads the
    inputs from it): ``(input_ids (L,), window (L + 1,))``."""

    def __init__(self, blocks: TokenBlocks) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.blocks[k]
        return x, torch.cat([x[:1], y])


def lm_tokenizer(opts: LMOptions, corpus: str | None):
    """``opts.tokenizer`` as a tokenizer: ``"model"`` is the pretrained model's own (a GGUF file's
    included), else :func:`dgpipe.data.text.load_tokenizer` (``bpe:N`` trained on ``corpus``)."""
    from transformers import AutoTokenizer

    if opts.tokenizer == "model":
        source = resolve_lm(opts.model)
        extra = {"gguf_file": source.gguf_file} if source.gguf_file else {}
        return AutoTokenizer.from_pretrained(source.path, **extra)
    return load_tokenizer(opts.tokenizer, corpus)


def random_config(opts: LMOptions, vocab_size: int):
    """The config to initialise randomly (``--model-config``), or ``None`` for pretrained weights."""
    from transformers import AutoConfig

    if opts.model_config is None:
        return None
    if opts.model_config in LM_PRESETS:
        return preset_config(opts.model_config, vocab_size, opts.block_length)
    config = AutoConfig.from_pretrained(opts.model_config)
    config.vocab_size = vocab_size
    return config


class LMJob(Job):
    """A decoder LM on a text corpus; see :class:`~dgpipe.train.job.Job` for the interface.

    The client of a client/server partition keeps the embeddings and the LM head (``pinned``), so
    tied embeddings stay on one rank there.

    Attributes:
        vocab: the model's vocabulary size, set by :meth:`build_layers`.
    """

    options = LMOptions
    pinned = (1, 1)
    classifier = False
    step_records = True
    links = LM_LINKS
    metric = "val_loss"
    metric_names = ("val_loss", "val_ppl")

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.tokenizer = lm_tokenizer(config.job, config.data.data_dir)
        self.bottlenecks: dict[str, int] = {}  # boundary name -> channels that cross (:meth:`shape_stages`)

    @classmethod
    def check(cls, config: RunConfig) -> LMOptions:
        """Check the corpus, tokenizer, model and partition in the launching process (a trained
        ``bpe:N`` tokenizer and the token streams are cached on disk here, once for all ranks).

        Returns ``config.job`` with ``tokenizer`` resolved (``"model"``: the pretrained model's own).

        Raises:
            ValueError: no or a missing corpus, neither or both of ``--model``/``--model-config``, an
                unknown preset or family, a GGUF file without the ``gguf`` package, a block length past
                the model's context or too long for the held-out split, a bad partition.
        """
        from transformers import AutoConfig

        opts, data = config.job, config.data
        if data.data_dir is None:
            raise ValueError("--data-dir: give a corpus folder with train.txt/valid.txt/test.txt (e.g. "
                             "../shared/data/text/wiki-excerpt) or, online, a Hugging Face dataset NAME[:CONFIG]")
        _check_flags(config)
        if opts.model is not None:
            resolve_lm(opts.model)  # an offline package or a GGUF file without what reads it: ValueError
        chat = is_chat_corpus(data.data_dir)
        read = read_conversations if chat else read_corpus
        for split in ("train", opts.eval_split):
            read(data.data_dir, split)
        opts = replace(opts, tokenizer=opts.tokenizer or ("model" if opts.model is not None else DEFAULT_BPE))
        if chat and opts.tokenizer.startswith("bpe:"):
            raise ValueError(f"--data-dir {data.data_dir} holds chat data: give a tokenizer that can render it "
                             "(--model's own, or --tokenizer DIR, e.g. ../shared/data/tokenizers/gpt2)")
        if chat and opts.distill:
            raise ValueError("--distill trains on raw text against the model's own outputs; give a text corpus")
        try:
            tokenizer = lm_tokenizer(opts, data.data_dir)
            model_config = random_config(opts, len(tokenizer))
            if model_config is None:
                source = resolve_lm(opts.model)
                model_config = AutoConfig.from_pretrained(
                    source.path, **({"gguf_file": source.gguf_file} if source.gguf_file else {}))
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load the model or tokenizer ({e}); pass --model as a local directory, a "
                             "GGUF file or a hub name (online), or --model-config PRESET for a random model") from None
        _check_fit(opts, config, data.data_dir, tokenizer, model_config, cls.pinned)
        return opts

    def build_layers(self) -> list[nn.Module]:
        from transformers.utils import logging as hf_logging

        if dist.is_initialized() and dist.get_rank() != 0 or not self.config.log.progress:
            hf_logging.set_verbosity_error()  # the load report and progress bars once, from rank 0, or never
            hf_logging.disable_progress_bar()
        opts = self.config.job
        config = random_config(opts, len(self.tokenizer))
        model = build_causal_lm(config if config is not None else resolve_lm(opts.model))
        if opts.distill:  # the teacher: the model as built, frozen; the student's own weights frozen too
            self.teacher = copy.deepcopy(model).eval().requires_grad_(False)
            model.requires_grad_(False)
        if opts.lora:
            model = add_adapters(model, lora_config(opts))
        config_: Any = model.config
        self.vocab, self.hidden_size = config_.vocab_size, int(config_.hidden_size)
        layers = causal_lm_layers(model, carry_ids=self.config.pipeline.token_reference or opts.bottleneck_anchor
                                  or opts.bottleneck_subspace)
        head = layers[-1]
        assert isinstance(head, CausalLMHead)  # causal_lm_layers' last layer
        head.defer_logits = self.config.train.activation_checkpointing and not opts.distill
        self.head = head
        first = layers[0]
        assert isinstance(first, CausalEmbeddings)  # causal_lm_layers' first layer
        self.token_embedding = first.embed_tokens
        if opts.bottleneck_subspace:  # one width at every boundary (LMJob.check)
            width = parse_width(str(opts.bottleneck), self.hidden_size)
            fixed = opts.bottleneck_subspace == "fixed"
            self.subspace = residual_subspace(first.embed_tokens, self.vocab, width, self.config.train.seed, fixed)
            constrain_layers(layers, self.subspace, embeddings=fixed)
        return layers

    def shape_stages(self, stages: list[nn.Module]) -> list[nn.Module]:
        """With ``--bottleneck``: a pair at the boundaries it names, each started as a random orthonormal basis
        (:func:`~dgpipe.models.bottleneck.insert_bottlenecks`; the identity at the model's full width)."""
        spec = self.config.job.bottleneck
        if spec is None:
            return stages
        opts = self.config.job
        widths = parse_widths(spec, self.hidden_size, len(stages) - 1)
        self.bottlenecks = {boundary_name(i): w for i, w in widths.items()}
        init = "identity" if all(w == self.hidden_size for w in widths.values()) else "orthonormal"
        anchor = self.token_embedding if opts.bottleneck_anchor else None
        seed = self.config.train.seed
        tables = ([self.token_embedding] + [copy.deepcopy(self.token_embedding) for _ in stages[1:]]
                  if opts.bottleneck_subspace == "stage" else None)  # the model as built: E as initialised
        shaped = (subspace_pairs(stages, self.subspace, tables) if opts.bottleneck_subspace else
                  insert_bottlenecks(stages, widths, self.hidden_size, init, seed=seed, anchor=anchor))
        pca = opts.bottleneck_init == "pca" or (opts.bottleneck_init == "auto" and opts.model is not None)
        if pca:
            self._fit(shaped)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(describe_pairs(shaped, stages), flush=True)
        return [*shaped]

    def _fit(self, stages: list[nn.Sequential]) -> None:
        """Start the pairs from the principal components of :data:`PCA_BLOCKS` training blocks' boundary states,
        computed on rank 0 and sent to the others (every rank then holds the same pairs)."""
        opts, d = self.config.job, self.config.data
        if not dist.is_initialized() or dist.get_rank() == 0:
            blocks = token_blocks(str(d.data_dir), "train", self.tokenizer, opts.block_length, PCA_BLOCKS)
            ids = torch.stack([blocks[i][0] for i in range(min(PCA_BLOCKS, len(blocks)))])
            modes = [s.training for s in stages]
            for s in stages:
                s.eval()
            kept = fit_bottlenecks(stages, ids)
            for s, mode in zip(stages, modes):
                s.train(mode)
            print("bottlenecks started from principal components, energy kept: "
                  + ", ".join(f"{boundary_name(i)} {k:.1%}" for i, k in kept.items()), flush=True)
        if dist.is_initialized():
            for layer in (m for s in stages for m in s.children()):
                if isinstance(layer, (BottleneckEncoder, BottleneckDecoder)):
                    for p in layer.proj.parameters():
                        dist.broadcast(p.data, 0)

    def raw_scale(self, boundary: str) -> float:
        """The model's width over a bottleneck's channels at ``boundary`` (1 where none)."""
        width = self.bottlenecks.get(boundary)
        return 1.0 if width is None else self.hidden_size / width

    def loaders(self, rank: int, world_size: int) -> tuple[DataLoader, DataLoader]:
        opts, d, seed = self.config.job, self.config.data, self.config.train.seed
        blocks = token_blocks(str(d.data_dir), "train", self.tokenizer, opts.block_length, d.train_subset)
        train: Dataset = _Windows(blocks) if opts.distill else blocks
        held = token_blocks(str(d.data_dir), opts.eval_split, self.tokenizer, opts.block_length, d.eval_subset)
        train_loader = make_dataloader(train, d.batch_size // world_size, shuffle=True, seed=seed,
                                       num_workers=d.num_workers, rank=rank, world_size=world_size,
                                       sample_ids=self.config.delta.delta)
        eval_loader = make_dataloader(held, d.batch_size, shuffle=False, seed=seed, num_workers=d.num_workers)
        return train_loader, eval_loader

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over the trained targets (chat data: the assistant's tokens; targets
        ``-100`` are left out): logits float ``(B, L, V)``, targets int64 ``(B, L)``. With
        ``--activation-checkpointing`` the head defers its logits (:attr:`CausalLMHead.defer_logits`): the output is
        its final-normed states ``(B, L, H)`` and the logits are computed here :data:`LOSS_ROWS` sequences at a time
        and recomputed in the backward pass, so no micro-batch's logits are ever held whole. With ``--distill``
        the target is the window of ``L + 1`` tokens (:class:`_Windows`) and the loss the mean over tokens of
        ``KL(teacher || model)`` between the next-token distributions (Hinton et al., "Distilling the Knowledge in
        a Neural Network", 2015, at temperature 1)."""
        if not self.config.job.distill:
            count = (target != IGNORE).sum().clamp(min=1)
            if not self.head.defer_logits:
                return F.cross_entropy(output.flatten(0, 1).float(), target.flatten(), reduction="sum") / count
            total = sum(checkpoint(self._summed_nll, out, tgt, use_reentrant=False)
                        for out, tgt in zip(output.split(LOSS_ROWS), target.split(LOSS_ROWS)))
            return total / count
        with torch.no_grad():
            teacher = self.teacher(target[:, :-1].to(next(self.teacher.parameters()).device)).logits
        student = F.log_softmax(output.flatten(0, 1).float(), -1)
        return F.kl_div(student, F.log_softmax(teacher.flatten(0, 1).float(), -1).to(student.device),
                        log_target=True, reduction="batchmean")

    def _summed_nll(self, output: torch.Tensor, target: torch.Tensor, per_row: bool = False) -> torch.Tensor:
        """Summed next-token NLL (nats, float32) of the last stage's output ``(b, L, ...)`` -- logits, or the head's
        final-normed states where it defers its logits (computed here, under the run's autocast) -- against targets
        int64 ``(b, L)`` (``-100`` left out): a scalar, or ``(b,)`` with ``per_row``."""
        if self.head.defer_logits:
            dtype = PRECISIONS[self.config.train.precision]
            with torch.autocast(output.device.type, dtype=dtype, enabled=dtype is not None):
                output = self.head.logits(output)
        nll = F.cross_entropy(output.flatten(0, 1).float(), target.flatten(), reduction="none").view(target.shape)
        return nll.sum(1) if per_row else nll.sum()

    def eval_outputs(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per block: float64 ``(B, 2)`` = (summed token NLL in nats, scored tokens) instead of the logits."""
        nll = torch.cat([self._summed_nll(out, tgt, per_row=True) for out, tgt in
                         zip(output.split(LOSS_ROWS), target.split(LOSS_ROWS))])
        return torch.stack([nll.double(), (target != IGNORE).sum(1).double()], 1)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """``val_loss`` (mean token NLL, nats) and ``val_ppl`` over every held-out block."""
        loss = float(outputs[:, 0].double().sum() / outputs[:, 1].double().sum())
        return {"val_loss": loss, "val_ppl": math.exp(loss)}

    def optimizer(self, params: Iterable[nn.Parameter], total_steps: int, steps_per_epoch: int,
                  momentum_in_codec: bool = False):
        from transformers import get_cosine_schedule_with_warmup

        a = self.config.job
        opt = torch.optim.AdamW(decay_groups(params, a.weight_decay), lr=self.config.train.lr, betas=(0.9, 0.95))
        return opt, get_cosine_schedule_with_warmup(opt, round(a.warmup_ratio * total_steps), total_steps)


def _check_flags(config: RunConfig) -> None:
    """The LM job's flags alone (before a corpus, tokenizer or model is read).

    Raises:
        ValueError: the first problem found, with the flag to change.
    """
    opts = config.job
    if (opts.model is None) == (opts.model_config is None):
        raise ValueError("give --model NAME_OR_PATH (pretrained weights) or --model-config PRESET_OR_PATH "
                         f"(random initialisation; presets: {', '.join(LM_PRESETS)}), not both or neither")
    if opts.block_length < 2:
        raise ValueError(f"--block-length {opts.block_length} is too short; use e.g. 128")
    if opts.weight_decay < 0 or not 0 <= opts.warmup_ratio < 1:
        raise ValueError("--weight-decay must be >= 0 and --warmup-ratio in [0, 1)")
    if config.delta.example_dropout:
        raise ValueError("--example-dropout is for the nlp job's encoders")
    if config.pipeline.skip_padding:
        raise ValueError("--skip-padding: the language model's blocks are packed text, without padding")
    if opts.model_config is not None and opts.model_config not in LM_PRESETS and \
            not (opts.model_config.endswith(".json") or "/" in opts.model_config):
        raise ValueError(f"--model-config {opts.model_config}: unknown preset; use one of "
                         f"{', '.join(LM_PRESETS)} or a config.json / model directory")


def _check_fit(opts: LMOptions, config: RunConfig, data_dir: str, tokenizer, model_config,
               pinned: tuple[int, int]) -> None:
    """What the model and tokenizer must fit: the family, the context, the vocabulary, each split's blocks, the
    partition, the adapters and the bottlenecks.

    Raises:
        ValueError: the first problem found, with the flag to change.
    """
    data = config.data
    if model_config.model_type not in FAMILIES:
        raise ValueError(f"the model's family {model_config.model_type!r} is not supported; supported: "
                         f"{', '.join(FAMILIES)}")
    context = getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", None)
    if context is not None and opts.block_length > context:
        raise ValueError(f"--block-length {opts.block_length} is past the model's context of {context} "
                         f"tokens; use --block-length <= {context}")
    if len(tokenizer) > model_config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model only {model_config.vocab_size}; "
                         "use the model's own tokenizer")
    for split, subset, flag in (("train", data.train_subset, "--train-subset"),
                                (opts.eval_split, data.eval_subset, "--eval-subset")):
        try:
            blocks = token_blocks(data_dir, split, tokenizer, opts.block_length, subset)
        except ValueError as e:
            raise ValueError(f"--block-length {opts.block_length}, {split} split: {e}") from None
        if split == "train" and len(blocks) < data.batch_size:
            raise ValueError(f"{flag}: {len(blocks)} training blocks of {opts.block_length} tokens are fewer than "
                             f"one batch (--batch-size {data.batch_size})")
    check_partition(model_config.num_hidden_layers + 2, config.pipeline, pinned)
    check_lora(opts, model_config)
    if opts.distill and opts.bottleneck is None and not opts.lora:
        raise ValueError("--distill trains the bottlenecks and adapters to the model's own outputs: add "
                         "--bottleneck D or --lora R")
    if opts.bottleneck is not None:
        boundaries = len(placement(config.pipeline)) - 1 if config.pipeline.mode == "pipeline" else 0
        parse_widths(opts.bottleneck, model_config.hidden_size, boundaries)
    elif opts.bottleneck_anchor or opts.bottleneck_subspace or opts.bottleneck_init != "auto":
        raise ValueError("--bottleneck-anchor, --bottleneck-subspace and --bottleneck-init shape the bottlenecks of "
                         "--bottleneck D: add it")
    if opts.bottleneck_subspace and (opts.model is not None or ":" in str(opts.bottleneck) or opts.bottleneck_anchor
                                     or opts.bottleneck_init != "auto"):
        raise ValueError("--bottleneck-subspace trains a model from scratch (--model-config) with one width at every "
                         "boundary (--bottleneck D), anchored and started by the subspace itself (no "
                         "--bottleneck-anchor or --bottleneck-init)")
