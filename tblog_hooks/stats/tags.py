"""TensorBoard tags, ``{root}/{stat}/{name}``: every root and statistic name, declared once here,
and the escaping of user-data names, so tags stay valid and unambiguous."""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import unquote

import numpy as np


class Root(enum.StrEnum):
    """The first part of a tag: what a value describes."""

    ACTIVATION = "activation"  #: a watched module's output
    INPUT = "input"  #: a watched module's input
    GRADIENT = "gradient"  #: the gradient w.r.t. a watched module's output
    GRADIENT_LOG10 = "gradient_log10"  #: log10 of that gradient's magnitudes (histograms)
    PARAM_GRAD = "param_grad"  #: a watched parameter's gradient
    PARAM = "param"  #: a watched parameter (weights)
    AMP = "amp"  #: the ``GradScaler``
    HEALTH = "health"  #: findings and the pictures that go with them
    FEATURE_MAP = "feature_map"  #: a watched module's output channels as an image
    ATTENTION = "attention"  #: the attention calls made inside a module (``attention=``)
    STEP = "step"  #: every optimizer step (``spikes=``), not only logged ones
    SPIKE = "spike"  #: the steps around a spike (``spikes=``)


class Stat(enum.StrEnum):
    """The second part of a scalar's tag: which statistic."""

    MEAN = "mean"
    STD = "std"
    MIN = "min"
    MAX = "max"
    ZERO_FRAC = "zero_frac"
    NONFINITE = "nonfinite"
    DEAD_FRAC = "dead_frac"
    NORM = "norm"
    GLOBAL_NORM = "global_norm"
    UPDATE_RATIO = "update_ratio"
    LOSS_SCALE = "loss_scale"
    SKIPPED_STEP = "skipped_step"
    MAX_LOGIT = "max_logit"
    ENTROPY = "entropy"
    GRAD_NORM = "grad_norm"
    LOSS = "loss"
    SAMPLES = "samples"
    AMAX = "amax"
    RMS = "rms"
    KURTOSIS = "kurtosis"
    MEDIAN_ABS = "median_abs"
    AMAX_CHANNEL = "amax_channel"
    LOG_Z = "log_z"
    LOG_Z_MAX = "log_z_max"
    Z_LOSS = "z_loss"


class Lost(enum.StrEnum):
    """What a low-precision format does to an element (``numerics=``): tagged per format,
    ``{root}/{lost}_{format}/{name}`` (:func:`per_format`)."""

    UNDERFLOW = "underflow"
    OVERFLOW = "overflow"
    SUBNORMAL = "subnormal"
    #: Left at the format's smallest subnormal, the last step above zero (fp16, bf16).
    FLOOR = "floor"


class Axis(enum.StrEnum):
    """The two casts of a Linear's output gradient under torchao's rowwise fp8 recipe
    (``fp8_scaling="rowwise"``), each scaled along its own axis of the gradient's 2-d view
    (tokens x output features): tagged ``gradient/{lost}_e4m3_{axis}/{module}`` (:func:`per_format`),
    apart from the per-tensor ``gradient/{lost}_e4m3/{module}``."""

    #: For grad_input (``grad_output @ W``): one scale per row (token), of its amax along the features.
    ROWS = "rows"
    #: For grad_weight (``grad_output.T @ input``): one scale per column (output feature), of its amax over the tokens.
    COLUMNS = "columns"


class Scale(enum.StrEnum):
    """How a statistic's values are drawn (the dashboard's colour scales and charts)."""

    LOG = "log"  #: a magnitude: log10, zeros apart (linear where a value is negative)
    LINEAR = "linear"  #: a signed or bounded quantity: linear
    FRACTION = "fraction"  #: a share of the elements, in [0, 1]: linear


#: The scale of each statistic and each per-format loss; any other is :attr:`Scale.LOG`.
SCALES: Mapping[str, Scale] = {
    Stat.MEAN: Scale.LINEAR,
    Stat.MIN: Scale.LINEAR,
    Stat.MAX: Scale.LINEAR,
    Stat.ENTROPY: Scale.LINEAR,
    Stat.LOG_Z: Scale.LINEAR,
    Stat.LOG_Z_MAX: Scale.LINEAR,
    Stat.SKIPPED_STEP: Scale.LINEAR,
    Stat.ZERO_FRAC: Scale.FRACTION,
    Stat.DEAD_FRAC: Scale.FRACTION,
}


