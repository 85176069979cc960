"""Data-parallel (DDP) baseline with optionally compressed, metered gradient exchange."""

from .ddp import DataParallel, build_ddp, grad_compression_names, validate_grad_compression

__all__ = ["DataParallel", "build_ddp", "grad_compression_names", "validate_grad_compression"]
