"""Seeded workloads: prompts, images (synthetic or from a folder), reuse, lengths.

Every request is a pure function of (seed, phase, load point, repetition, index), so a
workload is reproducible and every mode sees the same prompts and lengths. Media
identity is chosen with care because servers cache media (vLLM's processor cache, our
embedding store): a *unique* image is never sent twice in a run (its key includes the
point, repetition and index), while a *reused* image comes from a small pool shared by
the whole run, so it hits whatever cache the mode has. Unique images do not depend on
the mode, so greedy outputs can be compared across modes request by request.
"""

from __future__ import annotations

import dataclasses
import io
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image

from client.epd_client import chat_prompt

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
# Short common words; with a tokenizer the prompt is cut to an exact token count,
# without one each word counts as about one token.
FILLER_WORDS = (
    "the a of and to in is it on for as at by an be or we he do if up so no go my me "
    "cat sat mat sun sky sea red blue green tree road car dog bird hill house light "
    "water stone cloud river field city night day small large old new open near far"
).split()


# What the workload options default to, and the named workloads (``--workload``) of the EPD
# benchmark (docs/benchmarks/epd-pays.md): each sets these options' defaults.
WORKLOAD_DEFAULTS: dict[str, Any] = {
    "prompt_tokens": "32",
    "output_tokens": "32",
    "images_per_request": "1",
    "image_size": ["640x480"],
    "reuse_ratio": 0.0,
    "media_pool": 4,
}
# 0.26 to 1.0 MP, the article's range (its sizes: 0.26-0.79 MP; vLLM's EPD runs go to 1 MP).
ARTICLE_SIZES = ["512x512", "640x480", "800x600", "1024x768", "1000x1000"]
WORKLOADS: dict[str, dict[str, Any]] = {
    # (a) the article's regime, where splitting the encoder out should pay: heavy media, short
    # answers, every image new.
    "article": {"images_per_request": "4", "image_size": ARTICLE_SIZES, "output_tokens": "uniform:2:16"},
    # (b) one image and a long answer: decode dominates, splitting should not pay.
    "long-answer": {"images_per_request": "1", "image_size": ["640x480"], "output_tokens": "256"},
    # (c) the article's shape with 80% of images from a pool: the shared cache's regime.
    "reuse": {
        "images_per_request": "4", "image_size": ARTICLE_SIZES, "output_tokens": "uniform:2:16",
        "reuse_ratio": 0.8, "media_pool": 16,
    },  # fmt: skip
}


class WorkloadError(ValueError):
    """A workload option that cannot work (bad distribution text, empty image folder)."""


@dataclass(frozen=True)
class LengthDist:
    """A distribution of non-negative integers given as text on the command line.

    ``"128"`` (fixed), ``"uniform:64:256"`` (inclusive), ``"normal:128:32"`` (rounded,
    clipped at ``minimum``), ``"choice:0,1,2"`` (uniform over the listed values).
    """

    kind: str
    params: tuple[float, ...]
    minimum: int = 0

    @classmethod
    def parse(cls, text: str, minimum: int = 0) -> LengthDist:
        kind, _, rest = text.partition(":")
        try:
            if not rest:
                return cls("fixed", (float(int(kind)),), minimum)
            if kind == "uniform":
                low, high = (int(x) for x in rest.split(":"))
                if low > high:
                    raise WorkloadError(f"uniform:{low}:{high}: low > high")
                return cls(kind, (low, high), minimum)
            if kind == "normal":
                mean, std = (float(x) for x in rest.split(":"))
                return cls(kind, (mean, std), minimum)
            if kind == "choice":
                return cls(kind, tuple(float(int(x)) for x in rest.split(",")), minimum)
        except ValueError as exc:
            raise WorkloadError(f"cannot read length distribution {text!r}: {exc}") from None
        raise WorkloadError(
            f"unknown length distribution {text!r}: use N, uniform:LO:HI, normal:MEAN:STD or choice:A,B,..."
        )

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            value = self.params[0]
        elif self.kind == "uniform":
            value = rng.integers(int(self.params[0]), int(self.params[1]) + 1)
        elif self.kind == "normal":
            value = round(rng.normal(self.params[0], self.params[1]))
        else:
            value = self.params[int(rng.integers(len(self.params)))]
        return max(int(value), self.minimum)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.params[0]))
        if self.kind == "choice":
            return "choice:" + ",".join(str(int(p)) for p in self.params)
        return f"{self.kind}:" + ":".join(f"{p:g}" for p in self.params)


def parse_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise WorkloadError(f"image size {text!r} is not WIDTHxHEIGHT") from None
    if width < 1 or height < 1:
        raise WorkloadError(f"image size {text!r} must be positive")
    return width, height


