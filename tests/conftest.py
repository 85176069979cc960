"""Shared pytest fixtures, and the order of the tests."""

import os

import pytest
import torch

from dgpipe.train.placement import TORCHRUN_VARS

if not torch.cuda.is_available():
    # Without a GPU, tests/test_fused_triton.py runs the Triton kernels under Triton's interpreter,
    # which must be on before Triton is imported (nothing here imports it; no test imports it earlier).
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests with one intra-op thread (restored afterwards).

    Tiny models gain nothing from intra-op threads, and on a busy machine the threads'
    spin-waits turn milliseconds into seconds. Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_torchrun(monkeypatch):
    """Remove torchrun's variables (RANK, WORLD_SIZE, ...) from the environment, so that a
    main-job CLI run in-process spawns its own ranks instead of joining a torchrun world.
    Use with ``pytestmark = pytest.mark.usefixtures("no_torchrun")``."""
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)


def pytest_collection_modifyitems(items):
    """Run the tests that use CUDA last: once a process has run autograd on CUDA, a forked
    child cannot use autograd, and several modules fork their ranks (spawn_checks). The
    Triton kernels' tests use CUDA where there is a GPU."""
    items.sort(key=lambda item: "cuda" in item.nodeid.lower() or "triton" in item.nodeid.lower())
