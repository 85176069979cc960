"""Starting the processes of a pipeline: ``torchrun`` (env://) or a local spawner.

Multi-machine or one machine under torchrun::

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29500 train.py
    # in train.py
    rank, world_size = init_distributed(backend="auto", timeout=120)

One machine, from Python::

    def main(rank, world_size, lr):
        ...  # torch.distributed is initialised here
    spawn(main, world_size=2, args=(0.1,))

``spawn`` binds the rendezvous to 127.0.0.1 on a free port. If a rank raises or dies,
the others are terminated and :class:`SpawnError` names the failed rank with its
traceback (sent to the parent as UTF-8 text over a pipe, not pickled). Ctrl-C or
SIGTERM to the launcher ends every rank, and on Linux a rank also ends when its
launcher dies any other way (SIGKILL included: a parent-death signal). Inside the ranks, every blocking
receive has a timeout (the process group's and the pipeline's), so ranks launched any way end with an error naming the
peer when it fails or stalls. A rank whose ``fn`` returned destroys the process group,
runs its ``atexit`` handlers, flushes stdout/stderr and ends without interpreter teardown
(as multiprocessing's fork children do; pytorch/pytorch#38228): close the files ``fn``
writes, and do not count on non-daemon threads being joined.
"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing import connection
from typing import Callable, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dgpipe.comm.transport import TransportError

__all__ = ["SpawnError", "free_port", "resolve_backend", "init_distributed", "spawn", "stop_process_group",
           "raise_on_sigterm", "exit_without_teardown"]

_MAX_ERROR_BYTES = 32_000


class SpawnError(RuntimeError):
    """A rank started by :func:`spawn` failed.

    Attributes:
        rank: the rank that failed first on its own (not because a peer had failed).
        text: its traceback, or how it died.
    """

    def __init__(self, rank: int, text: str, others: dict[int, str]) -> None:
        last = text.strip().splitlines()[-1] if text.strip() else "no message"
        msg = f"rank {rank} failed: {last}\n\n--- rank {rank} ---\n{text.rstrip()}"
        for r, t in sorted(others.items()):
            msg += f"\n--- rank {r} (also failed) ---\n{t.strip().splitlines()[-1] if t.strip() else t}"
        super().__init__(msg)
        self.rank, self.text = rank, text


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def stop_process_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """End ``proc`` (started with ``start_new_session=True``) and every process of its
    group -- e.g. a launcher and the ranks it started: SIGTERM to the group, then
    SIGKILL if the leader has not exited after ``grace_s`` seconds. Returns once the
    leader has exited or nothing of the group is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def resolve_backend(backend: str) -> str:
    """``"auto"`` -> ``"nccl"`` if CUDA is available, else ``"gloo"``; checks the name.

    Use ``"gloo"`` for mixed placements (a CPU client with a GPU server).

    Raises:
        ValueError: an unknown backend.
    """
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    return backend


def init_distributed(backend: str = "auto", timeout: float = 300.0) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment (env:// rendezvous).

    Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK for the CUDA
    device with NCCL). Does nothing but return ``(rank, world_size)`` if already
    initialised.

    Args:
        backend: ``"auto"``, ``"gloo"`` or ``"nccl"``.
        timeout: seconds for the rendezvous and for every collective and receive
            that has no shorter timeout of its own.

    Returns:
        ``(rank, world_size)``.

    Raises:
        ValueError: a missing environment variable (launch with torchrun or
            :func:`spawn`), an unknown backend, or a non-positive timeout.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = resolve_backend(backend)
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(f"environment variables {missing} are not set; launch with torchrun, or use dgpipe's spawn()")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    wait = datetime.timedelta(seconds=timeout)
    restart_store = _restart_store(wait)
    if restart_store is None:
        dist.init_process_group(backend, init_method="env://", timeout=wait)
    else:
        dist.init_process_group(backend, store=restart_store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=wait)
    return dist.get_rank(), dist.get_world_size()


def _restart_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The store of a torchrun worker group that may be restarted (``--max-restarts``), or None (env://).

    torchrun's agent keeps one TCP store for all its restarts and hands it to the workers, whose
    process groups find each other under the same keys in every round: a restarted rank can read a
    dead predecessor's address and fail to connect (pytorch/pytorch#135712). On one machine every
    rank's ``TORCHELASTIC_RESTART_COUNT`` is the same agent's, so each round gets its own key prefix
    here. Across machines the counts can differ: there torchrun must be told not to share its
    store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: rank 0 then hosts a new one every round).

    Raises:
        ValueError: restarts across machines with the shared store.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS",
                                                                                          "0")) == 0:
        return None
    if os.environ.get("LOCAL_WORLD_SIZE") != os.environ["WORLD_SIZE"]:
        raise ValueError("torchrun --max-restarts across machines: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
                         "torchrun's environment on every machine (a shared store hands restarted ranks stale "
                         "addresses, pytorch/pytorch#135712)")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"dgpipe/restart{os.environ['TORCHELASTIC_RESTART_COUNT']}/", store)


def raise_on_sigterm() -> Callable[[], None]:
    """Make SIGTERM raise ``SystemExit(143)`` in this process, so that a launcher can stop what it
    started (the default would end it at once and leave its children running); returns the
    function that restores the previous handler. Only the main thread can set handlers:
    elsewhere nothing changes (the ranks' parent-death signal still ends them when the
    launcher dies)."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return lambda: None
    return lambda: signal.signal(signal.SIGTERM, previous)


def _die_with_parent(parent: int) -> None:
    """Linux: have the kernel send this rank SIGTERM when its launcher dies, however it dies
    (``prctl(PR_SET_PDEATHSIG)``); exit now if it already has. Elsewhere nothing happens."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the request took effect
        os._exit(1)


