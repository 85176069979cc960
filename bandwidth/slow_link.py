"""Run a two-rank command across a real throttled TCP link on this machine (needs root).

    python bandwidth/slow_link.py --rate 100mbit [--delay 5ms] [--timeout S] -- COMMAND...

Builds a ``SlowLink`` (network namespace + veth pair + ``tc tbf`` on both ends, ``netem``
for ``--delay``; see ``dgpipe/comm/slow_link.py``), then starts COMMAND twice with
torchrun-style environment variables:

* rank 0, the **client**, on the host; it hosts the rendezvous (TCPStore) on the
  host end of the link, ``MASTER_ADDR`` = the host-side veth address;
* rank 1, the **server**, inside the namespace (``ip netns exec``), reaching the
  client only through the shaped link.

Both get ``RANK``, ``WORLD_SIZE=2``, ``LOCAL_RANK`` = ``RANK`` (they share this
machine's devices), ``LOCAL_WORLD_SIZE=2``, ``GROUP_RANK`` = ``RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, and ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` naming their veth
end (NCCL's shared-memory, P2P and InfiniBand transports are disabled so that NCCL
traffic also crosses the link). COMMAND must therefore accept being launched like
under torchrun (``init_process_group(init_method="env://")``), as dgpipe's CLIs and
``bandwidth/probe_link.py`` do.

If either rank fails, the other is killed and this script exits with the failing
rank's status (128 + signal for a signal); after ``--timeout`` seconds both are
killed and it exits 124. The link is torn down in every case, Ctrl-C included.

Example::

    python bandwidth/slow_link.py --rate 100mbit -- python bandwidth/probe_link.py --max-size 16M
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from dgpipe.comm.slow_link import SlowLink, parse_delay, parse_rate
from dgpipe.pipeline import free_port, stop_process_group


def rank_env(link: SlowLink, rank: int, port: int) -> dict[str, str]:
    """Environment for one rank: the caller's plus torchrun-style and interface vars."""
    ifname = link.host_if if rank == 0 else link.ns_if
    env = dict(os.environ)
    env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
               GROUP_RANK=str(rank), MASTER_ADDR=link.host_addr, MASTER_PORT=str(port),
               GLOO_SOCKET_IFNAME=ifname, NCCL_SOCKET_IFNAME=ifname, NCCL_IB_DISABLE="1",
               NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
    return env


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def run_ranks(link: SlowLink, command: list[str], timeout_s: float | None) -> int:
    """Start rank 0 on the host and rank 1 in the namespace; return the exit status."""
    port = free_port(link.host_addr)
    procs: list[subprocess.Popen] = []
    try:
        for rank in (0, 1):
            argv = command if rank == 0 else link.ns_command(command)
            procs.append(subprocess.Popen(argv, env=rank_env(link, rank, port),
                                          start_new_session=True))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(f"slow_link: rank {rank} ({'client' if rank == 0 else 'server'}) "
                      f"exited with status {_status(code)}; stopping the other rank",
                      file=sys.stderr)
                return _status(code)
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                print(f"slow_link: timeout after {timeout_s:g} s; stopping both ranks",
                      file=sys.stderr)
                return 124
            time.sleep(0.05)
    finally:
        for proc in procs:
            stop_process_group(proc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s --rate RATE [--delay DELAY] [--timeout S] -- COMMAND...")
    parser.add_argument("--rate", required=True,
                        help="rate each way, tc syntax: e.g. 100mbit, 1gbit, 500kbit")
    parser.add_argument("--delay", default=None,
                        help="one-way delay added by netem on both ends, e.g. 5ms "
                             "(round trip +2x); needs a kernel with sch_netem")
    parser.add_argument("--timeout", type=float, default=None,
                        help="kill both ranks after this many seconds (exit status 124)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- then the command to run as both ranks")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --, e.g. -- python bandwidth/probe_link.py")
    if args.timeout is not None and args.timeout <= 0:
        parser.error("--timeout must be > 0 seconds")
    try:
        parse_rate(args.rate)
        parse_delay(args.delay)
    except ValueError as err:
        parser.error(str(err))
    try:
        with SlowLink(rate=args.rate, delay=args.delay) as link:
            print(link.describe(), file=sys.stderr, flush=True)
            return run_ranks(link, command, args.timeout)
    except (PermissionError, RuntimeError) as err:
        print(f"slow_link: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("slow_link: interrupted; link torn down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
