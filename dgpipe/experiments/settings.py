"""The named settings of the quality benchmark (:mod:`.ablation`): per label, the main job's flags that set a
boundary's (or the DDP exchange's) compression, grouped by ``--settings`` name in :data:`SETTINGS`.
"""

from __future__ import annotations

__all__ = ["PIPELINE_SETTINGS", "DDP_SETTINGS", "LOWBIT_SETTINGS", "EXAMPLE_DROPOUT_SETTINGS", "DELTA_SETTINGS",
           "LM_SETTINGS", "LM_BOTTLENECK_SETTINGS", "LM_FINETUNE_SETTINGS", "LM_FINETUNE_BOTTLENECK_SETTINGS",
           "LM_CHAT_SETTINGS", "SETTINGS"]

#: Pipeline boundary compression: uncompressed, sortquant at 16/12/8/4 bits (Q:S = 3:1),
#: uniform quantization, and the data-parallel baseline.
PIPELINE_SETTINGS: dict[str, list[str]] = {
    "none": [],
    "sortquant16": ["--sortquant", "--quant", "12", "--split", "4"],
    "sortquant12": ["--sortquant", "--quant", "9", "--split", "3"],
    "sortquant8": ["--sortquant", "--quant", "6", "--split", "2"],
    "sortquant4": ["--sortquant", "--quant", "3", "--split", "1"],
    "quant16": ["--quant", "16"],
    "quant8": ["--quant", "8"],
    "quant4": ["--quant", "4"],
    "dataparallel": ["--mode", "dataparallel"],
}

#: Data-parallel gradient compression (docs/data-parallel.md).
_DP = ["--mode", "dataparallel", "--grad-compression"]
DDP_SETTINGS: dict[str, list[str]] = {
    "ddp_none": ["--mode", "dataparallel"],
    "ddp_fp16": _DP + ["fp16"],
    "ddp_powersgd1": _DP + ["powersgd", "--grad-compression-opt", "matrix_approximation_rank=1"],
    "ddp_powersgd4": _DP + ["powersgd", "--grad-compression-opt", "matrix_approximation_rank=4"],
    "ddp_topk_ef": _DP + ["topk", "--grad-compression-opt", "ratio=0.01",
                          "--grad-compression-opt", "error_feedback=true"],
    "ddp_randomk": _DP + ["randomk", "--grad-compression-opt", "ratio=0.01"],
    "ddp_onebit_ef": _DP + ["onebit", "--grad-compression-opt", "error_feedback=true"],
    "ddp_qsgd4": _DP + ["qsgd", "--grad-compression-opt", "levels=4"],
    "ddp_qsgd4_b512": _DP + ["qsgd", "--grad-compression-opt", "levels=4", "--grad-compression-opt", "bucket_size=512"],
    "ddp_terngrad": _DP + ["terngrad"],
    "ddp_dgc": _DP + ["dgc", "--grad-compression-opt", "warmup_epochs=2"],
    "ddp_atomo4": _DP + ["atomo", "--grad-compression-opt", "budget=4"],
}


def _codebook(bits: int | None, flag: str = "--codec", count: int | None = None) -> list[str]:
    """Flags of the codebook codec at ``bits`` bits (or ``count`` levels, radix-packed): per-token RMS scale
    (bfloat16) after a Hadamard rotation."""
    size = f"bits={bits}" if count is None else f"count={count}"
    opts = [size, "levels=normal", "group=token", "rotate=hadamard", "scale_dtype=bfloat16"]
    return [flag, "codebook"] + [x for o in opts for x in (f"{flag}-opt", o)]


def _subspace(rank: int, bits: int | None, flag: str = "--codec", count: int | None = None) -> list[str]:
    """Flags of the subspace codec: ``rank`` directions per message in bfloat16 factors, the residual
    through the ``bits``-bit (or ``count``-level) codebook (token groups, Hadamard, bfloat16 scales: the
    codec's defaults; ``bits=0``: no residual)."""
    size = f"bits={bits}" if count is None else f"count={count}"
    return [flag, "subspace", f"{flag}-opt", f"rank={rank}", f"{flag}-opt", size]


