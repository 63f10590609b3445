"""Scale-out EPD: encoders as their own servers, reached by ``epd`` over gRPC (docs/scale-out.md).

- ``routing``: which encoder an image goes to (the one rule, :func:`routing.home`), and for
  remote servers bounded load and a circuit breaker per encoder;
- ``endpoints``: the encoder list from ``HOST:PORT,...``, ``dns:NAME:PORT`` or a file;
- ``membership``: which encoder servers are admitted (probe key check) and ready;
- ``remote``: encode on them with failover, and the ``epd`` stages that use it;
- ``wire``: the gRPC calls to an encoder server's ``encoder_0``;
- ``digest``: the digest an embedding carries across nodes;
- ``stats``: the counters and their export as Triton metrics.
"""
