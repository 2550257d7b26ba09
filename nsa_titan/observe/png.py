"""A minimal PNG writer (zlib only) and an RGB canvas with rectangles and 3x5 pixel digits.

Enough for the diagnostic plots without a plotting library: 8-bit grayscale, RGB or RGBA,
filter type 0 on every row, one IDAT chunk.
"""

from __future__ import annotations

import os
import struct
import zlib

SIGNATURE = b"\x89PNG\r\n\x1a\n"
_COLOR_TYPE = {1: 0, 3: 2, 4: 6}  # channels -> PNG colour type (grey, RGB, RGBA)

Color = tuple[int, int, int]


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(pixels: bytes, width: int, height: int, channels: int = 3) -> bytes:
    """PNG bytes of an 8-bit image given row-major pixels (height * width * channels bytes)."""
    if channels not in _COLOR_TYPE:
        raise ValueError(f"channels must be 1, 3 or 4, got {channels}")
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    stride = width * channels
    if len(pixels) != stride * height:
        raise ValueError(f"expected {stride * height} pixel bytes for {width}x{height}x{channels}, got {len(pixels)}")
    raw = bytearray()
    view = memoryview(bytes(pixels))
    for row in range(height):
        raw.append(0)  # filter type 0: the row as is
        raw += view[row * stride:(row + 1) * stride]
    header = struct.pack(">IIBBBBB", width, height, 8, _COLOR_TYPE[channels], 0, 0, 0)
    return SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(bytes(raw), 6)) + _chunk(b"IEND", b"")


def write_png(path: str, pixels: bytes, width: int, height: int, channels: int = 3) -> str:
    """Write the image to path (atomically) and return the path."""
    data = encode_png(pixels, width, height, channels)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)
    return path


# 3x5 digits, one string of 15 bits per glyph, rows top to bottom.
_DIGITS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
}
GLYPH_WIDTH, GLYPH_HEIGHT = 3, 5


class Canvas:
    """An RGB raster; coordinates are (x, y) from the top-left corner, rectangles half-open."""

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def fill_rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Paint [x0, x1) x [y0, y1), clipped to the canvas."""
        x0, x1 = max(x0, 0), min(x1, self.width)
        y0, y1 = max(y0, 0), min(y1, self.height)
        if x0 >= x1 or y0 >= y1:
            return
        row = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            start = (y * self.width + x0) * 3
            self.pixels[start:start + len(row)] = row

    def pixel(self, x: int, y: int) -> Color:
        i = (y * self.width + x) * 3
        return tuple(self.pixels[i:i + 3])  # type: ignore[return-value]

    def text(self, x: int, y: int, text: str, color: Color = (0, 0, 0), scale: int = 1) -> int:
        """Draw digits, '.' and '-' (other characters leave a gap); returns the x after the text."""
        for ch in text:
            bits = _DIGITS.get(ch)
            if bits is not None:
                for i, bit in enumerate(bits):
                    if bit == "1":
                        gx, gy = x + (i % GLYPH_WIDTH) * scale, y + (i // GLYPH_WIDTH) * scale
                        self.fill_rect(gx, gy, gx + scale, gy + scale, color)
            x += (GLYPH_WIDTH + 1) * scale
        return x

    def save(self, path: str) -> str:
        return write_png(path, bytes(self.pixels), self.width, self.height, 3)
