"""Subspace + residual codec (codec ``subspace``): a few dominant directions exactly, the rest by codebook.

A tensor of shape ``(..., d)`` is viewed as the matrix ``M`` of its ``n`` rows (tokens) of ``d``
values. Its projection on ``rank`` dominant directions of its own is sent as two thin factors in a
16-bit float format, and what is left through the codebook codec (:mod:`.codebook`)::

    P = orth(M W)                          # n x k; W: d x k Gaussian sketch, fixed seed, k = r + 4
    repeat power_iters times:  P = orth(M (M^T P))
    P = P U[:, :r],  U S V^T = svd(P^T M)  # the r dominant directions of that range (Rayleigh-Ritz)
    P^ = round(P),  R^ = round(P^T M)      # factor_dtype (bfloat16 by default)
    E = M - P^ R^                          # computed from the rounded factors: both sides agree
    decode = P^ R^ + codebook.decode(codebook.encode(E))     # bits=0: decode = P^ R^ (no residual)

The basis is the randomized range finder with subspace iteration (Halko, Martinsson & Tropp,
SIAM Review 2011), as in PowerSGD's compressor (Vogels et al., NeurIPS 2019), but fitted per
message, so the codec is stateless. Where it pays: a few directions carry much of a transformer
boundary gradient's energy; taken out exactly, they no longer inflate every token's RMS scale, and
the codebook spends its levels on the rest. Measured on all-MiniLM-L6-v2's boundary tensors
(``benchmarks/boundary_mse.py``, micro-batches of 4 sentences, error on the real tokens): rank 2
plus the 2-bit codebook (2.26 bits a value) leaves 0.018 / 0.069 of the layer-4 / layer-2
gradients' energy, against 0.115 / 0.118 for the 2-bit codebook alone (2.05), but 0.090-0.096
of the activations' against 0.117: the forward direction gains little (5 levels, 2.39 bits: 0.078).

Factor bytes grow with the rows of a message: ``16 * r * (n + d)`` bits, 0.21 bits a value for
``r = 2`` on a 256 x 384 micro-batch. With ``bits=0`` only the factors are sent: a sub-1-bit code
for tensors whose energy sits in a few directions (the gradient at MiniLM's layer-4 boundary keeps
0.05-0.1 of its energy outside rank 2-4; its activations keep far more).

The factors come out of float32 matrix products, whose rounding depends on the BLAS and on how many
threads split each sum: two machines may send different bytes for the same tensor (both valid; the
receiver decodes whatever factors it is sent, so sender and receiver always agree).
"""

from __future__ import annotations

import dataclasses

import torch

from ..base import Codec, Payload, check_params, check_tensor_specs, make_payload, register_codec
from ..kernels import finite_range
from ..steps.grid import flat_float32
from .codebook import CodebookQuantizer

__all__ = ["SubspaceCodec", "FACTOR_DTYPES"]

