"""A run's checkpoint out as a Hugging Face model (``dgpipe-lm export``) and back into split generation
(``dgpipe-lm generate --checkpoint``).

For every supported family, a tiny model (LoRA adapters on the rotary families, every weight on GPT-2 with its tied
embeddings; bf16 on one of them) trained 2 steps client/server uncompressed with ``--save``, exported: transformers'
``AutoModelForCausalLM.from_pretrained`` loads the folder and its held-out loss on the run's evaluation blocks,
computed here with transformers alone, equals the run's last validation loss; the adapter folder
(``--adapter-only``) on the base weights gives the merged model's logits. Split generation from the checkpoint,
uncompressed, prints transformers' greedy tokens of the exported folder. Bad input: a non-empty folder, an
incomplete checkpoint, a run without adapters for ``--adapter-only``, a run with bottlenecks -- one line each.
"""

from __future__ import annotations

import io
import json
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dgpipe.cli import export as export_cli
from dgpipe.cli import generate
from dgpipe.train.lm import lm_tokenizer, token_blocks
from dgpipe.train.runlog import read_summary
from helpers import ROOT, corpus_slice, load_cli, one_line_error

WIKI = ROOT.parent / "shared" / "data" / "text" / "wiki-excerpt"
LM = load_cli("test_lm_dgpipe")
pytestmark = [pytest.mark.usefixtures("no_torchrun"),
              pytest.mark.skipif(not WIKI.is_dir(), reason=f"real text corpus not found at {WIKI}")]
peft = pytest.importorskip("peft", reason="needs peft (pip install -e .)")

BLOCK, EVAL = 32, 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return corpus_slice(WIKI, tmp_path_factory.mktemp("wiki"), {"train": 20_000, "valid": 6_000, "test": 6_000})


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """Trained and saved runs by preset: ``(checkpoint folder, log)``."""
    cache = tmp_path_factory.mktemp("cache")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DGPIPE_CACHE", str(cache))
        for preset, extra in (("tiny-llama", ["--lora", "4", "--precision", "bf16"]), ("tiny-qwen2", ["--lora", "4"]),
                              ("tiny-qwen3", ["--lora", "4"]), ("tiny-gemma3", ["--lora", "4"]), ("tiny-gpt2", [])):
            folder = tmp_path_factory.mktemp(preset)
            code = LM.main(["--data-dir", str(corpus), "--model-config", preset, "--tokenizer", "bpe:400",
                            "--block-length", str(BLOCK), "--batch-size", "4", "--chunk", "2", "--max-steps", "2",
                            "--eval-subset", str(EVAL), "--lr", "1e-2", "--num-workers", "0", "--no-progress",
                            "--save", str(folder / "ckpt"), "--log-file", str(folder / "run.jsonl"), *extra])
            assert code == 0
            out[preset] = (folder / "ckpt", folder / "run.jsonl")
        yield out, cache


