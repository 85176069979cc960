"""What a user meets first in the CLIs: --help shows each default once, argument errors are
one line plus a pointer to --help, every flag passes through torchrun's own parser, and
the console scripts are the same programs as the repository-root scripts."""

from __future__ import annotations

import re

import pytest
from torch.distributed.run import get_args_parser

from dgpipe.cli import lm, nlp, probe, vision
from helpers import load_cli

PARSERS = {"nlp": nlp.build_parser, "vision": vision.build_parser, "probe": probe.build_parser}
pytestmark = pytest.mark.usefixtures("no_torchrun")


@pytest.fixture(autouse=True)
def wide_help(monkeypatch):
    """One help line per option where it fits: argparse wraps at $COLUMNS (also inside words with hyphens)."""
    monkeypatch.setenv("COLUMNS", "1000")


def _help_entries(text: str) -> dict[str, str]:
    """--help text -> {first option string: its whole help text (wrapped lines joined)}."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^  (-{1,2}[\w-]+)", line)
        if m:
            current = m.group(1)
            entries[current] = line
        elif current and line.startswith("   "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_help_shows_each_default_once(name, capsys):
    parser = PARSERS[name]("prog")
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    entries = _help_entries(text)
    checked = 0
    for action in parser._actions:
        if not action.option_strings or action.option_strings[0] == "-h":
            continue
        entry = " ".join(entries[action.option_strings[0]].split())
        assert entry.count("default") <= 1, entry
        if not (action.default is None or action.default is False or action.default == []):
            value = action.default if not isinstance(action.default, bool) else str(action.default)
            assert f"(default: {value}" in entry, entry
            checked += 1
    assert checked >= 5
    assert "example" in text.split("options:")[-1]  # an example after the options


def test_help_defaults_of_the_flags_users_look_for(capsys):
    for build, flags in ((nlp.build_parser, {"--epochs": "1", "--seed": "0", "--task": "sst2", "--lr": "0.0001",
                                            "--batch-size": "16", "--progress": "True"}),
                         (vision.build_parser, {"--epochs": "10", "--dataset": "cifar10", "--momentum": "0.9",
                                               "--data-dir": "./data"})):
        with pytest.raises(SystemExit):
            build("prog").parse_args(["--help"])
        entries = _help_entries(capsys.readouterr().out)
        for flag, value in flags.items():
            assert f"(default: {value})" in " ".join(entries[flag].split()), (flag, entries[flag])


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "zero"], "argument --epochs: invalid int value: 'zero'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--batch-size", "10", "--chunk", "4"], "--batch-size 10 is not divisible by --chunk 4"),
    (["--compare-to", "none,bogus"], "--compare-to 'none,bogus': give distinct settings out of none,"),
    (["--sortquant", "--quant", "6", "--split", "2", "--compare-to", "sortquant8"],
     "--compare-to sortquant8: the command's own compression flags already select sortquant8"),
    (["--compare-to", "codebook4", "--mode", "dataparallel"], "--compare-to compares pipeline boundary settings"),
])
def test_argument_errors_are_one_line_and_a_pointer_to_help(argv, message, capsys):
    cli = load_cli("test_vision_dgpipe")
    with pytest.raises(SystemExit) as exc:
        cli.main(["--data-dir", "/nonexistent", *argv])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    prog = lines[0].split(": error: ")[0]
    assert prog and " " not in prog and message in lines[0]
    assert lines[1] == f"{prog}: see '{prog} --help' for the options"


@pytest.mark.parametrize("name", ["nlp", "vision"])
def test_every_flag_passes_through_torchrun(name):
    """torchrun's parser takes an abbreviation of its own options anywhere on the command line,
    so a flag of ours that is a prefix of two of its options stops torchrun before the script
    runs; the script's flags must all reach ``training_script_args``."""
    torchrun = get_args_parser()
    parser = PARSERS[name]("prog")
    blocked = []
    for action in parser._actions:
        for flag in action.option_strings:
            if flag in ("-h", "--help", "--log"):
                continue
            try:
                parsed = torchrun.parse_args(["script.py", flag, "1"])
            except SystemExit:
                blocked.append(flag)
                continue
            assert parsed.training_script_args == [flag, "1"]
    assert blocked == []


def test_the_log_flag_has_a_spelling_torchrun_leaves_alone(capsys):
    torchrun = get_args_parser()
    with pytest.raises(SystemExit):  # why --log-file exists: torchrun reads --log as its --log-dir/--logs-specs
        torchrun.parse_args(["script.py", "--log", "x.jsonl"])
    capsys.readouterr()
    args = nlp.build_parser("prog").parse_args(["--log-file", "a.jsonl"])
    assert args.log == "a.jsonl" and nlp.build_parser("prog").parse_args(["--log", "b.jsonl"]).log == "b.jsonl"


def test_console_scripts_are_the_repository_scripts():
    assert load_cli("test_nlp_dgpipe").main is nlp.main
    assert load_cli("test_vision_dgpipe").main is vision.main
    assert load_cli("test_lm_dgpipe").main is lm.main
    from importlib.metadata import PackageNotFoundError, distribution, entry_points

    try:
        distribution("dgpipe")
    except PackageNotFoundError:
        pytest.skip("dgpipe is not installed (a checkout on PYTHONPATH): no console scripts to compare")

    scripts = {e.name: e.value for e in entry_points(group="console_scripts") if e.name.startswith("dgpipe-")}
    assert scripts == {"dgpipe-nlp": "dgpipe.cli.nlp:console", "dgpipe-vision": "dgpipe.cli.vision:console",
                       "dgpipe-probe": "dgpipe.cli.probe:console", "dgpipe-sweep": "dgpipe.cli.sweep:console",
                       "dgpipe-lm": "dgpipe.cli.lm:console"}
