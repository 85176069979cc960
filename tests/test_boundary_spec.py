"""BoundarySpec: the boundaries' options checked once when the spec is made, against the pipeline when it is built,
and the row mask named by its position (a value without it there is refused before anything is sent)."""

import pytest
import torch
import torch.nn.functional as F

from dgpipe.comm import BandwidthMeter
from dgpipe.compression import DeltaSpec, get_codec
from dgpipe.compression.wrappers.reference import TokenReference
from dgpipe.pipeline import BoundarySpec, Pipeline
from dgpipe.pipeline.boundary import Boundary


@pytest.mark.parametrize("options, message", [
    ({"compress_eval": 1}, "compress_eval must be a bool"),
    ({"delta": 5}, "delta must be a DeltaSpec, got int"),
    ({"example_ids": 0}, "example_ids .* must be a positive int, got 0"),
    ({"example_ids": True}, "example_ids .* must be a positive int, got True"),
    ({"delta": DeltaSpec(8), "example_ids": 9}, "example_ids=9 but the delta spec caches 8 examples"),
    ({"row_mask": -1}, r"row_mask must be a tuple position \(an int >= 0\), got -1"),
    ({"row_mask": "1"}, "row_mask must be a tuple position"),
    ({"token_reference": 50}, "token_reference must be a TokenReference, got int"),
    ({"token_reference": TokenReference(50), "row_mask": 1}, "not with delta or row_mask"),
    ({"token_reference": TokenReference(50), "delta": DeltaSpec(8)}, "not with delta or row_mask"),
    ({"link_delay": -0.1}, "link_delay must be >= 0 seconds, got -0.1"),
    ({"link_delay": float("nan")}, "link_delay must be >= 0 seconds"),
])
def test_a_bad_spec_is_refused_when_made(options, message):
    with pytest.raises(ValueError, match=message):
        BoundarySpec(**options)


def test_the_spec_is_frozen_and_gives_the_ids_range():
    spec = BoundarySpec(delta=DeltaSpec(8))
    assert spec.id_examples == 8 and BoundarySpec(example_ids=5).id_examples == 5 and BoundarySpec().id_examples is None
    with pytest.raises(AttributeError):
        spec.row_mask = 1  # type: ignore[misc]


def test_the_pipeline_checks_the_spec_against_its_boundaries():
    stages = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    with pytest.raises(ValueError, match=r"delta boundaries \(2,\): there are 2 boundaries"):
        Pipeline(stages, [0, 0, 0], loss_fn=F.cross_entropy, boundary=BoundarySpec(delta=DeltaSpec(8, boundaries=(2,))))
    with pytest.raises(ValueError, match="boundary must be a BoundarySpec, got dict"):
        Pipeline(stages, [0, 0, 0], loss_fn=F.cross_entropy, boundary={"row_mask": 1})


def _sender(row_mask):
    codec = lambda: get_codec("none")  # noqa: E731
    return Boundary(0, 0, 1, codec, codec, BandwidthMeter(), torch.device("cpu"), 5.0, rank=0, report=None,
                    spec=BoundarySpec(row_mask=row_mask))


@pytest.mark.parametrize("value, message", [
    ((torch.randn(2, 5, 4), torch.ones(2, 5, dtype=torch.long)), "row_mask is position 2, but the value holds 2"),
    ((torch.randn(2, 5, 4), torch.ones(2, 5), torch.ones(2, 5)), r"row_mask position 2 holds a torch.float32 \(2, 5\) tensor"),
    ((torch.randn(2, 5, 4), torch.ones(2, 5), torch.ones(2, 5, 1, dtype=torch.long)), r"row_mask position 2 holds a torch.int64 \(2, 5, 1\) tensor, not an integer \(B, L\) mask"),
    ((torch.randn(2, 6, 4), torch.ones(2, 5), torch.ones(2, 5, dtype=torch.long)),
     r"no floating tensor of the value has the row mask's \(B, L\) = \(2, 5\)"),
])
def test_a_value_without_the_named_row_mask_is_refused_before_it_is_sent(value, message):
    """No process group exists here: the check comes before anything would touch the wire."""
    with pytest.raises(ValueError, match="stage0->stage1: " + message):
        _sender(2).send_forward(0, value, 1, "eval")
