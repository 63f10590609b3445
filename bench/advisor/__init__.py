"""Layout advisor: a SimPy discrete-event model of colocated and xE+yP+zD serving
(docs/benchmarks/advisor.md).

- ``profiles``: hardware profiles (stage service times) as JSON under ``profiles/``.
- ``simulator``: the discrete-event model, fed with a profile, a layout and a workload.
- ``fit``: fits the CPU profile on measured bench points and checks predictions on others.
- ``cli``: ``triton-epd-advise`` (recommend a layout and path policy, plot predictions).
"""