#: Low-bit boundary codecs against the 8-bit ones (the quality benchmark, docs/quality.md); gradients at 4 bits
#: with the same codebook where the forward direction goes below 4.
LOWBIT_SETTINGS: dict[str, list[str]] = {
    "none": [],
    "sortquant8": PIPELINE_SETTINGS["sortquant8"],
    "sortquant4": PIPELINE_SETTINGS["sortquant4"],
    "quant4": PIPELINE_SETTINGS["quant4"],
    "codebook4": _codebook(4),
    "codebook3_g4": _codebook(3) + _codebook(4, "--grad-codec"),
    "codebook2_g4": _codebook(2) + _codebook(4, "--grad-codec"),
    "codebook2_g2": _codebook(2) + _codebook(2, "--grad-codec"),
    # 5 levels both ways (2.33 bits a value radix-packed, between the 2- and 3-bit codebooks)
    "codebook5lv_g5lv": _codebook(None, count=5) + _codebook(None, "--grad-codec", count=5),
    # 2 dominant directions per message exactly, the rest by the 2-bit codebook (2.26 bits a value)
    "subspace2": _subspace(2, 2) + _subspace(2, 2, "--grad-codec"),
    # the most accurate code within 2.5 bits a value, both ways (2.49 on 256 x 384 messages; 0.036-0.059 of
    # the energy left on MiniLM's boundaries, about the 3-bit codebook's error going forward)
    "subspace1lv5": _subspace(1, None, count=5) + _subspace(1, None, "--grad-codec", count=5),
    # the same gradients, 5 levels forward: on the real tokens rank 1 gains nothing going forward (its one direction
    # codes the padding rows), so its 0.1 bit is left out there (2.40 / 2.49 bits a value)
    "codebook5lv_gsub1lv5": _codebook(None, count=5) + _subspace(1, None, "--grad-codec", count=5),
    # under 1 bit a value averaged over both directions: the 1-bit codebook forward (1.05), the gradients'
    # 8 dominant directions alone (0.84 on a 256 x 384 message)
    "codebook1_gsub8": _codebook(1) + _subspace(8, 0, "--grad-codec"),
}

#: Per-example dropout masks (``--example-dropout``, the same masks at every visit): the uncompressed
#: pair (run with ``--baseline exdrop``) and the delta-coded settings that revisits should favour.
EXAMPLE_DROPOUT_SETTINGS: dict[str, list[str]] = {
    "exdrop": ["--example-dropout"],
    **{f"delta_{label}_exdrop_eval32": LOWBIT_SETTINGS[label] + ["--delta", "--example-dropout", "--no-compress-eval"]
       for label in ("codebook2_g2", "codebook1_gsub8")},
}

_LOWBIT_CODEBOOKS = ("codebook4", "codebook3_g4", "codebook2_g4", "codebook2_g2", "codebook5lv_g5lv", "subspace2",
                     "subspace1lv5", "codebook5lv_gsub1lv5", "codebook1_gsub8")

#: Delta coding against per-example caches (AQ-SGD, docs/delta.md) with the codebook codec at 4, 3 and 2
#: bits as the inner codec, beside the same codecs without delta; run them for >= 3 epochs so that
#: every training example is revisited.
DELTA_SETTINGS: dict[str, list[str]] = {
    "none": [],
    **{label: LOWBIT_SETTINGS[label] for label in _LOWBIT_CODEBOOKS},
    **{f"delta_{label}": LOWBIT_SETTINGS[label] + ["--delta"] for label in _LOWBIT_CODEBOOKS},
    "sortquant4": PIPELINE_SETTINGS["sortquant4"],
    "delta_sortquant4": PIPELINE_SETTINGS["sortquant4"] + ["--delta"],
    # The same pairs evaluated uncompressed: delta trains on reconstructions far closer to the
    # activations than direct low-bit coding, which is what compressed evaluation (no cache) still sees.
    **{f"{prefix}{label}_eval32": LOWBIT_SETTINGS[label] + flags + ["--no-compress-eval"]
       for label in _LOWBIT_CODEBOOKS
       for prefix, flags in (("", []), ("delta_", ["--delta"]))},
    # Direct coding against the per-token reference (--token-reference): evaluated through the link, where
    # no delta cache exists; the token ids count against the forward direction
    **{f"ref_{label}": LOWBIT_SETTINGS[label] + ["--token-reference"]
       for label in ("codebook2_g2", "codebook5lv_gsub1lv5")},
}

