"""CodecSpec: one immutable codec description, checked where it is made, built once per use."""

import dataclasses

import pytest
import torch

import dgpipe.compression.spec as spec_module
from dgpipe.compression import CodecSpec, ErrorFeedback, get_codec
from dgpipe.pipeline.coders import codec_factory


def test_bad_specs_fail_at_construction():
    with pytest.raises(ValueError, match="unknown codec 'nope'; available: .*sortquant"):
        CodecSpec("nope")
    with pytest.raises(ValueError, match="bad options for codec 'quant'"):
        CodecSpec("quant", {"bitz": 4})
    with pytest.raises(ValueError, match="error_feedback must be true or false"):
        CodecSpec("quant", {"bits": 4, "error_feedback": "yes"})
    with pytest.raises(ValueError, match="a codec spec is a name or a"):
        CodecSpec.of(("quant", 4))


def test_a_spec_is_immutable_and_compares_by_value():
    options = {"bits": 4}
    spec = CodecSpec("quant", options)
    options["bits"] = 2  # the caller's dict is copied
    assert spec == CodecSpec.of(("quant", {"bits": 4})) != CodecSpec("quant", {"bits": 2})
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "none"
    with pytest.raises(TypeError):
        spec.options["bits"] = 8
    assert hash(spec) == hash(CodecSpec("quant", {"bits": 4}))
    assert str(spec) == "quant(bits=4)" and spec.to_json() == {"name": "quant", "options": {"bits": 4}}


def test_build_makes_fresh_instances_with_their_own_feedback_state():
    spec = CodecSpec("quant", {"bits": 2, "error_feedback": True})
    a, b = spec.build(), spec.build()
    assert isinstance(a, ErrorFeedback) and a is not b and a.codec.bits == 2
    x = torch.randn(64)
    a.encode(x)
    # b has no residual yet: its first payload is the plain codec's
    assert torch.equal(b.encode(x).tensors[0], get_codec("quant", bits=2).encode(x).tensors[0])
    assert not isinstance(spec.build(error_feedback=False), ErrorFeedback)
    assert spec.build(bits=8).codec.bits == 8


def test_checked_once_at_construction_then_once_per_instance(monkeypatch):
    """The Pipeline API takes the spec as it is: no extra build to check it."""
    calls = []
    real = spec_module.get_codec
    monkeypatch.setattr(spec_module, "get_codec", lambda name, **kw: calls.append(name) or real(name, **kw))
    spec = CodecSpec("sortquant", {"quant_bits": 6, "split_bits": 2})
    assert calls == ["sortquant"]
    factory = codec_factory(spec)
    assert calls == ["sortquant"]
    factory(), factory()
    assert calls == ["sortquant"] * 3


def test_a_spec_survives_pickling_to_spawned_processes():
    import pickle

    spec = CodecSpec("quant", {"bits": 4, "error_feedback": True})
    again = pickle.loads(pickle.dumps(spec))
    assert again == spec and dict(again.options) == {"bits": 4, "error_feedback": True}
