"""Images the tests make: deterministic pictures and deliberately broken files."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image


def synthetic_image(width: int, height: int, seed: int, fmt: str = "JPEG", mode: str = "RGB") -> bytes:
    """A deterministic picture with structure (gradients + blocks), not flat noise.

    ``mode`` is the stored PIL mode: "RGB", "L" (grayscale) or "RGBA" (PNG; alpha varies).
    """
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), ((x + y) % 256)], -1)
    blocks = rng.integers(0, 256, size=(8, 8, 3))
    tiled = blocks[(y * 8 // height), (x * 8 // width)]
    pixels = ((base + tiled) // 2).astype(np.uint8)
    picture = Image.fromarray(pixels)
    if mode == "RGBA":
        alpha = Image.fromarray(rng.integers(0, 256, size=(height, width), dtype=np.uint8))
        picture = picture.convert("RGBA")
        picture.putalpha(alpha)
    elif mode != "RGB":
        picture = picture.convert(mode)
    buf = io.BytesIO()
    picture.save(buf, format=fmt)
    return buf.getvalue()


def flat_png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (width, height)).save(buf, format="PNG")
    return buf.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _png(header: bytes, idat: bytes) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def bilevel_png(width: int, height: int) -> bytes:
    """A valid all-black 1-bit PNG built row by row: 30000x30000 is ~110 kB on the wire,
    0.9 G pixels (2.7 GB as RGB) once decoded: a decompression bomb."""
    compressor = zlib.compressobj(9)
    row = b"\x00" * (1 + (width + 7) // 8)
    idat = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    return _png(struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0), idat)


def header_only_png(width: int, height: int) -> bytes:
    """A header that promises width x height RGB pixels and a few bytes of data."""
    return _png(struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0), zlib.compress(b"\0" * 64))


def zero_width_png() -> bytes:
    return _png(struct.pack(">IIBBBBB", 0, 10, 8, 0, 0, 0, 0), zlib.compress(b"\x00"))


def rotated_jpeg(width: int, height: int, seed: int, orientation: int = 6) -> bytes:
    """A JPEG whose EXIF orientation tag asks viewers to rotate it (6: 90 degrees clockwise)."""
    picture = Image.open(io.BytesIO(synthetic_image(width, height, seed)))
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    picture.save(buf, format="JPEG", exif=exif.tobytes())
    return buf.getvalue()


def with_note(data: bytes, note: bytes) -> bytes:
    """``data`` with ``note`` in a metadata segment (PNG tEXt, JPEG COM): other bytes, hence
    another content key, and the very same pixels. Other formats come back unchanged."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        end_of_ihdr = 8 + 8 + 13 + 4
        return data[:end_of_ihdr] + _png_chunk(b"tEXt", b"Comment\x00" + note) + data[end_of_ihdr:]
    if data.startswith(b"\xff\xd8"):
        offset = 2  # after SOI, past the APPn segments (JFIF, EXIF), before the tables
        while data[offset] == 0xFF and 0xE0 <= data[offset + 1] <= 0xEF:
            offset += 2 + struct.unpack(">H", data[offset + 2 : offset + 4])[0]
        return data[:offset] + b"\xff\xfe" + struct.pack(">H", len(note) + 2) + note + data[offset:]
    return data
