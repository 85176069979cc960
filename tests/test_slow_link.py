"""SlowLink (namespace + veth + tc) and the bandwidth/slow_link.py runner.

Tests that build links need root and iproute2; they are skipped otherwise.
"""

import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dgpipe.comm.slow_link import SlowLink, parse_delay, parse_rate
from helpers import default_sigint

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "bandwidth" / "slow_link.py"

needs_root = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0
    or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="building a slow link needs Linux, root (network namespaces, tc qdiscs) "
           "and iproute2's ip and tc")


def netns_exists(name: str) -> bool:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return any(line.split()[0] == name for line in out.splitlines() if line.strip())


def link_exists(ifname: str) -> bool:
    return subprocess.run(["ip", "link", "show", "dev", ifname],
                          capture_output=True).returncode == 0


def assert_gone(name: str) -> None:
    assert not netns_exists(name), f"netns {name} left behind"
    assert not link_exists(f"{name}h"), f"veth {name}h left behind"


# -- argument checks (no root needed) ---------------------------------------------------

def test_parse_rate_and_delay():
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("1.5Gbit") == 1_500_000_000
    assert parse_rate("500kbit") == 500_000
    assert parse_rate("1mbps") == 8_000_000  # tc: bps = bytes per second
    assert parse_delay("5ms") == pytest.approx(0.005)
    assert parse_delay("250us") == pytest.approx(250e-6)
    assert parse_delay(None) == 0.0 and parse_delay("0") == 0.0
    for bad in ("100", "fast", "100 mb", "-5mbit", "1bit"):
        with pytest.raises(ValueError):
            parse_rate(bad)
    for bad in ("5", "5 min", "-1ms", "11s"):
        with pytest.raises(ValueError):
            parse_delay(bad)


def test_bad_arguments_raise_before_anything_is_built():
    with pytest.raises(ValueError, match="rate"):
        SlowLink(rate="fast")
    with pytest.raises(ValueError, match="name"):
        SlowLink(rate="10mbit", name="has space")
    with pytest.raises(ValueError, match="name"):
        SlowLink(rate="10mbit", name="x" * 15)  # interface names are at most 15 chars


def test_refuses_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    link = SlowLink(rate="10mbit", name="dgslnoroot")
    with pytest.raises(PermissionError, match="root"):
        with link:
            pass
    assert not (shutil.which("ip") and netns_exists("dgslnoroot"))


