"""Select the submodules to watch: by exact name, glob, module instance, type or predicate.

Selectors are resolved once, at construction; every selector that matches nothing
is reported in one error together with the closest real module names. Modules are named as the
model's ``state_dict()`` names them, without the attributes of wrappers (``checkpoint_wrapper``,
FSDP1, ``torch.compile``'s ``OptimizedModule``, anywhere in the tree): a wrapper and the module
it wraps are one module of that name, the wrapped one; a name with those attributes selects too.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Iterable, Sequence
from typing import Union

from torch import nn
from torch.nn.utils.parametrize import ParametrizationList, is_parametrized

from .._compat import WRAPPED_MODULE_ATTRIBUTES
from ..errors import HookLoggerError

#: One way to pick modules: a dotted name from ``model.named_modules()`` (``"root"`` for the
#: model itself, as ``HookLogger.module_names`` shows it), a glob pattern over those names, a
#: module of the model (``model.fc``), an ``nn.Module`` subclass, or ``(name, module) -> bool``.
Selector = Union[str, nn.Module, type[nn.Module], Callable[[str, nn.Module], bool]]

ROOT_NAME = "root"
_GLOB_CHARS = frozenset("*?[")
_LEAF_CUTOFF = 0.6  # (``wq`` is 0.67 like ``wqkv``, 0.5 like ``wo`` or ``w1``)


def default_selection(name: str, module: nn.Module) -> bool:
    """Modules that own parameters themselves, with children or not: the layers whose weights
    training changes, and a module like ``nn.MultiheadAttention`` for its own ``in_proj_weight``
    (its ``out_proj`` is a layer of its own), so that every parameter is some watched module's.
    A layer with ``torch.nn.utils.parametrizations`` (``spectral_norm``, ``weight_norm``,
    ``orthogonal``) is one too: its parametrizations, which hold its original parameters, are
    not modules of their own here."""
    if isinstance(module, ParametrizationList):
        return False
    return is_parametrized(module) or next(module.parameters(recurse=False), None) is not None


def select_modules(
    model: nn.Module, selectors: Selector | Sequence[Selector] | None, option: str = "modules"
) -> dict[str, nn.Module]:
    """Resolve ``selectors`` against ``model`` into ``{display name: module}`` in model order;
    ``option``: the ``HookLogger`` option they were given as, which errors name.

    >>> select_modules(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), "0")
    {'0': Linear(in_features=2, out_features=2, bias=True)}
    """
    if selectors is None:
        rules: list[Selector] = [default_selection]
    elif isinstance(selectors, (str, type, nn.Module)) or callable(selectors) or not isinstance(selectors, Iterable):
        rules = [selectors]  # one selector (an nn.ModuleList too); _check_rule rejects what is not one
    else:
        rules = list(selectors)
    for rule in rules:
        _check_rule(rule, option)

    named = named_modules(model)
    matched: set[int] = set()
    unmatched: list[Selector] = []
    for rule in rules:
        hits = _hits(rule, named)
        if not hits and not _is_predicate(rule):
            unmatched.append(rule)
        matched |= hits
    if unmatched:
        raise HookLoggerError(_unmatched_message(unmatched, named, option))
    if not matched:
        raise HookLoggerError(
            f"{option}= selected no module of the model; pass names from "
            "model.named_modules(), glob patterns, modules of the model, nn.Module subclasses or predicates"
            + ("" if selectors is not None else " (the default picks the modules that own parameters)")
        )
    selected: dict[str, tuple[str, nn.Module]] = {}  # display name -> (name, module)
    for i in sorted(matched):  # (a wrapped module comes after its wrapper, of the same name: it is kept)
        name, _, module = named[i]
        display = name or ROOT_NAME
        if display in selected and selected[display][0] != name:
            raise HookLoggerError(
                f"{option}= selects both the model itself (shown as {ROOT_NAME!r}) and its submodule named "
                f"{ROOT_NAME!r}, whose tags would be the same; select only one of them"
            )
        selected[display] = (name, module)
    return {display: module for display, (_, module) in selected.items()}


def named_modules(model: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """``(name, name in named_modules(), module)`` of every module of ``model``, in model order;
    ``name`` leaves wrappers' attributes out (``WRAPPED_MODULE_ATTRIBUTES``), as ``state_dict()`` does."""
    return [(user_name(raw), raw, module) for raw, module in model.named_modules()]


