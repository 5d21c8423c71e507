"""torchtitan's default backend (``spmd_types``): its tensor parallelism runs on plain local
tensors that say nothing of how they are placed. Its ``Module.parallelize`` applied each
module's sharding configuration: the layout of the output its caller receives and of the input
its forward is handed, read here as the tensor-parallel styles are (``parallel.TensorParallel``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from .._compat import titan_backend, titan_local_map_output, titan_sharding, titan_state_shardings
from .sharding import Split, is_dtensor, placed

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

PARTIAL_REGION = (
    "it runs inside the local-tensor region of {region!r}, whose result is Partial over the tensor-parallel ranks, "
    "and neither takes that region's whole input nor holds parameters split over those ranks, so how its output "
    "on each rank adds up to the whole is said nowhere; its statistics are not recorded (those of {region!r}, "
    "whose output is reduced, are)"
)


class Region(NamedTuple):
    """Where a module runs inside a local-tensor region whose result is ``Partial`` over the
    tensor-parallel axis (torchtitan's routed experts without expert parallelism)."""

    #: The region's module name.
    name: str
    #: Whether the module returns this rank's term of a sum over the tensor-parallel ranks, from
    #: inputs every rank holds whole: it holds parameters split over those ranks (each rank its
    #: share of the experts' hidden units) and the region is handed its input ``Replicate``.
    summed: bool


def partial_regions(model: nn.Module) -> dict[int, Region]:
    """The modules of a tensor-parallel model torchtitan parallelized (:func:`parallelized_mesh`)
    that run inside a local-tensor region whose result is ``Partial`` over the tensor-parallel
    axis, by ``id``: what they return is a partial sum."""
    if parallelized_mesh(model) is None:
        return {}
    import spmd_types  # (installed with torchtitan)

    inside: dict[int, Region] = {}
    for name, module in model.named_modules():
        layout = titan_local_map_output(module)
        if layout is not None and not isinstance(layout, tuple) and _types(layout).get(TP) is spmd_types.P:
            found = layouts(module)
            whole = found is not None and found.handed is not None and found.handed.is_replicate()
            for m in module.modules():
                if m is not module:
                    split = any(isinstance(_types(s).get(TP), spmd_types.Shard) for s in titan_state_shardings(m))
                    inside[id(m)] = Region(name, whole and split)
    return inside


def local_heads(module: nn.Module, mesh: DeviceMesh) -> Split | None:
    """How the heads are split over the tensor-parallel ranks of ``mesh`` for the attention
    kernel that ``module`` calls, where its forward is a local-tensor region (torchtitan's inner
    attention): as the layout its query (``(batch, sequence, heads, head dim)``) is handed
    says; ``None`` for any other module."""
    if titan_local_map_output(module) is None:
        return None
    found = layouts(module)
    if found is None or found.handed is None:
        return None
    return placed(mesh, (found.handed,), 4)


def tensor_parallel_mesh(model: nn.Module) -> DeviceMesh | None:
    """The tensor-parallel mesh of a model torchtitan parallelized under ``spmd_types`` with a
    tensor-parallel degree above 1 (:func:`parallelized_mesh`); ``None`` otherwise."""
    return parallelized_mesh(model) if titan_backend() == "spmd_types" else None


def parallelized_mesh(model: nn.Module) -> DeviceMesh | None:
    """The tensor-parallel mesh of a model torchtitan parallelized, under any of its backends,
    with a tensor-parallel degree above 1 (its parameters, which FSDP2 always wraps, are
    ``DTensor`` s on a mesh with a ``tp`` axis); ``None`` otherwise."""
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
