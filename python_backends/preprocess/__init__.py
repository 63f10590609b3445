"""Media -> pixels: the DALI pipelines (built once, serialized by builders/, run by both targets)
and their CPU runners (Triton-free).
"""
