"""Pictures: the gradient-flow heatmap (drawn on the host from logged norms) and
feature-map grids (assembled on the device). Only torch/torchvision, no plotting library."""

from __future__ import annotations

import functools
import math
import struct
import zlib
from collections.abc import Sequence

import numpy as np
import torch
import torchvision
from torch import Tensor

#: Most channels a feature-map grid shows (the first ones), and the largest side of a tile:
#: larger maps are average-pooled down, which keeps the grid's share of the transfer small.
MAX_FEATURE_CHANNELS, MAX_FEATURE_SIDE = 64, 64
#: Most logged steps (the latest ones) a heatmap shows.
MAX_COLUMNS = 240

# A 3x5 bitmap font: five rows of three pixels per glyph, "#" is ink.
_GLYPHS = {
    "0": "####.##.##.####", "1": ".#.##..#..#.###", "2": "###..#####..###", "3": "###..#.##..####",
    "4": "#.##.####..#..#", "5": "####..###..####", "6": "####..####.####", "7": "###..#.#..#..#.",
    "8": "####.#####.####", "9": "####.####..####", "a": ".#.#.#####.##.#", "b": "##.#.###.#.###.",
    "c": ".###..#..#...##", "d": "##.#.##.##.###.", "e": "####..##.#..###", "f": "####..##.#..#..",
    "g": ".###..#.##.#.##", "h": "#.##.#####.##.#", "i": "###.#..#..#.###", "j": "..#..#..##.#.#.",
    "k": "#.##.###.#.##.#", "l": "#..#..#..#..###", "m": "#.########.##.#", "n": "##.#.##.##.##.#",
    "o": ".#.#.##.##.#.#.", "p": "##.#.###.#..#..", "q": ".#.#.##.###..##", "r": "##.#.###.#.##.#",
    "s": ".###...#...###.", "t": "###.#..#..#..#.", "u": "#.##.##.##.####", "v": "#.##.##.##.#.#.",
    "w": "#.##.########.#", "x": "#.##.#.#.#.##.#", "y": "#.##.#.#..#..#.", "z": "###..#.#.#..###",
    ".": ".............#.", "-": "......###......", "_": "............###", "+": "....#.###.#....",
    "/": "..#..#.#.#..#..", "|": ".#..#..#..#..#.", "(": ".#.#..#..#...#.", ")": ".#...#..#..#.#.",
    " ": "...............", "?": "###..#.#.....#.", ":": "....#.....#....", "=": "...###...###...",
}  # fmt: skip
_SCALE = 2  # pixels per font pixel
_CHAR_W, _CHAR_H = 4 * _SCALE, 5 * _SCALE  # advance (glyph + 1 column gap) and height

# Viridis at five stops: dark purple (small) to yellow (large); readable in grey scale too.
_STOPS = np.array([(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)], dtype=np.float64)
BACKGROUND, INK = (24, 24, 24), (230, 230, 230)
ZERO, NONFINITE = (0, 0, 0), (255, 0, 0)  # a gradient of exactly zero; NaN/Inf


def feature_grid(x: Tensor) -> Tensor:
    """One sample's channels (``C x H x W``, or more dims: first slice; ``C x L``: one row
    each) as a grey ``1 x H x W`` grid in [0, 1], each channel scaled to its own range and
    pooled to at most ``MAX_FEATURE_SIDE`` pixels a side. Stays on the device."""
    while x.dim() > 3:
        x = x[:, 0]
    if x.dim() == 2:
        x = x.unsqueeze(1)
    x = x[:MAX_FEATURE_CHANNELS].float()
    x = torch.nn.functional.adaptive_avg_pool2d(
        x, (min(x.shape[1], MAX_FEATURE_SIDE), min(x.shape[2], MAX_FEATURE_SIDE))
    )
    lo = x.amin(dim=(1, 2), keepdim=True)
    span = (x.amax(dim=(1, 2), keepdim=True) - lo).clamp_min(1e-12)
    x = ((x - lo) / span).nan_to_num_(0.0, 0.0, 0.0)
    grid = torchvision.utils.make_grid(x.unsqueeze(1), nrow=math.ceil(math.sqrt(x.shape[0])), padding=1, pad_value=1)
    return grid[:1]  # type: ignore[no-any-return]  # torchvision is untyped