def scale_of(stat: str) -> Scale:
    """The scale of a statistic (``dead_frac``) or a per-format loss (``underflow``)."""
    return SCALES.get(stat, Scale.LOG)


def per_format(lost: str, fmt: str, axis: str | None = None) -> str:
    """The statistic of ``lost`` in format ``fmt``: ``underflow_fp16``, ...; of a cast scaled
    along ``axis`` (an :class:`Axis`), ``underflow_e4m3_rows``, ..."""
    return f"{lost}_{fmt}" if axis is None else f"{lost}_{fmt}_{axis}"


@functools.lru_cache(maxsize=1 << 16)  # the same tags recur every logged step
def tag(root: str, *parts: str) -> str:
    """``root/part/...``; module and parameter names are user data, so each part is escaped
    (see :func:`escape`) and ``/`` only ever separates the parts."""
    return "/".join((str(root), *map(escape, parts)))


#: Every histogram kind, by tag root: ``activation/{module}``, ``input/{module}`` (with
#: ``inputs=True``), ``gradient/{module}`` (output gradient), ``gradient_log10/{module}`` (log10 of
#: its magnitudes), ``param_grad/{module}.{param}``, ``param/{module}.{param}`` (weights).
HISTOGRAM_KINDS: tuple[str, ...] = tuple(
    root.value
    for root in (Root.ACTIVATION, Root.INPUT, Root.GRADIENT, Root.GRADIENT_LOG10, Root.PARAM_GRAD, Root.PARAM)
)
#: Roots of scalars tagged ``root/stat/{name}`` (a module or parameter) and of those tagged
#: ``root/stat`` (the whole model); ``param_grad`` has both.
NAMED_ROOTS = (Root.ACTIVATION, Root.INPUT, Root.GRADIENT, Root.PARAM_GRAD, Root.PARAM, Root.ATTENTION, Root.SPIKE)
MODEL_ROOTS = (Root.PARAM_GRAD, Root.AMP, Root.HEALTH, Root.STEP)
#: A scalar tag of this package after an optional ``{prefix}/``: names are escaped (no ``/``), so each
#: root has a fixed number of parts. The prefix is matched greedily; no stat is named like a root, so
#: an unprefixed tag never reads as a prefixed one.
_SCALAR_TAG = re.compile(
    rf"(?:(?P<prefix>.+)/)?(?P<tag>(?:{'|'.join(NAMED_ROOTS)})/[^/]+/[^/]+|(?:{'|'.join(MODEL_ROOTS)})/[^/]+)"
)


def split_prefix(full: str) -> tuple[str, str] | None:
    """``(prefix, tag)`` of a scalar tag this package writes (``prefix`` is ``""`` without
    ``prefix=``); ``None`` for any other tag.

    >>> split_prefix("G/gradient/norm/0")
    ('G', 'gradient/norm/0')
    """
    match = _SCALAR_TAG.fullmatch(full)
    return None if match is None else (match["prefix"] or "", match["tag"])


def by_name(scalars: Mapping[str, float], root: str, stat: str) -> dict[str, float]:
    """``{name: value}`` of the scalars tagged ``root/stat/{name}`` (not to be changed by the caller)."""
    prefix = tag(root, stat, "")
    if isinstance(scalars, Indexed):
        return scalars.named(prefix)
    return {unescape(t[len(prefix) :]): v for t, v in scalars.items() if t.startswith(prefix)}


class Indexed(dict[str, float]):
    """One step's scalars that also hold them by ``root/stat/`` (``named``: ``{"gradient/norm/":
    {name: value}}``), so that a rule's look-up of a statistic costs its own tags, not a scan of
    every tag (a replay judges thousands of tags per step). Without ``named`` the index is built on
    the first :func:`by_name`. Not changed after it is built."""

    __slots__ = ("_named",)
    _named: dict[str, dict[str, float]]

    def __init__(self, values: Mapping[str, float], named: dict[str, dict[str, float]] | None = None) -> None:
        super().__init__(values)
        if named is not None:
            self._named = named

    def reordered(self, tags: Sequence[str]) -> Indexed:
        """The same scalars with their tags in the order of ``tags`` (all of them), the index kept."""
        return Indexed({t: self[t] for t in tags}, getattr(self, "_named", None))

    def named(self, prefix: str) -> dict[str, float]:
        """``{name: value}`` of the tags ``{prefix}{name}`` (``prefix`` ends in ``/``)."""
        if not hasattr(self, "_named"):
            self._named = {}
            for t, v in self.items():
                head, name = _head_and_name(t)
                if head:
                    self._named.setdefault(head, {})[name] = v
        return self._named.get(prefix, {})


