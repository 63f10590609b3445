"""The Triton edge: the modules of this package are the only ones under ``python_backends``
that import ``triton_python_backend_utils`` (``pb_utils``).

- ``responses``: request inputs -> numpy; chunks and arrays -> response tensors; errors -> codes.
- ``decoupled``: :class:`~python_backends.triton_edge.decoupled.DecoupledModel`, the base of every
  streaming ``model.py`` with the one error and cancel policy, and ``CancelWatch``.
- ``bls``: the stage calls that ``epd`` and the encoder models make over BLS.
- ``metrics``: a model's custom metrics on Triton's /metrics, released in one place.
- ``logs``: the ``python_backends`` loggers routed into Triton's log.

``pb_utils`` exists only inside the python-backend stub process; unit tests install a stub
(tests/unit/conftest.py). Everything else under ``python_backends`` is plain Python.
"""
