"""The device values the fused kernels (``fused.py``) give of a tensor, named once, by the names
the torch reductions give them: what a measure declared ``fused=True`` (``stats/kinds.py``) may
have as fields, checked when it is declared. Importable without Triton (``fused.py`` indexes its
buffers by these names, and a machine without a GPU still refuses a measure the kernels would
not give)."""

from __future__ import annotations

from ..stats import numerics

#: The float values (float64), in their order in the kernels' output: the moments, the extremes,
#: the L2 norm, the amax, and the powers relative to it (``numerics.measure``'s ``ref``,
#: ``sum2``, ``sum4``).
SCALARS = ("mean", "centred_norm", "min", "max", "norm", "amax", "ref", "sum2", "sum4")
#: The tensor's own counts (int64), first in the kernels' counts.
TOTALS = ("nonzero", "finite", "nonfinite")
#: The kernels' counts, in order: :data:`TOTALS`, then every format's (``numerics.COUNTED``),
#: given as one vector, :data:`FORMAT_COUNTS` (with ``numerics=``; else zeros).
COUNTS = (*TOTALS, *numerics.COUNTED)
FORMAT_COUNTS = numerics.COUNTS
#: Per unit (along the units dim, with ``per_unit``), the largest value and the largest magnitude.
PER_UNIT = ("peak", "unit_amax")
#: Every device value a call of the kernels gives, by name.
OUTPUTS = (*SCALARS, *TOTALS, FORMAT_COUNTS, *PER_UNIT)
