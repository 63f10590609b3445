"""The audio encoder (encoder + projector of a Qwen2-Audio checkpoint, ``builders/audio_encoder.py``'s
graph) under ONNX Runtime: Whisper features and their lengths in, each clip's embeddings out.

The graph masks each clip's padding frames itself (vLLM's mask), so a caller passes what the
features pipeline gives. Plain Python: no Triton import.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from python_backends import contract
from python_backends.errors import invalid_arg


class OnnxAudioEncoder:
    def __init__(
        self, onnx_path: str | Path, providers: Sequence[str] = ("CPUExecutionProvider",), intra_op_threads: int = 0
    ) -> None:
        import onnxruntime as ort  # heavy import stays out of callers that only need the module

        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads  # 0: ORT's default (all cores)
        self._session = ort.InferenceSession(str(onnx_path), sess_options=options, providers=list(providers))
        features = self._session.get_inputs()[0].shape  # [clips, mel bins, frames]
        self.mel_bins, self.frames = int(features[1]), int(features[2])

    def encode(self, features: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``features`` [clips, mel bins, frames], ``lengths`` [clips] -> (embeddings [clips,
        padded tokens, hidden], tokens [clips]): clip ``i``'s are ``embeddings[i, :tokens[i]]``."""
        if features.ndim != 3 or features.shape[1:] != (self.mel_bins, self.frames):
            expected = [-1, self.mel_bins, self.frames]
            raise invalid_arg(f"'{contract.INPUT_FEATURES}' must be {expected}, got {list(features.shape)}")
        if lengths.shape != (features.shape[0],) or not ((lengths > 0) & (lengths <= self.frames)).all():
            raise invalid_arg(f"'{contract.FEATURE_LENGTHS}' must hold one length in 1..{self.frames} per clip")
        embeds, tokens = self._session.run(
            [contract.AUDIO_EMBEDS, contract.AUDIO_TOKENS],
            {contract.INPUT_FEATURES: features.astype(np.float32, copy=False), contract.FEATURE_LENGTHS: lengths},
        )
        return embeds, tokens