#: The language-model benchmark (docs/lm.md): the 8-bit codecs, the 4-bit codebook, the best settings within
#: 2.5 bits a value averaged over both directions -- 5 levels forward, the gradients' dominant direction plus
#: 4 levels backward (2.48 / 2.30 on 4 x 128 x 128 messages; the 5-level residual of the encoder benchmark
#: needs 2.64 at this width), directly and against the per-token reference -- and the best under 1 bit: the
#: 1-bit codebook forward, the gradients' 4 dominant directions alone backward (1.14 / 0.64).
LM_SETTINGS: dict[str, list[str]] = {
    "none": [],
    "sortquant8": PIPELINE_SETTINGS["sortquant8"],
    "quant8": PIPELINE_SETTINGS["quant8"],
    "codebook4": _codebook(4),
    "codebook5lv_gsub1lv4": _codebook(None, count=5) + _subspace(1, None, "--grad-codec", count=4),
    "ref_codebook5lv_gsub1lv4": _codebook(None, count=5) + _subspace(1, None, "--grad-codec", count=4)
    + ["--token-reference"],
    "codebook1_gsub4": _codebook(1) + _subspace(4, 0, "--grad-codec"),
    # 5 levels both ways (2.48 bits), the gradients rounded to the nearest level or stochastically (unbiased
    # inside the outer levels)
    "codebook5lv_gcb5lv": _codebook(None, count=5) + _codebook(None, "--grad-codec", count=5),
    "codebook5lv_gcb5lv_sr": _codebook(None, count=5) + _codebook(None, "--grad-codec", count=5)
    + ["--grad-codec-opt", "stochastic=true"],
    # one direction at a time (the other uncompressed): which of the two costs the 2.4-bit setting its loss
    "codebook5lv_only": _codebook(None, count=5) + ["--grad-codec", "none"],
    "gsub1lv4_only": _subspace(1, None, "--grad-codec", count=4),
    # 5 levels both ways against the per-token reference with the channels weighed and the first positions and
    # unseen tokens backing off to shared rows (--token-reference-scale, --token-reference-backoff)
    "refscaledbackoff_codebook5lv_gcb5lv": _codebook(None, count=5) + _codebook(None, "--grad-codec", count=5)
    + ["--token-reference", "--token-reference-scale", "--token-reference-backoff"],
}

