"""A run on the kernel path (the fused Triton kernels) against the same run on the torch path,
everything TensorBoard reads of the two (``scripts/golden.py``'s ``read``): the counts, extremes
and selections exactly; the moments to float32 rounding (``1e-5`` relative, ``1e-7`` absolute;
the kurtosis as ``m4 / m2²``, the rounded quantity, before the 3 is subtracted); every tensor
(findings, text, value tables) and image the same."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tblog_hooks.stats import numerics
from tblog_hooks.stats.tags import Axis, Lost, Stat, per_format

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import golden

#: Statistics of counts, extremes and selections: the same on both paths, bit for bit.
EXACT_STATS = {
    *(Stat.MIN, Stat.MAX, Stat.AMAX, Stat.AMAX_CHANNEL, Stat.MEDIAN_ABS),
    *(Stat.ZERO_FRAC, Stat.NONFINITE, Stat.DEAD_FRAC),
    *(per_format(lost, fmt, axis) for lost in Lost for fmt in numerics.FORMATS for axis in (None, *Axis)),
}
#: The rounding of the moments: relative to the torch path's value, and absolute.
REL, ABS = 1e-5, 1e-7
#: Where a histogram's sum and sum of squares (moments) are among ``golden.read``'s values of it;
#: the rest (extremes, count, bucket limits and counts) are exact.
HISTOGRAM_MOMENTS = (3, 4)

T = TypeVar("T")


def on_its_own_stack(record: Callable[..., T], *args: object) -> T:
    """``record(*args)`` on a thread of its own, whose frames start at the bottom of a stack, not
    under pytest's: on Python 3.11 a loop whose calls cross from one chunk of the frame stack
    to the next maps and unmaps a chunk on each call (CPython gh-142183), and where pytest's
    frames put the interpreted kernels' calls on that boundary a zoo case ran 4 times slower
    (a million ``mmap``/``munmap`` pairs). What ``record`` raises is raised here."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(record(*args))
        except BaseException as e:  # (raised in the caller's thread)
            error.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def differences(torch_run: dict[str, dict], kernel_run: dict[str, dict]) -> list[str]:
    """What differs between a run read on the torch path and on the kernel path, as paths."""
    out = golden.differences(
        {k: v for k, v in torch_run.items() if k not in ("scalars", "histograms")},
        {k: v for k, v in kernel_run.items() if k not in ("scalars", "histograms")},
    )
    for kind in ("scalars", "histograms"):
        want, got = torch_run[kind], kernel_run[kind]
        out += [f"/{kind}/{tag}: missing" for tag in want.keys() - got.keys()]
        out += [f"/{kind}/{tag}: new" for tag in got.keys() - want.keys()]
        for tag in want.keys() & got.keys():
            if want[tag].keys() != got[tag].keys():
                out.append(f"/{kind}/{tag}: steps {sorted(want[tag])} != {sorted(got[tag])}")
                continue
            for step, value in want[tag].items():
                if kind == "scalars" and not _same_scalar(tag, value, got[tag][step]):
                    out.append(f"/{kind}/{tag}/{step}: {value} != {got[tag][step]}")
                if kind == "histograms" and not _same_histogram(value, got[tag][step]):
                    out.append(f"/{kind}/{tag}/{step}: {value} != {got[tag][step]}")
    return out


def _same_scalar(tag: str, want: float | str, got: float | str) -> bool:
    parts = tag.split("/")
    stat = parts[1] if len(parts) >= 3 else ""
    if stat in EXACT_STATS:
        return want == got  # (a non-finite value is read as its repr)
    return _close(want, got, shift=3.0 if stat == Stat.KURTOSIS else 0.0)


def _same_histogram(want: list[float | str], got: list[float | str]) -> bool:
    return len(want) == len(got) and all(
        _close(w, g) if i in HISTOGRAM_MOMENTS else w == g for i, (w, g) in enumerate(zip(want, got))
    )


def _close(want: float | str, got: float | str, shift: float = 0.0) -> bool:
    """Equal to float32 rounding, of ``value + shift``; non-finite values (read as their repr) equal."""
    if isinstance(want, str) or isinstance(got, str):
        return want == got
    return abs((got + shift) - (want + shift)) <= max(REL * abs(want + shift), ABS)
