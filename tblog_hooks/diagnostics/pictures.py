"""The pictures of a logged step, drawn on the host with Pillow: the gradient-flow heatmap, the
per-head attention pictures and the modules x formats fractions, in one layout."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Union

import numpy as np
from PIL import Image, ImageDraw, ImageFont

#: Most logged steps (the latest ones) a heatmap shows.
MAX_COLUMNS = 240

# Sizes in pixels, for a picture about 500 px wide: TensorBoard scales an image to its card
# (roughly 350-500 px) unless asked for the actual size, so the text stays legible there.
FONT_SIZE, ROW_HEIGHT, GRID_WIDTH, MAX_LABEL_WIDTH, PAD = 12, 14, 240, 170, 8
BAR_WIDTH, MIN_BAR_HEIGHT = 14, 112

# Viridis at five stops: dark purple (small) to yellow (large); readable in grey scale too.
_STOPS = np.array([(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)], dtype=np.float64)
BACKGROUND, INK = (255, 255, 255), (20, 20, 20)
ZERO_COLOUR, NONFINITE_COLOUR = (0, 0, 0), (255, 0, 0)  # a gradient of exactly zero; NaN/Inf
_Font = Union[ImageFont.FreeTypeFont, ImageFont.ImageFont]


def gradient_flow(modules: Sequence[str], steps: Sequence[int], norms: np.ndarray, logged: np.ndarray) -> np.ndarray:
    """Heatmap of ``norms[module, step]`` (where ``logged``) as a uint8 ``3 x H x W`` array:
    rows are modules (names as they are, long ones keep their end), columns logged steps
    (the latest :data:`MAX_COLUMNS`), colour the norm on a log scale with a labelled colour bar.
    Exact zeros are black, NaN/Inf red, cells not logged the background."""
    norms = np.asarray(norms, dtype=np.float64)[:, -MAX_COLUMNS:]
    missing = ~np.asarray(logged, dtype=bool)[:, -MAX_COLUMNS:]
    steps = list(steps)[-MAX_COLUMNS:]
    finite = np.isfinite(norms)
    positive = finite & (norms > 0)
    cells, bar = _decades(np.where(positive, norms, math.nan))
    cells[finite & ~positive] = ZERO_COLOUR
    cells[~finite & ~missing] = NONFINITE_COLOUR
    cells[missing] = BACKGROUND
    title = "output-gradient norm per module (input at the top) and logged step"
    return _heatmap(modules, cells, [str(s) for s in steps], "logged step", title, bar)


def heads_grid(modules: Sequence[str], values: np.ndarray, title: str, *, log: bool) -> np.ndarray:
    """Heatmap of ``values[module, head]`` as a uint8 ``3 x H x W`` array: a row per attention
    module, a column per head (numbered below), colour on a log scale by decades (``log``) or a
    linear one from 0, with a labelled colour bar; NaN (a head none of whose queries had a key,
    or a module with fewer heads) red."""
    values = np.asarray(values, dtype=np.float64)
    if log:
        cells, bar = _decades(np.where(values > 0, values, math.nan))
    else:
        finite = np.isfinite(values)
        top = max(math.ceil(float(values[finite].max())), 1) if finite.any() else 1
        cells = _colour(np.where(finite, values, 0.0) / top)
        bar = [(1 - i / 4, f"{top * i / 4:g}") for i in range(4, -1, -1)]
    cells[~np.isfinite(values)] = NONFINITE_COLOUR
    return _heatmap(modules, cells, [str(h) for h in range(values.shape[1])], "head", title, bar)


def fraction_grid(modules: Sequence[str], values: np.ndarray, columns: Sequence[str], title: str) -> np.ndarray:
    """Heatmap of fractions ``values[module, column]`` as a uint8 ``3 x H x W`` array: a row per
    module, a column per label of ``columns``, colour on a log scale by decades with a labelled
    colour bar; exact zeros black, NaN (not measured) the background."""
    values = np.asarray(values, dtype=np.float64)
    cells, bar = _decades(np.where(values > 0, values, math.nan))
    cells[values == 0] = ZERO_COLOUR
    cells[~np.isfinite(values)] = BACKGROUND
    return _heatmap(modules, cells, list(columns), "format", title, bar)


def _decades(values: np.ndarray) -> tuple[np.ndarray, list[tuple[float, str]]]:
    """Positive ``values`` (NaN elsewhere; a row per picture row) coloured on a log scale spanning
    whole decades, and the colour bar's ticks: ``(position from the top in [0, 1], label)``, as
    many as its height holds."""
    shown = np.isfinite(values)
    logs = np.log10(np.where(shown, values, 1.0))
    lo = math.floor(logs[shown].min()) if shown.any() else -1
    hi = max(math.ceil(logs[shown].max()) if shown.any() else 0, lo + 1)
    bar_h = max(ROW_HEIGHT * values.shape[0], MIN_BAR_HEIGHT)
    stride = max(1, math.ceil((hi - lo) / max(1, bar_h // (2 * (FONT_SIZE + 4)))))
    ticks = [((hi - value) / (hi - lo), f"1e{value}") for value in range(hi, lo - 1, -stride)]
    return _colour((logs - lo) / (hi - lo)), ticks


def _heatmap(
    rows: Sequence[str], cells: np.ndarray, columns: list[str], axis: str, title: str, bar: list[tuple[float, str]]
) -> np.ndarray:
    """``cells`` (RGB, a row per name in ``rows``, a column per label in ``columns``) drawn with
    the names at the left, ``title`` above, the column labels (some of them) and ``axis`` below,
    and a colour bar at the right with its ``bar`` ticks: the layout every picture shares."""
    font = _font()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    labels = _labels(tuple(rows))
    label_w = labels.shape[1]
    line = FONT_SIZE + 4
    cell_w = max(1, GRID_WIDTH // max(1, len(columns)))
    left, top = PAD + label_w + 6, PAD + line + 6
    grid_w, grid_h = cell_w * len(columns), ROW_HEIGHT * len(rows)
    bar_x, bar_h = left + grid_w + 14, max(grid_h, MIN_BAR_HEIGHT)
    width = max(bar_x + BAR_WIDTH + 6 + max(round(measure.textlength(t, font=font)) for _, t in bar) + PAD,
                PAD + round(measure.textlength(title, font=font)) + PAD)  # fmt: skip
    height = top + max(grid_h, bar_h) + 2 * line + 8 + PAD

    canvas = np.empty((height, width, 3), dtype=np.uint8)
    canvas[:] = BACKGROUND
    if grid_h and grid_w:
        canvas[top : top + grid_h, left : left + grid_w] = np.repeat(np.repeat(cells, ROW_HEIGHT, 0), cell_w, 1)
    canvas[top : top + grid_h, PAD : PAD + label_w] = labels
    ramp = np.linspace(1.0, 0.0, bar_h)[:, None].repeat(BAR_WIDTH, axis=1)
    canvas[top : top + bar_h, bar_x : bar_x + BAR_WIDTH] = _colour(ramp)
    image = Image.fromarray(canvas)
    draw = ImageDraw.Draw(image)

    _text(draw, (PAD, PAD), title, font, ("left", "top"))
    axis_y = top + grid_h + 2
    for column in _step_ticks(len(columns), cell_w):
        x = left + column * cell_w + cell_w // 2
        draw.line([(x, axis_y), (x, axis_y + 3)], fill=INK)
        _text(draw, (x, axis_y + 4), columns[column], font, ("centre", "top"))
    _text(draw, (left + grid_w / 2, axis_y + 4 + line), axis, font, ("centre", "top"))
    for position, text in bar:
        y = top + round(position * (bar_h - 1))
        draw.line([(bar_x + BAR_WIDTH, y), (bar_x + BAR_WIDTH + 3, y)], fill=INK)
        _text(draw, (bar_x + BAR_WIDTH + 5, y), text, font, ("left", "middle"))
    return np.ascontiguousarray(np.asarray(image).transpose(2, 0, 1))


def _colour(t: np.ndarray) -> np.ndarray:
    """Map values in [0, 1] to RGB along the viridis stops."""
    pos = np.clip(t, 0.0, 1.0) * (len(_STOPS) - 1)
    i = np.minimum(pos.astype(np.int64), len(_STOPS) - 2)
    frac = (pos - i)[..., None]
    return np.round(_STOPS[i] * (1 - frac) + _STOPS[i + 1] * frac).astype(np.uint8)  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=8)
def _labels(modules: tuple[str, ...]) -> np.ndarray:
    """The module names right-aligned, one per row, as an RGB array. Cached: the names rarely
    change between drawings, and rendering them is most of the cost of one."""
    font = _font()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    # Names are user data: unprintable characters (a newline, a lone surrogate) are drawn escaped.
    labels = [_fit(measure, "".join(c if c.isprintable() else ascii(c)[1:-1] for c in m), font) for m in modules]
    width = max([round(measure.textlength(label, font=font)) for label in labels] + [1])
    image = Image.new("RGB", (width, max(1, ROW_HEIGHT * len(labels))), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for row, label in enumerate(labels):
        _text(draw, (width, row * ROW_HEIGHT + ROW_HEIGHT / 2), label, font, ("right", "middle"))
    return np.asarray(image)[: ROW_HEIGHT * len(labels)]


@functools.cache
def _font() -> _Font:
    """Pillow's own font at :data:`FONT_SIZE` (its small bitmap font where Pillow is older than 10.1)."""
    try:
        return ImageFont.load_default(size=FONT_SIZE)
    except (TypeError, ImportError, OSError):
        return ImageFont.load_default()