#: The pretraining benchmark with boundary bottlenecks (docs/lm.md): ``--bottleneck D`` channels of the small Llama's
#: 128 cross each way (from a random orthonormal basis, trained with the model), alone and with codes on top; bits a
#: value counted against the width 128: ``D / 128`` of the codec's bits.
LM_BOTTLENECK_SETTINGS: dict[str, list[str]] = {
    # anchored (--bottleneck-anchor): the pairs code the residual stream less the token embedding, rebuilt from the
    # ids on the far side (the ids cross losslessly: ~0.1 bit a value forward at this width)
    "abneck16ch_quant6": ["--bottleneck", "16", "--bottleneck-anchor", "--quant", "6"],  # 0.75 bit + ids
    "abneck16ch": ["--bottleneck", "16", "--bottleneck-anchor"],  # 4 bits + ids
    "abneck8ch_quant8": ["--bottleneck", "8", "--bottleneck-anchor", "--quant", "8"],  # 0.5 bit + ids
    "abneck4ch_quant8": ["--bottleneck", "4", "--bottleneck-anchor", "--quant", "8"],  # 0.25 bit + ids
    "abneck32ch_quant3": ["--bottleneck", "32", "--bottleneck-anchor", "--quant", "3"],  # 0.75 bit + ids
    # a residual stream in one shared subspace (--bottleneck-subspace): the pairs code it exactly, the ids cross too
    "sub64ch": ["--bottleneck", "64", "--bottleneck-subspace"],  # 16 bits + ids
    "sub32ch": ["--bottleneck", "32", "--bottleneck-subspace"],  # 8 bits + ids
    "sub32ch_quant3": ["--bottleneck", "32", "--bottleneck-subspace", "--quant", "3"],  # 0.75 bit + ids
    "sub16ch_quant6": ["--bottleneck", "16", "--bottleneck-subspace", "--quant", "6"],  # 0.75 bit + ids
    "sub16ch": ["--bottleneck", "16", "--bottleneck-subspace"],  # 4 bits + ids
    # each stage's own trained token table (--bottleneck-subspace stage)
    "subt128ch": ["--bottleneck", "128", "--bottleneck-subspace", "stage"],  # the model with stage tables, 32 bits
    "subt16ch_quant6": ["--bottleneck", "16", "--bottleneck-subspace", "stage", "--quant", "6"],  # 0.75 bit + ids
    "subt8ch_quant8": ["--bottleneck", "8", "--bottleneck-subspace", "stage", "--quant", "8"],  # 0.5 bit + ids
    "subt4ch_quant5": ["--bottleneck", "4", "--bottleneck-subspace", "stage", "--quant", "5"],  # 0.16 bit + ids
    "sub8ch_quant8": ["--bottleneck", "8", "--bottleneck-subspace", "--quant", "8"],  # 0.5 bit + ids
    "sub4ch_quant6": ["--bottleneck", "4", "--bottleneck-subspace", "--quant", "6"],  # 0.19 bit + ids
    # per-token scales (bfloat16: 0.5 bit a coded value at 32 channels) after a Hadamard rotation
    "sub32ch_codebook3": ["--bottleneck", "32", "--bottleneck-subspace"] + _codebook(3),  # 0.89 bit + ids
    "sub64ch_codebook3lv": ["--bottleneck", "64", "--bottleneck-subspace"] + _codebook(None, count=3),  # 0.92 + ids
    # plain pairs
    "bneck16ch_quant6": ["--bottleneck", "16", "--quant", "6"],  # 0.75 bit
    "bneck32ch_quant3": ["--bottleneck", "32", "--quant", "3"],  # 0.75 bit
    "bneck4ch_quant8": ["--bottleneck", "4", "--quant", "8"],  # 0.25 bit
    "bneck16ch": ["--bottleneck", "16"],  # 4 bits
    "bneck8ch_quant8": ["--bottleneck", "8", "--quant", "8"],  # 0.5 bit
    "bneck4ch": ["--bottleneck", "4"],  # 1 bit
    "bneck8ch": ["--bottleneck", "8"],  # 2 bits
    "bneck32ch": ["--bottleneck", "32"],  # 8 bits
    "bneck64ch": ["--bottleneck", "64"],  # 16 bits
    "bneck32ch_codebook4": ["--bottleneck", "32"] + _codebook(4),  # 1.1 bits
    "bneck64ch_codebook2": ["--bottleneck", "64"] + _codebook(2),  # 1.1 bits
}

#: The fine-tuning benchmark of a pretrained decoder (docs/lm.md): the language-model settings, 5 levels both ways
#: directly, against the per-token reference, against it with the channels weighed, and with the first positions
#: and unseen tokens backing off to shared rows too (2.37 bits a value on SmolLM2's 576-wide messages), and the same
#: runs evaluated uncompressed (``_eval32``: what fine-tuning through the codec cost the weights, apart from what
#: the link costs the evaluation).
LM_FINETUNE_SETTINGS: dict[str, list[str]] = {
    **LM_SETTINGS,
    "ref_codebook5lv_gcb5lv": LM_SETTINGS["codebook5lv_gcb5lv"] + ["--token-reference"],
    "refscaled_codebook5lv_gcb5lv": LM_SETTINGS["codebook5lv_gcb5lv"] + ["--token-reference",
                                                                           "--token-reference-scale"],
    "refbackoff_codebook5lv_gcb5lv": LM_SETTINGS["codebook5lv_gcb5lv"] + ["--token-reference",
                                                                            "--token-reference-backoff"],
    **{f"{label}_eval32": LM_SETTINGS[label] + ["--no-compress-eval"]
       for label in ("codebook4", "codebook5lv_gcb5lv", "refscaledbackoff_codebook5lv_gcb5lv")},
    # under 1 bit a value averaged over both directions, the weights evaluated uncompressed: the forward direction
    # against the per-token reference (weighed, backing off) at 3 levels (1.6 bits) or 2 (1 bit), the gradients'
    # dominant directions alone backward (bfloat16 factors: 0.09 bit a direction on 4 x 64 x 576 messages)
    **{f"refscaledbackoff_codebook{fwd}lv_gsub{rank}_eval32": _codebook(None, count=fwd)
       + _subspace(rank, 0, "--grad-codec")
       + ["--token-reference", "--token-reference-scale", "--token-reference-backoff", "--no-compress-eval"]
       for fwd, rank in ((3, 3), (3, 2), (2, 8))},
    # one direction at a time, the other uncompressed: which of the two costs those settings their loss
    "refscaledbackoff_codebook3lv_only_eval32": _codebook(None, count=3) + ["--grad-codec", "none"]
    + ["--token-reference", "--token-reference-scale", "--token-reference-backoff", "--no-compress-eval"],
    "gsub3_only_eval32": ["--codec", "none"] + _subspace(3, 0, "--grad-codec") + ["--no-compress-eval"],
}

