"""Moving payloads between ranks and measuring the traffic. Imports only ``dgpipe.compression``.

- :mod:`dgpipe.comm.link`: ``Link``, the one way a payload moves: the caller's codecs timed, the message framed
  and sent (or framed for torch's own transport), received and checked whole, decoded, and every step recorded
  in the meters; the runtime's boundaries, torch's schedules' stage, split generation and the data-parallel
  hooks all move their traffic through it, and nothing else records into a meter.
- :mod:`dgpipe.comm.framing`: the wire format, the one place payloads become bytes and back: point-to-point
  messages (int64 fields and headers, the tensors, a closing word) and the data-parallel hooks' all-gather
  frames (varint headers), each read back validated before anything is allocated.
- :mod:`dgpipe.comm.transport`: ``send_payload`` / ``recv_payload`` of a codec
  ``Payload`` (and ``Sender`` / ``Receiver`` streams of messages with several payloads
  and meta integers) over torch.distributed point-to-point messages (int64 fields,
  headers, tensor bytes; never pickled), with timeouts that name the failed peer.
- :mod:`dgpipe.comm.delay`: ``DelayLine``, an emulated one-way latency that holds every send back
  (benchmarks on kernels without ``netem``).
- :mod:`dgpipe.comm.meter`: ``BandwidthMeter``, bytes and seconds per boundary and
  direction, gathered to rank 0 with tensor collectives.
- :mod:`dgpipe.comm.probe`: ``pingpong_seconds`` (message time between two ranks) and
  ``fit_latency_bandwidth`` (``seconds = latency + bytes / bandwidth``).
- :mod:`dgpipe.comm.slow_link`: ``SlowLink``, a real throttled TCP link on one machine
  (network namespace, veth pair, ``tc``); standard library only, needs root.
"""

from .link import Incoming, Link, Outgoing
from .meter import BandwidthMeter
from .transport import Receiver, Sender, SendWork, TransportError, recv_payload, send_payload, wire_device

__all__ = [
    "BandwidthMeter",
    "Incoming",
    "Link",
    "Outgoing",
    "Receiver",
    "SendWork",
    "Sender",
    "TransportError",
    "recv_payload",
    "send_payload",
    "wire_device",
]