@dataclass(frozen=True)
class WorkloadSpec:
    seed: int = 0
    prompt_tokens: LengthDist = LengthDist.parse("32", minimum=1)
    output_tokens: LengthDist = LengthDist.parse("32", minimum=1)
    images_per_request: LengthDist = LengthDist.parse("1")
    image_sizes: tuple[tuple[int, int], ...] = ((640, 480),)
    image_format: str = "JPEG"
    image_dir: Path | None = None
    # Fraction of image slots filled from the shared pool, for modes without a suffix
    # and for ``:repeated`` modes respectively.
    reuse_ratio: float = 0.0
    repeated_reuse_ratio: float = 1.0
    media_pool_size: int = 4
    ignore_eos: bool = True
    temperature: float = 0.0
    tokenizer: Path | None = None
    # Mixed into synthetic image content (not prompts or lengths). Caches that outlive a
    # server (our embedding store in /dev/shm) still hold the images of an earlier run with
    # the same seed; a salt of its own makes a run's "unique" images new to every server.
    media_salt: str = ""

    def __post_init__(self) -> None:
        for name in ("reuse_ratio", "repeated_reuse_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise WorkloadError(f"{name} must be within [0, 1]")
        if self.media_pool_size < 1:
            raise WorkloadError("media_pool_size must be >= 1")
        if not self.image_sizes:
            raise WorkloadError("give at least one image size")

    def describe(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "prompt_tokens": str(self.prompt_tokens),
            "output_tokens": str(self.output_tokens),
            "images_per_request": str(self.images_per_request),
            "image_sizes": [f"{w}x{h}" for w, h in self.image_sizes],
            "image_format": self.image_format,
            "image_dir": str(self.image_dir) if self.image_dir else None,
            "reuse_ratio": self.reuse_ratio,
            "repeated_reuse_ratio": self.repeated_reuse_ratio,
            "media_pool_size": self.media_pool_size,
            "ignore_eos": self.ignore_eos,
            "temperature": self.temperature,
            "tokenizer": str(self.tokenizer) if self.tokenizer else None,
            "media_salt": self.media_salt,
        }


@dataclass(frozen=True)
class BenchRequest:
    """One request as the load generator sends it (images already encoded)."""

    key: str
    prompt: str
    images: tuple[bytes, ...]
    sampling: dict[str, Any]
    reused_images: int = 0
    image_keys: tuple[str, ...] = field(default=(), repr=False)


class MediaSource(Protocol):
    def image(self, key: str, size: tuple[int, int]) -> bytes:
        """Encoded image bytes for ``key``: the same key always gives the same bytes."""


def _stable_seed(key: str) -> int:
    return zlib.crc32(key.encode("utf-8"))


@lru_cache(maxsize=256)  # pool images are asked for over and over
def synthetic_image(width: int, height: int, seed: int, fmt: str = "JPEG") -> bytes:
    """A deterministic picture with structure (gradients + random blocks), not flat noise;
    different seeds give different bytes, so caches keyed by content see distinct media."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], -1)
    blocks = rng.integers(0, 256, size=(8, 8, 3))
    tiled = blocks[y * 8 // height, x * 8 // width]
    pixels = ((base + tiled) // 2).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


@dataclass(frozen=True)
class SyntheticMedia:
    seed: int
    fmt: str = "JPEG"
    salt: str = ""  # WorkloadSpec.media_salt

    def image(self, key: str, size: tuple[int, int]) -> bytes:
        name = f"{self.seed}/{self.salt}/{key}" if self.salt else f"{self.seed}/{key}"
        return synthetic_image(size[0], size[1], _stable_seed(name), self.fmt)


class FolderMedia:
    """Real image files; a folder of K files gives at most K distinct images, so keys
    beyond that map onto files already used (unique media then repeats)."""

    def __init__(self, folder: Path, seed: int) -> None:
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise WorkloadError(f"no image files ({', '.join(IMAGE_SUFFIXES)}) in {folder}")
        order = np.random.default_rng(seed).permutation(len(files))
        self.files = [files[i] for i in order]

    def image(self, key: str, size: tuple[int, int]) -> bytes:  # real files keep their size
        return self.files[_stable_seed(key) % len(self.files)].read_bytes()


def media_source(spec: WorkloadSpec) -> MediaSource:
    return (
        FolderMedia(spec.image_dir, spec.seed)
        if spec.image_dir
        else SyntheticMedia(spec.seed, spec.image_format, spec.media_salt)
    )


class PromptMaker:
    """Text of an exact token count when a tokenizer file is given, about right otherwise."""

    def __init__(self, tokenizer_path: Path | None) -> None:
        self._tokenizer = None
        if tokenizer_path is not None:
            from tokenizers import Tokenizer  # optional, light

            self._tokenizer = Tokenizer.from_file(str(tokenizer_path))

    def text(self, num_tokens: int, rng: np.random.Generator) -> str:
        # Random word order keeps prompts distinct, so prefix caching cannot serve them.
        words = [FILLER_WORDS[i] for i in rng.integers(len(FILLER_WORDS), size=num_tokens)]
        text = " ".join(words)
        if self._tokenizer is None:
            return text
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids[:num_tokens]
        return self._tokenizer.decode(ids)


PHASES = {"measure": 0, "warmup": 1, "perf_analyzer": 2, "equality": 3}


@dataclass
class WorkloadBuilder:
    """Builds the requests of one (phase, point, repetition); cheap to keep for a run."""

    spec: WorkloadSpec
    media: MediaSource = field(init=False)
    prompts: PromptMaker = field(init=False)

    def __post_init__(self) -> None:
        self.media = media_source(self.spec)
        self.prompts = PromptMaker(self.spec.tokenizer)

    def build(
        self,
        count: int,
        reuse_ratio: float,
        phase: str = "measure",
        point: int = 0,
        rep: int = 0,
        identical: bool = False,
        namespace: str = "",
    ) -> list[BenchRequest]:
        """``count`` requests; ``namespace`` keeps unique images apart from other modes' (the same
        key in another namespace is another image)."""
        # Lengths and image counts do not depend on the reuse ratio (a separate stream),
        # so `llm` and `llm:repeated` get the same shapes of work.
        shapes = np.random.default_rng([self.spec.seed, PHASES[phase], point, rep, 0])
        reuse = np.random.default_rng([self.spec.seed, PHASES[phase], point, rep, 1])
        if identical:  # one request (first pool image, one prompt) sent `count` times
            one = self._request(f"{phase}/{point}/{rep}/0", shapes, reuse, 1.0, pool_index=0)
            return [dataclasses.replace(one, key=f"{phase}/{point}/{rep}/{i}") for i in range(count)]
        return [
            self._request(f"{phase}/{point}/{rep}/{i}", shapes, reuse, reuse_ratio, namespace=namespace)
            for i in range(count)
        ]

    def pool_primers(self) -> list[BenchRequest]:
        """One request per image of the reused pool, each showing that image only: the
        warm-up of a mode with reuse, so its measured requests find the whole pool cached
        (what "repeated media" means) instead of first-seen pool images in the first rep."""
        shapes = np.random.default_rng([self.spec.seed, PHASES["warmup"], 1 << 20])
        return [
            self._request(f"warmup/pool/{i}", shapes, np.random.default_rng(0), 1.0, pool_index=i, num_images=1)
            for i in range(self.spec.media_pool_size)
        ]

    def _request(
        self,
        key: str,
        shapes: np.random.Generator,
        reuse: np.random.Generator,
        reuse_ratio: float,
        pool_index: int | None = None,
        num_images: int | None = None,
        namespace: str = "",
    ) -> BenchRequest:
        spec = self.spec
        prompt_tokens = spec.prompt_tokens.sample(shapes)
        output_tokens = spec.output_tokens.sample(shapes)
        sampled_images = spec.images_per_request.sample(shapes)
        num_images = sampled_images if num_images is None else num_images
        text = self.prompts.text(prompt_tokens, shapes)
        images, keys, reused = [], [], 0
        for slot in range(num_images):
            size = spec.image_sizes[int(shapes.integers(len(spec.image_sizes)))]
            if pool_index is not None or reuse.random() < reuse_ratio:
                index = pool_index if pool_index is not None else int(reuse.integers(spec.media_pool_size))
                image_key = f"pool/{index}"
                # A pool image keeps one size, whatever the slot drew.
                size = spec.image_sizes[index % len(spec.image_sizes)]
                reused += 1
            else:
                image_key = f"unique/{namespace}{key}/{slot}"
            images.append(self.media.image(image_key, size))
            keys.append(image_key)
        return BenchRequest(
            key=key,
            prompt=chat_prompt(text, num_images),
            images=tuple(images),
            sampling=sampling_parameters(output_tokens, spec),
            reused_images=reused,
            image_keys=tuple(keys),
        )


def sampling_parameters(output_tokens: int, spec: WorkloadSpec) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": output_tokens, "temperature": spec.temperature}
    if spec.ignore_eos:
        params["ignore_eos"] = True  # output length is then exactly max_tokens
    return params


def parse_sizes(texts: Sequence[str]) -> tuple[tuple[int, int], ...]:
    return tuple(parse_size(t) for t in texts)
