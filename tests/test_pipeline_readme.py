"""The README's "Pipeline API" example runs: its ``main`` trains a client/server pipeline
with sortquant boundaries and prints the loss and the metered traffic; so does docs/pipeline-api.md's example
under torch's 1F1B schedule.

The example's code is taken from README.md verbatim; only its ``spawn`` entry point is
replaced by one that forks (the ranks inherit the imported torch, which keeps the test
fast). The example as written (``python example.py``) was run by hand, too.
"""

import re
from pathlib import Path

import pytest

from dgpipe.compression import available_codecs
from dgpipe.pipeline import spawn

README = Path(__file__).resolve().parents[1] / "README.md"
PIPELINE_API = README.parent / "docs" / "pipeline-api.md"


def example_code():
    text = README.read_text()
    section = text[text.index("## Pipeline API") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.skipif("sortquant" not in available_codecs(), reason="sortquant not registered yet")
def test_readme_pipeline_example_runs(capfd):
    namespace = {"__name__": "readme_example"}
    exec(compile(example_code(), str(README), "exec"), namespace)  # defines make_model and main
    spawn(namespace["main"], 2, timeout=120, start_method="fork")
    out = capfd.readouterr().out
    losses = [float(v) for v in re.findall(r"step \d+: loss ([\d.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    ratios = re.findall(r"(stage\d->stage\d) +(forward|backward) +raw (\d+) B, wire (\d+) B, ratio ([\d.]+)", out)
    assert sorted((n, d) for n, d, *_ in ratios) == [
        ("stage0->stage1", "backward"), ("stage0->stage1", "forward"),
        ("stage1->stage2", "backward"), ("stage1->stage2", "forward"),
    ]  # fmt: skip
    for *_, raw, wire, ratio in ratios:
        assert int(raw) == 30 * 4 * 64 * 64 * 4  # steps x micro-batches x float32[64, 64]
        assert 0.25 < float(ratio) < 0.27  # 8 of 32 bits, plus headers and bucket parameters


def test_readme_torch_schedule_example_runs(capfd):
    """docs/pipeline-api.md's torch-schedule example: losses fall, each direction at its own bits."""
    text = PIPELINE_API.read_text()
    section = text[text.index("## torch's schedules: `CompressedPipelineStage`") :]
    namespace = {"__name__": "readme_torch_example"}
    exec(compile(re.search(r"```python\n(.*?)```", section, re.S).group(1), str(PIPELINE_API), "exec"), namespace)
    spawn(namespace["main"], 2, timeout=120, start_method="fork")
    out = capfd.readouterr().out
    losses = [float(v) for v in re.findall(r"step \d+: loss ([\d.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    sent = {d: (int(raw), int(wire)) for d, raw, wire in re.findall(r"sent (\w+) +raw (\d+) B, wire (\d+) B", out)}
    raw = 30 * 4 * 64 * 64 * 4  # steps x micro-batches x float32[64, 64]
    assert sent["forward"][0] == sent["backward"][0] == raw
    assert 4 / 32 < sent["forward"][1] / raw < 4.5 / 32 and 8 / 32 < sent["backward"][1] / raw < 8.5 / 32
