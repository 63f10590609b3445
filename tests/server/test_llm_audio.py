"""An audio checkpoint over the wire (issue 34): the tiny Qwen2-Audio served from its own generated
repository. ``llm``: clips of 1-30 s in four containers give offline vLLM's greedy tokens on the
same samples; ``epd`` (disaggregated: the clip stops at the encoders, prefill and decode get
references) gives the same tokens, encoded and from the store; every kind of bad audio is
refused with INVALID_ARG naming the problem in bounded memory, and the server serves on. The
encoders (``encoder_<i>`` -> ``audio_encoder``): each clip's embeddings in the node store by
reference, equal to the ONNX encoder's on transformers' features of the same samples, a hit for
every encoder after the first encode.

The repository holds ``llm``, ``epd``, ``prefill``, ``decode``, ``audio_encoder`` and the encoders
(an audio checkpoint has no image models): three engine starts, plus one offline engine for the
reference tokens.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import queue
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from bench.audio_clips import BAD_AUDIO, CLIP, encoded, tone, wav
from builders.default_model import DEFAULT_AUDIO_MODEL_DIR, build_default_model
from builders.launcher import prepare
from builders.stage_watch import find_role, peak_rss
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer
from client.epd_client import ClientError, GrpcClient, HttpClient, chat_prompt
from python_backends import contract
from python_backends.request.audios import AudioLimits, decode_audio
from python_backends.request.generate import AUDIO_PLACEHOLDER
from python_backends.store import EmbeddingStore, StoreConfig
from tests.server.conftest import (
    CACHE_POLICY,
    LOG_DIR,
    SERVER_REPOSITORY,
    TEST_EXIT_TIMEOUT_S,
    _client,
    openai_api,
    serving,
)

pytestmark = pytest.mark.server

GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
CHAT = "<|im_start|>user\nAudio 1: " + AUDIO_PLACEHOLDER + "\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"

# Eight clips of 1-30 s in four containers (WAV, FLAC, MP3, Ogg Opus/Vorbis), mono and stereo, at
# 16, 44.1 and 48 kHz: name -> (the file, the prompt).
CLIPS: dict[str, tuple[Callable[[], bytes], str]] = {
    "wav 1 s": (lambda: wav(tone(1.0, 300.0, seed=1)), "What is it?"),
    "wav stereo 7.5 s": (lambda: wav(tone(7.5, 520.0, seed=2), channels=2), CHAT),
    "wav 44.1 kHz 4 s": (lambda: wav(tone(4.0, 660.0, seed=3, rate=44_100), rate=44_100), "Describe the sound."),
    "flac 3.5 s": (lambda: encoded(tone(3.5, 880.0, seed=4), "flac", "flac"), CHAT),
    "flac 30 s": (lambda: encoded(tone(30.0, 250.0, seed=5), "flac", "flac"), "What is it?"),
    "mp3 10 s": (lambda: encoded(tone(10.0, 440.0, seed=6), "mp3", "libmp3lame"), CHAT),
    "ogg opus 48 kHz 12 s": (
        lambda: encoded(tone(12.0, 1000.0, seed=7, rate=48_000), "ogg", "libopus", 48_000), "What is it?"
    ),
    "ogg vorbis 20 s": (lambda: encoded(tone(20.0, 150.0, seed=8), "ogg", "libvorbis"), CHAT),
}


def seconds_of(name: str) -> float:
    return float(name.split()[-2])


AUDIO_REPOSITORY = SERVER_REPOSITORY.with_name(SERVER_REPOSITORY.name.replace("repository", "audio-repository"))


@pytest.fixture(scope="module")
def audio_store(node_dir: Path) -> Path:
    """The audio server's node store: in the slot's folder, apart from the session server's."""
    return node_dir / "audio-embeddings"


@pytest.fixture(scope="module")
def audio_repository(audio_store: Path) -> Path:
    model_dir = build_default_model(DEFAULT_AUDIO_MODEL_DIR, recipe="qwen2-audio")
    prepare("cpu", model_dir, AUDIO_REPOSITORY, cache=dataclasses.replace(CACHE_POLICY, path=str(audio_store)))
    return AUDIO_REPOSITORY


@pytest.fixture(scope="module")
def audio_server(audio_repository: Path) -> Iterator[TritonServer]:
    # The forwarding experiment's baseline allowed (test_the_raw_forwarding_baseline_...).
    options = ServerOptions(audio_repository, Ports.free(), exit_timeout_s=TEST_EXIT_TIMEOUT_S,
                            extra_env={contract.ALLOW_RAW_FORWARDING_ENV: "1"})  # fmt: skip
    with serving(options, LOG_DIR / "llm-audio.log") as running:
        yield running