@functools.lru_cache(maxsize=1 << 16)  # the same tags recur every logged step
def _head_and_name(t: str) -> tuple[str, str]:
    """``("root/stat/", name)`` of a tag ``root/stat/{name}`` (``("", t)`` of one without ``/``)."""
    head, slash, name = t.rpartition("/")
    return (f"{head}/", unescape(name)) if slash else ("", t)


def escape(name: str) -> str:
    """Percent-encode ``%``, ``/`` and unprintable characters (as UTF-8 bytes, as in URLs);
    other characters, unicode and spaces included, stay as they are.
    :func:`unescape` gives the name back.

    >>> escape("blocks.a/b 50%")
    'blocks.a%2Fb 50%25'
    """
    if name.isprintable() and "/" not in name and "%" not in name:
        return name
    return "".join(c if c.isprintable() and c not in "%/" else _percent(c) for c in name)


def _percent(char: str) -> str:
    return "".join(f"%{byte:02X}" for byte in char.encode("utf-8", "surrogatepass"))


def unescape(part: str) -> str:
    """The name :func:`escape` was given."""
    return unquote(part, errors="surrogatepass") if "%" in part else part


#: The ``GradScaler``'s loss scale of a logged step's backward, and whether the scaler skipped it.
SCALE_TAG, SKIPPED_TAG = tag(Root.AMP, Stat.LOSS_SCALE), tag(Root.AMP, Stat.SKIPPED_STEP)
#: Every step's gradient norm, loss and samples (``spikes=``).
GRAD_NORM_TAG, LOSS_TAG = tag(Root.STEP, Stat.GRAD_NORM), tag(Root.STEP, Stat.LOSS)
SAMPLES_TAG = tag(Root.STEP, Stat.SAMPLES)
#: The watched modules in forward order, written when it changes: a string tensor of the dashboard
#: plugin (:func:`names_tensor`), which the dashboard and ``report`` read, and the same as a
#: numbered list in a text summary (:func:`order_markdown`) for TensorBoard's Text tab.
ORDER_TAG = tag(Root.HEALTH, "forward_order")
#: Per logged step, the numbers behind the layers x heads pictures (``attention=``: a float32
#: ``layers x heads x 2`` tensor, each head's max logit then mean entropy) and the modules x formats
#: pictures (``numerics=``: a float32 ``2 x modules x formats x 4`` tensor, outputs then output
#: gradients, each format's underflow, overflow, subnormal and floor fractions, :class:`Lost`);
#: each with its rows' module names in the string tensor :func:`rows_tag`.
HEADS_TABLE_TAG, NUMERICS_TABLE_TAG = tag(Root.HEALTH, "attention_heads"), tag(Root.HEALTH, "numerics")
#: The dashboard plugin's name, declared once: the value tables are written for it (TensorBoard's
#: other tabs skip them), and it titles the custom-scalars layout.
TABLE_PLUGIN = "tblog_hooks"


def rows_tag(table: str) -> str:
    """The tag of a value table's row names (one string per module, in the table's row order)."""
    return f"{table}_modules"


def names_tensor(names: Iterable[str]) -> np.ndarray:
    """Module names as a 1-D string tensor (the rows of a value table, the forward order), each
    escaped (:func:`escape`): a lone surrogate could not be encoded as UTF-8."""
    return np.array([escape(n) for n in names], dtype=object)


def tensor_names(values: np.ndarray) -> list[str]:
    """The names :func:`names_tensor` was given, from the tensor as TensorBoard decodes it (``bytes``)."""
    return [unescape(n.decode("utf-8")) for n in values.ravel()]


def order_markdown(order: Sequence[str]) -> str:
    """The forward order as a numbered Markdown list of escaped names, for the Text tab."""
    return "\n".join(f"{i}. `{escape(m)}`" for i, m in enumerate(order, 1))


def read_order(text: str) -> list[str]:
    """The forward order of a run written before it was a tensor of its own, from its text summary
    (:func:`order_markdown`): the one reader of that text, so that such log directories still read."""
    return [unescape(m) for m in re.findall(r"^\d+\. `(.*)`$", text, flags=re.MULTILINE)]
