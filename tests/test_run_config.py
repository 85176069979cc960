"""The run config: parsed flags frozen into typed parts, the flags left as parsed, variants as new configs."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from dgpipe.compression import CodecSpec
from dgpipe.train.args import run_config
from dgpipe.train.codecs import SETTINGS
from dgpipe.train.config import RunConfig
from dgpipe.train.nlp import GlueOptions
from dgpipe.train.vision import VisionOptions
from helpers import load_cli

VISION = load_cli("test_vision_dgpipe")


def _flags(*argv: str):
    return VISION.build_parser().parse_args(list(argv))


def test_the_flags_are_read_not_changed_and_every_one_lands_in_one_part():
    flags = _flags("--partition", "linear", "--world-size", "3", "--balance", "4,4,8", "--codec", "quant",
                   "--codec-opt", "bits=8", "--compare-to", "none")
    before = copy.deepcopy(vars(flags))
    config = run_config(flags, VisionOptions, environ={})
    assert vars(flags) == before  # nothing written back into the Namespace
    assert (config.pipeline.stages, config.pipeline.balance, config.pipeline.world_size) == (3, (4, 4, 8), 3)
    assert config.codec.compression.forward == CodecSpec("quant", {"bits": 8})
    assert config.codec.compare_to == ("none",) and config.codec.codec_opt == ("bits=8",)
    flat = config.to_json()
    derived = {"stages", "balance", "world_size", "compression", "dp_compression", "compare_to"}
    assert set(flat) == set(before) | {"compression", "dp_compression"}  # one field per flag, and the specs
    for key, value in before.items():
        if key not in derived:
            assert flat[key] == value, key
    assert flat["balance"] == [4, 4, 8] and flat["compression"]["forward"] == {"name": "quant", "options": {"bits": 8}}


def test_frozen_parts_and_variants_by_replace():
    config = run_config(_flags("--sortquant", "--quant", "6", "--split", "2"), VisionOptions, environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.log.log = "x.jsonl"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.codec = None
    other = config.replace(codec={"compression": SETTINGS["none"]}, log={"log": "b.jsonl", "progress": False})
    assert other.codec.compression == SETTINGS["none"] and (other.log.log, other.log.progress) == ("b.jsonl", False)
    assert config.codec.compression == SETTINGS["sortquant8"] and config.log.log is None  # the original is unchanged
    assert other.pipeline is config.pipeline and other.data is config.data  # untouched parts are shared
    with pytest.raises(TypeError):
        config.replace(log={"no_such_field": 1})


def test_from_flags_refuses_flags_without_a_place_and_parts_without_their_flags():
    flags = vars(_flags())
    derived = {"compression": None, "dp_compression": None, "compare_to": ()}
    RunConfig.from_flags({**flags, **derived}, VisionOptions)
    with pytest.raises(TypeError, match="without a place in the run config: settings"):
        RunConfig.from_flags({**flags, **derived, "settings": "none"}, VisionOptions)
    with pytest.raises(TypeError, match="part 'job' lacks task"):  # a vision parser's flags for the GLUE job
        RunConfig.from_flags({**flags, **derived}, GlueOptions)
    with pytest.raises(TypeError, match="part 'codec' lacks compression"):
        RunConfig.from_flags({**flags, "dp_compression": None, "compare_to": ()}, VisionOptions)
