"""A real, throttled TCP link on one Linux machine: network namespace + veth pair + ``tc``.

``SlowLink`` builds a point-to-point link between the host and a fresh network
namespace, and shapes both directions with ``tc``:

* a veth pair ``<name>h`` (host end) / ``<name>n`` (namespace end) with the two usable
  addresses of a private ``/30`` in ``10.77.0.0/16`` (one that no host address or route
  already overlaps), so nothing but the two ends of this link is ever addressed;
* on the egress of **both** ends a ``tbf`` (token bucket filter) qdisc at ``rate``, so
  each direction is an independent link of that rate (full duplex); with ``delay`` a
  ``netem`` qdisc is the root and the ``tbf`` its child, so every packet waits
  ``delay`` (one way; the round trip adds ``2 * delay``) and is then rate limited.

Processes started with :meth:`SlowLink.ns_command` run inside the namespace and reach
the host end at :attr:`SlowLink.host_addr`; processes on the host reach the namespace
end at :attr:`SlowLink.ns_addr`. Traffic between the two crosses the shaped veth pair:
real TCP, real queueing, no sleeps.

Teardown (kill what still runs in the namespace, delete the veth pair and the
namespace) always runs: on a normal exit, on an exception, on Ctrl-C (SIGINT), on
SIGTERM/SIGHUP while the context is active (they are turned into ``SystemExit``), and
from ``atexit`` as a last resort. Leftovers of a crashed earlier run under the same
name are removed before setup. Requires root, ``ip`` and ``tc`` (iproute2).

Example::

    with SlowLink(rate="100mbit", delay="5ms") as link:
        server = subprocess.Popen(link.ns_command(["python", "server.py", link.ns_addr]))
        subprocess.run(["python", "client.py", link.ns_addr], check=True)

This module imports nothing from dgpipe (standard library only).
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

__all__ = ["SlowLink", "parse_rate", "parse_delay"]

_RATE_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_NAME_RE = re.compile(r"^[A-Za-z0-9_]{1,14}$")
_POOL = ipaddress.ip_network("10.77.0.0/16")
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_counter = itertools.count()


def parse_rate(rate: str) -> int:
    """Parse a ``tc``-style rate such as ``"100mbit"`` into bits per second.

    Units (decimal, as in ``tc``): ``bit kbit mbit gbit`` (bits per second) and
    ``bps kbps mbps gbps`` (bytes per second). Returns an ``int`` >= 8000 (1 kB/s).
    Raises ``ValueError`` for anything else.
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)\s*", str(rate))
    if not m or m.group(2).lower() not in _RATE_UNITS:
        raise ValueError(
            f"bad rate {rate!r}: use a number and one of {', '.join(_RATE_UNITS)}, e.g. '100mbit'")
    bits = int(round(float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]))
    if bits < 8000:
        raise ValueError(f"rate {rate!r} is below 8kbit (1 kB/s); use a larger rate")
    return bits


def parse_delay(delay: str | None) -> float:
    """Parse a one-way delay such as ``"5ms"`` (units ``us``, ``ms``, ``s``) into seconds.

    ``None``, ``""`` and ``"0"`` mean no delay (0.0). Delays above 10 s raise
    ``ValueError``, as does any other spelling.
    """
    if delay is None or str(delay).strip() in ("", "0"):
        return 0.0
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(us|ms|s)\s*", str(delay))
    if not m:
        raise ValueError(f"bad delay {delay!r}: use a number and us, ms or s, e.g. '5ms'")
    seconds = float(m.group(1)) * _DELAY_UNITS[m.group(2)]
    if seconds > 10.0:
        raise ValueError(f"delay {delay!r} is above 10s; use a smaller delay")
    return seconds


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(argv)}\n"
                           f"{proc.stderr.strip()}")
    return proc


def _netns_exists(name: str) -> bool:
    out = _run(["ip", "netns", "list"]).stdout
    return any(line.split()[0] == name for line in out.splitlines() if line.strip())


def _link_exists(ifname: str) -> bool:
    return _run(["ip", "link", "show", "dev", ifname], check=False).returncode == 0


