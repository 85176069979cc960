"""Encoder layer lists (tiny random RoBERTa and BERT): composition equals the model's forward,
the integer attention mask travels unchanged, client/server cut."""

import pytest
import torch
from torch import nn

from dgpipe.models.encoder import build_encoder, encoder_layers, small_encoder_config
from dgpipe.models.split import client_server_split

VOCAB, LENGTH = 120, 12
pytestmark = pytest.mark.usefixtures("one_thread")


def _model(family, attn="sdpa", num_labels=3):
    torch.manual_seed(0)
    pad = 1 if family == "roberta" else 0  # RoBERTa's usual pad id; positions count after it
    cfg = small_encoder_config(family, VOCAB, pad, max_length=LENGTH, num_labels=num_labels, hidden_size=32,
                               num_layers=4, num_heads=2)
    return build_encoder(cfg, num_labels, attn_implementation=attn)


def _inputs(model, with_types):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, VOCAB, (3, LENGTH), generator=g)
    mask = torch.ones(3, LENGTH, dtype=torch.int64)
    mask[1, 7:] = 0  # padded example
    mask[2, 3:] = 0
    ids[mask == 0] = model.config.pad_token_id
    inputs = (ids, mask)
    if with_types:
        types = torch.zeros_like(ids)
        types[:, 4:] = 1
        inputs += (types * mask,)
    return inputs


def _compose(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def _reference(model, inputs):
    kwargs = {"attention_mask": inputs[1]}
    if len(inputs) == 3:
        kwargs["token_type_ids"] = inputs[2]
    return model(inputs[0], **kwargs).logits


@pytest.mark.parametrize("family", ["roberta", "bert"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_eval_composition_equals_forward(family, attn):
    model = _model(family, attn).eval()
    assert model.config._attn_implementation == attn
    layers = encoder_layers(model)
    assert len(layers) == 6  # embeddings, 4 encoder layers, head
    inputs = _inputs(model, with_types=family == "bert")
    with torch.no_grad():
        ref = _reference(model, inputs)
        out = _compose(layers, inputs)
        unpadded = _compose(layers, inputs[:1] + (torch.ones_like(inputs[1]),) + inputs[2:])
    assert ref.shape == (3, 3)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    assert not torch.allclose(unpadded[1:], ref[1:], atol=1e-4)  # the mask really is applied


@pytest.mark.parametrize("family", ["roberta", "bert"])
def test_train_mode_gradients_equal(family):
    model = _model(family).train()  # dropout on: both runs draw the same masks from the same seed
    inputs = _inputs(model, with_types=False)
    y = torch.tensor([0, 2, 1])
    grads = []
    for run in ("model", "layers"):
        model.zero_grad()
        torch.manual_seed(3)
        logits = _reference(model, inputs) if run == "model" else _compose(encoder_layers(model), inputs)
        nn.functional.cross_entropy(logits, y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


def test_mask_travels_unchanged():
    model = _model("roberta").eval()
    ids, mask = _inputs(model, with_types=False)
    x = (ids, mask)
    for layer in encoder_layers(model)[:-1]:
        x = layer(x)
        assert isinstance(x, tuple) and len(x) == 2
        assert x[1] is mask and x[1].dtype == torch.int64  # not a float bias
        assert x[0].dtype == torch.float32 and x[0].shape == (3, LENGTH, 32)


@pytest.mark.parametrize("family", ["roberta", "bert"])
def test_client_server_split(family):
    model = _model(family).eval()
    layers = encoder_layers(model)
    stages = client_server_split(layers, client_layers=1, always_client=(1, 1))
    assert [len(s) for s in stages] == [2, 2, 2]  # embeddings+L1 | L2 L3 | L4+head
    inputs = _inputs(model, with_types=False)
    with torch.no_grad():
        boundary = stages[0](inputs)
        assert boundary[1] is inputs[1]
        out = stages[2](stages[1](*boundary))  # a stage also takes the tuple's items as arguments
        torch.testing.assert_close(out, _reference(model, inputs), rtol=0, atol=1e-6)
    assert [len(s) for s in client_server_split(layers, 0, always_client=(1, 1))] == [1, 4, 1]
    with pytest.raises(ValueError, match=r"client_layers in \[0, 1\]"):
        client_server_split(layers, 2, always_client=(1, 1))


def test_regression_head_and_errors():
    model = _model("bert", num_labels=1).eval()
    inputs = _inputs(model, with_types=True)
    with torch.no_grad():
        assert _compose(encoder_layers(model), inputs).shape == (3, 1)
    with pytest.raises(ValueError, match="not a BERT/RoBERTa-family"):
        encoder_layers(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="tuple"):
        encoder_layers(model)[0](inputs[0])
    with pytest.raises(ValueError, match="unknown encoder family"):
        small_encoder_config("gpt2", VOCAB, 0)


@pytest.mark.parametrize("family", ["roberta", "bert"])
def test_split_with_detached_boundaries_gives_unsplit_gradients(family):
    """Each stage runs on boundary leaves (as after a receive); gradients sent back by hand."""
    model = _model(family).train()
    inputs, y = _inputs(model, with_types=family == "bert"), torch.tensor([2, 0, 1])
    torch.manual_seed(9)
    nn.functional.cross_entropy(_reference(model, inputs), y).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    torch.manual_seed(9)
    stages = client_server_split(encoder_layers(model), client_layers=1, always_client=(1, 1))
    received, sent, x = [], [], inputs
    for stage in stages:
        if stage is not stages[0]:
            x = (x[0].detach().requires_grad_(), x[1])  # hidden states: a leaf; the mask: as is
        received.append(x)
        x = stage(x)
        sent.append(x)
    nn.functional.cross_entropy(sent[-1], y).backward()
    for i in (1, 0):
        sent[i][0].backward(received[i + 1][0].grad)
    for name, grad in expected.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-5, atol=1e-7, msg=name)


def test_half_precision_checkpoint_loads_as_float32_master_weights(tmp_path):
    model = _model("bert").half()
    model.save_pretrained(tmp_path)
    loaded = build_encoder(str(tmp_path), 3)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p.float(), q), name  # the float16 values, exactly
    assert {p.dtype for p in build_encoder(str(tmp_path), 3, dtype=torch.float16).parameters()} == {torch.float16}
