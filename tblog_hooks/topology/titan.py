"""torchtitan's default backend (``spmd_types``): its tensor parallelism runs on plain local
tensors that say nothing of how they are placed. Its ``Module.parallelize`` applied each
module's sharding configuration: the layout of the output its caller receives and of the input
its forward is handed, read here as the tensor-parallel styles are (``parallel.TensorParallel``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from .._compat import titan_backend, titan_sharding
from .sharding import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement

#: The name torchtitan gives its tensor-parallel mesh axis.
TP = "tp"
#: Where a sharding configuration's layout over the tensor-parallel axis is not known here.
UNKNOWN_LAYOUT = (
    "its torchtitan sharding configuration leaves how its output is placed over the tensor-parallel ranks unsaid "
    "(a Varying layout without a PartitionSpec), so its statistics would be this rank's piece only; leave the "
    "module out of modules="
)


def tensor_parallel_mesh(model: nn.Module) -> DeviceMesh | None:
    """The tensor-parallel mesh of a model torchtitan parallelized under ``spmd_types`` with a
    tensor-parallel degree above 1 (:func:`titan_mesh`); ``None`` otherwise."""
    return titan_mesh(model) if titan_backend() == "spmd_types" else None


def titan_mesh(model: nn.Module) -> DeviceMesh | None:
    """The tensor-parallel mesh of a model torchtitan parallelized with a tensor-parallel degree
    above 1, under any backend (its parameters, which FSDP2 always wraps, are ``DTensor`` s on a
    mesh with a ``tp`` axis); ``None`` otherwise."""
    for p in model.parameters():
        if is_dtensor(p) and TP in (p.device_mesh.mesh_dim_names or ()):
            mesh = p.device_mesh[TP]
            return mesh if mesh.size() > 1 else None
    return None


class Layouts(NamedTuple):
    """How a module's tensors are placed over the tensor-parallel axis, by its sharding
    configuration (``None``: not said, or said ``Varying`` alone, which names no placement)."""

    output: Placement | None  # as its caller receives it
    declared: bool  # whether an output layout is declared at all
    handed: Placement | None  # its first input, as its forward is handed it
    given: Placement | None  # the same, as its caller passes it
    #: Whether the output is Replicate over the ranks (spmd_types' ``R``), whose gradient each
    #: rank then holds a term of (``P``): a partial sum that only a collective could add up.
    partial_gradient: bool


def layouts(module: nn.Module) -> Layouts | None:
    """``module``'s :class:`Layouts`; ``None`` for a module without a sharding configuration."""
    sharding = titan_sharding(module)
    if sharding is None:
        return None
    output, handed, given = sharding
    import spmd_types  # (installed with torchtitan)

    replicate = output is not None and _types(output).get(TP) is spmd_types.R
    return Layouts(_placement(output), output is not None, _placement(handed), _placement(given), replicate)


def handed_shape(shape: torch.Size, given: Placement | None, handed: Placement, ranks: int) -> torch.Size:
    """The local shape of an input of local ``shape`` placed ``given`` once redistributed to
    ``handed`` over ``ranks`` ranks (gathered along a dim it was sharded on, split along one it
    is to be sharded on)."""
    sizes = list(shape)
    if given is not None and given.is_shard() and not handed.is_shard(given.dim):  # type: ignore[attr-defined]
        sizes[given.dim] *= ranks  # type: ignore[attr-defined]
    if handed.is_shard() and not (given is not None and given.is_shard(handed.dim)):  # type: ignore[attr-defined]
        sizes[handed.dim] //= ranks  # type: ignore[attr-defined]
    return torch.Size(sizes)


def _placement(layout: object | None) -> Placement | None:
    """The placement over the ``tp`` axis of an ``SpmdLayout`` (``None``: none said)."""
    if layout is None:
        return None
    import spmd_types  # (installed with torchtitan)

    try:
        return spmd_types.spmd_type_to_dtensor_placement(_types(layout)[TP])  # type: ignore[no-any-return]
    except (KeyError, ValueError, TypeError):  # (undeclared, Varying without a PartitionSpec)
        return None


def _types(layout: object) -> dict[str, object]:
    """An ``SpmdLayout``'s type on each mesh axis, by the axis's name."""
    return {getattr(axis, "value", axis): kind for axis, kind in layout.per_axis_spmd_types().items()}  # type: ignore[attr-defined]
