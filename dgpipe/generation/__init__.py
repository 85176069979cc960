"""Split generation for decoder LMs: a client holds the embeddings, the first and last blocks and the head,
a server the blocks between, and text is generated through the link, each side with a KV cache.

The layers are those of :func:`dgpipe.models.causal_lm.causal_lm_layers` (shared with the model), cut as
``client_server_split`` cuts them for training: the client runs ``[embeddings, blocks[:k]]``, the server
``blocks[k:N-k]``, the client ``[blocks[N-k:], head]``. Generation is a prefill of the prompts (a batch,
left-padded, with their attention mask) and then one token per step; every step sends one message each
way: the client's hidden states ``(B, L, H)`` to the server (L = the prompt length at prefill, 1 after),
the server's back. Each direction has its own codec (any of :func:`dgpipe.compression.get_codec`'s, as in
training: ``act_codec`` client -> server, ``return_codec`` server -> client); the prompt's padding mask goes
once, losslessly (``intpack``), at prefill; the server keeps its own copy, grown by one column a step, and
derives the positions from it exactly as the client does. Each block keeps its keys and values in its
stage's ``transformers.DynamicCache``.

A model trained with boundary bottlenecks (:mod:`dgpipe.models.bottleneck`) is split where it was trained: the
client's front ends with the encoder of the first pair, the server starts with its decoder and ends with the
encoder of the second, and the client's back starts with that decoder, so each direction carries its pair's
channels (:class:`StageBlocks`: ``width_in``/``width_out``). Anchored pairs (``--bottleneck-anchor``, a residual
subspace) rebuild a token table's rows on both sides of a boundary, so every client message then also carries the
new tokens' ids (``intpack``; :attr:`ClientStages.sends_ids`, ``RemoteServer(send_ids=True)``), which the server
checks against its vocabulary: the prompt's text leaves the client.

What the unsplit ``model.generate`` computes, step for step: positions ``cumsum(mask) - 1`` (0 at pads)
and one more per step; no mask at all when the prompts have no padding; greedy decoding or sampling with
temperature, top-k and top-p applied in that order to the last position's logits (as ``transformers``'
logits warpers do) and ``torch.multinomial`` on the softmax; rows that produced EOS go on with the pad
token until every row has or the token budget is spent. With a lossless codec (``none``) the tokens are
the unsplit model's, and sampling with the same seed draws the same tokens (tested).

With ``channel_mean``, each direction is coded as its residual against running per-channel means that both
sides keep alike (:func:`~dgpipe.compression.wrappers.reference.position_keys`: a sequence's first position,
later positions, padding), updated from every message's decoded rows; no token id crosses the link for them. A decoder's
hidden states carry a large mean per channel and a far larger first position (SmolLM2-135M: the 4-bit
codebook's perplexity cost falls from +8.8% to +1.7%, ``benchmarks/lm_generate_quality.py``). With
``channel_scale`` the residual's channels are also weighed by their running variance ** -1/4 (4 bits: +1.2%;
5 levels: +4.0%).

The wire: every message is a :class:`dgpipe.comm.transport.Sender` message whose meta is integers
(:data:`PREFILL`, :data:`DECODE`, :data:`END`, :data:`HIDDEN`, the past length, the batch size and the
step's length), checked on arrival -- nothing is unpickled. The server trusts nothing a client sends
(:class:`ServerLimits`): before it decodes or allocates anything it checks the meta (batch >= 1, length >= 1,
``past + length`` within the context it serves, ``batch x (past + length)`` within its token budget) and
every payload's header (the stream's codec; hidden states ``(batch, length, H)`` in the blocks' dtype; a
prompt mask ``(batch, length)`` of integers), and bounds the message's size by what those limits allow; a
message that does not fit is refused with a one-line ``ValueError`` that names the peer and the field
(``client (rank 0) sent ...``), and :func:`serve` ends. The client checks the server's answers the same way
(``server (rank 1) sent ...``). A dead or stalled peer raises the transport's ``TransportError`` within
``timeout``. The :class:`~dgpipe.comm.BandwidthMeter` records each
direction (``client->server`` / ``server->client``, direction ``"generate"``).

Reference: split inference of decoder LMs over a network as in Petals (Borzunov et al., "Petals:
Collaborative Inference and Fine-tuning of Large Models", ACL 2023 demo), which sends 16-bit hidden states.
"""

from .client import RemoteServer, Sampling, generate, score
from .protocol import ALPHA, DECODE, END, HIDDEN, PREFILL, TAG, ServerLimits
from .server import LocalServer, serve
from .stages import ClientStages, StageBlocks

__all__ = ["Sampling", "StageBlocks", "ClientStages", "LocalServer", "RemoteServer", "ServerLimits", "serve",
           "generate", "score", "ALPHA", "PREFILL", "DECODE", "END", "HIDDEN", "TAG"]
