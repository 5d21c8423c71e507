"""What the logger holds of the model: the watched modules, held weakly (their parameters as they
are now, and which left the model), and the handles of its hooks on them, removed in one place;
copies and pickles of the model leave its hooks out.

Parameters are looked up when they are needed (not once at construction), so parameters
unfrozen, assigned (``load_state_dict(..., assign=True)``) or converted to new objects
(``torch.__future__.set_overwrite_module_params_on_conversion``) after attaching are read.
Weak references only: the logger never keeps the model or a replaced module alive.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, NoReturn, SupportsIndex

from torch import Tensor, nn
from torch.nn.utils.parametrize import is_parametrized
from torch.utils.hooks import RemovableHandle

from .._compat import hook_dict_attributes, own_parameters
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

    def computed_by_parent(self) -> dict[str, str]:
        """``{module: parent}`` of the watched modules whose output their parent computes without
        calling them, as its own output: ``nn.MultiheadAttention``'s ``out_proj``, whose weight
        ``F.multi_head_attention_forward`` uses. Where the parent is watched, that output and its
        gradient are recorded under the parent's name."""
        model = self._model()
        found: dict[str, str] = {}
        for name, ref in self._modules:
            parent_name, _, leaf = name.rpartition(".")
            if leaf != "out_proj" or model is None or name in self._left:
                continue
            try:
                parent = model.get_submodule(parent_name)
            except AttributeError:
                continue
            if isinstance(parent, nn.MultiheadAttention) and parent.out_proj is ref():
                found[name] = parent_name
        return found

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


class _Hook:
    """Base of the hooks this library registers on modules (``hooks.py``, ...). Copies and pickles
    of a module leave them out (:class:`LeftOut`); one reached on its own by a copy or a pickle
    (registered again by other code) refuses, saying why, rather than drag the logger along."""

    __slots__ = ()

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise TypeError(
            f"tblog_hooks: {type(self).__name__} is a hook of a HookLogger and is not copied or pickled; copies and "
            "pickles of the module it was registered on leave it out, but this one was reached another way "
            "(registered again by other code, as torch.ao.quantization's module swaps do): close() the HookLogger "
            "before copying or saving the model"
        )


class LeftOut:
    """The keys of our hooks in one module hooks dict (``_forward_hooks``, ``_forward_pre_hooks``
    and their ``..._with_kwargs`` / ``..._always_called`` companions), set on the dict as its
    ``__reduce_ex__``, which pickle, ``copy.copy`` and ``copy.deepcopy`` look up on the object:
    the dict then reduces as an ``OrderedDict`` of the other entries only. So a model saved
    (``torch.save``), pickled or deep-copied (EMA, ``AveragedModel``) while a logger is attached
    comes out as if none were: no entry of ours, nothing of this library in a checkpoint
    (``weights_only=True`` loads it, where tblog_hooks is not installed too), and no copy logs
    into the logger. Taken off the dict when its last key goes."""

    __slots__ = ("hooks_dict", "keys")

    def __init__(self, hooks_dict: dict[int, Any]) -> None:
        self.hooks_dict = weakref.ref(hooks_dict)  # (the dict holds this)
        self.keys: set[int] = set()

    @classmethod
    def of(cls, hooks_dict: dict[int, Any]) -> LeftOut:
        """The one set on ``hooks_dict``, set now if there is none."""
        attributes = hook_dict_attributes(hooks_dict)
        left_out = attributes.get("__reduce_ex__")
        if not isinstance(left_out, LeftOut):
            left_out = attributes["__reduce_ex__"] = cls(hooks_dict)
        return left_out

    def discard(self, key: int) -> None:
        self.keys.discard(key)
        hooks_dict = self.hooks_dict()
        if self.keys or hooks_dict is None:
            return
        attributes = hook_dict_attributes(hooks_dict)
        if attributes.get("__reduce_ex__") is self:
            del attributes["__reduce_ex__"]

    def __call__(self, protocol: SupportsIndex) -> tuple[object, ...]:
        hooks_dict = self.hooks_dict() or {}  # (alive: it is being copied)
        return OrderedDict, (), None, None, iter([(k, v) for k, v in hooks_dict.items() if k not in self.keys])


class Handles:
    """Every handle the logger made, removed in one place; ``remove_all`` is idempotent. While
    one of our hooks is in a module hooks dict, copies of the dict leave it out (:class:`LeftOut`)."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        self._left_out: list[tuple[LeftOut, int]] = []

    def add(self, handle: RemovableHandle) -> None:
        self._handles.append(handle)
        hooks_dict = handle.hooks_dict_ref()
        if hooks_dict is not None and ours(hooks_dict.get(handle.id)):
            for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref):
                d = ref()
                if d is not None:
                    left_out = LeftOut.of(d)
                    left_out.keys.add(handle.id)
                    self._left_out.append((left_out, handle.id))

    def remove_all(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        while self._left_out:
            left_out, key = self._left_out.pop()
            left_out.discard(key)

    def __len__(self) -> int:
        return len(self._handles)


def ours(hook: object) -> bool:
    """Whether ``hook`` (a value of a module's hooks dict) is one of this library's."""
    return isinstance(hook, _Hook)
