"""How far the DALI audio pipeline's features are from transformers' WhisperFeatureExtractor, per
container, codec and sample rate (issue 34).

Two references, each then through the feature extractor: FFmpeg's decode to mono float32 at
16 kHz (:func:`ffmpeg_samples`) and what vLLM does with the same file on a raw-audio request
(:func:`vllm_samples`). A row says how many samples each decoded, and the features' max and mean
absolute difference from DALI's. The last column is what is served
(:mod:`python_backends.preprocess.audio`: FFmpeg decodes, DALI makes the features from its samples)
against the feature extractor on the same samples.

CLI: ``python -m bench.audio_parity [--out DIR]`` prints a markdown table (and writes it to
DIR/audio_parity.md).
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.audio_clips import SAMPLING_RATE, encoded, tone, wav

SECONDS = 3.5


def cases() -> dict[str, Callable[[], bytes]]:
    clip = tone(SECONDS, 880.0, seed=1)
    return {
        "WAV 16 kHz mono": lambda: wav(clip),
        "WAV 16 kHz stereo": lambda: wav(clip, channels=2),
        "FLAC 16 kHz": lambda: encoded(clip, "flac", "flac"),
        "WAV 44.1 kHz (resampled)": lambda: wav(tone(SECONDS, 880.0, seed=1, rate=44_100), rate=44_100),
        "Ogg Opus 48 kHz (resampled)": lambda: encoded(
            tone(SECONDS, 880.0, seed=1, rate=48_000), "ogg", "libopus", 48_000
        ),
        "Ogg Vorbis 16 kHz": lambda: encoded(clip, "ogg", "libvorbis"),
        "MP3 16 kHz": lambda: encoded(clip, "mp3", "libmp3lame"),
    }


def ffmpeg_samples(data: bytes) -> np.ndarray:
    """Mono float32 in [-1, 1] at 16 kHz, decoded, downmixed and resampled by FFmpeg (PyAV)."""
    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLING_RATE)
    chunks: list[np.ndarray] = []
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(audio=0):
            chunks += [out.to_ndarray()[0] for out in resampler.resample(frame)]
    chunks += [out.to_ndarray()[0] for out in resampler.resample(None)]
    return np.concatenate(chunks)


def vllm_samples(data: bytes) -> np.ndarray:
    """What vLLM 0.32 makes of the file for a raw-audio request: its loader (here PyAV: no
    torchcodec or soundfile), then its resampler to 16 kHz (PyAV's: its default, torchaudio, is
    not installed)."""
    from vllm.multimodal.audio import AudioResampler
    from vllm.multimodal.media.audio import load_audio

    samples, rate = load_audio(io.BytesIO(data), sr=None)
    return AudioResampler(SAMPLING_RATE, method="pyav").resample(samples, orig_sr=rate).astype(np.float32)


REFERENCES = {"FFmpeg": ffmpeg_samples, "vLLM": vllm_samples}


def measure() -> list[dict[str, object]]:
    from transformers import WhisperFeatureExtractor

    from python_backends.preprocess.audio_pipeline import AudioFeatureConfig, serialize_audio_pipeline
    from python_backends.preprocess.runner import DaliCpuRunner

    config = AudioFeatureConfig()
    extractor = WhisperFeatureExtractor(feature_size=config.feature_size)
    pipeline = serialize_audio_pipeline(config, max_batch_size=1)
    from python_backends.preprocess.audio import DaliAudioFeatures
    from python_backends.request.audios import AudioLimits, decode_audio

    ours = DaliAudioFeatures.of_config(config, max_batch_size=1, num_threads=1)
    rows: list[dict[str, object]] = []
    for name, make in cases().items():
        data = make()
        row: dict[str, object] = {"case": name, "bytes": len(data)}
        samples_ours = decode_audio(data, 0, AudioLimits(), SAMPLING_RATE)
        expected_ours = extractor(samples_ours, sampling_rate=SAMPLING_RATE, padding="max_length")
        served = ours.features([samples_ours])[0].features
        row["ours"] = f"{np.abs(served - expected_ours['input_features'][0]).max():.1e}"
        try:  # a fresh runner per file: DALI's state after an error is not reused
            features, samples = DaliCpuRunner(pipeline, 1, 1)._run_feeds({"audio": [np.frombuffer(data, np.uint8)]})
            row["DALI"] = int(np.array(samples[0])[0])
        except RuntimeError:
            features, row["DALI"] = None, "refused"
        for reference, decode in REFERENCES.items():
            samples_ref = decode(data)
            row[reference] = samples_ref.size
            if features is not None:
                expected = extractor(samples_ref, sampling_rate=SAMPLING_RATE, padding="max_length")
                difference = np.abs(np.array(features[0]) - expected["input_features"][0])
                row[f"{reference} diff"] = f"{difference.max():.1e} / {difference.mean():.1e}"
        rows.append(row)
    return rows


def table(rows: list[dict[str, object]]) -> str:
    lines = [
        "| file | bytes | samples DALI / FFmpeg / vLLM | vs FFmpeg: max / mean diff | vs vLLM: max / mean diff "
        "| served (FFmpeg decode + DALI features): max diff |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        counts = f"{row['DALI']} / {row['FFmpeg']} / {row['vLLM']}"
        ffmpeg, vllm = row.get("FFmpeg diff", "-"), row.get("vLLM diff", "-")
        lines.append(f"| {row['case']} | {row['bytes']:,} | {counts} | {ffmpeg} | {vllm} | {row['ours']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.audio_parity", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/latest/audio-parity"))
    args = parser.parse_args(argv)
    text = table(measure())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "audio_parity.md").write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
