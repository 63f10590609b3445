"""The user-facing request: inputs, sampling parameters, media limits and checks, tenants, the
request's Triton parameters (Triton-free).
"""
