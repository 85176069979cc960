"""Per-example dropout: masks drawn from example ids (the same at every visit), attention
probabilities included, and a two-rank pipeline whose ids travel with the micro-batches and whose
gradients equal the unsplit model's under the same masks."""

import copy

import pytest
import torch
import torch.nn.functional as F

from dgpipe.models.encoder import build_encoder, encoder_layers, small_encoder_config
from dgpipe.models.example_dropout import ExampleDropout, example_ids, use_example_dropout
from dgpipe.pipeline import BoundarySpec, Pipeline
from helpers import assert_ranks_ok, spawn_checks

VOCAB, LENGTH = 120, 12
pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_mask_depends_on_the_example_id_only():
    drop = ExampleDropout(0.5, site=3, seed=7).train()
    x = torch.ones(4, 64, 32)
    with example_ids(torch.tensor([10, 11, 12, 13])):
        a, b = drop(x), drop(x)
    with example_ids(torch.tensor([13, 11, 12, 99])):
        c = drop(x)
    assert torch.equal(a, b)  # a revisit draws the same masks
    assert torch.equal(c[0], a[3]) and torch.equal(c[1:3], a[1:3])  # per example, not per row position
    assert not torch.equal(c[3], a[3]) and not torch.equal(a[0], a[1])
    assert set(a.unique().tolist()) == {0.0, 2.0}  # kept values scaled by 1 / (1 - p)
    assert abs(float((a > 0).float().mean()) - 0.5) < 0.02  # 8,192 draws
    other = ExampleDropout(0.5, site=4, seed=7).train()  # another site, another mask
    with example_ids(torch.tensor([10, 11, 12, 13])):
        assert not torch.equal(other(x), a)


def test_eval_and_p0_are_the_identity_and_training_needs_the_ids():
    x = torch.randn(2, 5)
    assert ExampleDropout(0.3, 0, 0).eval()(x) is x
    assert ExampleDropout(0.0, 0, 0).train()(x) is x
    with pytest.raises(RuntimeError, match="example ids"):
        ExampleDropout(0.3, 0, 0).train()(x)
    with example_ids(torch.tensor([1, 2, 3])), pytest.raises(RuntimeError, match="3 example ids for a batch of 2"):
        ExampleDropout(0.3, 0, 0).train()(x)
    with pytest.raises(ValueError, match="p must be in"):
        ExampleDropout(1.0, 0, 0)


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = small_encoder_config("bert", VOCAB, 0, max_length=LENGTH, num_labels=3, hidden_size=32, num_layers=4,
                               num_heads=2)
    return build_encoder(cfg, 3, attn_implementation="eager")


def _inputs(n=8):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, VOCAB, (n, LENGTH), generator=g)
    mask = torch.ones(n, LENGTH, dtype=torch.int64)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    ids[mask == 0] = 0
    return ids, mask


def test_a_model_s_dropouts_and_its_attention_probabilities_follow_the_ids():
    model = _model()
    plain = copy.deepcopy(model).eval()
    use_example_dropout(model, seed=5)
    sites = [m for m in model.modules() if isinstance(m, ExampleDropout)]
    assert len(sites) == 1 + 3 * 4 + 1 and [m.site for m in sites] == list(range(len(sites)))
    ids, mask = _inputs(3)
    model.eval()  # eval: the model's own forward
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits)
    model.train()
    for name, m in model.named_modules():  # only the attention probabilities' dropout left on
        if isinstance(m, ExampleDropout) and not name.endswith("attention.self.dropout"):
            m.p = 0.0
    with example_ids(torch.tensor([4, 5, 6])):
        a = model(ids, attention_mask=mask).logits
        b = model(ids, attention_mask=mask).logits
    assert torch.equal(a, b)
    assert not torch.allclose(a, plain(ids, attention_mask=mask).logits, atol=1e-4)


def run_example_dropout_pipeline(rank):
    """Two stages of a tiny BERT with per-example dropout; sample ids travel with the micro-batches
    (no delta coding), and loss and gradients equal the unsplit model's, run micro-batch by
    micro-batch under the same ids."""
    model = use_example_dropout(_model(), seed=3).train()
    ref = copy.deepcopy(model)
    layers = encoder_layers(model)
    stages = [torch.nn.Sequential(*layers[:3]), torch.nn.Sequential(*layers[3:])]
    pipe = Pipeline(stages, [0, 1], chunks=2, loss_fn=F.cross_entropy, timeout=30,
                    boundary=BoundarySpec(example_ids=100))
    inputs, y = _inputs(8), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    ids = torch.tensor([50, 3, 77, 12, 9, 41, 60, 99])
    if rank == 0:  # refused before anything is sent
        with pytest.raises(ValueError, match="needs sample_ids"):
            pipe.train_step(inputs, y)
    loss = pipe.train_step(inputs, y, sample_ids=ids)
    expected = 0.0
    for m in range(2):
        rows = slice(4 * m, 4 * m + 4)
        with example_ids(ids[rows]):
            micro = F.cross_entropy(ref(inputs[0][rows], attention_mask=inputs[1][rows]).logits, y[rows]) / 2
        micro.backward()
        expected += float(micro)
    assert abs(loss - expected) < 1e-5
    mine = {n: p for n, p in model.named_parameters() if p.grad is not None}
    assert mine  # this rank's stage has gradients, each equal to the reference's
    for name, p in mine.items():
        torch.testing.assert_close(p.grad, dict(ref.named_parameters())[name].grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def pipeline_outcome(tmp_path_factory):
    return spawn_checks({"pipeline": run_example_dropout_pipeline}, 2, tmp_path_factory.mktemp("example_dropout"))


def test_two_rank_pipeline_matches_the_unsplit_model_under_the_same_masks(pipeline_outcome):
    assert_ranks_ok(pipeline_outcome, "pipeline", 2)

