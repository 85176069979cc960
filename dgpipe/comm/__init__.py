"""Moving payloads between ranks and measuring the traffic. Imports only ``dgpipe.compression``.

- :mod:`dgpipe.comm.transport`: ``send_payload`` / ``recv_payload`` of a codec
  ``Payload`` over torch.distributed point-to-point messages (preamble, int64 header,
  tensors; never pickled), with timeouts that name the failed peer.
- :mod:`dgpipe.comm.meter`: ``BandwidthMeter``, bytes and seconds per boundary and
  direction, gathered to rank 0 with tensor collectives.
"""

from .meter import BandwidthMeter
from .transport import SendWork, TransportError, recv_payload, send_payload, wire_device

__all__ = ["BandwidthMeter", "SendWork", "TransportError", "recv_payload", "send_payload", "wire_device"]
