"""dgpipe: GPipe-style micro-batch pipeline training with compressed stage boundaries."""

__version__ = "0.1.0"
