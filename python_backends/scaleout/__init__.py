"""Scale-out EPD (issue 13): encoders as their own servers, reached by ``epd`` over gRPC.

- ``routing``: rendezvous hashing with bounded load, a circuit breaker per encoder;
- ``endpoints``: the encoder list from ``HOST:PORT,...``, ``dns:NAME:PORT`` or a file.
"""
