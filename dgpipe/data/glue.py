"""GLUE tasks: examples from local TSVs (original GLUE layout) or ``datasets``, tokenised.

Local layout, as written by GLUE's ``download_glue_data.py`` (e.g. ``shared/data/glue``)::

    data_dir/CoLA/{train,dev}.tsv    no header; source, label, original mark, sentence
    data_dir/SST-2/{train,dev}.tsv   header "sentence label"
    data_dir/MRPC/{train,dev}.tsv    UTF-8 BOM, header "Quality #1 ID #2 ID #1 String #2 String"
    data_dir/QQP/{train,dev}.tsv     header "id qid1 qid2 question1 question2 is_duplicate"
    data_dir/STS-B/{train,dev}.tsv   header "... sentence1 sentence2 score" (float 0..5)
    data_dir/MNLI/train.tsv, dev_matched.tsv, dev_mismatched.tsv   "... sentence1 sentence2 ... gold_label"
    data_dir/QNLI/{train,dev}.tsv    header "index question sentence label"
    data_dir/RTE/{train,dev}.tsv     header "index sentence1 sentence2 label"
    data_dir/WNLI/{train,dev}.tsv    header "index sentence1 sentence2 label" (0/1)

Fields are tab-separated and never quoted (GLUE text contains bare ``"``), so the files
are read with ``csv.QUOTE_NONE``. Label ids follow the Hugging Face ``glue`` dataset, so
local files and ``datasets.load_dataset("nyu-mll/glue", task)`` give the same ids.
Reference: Wang et al., "GLUE: A Multi-Task Benchmark and Analysis Platform for Natural
Language Understanding", ICLR 2019.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from .loading import make_dataloader
from .subset import choose_subset

Example = tuple[str, "str | None", "int | float"]


@dataclasses.dataclass(frozen=True)
class GlueTask:
    """How one GLUE task is stored and labelled.

    ``text_a``/``text_b``/``label`` are header column names (column indices for CoLA, which
    has no header); ``tsv_labels[i]`` is how label id ``i`` is written in the TSV
    (``None``: regression, float scores); ``hf_columns`` are the ``datasets`` text columns.
    """

    name: str
    folder: str
    text_a: str | int
    text_b: str | int | None
    label: str | int
    tsv_labels: tuple[str, ...] | None
    hf_columns: tuple[str, str | None]
    columns: int | None = None  # field count of a header-less file
    dev_files: tuple[tuple[str, str], ...] = (("dev", "dev.tsv"),)

    @property
    def is_regression(self) -> bool:
        """True for a regression task (STS-B: a float score in [0, 5], no class labels)."""
        return self.tsv_labels is None

    @property
    def num_labels(self) -> int:
        """Outputs of the classifier: 1 for STS-B (regression), else the number of classes."""
        return 1 if self.tsv_labels is None else len(self.tsv_labels)


_BINARY = ("0", "1")
_NLI = ("entailment", "not_entailment")
GLUE_TASKS = {
    t.name: t
    for t in [
        GlueTask("cola", "CoLA", 3, None, 1, _BINARY, ("sentence", None), columns=4),
        GlueTask("sst2", "SST-2", "sentence", None, "label", _BINARY, ("sentence", None)),
        GlueTask("mrpc", "MRPC", "#1 String", "#2 String", "Quality", _BINARY, ("sentence1", "sentence2")),
        GlueTask("qqp", "QQP", "question1", "question2", "is_duplicate", _BINARY, ("question1", "question2")),
        GlueTask("stsb", "STS-B", "sentence1", "sentence2", "score", None, ("sentence1", "sentence2")),
        GlueTask(
            "mnli", "MNLI", "sentence1", "sentence2", "gold_label", ("entailment", "neutral", "contradiction"),
            ("premise", "hypothesis"),
            dev_files=(("dev", "dev_matched.tsv"), ("dev_mismatched", "dev_mismatched.tsv")),
        ),
        GlueTask("qnli", "QNLI", "question", "sentence", "label", _NLI, ("question", "sentence")),
        GlueTask("rte", "RTE", "sentence1", "sentence2", "label", _NLI, ("sentence1", "sentence2")),
        GlueTask("wnli", "WNLI", "sentence1", "sentence2", "label", _BINARY, ("sentence1", "sentence2")),
    ]
}

# Split names accepted (GLUE file names and Hugging Face split names) -> canonical split.
_SPLITS = {
    "train": "train",
    "dev": "dev",
    "validation": "dev",
    "dev_matched": "dev",
    "validation_matched": "dev",
    "dev_mismatched": "dev_mismatched",
    "validation_mismatched": "dev_mismatched",
}


#: Seed of the held-out slice of a training file: fixed, so every run (any --seed) holds out the same examples.
HELDOUT_SEED = 0x4E1D


def glue_task(task: str) -> GlueTask:
    """The :class:`GlueTask` of ``task`` (case and ``-`` ignored: "SST-2" = "sst2").

    Raises:
        ValueError: unknown task (lists the known ones).
    """
    key = task.lower().replace("-", "")
    if key not in GLUE_TASKS:
        raise ValueError(f"unknown GLUE task {task!r}; use one of {', '.join(GLUE_TASKS)}")
    return GLUE_TASKS[key]


def _split_file(spec: GlueTask, split: str) -> tuple[str, str]:
    """(canonical split, TSV file name)."""
    canonical = _SPLITS.get(split)
    files = dict((("train", "train.tsv"),) + spec.dev_files)
    if canonical not in files:
        raise ValueError(f"GLUE {spec.name} has no labelled split {split!r}; use one of {sorted(files)}")
    return canonical, files[canonical]


def _parse_label(spec: GlueTask, value: str, where: str) -> int | float:
    try:
        return float(value) if spec.tsv_labels is None else spec.tsv_labels.index(value)
    except ValueError:
        expected = "a float score" if spec.tsv_labels is None else f"one of {spec.tsv_labels}"
        raise ValueError(f"{where}: label {value!r} is not {expected}") from None


def read_glue_tsv(task: str, path: str | os.PathLike) -> list[Example]:
    """Read one GLUE TSV file.

    Returns:
        list of ``(text_a, text_b or None, label)``; label is an ``int`` class id (see
        :data:`GLUE_TASKS` for the order) or, for STS-B, a ``float`` score.

    Raises:
        FileNotFoundError: no such file. ValueError: a row with the wrong number of fields,
        a missing column or an unknown label (names file and line).
    """
    spec = glue_task(task)
    path = Path(path)
    # utf-8-sig drops MRPC's byte-order mark; newline="" lets csv see the raw line ends.
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        if spec.columns is None:
            header = next(rows, None) or []
            try:
                a, label = header.index(spec.text_a), header.index(spec.label)
                b = None if spec.text_b is None else header.index(spec.text_b)
            except ValueError:
                raise ValueError(
                    f"{path}: header {header} lacks a column of {spec.text_a!r}, {spec.text_b!r}, {spec.label!r}; "
                    f"is this the GLUE {spec.folder} file?"
                ) from None
            width, first_line = len(header), 2
        else:
            a, b, label, width, first_line = spec.text_a, spec.text_b, spec.label, spec.columns, 1
        examples = []
        for line, row in enumerate(rows, start=first_line):
            if not row:
                continue
            where = f"{path}:{line}"
            if len(row) != width:
                raise ValueError(f"{where}: expected {width} tab-separated fields, got {len(row)}")
            examples.append((row[a], None if b is None else row[b], _parse_label(spec, row[label], where)))
    return examples


def _from_datasets(spec: GlueTask, split: str) -> list[Example]:
    import datasets

    hf_split = {"train": "train", "dev": "validation", "dev_mismatched": "validation_mismatched"}[split]
    if spec.name == "mnli" and split == "dev":
        hf_split = "validation_matched"
    data = datasets.load_dataset("nyu-mll/glue", spec.name, split=hf_split)
    col_a, col_b = spec.hf_columns
    texts_b = data[col_b] if col_b else [None] * len(data)
    cast = float if spec.is_regression else int
    return [(a, b, cast(y)) for a, b, y in zip(data[col_a], texts_b, data["label"])]


def load_glue(
    task: str,
    data_dir: str | os.PathLike | None,
    split: str,
    subset: int | None = None,
    seed: int = 0,
    heldout: int = 0,
) -> list[Example]:
    """Examples of one GLUE split.

    Args:
        task: cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte or wnli.
        data_dir: a GLUE folder in the original layout (``data_dir/RTE/train.tsv``; the task
            folder itself also works); ``None``: ``datasets.load_dataset("nyu-mll/glue", task)``
            (the Hub's ``glue`` dataset; needs internet or a filled ``datasets`` cache).
        split: ``"train"``, ``"dev"`` (= ``"validation"``; MNLI: matched) or, for MNLI,
            ``"dev_mismatched"``.
        subset: keep this many examples, fixed by ``seed`` (class-stratified, except STS-B).
        seed: seed of the subset choice.
        heldout: with ``split="train"``: hold out this many training examples -- a fixed,
            class-stratified choice (:data:`HELDOUT_SEED`, the same for every ``seed``) --
            and return the rest (``subset`` is then drawn from the rest); with
            ``split="heldout"``: return exactly those held-out examples (``subset`` and
            ``seed`` do not apply). An evaluation set far larger than a dev set, that
            training never sees.

    Returns:
        list of ``(text_a, text_b or None, label)`` in file order; label ``int`` (class id)
        or ``float`` (STS-B score).

    Raises:
        ValueError: unknown task/split, malformed file, bad subset.
        FileNotFoundError: the file is not there / ``datasets`` cannot load the task; the
        message names the paths tried and how to get the data.
    """
    spec = glue_task(task)
    part = "heldout" if split == "heldout" else None
    if part and heldout < 1:
        raise ValueError("split 'heldout' needs heldout >= 1 (how many training examples are held out)")
    if heldout < 0:
        raise ValueError(f"heldout must be >= 0, got {heldout}")
    canonical, file = _split_file(spec, "train" if part else split)
    if heldout and canonical != "train":
        raise ValueError(f"heldout applies to the training file, not to split {split!r}")
    if data_dir is not None:
        tried = [Path(data_dir) / spec.folder / file, Path(data_dir) / file]
        path = next((p for p in tried if p.is_file()), None)
        if path is None:
            raise FileNotFoundError(
                f"GLUE {spec.folder} {canonical} file not found; tried {', '.join(map(str, tried))}. "
                f"Point --data-dir at a GLUE folder holding {spec.folder}/{file} (as written by GLUE's "
                "download_glue_data.py, e.g. ../shared/data/glue), or omit it to use the datasets library online."
            )
        examples = read_glue_tsv(spec.name, path)
    else:
        try:
            examples = _from_datasets(spec, canonical)
        except Exception as err:  # datasets raises many types when offline (ConnectionError, OSError, ...)
            raise FileNotFoundError(
                f"no --data-dir given and datasets.load_dataset('nyu-mll/glue', {spec.name!r}) failed: {err!r}. "
                f"Pass --data-dir pointing at a GLUE folder with {spec.folder}/{file} "
                "(e.g. ../shared/data/glue), or run where the Hugging Face Hub is reachable."
            ) from err
    if heldout:
        try:
            labels = [y for _, _, y in examples]
            held = set(choose_subset(labels, heldout, HELDOUT_SEED, not spec.is_regression).tolist())
        except ValueError as e:
            raise ValueError(f"heldout: {e}") from None
        if part:
            return [ex for i, ex in enumerate(examples) if i in held]
        examples = [ex for i, ex in enumerate(examples) if i not in held]
    keep = choose_subset([y for _, _, y in examples], subset, seed, stratify=not spec.is_regression)
    return [examples[i] for i in keep] if subset is not None else examples


def tokenize_glue(examples: list[Example], tokenizer, max_length: int = 128) -> dict[str, torch.Tensor]:
    """Tokenise examples with the model's tokenizer, padded and truncated to ``max_length``.

    Args:
        examples: from :func:`load_glue`.
        tokenizer: a Hugging Face tokenizer (``AutoTokenizer.from_pretrained(model)`` or
            :func:`~dgpipe.data.tokenizer.offline_tokenizer`); pairs are truncated
            longest-first.
        max_length: tokens per example, special tokens included.

    Returns:
        ``input_ids`` int64 ``(N, L)``, ``attention_mask`` int64 ``(N, L)`` (1 = token,
        0 = padding), ``token_type_ids`` int64 ``(N, L)`` when the tokenizer produces them
        (BERT family), and ``labels``: int64 ``(N,)``, or float32 ``(N,)`` for float scores.

    Raises:
        ValueError: no examples, ``max_length < 2``.
    """
    if not examples:
        raise ValueError("no examples to tokenise")
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    texts_a = [a for a, _, _ in examples]
    texts_b = [b for _, b, _ in examples]
    pair = texts_b[0] is not None
    enc = tokenizer(
        texts_a,
        texts_b if pair else None,
        padding="max_length",
        truncation=True,
        max_length=max_length,
        return_tensors="pt",
    )
    out = {k: enc[k].long() for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc}
    labels = [y for _, _, y in examples]
    regression = isinstance(labels[0], float)
    out["labels"] = torch.tensor(labels, dtype=torch.float32 if regression else torch.int64)
    return out


def trim_padding(items: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]
                 ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Collate items of a :class:`TokenizedDataset` and cut the padding columns that every
    example of the batch has (what ``DataCollatorWithPadding(padding="longest")`` gives,
    on examples tokenised once at the longest length).

    Returns:
        ``(inputs, labels)``: each input int64 ``(B, L)`` with ``L`` the batch's longest
        example (its attention mask's largest row sum, at least 1), labels as collated.
    """
    inputs, labels = default_collate(items)
    length = max(int(inputs[1].sum(dim=1).max()), 1)
    return tuple(t[:, :length] for t in inputs), labels


class TokenizedDataset(Dataset):
    """Tokenised examples; item ``i`` is ``((input_ids, attention_mask[, token_type_ids]), label)``.

    The inputs tuple (each int64 ``(L,)``) is what the first layer of
    :func:`~dgpipe.models.encoder.encoder_layers` takes, so a batch ``(inputs, labels)``
    feeds a pipeline's first stage directly.
    """

    def __init__(self, encoded: dict[str, torch.Tensor]) -> None:
        keys = ("input_ids", "attention_mask", "token_type_ids")
        self.inputs = tuple(encoded[k] for k in keys if k in encoded)
        self.labels = encoded["labels"]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        return tuple(t[index] for t in self.inputs), self.labels[index]


def make_glue_loader(
    task: str,
    tokenizer,
    data_dir: str | os.PathLike | None,
    split: str,
    batch_size: int,
    *,
    max_length: int = 128,
    subset: int | None = None,
    seed: int = 0,
    num_workers: int = 0,
    drop_last: bool | None = None,
    rank: int = 0,
    world_size: int = 1,
    heldout: int = 0,
    sample_ids: bool = False,
    pad_to_longest: bool = False,
) -> DataLoader:
    """A DataLoader over one GLUE split yielding ``((input_ids, attention_mask[, token_type_ids]), labels)``.

    Shapes: each input int64 ``(B, L)`` with ``L = max_length``, or with ``pad_to_longest`` the
    batch's longest example (:func:`trim_padding`); labels int64 ``(B,)`` (float32 for STS-B).
    Data comes from :func:`load_glue` (``data_dir``, ``split``, ``subset``, ``seed``, ``heldout``), is
    tokenised once by :func:`tokenize_glue`; ``train`` is shuffled (seeded) and drops the
    last incomplete batch unless ``drop_last`` says otherwise. ``rank``/``world_size``,
    ``sample_ids`` (also yield the examples' indices): see :func:`~dgpipe.data.loading.make_dataloader`.

    Raises:
        as :func:`load_glue` and :func:`tokenize_glue`.
    """
    examples = load_glue(task, data_dir, split, subset, seed, heldout)
    dataset = TokenizedDataset(tokenize_glue(examples, tokenizer, max_length))
    train = split == "train"
    return make_dataloader(dataset, batch_size, shuffle=train, seed=seed, drop_last=drop_last, num_workers=num_workers,
                           collate_fn=trim_padding if pad_to_longest else None, rank=rank, world_size=world_size,
                           sample_ids=sample_ids)