def _used_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks the host already has as addresses or routes (any table)."""
    nets = []
    for line in _run(["ip", "-4", "-o", "addr", "show"]).stdout.splitlines():
        m = re.search(r"\binet\s+(\S+)", line)
        if m:
            nets.append(ipaddress.ip_interface(m.group(1)).network)
    for line in _run(["ip", "-4", "route", "show", "table", "all"]).stdout.splitlines():
        words = line.split()
        if words and words[0] in ("local", "broadcast", "unicast", "multicast", "anycast",
                                  "blackhole", "unreachable", "prohibit", "throw", "nat"):
            words = words[1:]
        if words and words[0] != "default":
            try:
                nets.append(ipaddress.ip_network(words[0], strict=False))
            except ValueError:
                continue
    return nets


def _free_subnet(start: int) -> ipaddress.IPv4Network:
    used = _used_networks()
    subnets = list(_POOL.subnets(new_prefix=30))
    for k in range(len(subnets)):
        net = subnets[(start + k) % len(subnets)]
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError(f"no free /30 left in {_POOL}; delete stale veth links (ip link)")


class SlowLink:
    """Context manager: a shaped veth link between the host and a new network namespace.

    Args:
        rate: per-direction rate in ``tc`` syntax, e.g. ``"100mbit"`` (see
            :func:`parse_rate`).
        delay: optional one-way delay, e.g. ``"5ms"`` (see :func:`parse_delay`);
            applied by ``netem`` on both ends, so the round trip gains ``2 * delay``.
        name: namespace name, also the stem of the interface names (at most 14
            characters of ``[A-Za-z0-9_]``). Default ``dgsl<pid>x<n>``: unique per
            process and instance, so parallel runs never collide.
        mtu: MTU of the veth pair in bytes (default 1500, like Ethernet).

    Attributes (valid inside the ``with`` block):
        netns: namespace name. host_if / ns_if: interface names.
        host_addr / ns_addr: IPv4 addresses (str) of the host and namespace ends.
        rate_bps: rate in bits per second. delay_s: one-way delay in seconds.
        burst_bytes: ``tbf`` bucket size in bytes. limit_bytes: ``tbf`` queue in bytes.

    Raises:
        ValueError: bad ``rate``, ``delay``, ``name`` or ``mtu`` (before anything is built).
        PermissionError: not running as root.
        RuntimeError: not Linux, ``ip``/``tc`` missing, or an ``ip``/``tc`` command failed
            (everything built so far is torn down first).
    """

    def __init__(self, rate: str, delay: str | None = None, name: str | None = None,
                 mtu: int = 1500) -> None:
        self.rate_bps = parse_rate(rate)
        self.delay_s = parse_delay(delay)
        if name is None:
            name = f"dgsl{os.getpid()}x{next(_counter)}"
        if not _NAME_RE.match(name):
            raise ValueError(f"bad name {name!r}: use 1 to 14 characters of [A-Za-z0-9_]")
        if not 576 <= int(mtu) <= 65535:
            raise ValueError(f"bad mtu {mtu}: use 576..65535 bytes")
        self.netns = name
        self.host_if = f"{name}h"
        self.ns_if = f"{name}n"
        self.mtu = int(mtu)
        rate_Bps = self.rate_bps / 8
        # Bucket: as small as keeps the rate exact -- two full frames, or 100 us of
        # traffic at high rates (fewer timer wake-ups) -- so that, as on a real wire,
        # only a few kilobytes ever pass faster than the rate (100mbit: 94-95 Mbit/s of
        # TCP goodput measured either way). Queue: 50 ms of traffic plus the bucket, at
        # least 64 frames, so TCP does not see drops at the bandwidth-delay product.
        frame = self.mtu + 14  # Ethernet header; tbf counts link-layer bytes
        self.burst_bytes = int(max(rate_Bps * 100e-6, 2 * frame))
        self.limit_bytes = int(max(rate_Bps * 50e-3, 64 * frame) + self.burst_bytes)
        self.host_addr = ""
        self.ns_addr = ""
        self._active = False
        self._old_handlers: dict[int, object] = {}

    # -- public ---------------------------------------------------------------------

    def ns_command(self, argv: Sequence[str]) -> list[str]:
        """Return ``argv`` prefixed so that it runs inside the namespace.

        ``ip netns exec`` replaces itself with the command, so the pid of the started
        process is the command's pid; the environment is inherited.
        """
        if not argv:
            raise ValueError("ns_command needs a non-empty argv")
        return ["ip", "netns", "exec", self.netns, *[str(a) for a in argv]]

    def describe(self) -> str:
        """One line: addresses, interfaces, rate (Mbit/s), one-way delay (ms) and the TCP congestion control of
        each end (it decides how TCP fills the shaped queue: e.g. BBR drops more in a shallow one than CUBIC)."""
        key = "/proc/sys/net/ipv4/tcp_congestion_control"
        host = Path(key).read_text().strip() if Path(key).exists() else "?"
        ns = _run(self.ns_command(["cat", key]), check=False).stdout.strip() or "?"
        return (f"slow link {self.host_addr} ({self.host_if}, host) <-> {self.ns_addr} "
                f"({self.ns_if}, netns {self.netns}): {self.rate_bps / 1e6:g} Mbit/s "
                f"each way, one-way delay {self.delay_s * 1e3:g} ms; TCP congestion control {host} (host), "
                f"{ns} (netns)")

    def __enter__(self) -> "SlowLink":
        self._check_environment()
        self._active = True
        atexit.register(self._teardown_quietly)
        try:
            self._install_signal_handlers()
            self._teardown()  # leftovers of a crashed run with the same name
            self._setup()
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._close(raise_errors=exc_type is None)

    # -- internals ------------------------------------------------------------------

    @staticmethod
    def _check_environment() -> None:
        if not sys.platform.startswith("linux"):
            raise RuntimeError("SlowLink needs Linux (network namespaces, veth, tc)")
        if os.geteuid() != 0:
            raise PermissionError(
                "SlowLink needs root to create network namespaces and tc qdiscs; "
                "run as root (e.g. sudo python ...)")
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            raise RuntimeError(f"SlowLink needs {' and '.join(missing)} from iproute2 "
                               "(e.g. apt-get install iproute2)")

    def _setup(self) -> None:
        net = _free_subnet(start=os.getpid() * 131 + sum(map(ord, self.netns)))
        host, ns = list(net.hosts())
        self.host_addr, self.ns_addr = str(host), str(ns)
        plen = net.prefixlen
        _run(["ip", "netns", "add", self.netns])
        _run(["ip", "link", "add", self.host_if, "mtu", str(self.mtu), "type", "veth",
              "peer", "name", self.ns_if, "mtu", str(self.mtu), "netns", self.netns])
        _run(["ip", "addr", "add", f"{host}/{plen}", "dev", self.host_if])
        _run(["ip", "link", "set", self.host_if, "up"])
        nsx = ["ip", "netns", "exec", self.netns]
        _run([*nsx, "ip", "addr", "add", f"{ns}/{plen}", "dev", self.ns_if])
        _run([*nsx, "ip", "link", "set", self.ns_if, "up"])
        _run([*nsx, "ip", "link", "set", "lo", "up"])
        self._shape([])
        self._shape(nsx)

    def _shape(self, prefix: list[str]) -> None:
        dev = self.host_if if not prefix else self.ns_if
        tbf = ["tbf", "rate", f"{self.rate_bps}bit", "burst", str(self.burst_bytes),
               "limit", str(self.limit_bytes)]
        tc = [*prefix, "tc", "qdisc", "add", "dev", dev]
        if self.delay_s > 0:
            delay_us = max(1, int(round(self.delay_s * 1e6)))
            netem = _run([*tc, "root", "handle", "1:", "netem", "delay", f"{delay_us}us",
                          "limit", "100000"], check=False)
            if netem.returncode != 0:
                raise RuntimeError(
                    "tc could not add a netem qdisc, so --delay cannot be emulated on this "
                    "kernel (it needs CONFIG_NET_SCH_NETEM / module sch_netem); run without "
                    f"a delay or on a kernel with netem. tc said: {netem.stderr.strip()}")
            _run([*tc, "parent", "1:1", "handle", "10:", *tbf])
        else:
            _run([*tc, "root", "handle", "1:", *tbf])

    def _kill_ns_processes(self) -> None:
        out = _run(["ip", "netns", "pids", self.netns], check=False).stdout
        pids = [int(p) for p in out.split() if p.isdigit()]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 2.0
            while pids and time.monotonic() < deadline:
                pids = [p for p in pids if os.path.exists(f"/proc/{p}")]
                if pids:
                    time.sleep(0.05)
            if not pids:
                return

    def _teardown(self) -> None:
        """Remove the namespace, the veth pair and anything running inside."""
        if _netns_exists(self.netns):
            self._kill_ns_processes()
        if _link_exists(self.host_if):
            _run(["ip", "link", "del", self.host_if], check=False)
        if _netns_exists(self.netns):
            _run(["ip", "netns", "del", self.netns], check=False)
        left = [what for what, exists in ((f"netns {self.netns}", _netns_exists(self.netns)),
                                          (f"link {self.host_if}", _link_exists(self.host_if)))
                if exists]
        if left:
            raise RuntimeError(f"SlowLink teardown left {', '.join(left)}; remove by hand: "
                               f"ip link del {self.host_if}; ip netns del {self.netns}")

    def _teardown_quietly(self) -> None:
        if self._active:
            self._active = False
            try:
                self._teardown()
            except Exception as err:  # atexit: report, never raise
                print(f"warning: {err}", file=sys.stderr)

    def _close(self, raise_errors: bool = False) -> None:
        """Teardown with SIGINT/SIGTERM/SIGHUP blocked, then restore the handlers."""
        blocked = {signal.SIGINT, *_SIGNALS}
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            atexit.unregister(self._teardown_quietly)
            self._active = False
            try:
                self._teardown()
            except RuntimeError as err:
                if raise_errors:
                    raise
                print(f"warning: {err}", file=sys.stderr)
        finally:
            self._restore_signal_handlers()
            if in_main:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals are delivered to the main thread only; atexit still runs

        def _raise(signum, frame):
            raise SystemExit(128 + signum)

        for sig in _SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, _raise)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()
