"""Helpers shared by the test modules (no ``test_`` prefix: pytest does not collect it).

- :func:`load_cli`: import a script of the repository root (a main-job CLI) by path;
  :func:`load_benchmark`: a script of ``benchmarks/``.
- :func:`spawn_checks` / :func:`assert_ranks_ok`: run named checks on every rank of one
  spawned gloo world (one process-group start for a whole module), each rank writing
  its outcome per check to a file, and let every test read the outcome of its own check.
- :func:`message_bytes` / :func:`wire_message` / :func:`wire_parts`: a transport message's size, bytes
  and the parts it goes out as, computed independently of :mod:`dgpipe.comm.transport`.
- :data:`needs_c`: skip a test of the compiled C kernels where they were not built.
- :func:`default_sigint`: a child's ``preexec_fn`` that gives it the default Ctrl-C handling.
- :func:`one_line_error`: a CLI's refusal -- exit status 2, the error and the pointer to ``--help``.
- :func:`corpus_slice`: a text corpus folder holding the first characters of each split of another.
- :func:`tiny_llama` / :func:`token_batch` / :func:`lm_loss` / :func:`unsplit_reference` / :func:`assert_grads_match`:
  split-equals-unsplit checks of a tiny Llama's stages (its boundary bottlenecks or subspace).
"""

from __future__ import annotations

import importlib.util
import signal
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

from dgpipe.compression.kernels import backend, compiled, rows
from dgpipe.pipeline import spawn

ROOT = Path(__file__).resolve().parents[1]

def load_benchmark(name: str) -> ModuleType:
    """The script ``benchmarks/<name>.py`` as a module (``pytest.ini`` puts ``benchmarks/`` on the import path,
    so a script imports its neighbours there as it does when run). Importing a benchmark starts nothing."""
    return importlib.import_module(name)


def default_sigint() -> None:
    """Restore SIGINT's default disposition in a child about to exec (``subprocess.Popen(preexec_fn=...)``):
    a suite started in the background (``&``, ``nohup``) inherits SIGINT ignored, and Python then leaves it
    ignored, so a test that sends SIGINT to a child would wait in vain."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


HAVE_C = compiled.available() and rows.available()
"""Whether the C extensions were built (no C compiler when dgpipe was installed: not)."""
needs_c = pytest.mark.skipif(not HAVE_C, reason=backend.MISSING)
"""Marks a test that asserts the compiled CPU kernels (``kernels.compiled``, ``kernels.rows``) ran: skipped, with
the notice the package gives, where the extensions were not built (no C compiler when dgpipe was installed)."""


def load_cli(name: str) -> ModuleType:
    """Import the repository-root script ``<name>.py`` as the module ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _run_checks(rank: int, world_size: int, checks: Mapping[str, Callable[[int], None]], out_dir: str,
                barrier_after_last: bool) -> None:
    """Rank body: every check in order, its outcome ("ok" or the traceback) to ``<name>.<rank>``."""
    torch.set_num_threads(1)
    last = list(checks)[-1]
    for name, check in checks.items():
        try:
            check(rank)
            result = "ok"
        except BaseException:  # recorded for the test that owns this check
            result = traceback.format_exc()
        Path(out_dir, f"{name}.{rank}").write_text(result)
        if name != last or barrier_after_last:
            dist.barrier()


def spawn_checks(checks: Mapping[str, Callable[[int], None]], world_size: int, out_dir: str | Path,
                 barrier_after_last: bool = True) -> Path:
    """Run ``check(rank)`` of every named check on each rank of a ``world_size`` gloo world.

    The ranks are forked (they inherit the imported torch and the checks, which need not
    be picklable); a barrier follows every check (not the last one without
    ``barrier_after_last``: e.g. after a check that leaves the group timed out).
    Returns ``out_dir`` for :func:`assert_ranks_ok`.
    """
    spawn(_run_checks, world_size, args=(checks, str(out_dir), barrier_after_last), timeout=60, start_method="fork")
    return Path(out_dir)


def assert_ranks_ok(out_dir: Path, name: str, world_size: int) -> None:
    """Fail with the rank's traceback unless check ``name`` passed on every rank."""
    for rank in range(world_size):
        result = (out_dir / f"{name}.{rank}").read_text()
        assert result == "ok", f"rank {rank}:\n{result}"


TRANSPORT_MAGIC = 0x64677033  # "dgp3", the transport's message magic
TRANSPORT_CLOSE = b"dgp3end!"  # the transport's closing word