def test_cli_rejects_bad_input_before_building(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("slow_link_cli", CLI)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    monkeypatch.setattr(cli, "SlowLink", None)  # building a link would fail loudly
    for args, msg in ((["--rate", "fast", "--", "true"], "bad rate"),
                      (["--rate", "10mbit"], "command"),
                      (["--rate", "10mbit", "--delay", "5", "--", "true"], "bad delay"),
                      (["--rate", "10mbit", "--timeout", "0", "--", "true"], "--timeout")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(args)
        assert exit_info.value.code == 2
        assert msg in capsys.readouterr().err


# -- real links ----------------------------------------------------------------------------

@needs_root
def test_setup_shapes_both_ends_and_teardown_removes_everything():
    with SlowLink(rate="10mbit") as link:
        assert netns_exists(link.netns)
        host = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", link.host_if],
                              capture_output=True, text=True, check=True).stdout
        assert f"inet {link.host_addr}/30" in host
        inside = subprocess.run(link.ns_command(["ip", "-4", "-o", "addr", "show"]),
                                capture_output=True, text=True, check=True).stdout
        assert f"inet {link.ns_addr}/30" in inside and link.ns_if in inside
        assert not link_exists(link.ns_if)  # the namespace end is not on the host
        for argv in (["tc", "qdisc", "show", "dev", link.host_if],
                     link.ns_command(["tc", "qdisc", "show", "dev", link.ns_if])):
            qdisc = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
            assert re.search(r"qdisc tbf 1: root .*rate 10Mbit", qdisc), qdisc
        name = link.netns
    assert_gone(name)


@needs_root
def test_teardown_runs_on_exception():
    with pytest.raises(ZeroDivisionError):
        with SlowLink(rate="10mbit") as link:
            name = link.netns
            assert netns_exists(name)
            1 / 0
    assert_gone(name)


@needs_root
def test_stale_leftovers_of_a_crashed_run_are_removed():
    name = f"dgst{os.getpid()}"[:14]
    subprocess.run(["ip", "netns", "add", name], check=True)
    subprocess.run(["ip", "link", "add", f"{name}h", "type", "veth", "peer", "name",
                    f"{name}n"], check=True)
    try:
        with SlowLink(rate="10mbit", name=name) as link:
            assert link_exists(link.host_if) and netns_exists(name)
    finally:
        subprocess.run(["ip", "link", "del", f"{name}h"], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    assert_gone(name)


@needs_root
def test_parallel_links_get_distinct_names_and_subnets():
    with SlowLink(rate="10mbit") as a, SlowLink(rate="10mbit") as b:
        assert a.netns != b.netns
        assert {a.host_addr, a.ns_addr}.isdisjoint({b.host_addr, b.ns_addr})
        names = (a.netns, b.netns)
    for name in names:
        assert_gone(name)


SERVER = textwrap.dedent("""
    import socket, sys
    srv = socket.socket()
    srv.settimeout(20)
    srv.bind((sys.argv[1], 0)); srv.listen(1)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept(); conn.settimeout(20)
    n, data = int(sys.argv[2]), bytearray()
    while len(data) < n:
        chunk = conn.recv(1 << 16)
        if not chunk: break
        data += chunk
    conn.sendall(b"k")    # everything arrived
    conn.sendall(data)    # and back again
    conn.close()
""")


@needs_root
def test_tcp_transfer_crosses_the_link_at_the_set_rate():
    rate_bps, nbytes = 8_000_000, 300_000  # 1 MB/s: 0.3 s per direction
    payload = os.urandom(nbytes)
    with SlowLink(rate="8mbit") as link:
        server = subprocess.Popen(
            link.ns_command([sys.executable, "-c", SERVER, link.ns_addr, str(nbytes)]),
            stdout=subprocess.PIPE, text=True)
        try:
            port = int(server.stdout.readline())
            with socket.create_connection((link.ns_addr, port), timeout=20) as conn:
                start = time.perf_counter()
                conn.sendall(payload)
                assert conn.recv(1) == b"k"
                up = time.perf_counter() - start
                echoed = bytearray()
                while len(echoed) < nbytes:
                    chunk = conn.recv(1 << 16)
                    assert chunk, "server closed early"
                    echoed += chunk
                down = time.perf_counter() - start - up
            assert server.wait(timeout=20) == 0
        finally:
            server.kill()
    assert bytes(echoed) == payload
    wire = nbytes * 8 / rate_bps  # seconds at the rate, payload only
    # Lower bounds only (a loaded machine can only add time). The upload is whole before the server
    # answers; the echo may start while the client has not yet read the answer, so the way down is
    # bounded together with the way up.
    assert up > 0.95 * wire, (up, wire)
    assert up + down > 0.95 * 2 * wire, (up, down, wire)


LINGER = textwrap.dedent("""
    import sys, time
    from dgpipe.comm.slow_link import SlowLink
    with SlowLink(rate="10mbit", name=sys.argv[1]) as link:
        print("ready", flush=True)
        time.sleep(60)
""")


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_tears_down(sig):
    name = f"dgsg{os.getpid()}{int(sig)}"[:14]
    proc = subprocess.Popen([sys.executable, "-c", LINGER, name], stdout=subprocess.PIPE,
                            text=True, preexec_fn=default_sigint)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert netns_exists(name)
        proc.send_signal(sig)
        code = proc.wait(timeout=20)
    finally:
        proc.kill()
    assert code != 0
    assert_gone(name)


# -- the runner -------------------------------------------------------------------------------

RANK_INFO = ("import os; e = os.environ; os.write(1, ' '.join(['rank', e['RANK'], "
             "e['WORLD_SIZE'], e['MASTER_ADDR'], e['GLOO_SOCKET_IFNAME'], "
             "str(os.path.exists('/sys/class/net/' + e['GLOO_SOCKET_IFNAME'])), '\\n'])"
             ".encode())")  # one write per rank: the two ranks share stdout


@needs_root
def test_cli_runs_rank0_on_host_and_rank1_in_namespace():
    proc = subprocess.run([sys.executable, str(CLI), "--rate", "50mbit", "--",
                           sys.executable, "-c", RANK_INFO],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = sorted(line.split() for line in proc.stdout.splitlines() if line.startswith("rank"))
    m = re.search(r"slow link (\S+) \((\w+)h, host\) <-> (\S+) \((\w+)n, netns (\w+)\)",
                  proc.stderr)
    host_addr, stem = m.group(1), m.group(2)
    # each rank sees its own veth end in its own network namespace
    assert rows == [["rank", "0", "2", host_addr, f"{stem}h", "True"],
                    ["rank", "1", "2", host_addr, f"{stem}n", "True"]]
    assert_gone(m.group(5))


@needs_root
def test_cli_failing_rank_stops_the_other_and_exits_nonzero():
    script = "import os, sys, time; sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(60)"
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(CLI), "--rate", "50mbit", "--",
                             sys.executable, "-c", script],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=40)
    finally:
        proc.kill()
    assert proc.returncode == 3, err
    assert "rank 1 (server) exited with status 3" in err
    assert time.monotonic() - start < 30
    assert_gone(f"dgsl{proc.pid}x0")


@needs_root
def test_probe_traffic_goes_through_the_link():
    proc = subprocess.run(
        [sys.executable, str(CLI), "--rate", "100mbit", "--timeout", "90", "--",
         sys.executable, str(ROOT / "bandwidth" / "probe_link.py"), "--min-size", "4K",
         "--max-size", "256K", "--repeats", "3", "--min-time", "0"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0] + " " + line.split()[1]: float(line.split()[3])
            for line in proc.stdout.splitlines() if re.match(r"\s+\d+ KiB ", line)}
    assert set(rows) == {"4 KiB", "16 KiB", "64 KiB", "256 KiB"}
    # 100 Mbit/s is 12.5 MB/s; gloo over loopback moves 256 KiB at hundreds of MB/s
    assert rows["256 KiB"] < 12.5, rows
    assert "fit: latency" in proc.stdout