def _text(draw: ImageDraw.ImageDraw, at: tuple[float, float], text: str, font: _Font, align: tuple[str, str]) -> None:
    """Draw ``text`` so that ``at`` is its (left|right|centre, top|middle) point; measured with
    ``getbbox``, which bitmap fonts support too (unlike ``anchor=``)."""
    x0, y0, x1, y1 = font.getbbox(text)
    x = at[0] - {"left": x0, "right": x1, "centre": (x0 + x1) / 2}[align[0]]
    y = at[1] - {"top": y0, "middle": (y0 + y1) / 2}[align[1]]
    draw.text((round(x), round(y)), text, fill=INK, font=font)


def _fit(draw: ImageDraw.ImageDraw, text: str, font: _Font) -> str:
    """``text`` cut to :data:`MAX_LABEL_WIDTH` pixels, keeping its end (the most specific part of a name)."""
    if draw.textlength(text, font=font) <= MAX_LABEL_WIDTH:
        return text
    cut = 1
    while cut < len(text) and draw.textlength("…" + text[cut:], font=font) > MAX_LABEL_WIDTH:
        cut += 1
    return "…" + text[cut:]


def _step_ticks(columns: int, cell_w: int) -> list[int]:
    """Columns to label: the first, the last and evenly spaced ones between, about 60 px apart."""
    if columns == 0:
        return []
    count = max(2, min(columns, (columns * cell_w) // 60))
    return sorted({round(i * (columns - 1) / (count - 1)) for i in range(count)} if columns > 1 else {0})
