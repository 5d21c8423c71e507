"""The watched modules, held weakly: their parameters as they are now, and which left the model.

Parameters are looked up when they are needed (not once at construction), so parameters
unfrozen, assigned (``load_state_dict(..., assign=True)``) or converted to new objects
(``torch.__future__.set_overwrite_module_params_on_conversion``) after attaching are read.
Weak references only: the logger never keeps the model or a replaced module alive.
"""

from __future__ import annotations

import weakref

from torch import Tensor, nn
from torch.nn.utils.parametrize import is_parametrized

from .._compat import own_parameters


class Watched:
    """The model and its watched modules (``{display name: module}``), held by weak reference."""

    def __init__(self, model: nn.Module, modules: dict[str, nn.Module]) -> None:
        self._model = weakref.ref(model)
        self._modules = [(name, weakref.ref(module)) for name, module in modules.items()]
        self._left: set[str] = set()

    def params(self) -> list[tuple[str, Tensor]]:
        """``[("module.param", parameter)]`` of the watched modules still in the model (frozen ones
        too; tied ones once)."""
        seen: set[int] = set()
        params: list[tuple[str, Tensor]] = []
        for name, ref in self._modules:
            module = None if name in self._left else ref()
            for pname, p in [] if module is None else _parameters(module):
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    params.append((f"{name}.{pname}", p))
        return params

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
