"""Validate and decode the encoded images that clients send in the ``image`` input.

Each element of ``image`` is either the file's raw bytes or base64 of them (Triton's
vllm_backend takes base64; raw bytes save a third of the wire size). Limits are checked
from the header before any pixel is decoded, so a decompression bomb costs nothing.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

from python_backends import contract
from python_backends.errors import invalid_arg

# Leading bytes of the formats we accept (PIL decodes more; these are the ones we test).
_MAGIC_PREFIXES: tuple[bytes, ...] = (
    b"\xff\xd8\xff",  # JPEG
    b"\x89PNG\r\n\x1a\n",  # PNG
    b"GIF87a",
    b"GIF89a",
    b"BM",  # BMP
    b"II*\x00",  # TIFF, little endian
    b"MM\x00*",  # TIFF, big endian
)
SUPPORTED_FORMATS = "JPEG, PNG, WebP, BMP, GIF, TIFF"


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = int(contract.default_of(contract.MAX_IMAGES))
    max_image_bytes: int = int(contract.default_of(contract.MAX_IMAGE_BYTES))
    max_image_pixels: int = int(contract.default_of(contract.MAX_IMAGE_PIXELS))


def _looks_like_image(data: bytes) -> bool:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return True
    return data.startswith(_MAGIC_PREFIXES)


def image_bytes(item: bytes, index: int) -> bytes:
    """The encoded image in ``item``: raw bytes as they are, base64 decoded."""
    if not item:
        raise invalid_arg(f"image[{index}] is empty")
    if _looks_like_image(item):
        return item
    try:
        decoded = base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError):
        decoded = b""
    if decoded and _looks_like_image(decoded):
        return decoded
    raise invalid_arg(
        f"image[{index}] is neither an encoded image ({SUPPORTED_FORMATS}) nor base64 of one"
    )


# transformers' smart_resize refuses more elongated images; refuse them first, with a message.
MAX_ASPECT_RATIO = 200


def check_image_header(data: bytes, index: int, limits: ImageLimits) -> tuple[int, int]:
    """(width, height) from the header; rejects oversized images before decoding."""
    if len(data) > limits.max_image_bytes:
        raise invalid_arg(
            f"image[{index}] has {len(data)} bytes, above the limit of "
            f"{limits.max_image_bytes} (max_image_bytes)"
        )
    try:
        with _quiet_pil(), Image.open(io.BytesIO(data)) as img:
            width, height = img.size
    except Image.DecompressionBombError as exc:  # PIL's own ceiling, far above ours
        raise invalid_arg(
            f"image[{index}] is above the limit of {limits.max_image_pixels} pixels "
            f"(max_image_pixels): {_short(exc)}"
        ) from None
    except UnidentifiedImageError:
        raise invalid_arg(f"image[{index}] cannot be read: unknown format or corrupt header") from None
    except Exception as exc:  # PIL raises many types for bad headers
        raise invalid_arg(f"image[{index}] cannot be read: {_short(exc)}") from None
    if width <= 0 or height <= 0:
        raise invalid_arg(f"image[{index}] has zero size ({width}x{height})")
    if width * height > limits.max_image_pixels:
        raise invalid_arg(
            f"image[{index}] is {width}x{height} = {width * height} pixels, above the limit "
            f"of {limits.max_image_pixels} (max_image_pixels)"
        )
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise invalid_arg(
            f"image[{index}] is {width}x{height}: aspect ratio above {MAX_ASPECT_RATIO} "
            "is not supported by Qwen2-VL"
        )
    return width, height


def decode_rgb(data: bytes, index: int, limits: ImageLimits) -> Image.Image:
    """Fully decoded RGB image (grayscale, palette, RGBA and CMYK converted)."""
    check_image_header(data, index, limits)
    try:
        with _quiet_pil(), Image.open(io.BytesIO(data)) as img:
            img.load()  # truncated or corrupt pixel data fails here, not later in vLLM
            # Honour EXIF orientation as DALI's decoder (the encode path) does, so every
            # mode sees the same pixels for a rotated photo.
            return ImageOps.exif_transpose(img).convert("RGB")
    except Exception as exc:
        raise invalid_arg(f"image[{index}] cannot be decoded: {_short(exc)}") from None


def decode_images(items: list[bytes], limits: ImageLimits) -> list[Image.Image]:
    return [decode_rgb(image_bytes(item, i), i, limits) for i, item in enumerate(items)]


@contextlib.contextmanager
def _quiet_pil() -> Iterator[None]:
    # PIL warns (DecompressionBombWarning) before our own, clearer, limit check.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _short(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def header_pixels(data: bytes) -> int:
    """width * height from an image's header; 0 when it cannot be read (a size estimate for
    the cost model only: requests are checked by :func:`check_image_header`)."""
    try:
        with _quiet_pil(), Image.open(io.BytesIO(data)) as img:
            width, height = img.size
    except Exception:
        return 0
    return int(width) * int(height)