@pytest.fixture(scope="module")
def clip_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("clips")
    files = {}
    for i, (name, (make, _)) in enumerate(CLIPS.items()):
        files[name] = folder / f"clip{i}"
        files[name].write_bytes(make())
    return files


@pytest.fixture(scope="module")
def offline_tokens(
    clip_files: dict[str, Path], audio_repository: Path, audio_server: TritonServer
) -> dict[str, list[int]]:
    """vLLM's own tokens for each clip, decoded as ``llm`` decodes (after the server: one vLLM
    start at a time), and for the two-clip case."""
    cases = [{"prompt": CLIPS[name][1], "audios": [str(path)], "sampling": GREEDY} for name, path in clip_files.items()]
    cases.append({"prompt": "Compare them.", "audios": [str(clip_files["wav 1 s"]), str(clip_files["mp3 10 s"])],
                  "sampling": GREEDY})  # fmt: skip
    folder = clip_files["wav 1 s"].parent
    cases_path, out_path = folder / "cases.json", folder / "out.json"
    cases_path.write_text(json.dumps(cases))
    engine_args = audio_repository / contract.LLM_MODEL / "1" / "engine_args.json"
    script = Path(__file__).with_name("offline_vllm.py")
    subprocess.run([sys.executable, str(script), str(cases_path), str(out_path), str(engine_args)],
                   check=True, cwd=REPO_ROOT, timeout=900)  # fmt: skip
    tokens = json.loads(out_path.read_text())
    return {**dict(zip(CLIPS, tokens, strict=False)), "two clips": tokens[-1]}


@pytest.fixture
def llm(audio_server: TritonServer) -> Iterator[GrpcClient]:
    yield from _client(audio_server, contract.LLM_MODEL)


@pytest.fixture
def http_llm(audio_server: TritonServer) -> Iterator[HttpClient]:
    client = HttpClient(audio_server.http_url, contract.LLM_MODEL)
    yield client
    client.close()


def test_clips_in_four_containers_give_offline_vllms_tokens(
    llm: GrpcClient, clip_files: dict[str, Path], offline_tokens: dict[str, list[int]]
) -> None:
    for name, path in clip_files.items():
        result = llm.generate(CLIPS[name][1], sampling=GREEDY, audios=[path.read_bytes()])
        assert result.token_ids == offline_tokens[name], name
        # The clip's audio tokens are in the prompt: 25 a second (Whisper's 100 frames, halved twice).
        assert result.num_input_tokens >= 25 * seconds_of(name), name
    two = [clip_files["wav 1 s"].read_bytes(), clip_files["mp3 10 s"].read_bytes()]
    assert llm.generate("Compare them.", sampling=GREEDY, audios=two).token_ids == offline_tokens["two clips"]
    # Not one answer for everything: the clips steer the tokens.
    assert len({tuple(tokens) for tokens in offline_tokens.values()}) >= 6


@pytest.fixture
def epd(audio_server: TritonServer) -> Iterator[GrpcClient]:
    yield from _client(audio_server, contract.EPD_MODEL)


def test_epd_gives_llms_tokens_on_every_clip_on_both_paths_encoded_and_from_the_store(
    epd: GrpcClient, clip_files: dict[str, Path], offline_tokens: dict[str, list[int]]
) -> None:
    """``epd`` answers every clip with vLLM's tokens from the raw clip (``llm``'s), on both paths
    (disaggregated: encoders -> store -> prefill -> decode, the clip never past the encoders;
    colocated: encoders -> store -> epd's own engine), each first encoded and then from the store
    (sent as base64 the second time: the same entry): half the clips first on each path."""
    paths = ("disaggregated", "colocated")
    for index, (name, path) in enumerate(clip_files.items()):
        clip = path.read_bytes()
        first_path, then_path = paths if index % 2 == 0 else paths[::-1]
        first = epd.generate(CLIPS[name][1], sampling=GREEDY, audios=[clip], parameters={"path": first_path})
        assert first.token_ids == offline_tokens[name] and first.cache_hits == 0, (name, first_path)
        assert "encode" in first.timings_ms, name
        again = epd.generate(CLIPS[name][1], sampling=GREEDY, audios=[base64.b64encode(clip)],
                             parameters={"path": then_path})  # fmt: skip
        assert again.token_ids == offline_tokens[name] and again.cache_hits == 1, (name, then_path)
        assert "encode" not in again.timings_ms, name
    two = [clip_files["wav 1 s"].read_bytes(), clip_files["mp3 10 s"].read_bytes()]
    assert epd.generate("Compare them.", sampling=GREEDY, audios=two).token_ids == offline_tokens["two clips"]


