"""The keywords of the public configuration classes (``Histograms``, ``Thresholds``, ``Spikes``),
checked by one class decorator, :func:`keywords`: an unknown keyword is a :class:`HookLoggerError`
naming the closest valid one, and a renamed keyword keeps working for a release with a
``DeprecationWarning`` that names the new one (and, where the meaning changed, how to convert),
then it is removed. And the values of the options that switch a watch off, read one way
(:func:`is_off`, :func:`switched`).
"""

from __future__ import annotations

import difflib
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from .errors import HookLoggerError

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # (typing's own from Python 3.13)

T = TypeVar("T")
C = TypeVar("C")
#: A converter: the old keyword's value and the call's other keywords (new names, defaults filled
#: in) to the new keyword's value.
Convert = Callable[[Any, Mapping[str, Any]], Any]


@dataclass(frozen=True)
class Renamed:
    """An old keyword of a class: its new name and, where the meaning changed, how to convert."""

    new: str
    #: Says how an old value becomes a new one, in the warning (``""``: the value is the same).
    how: str = ""
    #: Makes the new value from the old one (``None``: the value is the same).
    convert: Convert | None = None


def keywords(**old: str | Renamed) -> Callable[[type[T]], type[T]]:
    """Class decorator of a public dataclass: a keyword that is no field is a
    :class:`HookLoggerError` naming the closest field. ``old_name="new_name"`` (or a
    :class:`Renamed`): the constructor takes the old keyword with a ``DeprecationWarning`` naming
    the new one; giving both is a :class:`HookLoggerError`. A field renamed without a change of
    meaning is also readable under its old name (with the same warning)."""
    table = {name: Renamed(new) if isinstance(new, str) else new for name, new in old.items()}

    def decorate(cls: type[T]) -> type[T]:
        init = cls.__init__
        own = fields(cls)  # type: ignore[arg-type]
        names = [f.name for f in own if f.init]
        defaults = {f.name: f.default for f in own if f.default is not MISSING}

        @functools.wraps(init)
        def __init__(self: T, *args: Any, **kwargs: Any) -> None:
            unknown = [name for name in kwargs if name not in names and name not in table]
            if unknown:
                raise HookLoggerError(unknown_keywords(f"{cls.__name__}()", unknown, names))
            init(self, *args, **_new_keywords(cls.__name__, table, kwargs, defaults))

        cls.__init__ = __init__  # type: ignore[assignment,method-assign]
        for name, rename in table.items():
            if rename.convert is None:
                setattr(cls, name, _old_attribute(cls.__name__, name, rename.new))
        return cls

    return decorate


def _new_keywords(
    owner: str, table: Mapping[str, Renamed], given: Mapping[str, Any], defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """``given`` with each old keyword replaced by its new one, warning once per old keyword."""
    kwargs = {name: value for name, value in given.items() if name not in table}
    olds = [name for name in given if name in table]
    for name in olds:
        rename = table[name]
        if rename.new in given:
            raise HookLoggerError(
                f"{owner}() got both {name}= and {rename.new}=: {name} is the old name of {rename.new}; "
                f"pass {rename.new}= only"
            )
        how = f"; {rename.how}" if rename.how else ""
        warnings.warn(
            f"{owner}({name}=...) is deprecated and will be removed in the next release: use {rename.new}={how}",
            DeprecationWarning,
            stacklevel=3,  # (the caller of the constructor)
        )
    kwargs |= {table[name].new: given[name] for name in olds if table[name].convert is None}
    for name in olds:  # after the plain renames, so that a conversion sees their values
        rename = table[name]
        if rename.convert is not None:
            kwargs[rename.new] = rename.convert(given[name], {**defaults, **kwargs})
    return kwargs


def unknown_keywords(owner: str, unknown: Sequence[str], names: Sequence[str], what: str = "keyword") -> str:
    """The message for keywords that ``owner`` does not take, each with the closest of ``names``."""
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, names, n=1)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"{owner} got unknown {what}(s) {', '.join(parts)}; valid {what}s: {', '.join(names)}"


def _old_attribute(owner: str, old: str, new: str) -> property:
    """A read of ``new`` under its old name, with the warning."""

    def read(self: object) -> Any:
        warnings.warn(
            f"{owner}.{old} is deprecated and will be removed in the next release: use {owner}.{new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(self, new)

    return property(read, doc=f"Deprecated: the old name of :attr:`{new}`.")


def is_off(value: object) -> TypeIs[Literal[False] | None]:
    """Whether an option's value switches its watch off: ``False`` or ``None``, alike for every
    option that switches one off (``histograms``, ``feature_maps``, ``attention``, ``health``,
    ``spikes``, ``numerics``, ``logits``)."""
    return value is False or value is None


def switched(value: object, config: type[C], otherwise: Callable[[object], C | None]) -> C | None:
    """An option that is off (:func:`is_off`), on with its defaults (``True``: ``config()``) or
    configured (a ``config``), as a ``config``; ``None`` when off. Any other value is
    ``otherwise``'s: another form the option takes, or its error."""
    if isinstance(value, config):
        return value
    if value is True:
        return config()
    if is_off(value):
        return None
    return otherwise(value)
