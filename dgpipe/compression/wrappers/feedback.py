"""Error feedback: a stateful wrapper that sends, with each tensor, what earlier encodes lost.

``ErrorFeedback(codec)`` keeps the residual ``e`` of one stream of tensors. Each
``encode(x)`` encodes ``c = x + e`` with the wrapped codec, decodes the payload
locally, and keeps ``e = c - decode(payload)`` for the next call. So the decoded
outputs sum to the inputs up to the last residual:
``sum(decoded_1..t) = sum(x_1..t) - e_t``, with ``e_t`` bounded by the codec's error on
one tensor instead of growing with ``t`` (error feedback / error compensation: Seide et
al., "1-Bit Stochastic Gradient Descent ...", Interspeech 2014; Karimireddy et al.,
"Error Feedback Fixes SignSGD ...", ICML 2019).

Usage::

    ef = ErrorFeedback(get_codec("topk", ratio=0.01))   # one per stream
    payload = ef.encode(grad)     # wire format of the wrapped codec
    y = ef.decode(payload)        # or any "topk" codec on the receiving side
"""

from __future__ import annotations

import torch

from ..base import Codec, Payload

__all__ = ["ErrorFeedback"]


class ErrorFeedback(Codec):
    """Error-compensated ``codec`` for one stream of tensors (``stateful = True``).

    Args:
        codec: the codec to wrap (not itself an ``ErrorFeedback``).

    The residual is float32 (float64 for float64 inputs), shaped like the input, on
    its device. A tensor of another shape than the residual starts the stream anew
    (the residual is dropped: e.g. a smaller last batch); :meth:`reset` drops it
    explicitly. The payload is the wrapped codec's, so the receiving side decodes it
    with the plain codec; :meth:`decode` delegates. Each ``encode`` also decodes once
    (to measure the residual).

    State: :meth:`state_dict` / :meth:`load_state_dict` -- the residual (``None``
    before the first encode) and the wrapped codec's state if it has one.
    """

    stateful = True

    def __init__(self, codec: Codec) -> None:
        if not isinstance(codec, Codec) or isinstance(codec, ErrorFeedback):
            raise ValueError(f"ErrorFeedback wraps one codec (not an ErrorFeedback), got {codec!r}")
        self.codec = codec
        self.name, self.codec_id = codec.name, codec.codec_id
        self._residual: torch.Tensor | None = None

    def encode(self, x: torch.Tensor) -> Payload:
        """Encode ``x + residual`` with the wrapped codec; keep the new residual.

        Raises:
            ValueError: ``x`` not floating, or whatever the wrapped codec raises (the
                residual is then left as it was).
        """
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"ErrorFeedback needs a floating tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        c = x.detach().to(acc)
        e = self._residual
        if e is not None and e.shape == x.shape:
            c = c + e.to(device=c.device, dtype=acc)
        payload = self.codec.encode(c.to(x.dtype))
        self._residual = c - self.codec.decode(payload).to(acc)
        return payload

    def decode(self, payload: Payload) -> torch.Tensor:
        """The wrapped codec's decode (stateless)."""
        return self.codec.decode(payload)

    def reset(self) -> None:
        """Drop the residual: the next encode starts a new stream."""
        self._residual = None

    def state_dict(self) -> dict:
        """``{"residual": tensor or None, "codec": the wrapped codec's state_dict() or None}``."""
        inner = self.codec.state_dict() if hasattr(self.codec, "state_dict") else None
        return {"residual": None if self._residual is None else self._residual.clone(), "codec": inner}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises:
            ValueError: the residual is not a floating tensor or None, or the wrapped
                codec's state does not fit it.
        """
        residual = state.get("residual")
        if residual is not None and not (isinstance(residual, torch.Tensor) and residual.is_floating_point()):
            raise ValueError(f"ErrorFeedback: state 'residual' must be a floating tensor or None, got {residual!r}")
        inner = state.get("codec")
        if inner is not None:
            if not hasattr(self.codec, "load_state_dict"):
                raise ValueError(f"ErrorFeedback: the wrapped codec {self.codec.name!r} has no state to load")
            self.codec.load_state_dict(inner)
        self._residual = None if residual is None else residual.detach().clone()

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.codec!r})"
