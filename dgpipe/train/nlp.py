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

from dataclasses import dataclass, replace
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader

from dgpipe.data import glue_task, load_glue, make_glue_loader, offline_tokenizer
from dgpipe.data.loading import make_dataloader
from dgpipe.models import ATTENTION_MASK, build_encoder, encoder_layers, resolve_model, small_encoder_config
from dgpipe.models.example_dropout import use_example_dropout

from .config import RunConfig
from .job import Job, check_partition, decay_groups, metric_key
from .metrics import TASK_METRICS, compute_metrics

__all__ = ["GlueJob", "GlueOptions", "TINY_CONFIGS", "OFFLINE_VOCAB"]

#: ``--model-config`` presets: small random encoders sized for smoke runs.
TINY_CONFIGS = {"tiny-roberta": "roberta", "tiny-bert": "bert"}
#: Vocabulary bound of the offline tokenizer.
OFFLINE_VOCAB = 8000


def _tokenizer(opts: GlueOptions, data_dir: str | None):
    """``--tokenizer``: the offline WordPiece vocabulary of the task's training texts, or
    ``AutoTokenizer.from_pretrained``. BERT-family configs get ``token_type_ids``."""
    from transformers import AutoConfig, AutoTokenizer

    if opts.tokenizer != "offline":
        return AutoTokenizer.from_pretrained(opts.tokenizer)
    if opts.model_config in TINY_CONFIGS:
        family = TINY_CONFIGS[opts.model_config]
    else:
        family = AutoConfig.from_pretrained(opts.model_config).model_type
    examples = load_glue(opts.task, data_dir, "train")
    texts = [a for a, _, _ in examples] + [b for _, b, _ in examples if b]
    return offline_tokenizer(texts, OFFLINE_VOCAB, token_type_ids=family == "bert")


def _config(opts: GlueOptions, tokenizer):
    """The model config of ``--model-config`` (None: use ``--model``'s pretrained weights)."""
    from transformers import AutoConfig

    num_labels = glue_task(opts.task).num_labels
    if opts.model_config is None:
        return None
    if opts.model_config in TINY_CONFIGS:
        return small_encoder_config(TINY_CONFIGS[opts.model_config], len(tokenizer), tokenizer.pad_token_id,
                                    opts.max_length, num_labels)
    config = AutoConfig.from_pretrained(opts.model_config)
    config.num_labels = num_labels
    if opts.tokenizer == "offline":
        config.vocab_size, config.pad_token_id = len(tokenizer), tokenizer.pad_token_id
    return config


@dataclass(frozen=True)
class GlueOptions:
    """The GLUE job's own flags (``RunConfig.job``); see ``test_nlp_dgpipe.py --help``.

    Attributes:
        task: GLUE task name.
        model: checkpoint (hub name or local directory).
        model_config: random initialisation from this preset or config path, or ``None``.
        tokenizer: ``"offline"`` or a tokenizer name/directory (``None`` until :meth:`GlueJob.check`).
        max_length: most tokens per example.
        padding: ``"longest"`` or ``"max_length"`` (``None`` until :meth:`GlueJob.check`).
        heldout: training examples held out and evaluated as ``heldout_*``.
        weight_decay: AdamW weight decay.
        warmup_ratio: fraction of steps of linear warm-up.
    """

    task: str
    model: str
    model_config: str | None
    tokenizer: str | None
    max_length: int
    padding: str | None
    heldout: int
    weight_decay: float
    warmup_ratio: float


