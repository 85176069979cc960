"""The NLP main job: a BERT/RoBERTa-family encoder fine-tuned on a GLUE task.

Data from :mod:`dgpipe.data.glue` (local GLUE TSVs or ``datasets``), model from
:mod:`dgpipe.models.encoder` (``from_pretrained`` a hub name or local directory, or a
random initialisation from a config: ``--model-config tiny-roberta|tiny-bert|PATH``),
AdamW with a linear warm-up and linear decay
(``transformers.get_linear_schedule_with_warmup``). Flags: see ``test_nlp_dgpipe.py``.

Tokenizer: the model's own (``AutoTokenizer``), or ``--tokenizer offline`` -- a small
WordPiece vocabulary built from the task's training texts (:func:`dgpipe.data.offline_tokenizer`,
deterministic, so every rank builds the same one), for randomly initialised models on
machines without a model hub.
"""

from __future__ import annotations

import argparse
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader

from dgpipe.data import glue_task, load_glue, make_glue_loader, offline_tokenizer
from dgpipe.data.loading import make_dataloader
from dgpipe.models import build_encoder, encoder_layers, resolve_model, small_encoder_config

from .job import Job, check_partition, decay_groups, metric_key
from .metrics import TASK_METRICS, compute_metrics

__all__ = ["GlueJob", "TINY_CONFIGS", "OFFLINE_VOCAB"]

#: ``--model-config`` presets: small random encoders sized for smoke runs.
TINY_CONFIGS = {"tiny-roberta": "roberta", "tiny-bert": "bert"}
#: Vocabulary bound of the offline tokenizer.
OFFLINE_VOCAB = 8000


def _tokenizer(args: argparse.Namespace):
    """``--tokenizer``: the offline WordPiece vocabulary of the task's training texts, or
    ``AutoTokenizer.from_pretrained``. BERT-family configs get ``token_type_ids``."""
    from transformers import AutoConfig, AutoTokenizer

    if args.tokenizer != "offline":
        return AutoTokenizer.from_pretrained(args.tokenizer)
    if args.model_config in TINY_CONFIGS:
        family = TINY_CONFIGS[args.model_config]
    else:
        family = AutoConfig.from_pretrained(args.model_config).model_type
    examples = load_glue(args.task, args.data_dir, "train")
    texts = [a for a, _, _ in examples] + [b for _, b, _ in examples if b]
    return offline_tokenizer(texts, OFFLINE_VOCAB, token_type_ids=family == "bert")


def _config(args: argparse.Namespace, tokenizer):
    """The model config of ``--model-config`` (None: use ``--model``'s pretrained weights)."""
    from transformers import AutoConfig

    num_labels = glue_task(args.task).num_labels
    if args.model_config is None:
        return None
    if args.model_config in TINY_CONFIGS:
        return small_encoder_config(TINY_CONFIGS[args.model_config], len(tokenizer), tokenizer.pad_token_id,
                                    args.max_length, num_labels)
    config = AutoConfig.from_pretrained(args.model_config)
    config.num_labels = num_labels
    if args.tokenizer == "offline":
        config.vocab_size, config.pad_token_id = len(tokenizer), tokenizer.pad_token_id
    return config