def test_the_raw_forwarding_baseline_reprocesses_each_clip_on_prefill_for_the_same_tokens(
    audio_server: TritonServer, epd: GrpcClient, clip_files: dict[str, Path], offline_tokens: dict[str, list[int]]
) -> None:
    """The article's baseline (request parameter forward_media=raw): the clip goes on to prefill,
    which decodes and re-extracts it (the reference's token count checked there); same tokens."""
    from bench.server_stats import scrape_required

    def media_bytes() -> float:
        metrics = scrape_required(f"http://127.0.0.1:{audio_server.options.ports.metrics}/metrics")
        return sum(v for (name, labels), v in metrics.counters.items()
                   if name == "epd_prefill_input_bytes" and ("kind", "media") in labels)  # fmt: skip

    before = media_bytes()
    clip = clip_files["ogg vorbis 20 s"].read_bytes()
    raw = epd.generate(CLIPS["ogg vorbis 20 s"][1], sampling=GREEDY, audios=[clip],
                       parameters={"forward_media": "raw", "path": "disaggregated"})  # fmt: skip
    assert raw.token_ids == offline_tokens["ogg vorbis 20 s"]
    assert media_bytes() - before == len(clip)  # the clip itself crossed into prefill


def test_http_with_base64_audio_gives_the_same_tokens(
    http_llm: HttpClient, clip_files: dict[str, Path], offline_tokens: dict[str, list[int]]
) -> None:
    for name in ("flac 3.5 s", "ogg opus 48 kHz 12 s"):
        result = http_llm.generate(CLIPS[name][1], sampling=GREEDY, audios=[clip_files[name].read_bytes()])
        assert result.token_ids == offline_tokens[name], name


def test_the_model_declares_audio_and_no_image_input(audio_server: TritonServer, http_llm: HttpClient) -> None:
    import tritonclient.grpc as grpcclient

    metadata = grpcclient.InferenceServerClient(audio_server.grpc_url).get_model_metadata(contract.LLM_MODEL)
    inputs = {tensor.name for tensor in metadata.inputs}
    assert contract.AUDIO in inputs and not inputs & {contract.IMAGE, contract.VIDEO, contract.IMAGE_EMBEDS}
    with pytest.raises(ClientError) as caught:
        http_llm.generate("What is it?", audios=[wav(CLIP)] * 3, sampling=GREEDY)
    assert caught.value.status == "400"
    assert "request has 3 audios, above the limit of 2 (max_audios)" in str(caught.value)


def test_bad_audio_is_invalid_arg_in_bounded_memory_and_the_server_serves_on(
    audio_server: TritonServer, http_llm: HttpClient, llm: GrpcClient, offline_tokens: dict[str, list[int]],
    clip_files: dict[str, Path],
) -> None:
    # Where clips are decoded: llm's stub, and the encoders' for epd.
    stubs = {name: find_role(audio_server.process.pid, f"stub:{name}") for name in ("llm", "encoder_0", "encoder_1")}
    peaks_before = {name: peak_rss(pid) for name, pid in stubs.items()}
    bad = {name: case for name, case in BAD_AUDIO.items() if name != "too many bytes"}
    bad["above max_audio_bytes"] = (lambda: b"RIFF" + bytes(25 << 20), "above the limit of 26214400 (max_audio_bytes)")
    http_epd = HttpClient(audio_server.http_url, contract.EPD_MODEL)
    for name, (make, says) in bad.items():
        with pytest.raises(ClientError) as caught:
            http_llm.generate("What is it?", audios=[wav(CLIP), make()], sampling=GREEDY)
        assert caught.value.status == "400", name
        message = str(caught.value)
        assert message.startswith("audio[1]: ") and says in message, (name, message)
        with pytest.raises(ClientError) as caught:  # epd: refused at its edge or by its encoder
            http_epd.generate("What is it?", audios=[wav(CLIP), make()], sampling=GREEDY)
        assert caught.value.status == "400" and "audio[1]: " in str(caught.value) and says in str(caught.value), name
    http_epd.close()
    # Nothing was decoded at length: no stub's peak resident memory moved much (the 37-hour header
    # alone would have been 8.6 GB of samples; the 25 MiB file is held as bytes a few times).
    for name, pid in stubs.items():
        before = peaks_before[name]
        assert before is not None and (peak_rss(pid) or 0) - before < 256 << 20, name
    result = llm.generate(CLIPS["mp3 10 s"][1], sampling=GREEDY, audios=[clip_files["mp3 10 s"].read_bytes()])
    assert result.token_ids == offline_tokens["mp3 10 s"]


@pytest.fixture(scope="module")
def api_url(audio_server: TritonServer) -> Iterator[str]:
    with openai_api(audio_server.grpc_url, DEFAULT_AUDIO_MODEL_DIR, LOG_DIR / "openai-audio.log") as url:
        yield url


