"""The README's recipe for an untrusted network: a client/server run through an SSH layer-3 tunnel.

Two "machines" on this one: the host, and a network namespace joined to it by a veth
pair (:class:`dgpipe.comm.slow_link.SlowLink`, unshaped in practice at 1 Gbit/s). The
namespace runs ``sshd``; the host opens the tunnel with ``ssh -w N:N`` as the README
says, and each end gives its ``tunN`` a point-to-point address. The NLP main job then
runs as torchrun would start it on two machines -- rank 0 (the client, which hosts the
rendezvous) on the host, rank 1 (the server) in the namespace -- with ``MASTER_ADDR``
the client's tunnel address and ``GLOO_SOCKET_IFNAME=tunN`` on both sides. The test
checks that the run ends normally and that its traffic crossed the tunnel: the
tunnel's byte counters grow by at least the wire bytes the run's log reports.

Needs root, iproute2, OpenSSH's ``ssh``, ``sshd`` and ``ssh-keygen``, and ``/dev/net/tun``;
skipped otherwise (e.g. on CI, which has no ``sshd``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dgpipe.comm.slow_link import SlowLink
from dgpipe.train.runlog import read_records
from helpers import ROOT

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
GLUE = ROOT.parent / "shared" / "data" / "glue"

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("ip") is None
    or shutil.which("tc") is None or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None
    or SSHD is None or not os.path.exists("/dev/net/tun") or not (GLUE / "RTE").is_dir(),
    reason="an SSH tunnel between a network namespace and the host needs Linux, root, iproute2, "
           "OpenSSH's ssh, sshd and ssh-keygen, /dev/net/tun and ../shared/data/glue/RTE")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tun_bytes(link: SlowLink, ifname: str, inside: bool) -> int:
    """rx + tx bytes of ``ifname`` on the host or in the link's namespace."""
    prefix = ["ip", "netns", "exec", link.netns] if inside else []
    out = subprocess.run(prefix + ["cat", f"/sys/class/net/{ifname}/statistics/rx_bytes",
                                   f"/sys/class/net/{ifname}/statistics/tx_bytes"],
                         capture_output=True, text=True, check=True).stdout.split()
    return sum(int(v) for v in out)


def _wait_for(check, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_client_server_run_through_an_ssh_layer3_tunnel(tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True)
    (keys / "authorized_keys").write_text((keys / "client_key.pub").read_text())
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    tun = 40 + os.getpid() % 50
    ifname, client_addr, server_addr = f"tun{tun}", "10.79.0.1", "10.79.0.2"
    port = _free_port()
    procs = []
    try:
        with SlowLink(rate="1gbit") as link:
            sshd = subprocess.Popen(link.ns_command([
                SSHD, "-D", "-e", "-p", str(port), "-h", str(keys / "host_key"),
                "-o", f"ListenAddress={link.ns_addr}", "-o", "PermitTunnel=point-to-point",
                "-o", "PermitRootLogin=prohibit-password", "-o", f"AuthorizedKeysFile={keys / 'authorized_keys'}",
                "-o", "StrictModes=no", "-o", "PidFile=none", "-o", "UsePAM=no"]),
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            procs.append(sshd)

            def listening() -> bool:
                assert sshd.poll() is None, f"sshd exited: {sshd.communicate()[1]}"
                try:
                    socket.create_connection((link.ns_addr, port), timeout=1).close()
                    return True
                except OSError:
                    return False

            _wait_for(listening, "sshd")
            # the README's one line (here with a throwaway key and no host-key check)
            ssh = subprocess.Popen([
                "ssh", "-N", "-w", f"{tun}:{tun}", "-p", str(port), "-i", str(keys / "client_key"),
                "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes", "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=10", f"root@{link.ns_addr}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            procs.append(ssh)

            def up(inside: bool) -> bool:
                prefix = ["ip", "netns", "exec", link.netns] if inside else []
                return subprocess.run(prefix + ["ip", "link", "show", ifname], capture_output=True).returncode == 0

            try:
                _wait_for(lambda: ssh.poll() is not None or sshd.poll() is not None or (up(False) and up(True)),
                          f"{ifname} on both ends")
            except TimeoutError:
                ssh.kill()
                sshd.kill()
                raise AssertionError(f"no tunnel: ssh: {ssh.communicate()[1]}\nsshd: {sshd.communicate()[1]}")
            assert ssh.poll() is None, f"ssh exited: {ssh.communicate()[1]}"
            for inside, mine, peer in ((False, client_addr, server_addr), (True, server_addr, client_addr)):
                prefix = ["ip", "netns", "exec", link.netns] if inside else []
                subprocess.run(prefix + ["ip", "addr", "add", mine, "peer", peer, "dev", ifname], check=True)
                subprocess.run(prefix + ["ip", "link", "set", ifname, "up"], check=True)
            before = _tun_bytes(link, ifname, inside=False)

            log = tmp_path / "rte.jsonl"
            env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
            env.update(WORLD_SIZE="2", MASTER_ADDR=client_addr, MASTER_PORT=str(_free_port()),
                       GLOO_SOCKET_IFNAME=ifname, OMP_NUM_THREADS="1")
            cmd = [sys.executable, str(ROOT / "test_nlp_dgpipe.py"), "--task", "rte", "--data-dir", str(GLUE),
                   "--model-config", "tiny-roberta", "--max-length", "64", "--sortquant", "--quant", "6",
                   "--split", "2", "--chunk", "4", "--batch-size", "16", "--train-subset", "64",
                   "--eval-subset", "32", "--epochs", "1", "--max-steps", "2", "--no-progress",
                   "--timeout", "60", "--log", str(log)]
            server = subprocess.Popen(link.ns_command(["env", "RANK=1", "LOCAL_RANK=0", *cmd]), env=env,
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append(server)
            client = subprocess.run(cmd, env=dict(env, RANK="0", LOCAL_RANK="0"), cwd=ROOT,
                                    capture_output=True, text=True, timeout=240)
            server_out = server.communicate(timeout=60)[0]
            assert client.returncode == 0 and server.returncode == 0, \
                f"client:\n{client.stdout}\n{client.stderr}\nserver:\n{server_out}"
            crossed = _tun_bytes(link, ifname, inside=False) - before
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.kill()
                p.wait()
    summary = read_records(log)[-1]
    assert summary["event"] == "summary" and summary["steps"] == 2
    # every boundary message of the run (and the rendezvous) went through tunN
    assert crossed >= summary["wire_bytes"] > 0, (crossed, summary["wire_bytes"])