FACTOR_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""Formats of the factors on the wire, in the order of their wire codes."""

SKETCH_SEED = 0x5B5
"""Seed of the Gaussian sketch ``W`` (encode is deterministic)."""

OVERSAMPLE = 4
"""Directions sketched beyond ``rank``: the range finder then converges in a couple of iterations
even where the rank-th and the next singular values are close (Halko et al., section 4.2)."""

MAX_RANK = 1024


@register_codec("subspace", 15)
class SubspaceCodec(Codec):
    """Rank-``rank`` projection of the rows in bfloat16 factors, plus the residual through ``codebook``.

    Args:
        rank: directions sent exactly, 1..1024; the effective rank is ``min(rank, n, d)``.
        power_iters: subspace iterations after the sketch (>= 0; each: two matrix products).
        factor_dtype: ``bfloat16`` (default), ``float16`` or ``float32``: the factors on the wire.
        **residual: options of the residual's :class:`.codebook.CodebookQuantizer`
            (``bits``/``count``, ``group``, ``rotate``, ``scale_dtype``, ...); the default
            codebook has 2 bits, token groups, a Hadamard rotation and bfloat16 scales.
            ``bits=0`` (and no other residual option) sends no residual: the factors only.

    Input: a floating tensor of at least one dimension, any device; computed in float32. Decode
    returns its shape, dtype and device.

    Wire (exact, tested)::

        nbytes = sizeof(factor_dtype) * r * (n + d) + (the residual codebook payload's tensor bytes)
                 + header bytes      # header params: rank, factor dtype, then the codebook's
                                     # (none, and 2 tensors only, with bits=0)

    Raises:
        ValueError: bad options (construction); non-floating or 0-d input, inf/NaN (encode); a
            corrupt payload (decode).
    """

    def __init__(self, rank: int = 2, power_iters: int = 2, factor_dtype: str = "bfloat16", **residual) -> None:
        for name, v, lo, hi in (("rank", rank, 1, MAX_RANK), ("power_iters", power_iters, 0, 16)):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"subspace: {name} must be an int in [{lo}, {hi}], got {v!r}")
        if factor_dtype not in FACTOR_DTYPES:
            raise ValueError(f"subspace: factor_dtype must be one of {tuple(FACTOR_DTYPES)}, got {factor_dtype!r}")
        self.rank, self.power_iters, self.factor_dtype = rank, power_iters, factor_dtype
        if residual.get("bits") == 0:
            if len(residual) > 1:
                raise ValueError(f"subspace: bits=0 sends no residual, so it takes no residual options, "
                                 f"got {sorted(set(residual) - {'bits'})}")
            self.residual = None
            return
        options = {"bits": 2, "group": "token", "rotate": "hadamard", "scale_dtype": "bfloat16"}
        if "count" in residual:
            options.pop("bits")
        self.residual = CodebookQuantizer(**{**options, **residual})

    def encode(self, x: torch.Tensor) -> Payload:
        flat = flat_float32(x, self.name)
        if x.dim() == 0:
            raise ValueError("subspace codec needs a tensor of at least one dimension (rows x d), got a 0-d tensor")
        d = x.shape[-1]
        n = flat.numel() // d if d else 0
        mat = flat.view(n, d)
        r = min(self.rank, n, d)
        fdt = FACTOR_DTYPES[self.factor_dtype]
        if r:
            finite_range(*torch.aminmax(mat), self.name)  # a matrix product would spread inf/NaN everywhere
            p, q = self._factors(mat, r, fdt)
            rest = mat - p.float() @ q.float()
        else:
            p = q = mat.new_empty(0, dtype=fdt)
            rest = mat
        params, tensors = (r, list(FACTOR_DTYPES).index(self.factor_dtype)), (p, q)
        if self.residual is not None:
            inner = self.residual.encode(rest.view(x.shape))
            params, tensors = params + self.residual.parse(inner).params, tensors + inner.tensors
        return make_payload(self.codec_id, x.dtype, x.shape, params, tensors)

    def _factors(self, mat: torch.Tensor, r: int, fdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P^ (n, r), R^ (r, d))`` in ``fdt``: the rounded orthonormal basis of the ``r`` dominant
        directions and the rows' coefficients in it (module docstring)."""
        n, d = mat.shape
        k = min(r + OVERSAMPLE, n, d)
        # drawn on CPU, so that a GPU rank sends what a CPU rank would (device generators differ)
        w = torch.randn(d, k, generator=torch.Generator().manual_seed(SKETCH_SEED)).to(mat.device)
        p = torch.linalg.qr(mat @ w).Q
        for _ in range(self.power_iters):
            p = torch.linalg.qr(mat @ (mat.T @ p)).Q
        # Rayleigh-Ritz: the r dominant directions inside the k-dimensional range found
        u = torch.linalg.svd(p.T @ mat, full_matrices=False).U
        p = (p @ u[:, :r]).to(fdt)
        return p, (p.float().T @ mat).to(fdt)

    def decode(self, payload: Payload) -> torch.Tensor:
        h = self.parse(payload)
        if not h.shape:
            raise ValueError("corrupt header: field 'shape' is 0-d; the subspace codec sends rows")
        d = h.shape[-1]
        n = h.numel // d if d else 0
        if len(h.params) < 2 or len(h.tensor_specs) < 2:
            raise ValueError(f"corrupt header: fields 'n_params' = {len(h.params)}, 'n_tensors' = "
                             f"{len(h.tensor_specs)}, expected at least 2 each")
        own = dataclasses.replace(h, params=h.params[:2], tensor_specs=h.tensor_specs[:2])
        r, fcode = check_params(own, ("rank", 0, min(MAX_RANK, n, d)), ("factor_dtype", 0, len(FACTOR_DTYPES) - 1))
        fdt = list(FACTOR_DTYPES.values())[fcode]
        check_tensor_specs(own, ("P", fdt, n * r), ("R", fdt, r * d))
        if len(h.params) == 2 and len(h.tensor_specs) == 2:  # factors only (bits=0)
            rest = torch.zeros(n, d, device=payload.tensors[0].device)
        else:
            inner = make_payload(CodebookQuantizer.codec_id, torch.float32, h.shape, h.params[2:], payload.tensors[2:])
            rest = (self.residual or CodebookQuantizer()).decode(inner).reshape(n, d)
        p, q = payload.tensors[:2]
        if r:
            if not (bool(torch.isfinite(p).all()) and bool(torch.isfinite(q).all())):
                raise ValueError("corrupt payload: fields 'tensors[0:2]' (factors) hold inf/NaN")
            rest = rest + p.view(n, r).float() @ q.view(r, d).float()
        return rest.view(h.shape).to(h.dtype)