def test_the_openai_package_sends_input_audio_and_gets_llms_tokens(
    api_url: str, llm: GrpcClient, clip_files: dict[str, Path]
) -> None:
    import openai

    clip = clip_files["mp3 10 s"].read_bytes()
    data = base64.b64encode(clip).decode()
    expected = llm.generate(chat_prompt("What is it?", 0, num_audios=1), sampling=GREEDY, audios=[clip])
    parts = {
        "input_audio": {"type": "input_audio", "input_audio": {"data": data, "format": "mp3"}},
        "audio_url": {"type": "audio_url", "audio_url": {"url": f"data:audio/mpeg;base64,{data}"}},
    }
    with openai.OpenAI(base_url=f"{api_url}/v1", api_key="unused", max_retries=0, timeout=300) as api:
        for kind, part in parts.items():
            answer = api.chat.completions.create(
                model=contract.LLM_MODEL,
                messages=[{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}],  # type: ignore[list-item, misc]
                max_tokens=GREEDY["max_tokens"], temperature=0.0, extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert answer.choices[0].message.content == expected.text, kind
            assert answer.usage is not None and answer.usage.completion_tokens == len(expected.token_ids), kind
            assert answer.usage.prompt_tokens == expected.num_input_tokens, kind


def encode(server: TritonServer, clips: list[bytes], model: str) -> tuple[list[bytes], list[bool]]:
    """An encoder model's references and cache hits for ``clips`` (no lease), or ClientError."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        audio = grpcclient.InferInput(contract.AUDIO, [len(clips)], "BYTES")
        audio.set_data_from_numpy(np.array(clips, dtype=np.object_))
        client.async_stream_infer(model, [audio])
        result, error = answers.get(timeout=300)
        if error is not None:
            raise ClientError(error.message())
        hits = [bool(hit) for hit in result.as_numpy(contract.CACHE_HIT).reshape(-1)]
        return [bytes(r) for r in result.as_numpy(contract.REFERENCES).reshape(-1)], hits
    finally:
        client.stop_stream()
        client.close()


def test_encoders_store_each_clips_embeddings_by_reference(
    audio_server: TritonServer, audio_repository: Path, audio_store: Path
) -> None:
    """A clip through encoder_0: a reference (audio, its 25 tokens a second) to embeddings equal to
    the ONNX encoder's on transformers' features of the same samples; the same clip as base64 to
    encoder_1: the same entry, a hit."""
    import onnxruntime as ort
    from transformers import WhisperFeatureExtractor

    from builders.audio_encoder import onnx_embeddings

    # Clips no other test sent (epd's test stored every clip of CLIPS).
    made = {
        "flac 6.0 s": encoded(tone(6.0, 520.0, seed=21), "flac", "flac"),
        "mp3 10.0 s": encoded(tone(10.0, 360.0, seed=22), "mp3", "libmp3lame"),
    }
    names, clips = list(made), list(made.values())
    references, hits = encode(audio_server, clips, "encoder_0")
    assert hits == [False, False]
    again, hits = encode(audio_server, [base64.b64encode(clip) for clip in clips], "encoder_1")
    assert again == references and hits == [True, True]

    extractor = WhisperFeatureExtractor.from_pretrained(DEFAULT_AUDIO_MODEL_DIR)
    session = ort.InferenceSession(str(audio_repository / "audio_encoder" / "1" / "model.onnx"))
    store = EmbeddingStore(StoreConfig(path=str(audio_store), capacity_bytes=CACHE_POLICY.capacity_bytes))
    for name, clip, raw in zip(names, clips, references, strict=True):
        reference = store.parse_reference(raw)
        assert reference.modality == "audio" and reference.grid_thw is None, name
        assert reference.num_placeholders == int(25 * seconds_of(name)), name
        samples = decode_audio(clip, 0, AudioLimits(), 16_000)
        features = extractor(samples, sampling_rate=16_000, padding="max_length", return_attention_mask=True)
        lengths = features["attention_mask"].sum(-1).astype(np.int64)
        (expected,) = onnx_embeddings(session, features["input_features"].astype(np.float32), lengths)
        with store.open_view(reference) as stored:
            assert stored.shape == expected.shape, name
            assert float(np.abs(np.asarray(stored) - expected).max()) < 1e-4, name


def test_an_encoder_refuses_bad_audio_naming_the_clip_and_serves_on(
    audio_server: TritonServer, clip_files: dict[str, Path]
) -> None:
    good = clip_files["wav 1 s"].read_bytes()
    for name in ("not audio", "truncated wav", "header claims hours"):
        make, says = BAD_AUDIO[name]
        with pytest.raises(ClientError) as caught:
            encode(audio_server, [good, make()], "encoder_0")
        assert str(caught.value).startswith("audio[1]: ") and says in str(caught.value), (name, caught.value)
    assert len(encode(audio_server, [good], "encoder_0")[0]) == 1
