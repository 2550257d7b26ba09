"""The PNG writer, checked by decoding its output with zlib alone; and the canvas."""

from __future__ import annotations

import struct
import zlib

import pytest

from nsa_titan.observe.png import Canvas, encode_png, write_png

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def decode_png(data: bytes) -> tuple[int, int, int, bytes]:
    """(width, height, channels, pixels) of an 8-bit, non-interlaced PNG with filter-0 rows; checks every CRC."""
    assert data[:8] == PNG_SIGNATURE
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, color_type, compression, filtering, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, compression, filtering, interlace) == (8, 0, 0, 0)
    channels = {0: 1, 2: 3, 6: 4}[color_type]
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = width * channels
    assert len(raw) == height * (stride + 1)
    rows = [raw[r * (stride + 1):(r + 1) * (stride + 1)] for r in range(height)]
    assert all(row[0] == 0 for row in rows)
    return width, height, channels, b"".join(row[1:] for row in rows)


def pixel_at(decoded, x: int, y: int) -> tuple[int, ...]:
    width, _, channels, pixels = decoded
    i = (y * width + x) * channels
    return tuple(pixels[i:i + channels])


def test_rgb_round_trip(tmp_path):
    # 3 x 2: red, green, blue / black, grey, white
    pixels = bytes([255, 0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 128, 128, 128, 255, 255, 255])
    path = write_png(str(tmp_path / "sub" / "a.png"), pixels, 3, 2)
    data = open(path, "rb").read()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR" and struct.unpack(">II", data[16:24]) == (3, 2)
    decoded = decode_png(data)
    assert decoded == (3, 2, 3, pixels)
    assert pixel_at(decoded, 1, 1) == (128, 128, 128)


@pytest.mark.parametrize("channels", [1, 4])
def test_grey_and_rgba(channels):
    width, height = 5, 7
    pixels = bytes((i * 37) % 256 for i in range(width * height * channels))
    assert decode_png(encode_png(pixels, width, height, channels)) == (width, height, channels, pixels)


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError):
        encode_png(b"\x00" * 5, 2, 1, 3)
    with pytest.raises(ValueError):
        encode_png(b"", 0, 1, 3)
    with pytest.raises(ValueError):
        encode_png(b"\x00\x00", 1, 1, 2)


def test_canvas_rectangles_clip_and_digits(tmp_path):
    canvas = Canvas(10, 8, background=(1, 2, 3))
    canvas.fill_rect(2, 1, 5, 3, (200, 10, 20))
    canvas.fill_rect(8, 6, 40, 40, (7, 7, 7))  # clipped at the edges
    decoded = decode_png(open(canvas.save(str(tmp_path / "c.png")), "rb").read())
    painted = {(x, y) for x in range(10) for y in range(8) if pixel_at(decoded, x, y) == (200, 10, 20)}
    assert painted == {(x, y) for x in range(2, 5) for y in range(1, 3)}
    assert {(x, y) for x in range(10) for y in range(8) if pixel_at(decoded, x, y) == (7, 7, 7)} == \
        {(8, 6), (9, 6), (8, 7), (9, 7)}
    digits = Canvas(8, 5)
    assert digits.text(0, 0, "17") == 8
    ink = ["".join("#" if digits.pixel(x, y) == (0, 0, 0) else "." for x in range(8)) for y in range(5)]
    assert ink == [".#..###.",
                   "##....#.",
                   ".#....#.",
                   ".#....#.",
                   "###...#."]
