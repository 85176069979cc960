"""Fixed, seeded subsets of a dataset split (``--train-subset`` / ``--eval-subset``)."""

from __future__ import annotations

import numpy as np


def choose_subset(labels, size: int | None, seed: int = 0, stratify: bool = True) -> np.ndarray:
    """Indices of a fixed subset of ``size`` examples, sorted ascending.

    Args:
        labels: sequence of the ``N`` labels of the split (class ids; any hashable values).
        size: number of examples wanted; ``None`` means the whole split.
        seed: seed of the choice; the same (labels, size, seed) always gives the same indices.
        stratify: keep each class's share of the split (largest-remainder rounding), so a
            small subset still holds every class; ``False`` (e.g. regression targets) picks
            uniformly at random without replacement.

    Returns:
        int64 array of ``size`` distinct indices into ``labels`` (``arange(N)`` when ``size``
        is ``None``).

    Raises:
        ValueError: ``size`` is not in ``1..N``.
    """
    n = len(labels)
    if size is None:
        return np.arange(n, dtype=np.int64)
    if not 1 <= size <= n:
        raise ValueError(f"subset size {size} is out of range: the split has {n} examples; pass 1..{n} (or no subset)")
    rng = np.random.default_rng(seed)
    if not stratify:
        return np.sort(rng.choice(n, size=size, replace=False)).astype(np.int64)
    _, codes = np.unique(np.asarray(labels), return_inverse=True)
    codes = codes.reshape(-1)
    counts = np.bincount(codes)
    exact = counts * (size / n)
    quota = np.floor(exact).astype(np.int64)
    # Largest remainder: hand the leftover examples to the classes with the biggest fractions.
    leftover = size - int(quota.sum())
    order = np.argsort(-(exact - quota), kind="stable")
    quota[order[:leftover]] += 1
    chosen = [rng.permutation(np.flatnonzero(codes == c))[:q] for c, q in enumerate(quota)]
    return np.sort(np.concatenate(chosen)).astype(np.int64)
