"""Shared pytest fixtures."""

import pytest
import torch


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
