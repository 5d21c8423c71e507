"""The low-precision formats ``numerics=`` judges, typed once: their constants, without torch,
so that what reads runs back (the rules, the dashboard) shares them with the device side
(``stats/numerics.py``); ``tests/test_numerics.py`` checks them against ``torch.finfo``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Spec:
    """A format's constants."""

    name: str
    #: The ``torch`` dtype's attribute name.
    dtype: str
    #: The largest finite value.
    max: float
    #: The smallest normal magnitude.
    tiny: float
    mantissa_bits: int
    #: Cast after per-tensor scaling by ``max / amax`` (the float8 formats), else as it is.
    scaled: bool


#: The formats, in the order the pictures show them.
SPECS: dict[str, Spec] = {
    s.name: s
    for s in (
        Spec("fp16", "float16", 65504.0, 2.0**-14, 10, scaled=False),
        Spec("bf16", "bfloat16", 3.3895313892515355e38, 2.0**-126, 7, scaled=False),
        Spec("e4m3", "float8_e4m3fn", 448.0, 2.0**-6, 3, scaled=True),
        Spec("e5m2", "float8_e5m2", 57344.0, 2.0**-14, 2, scaled=True),
    )
}
#: Their names, in that order.
NAMES: tuple[str, ...] = tuple(SPECS)
#: The format of a run that trains in no autocast dtype (``numerics=True``).
DEFAULT = "bf16"
#: The format fp8 training casts a Linear's input and weight to (torchao, Transformer Engine), and
#: under torchao's rowwise recipe its output gradient; and the one the tensorwise recipe casts the
#: output gradient to.
FORWARD, BACKWARD = "e4m3", "e5m2"
