"""What the logger holds of the model: the watched modules, held weakly (their parameters as they
are now, and which left the model), and the handles of its hooks on them, removed in one place.

Parameters are looked up when they are needed (not once at construction), so parameters
unfrozen, assigned (``load_state_dict(..., assign=True)``) or converted to new objects
(``torch.__future__.set_overwrite_module_params_on_conversion``) after attaching are read.
Weak references only: the logger never keeps the model or a replaced module alive.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.nn.utils.parametrize import is_parametrized
from torch.utils.hooks import RemovableHandle

from .._compat import own_parameters
from .selection import user_name


class Watched:
    """The model and its watched modules (``{display name: module}``), held by weak reference."""

    def __init__(self, model: nn.Module, modules: dict[str, nn.Module]) -> None:
        self._model = weakref.ref(model)
        self._modules = [(name, weakref.ref(module)) for name, module in modules.items()]
        self._left: set[str] = set()

    def params(self) -> list[tuple[str, Tensor]]:
        """``[("module.param", parameter)]`` of the watched modules still in the model (frozen ones
        too; tied ones once)."""
        return [(key, p) for _, key, p in self.owned()]

    def owned(self) -> list[tuple[str, str, Tensor]]:
        """``(module, "module.param", parameter)`` of :meth:`params`: which watched module owns each."""
        seen: set[int] = set()
        owned: list[tuple[str, str, Tensor]] = []
        for name, ref in self._modules:
            module = None if name in self._left else ref()
            for pname, p in [] if module is None else _parameters(module):
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    owned.append((name, f"{name}.{pname}", p))
        return owned

    def others(self) -> list[tuple[str, Tensor]]:
        """``[(name, parameter)]`` of the model's parameters that no watched module owns, by their
        names in the model (``state_dict()``'s): they count in the global gradient norm, which is
        the whole model's, and have no tags of their own."""
        model = self._model()
        if model is None:
            return []
        watched = {id(p) for _, p in self.params()}
        return [(user_name(name), p) for name, p in model.named_parameters() if id(p) not in watched]

    def all_params(self) -> list[tuple[str, Tensor]]:
        """:meth:`params`, then :meth:`others`: every parameter of the model, once."""
        return self.params() + self.others()

    def trained_parameter(self) -> Tensor | None:
        """A parameter of the watched modules (or of their children) that requires grad, with
        ``parameters=False`` too; ``None`` if there is none."""
        for name, ref in self._modules:
            module = None if name in self._left else ref()
            for p in [] if module is None else module.parameters():
                if p.requires_grad:
                    return p
        return None

    def newly_left(self) -> list[str]:
        """Watched modules no longer in the model (replaced, deleted), each reported once.
        A module that moved (wrapped after attaching, e.g. for checkpointing) is still in it."""
        model = self._model()
        if model is None:
            return []
        everything: set[int] | None = None  # ids of all modules, built only if a name lookup misses
        left = []
        for name, ref in self._modules:
            module = ref()
            if name in self._left or module is model:
                continue
            try:
                found = model.get_submodule(name) is module
            except AttributeError:
                found = False
            if not found:
                everything = everything if everything is not None else {id(m) for m in model.modules()}
                found = module is not None and id(module) in everything
            if not found:
                self._left.add(name)
                left.append(name)
        return left

    def clear(self) -> None:
        """Forget everything (``close()``)."""
        self._modules = []


def _parameters(module: nn.Module) -> list[tuple[str, Tensor | None]]:
    """A module's own parameters, by the names the user knows them by: those of a
    parametrization (``spectral_norm``, ``weight_norm``, ...) as the tensor they make,
    ``weight`` for ``parametrizations.weight.original`` and ``weight.original0``, ... where
    there are several (``weight_norm``'s magnitude and direction)."""
    own = list(own_parameters(module))
    if not is_parametrized(module):
        return own
    for pname, parametrization in module.parametrizations.items():  # type: ignore[union-attr, operator]
        originals = [(key, p) for key, p in own_parameters(parametrization) if key.startswith("original")]
        if len(originals) == 1:
            own.append((pname, originals[0][1]))
        else:
            own += [(f"{pname}.{key}", p) for key, p in originals]
    return own


# What a copied or unpickled hook is: a standard-library callable that takes any arguments and
# returns None (a hook returning None changes nothing), and that torch.compile traces:
# ``Enum.__init__`` is ``def __init__(self, *args, **kwds): pass``.
_NOOP_SOURCE: tuple[object, str] = (enum.Enum, "__init__")
NOOP: Callable[..., None] = getattr(*_NOOP_SOURCE)


class _Hook:
    """Base of our hooks (``hooks.py``): copies and pickles of a model get :data:`NOOP` in place
    of each, which never logs into the logger and references nothing of this library, so a
    checkpoint loads where it is not installed; the entries of a deep copy are removed when the
    logger's hooks are.
    ``handle`` and ``handles`` are set by :meth:`Handles.add`."""

    __slots__ = ("handle", "handles")

    def __init__(self) -> None:
        self.handle: RemovableHandle | None = None
        self.handles: Handles | None = None

    def __reduce__(self) -> tuple[Any, tuple[object, str]]:
        return getattr, _NOOP_SOURCE

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        # ``copy.deepcopy`` copies a hooks dict into memo before its entries: find the copy of
        # ours and let ``Handles.remove_all`` take the entry out of it too.
        if self.handle is not None and self.handles is not None:
            original = self.handle.hooks_dict_ref()
            copied = None if original is None else memo.get(id(original))
            if copied is not None:
                self.handles.copied(copied, self.handle.id)
        return NOOP


class Handles:
    """Every handle the logger made, and every entry deep copies made of its hooks, removed
    in one place; ``remove_all`` is idempotent. Holds no hook dict, only weak references."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        self._copies: dict[int, tuple[weakref.ref[dict[int, Any]], list[int]]] = {}  # id(dict) -> dict, keys

    def add(self, handle: RemovableHandle) -> None:
        """Keep ``handle``; the hook it registered learns it, to find the entries of its deep copies."""
        self._handles.append(handle)
        hooks_dict = handle.hooks_dict_ref()
        hook = None if hooks_dict is None else hooks_dict.get(handle.id)
        if isinstance(hook, _Hook):
            hook.handle, hook.handles = handle, self

    def copied(self, hooks_dict: dict[int, Any], key: int) -> None:
        """A deep copy of one of our hooks is going into ``hooks_dict[key]``."""
        entry = self._copies.get(id(hooks_dict))
        if entry is None or entry[0]() is not hooks_dict:
            # A new copied dict: forget copies already collected, so repeated deep copies do not pile up.
            self._copies = {i: e for i, e in self._copies.items() if e[0]() is not None}
            entry = self._copies[id(hooks_dict)] = (weakref.ref(hooks_dict), [])
        entry[1].append(key)

    def remove_all(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        while self._copies:
            ref, keys = self._copies.popitem()[1]
            hooks_dict = ref()
            if hooks_dict is not None:
                for key in keys:
                    hooks_dict.pop(key, None)

    def __len__(self) -> int:
        return len(self._handles)


def ours(hook: object) -> bool:
    """Whether ``hook`` (a value of a module's hooks dict) is one of this library's."""
    return isinstance(hook, _Hook)
