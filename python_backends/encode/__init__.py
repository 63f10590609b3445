"""Pixels -> embeddings: the ONNX vision tower under ONNX Runtime, and the encoder models in front
of the embedding store (Triton-free).
"""
