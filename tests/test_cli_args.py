"""Argument validation of the main-job CLIs and the compression-flag -> codec mapping.

Every error must stop the CLI (exit status 2, argparse style) before any process
starts, with a message that says what to change. The CLIs are loaded from the repo
root by path and run in-process; nothing here spawns a rank.
"""

from pathlib import Path

import pytest

from dgpipe.train import args as targs
from dgpipe.train import placement
from dgpipe.train import loop, vision
from dgpipe.compression import ErrorFeedback
from dgpipe.baseline import GradCompression
from dgpipe.compression import CodecSpec
from dgpipe.train.codecs import parse_options
from helpers import load_cli

RTE_ROWS = [("The cat sat on the mat.", "A cat sat.", "entailment"), ("It rained.", "It was dry.", "not_entailment")]


VISION = load_cli("test_vision_dgpipe")
NLP = load_cli("test_nlp_dgpipe")
pytestmark = pytest.mark.usefixtures("no_torchrun")


@pytest.fixture(scope="module")
def cifar(tmp_path_factory) -> Path:
    """A CIFAR-10-shaped image folder: 10 classes, 2 train and 1 test image each."""
    from PIL import Image

    root = tmp_path_factory.mktemp("cifar")
    for split, count in (("train", 2), ("test", 1)):
        for c in range(10):
            (root / split / f"c{c}").mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (32, 32), (c * 20, i * 50, 0)).save(root / split / f"c{c}" / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def glue(tmp_path_factory) -> Path:
    """A GLUE folder with a 4-row RTE train split and a 2-row dev split."""
    root = tmp_path_factory.mktemp("glue")
    (root / "RTE").mkdir()
    for split, rows in (("train", RTE_ROWS * 2), ("dev", RTE_ROWS)):
        lines = ["index\tsentence1\tsentence2\tlabel"] + [f"{i}\t{a}\t{b}\t{y}" for i, (a, b, y) in enumerate(rows)]
        (root / "RTE" / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def _error(cli, argv, capsys) -> str:
    """Run the CLI, expect an argument error; return its message."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def _validated(argv, cli=VISION):
    """The run config of ``argv`` (the shared checks; the job's own are not run)."""
    from dgpipe.train.vision import VisionOptions
    from dgpipe.train.nlp import GlueOptions

    options = VisionOptions if cli is VISION else GlueOptions
    return targs.run_config(cli.build_parser().parse_args(argv), options, environ={})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sortquant", "--quant", "12", "--split", "6"], "18 bits per value is more than 16"),
        (["--quant", "17"], "17 bits per value is more than 16"),
        (["--grad-quant", "9", "--grad-split", "8", "--sortquant", "--quant", "6", "--split", "2"],
         "--grad-quant 9 --grad-split 8: 17 bits"),
        (["--batch-size", "10", "--chunk", "4"], "--batch-size 10 is not divisible by --chunk 4; use e.g. --batch-size 8"),
        (["--batch-size", "2", "--chunk", "4"], "--chunk 4 micro-batches is more than --batch-size 2"),
        (["--codec", "nope"], "--codec: unknown codec 'nope'; available: "),
        (["--codec", "quant", "--codec-opt", "bits=0"], "--codec quant(bits=0): quant: bits must be an int in [1, 16]"),
        (["--codec", "fp16", "--codec-opt", "ratio"], "--codec-opt 'ratio': write KEY=VALUE"),
        (["--sortquant", "--quant", "6"], "--sortquant needs --quant Q and --split S"),
        (["--quant", "6", "--split", "2"], "--split is the bucket bits of sort quantization: add --sortquant"),
        (["--codec", "fp16", "--quant", "8"], "--codec replaces --sortquant/--quant/--split"),
        (["--grad-compression", "fp16"], "--grad-compression compresses the DDP gradient exchange: add --mode dataparallel"),
        (["--mode", "dataparallel", "--sortquant", "--quant", "6", "--split", "2"],
         "--sortquant, --quant, --split compress pipeline boundaries; in --mode dataparallel use --grad-compression"),
        (["--mode", "dataparallel", "--grad-compression", "zip"], "unknown grad compression 'zip'"),
        (["--mode", "dataparallel", "--batch-size", "9"], "--batch-size 9 is not divisible by --world-size 2"),
        (["--world-size", "3"], "client-server runs on exactly 2 processes, not 3"),
        (["--partition", "linear", "--stages", "3", "--balance", "5,5"], "--balance lists 2 stages but --stages is 3"),
        (["--train-subset", "100", "--batch-size", "128"], "--train-subset 100 is smaller than one batch"),
        (["--devices", "cpu,cpu,cpu"], "--devices lists 3 devices for 2 processes"),
        (["--epochs", "0"], "--epochs must be positive, got 0"),
        (["--codec", "quant", "--codec-opt", "error_feedback=true"],
         "--codec-opt error_feedback: error feedback carries a gradient's residual"),
        (["--grad-codec", "quant", "--grad-codec-opt", "error_feedback=2"],
         "--grad-codec quant(error_feedback=2): error_feedback must be true or false, got 2"),
        (["--mode", "dataparallel", "--delta"], "--delta codes pipeline boundaries; it has no meaning in --mode"),
        (["--delta-warmup-epochs", "1"], "--delta-warmup-epochs configure --delta; add --delta"),
        (["--delta", "--delta-warmup-epochs", "-1"], "--delta-warmup-epochs must be >= 0, got -1"),
        (["--delta", "--delta-cache-limit", "0"], "--delta-cache-limit must be a positive number of GiB"),
        (["--delta", "--delta-cache-dir", "/dev/null/caches"], "--delta-cache-dir /dev/null/caches: cannot create files"),
        (["--mode", "dataparallel", "--example-dropout"], "--example-dropout sends sample ids along the pipeline"),
        (["--example-dropout", "--engine", "torch", "--partition", "linear"],
         "--example-dropout needs the examples' ids at every boundary, which torch's schedules do not pass"),
        (["--example-dropout"], "--example-dropout is for the nlp job's encoders"),
        (["--mode", "dataparallel", "--skip-padding"], "--skip-padding works on pipeline boundaries; use --mode pipeline"),
        (["--skip-padding", "--engine", "torch", "--partition", "linear"],
         "--skip-padding is dgpipe's runtime (its boundaries carry the attention mask and token ids): use --engine "
         "dgpipe"),
        (["--skip-padding"], "--skip-padding is for the nlp job's encoders"),
        (["--token-reference", "--delta"], "--token-reference does not combine with --delta (it codes whole tensors"),
        (["--token-reference", "--skip-padding"], "--token-reference does not combine with --skip-padding"),
        (["--mode", "dataparallel", "--token-reference"], "--token-reference works on pipeline boundaries; use --mode"),
        (["--token-reference-scale"], "--token-reference-scale is an option of --token-reference: add"),
        (["--token-reference-backoff"], "--token-reference-backoff is an option of --token-reference: add"),
        (["--token-reference", "--engine", "torch", "--partition", "linear"],
         "--token-reference is dgpipe's runtime (its boundaries carry the attention mask and token ids)"),
        (["--token-reference"], "--token-reference is for the nlp job's encoders"),
    ],
)
def test_common_flag_errors(argv, message, cifar, capsys):
    assert message in _error(VISION, ["--data-dir", str(cifar), *argv], capsys)


def test_errors_come_before_any_process(monkeypatch, cifar, capsys):
    def no_spawn(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(loop, "run", no_spawn)
    _error(VISION, ["--data-dir", str(cifar), "--batch-size", "6", "--chunk", "4"], capsys)
    _error(VISION, ["--data-dir", str(cifar), "--eval-subset", "11", "--batch-size", "4"], capsys)


def test_missing_data_names_the_paths_tried_and_downloads_nothing(tmp_path, monkeypatch, capsys):
    def no_download(name, data_dir):
        raise AssertionError("a download was attempted without --download")

    monkeypatch.setattr(vision, "download_cifar", no_download)
    err = _error(VISION, ["--data-dir", str(tmp_path / "nowhere")], capsys)
    assert "CIFAR-10 not found" in err and "add --download" in err
    assert str(tmp_path / "nowhere" / "cifar-10-python.tar.gz") in err
    assert str(tmp_path / "nowhere" / "cifar10-images") in err
    assert not (tmp_path / "nowhere").exists()  # nothing created
    err = _error(NLP, ["--task", "cola", "--data-dir", str(tmp_path), "--model-config", "tiny-roberta"], capsys)
    assert f"tried {tmp_path / 'CoLA' / 'train.tsv'}" in err


def test_download_only_when_asked(tmp_path, monkeypatch, capsys):
    calls = []

    def offline(name, data_dir):
        calls.append(data_dir)
        raise OSError("no network")

    monkeypatch.setattr(vision, "download_cifar", offline)
    err = _error(VISION, ["--data-dir", str(tmp_path / "nowhere"), "--download"], capsys)
    assert calls == [str(tmp_path / "nowhere")]
    assert "CIFAR-10 not found" in err and "download failed: no network" in err


def test_subsets_larger_than_the_data(cifar, glue, capsys):
    err = _error(VISION, ["--data-dir", str(cifar), "--eval-subset", "11", "--batch-size", "4"], capsys)
    assert f"--eval-subset 11 is more than the 10 test images in {cifar}" in err
    err = _error(NLP, ["--task", "rte", "--data-dir", str(glue), "--model-config", "tiny-roberta", "--train-subset", "5",
                       "--batch-size", "4"], capsys)
    assert "--train-subset: subset size 5 is out of range: the split has 4 examples" in err


def test_bad_task_and_partition_that_does_not_fit(cifar, glue, capsys):
    assert "argument --task: invalid choice: 'imagenet'" in _error(NLP, ["--task", "imagenet"], capsys)
    # MobileNetV2 has 20 layers: at most 9 at each end for the client.
    err = _error(VISION, ["--data-dir", str(cifar), "--client-layers", "10", "--width-mult", "0.25"], capsys)
    assert "--client-layers 10" in err and "use client_layers in [1, 9]" in err
    err = _error(NLP, ["--task", "rte", "--data-dir", str(glue), "--model-config", "tiny-roberta", "--client-layers", "3"], capsys)
    assert "use client_layers in [0, 2]" in err  # tiny-roberta: embeddings + 6 layers + head
    err = _error(VISION, ["--data-dir", str(cifar), "--partition", "linear", "--balance", "10,9", "--width-mult", "0.25"],
                 capsys)
    assert "--balance 10,9: balance [10, 9] covers 19 layers but there are 20" in err
    err = _error(NLP, ["--task", "rte", "--data-dir", str(glue), "--tokenizer", "offline"], capsys)
    assert "--tokenizer offline has a vocabulary of its own" in err


def test_checkpoint_flags_are_checked(tmp_path, cifar, capsys):
    common = ["--data-dir", str(cifar), "--width-mult", "0.25"]
    err = _error(VISION, [*common, "--resume", str(tmp_path)], capsys)
    assert f"--resume {tmp_path}: no checkpoint there (no step-* folder)" in err
    assert "--save-every needs --save DIR" in _error(VISION, [*common, "--save-every", "10"], capsys)
    err = _error(VISION, [*common, "--save", str(tmp_path), "--save-every", "0"], capsys)
    assert "--save-every must be positive, got 0" in err
    err = _error(VISION, [*common, "--save", str(tmp_path), "--keep-checkpoints", "1"], capsys)
    assert "--keep-checkpoints must be >= 2, got 1" in err
    assert "--resume auto continues from --save's directory" in _error(VISION, [*common, "--resume", "auto"], capsys)


def test_resume_refuses_other_settings(tmp_path, cifar, capsys):
    """A checkpoint is resumed only by a run with its settings: the world size, the partition, the
    codec (and every other setting that changes what is computed) are compared before any process
    starts, the difference named; where files go and timeouts may change."""
    from dgpipe.train import checkpoint

    save = tmp_path / "ckpt"
    common = ["--data-dir", str(cifar), "--width-mult", "0.25", "--save", str(save), "--resume", "auto"]
    config = loop.parse_config(vision.VisionJob, VISION.build_parser(), [*common, "--quant", "8"], environ={})
    writer = checkpoint.Writer(save, 0, keep=2)
    writer.save(40, {"x": 1}, {"world_size": 2, "mode": "pipeline", "epoch": 1, "args": config.to_json()})
    # the same settings, another timeout and log: accepted
    loop.parse_config(vision.VisionJob, VISION.build_parser(), [*common, "--quant", "8", "--timeout", "9",
                                                                "--log", str(tmp_path / "x.jsonl")], environ={})
    err = _error(VISION, [*common, "--quant", "4", "--partition", "linear"], capsys)
    assert "--resume auto: the checkpoint of step 40 in" in err
    assert 'was saved with other settings: compression {"forward": {"name": "quant", "options": {"bits": 8}}' in err
    assert 'partition "client-server" -> "linear", quant 8 -> 4, stages null -> 2; resume with the saved' in err
    writer.save(50, {"x": 1}, {"world_size": 1, "mode": "pipeline", "epoch": 1, "args": config.to_json()})
    writer.wait()
    err = _error(VISION, [*common, "--quant", "8"], capsys)
    assert "the checkpoint was saved by 1 processes in pipeline mode; resume with --world-size 1" in err


def test_torchrun_world_size():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert placement.dist_env(None, env) == placement.DistEnv(True, 1, 1, 2)
    with pytest.raises(ValueError, match="--world-size 4 but torchrun started 2 processes"):
        placement.dist_env(4, env)
    with pytest.raises(ValueError, match="MASTER_PORT not set"):
        placement.dist_env(None, {k: v for k, v in env.items() if k != "MASTER_PORT"})
    assert placement.dist_env(None, {}) == placement.DistEnv(False, 0, 0, 2)


def test_compression_flags_map_to_codecs():
    sq = CodecSpec("sortquant", {"quant_bits": 6, "split_bits": 2})
    c = _validated(["--sortquant", "--quant", "6", "--split", "2"]).codec.compression
    assert (c.forward, c.backward) == (sq, sq)
    c = _validated(["--quant", "8"]).codec.compression
    assert c.forward == c.backward == CodecSpec("quant", {"bits": 8})
    c = _validated([]).codec.compression
    assert c.forward == c.backward == CodecSpec("none")
    c = _validated(["--sortquant", "--quant", "6", "--split", "2", "--grad-quant", "9", "--grad-split", "3"]).codec.compression
    assert (c.forward, c.backward) == (sq, CodecSpec("sortquant", {"quant_bits": 9, "split_bits": 3}))
    c = _validated(["--sortquant", "--quant", "6", "--split", "2", "--grad-quant", "10"]).codec.compression
    assert c.backward == CodecSpec("sortquant", {"quant_bits": 10, "split_bits": 2})
    c = _validated(["--quant", "4", "--grad-quant", "8"]).codec.compression
    assert (c.forward, c.backward) == (CodecSpec("quant", {"bits": 4}), CodecSpec("quant", {"bits": 8}))
    c = _validated(["--sortquant", "--quant", "3", "--split", "1", "--grad-codec", "none"]).codec.compression
    assert c.backward == CodecSpec("none") and str(c) == "forward sortquant(quant_bits=3, split_bits=1), backward none"
    c = _validated(["--codec", "quant", "--codec-opt", "bits=6", "--codec-opt", "stochastic=true"]).codec.compression
    assert c.forward == CodecSpec("quant", {"bits": 6, "stochastic": True})
    c = _validated(["--codec", "codebook", "--codec-opt", "bits=3", "--grad-codec", "quant",
                    "--grad-codec-opt", "bits=4", "--grad-codec-opt", "error_feedback=true"]).codec.compression
    assert c.backward == CodecSpec("quant", {"bits": 4, "error_feedback": True})
    ef = c.backward.build()
    assert isinstance(ef, ErrorFeedback) and ef.codec.bits == 4 and not isinstance(c.forward.build(), ErrorFeedback)
    a = _validated(["--mode", "dataparallel", "--grad-compression", "powersgd",
                    "--grad-compression-opt", "matrix_approximation_rank=4"])
    assert a.codec.compression is None and a.codec.dp_compression == GradCompression("powersgd", {"matrix_approximation_rank": 4})
    assert _validated(["--mode", "dataparallel"]).codec.dp_compression is None


def test_parse_options_types_and_linear_defaults():
    assert parse_options(["a=1", "b=0.5", "c=False", "d=l2", "e-f=2"], "--x") == {
        "a": 1, "b": 0.5, "c": False, "d": "l2", "e_f": 2}
    with pytest.raises(ValueError, match="gives 'a' twice"):
        parse_options(["a=1", "a=2"], "--x")
    a = _validated(["--partition", "linear", "--world-size", "3"])
    assert (a.pipeline.stages, a.pipeline.balance) == (3, None)
    a = _validated(["--partition", "linear", "--balance", "4,4,4,8"])
    assert (a.pipeline.stages, a.pipeline.balance) == (4, (4, 4, 4, 8))
