"""Task metrics against hand-computed values."""

import math

import numpy as np
import pytest
import torch

from dgpipe.train.metrics import (
    accuracy,
    compute_metrics,
    f1,
    matthews_correlation,
    pearson,
    spearman,
    task_metric,
)

# TP = 2 (items 0, 4), FP = 1 (item 1), TN = 2 (items 2, 3), FN = 1 (item 5)
PRED = [1, 1, 0, 0, 1, 0]
GOLD = [1, 0, 0, 0, 1, 1]


def test_accuracy():
    assert accuracy([1, 0, 1, 1], [1, 1, 1, 0]) == 0.5
    assert accuracy(torch.tensor(PRED), torch.tensor(GOLD)) == pytest.approx(4 / 6)


def test_matthews_and_f1():
    # (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = (4 - 1) / sqrt(3*3*3*3)
    assert matthews_correlation(PRED, GOLD) == pytest.approx(1 / 3)
    assert f1(PRED, GOLD) == pytest.approx(2 / 3)  # precision 2/3, recall 2/3
    assert matthews_correlation([1, 1, 1], [1, 0, 1]) == 0.0  # constant prediction


def test_correlations():
    x, y = [1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 5.0, 9.0]
    # deviations (-1.5, -.5, .5, 1.5) and (-3, -1, 0, 4): 11 / sqrt(5 * 26)
    assert pearson(x, y) == pytest.approx(11 / math.sqrt(130))
    # ranks (1, 2, 3, 4) vs (1, 3, 2, 4): 1 - 6 * 2 / (4 * 15)
    assert spearman(x, [2.0, 5.0, 4.0, 9.0]) == pytest.approx(0.8)
    assert math.isnan(pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))


def test_task_metric_names():
    assert task_metric("cola") == "matthews_correlation"
    assert task_metric("MRPC") == task_metric("qqp") == "f1"
    assert task_metric("sts-b") == "pearson"
    assert {task_metric(t) for t in ("sst2", "mnli", "qnli", "rte", "wnli", "cifar10", "cifar100")} == {"accuracy"}
    with pytest.raises(ValueError, match="unknown task"):
        task_metric("imagenet")


def test_compute_metrics_from_logits_and_scores():
    logits = torch.tensor([[0.1, 0.9], [0.2, 0.8], [3.0, -1.0], [0.5, 0.4], [-2.0, 2.0], [1.0, 0.0]])
    got = compute_metrics("mrpc", logits, torch.tensor(GOLD))  # argmax of logits == PRED
    assert list(got) == ["f1", "accuracy"]
    assert got["f1"] == pytest.approx(2 / 3) and got["accuracy"] == pytest.approx(4 / 6)
    cola = compute_metrics("cola", np.array(PRED), GOLD)
    assert list(cola) == ["matthews_correlation", "accuracy"] and cola["matthews_correlation"] == pytest.approx(1 / 3)
    stsb = compute_metrics("stsb", torch.tensor([[1.0], [2.0], [3.0], [4.0]]), torch.tensor([2.0, 4.0, 5.0, 9.0]))
    assert stsb["pearson"] == pytest.approx(11 / math.sqrt(130)) and stsb["spearmanr"] == pytest.approx(1.0)
    assert compute_metrics("rte", [0, 1, 1], [0, 1, 0]) == {"accuracy": pytest.approx(2 / 3)}
    with pytest.raises(ValueError, match="3 outputs but 2 labels"):
        compute_metrics("rte", [0, 1, 1], [0, 1])
