"""The data-parallel baseline: DDP with metered, optionally compressed gradient exchange."""

from .ddp import DataParallel, GradCompression, build_ddp, grad_compression_names

__all__ = ["DataParallel", "GradCompression", "build_ddp", "grad_compression_names"]
