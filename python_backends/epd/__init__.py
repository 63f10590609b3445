"""The ``epd`` orchestrator: hash -> lookup -> encode -> choose a path -> prefill/decode, and the
path cost model (Triton-free).
"""