def _held_out_loss(model, run_args: dict, tokenizer) -> float:
    """The mean token NLL of the run's evaluation blocks, with transformers' forward alone."""
    blocks = token_blocks(run_args["data_dir"], run_args["eval_split"], tokenizer, BLOCK, EVAL)
    x = torch.stack([blocks[i][0] for i in range(len(blocks))])
    y = torch.stack([blocks[i][1] for i in range(len(blocks))])
    with torch.no_grad():
        logits = model(x).logits
    return float(F.cross_entropy(logits.flatten(0, 1), y.flatten()))


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gpt2"])
def test_exported_model_scores_the_runs_validation_loss(runs, preset, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done, cache = runs
    ckpt, log = done[preset]
    monkeypatch.setenv("DGPIPE_CACHE", str(cache))
    assert export_cli.main([str(ckpt), str(tmp_path / "hf")]) == 0
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= \
        {p.name for p in (tmp_path / "hf").iterdir()}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    summary = read_summary(log)
    args = json.loads((ckpt / "step-00000002" / "meta.json").read_text())["args"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.get_vocab() == lm_tokenizer(_opts(args), args["data_dir"]).get_vocab()
    loss = _held_out_loss(model, args, tokenizer)
    tolerance = 2e-2 if args["precision"] == "bf16" else 1e-5  # the run evaluated under bf16 autocast
    assert loss == pytest.approx(summary["value"], rel=tolerance)
    if preset == "tiny-gpt2":
        assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # still tied


def _opts(args):
    from dgpipe.train.export import LMOptions
    import dataclasses

    return LMOptions(**{f.name: args[f.name] for f in dataclasses.fields(LMOptions)})


def test_adapter_folder_on_the_base_weights_gives_the_merged_logits(runs, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    (ckpt, _), cache = runs[0]["tiny-qwen2"], runs[1]
    monkeypatch.setenv("DGPIPE_CACHE", str(cache))
    assert export_cli.main([str(ckpt), str(tmp_path / "merged")]) == 0
    assert export_cli.main([str(ckpt), str(tmp_path / "adapter"), "--adapter-only"]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    from dgpipe.train.export import load_run

    base = load_run(str(ckpt)).model  # the run's weights with the adapters: strip them to the base weights
    plain = AutoModelForCausalLM.from_config(base.config)
    plain.load_state_dict({k.replace(".base_layer", ""): v for k, v in base.state_dict().items() if "lora_" not in k})
    adapted = peft.PeftModel.from_pretrained(plain, tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, merged(ids).logits, rtol=1e-4, atol=1e-5)


def test_generate_from_the_checkpoint_prints_transformers_greedy_tokens(runs, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt, cache = runs[0]["tiny-gemma3"][0], runs[1]
    monkeypatch.setenv("DGPIPE_CACHE", str(cache))
    assert export_cli.main([str(ckpt), str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompt = "The history of the"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    want = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id or 0)
    text = tokenizer.decode(want[0, ids.shape[1]:], skip_special_tokens=True)
    out = io.StringIO()
    with redirect_stdout(out):
        assert generate.main(["--checkpoint", str(ckpt), "--prompt", prompt, "--max-new-tokens", "12",
                              "--world-size", "1"]) == 0
    assert f"--- {prompt!r}\n{text}\n" in out.getvalue()


def _export_error(argv, capsys) -> str:
    return one_line_error(export_cli.main, argv, capsys)


def test_export_refusals(runs, tmp_path, capsys, monkeypatch):
    (gpt2, _), cache = runs[0]["tiny-gpt2"], runs[1]
    monkeypatch.setenv("DGPIPE_CACHE", str(cache))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert "exists and is not empty" in _export_error([str(gpt2), str(tmp_path / "full")], capsys)
    assert "trained no LoRA adapters" in _export_error([str(gpt2), str(tmp_path / "a"), "--adapter-only"], capsys)
    assert "no checkpoint" in _export_error([str(tmp_path / "nothing"), str(tmp_path / "b")], capsys)
    broken = tmp_path / "broken"
    shutil.copytree(gpt2, broken)
    for step in broken.iterdir():
        (step / "rank1.pt").write_bytes(b"truncated")
    err = _export_error([str(broken), str(tmp_path / "c")], capsys)
    assert "no complete checkpoint" in err and "step 2" in err and "rank1.pt" in err
    meta = next(broken.iterdir()) / "meta.json"
    args = json.loads(meta.read_text())
    args["args"]["bottleneck"] = "8"
    meta.write_text(json.dumps(args))
    shutil.copy(gpt2 / "step-00000002" / "rank1.pt", next(broken.iterdir()) / "rank1.pt")
    assert "boundary bottlenecks" in _export_error([str(broken), str(tmp_path / "d")], capsys)


def test_weights_read_from_gguf_are_saved_as_a_plain_model(tmp_path):
    """transformers marks a model it de-quantized from a GGUF file as quantized and refuses to save it; the export
    saves the same weights from a model built without the GGUF record."""
    from transformers import AutoModelForCausalLM

    from dgpipe.models.causal_lm import build_causal_lm, preset_config
    from dgpipe.train.export import _plain

    torch.manual_seed(0)
    model = build_causal_lm(preset_config("tiny-llama", 97, 16))
    assert _plain(model) is model
    model.hf_quantizer = object()
    model.config.quantization_config = {"quant_method": "gguf"}
    plain = _plain(model)
    assert getattr(plain, "hf_quantizer", None) is None and not hasattr(plain.config, "quantization_config")
    plain.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)