#: Fine-tuning SmolLM2 (576 wide) with boundary bottlenecks started from the boundary states' principal components
#: (``--model``: ``--bottleneck-init auto``), alone and with codes on top; bits a value against the width 576.
LM_FINETUNE_BOTTLENECK_SETTINGS: dict[str, list[str]] = {
    "bneck72ch": ["--bottleneck", "1/8"],  # 4 bits
    "bneck72ch_quant7": ["--bottleneck", "1/8", "--quant", "7"],  # 0.875 bit
    "bneck72ch_codebook4": ["--bottleneck", "1/8"] + _codebook(4),  # 0.53 bit
    "bneck36ch_quant8": ["--bottleneck", "1/16", "--quant", "8"],  # 0.5 bit
    # the pairs distilled to the model's own outputs (--distill: the model frozen), at a pair's learning rate
    "distill_bneck72ch": ["--bottleneck", "1/8", "--distill", "--lr", "1e-3"],  # 4 bits
    "distill_bneck72ch_codebook4": ["--bottleneck", "1/8", "--distill", "--lr", "1e-3"] + _codebook(4),  # 0.92 bit
}

#: Fine-tuning SmolLM2 on instruction data the way LMs are fine-tuned (``benchmarks/lm_finetune.py --chat``): against
#: the full float32 fine-tune (``none``, lr 3e-5), LoRA r=8 (alpha 16, lr 1e-3: +0.35% where 2e-4 left +4.9%, one
#: seed) in bf16, with activation checkpointing, and with the 2.38-bit link of the fine-tuning table (5-level
#: codebooks both ways, token reference).
LM_CHAT_SETTINGS: dict[str, list[str]] = {
    "lora8_bf16": ["--lora", "8", "--lora-alpha", "16", "--lr", "1e-3", "--precision", "bf16"],
    "lora8_bf16_ckpt": ["--lora", "8", "--lora-alpha", "16", "--lr", "1e-3", "--precision", "bf16",
                        "--activation-checkpointing"],
    "lora8_bf16_ckpt_link": ["--lora", "8", "--lora-alpha", "16", "--lr", "1e-3", "--precision", "bf16",
                             "--activation-checkpointing",
                             *LM_FINETUNE_SETTINGS["refscaledbackoff_codebook5lv_gcb5lv"]],
}

SETTINGS = {"pipeline": PIPELINE_SETTINGS, "ddp": DDP_SETTINGS, "lowbit": LOWBIT_SETTINGS, "delta": DELTA_SETTINGS,
            "exdrop": EXAMPLE_DROPOUT_SETTINGS, "lm": LM_SETTINGS, "lm_finetune": LM_FINETUNE_SETTINGS,
            "lm_bottleneck": {"none": [], **LM_BOTTLENECK_SETTINGS},
            "lm_finetune_bottleneck": {"none": [], **LM_FINETUNE_BOTTLENECK_SETTINGS},
            "lm_chat": {"none": [], **LM_CHAT_SETTINGS}}
