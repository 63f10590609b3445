"""Stress harnesses: long or destructive runs against a real tritonserver, not tests themselves.

``crash`` (``make crash``), ``soak`` (``make soak``) and ``cancel_storm`` (``make cancel-storm``)
write their tables under ``--out``; ``fault_load`` is the closed-loop load the first two drive.
tests/server/test_crash.py and test_soak.py run short versions of them. They import nothing from
``bench`` (see docs/development.md): bench ships, tests do not.
"""
