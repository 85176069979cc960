"""Evaluation metrics of the vision and GLUE jobs, computed with scikit-learn and scipy.

Per task (as in the GLUE paper, Wang et al., ICLR 2019): accuracy for most tasks;
Matthews correlation for CoLA; F1 and accuracy for MRPC and QQP; Pearson and Spearman
correlation for STS-B. :func:`task_metric` names the one summary metric a run reports
(the first of those).
"""

from __future__ import annotations

import numpy as np

# task -> metric names; the first is the summary metric.
TASK_METRICS = {
    "cola": ("matthews_correlation", "accuracy"),
    "sst2": ("accuracy",),
    "mrpc": ("f1", "accuracy"),
    "qqp": ("f1", "accuracy"),
    "stsb": ("pearson", "spearmanr"),
    "mnli": ("accuracy",),
    "qnli": ("accuracy",),
    "rte": ("accuracy",),
    "wnli": ("accuracy",),
    "cifar10": ("accuracy",),
    "cifar100": ("accuracy",),
}


def _task(task: str) -> str:
    key = task.lower().replace("-", "")
    if key not in TASK_METRICS:
        raise ValueError(f"unknown task {task!r}; use one of {', '.join(TASK_METRICS)}")
    return key


def _numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy() if x.is_floating_point() else x.detach().cpu().numpy()
    return np.asarray(x)


def accuracy(predictions, labels) -> float:
    """Fraction of ``predictions`` (class ids, ``(N,)``) equal to ``labels`` (``(N,)``)."""
    from sklearn.metrics import accuracy_score

    return float(accuracy_score(_numpy(labels), _numpy(predictions)))


def matthews_correlation(predictions, labels) -> float:
    """Matthews correlation coefficient of binary/multiclass ids, in [-1, 1] (0 when a side is constant)."""
    from sklearn.metrics import matthews_corrcoef

    return float(matthews_corrcoef(_numpy(labels), _numpy(predictions)))


def f1(predictions, labels) -> float:
    """F1 score of the positive class (label 1) of binary ids."""
    from sklearn.metrics import f1_score

    return float(f1_score(_numpy(labels), _numpy(predictions), zero_division=0.0))


def pearson(predictions, labels) -> float:
    """Pearson correlation of float scores (NaN when either side is constant)."""
    from scipy.stats import pearsonr

    p, y = _numpy(predictions).astype(np.float64), _numpy(labels).astype(np.float64)
    return float("nan") if np.ptp(p) == 0 or np.ptp(y) == 0 else float(pearsonr(p, y)[0])


def spearman(predictions, labels) -> float:
    """Spearman rank correlation of float scores (NaN when either side is constant)."""
    from scipy.stats import spearmanr

    p, y = _numpy(predictions).astype(np.float64), _numpy(labels).astype(np.float64)
    return float("nan") if np.ptp(p) == 0 or np.ptp(y) == 0 else float(spearmanr(p, y)[0])


_FUNCTIONS = {
    "accuracy": accuracy,
    "matthews_correlation": matthews_correlation,
    "f1": f1,
    "pearson": pearson,
    "spearmanr": spearman,
}


def task_metric(task: str) -> str:
    """Name of the summary metric of ``task`` (a GLUE task, ``cifar10`` or ``cifar100``):
    ``"matthews_correlation"`` (CoLA), ``"f1"`` (MRPC, QQP), ``"pearson"`` (STS-B), else
    ``"accuracy"``. ValueError for an unknown task."""
    return TASK_METRICS[_task(task)][0]


def compute_metrics(task: str, outputs, labels) -> dict[str, float]:
    """All metrics of ``task``.

    Args:
        task: GLUE task name, ``cifar10`` or ``cifar100``.
        outputs: model outputs: logits ``(N, C)`` (argmax taken), class ids ``(N,)``, or for
            STS-B scores ``(N,)`` / ``(N, 1)``. Torch tensors or arrays.
        labels: ``(N,)`` class ids, or float scores for STS-B.

    Returns:
        ``{metric name: value}`` in the order of :data:`TASK_METRICS` (summary first).

    Raises:
        ValueError: unknown task, or outputs and labels of different length.
    """
    key = _task(task)
    out, y = _numpy(outputs), _numpy(labels).reshape(-1)
    if key == "stsb":
        out = out.reshape(len(out), -1)[:, 0] if out.ndim == 2 else out
    elif out.ndim == 2:
        out = out.argmax(axis=1)
    if len(out) != len(y):
        raise ValueError(f"{len(out)} outputs but {len(y)} labels")
    return {name: _FUNCTIONS[name](out, y) for name in TASK_METRICS[key]}
