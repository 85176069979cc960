"""MobileNetV2 layer list: its composition is the model's forward; client/server cut."""

import pytest
import torch
from torch import nn

from dgpipe.models.mobilenet import build_mobilenet, mobilenet_layers
from dgpipe.models.split import Stage, client_server_split


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_mobilenet(10, depth_multiplier=0.35, image_size=32, classifier_dropout_prob=0.3)
    with torch.no_grad():  # give the batch norms real running statistics
        for _ in range(3):
            m(torch.randn(8, 3, 32, 32))
    return m


def _compose(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def test_layer_list_structure(model):
    layers = mobilenet_layers(model)
    assert len(layers) == 20  # stem, 16 inverted-residual blocks, 1x1 conv, pool+flatten, classifier
    assert layers[0] is model.mobilenet_v2.conv_stem and layers[17] is model.mobilenet_v2.conv_1x1
    shared = {id(p) for layer in layers for p in layer.parameters()}
    assert shared == {id(p) for p in model.parameters()}  # the layers are the model's parameters


def test_eval_composition_equals_forward(model):
    model.train()
    layers = mobilenet_layers(model)
    model.eval()  # the layers follow the model's mode (dropout included)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        ref = model(x).logits
        out = _compose(layers, x)
    assert ref.abs().mean() > 1e-2  # not a vanishing signal
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    assert model(torch.randn(2, 3, 64, 64)).logits.shape == (2, 10)


def test_train_mode_gradients_equal(model):
    model.train()
    x = torch.randn(4, 3, 32, 32)
    y = torch.tensor([1, 2, 3, 4])
    grads = []
    for run in ("model", "layers"):
        model.zero_grad()
        torch.manual_seed(7)  # same dropout mask in both runs
        logits = model(x).logits if run == "model" else _compose(mobilenet_layers(model), x)
        nn.functional.cross_entropy(logits, y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in grads[0])


def test_client_server_split(model):
    model.eval()
    layers = mobilenet_layers(model)
    stages = client_server_split(layers, client_layers=2)
    assert [len(s) for s in stages] == [2, 16, 2] and all(isinstance(s, Stage) for s in stages)
    whole = Stage(*layers).state_dict()
    parts = {k: v for s in stages for k, v in s.state_dict().items()}
    assert parts.keys() == whole.keys() and all(parts[k] is whole[k] or torch.equal(parts[k], whole[k]) for k in whole)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(stages[2](stages[1](stages[0](x))), model(x).logits, rtol=0, atol=1e-6)
    assert [len(s) for s in client_server_split(layers, 9)] == [9, 2, 9]
    with pytest.raises(ValueError, match=r"client_layers in \[1, 9\]"):
        client_server_split(layers, 10)
    with pytest.raises(ValueError, match="non-empty"):
        client_server_split(layers, 0)


def test_random_init_scale():
    torch.manual_seed(0)
    m = build_mobilenet(10, depth_multiplier=0.35)
    stem = m.mobilenet_v2.conv_stem.first_conv.convolution.weight  # 3x3, 8 out channels, fan_out 72
    assert stem.std().item() == pytest.approx((2 / 72) ** 0.5, rel=0.3)
    assert m.classifier.bias.abs().sum() == 0


def test_pretrained_replaces_classifier(tmp_path):
    torch.manual_seed(0)
    source = build_mobilenet(5, depth_multiplier=0.35)
    source.save_pretrained(tmp_path)
    loaded = build_mobilenet(10, pretrained=str(tmp_path))
    assert loaded.classifier.out_features == 10 and loaded.config.num_labels == 10
    torch.testing.assert_close(
        loaded.mobilenet_v2.conv_1x1.convolution.weight, source.mobilenet_v2.conv_1x1.convolution.weight
    )
    with pytest.raises(ValueError, match="pretrained"):
        build_mobilenet(10, pretrained=str(tmp_path), depth_multiplier=0.5)
    with pytest.raises(ValueError, match="expected a MobileNetV2ForImageClassification"):
        mobilenet_layers(nn.Linear(2, 2))


def test_split_with_detached_boundaries_gives_unsplit_gradients(model):
    """Each stage runs on a boundary leaf (as after a receive); gradients sent back by hand."""
    model.train()
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    model.zero_grad()
    torch.manual_seed(5)
    nn.functional.cross_entropy(model(x).logits, y).backward()
    expected = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    torch.manual_seed(5)
    stages = client_server_split(mobilenet_layers(model), client_layers=3)
    outputs, inputs, h = [], [], x
    for stage in stages:
        h = h.detach().requires_grad_(h is not x)  # a received tensor is a leaf
        inputs.append(h)
        outputs.append(stage(h))
        h = outputs[-1]
    nn.functional.cross_entropy(outputs[-1], y).backward()
    for i in (1, 0):
        outputs[i].backward(inputs[i + 1].grad)
    for a, b in zip(expected, (p.grad for p in model.parameters())):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