def message_bytes(payloads, n_meta):
    """Packed size: int64 fields (5 fixed, meta, header lengths, headers), then each tensor at
    an 8-byte aligned offset, then the 8-byte closing word at the next aligned offset; computed
    here independently of the transport."""
    end = 8 * (5 + n_meta + len(payloads) + sum(p.header.numel() for p in payloads))
    for p in payloads:
        for t in p.tensors:
            end = (end + 7) // 8 * 8 + t.numel() * t.element_size()
    return (end + 7) // 8 * 8 + 8


def wire_message(payloads, meta):
    """The wire bytes of a message, packed here independently of the transport (module doc layout)."""
    headers = [p.header for p in payloads]
    total = message_bytes(payloads, len(meta))
    words = [TRANSPORT_MAGIC, total, len(meta), len(payloads), sum(h.numel() for h in headers), *meta,
             *(h.numel() for h in headers)] + [v for h in headers for v in h.tolist()]
    buf = torch.zeros(total, dtype=torch.uint8)
    buf[: 8 * len(words)] = torch.tensor(words, dtype=torch.int64).view(torch.uint8)
    end = 8 * len(words)
    for p in payloads:
        for t in p.tensors:
            start = (end + 7) // 8 * 8
            end = start + t.numel() * t.element_size()
            buf[start:end] = t.reshape(-1).view(torch.uint8)
    buf[-8:] = torch.frombuffer(bytearray(TRANSPORT_CLOSE), dtype=torch.uint8)
    return buf


def wire_parts(data, capacity):
    """The parts a message's bytes ``data`` go out as on a stream of ``capacity`` bytes: itself when it
    fits, else its first ``capacity - 8`` bytes closed by the closing word, and the rest."""
    if data.numel() <= capacity:
        return [data]
    close = torch.frombuffer(bytearray(TRANSPORT_CLOSE), dtype=torch.uint8)
    return [torch.cat([data[: capacity - 8], close]), data[capacity - 8 :]]


def tiny_bert(vocab: int, length: int, hidden: int):
    """A 4-layer BERT classifier (3 labels) with every dropout off, seeded, in training mode: a pipeline's
    boundaries and the unsplit model then compute the same numbers (no random masks)."""
    from dgpipe.models.encoder import build_encoder, small_encoder_config

    torch.manual_seed(0)
    cfg = small_encoder_config("bert", vocab, 0, max_length=length, num_labels=3, hidden_size=hidden, num_layers=4,
                               num_heads=2)
    model = build_encoder(cfg, 3, attn_implementation="eager")
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model.train()


def one_line_error(main: Callable, argv, capsys) -> str:
    """Run a CLI's ``main(argv)``, which must exit with status 2 and print two lines on stderr (the error, then
    the pointer to ``--help``); returns stderr."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 2, err
    return err


def corpus_slice(source: Path, folder: Path, chars: Mapping[str, int]) -> Path:
    """``folder`` holding ``<split>.txt`` = the first ``chars[split]`` characters of ``source``'s; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in chars.items():
        (folder / f"{split}.txt").write_text((source / f"{split}.txt").read_text(encoding="utf-8")[:n],
                                             encoding="utf-8")
    return folder



def tiny_llama(vocab: int, length: int):
    """The ``tiny-llama`` preset (64 wide), seeded, in training mode."""
    from dgpipe.models.causal_lm import build_causal_lm, preset_config

    torch.manual_seed(0)
    return build_causal_lm(preset_config("tiny-llama", vocab, length)).train()


def token_batch(vocab: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, next-token targets)``, int64 ``(batch, length)`` each, from a fixed seed."""
    ids = torch.randint(0, vocab, (batch, length + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def unsplit_reference(stages, x, y, chunks: int) -> tuple[float, torch.nn.Module]:
    """The loss (mean over ``chunks`` micro-batches) of ``stages`` run whole as one ``nn.Sequential``, and that
    model with the gradients of its backward."""
    model = torch.nn.Sequential(*stages)
    loss = 0.0
    for xm, ym in zip(x.chunk(chunks), y.chunk(chunks)):
        part = lm_loss(model(xm), ym) / chunks
        part.backward()
        loss += float(part.detach())
    return loss, model


def assert_grads_match(stages, reference: torch.nn.Module, mine) -> None:
    """Every trained parameter of this rank's stages ``mine`` has the reference's gradient (parameters matched by
    their place in the whole model: ``stages`` in order, each parameter once); at least one is checked."""
    whole = list(dict.fromkeys(p for s in stages for p in s.parameters()))
    want = list(dict.fromkeys(reference.parameters()))
    assert len(whole) == len(want)
    index = {id(p): i for i, p in enumerate(whole)}
    trained = [p for p in dict.fromkeys(q for s in mine for q in s.parameters()) if p.requires_grad]
    assert trained
    for p in trained:
        torch.testing.assert_close(p.grad, want[index[id(p)]].grad, rtol=1e-4, atol=1e-6)
