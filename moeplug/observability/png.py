"""A minimal PNG encoder: 8-bit RGB, no interlace, filter type 0 on every row.

Enough for a heat map without an imaging library (Pillow/matplotlib are not dependencies).
Layout (PNG spec, ISO/IEC 15948): the 8-byte signature, then chunks of
``length (4 bytes, big-endian) | type (4 ASCII) | data | CRC-32 of type + data``:
IHDR (width, height, bit depth 8, colour type 2 = RGB, compression 0, filter 0, interlace 0),
one IDAT holding the zlib stream of every row prefixed by its filter byte 0, and IEND.
"""

from __future__ import annotations

import struct
import zlib

SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """PNG bytes of a ``height`` x ``width`` image; ``rgb`` holds the rows top to bottom,
    3 bytes (R, G, B) per pixel."""
    if width <= 0 or height <= 0:
        raise ValueError(f"encode_png: image size {width}x{height} must be at least 1x1. "
                         f"Fix: pass a non-empty image")
    if len(rgb) != width * height * 3:
        raise ValueError(f"encode_png: got {len(rgb)} bytes of pixels, a {width}x{height} RGB "
                         f"image needs width * height * 3 = {width * height * 3}. "
                         f"Fix: pass 3 bytes per pixel, rows top to bottom")
    stride = width * 3
    raw = b"".join(b"\x00" + rgb[y * stride:(y + 1) * stride] for y in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (SIGNATURE + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw, 9))
            + _chunk(b"IEND", b""))