def user_name(name: str) -> str:
    """``name`` without the attributes under which wrappers hold the module they wrap."""
    if not any(attribute in name for attribute in WRAPPED_MODULE_ATTRIBUTES):
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPED_MODULE_ATTRIBUTES)


def _is_predicate(rule: Selector) -> bool:
    return not isinstance(rule, (str, type, nn.Module))


def _check_rule(rule: object, option: str) -> None:
    if isinstance(rule, (str, nn.Module)):
        return
    if isinstance(rule, type):
        if issubclass(rule, nn.Module):
            return
    elif callable(rule):
        return
    raise HookLoggerError(
        f"{option}= got {rule!r}; each selector must be a module name or glob pattern (str), "
        "a module of the model, an nn.Module subclass, or a predicate (name, module) -> bool"
    )


def _hits(rule: Selector, named: list[tuple[str, str, nn.Module]]) -> set[int]:
    """Indices into ``named`` that ``rule`` selects. A string is an exact name first (so names
    holding ``*?[`` select themselves, and ``"root"`` the model unless a submodule has that
    name), with or without wrappers' attributes, else a glob pattern over either."""
    if isinstance(rule, str):
        exact = {i for i, (name, raw, _) in enumerate(named) if rule in (name, raw)} or {
            i for i, (name, _, _) in enumerate(named) if rule == ROOT_NAME and name == ""
        }
        if exact or _GLOB_CHARS.isdisjoint(rule):
            return exact
        return {
            i
            for i, (name, raw, _) in enumerate(named)
            if fnmatch.fnmatchcase(name, rule) or fnmatch.fnmatchcase(raw, rule)
        }
    if isinstance(rule, nn.Module):
        return {i for i, (_, _, module) in enumerate(named) if module is rule}
    if isinstance(rule, type):
        return {i for i, (_, _, module) in enumerate(named) if isinstance(module, rule)}
    return {i for i, (name, _, module) in enumerate(named) if rule(name, module)}


def _closest_names(rule: str, names: list[str], n: int = 5) -> list[str]:
    """Up to ``n`` of ``names`` like ``rule``: first those whose last part is like the rule's
    (``layers.0.attention.qkv_linear.wqkv`` for ``layers.0.attention.wq``, which the whole
    names alone would not offer ahead of ``layers.0.attention.wo``), the closer whole name first
    among equally close last parts; then the closest whole names."""
    leaf = rule.rpartition(".")[2]
    matcher = difflib.SequenceMatcher(b=leaf)
    by_leaf = []
    for name in names:
        matcher.set_seq1(name.rpartition(".")[2])
        if matcher.real_quick_ratio() >= _LEAF_CUTOFF and matcher.ratio() >= _LEAF_CUTOFF:
            by_leaf.append((-matcher.ratio(), -difflib.SequenceMatcher(a=name, b=rule).ratio(), name))
    whole = difflib.get_close_matches(rule, names, n=n, cutoff=0.5)
    return list(dict.fromkeys([name for *_, name in sorted(by_leaf)] + whole))[:n]


def _unmatched_message(
    unmatched: list[Selector], named: list[tuple[str, str, nn.Module]], option: str, shown: int = 5
) -> str:
    """What matched nothing, each with the closest real names (or types); where nothing is close,
    the model's first ``shown`` names (or types), so that the message always shows real ones."""
    names = [n for n in dict.fromkeys(name for name, _, _ in named) if n]
    types = list(dict.fromkeys(type(module).__name__ for _, _, module in named))
    lines = [f"{option}= has selectors that match no module of the model:"]
    for rule in unmatched:
        if isinstance(rule, str):
            close = _closest_names(rule, names)
            hint = (
                f"closest names: {', '.join(close)}" if close else f"no similar name; {_first('names', names, shown)}"
            )
            lines.append(f"  {rule!r} ({hint})")
        elif isinstance(rule, nn.Module):
            lines.append(f"  a {type(rule).__name__} that is not part of the model (not in model.named_modules())")
        else:
            lines.append(
                f"  {getattr(rule, '__name__', rule)} (no module of this type; {_first('types', types, shown)})"
            )
    lines.append("Names come from model.named_modules(); patterns use fnmatch ('layer1.*', '*.conv2').")
    return "\n".join(lines)


def _first(what: str, items: list[str], shown: int) -> str:
    """``the model's names: a, b, c (+4 more)``."""
    more = f" (+{len(items) - shown} more)" if len(items) > shown else ""
    return f"the model's {what}: {', '.join(items[:shown])}{more}"