class GlueJob(Job):
    """An encoder on one GLUE task; see :class:`~dgpipe.train.job.Job` for the interface."""

    pinned = (1, 1)

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.task = glue_task(args.task)
        names = tuple(metric_key(m) for m in TASK_METRICS[self.task.name])
        self.metric_names = names + tuple(n.replace("val_", "heldout_", 1) for n in names if args.heldout)
        self._dev_size: int | None = None
        self.metric = self.metric_names[0]
        self.tokenizer = _tokenizer(args)

    @classmethod
    def check(cls, args: argparse.Namespace) -> None:
        """Check lengths, data, tokenizer and model (loading them once), and the partition.

        Sets ``args.padding`` and ``args.tokenizer`` when they were left to their defaults, and
        ``args.model`` to a local directory when an installed package carries its weights
        (:func:`dgpipe.models.resolve_model`).

        Raises:
            ValueError: bad ``--max-length``/``--weight-decay``/``--warmup-ratio``, missing
                GLUE files (names the paths tried), a model or tokenizer that cannot be
                loaded, or a partition that does not fit the model.
        """
        from transformers import AutoConfig

        if args.max_length < 8:
            raise ValueError(f"--max-length {args.max_length} is too short; use e.g. 128")
        if args.weight_decay < 0 or not 0 <= args.warmup_ratio < 1:
            raise ValueError("--weight-decay must be >= 0 and --warmup-ratio in [0, 1)")
        try:
            heldout = args.heldout
            if heldout < 0:
                raise ValueError(f"--heldout must be >= 0, got {heldout}")
            for flag, split, subset in (("--train-subset", "train", args.train_subset),
                                        ("--eval-subset", "dev", args.eval_subset),
                                        ("--heldout", "heldout", None)):
                if split != "heldout" or heldout:
                    load_glue(args.task, args.data_dir, split, subset, args.seed, heldout if split != "dev" else 0)
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
        if args.padding is None:
            args.padding = "max_length" if args.delta else "longest"
        elif args.delta and args.padding != "max_length":
            raise ValueError("--delta caches every example's activation at one shape: use --padding max_length")
        args.model = resolve_model(args.model)
        if args.tokenizer is None:
            args.tokenizer = "offline" if args.model_config is not None else args.model
        if args.model_config is None and args.tokenizer == "offline":
            raise ValueError("--tokenizer offline has a vocabulary of its own: it needs a randomly initialised "
                             "model (--model-config tiny-roberta), not pretrained weights")
        try:
            config = _config(args, _tokenizer(args)) or AutoConfig.from_pretrained(args.model)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load the model or tokenizer ({e}); pass --model/--tokenizer as a hub name "
                             "(online) or a local directory, or --model-config tiny-roberta for a random model") from None
        positions = getattr(config, "max_position_embeddings", None)
        need = args.max_length + (config.pad_token_id + 1 if config.model_type == "roberta" else 0)
        if positions is not None and need > positions:
            raise ValueError(f"--max-length {args.max_length} needs {need} position embeddings but the model has "
                             f"{positions}; use --max-length <= {args.max_length - need + positions}")
        check_partition(config.num_hidden_layers + 2, args, cls.pinned)

    def build_layers(self) -> list[nn.Module]:
        from transformers.utils import logging as hf_logging

        if dist.is_initialized() and dist.get_rank() != 0:
            hf_logging.set_verbosity_error()  # the checkpoint's load report and progress once, from rank 0
            hf_logging.disable_progress_bar()
        config = _config(self.args, self.tokenizer)
        num_labels = self.task.num_labels
        model = build_encoder(config if config is not None else self.args.model, num_labels)
        return encoder_layers(model)

    def loaders(self, rank: int, world_size: int) -> tuple[DataLoader, DataLoader]:
        a = self.args
        common = dict(max_length=a.max_length, seed=a.seed, num_workers=0, pad_to_longest=a.padding == "longest")
        train = make_glue_loader(a.task, self.tokenizer, a.data_dir, "train", a.batch_size // world_size,
                                 subset=a.train_subset, rank=rank, world_size=world_size, heldout=a.heldout,
                                 sample_ids=a.delta, **common)
        evaluation = make_glue_loader(a.task, self.tokenizer, a.data_dir, "dev", a.batch_size,
                                      subset=a.eval_subset, **common)
        if a.heldout:  # one evaluation pass: the dev examples, then the held-out ones (metrics split them)
            self._dev_size = len(evaluation.dataset)
            heldout = make_glue_loader(a.task, self.tokenizer, a.data_dir, "heldout", a.batch_size, heldout=a.heldout,
                                       **common)
            evaluation = make_dataloader(ConcatDataset([evaluation.dataset, heldout.dataset]), a.batch_size,
                                         shuffle=False, seed=a.seed, collate_fn=evaluation.collate_fn)
        return train, evaluation

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.task.is_regression:
            return F.mse_loss(output.squeeze(-1), target)
        return F.cross_entropy(output, target)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """Dev metrics (``val_*``) and, with ``--heldout``, those of the held-out examples (``heldout_*``),
        which follow the dev examples in the evaluation order."""
        n = self._dev_size if self._dev_size is not None else len(targets)
        values = {metric_key(k): v for k, v in compute_metrics(self.task.name, outputs[:n], targets[:n]).items()}
        if self._dev_size is not None:
            held = compute_metrics(self.task.name, outputs[n:], targets[n:])
            values |= {metric_key(k).replace("val_", "heldout_", 1): v for k, v in held.items()}
        return values

    def optimizer(self, params: Iterable[nn.Parameter], total_steps: int, steps_per_epoch: int,
                  momentum_in_codec: bool = False):
        from transformers import get_linear_schedule_with_warmup

        a = self.args
        opt = torch.optim.AdamW(decay_groups(params, a.weight_decay), lr=a.lr)
        return opt, get_linear_schedule_with_warmup(opt, round(a.warmup_ratio * total_steps), total_steps)
