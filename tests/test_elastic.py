"""A rank killed under ``torchrun --max-restarts`` costs the steps since the last checkpoint, not the run.

Two real torchrun runs of the language-model job (tiny Llama, client/server on two ranks,
checkpoints every 10 steps, ``--resume auto``): uninterrupted, and with the server SIGKILLed
after step 25. The second ends with exit status 0 after one restart that resumed from a step
checkpoint, and its step losses, final validation loss and both ranks' final weights and
optimizer state equal the uninterrupted run's to the bit (``benchmarks/faults.py`` does the
same with 5 kills and stalls in 200 steps).
"""

import os
from pathlib import Path

import pytest

from helpers import load_benchmark

faults = load_benchmark("faults")

pytestmark = [
    pytest.mark.usefixtures("no_torchrun"),
    pytest.mark.skipif(not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(),
                       reason="finding torchrun's workers needs Linux's /proc/<pid>/task/<tid>/children"),
    pytest.mark.skipif(not faults.WIKI.is_dir(), reason=f"wiki-excerpt not found at {faults.WIKI}"),
]


def test_killed_server_is_restarted_and_the_run_ends_as_an_uninterrupted_one(tmp_path):
    data = faults.corpus(tmp_path / "wiki")
    clean = faults.run(tmp_path, "clean", data, 60, 10, [], timeout=30.0)
    faulted = faults.run(tmp_path, "faulted", data, 60, 10, [(25, "kill", 1)], timeout=30.0)
    for run in (clean, faulted):  # the log of a run that failed, to see why
        assert run["returncode"] == 0, (tmp_path / f"{run['name']}.out").read_text()[-3000:]
    assert [f["kind"] for f in faulted["faults"]] == ["kill"]
    result = faults.compare(clean, faulted, 60)
    assert result["restarts"] == [1]
    seen = faulted["faults"][0]["seen"]
    assert result["resumed_at"][0] % 10 == 0 and 20 <= result["resumed_at"][0] <= seen
    assert result["step_losses_equal"] and result["val_loss_equal"] and result["final_state_equal"]
    assert result["step_records"] == 60 + result["repeated_steps"] > 60  # the repeated steps logged twice
    assert "resumed at step" in (tmp_path / "faulted.out").read_text()
