"""Latency/bandwidth fit and the two-process link probe (bandwidth/probe_link.py)."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dgpipe.comm.probe import fit_latency_bandwidth

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "bandwidth" / "probe_link.py"
SIZES = [1024 * 4 ** k for k in range(9)]  # 1 KiB .. 64 MiB


def load_probe_cli():
    spec = importlib.util.spec_from_file_location("probe_link", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@settings(max_examples=40, deadline=None)
@given(latency=st.floats(1e-6, 1e-2), bandwidth=st.floats(1e5, 1e10))
def test_fit_is_exact_on_exact_timings(latency, bandwidth):
    seconds = [latency + s / bandwidth for s in SIZES]
    fit = fit_latency_bandwidth(SIZES, seconds)
    assert fit.latency_s == pytest.approx(latency, rel=1e-6)
    assert fit.bandwidth_Bps == pytest.approx(bandwidth, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0, abs=1e-9)
    assert max(abs(r) for r in fit.rel_residuals) < 1e-6


@pytest.mark.parametrize("latency,bandwidth", [(50e-6, 100e6), (2e-3, 12.5e6), (10e-6, 3e9)])
def test_fit_recovers_latency_and_bandwidth_from_noisy_timings(latency, bandwidth):
    rng = np.random.default_rng(1)
    sizes = np.repeat(SIZES, 3)  # three noisy samples per size
    seconds = (latency + sizes / bandwidth) * (1 + 0.02 * rng.standard_normal(sizes.size))
    fit = fit_latency_bandwidth(sizes, seconds)
    assert fit.latency_s == pytest.approx(latency, rel=0.15)
    assert fit.bandwidth_Bps == pytest.approx(bandwidth, rel=0.03)
    assert fit.r2 > 0.99
    np.testing.assert_allclose(
        fit.rel_residuals, (fit.latency_s + sizes / fit.bandwidth_Bps - seconds) / seconds)


def test_fit_bandwidth_is_not_dragged_by_a_shaper_burst():
    # A token bucket passes the first 12 KB at line speed: small messages are too fast
    # for the line, large ones follow 12.5 MB/s exactly. The bandwidth must stay right.
    bucket, rate, fast = 12_000, 12.5e6, 2e9
    seconds = [20e-6 + min(s, bucket) / fast + max(0, s - bucket) / rate for s in SIZES]
    fit = fit_latency_bandwidth(SIZES, seconds)
    assert fit.bandwidth_Bps == pytest.approx(rate, rel=0.02)
    assert abs(fit.rel_residuals[0]) > 0.25  # and the misfit is visible


def test_fit_flags_nonlinear_growth():
    seconds = [1e-4 + (s / 1e6) ** 2 for s in SIZES]  # quadratic in size
    fit = fit_latency_bandwidth(SIZES, seconds)
    assert max(abs(r) for r in fit.rel_residuals) > 0.25


def test_fit_of_size_independent_time_has_infinite_bandwidth():
    fit = fit_latency_bandwidth([1000, 2000, 4000], [1e-3, 1e-3, 1e-3])
    assert fit.bandwidth_Bps == float("inf")
    assert fit.latency_s == pytest.approx(1e-3)


@pytest.mark.parametrize("sizes,seconds,msg", [
    ([1, 2], [1.0], "one time per size"),
    ([4, 4, 4], [1.0, 1.0, 1.0], "two distinct"),
    ([0, 4], [1.0, 1.0], "sizes"),
    ([1, 4], [1.0, 0.0], "times"),
    ([1, 4], [1.0, float("nan")], "times"),
])
def test_fit_rejects_bad_input(sizes, seconds, msg):
    with pytest.raises(ValueError, match=msg):
        fit_latency_bandwidth(sizes, seconds)


def test_cli_sizes():
    cli = load_probe_cli()
    assert cli.parse_size("64M") == 64 << 20 and cli.parse_size("1KiB") == 1024
    assert cli.parse_size("4096") == 4096
    assert cli.message_sizes(1024, 16384, 4) == [1024, 4096, 16384]
    assert cli.message_sizes(1024, 20000, 4) == [1024, 4096, 16384]
    with pytest.raises(ValueError):
        cli.message_sizes(4096, 1024, 4)


def test_cli_rejects_bad_arguments_before_spawning(capsys):
    cli = load_probe_cli()
    for argv, msg in ((["--min-size", "64K", "--max-size", "1K"], "min size <= max size"),
                      (["--repeats", "0"], "--repeats"),
                      (["--min-size", "1X"], "bad size")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2
        assert msg in capsys.readouterr().err


def test_two_process_probe_on_loopback():
    proc = subprocess.run([sys.executable, str(PROBE), "--min-size", "1K", "--max-size", "16K",
                           "--repeats", "3", "--warmup", "1", "--min-time", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()
            if re.match(r"\s+\d+ KiB ", line)]
    assert [r[0] for r in rows] == ["1", "4", "16"]
    for count, _, median_s, mb_s, *_ in rows:
        seconds = float(median_s)
        assert 0 < seconds < 1.0
        # MB/s column is the size over the median time (rounded as printed)
        assert float(mb_s) == pytest.approx(int(count) * 1024 / seconds / 1e6, rel=0.05, abs=0.01)
    assert re.search(r"fit: latency [\d.]+ us, bandwidth (inf|[\d.]+) MB/s", proc.stdout)
    assert "time grows linearly with size:" in proc.stdout
