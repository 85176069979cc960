"""DDP communication hooks on 2 gloo processes, plus argument validation.

One spawn of 2 ranks runs every distributed scenario (``_worker``) and saves what each
rank saw; the tests below assert on those results.
"""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.distributed as dist

from dgpipe.baseline import GradCompression, build_ddp, grad_compression_names
from dgpipe.compression import get_codec
from dgpipe.pipeline import spawn

WORLD = 2


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def batch(rank: int, step: int, zero_input: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(8, 6, generator=g)
    return (torch.zeros_like(x) if zero_input else x), torch.randn(8, 3, generator=g)


def grads_of(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in module.parameters()]


def backward(module: torch.nn.Module, rank: int, step: int, zero_input: bool = False) -> None:
    x, y = batch(rank, step, zero_input)
    module.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(module(x), y).backward()


def ddp_grads(name, options, rank, steps=1, zero_input=False, **kw):
    dp = build_ddp(tiny_model(), "cpu", GradCompression(name, options), seed=1, **kw)
    for step in range(steps):
        backward(dp.module, rank, step, zero_input)
    return grads_of(dp.module), dp


def mean_of_own_decodes(name, options, rank, zero_input=False) -> list[torch.Tensor]:
    """Independent reference: local gradients, a fresh codec per parameter, decoded,
    all-gathered by this test and averaged."""
    local = tiny_model()
    backward(local, rank, 0, zero_input)
    out = []
    for g in grads_of(local):
        codec = get_codec(name, **options)
        mine = codec.decode(codec.encode(g))
        every = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(every, mine)
        out.append(sum(every) / WORLD)
    return out


def train_steps(name, options, rank, steps, state=None):
    """SGD steps through build_ddp; returns (model state, optimizer state, hook state,
    gradients of the last step). ``state`` resumes from a previous return value."""
    dp = build_ddp(tiny_model(), "cpu", GradCompression(name, options), seed=1)
    opt = torch.optim.SGD(dp.module.parameters(), lr=0.1, momentum=0.9)
    start = 0
    if state is not None:
        dp.module.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        buf = io.BytesIO()
        torch.save(state["hook"], buf)  # as a checkpoint would: tensors and plain types only
        dp.load_hook_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
        start = state["step"]
    for step in range(start, steps):
        backward(dp.module, rank, step)
        opt.step()
    return {
        "model": copy.deepcopy(dp.module.module.state_dict()),
        "opt": copy.deepcopy(opt.state_dict()),
        "hook": dp.hook_state_dict(),
        "step": steps,
        "grads": grads_of(dp.module),
    }


def _scenarios(rank: int) -> dict:
    res: dict = {}
    plain = torch.nn.parallel.DistributedDataParallel(tiny_model())
    backward(plain, rank, 0)
    res["plain"] = grads_of(plain)

    res["none"], dp = ddp_grads(None, None, rank)
    res["none_records"] = dp.step_records()
    res["none_allgather"], _ = ddp_grads("none", {"exchange": "allgather"}, rank)
    res["none_allreduce"], _ = ddp_grads("none", {"exchange": "allreduce"}, rank)
    res["fp16"], dp = ddp_grads("fp16", None, rank)
    res["fp16_records"] = dp.step_records()

    res["onebit"], dp = ddp_grads("onebit", {}, rank)
    res["onebit_records"] = dp.step_records()
    res["onebit_reference"] = mean_of_own_decodes("onebit", {}, rank)
    local = tiny_model()
    backward(local, rank, 0)
    res["onebit_payload_bytes"] = framed_bytes([get_codec("onebit").encode(g) for g in grads_of(local)])

    # rank 1's input is zero: its first weight gradient is 0 and ATOMO sends 0 atoms
    # for it, rank 0 sends several -- payloads of different sizes.
    res["atomo"], dp = ddp_grads("atomo", {"budget": 6}, rank, zero_input=rank == 1)
    res["atomo_records"] = dp.step_records()
    plain = torch.nn.parallel.DistributedDataParallel(tiny_model())
    backward(plain, rank, 0, zero_input=rank == 1)
    res["atomo_plain"] = grads_of(plain)
    res["dgc"], _ = ddp_grads("dgc", {"density": 0.3, "warmup_epochs": 0}, rank, steps=3)
    res["randomk"], dp = ddp_grads("randomk", {"ratio": 0.5}, rank)
    res["randomk_records"] = dp.step_records()

    for name, options, steps, cut in [
        ("onebit", {"error_feedback": True}, 3, 2),
        ("dgc", {"density": 0.2, "warmup_epochs": 0}, 3, 2),
        ("powersgd", {"start_powerSGD_iter": 2}, 5, 3),
    ]:
        full = train_steps(name, options, rank, steps)
        half = train_steps(name, options, rank, cut)
        resumed = train_steps(name, options, rank, steps, state=half)
        untrained = build_ddp(tiny_model(), "cpu", GradCompression(name, options), seed=1).hook_state_dict()
        fresh = train_steps(name, options, rank, steps, state={**half, "hook": untrained})
        res[f"resume_{name}"] = (full, resumed, fresh)

    # a rank that cannot encode (NaN gradient) must stop every rank with an error
    dp = build_ddp(tiny_model(), "cpu", GradCompression("onebit"), seed=1)
    x, y = batch(rank, 0)
    if rank == 1:
        x[0, 0] = float("nan")
    try:
        torch.nn.functional.mse_loss(dp.module(x), y).backward()
        res["nan_error"] = None
    except Exception as err:  # noqa: BLE001
        res["nan_error"] = str(err)
    return res


def _worker(rank: int, world_size: int, outdir: str) -> None:
    torch.set_num_threads(1)  # tiny tensors; spare the busy machine the threads' spin-waits
    torch.save(_scenarios(rank), os.path.join(outdir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # The library's launcher: a rank that fails is reported with its traceback, and a finished rank
    # ends without interpreter teardown, where gloo's threads can abort it (pytorch/pytorch#38228).
    outdir = str(tmp_path_factory.mktemp("ddp"))
    spawn(_worker, WORLD, (outdir,), backend="gloo", timeout=60.0)
    return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


def assert_all_close(a, b, **kw):
    assert len(a) == len(b)
    for s, t in zip(a, b):
        torch.testing.assert_close(s, t, **kw)


def test_none_equals_plain_ddp(runs):
    for res in runs:
        for key in ("none", "none_allgather", "none_allreduce"):
            assert_all_close(res[key], res["plain"], rtol=1e-6, atol=1e-7)


def test_fp16_close_to_plain(runs):
    for res in runs:
        assert_all_close(res["fp16"], res["plain"], rtol=2e-3, atol=1e-4)
    (rec,) = runs[0]["fp16_records"]
    assert rec["name"] == "ddp" and rec["direction"] == "allreduce" and rec["wire_bytes"] * 2 == rec["raw_bytes"]


def test_none_meters_the_allreduce(runs):
    numel = sum(p.numel() for p in tiny_model().parameters())
    (rec,) = runs[0]["none_records"]
    assert rec["raw_bytes"] == rec["wire_bytes"] == rec["recv_bytes"] == 4 * numel
    assert rec["ratio"] == 1.0 and rec["recv_seconds"] > 0


def test_allgather_codec_gives_every_rank_the_mean_of_decodes(runs):
    for res in runs:
        assert_all_close(res["onebit"], res["onebit_reference"], rtol=1e-6, atol=1e-7)
    for a, b in zip(runs[0]["onebit"], runs[1]["onebit"]):
        assert torch.equal(a, b)
    (rec,) = runs[0]["onebit_records"]
    assert rec["direction"] == "allgather" and rec["wire_bytes"] == runs[0]["onebit_payload_bytes"]
    assert rec["recv_bytes"] == runs[1]["onebit_payload_bytes"]
    assert rec["encode_seconds"] > 0 and rec["decode_seconds"] > 0 and rec["recv_seconds"] > 0


def test_payloads_of_different_sizes_do_not_hang(runs):
    wire = [res["atomo_records"][0]["wire_bytes"] for res in runs]
    assert wire[0] != wire[1]
    for res in runs:  # the budget covers every rank, so ATOMO is exact: the plain average
        assert_all_close(res["atomo"], res["atomo_plain"], rtol=1e-4, atol=1e-5)
    for a, b in zip(runs[0]["dgc"], runs[1]["dgc"]):
        assert torch.equal(a, b)


def test_randomk_goes_through_allreduce(runs):
    """Shared seeds: every rank keeps the same positions, so the all-reduced sum decodes
    to the plain average on those positions (times randomk's constant scale), 0 elsewhere."""
    for a, b in zip(runs[0]["randomk"], runs[1]["randomk"]):
        assert torch.equal(a, b)
    kept = total = 0
    for r, avg in zip(runs[0]["randomk"], runs[0]["plain"]):
        support = r != 0
        kept, total = kept + int(support.sum()), total + r.numel()
        scale = r[support] / avg[support]
        torch.testing.assert_close(scale, scale.mean().expand_as(scale), rtol=1e-4, atol=0)
    assert 0.25 * total <= kept <= 0.75 * total
    (rec,) = runs[0]["randomk_records"]
    assert rec["direction"] == "allreduce" and rec["wire_bytes"] < rec["raw_bytes"]


@pytest.mark.parametrize("name", ["onebit", "dgc", "powersgd"])
def test_resume_restores_hook_state(name, runs):
    for res in runs:
        full, resumed, fresh = res[f"resume_{name}"]
        assert_all_close(resumed["grads"], full["grads"], rtol=0, atol=0)
        for k, v in full["model"].items():
            assert torch.equal(resumed["model"][k], v)
        # without the saved hook state the next update differs: the state matters
        assert any(not torch.equal(a, b) for a, b in zip(fresh["grads"], full["grads"]))


def test_failing_rank_stops_every_rank(runs):
    assert "inf/NaN" in runs[1]["nan_error"]
    assert "rank 1 failed to encode" in runs[0]["nan_error"]


def test_validation_errors_before_any_process():
    GradCompression(None, None)
    GradCompression("topk" if "topk" in grad_compression_names() else "onebit", {"error_feedback": True})
    GradCompression("powersgd", {"matrix_approximation_rank": 4})
    GradCompression("qsgd", {"levels": 4, "norm": "max"})
    for name, options, match in [
        ("nope", {}, "unknown grad compression"),
        ("fp16", {"x": 1}, "takes no options"),
        ("powersgd", {"rank": 2}, "unknown powersgd options"),
        ("powersgd", {"matrix_approximation_rank": 0}, "matrix_approximation_rank"),
        ("powersgd", {"start_powerSGD_iter": 1}, "start_powerSGD_iter"),
        ("qsgd", {"levels": -1}, "levels"),
        ("qsgd", {"seed": 3}, "seed"),
        ("onebit", {"error_feedback": "yes"}, "error_feedback"),
        ("onebit", {"exchange": "allreduce"}, "cannot be all-reduced"),
        ("dgc", {"error_feedback": True}, "dgc"),
    ]:
        with pytest.raises(ValueError, match=match):
            GradCompression(name, options)


def _leb128_zigzag_size(v: int) -> int:
    """Bytes of one zigzag LEB128 varint, from the definition (Python ints, no torch)."""
    z = 2 * v if v >= 0 else -2 * v - 1
    return max(1, -(-z.bit_length() // 7))


def framed_bytes(payloads) -> int:
    """Frame bytes beyond the fixed prefix: each header's length and fields as varints,
    plus the payload tensors' bytes (``Payload.nbytes`` less the int64 header)."""
    return sum(sum(_leb128_zigzag_size(v) for v in [p.header.numel(), *p.header.tolist()])
               + p.nbytes - 8 * p.header.numel() for p in payloads)


def test_varint_matches_protobuf_sint64_bytes():
    from dgpipe.comm.framing import varint_encode

    # Protocol Buffers' sint64 encodings (zigzag, then base-128 varint)
    cases = {0: [0x00], -1: [0x01], 1: [0x02], -2: [0x03], 63: [0x7E], -64: [0x7F], 64: [0x80, 0x01], 300: [0xD8, 0x04],
             2**63 - 1: [0xFE] + [0xFF] * 8 + [0x01], -(2**63): [0xFF] * 9 + [0x01]}
    got = varint_encode(torch.tensor(list(cases), dtype=torch.int64)).tolist()
    assert got == [b for enc in cases.values() for b in enc]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40))
def test_varint_roundtrip_and_size(values):
    from dgpipe.comm.framing import varint_decode, varint_encode

    data = varint_encode(torch.tensor(values, dtype=torch.int64))
    assert data.dtype == torch.uint8 and data.numel() == sum(_leb128_zigzag_size(v) for v in values)
    assert varint_decode(data).tolist() == values


def test_varint_rejects_truncated_and_overlong_values():
    from dgpipe.comm.framing import varint_decode

    with pytest.raises(ValueError, match="end inside a value"):
        varint_decode(torch.tensor([0x80], dtype=torch.uint8))
    with pytest.raises(ValueError, match="over 64 bits"):
        varint_decode(torch.tensor([0xFF] * 9 + [0x02], dtype=torch.uint8))
    with pytest.raises(ValueError, match="over 64 bits"):
        varint_decode(torch.tensor([0x80] * 10 + [0x00], dtype=torch.uint8))


def test_frame_roundtrip_exact_bytes_and_corruption():
    from dgpipe.comm.framing import FRAME_PREFIX_BYTES, frame_payloads, unframe_payloads

    x = torch.randn(5, 4)
    payloads = [get_codec("onebit").encode(x), get_codec("none").encode(x.half()), get_codec("atomo").encode(x)]
    blob = frame_payloads(payloads, torch.device("cpu"))
    assert blob.dtype == torch.uint8 and blob.numel() == FRAME_PREFIX_BYTES + framed_bytes(payloads)
    # 12-13 header fields, 96-104 bytes each as int64: well under half of that as varints
    assert blob.numel() - FRAME_PREFIX_BYTES < sum(p.nbytes for p in payloads) - 150
    back = unframe_payloads(blob, 3, torch.device("cpu"))
    for p, q in zip(payloads, back):
        assert torch.equal(p.header, q.header)
        assert all(torch.equal(s, t) for s, t in zip(p.tensors, q.tensors))
    assert unframe_payloads(frame_payloads([], torch.device("cpu")), 0, torch.device("cpu")) == []
    with pytest.raises(ValueError, match="magic/count"):
        unframe_payloads(blob, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="total"):
        unframe_payloads(blob[:-1], 3, torch.device("cpu"))
    bad = blob.clone()
    bad[FRAME_PREFIX_BYTES + 1] ^= 0x04  # the first header's magic (its first varint byte)
    with pytest.raises(ValueError, match="corrupt header"):
        unframe_payloads(bad, 3, torch.device("cpu"))
    bad = blob.clone()
    bad[16:24] = torch.tensor([10**6], dtype=torch.int64).view(torch.uint8)  # header_bytes past the end
    with pytest.raises(ValueError, match="header_bytes"):
        unframe_payloads(bad, 3, torch.device("cpu"))
    bad = blob.clone()
    bad[FRAME_PREFIX_BYTES] = 2  # first header length 1 (zigzag 2): too short
    with pytest.raises(ValueError, match="header_numel"):
        unframe_payloads(bad, 3, torch.device("cpu"))