def _child(rank: int, world_size: int, fn: Callable, args: tuple, backend: str, host: str, port: int,
           timeout: float, err_conn, parent: int) -> None:
    """Body of one spawned rank: rendezvous, run ``fn``, report a failure as text, exit."""
    _die_with_parent(parent)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=host, MASTER_PORT=str(port),
    )
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        init_distributed(backend, timeout)
        fn(rank, world_size, *args)
    except BaseException as err:  # report everything, Ctrl-C included, then exit non-zero
        text = traceback.format_exc()
        sys.stderr.write(f"[rank {rank}] {text}")
        sys.stderr.flush()
        sys.stdout.flush()
        kind = b"P" if isinstance(err, TransportError) else b"E"  # P: failed because a peer did
        err_conn.send_bytes(kind + text.encode("utf-8", "replace")[-_MAX_ERROR_BYTES:])
        err_conn.close()
        os._exit(130 if isinstance(err, KeyboardInterrupt) else 1)  # skip teardown that could block on dead peers
    dist.destroy_process_group()
    err_conn.close()
    exit_without_teardown(0)


def exit_without_teardown(status: int) -> NoReturn:
    """End this process with ``status`` after its work is done, skipping interpreter teardown.

    Runs the ``atexit`` handlers (multiprocessing's among them: it unlinks the semaphores
    the process made), flushes stdout and stderr, then ``os._exit(status)``, as
    multiprocessing's fork children end. In interpreter teardown a thread still inside
    torch aborts the process as it takes the GIL back ("terminate called without an
    active exception", pytorch/pytorch#38228): a rank whose work was done would end
    with SIGABRT and be reported failed. Non-daemon threads are not joined. Spawned ranks
    end this way; so do the main-job CLIs (a rank under torchrun). Never returns.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _stop(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def spawn(
    fn: Callable,
    world_size: int,
    args: tuple = (),
    backend: str = "gloo",
    timeout: float = 300.0,
    host: str = "127.0.0.1",
    start_method: str = "spawn",
) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes on this machine.

    Each process gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=``host`` and a free
    MASTER_PORT, and has torch.distributed initialised (:func:`init_distributed`)
    before ``fn`` runs. Unless OMP_NUM_THREADS is set, each process uses
    ``cpu_count // world_size`` intra-op threads (at least one), so that the ranks
    share the cores instead of spinning against each other. A rank whose ``fn`` returned
    destroys the process group, runs its ``atexit`` handlers, flushes stdout and stderr and
    ends without interpreter teardown (module docstring).

    Args:
        fn: a module-level function (it is imported by the child processes).
        world_size: number of processes (ranks).
        args: extra arguments passed to ``fn`` (must be picklable for the local
            process start; they never cross the network).
        backend: ``"gloo"``, ``"nccl"`` or ``"auto"``.
        timeout: process-group timeout in seconds (see :func:`init_distributed`).
        host: address the rendezvous binds to (loopback by default).
        start_method: multiprocessing start method.

    Raises:
        ValueError: bad ``world_size``, ``backend`` or ``timeout`` (before anything starts).
        SpawnError: a rank raised or died; the others were terminated. It names the
            first rank that failed on its own (rather than because a peer had failed).
        KeyboardInterrupt: Ctrl-C; every rank was terminated.
        SystemExit: SIGTERM to the launcher (exit status 143); every rank was terminated.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    resolve_backend(backend)
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")
    ctx = mp.get_context(start_method)
    port = free_port(host)
    readers, procs = [], []
    terminate = raise_on_sigterm()
    try:
        for rank in range(world_size):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(rank, world_size, fn, tuple(args), backend, host, port, timeout, w,
                                                 os.getpid()), name=f"dgpipe-rank{rank}")
            p.start()
            w.close()
            readers.append(r)
            procs.append(p)
        order, texts, by_peer = _monitor(procs, readers)
    except BaseException:  # Ctrl-C, SIGTERM (as SystemExit), or an error here: no rank outlives its launcher
        _stop(procs)
        raise
    finally:
        terminate()
    if not order:
        return
    _stop(procs)
    for i in order:
        if i not in texts:
            code = procs[i].exitcode
            how = f"killed by signal {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"
            texts[i] = f"rank {i} died without a Python exception ({how})"
    # Blame the first rank that failed on its own; ranks that only saw a peer fail come after.
    first = next((i for i in order if i not in by_peer), order[0])
    raise SpawnError(first, texts[first], {i: texts[i] for i in order if i != first})


def _monitor(procs: list, readers: list, grace: float = 1.0) -> tuple[list[int], dict[int, str], set[int]]:
    """Watch the ranks until all exit cleanly, or until ``grace`` seconds after the first failure.

    Returns:
        The failed ranks in the order their failure was seen, their reported
        tracebacks, and the ranks whose failure was a peer's (a ``TransportError``).
    """
    order: list[int] = []
    texts: dict[int, str] = {}
    by_peer: set[int] = set()
    live = {p.sentinel: i for i, p in enumerate(procs)}
    open_readers = {r: i for i, r in enumerate(readers)}
    deadline = None
    while live or open_readers:
        wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = connection.wait(list(live) + list(open_readers), wait_s)
        if not ready:
            break
        for obj in ready:
            if obj in open_readers:
                i = open_readers[obj]
                try:
                    data = obj.recv_bytes()
                except EOFError:
                    del open_readers[obj]
                    continue
                texts[i] = data[1:].decode("utf-8", "replace")
                if data[:1] == b"P":
                    by_peer.add(i)
            else:
                i = live.pop(obj)
                procs[i].join()
                if procs[i].exitcode == 0:
                    continue
            if i not in order:
                order.append(i)
        if order and deadline is None:
            deadline = time.monotonic() + grace
    return order, texts, by_peer
