"""One logged step on the host, as TensorBoard will hold it: scalars, histograms, images, value
tables and the per-head attention values. Plain data (NumPy, no torch), so that what reads runs back can use it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: Per head of one module: the largest attention logit and the mean entropy (nats).
Heads = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Histogram:
    """A histogram in TensorBoard's terms: ``limits[i]`` is the right edge of bucket ``i``."""

    min: float
    max: float
    num: float
    sum: float
    sum_squares: float
    limits: list[float]
    counts: list[float]


@dataclass
class StepSummary:
    """Everything one logged step writes: ``{tag: value}``, ``{tag: Histogram}``,
    ``{tag: uint8 image, channels first}`` and ``{tag: float32 or string array}`` (the value tables
    of ``stats/tags.py``'s ``HEADS_TABLE_TAG`` and ``NUMERICS_TABLE_TAG``, and ``ORDER_TAG``)."""

    step: int
    scalars: dict[str, float]
    histograms: dict[str, Histogram]
    images: dict[str, np.ndarray] = field(default_factory=dict)
    #: With ``attention=``: per module, each head's largest logit and mean entropy (``stats/attention.py``).
    heads: dict[str, Heads] = field(default_factory=dict)
    #: With ``numerics=``: every format's ``{root}/{lost}_{format}/{name}`` scalar, those not
    #: written included (``stats/numerics.py``), for the modules x formats picture.
    numerics: dict[str, float] = field(default_factory=dict)
    #: The value tables of the pictures and the forward order (``diagnostics/``), written as tensors.
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    #: The scalars that carry a ``GradScaler``'s loss scale (as the recipe's measures say), by tag:
    #: the source they measure (``"output_gradient"``, ``"param_grad"``; ``stats/recipe.py``).
    scaled: dict[str, str] = field(default_factory=dict)
    #: The same of histograms: their source, and whether they bin log10 magnitudes.
    scaled_histograms: dict[str, tuple[str, bool]] = field(default_factory=dict)
    #: The per-format scalars (``numerics=``), by tag: their format.
    formats: dict[str, str] = field(default_factory=dict)
    #: Of them, those of what fp8 training casts, in the format it casts to (``Recipe.casts``):
    #: written whichever float8 format is named.
    casts: frozenset[str] = frozenset()
