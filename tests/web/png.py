"""A PNG decoder for the screenshot tests (standard library only): 8-bit greyscale, RGB or
RGBA, not interlaced, as Chromium's ``Page.captureScreenshot`` writes them (PNG spec,
https://www.w3.org/TR/png/: chunks, zlib data, one filter byte per row)."""

from __future__ import annotations

import struct
import zlib

import numpy as np

CHANNELS = {0: 1, 2: 3, 6: 4}  # colour type -> channels


def decode_png(data: bytes) -> np.ndarray:
    """The pixels of a PNG as uint8 [height, width, channels].

    Raises:
        ValueError: not a PNG, or a kind this decoder does not read (names it).
    """
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG (bad signature)")
    at, idat, head = 8, [], None
    while at < len(data):
        (n,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + n]
        at += 12 + n
        if kind == b"IHDR":
            head = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    width, height, depth, colour, _, _, interlace = head
    if depth != 8 or colour not in CHANNELS or interlace:
        raise ValueError(f"unsupported PNG: depth {depth}, colour type {colour}, {interlace=}")
    c = CHANNELS[colour]
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(height, width * c + 1)
    rows, prev = [], [0] * (width * c)
    for y in range(height):
        f, line = raw[y, 0], raw[y, 1:].tolist()
        if f == 0:
            row = line
        elif f == 2:
            row = [(v + b) & 255 for v, b in zip(line, prev)]
        else:  # Sub, Average, Paeth depend on the left neighbour: byte by byte
            row = [0] * len(line)
            for i, v in enumerate(line):
                a = row[i - c] if i >= c else 0
                b = prev[i]
                cc = prev[i - c] if i >= c else 0
                if f == 1:
                    p = a
                elif f == 3:
                    p = (a + b) // 2
                else:
                    pa, pb, pc = abs(b - cc), abs(a - cc), abs(a + b - 2 * cc)
                    p = a if pa <= pb and pa <= pc else (b if pb <= pc else cc)
                row[i] = (v + p) & 255
        rows.append(row)
        prev = row
    out = np.array(rows, np.uint8)
    return out.reshape(height, width, c).astype(np.uint8)
