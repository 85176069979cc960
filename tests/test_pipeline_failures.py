"""A failing, dying or stalled rank ends every rank with a clear error, never a hang.

Spawned worlds use the ``fork`` start method (the ranks inherit the imported torch,
which keeps these tests fast); the torchrun-style test starts plain processes that
rendezvous through env:// with no supervisor at all.
"""

import datetime
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dgpipe.pipeline import Pipeline, SpawnError, free_port, spawn
from helpers import default_sigint


class Boom(nn.Module):
    """Raises on its ``fail_at``-th call (a stage that fails in the middle of a step)."""

    def __init__(self, fail_at):
        super().__init__()
        self.lin, self.calls, self.fail_at = nn.Linear(4, 4), 0, fail_at

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ValueError(f"injected failure in call {self.calls}")
        return self.lin(x)


def _pipeline(timeout, fail_at=0):
    torch.manual_seed(0)
    return Pipeline([nn.Linear(4, 4), Boom(fail_at)], [0, 1], chunks=4, loss_fn=F.mse_loss, timeout=timeout)


def _step(rank, world_size, fault):
    """One training step in which rank 1 misbehaves: ``"raise"`` (its stage raises in the
    middle of the step), ``"die"`` (exits at once) or ``"stall"`` (sleeps; the pipeline's
    timeout is 2 s)."""
    torch.set_num_threads(1)
    pipe = _pipeline(timeout=2 if fault == "stall" else 60, fail_at=3 if fault == "raise" else 0)
    if rank == 1 and fault == "die":
        os._exit(3)
    if rank == 1 and fault == "stall":
        time.sleep(120)
    pipe.train_step(torch.randn(8, 4), torch.randn(8, 4))


def test_spawn_names_the_rank_that_raised():
    start = time.monotonic()
    with pytest.raises(SpawnError, match=r"rank 1 failed: ValueError: injected failure in call 3") as info:
        spawn(_step, 2, ("raise",), timeout=60, start_method="fork")
    assert info.value.rank == 1
    assert "Traceback" in info.value.text
    assert time.monotonic() - start < 30  # not the 60 s timeouts: the others were stopped at once


def test_spawn_names_a_rank_that_died_without_an_exception():
    with pytest.raises(SpawnError, match=r"rank 1 failed: rank 1 died without a Python exception \(exit code 3\)"):
        spawn(_step, 2, ("die",), timeout=60, start_method="fork")


def test_stalled_peer_times_out_with_its_rank_named():
    start = time.monotonic()
    with pytest.raises(SpawnError, match=r"rank 0 failed: .*timed out after 2 s: rank 1 is stalled") as info:
        spawn(_step, 2, ("stall",), timeout=60, start_method="fork")
    assert info.value.rank == 0
    assert time.monotonic() - start < 30


TORCHRUN_RANK = textwrap.dedent(
    """
    import os, sys, torch, torch.nn as nn, torch.nn.functional as F
    from dgpipe.pipeline import Pipeline, init_distributed
    torch.set_num_threads(1)
    rank, world = init_distributed("gloo", timeout=60)

    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("injected failure on rank %d" % rank)

    stages = [nn.Linear(4, 4), Boom()]
    pipe = Pipeline(stages, [0, 1], chunks=2, loss_fn=F.mse_loss, timeout=30)
    pipe.train_step(torch.randn(4, 4), torch.randn(4, 4))
    """
)


def test_without_supervisor_the_peer_of_a_failed_rank_exits_nonzero(tmp_path):
    """Like torchrun ranks: rank 1 raises; rank 0, blocked receiving, exits non-zero on its own."""
    script = tmp_path / "rank.py"
    script.write_text(TORCHRUN_RANK)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    procs = [
        subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r)), stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode != 0 and "injected failure on rank 1" in errs[1]
    assert procs[0].returncode != 0
    assert "TransportError" in errs[0] and "rank 1 closed the connection or failed" in errs[0], errs[0][-2000:]


CTRL_C_PARENT = textwrap.dedent(
    """
    import os, sys, time
    from dgpipe.pipeline import spawn

    def wait_forever(rank, world_size, out_dir):
        open(os.path.join(out_dir, "rank%d.pid" % rank), "w").write(str(os.getpid()))
        time.sleep(600)

    spawn(wait_forever, 2, args=(sys.argv[1],), start_method="fork")
    """
)


def _gone(pid: int) -> bool:
    """The process has exited (a zombie that nobody has reaped yet counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigkill"])
def test_stopping_the_launcher_ends_every_rank(tmp_path, how):
    """Ctrl-C (SIGINT to the terminal's process group), SIGTERM to the launcher alone (what a job
    runner or ``kill`` sends; the launcher stops its ranks) and SIGKILL to the launcher alone
    (the ranks' parent-death signal, Linux) all leave no rank running."""
    if how == "sigkill" and not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux's")
    script = tmp_path / "parent.py"
    script.write_text(CTRL_C_PARENT)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)], start_new_session=True,
                              stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)  # fmt: skip
    pids = []
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert parent.poll() is None and time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.2)
        time.sleep(0.5)  # the ranks have written their pids: let both reach their sleep
        pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid"))]
        if how == "ctrl-c":
            os.killpg(parent.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        else:
            os.kill(parent.pid, signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        parent.communicate(timeout=30)
        deadline = time.monotonic() + 15
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        for pid in pids:  # never leave a rank behind, whatever the outcome
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
    assert parent.returncode != 0
    assert all(_gone(pid) for pid in pids), f"ranks still running after {how} to the launcher"


def _torch_in_a_daemon_thread(rank, world_size, marker):
    """Returns while a daemon thread is inside torch ops: in interpreter teardown that thread,
    taking the GIL back, aborts the process ("terminate called without an active exception",
    pytorch/pytorch#38228 -- how a rank whose work was done failed once in CI)."""
    import atexit
    import threading

    def spin():
        a = torch.randn(1000)
        while True:
            a + a

    threading.Thread(target=spin, daemon=True).start()
    time.sleep(0.2)
    atexit.register(lambda: open(f"{marker}.{rank}", "w").close())


def test_a_rank_that_finished_is_not_failed_by_interpreter_teardown(tmp_path):
    spawn(_torch_in_a_daemon_thread, 2, (str(tmp_path / "atexit"),), timeout=60, start_method="spawn")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit.0", "atexit.1"]  # atexit handlers still ran


def test_restarts_across_machines_need_a_store_per_round(monkeypatch):
    """Under torchrun --max-restarts with the agent's shared store, ranks on several machines cannot
    agree on a key prefix per round: init_distributed names torchrun's switch instead of letting a
    restarted rank read a dead predecessor's address; on one machine, or without restarts, or with
    the switch set, env:// as usual."""
    from dgpipe.pipeline import launch

    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3",
           "TORCHELASTIC_RESTART_COUNT": "0"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment"):
        launch.init_distributed("gloo", timeout=5)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert launch._restart_store(datetime.timedelta(seconds=5)) is None
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert launch._restart_store(datetime.timedelta(seconds=5)) is None