def gradient_flow(modules: Sequence[str], steps: Sequence[int], norms: np.ndarray, logged: np.ndarray) -> np.ndarray:
    """Heatmap of ``norms[module, step]`` (where ``logged``) as a uint8 ``3 x H x W`` array:
    rows are modules, columns logged steps, colour log10 of the norm, with a labelled colour bar.
    Exact zeros are black, NaN/Inf red, cells not logged the background."""
    norms = np.asarray(norms, dtype=np.float64)[:, -MAX_COLUMNS:]
    missing = ~np.asarray(logged, dtype=bool)[:, -MAX_COLUMNS:]
    steps = list(steps)[-MAX_COLUMNS:]
    finite = np.isfinite(norms)
    positive = finite & (norms > 0)
    logs = np.log10(np.where(positive, norms, 1.0))
    lo = math.floor(logs[positive].min()) if positive.any() else -1
    hi = max(math.ceil(logs[positive].max()) if positive.any() else 0, lo + 1)

    labels = [_fit(m, 28) for m in modules]
    cell_h = _CHAR_H + 2
    cell_w = max(2, min(12, 480 // max(1, len(steps))))
    left = 6 + _CHAR_W * max([len(s) for s in labels] + [4])
    top = 6 + 2 * _CHAR_H
    grid_h, grid_w = cell_h * len(modules), cell_w * len(steps)
    bar_h = max(grid_h, 8 * _CHAR_H)
    title = "log10 output-gradient norm per module (forward order) and step"
    width = max(left + grid_w + 12 + 16 + 6 + _CHAR_W * 4 + 6, 12 + _CHAR_W * len(title))
    height = top + max(grid_h, bar_h) + 2 * _CHAR_H + 10
    image = np.empty((height, width, 3), dtype=np.uint8)
    image[:] = BACKGROUND

    _text(image, 6, 4, title)
    cells = _colour((logs - lo) / (hi - lo))
    cells[finite & ~positive] = ZERO
    cells[~finite & ~missing] = NONFINITE
    cells[missing] = BACKGROUND
    block = np.repeat(np.repeat(cells, cell_h, axis=0), cell_w, axis=1)
    image[top : top + grid_h, left : left + grid_w] = block
    for row, label in enumerate(labels):
        _text(image, left - 4 - _CHAR_W * len(label), top + row * cell_h + 1, label)
    below = top + grid_h + 4
    if steps:
        _text(image, left, below, str(steps[0]))
        last = str(steps[-1])
        _text(image, max(left + grid_w - _CHAR_W * len(last), left + _CHAR_W * (len(str(steps[0])) + 1)), below, last)
    _text(image, left, below + _CHAR_H + 2, "step")

    bar_x = left + grid_w + 12
    ramp = np.linspace(1.0, 0.0, bar_h)[:, None]
    image[top : top + bar_h, bar_x : bar_x + 16] = _colour(np.repeat(ramp, 16, axis=1))
    decades = hi - lo
    stride = max(1, math.ceil(decades / max(1, bar_h // (2 * _CHAR_H))))
    for value in range(lo, hi + 1, stride):
        y = top + round((hi - value) / decades * (bar_h - 1))
        image[y, bar_x + 16 : bar_x + 20] = INK
        _text(image, bar_x + 22, min(max(y - _CHAR_H // 2, top), top + bar_h - _CHAR_H), str(value))
    return np.ascontiguousarray(image.transpose(2, 0, 1))


def png(image: np.ndarray) -> bytes:
    """A uint8 ``C x H x W`` array (1 or 3 channels) as PNG bytes. Written with ``zlib``:
    ``torchvision.io.encode_png`` is deprecated since torchvision 0.29."""
    channels, height, width = image.shape
    rows = np.ascontiguousarray(image.transpose(1, 2, 0)).reshape(height, width * channels)
    up = rows.copy()
    up[1:] -= rows[:-1]  # PNG filter "Up" (2): repeated rows, most of a heatmap, become zeros
    raw = np.concatenate([np.full((height, 1), 2, dtype=np.uint8), up], axis=1).tobytes()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    colour_type = {1: 0, 3: 2}[channels]  # grey, RGB
    header = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def _colour(t: np.ndarray) -> np.ndarray:
    """Map values in [0, 1] to RGB along the viridis stops."""
    pos = np.clip(t, 0.0, 1.0) * (len(_STOPS) - 1)
    i = np.minimum(pos.astype(np.int64), len(_STOPS) - 2)
    frac = (pos - i)[..., None]
    return np.round(_STOPS[i] * (1 - frac) + _STOPS[i + 1] * frac).astype(np.uint8)  # type: ignore[no-any-return]


def _fit(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, keeping its end (the most specific part of a name)."""
    return text if len(text) <= limit else ".." + text[-(limit - 2) :]


def _text(image: np.ndarray, x: int, y: int, text: str) -> None:
    """Draw ``text`` with its top-left corner at (x, y); characters outside the font show as ``?``."""
    mask = np.concatenate([_ink(char) for char in text.lower()], axis=1)[:, :-_SCALE]  # no gap after the last
    image[y : y + mask.shape[0], x : x + mask.shape[1]][mask] = INK


@functools.cache
def _ink(char: str) -> np.ndarray:
    """A glyph as a boolean mask, scaled, with its one-column gap on the right."""
    rows = np.array([c == "#" for c in _GLYPHS.get(char, _GLYPHS["?"])]).reshape(5, 3)
    rows = np.concatenate([rows, np.zeros((5, 1), dtype=bool)], axis=1)
    return np.repeat(np.repeat(rows, _SCALE, axis=0), _SCALE, axis=1)