class GlueJob(Job):
    """An encoder on one GLUE task; see :class:`~dgpipe.train.job.Job` for the interface.

    Attributes:
        vocab: the model's vocabulary size (token ids are in ``[0, vocab)``), set by :meth:`build_layers`.
    """

    options = GlueOptions
    pinned = (1, 1)
    row_mask = ATTENTION_MASK

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.task = glue_task(config.job.task)
        names = tuple(metric_key(m) for m in TASK_METRICS[self.task.name])
        self.metric_names = names + tuple(n.replace("val_", "heldout_", 1) for n in names if config.job.heldout)
        self._dev_size: int | None = None
        self.metric = self.metric_names[0]
        self.tokenizer = _tokenizer(config.job, config.data.data_dir)

    @classmethod
    def check(cls, config: RunConfig) -> GlueOptions:
        """Check lengths, data, tokenizer and model (loading them once), and the partition.

        Returns ``config.job`` with ``padding`` and ``tokenizer`` set when they were left to
        their defaults, and ``model`` a local directory when an installed package carries its
        weights (:func:`dgpipe.models.resolve_model`).

        Raises:
            ValueError: bad ``--max-length``/``--weight-decay``/``--warmup-ratio``, missing
                GLUE files (names the paths tried), a model or tokenizer that cannot be
                loaded, or a partition that does not fit the model.
        """
        from transformers import AutoConfig

        opts, data, seed, delta = config.job, config.data, config.train.seed, config.delta.delta
        if opts.max_length < 8:
            raise ValueError(f"--max-length {opts.max_length} is too short; use e.g. 128")
        if opts.weight_decay < 0 or not 0 <= opts.warmup_ratio < 1:
            raise ValueError("--weight-decay must be >= 0 and --warmup-ratio in [0, 1)")
        try:
            heldout = opts.heldout
            if heldout < 0:
                raise ValueError(f"--heldout must be >= 0, got {heldout}")
            for flag, split, subset in (("--train-subset", "train", data.train_subset),
                                        ("--eval-subset", "dev", data.eval_subset),
                                        ("--heldout", "heldout", None)):
                if split != "heldout" or heldout:
                    load_glue(opts.task, data.data_dir, split, subset, seed, heldout if split != "dev" else 0)
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
        fixed = delta or config.pipeline.engine == "torch"
        if fixed and opts.padding not in (None, "max_length"):
            raise ValueError(f"{'--delta caches every example' if delta else '--engine torch keeps every'} "
                             "activation at one shape: use --padding max_length")
        model = resolve_model(opts.model)
        opts = replace(opts, model=model, padding=opts.padding or ("max_length" if fixed else "longest"),
                       tokenizer=opts.tokenizer or ("offline" if opts.model_config is not None else model))
        if opts.model_config is None and opts.tokenizer == "offline":
            raise ValueError("--tokenizer offline has a vocabulary of its own: it needs a randomly initialised "
                             "model (--model-config tiny-roberta), not pretrained weights")
        try:
            model_config = _config(opts, _tokenizer(opts, data.data_dir)) or AutoConfig.from_pretrained(opts.model)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load the model or tokenizer ({e}); pass --model/--tokenizer as a hub name "
                             "(online) or a local directory, or --model-config tiny-roberta for a random "
                             "model") from None
        positions = getattr(model_config, "max_position_embeddings", None)
        need = opts.max_length + (model_config.pad_token_id + 1 if model_config.model_type == "roberta" else 0)
        if positions is not None and need > positions:
            raise ValueError(f"--max-length {opts.max_length} needs {need} position embeddings but the model has "
                             f"{positions}; use --max-length <= {opts.max_length - need + positions}")
        check_partition(model_config.num_hidden_layers + 2, config.pipeline, cls.pinned)
        return opts

    def build_layers(self) -> list[nn.Module]:
        from transformers.utils import logging as hf_logging

        if dist.is_initialized() and dist.get_rank() != 0:
            hf_logging.set_verbosity_error()  # the checkpoint's load report and progress once, from rank 0
            hf_logging.disable_progress_bar()
        config = _config(self.config.job, self.tokenizer)
        model = build_encoder(config if config is not None else self.config.job.model, self.task.num_labels)
        if self.config.delta.example_dropout:
            use_example_dropout(model, self.config.train.seed)
        self.vocab = model.config.vocab_size
        return encoder_layers(model, carry_ids=self.config.pipeline.token_reference)

    def loaders(self, rank: int, world_size: int) -> tuple[DataLoader, DataLoader]:
        a, d, seed = self.config.job, self.config.data, self.config.train.seed
        common = dict(max_length=a.max_length, seed=seed, num_workers=0, pad_to_longest=a.padding == "longest")
        train = make_glue_loader(a.task, self.tokenizer, d.data_dir, "train", d.batch_size // world_size,
                                 subset=d.train_subset, rank=rank, world_size=world_size, heldout=a.heldout,
                                 sample_ids=self.config.delta.delta or self.config.delta.example_dropout, **common)
        evaluation = make_glue_loader(a.task, self.tokenizer, d.data_dir, "dev", d.batch_size,
                                      subset=d.eval_subset, **common)
        if a.heldout:  # one evaluation pass: the dev examples, then the held-out ones (metrics split them)
            self._dev_size = len(evaluation.dataset)
            heldout = make_glue_loader(a.task, self.tokenizer, d.data_dir, "heldout", d.batch_size, heldout=a.heldout,
                                       **common)
            evaluation = make_dataloader(ConcatDataset([evaluation.dataset, heldout.dataset]), d.batch_size,
                                         shuffle=False, seed=seed, collate_fn=evaluation.collate_fn)
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

        a = self.config.job
        opt = torch.optim.AdamW(decay_groups(params, a.weight_decay), lr=self.config.train.lr)
        return opt, get_linear_schedule_with_warmup(opt, round(a.warmup_ratio * total_steps), total_steps)
