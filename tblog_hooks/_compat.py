"""Every private torch API the library uses, and TensorBoard's writer as torch's ``SummaryWriter``
holds it, in one place, each with why it is needed: the torch side. All are present in the torch
releases the project supports (>= 2.4) and are tested with torch 2.14.1 and tensorboard 2.21.0;
where a use is known to need a later release, it says so. Nothing else in the package touches a
private attribute of either but ``_tensorboard_compat.py``, the read side's TensorBoard APIs
(imported by what TensorBoard loads, so without torch): a torch upgrade means reading this file.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

import google_crc32c
import torch
from torch import Tensor, nn
from torch.autograd.variable import Variable
from torch.utils import _pytree
from torch.utils.tensorboard import SummaryWriter

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement
    from torch.utils._pytree import TreeSpec


# -- autograd ----------------------------------------------------------------------------------
#: ``(major, minor)`` of the installed torch.
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])


def in_backward() -> bool:
    """Whether the caller runs inside a backward pass (a checkpoint recompute). No public API
    tells; ``torch._C._current_graph_task_id`` is -1 outside backward. Code being compiled is
    a forward (a compiled recompute runs in the backward graph, without hooks); dynamo cannot
    trace that call."""
    return not torch.compiler.is_compiling() and bool(torch._C._current_graph_task_id() != -1)


def at_end_of_backward(callback: Callable[[], None]) -> bool:
    """Run ``callback`` once the running backward pass has finished, as DDP does
    (``Variable._execution_engine.queue_callback``). False outside backward."""
    try:
        Variable._execution_engine.queue_callback(callback)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass"
        return False
    return True


def in_functorch_transform() -> bool:
    """Whether the caller runs inside a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``,
    ...), whose tensors are wrapped ones (``torch._C._functorch``'s interpreter stack is not empty)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def tree_flatten(tree: object) -> tuple[list[Any], TreeSpec]:
    """The leaves of a nested output and how to rebuild it; ``torch.utils._pytree`` knows every
    container torch does (named tuples, ``ModelOutput`` of transformers, ...)."""
    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list[Any], spec: TreeSpec) -> Any:
    return _pytree.tree_unflatten(leaves, spec)


def version(t: Tensor) -> int:
    """How many times ``t`` was modified in place (``Tensor._version``, autograd's own counter):
    tells whether a tensor seen earlier is still unchanged, at no device cost."""
    return int(t._version)


# -- multi-tensor ops: one op for many tensors, as clip_grad_norm_ and the optimizers use -------
def foreach_norm(tensors: Sequence[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """L2 norms of many tensors in one op (``torch._foreach_norm``), accumulated in ``dtype``."""
    return list(torch._foreach_norm(list(tensors), 2, dtype=dtype))


def foreach_div(tensors: Sequence[Tensor], divisor: Tensor | Sequence[Tensor]) -> list[Tensor]:
    return list(torch._foreach_div(list(tensors), divisor))  # type: ignore[arg-type]


def foreach_copy(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Copies of many tensors in one op (``torch._foreach_mul`` by 1)."""
    return list(torch._foreach_mul(list(tensors), 1.0))


def foreach_sub_(tensors: Sequence[Tensor], others: Sequence[Tensor]) -> None:
    torch._foreach_sub_(list(tensors), list(others))


# -- sparse and module internals ---------------------------------------------------------------
def sparse_parts(g: Tensor) -> tuple[Tensor, Tensor]:
    """Indices and values of a sparse COO tensor, coalesced or not (``indices()``/``values()``
    refuse an uncoalesced one, and coalescing syncs with the host)."""
    return g._indices(), g._values()


def own_parameters(module: nn.Module) -> Iterable[tuple[str, Tensor | None]]:
    """``module.named_parameters(recurse=False)`` without its generator machinery
    (``Module._parameters``): read on every logged step."""
    return module._parameters.items()


def forward_hooks(module: nn.Module) -> Iterable[object]:
    """The forward hooks registered on ``module`` (``Module._forward_hooks``): no public API lists them."""
    return module._forward_hooks.values()


def hook_dict_attributes(hooks_dict: dict[int, Any]) -> dict[str, Any]:
    """The attributes of a module's hooks dict (a ``RemovableHandle``'s ``hooks_dict_ref()`` or
    ``extra_dict_ref``), where ``capture.watched.LeftOut`` is set as its ``__reduce_ex__``: torch
    keeps a module's hooks in ``OrderedDict`` s (1.x to 2.14), whose instances take attributes
    (a plain ``dict`` takes none), and no public API changes how a module copies its hooks."""
    return vars(hooks_dict)


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` is ``torch.compile(model)`` (an ``OptimizedModule``) or had
    ``model.compile()`` called (``_compiled_call_impl``)."""
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule) or (
        getattr(model, "_compiled_call_impl", None) is not None
    )


#: The attributes under which wrappers hold the module they wrap: ``checkpoint_wrapper``'s
#: ``CheckpointWrapper``, FSDP1's ``FullyShardedDataParallel`` and ``torch.compile``'s
#: ``OptimizedModule``. Their ``state_dict()`` keys leave them out (the names the user knows).
WRAPPED_MODULE_ATTRIBUTES = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"})


def compiled_code_ran(module: nn.Module) -> bool:
    """Whether ``torch.compile`` already compiled the forward of ``module`` (an
    ``OptimizedModule``'s wrapped module, or one whose ``compile()`` was called): hooks added
    now inside it are ignored by that code (``skip_nnmodule_hook_guards``), which serves every
    instance of its class. Dynamo keeps its compiled code on the forward's code object
    (``_debug_get_cache_entry_list``); no public API tells."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    inner = module._orig_mod if isinstance(module, torch._dynamo.eval_frame.OptimizedModule) else module
    code = getattr(type(inner).forward, "__code__", None)
    return code is not None and bool(_debug_get_cache_entry_list(code))


# -- data parallelism --------------------------------------------------------------------------
def fsdp_gradient_divisor(module: nn.Module) -> float | None:
    """What FSDP2 (``fully_shard``) divides ``module``'s summed parameter gradients by: its
    ``set_gradient_divide_factor`` (torchtitan sets 1: its loss is normalised over the global
    batch), else the data-parallel size, the shard group's times the replicate group's under HSDP
    (as ``_fsdp_collectives._get_gradient_divide_factors``); ``None`` for a module without a
    parameter group of its own. Its param groups are private (``FSDPState._fsdp_param_groups``)."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return None
    for group in getattr(get_state(), "_fsdp_param_groups", ()):
        factor = getattr(group, "gradient_divide_factor", None)
        if factor is not None:
            return float(factor)
        info = group.mesh_info
        return float(getattr(info, "shard_mesh_size", 1) * getattr(info, "replicate_mesh_size", 1))
    return None


# -- GradScaler --------------------------------------------------------------------------------
def step_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> object | None:
    """The closure of the ``optimizer.step(...)`` call an optimizer step hook sees (``args[0]``
    is the optimizer): LBFGS & co. (and Lightning, always) compute the gradients inside
    ``step()`` by calling it, so they are read after it."""
    return kwargs.get("closure", args[1] if len(args) > 1 else None)


def loss_scale(scaler: torch.amp.GradScaler) -> Tensor | None:
    """The scaler's scale as its device tensor, without the host read ``get_scale()`` makes
    (``_get_scale_async``); ``None`` before its first ``scale()``."""
    return scaler._get_scale_async()


def initial_scale(scaler: torch.amp.GradScaler) -> float:
    return float(scaler._init_scale)


def grad_scale(optimizer: torch.optim.Optimizer) -> Tensor | None:
    """The loss scale still in ``.grad`` when ``GradScaler.step`` calls an optimizer that unscales
    inside its own ``step()`` (``fused=True`` Adam, AdamW, SGD): the scaler hands it over as
    ``optimizer.grad_scale`` for the length of the step (``None`` once ``unscale_`` ran)."""
    scale = getattr(optimizer, "grad_scale", None)
    return scale if isinstance(scale, Tensor) else None


def unscaled(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether the scaler's ``unscale_`` divided ``optimizer``'s gradients by the loss scale this
    step (its per-optimizer ``stage``, between ``unscale_`` or ``step()`` and ``update()``)."""
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states.get(id(optimizer))
    return state is not None and state["stage"] is not OptState.READY


def found_inf(scaler: torch.amp.GradScaler) -> list[Tensor]:
    """The scaler's inf/NaN flags of this step, per optimizer and device, between its ``step()``
    and ``update()`` (``_per_optimizer_states``); empty otherwise."""
    states = scaler._per_optimizer_states.values()
    return [flag for state in states for flag in state["found_inf_per_device"].values()]


# -- TensorBoard -------------------------------------------------------------------------------
def writer_closed(writer: SummaryWriter) -> bool:
    """Whether ``writer.close()`` was called (it sets ``all_writers`` to ``None``): its next write
    would silently open a new event file."""
    return writer.all_writers is None


def event_file_writer(writer: SummaryWriter) -> Any:
    """The writer's event file (``_get_file_writer``), to add one whole ``Summary`` as one event.
    A closed writer opens a new one, as on any write after ``close()``."""
    return writer._get_file_writer()


def fast_checksum(writer: SummaryWriter, frame: Callable[[bytes], bytes]) -> Callable[[], None]:
    """Give the record writer of ``writer``'s event file ``frame`` (``output.event_files.frame``:
    a C CRC-32C) in place of TensorBoard's pure-Python framing, which holds the GIL ~0.3 ms per
    kB; the bytes written are the same. Only this
    writer changes (its ``RecordWriter`` object gets its own ``write``, reached through
    ``FileWriter.event_writer._async_writer._writer``); returns what puts it back. A writer laid
    out otherwise keeps its own checksum. Nothing changes where ``google-crc32c`` has no C implementation."""
    try:
        records = event_file_writer(writer).event_writer._async_writer._writer
        file = records._writer
    except AttributeError:  # another tensorboard layout: keep its own checksum
        return _nothing
    if google_crc32c.implementation != "c" or "write" in vars(records):
        return _nothing  # (already given one, by another logger sharing this writer)

    def write(data: bytes) -> None:
        file.write(frame(data))

    records.write = write

    def restore() -> None:
        if vars(records).get("write") is write:
            del records.write

    return restore


def _nothing() -> None:
    pass


# -- DTensor ------------------------------------------------------------------------------------
def dtensor_api() -> ModuleType:
    """The module holding ``DTensor`` and its placements (``Replicate``, ...): public as
    ``torch.distributed.tensor`` from torch 2.5; torch 2.4 has them in ``torch.distributed._tensor``."""
    import torch.distributed.tensor as public

    if hasattr(public, "DTensor"):
        return public
    import torch.distributed._tensor as private

    return private


# -- tensor parallelism ------------------------------------------------------------------------
def _style_hooks(module: nn.Module) -> list[dict[str, Any]]:
    """What the forward (pre-)hooks of ``module`` close over, per hook: ``distribute_module``'s
    hooks close over ``device_mesh`` and ``input_fn``/``output_fn`` (``functools.partial`` of a
    style's ``_prepare_*_fn``, whose first arguments are the layouts); ``PrepareModuleInput``'s
    and ``PrepareModuleOutput``'s lambdas over ``self`` (the style) and ``device_mesh``. No public
    API tells a module's style."""
    out = []
    for hook in [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]:
        code, closure = getattr(hook, "__code__", None), getattr(hook, "__closure__", None) or ()
        if code is not None and "device_mesh" in code.co_freevars:
            out.append({name: cell.cell_contents for name, cell in zip(code.co_freevars, closure)})
    return out


def parallel_output(module: nn.Module) -> tuple[DeviceMesh, tuple[Placement, ...] | None] | None:
    """The device mesh of the tensor-parallel style ``parallelize_module`` gave ``module``, and the
    placements of the output its caller receives (``None``: a style whose output is not known
    here); ``None`` for a module without an output style (``PrepareModuleInput`` alone has none)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    mesh, placements, styled = None, None, getattr(module, "_distribute_module_applied", False)
    for contents in _style_hooks(module):
        fn = contents.get("output_fn", contents.get("input_fn"))
        func = getattr(fn, "func", None)
        # (SequenceParallel's output is sharded as its input)
        if func in (
            ColwiseParallel._prepare_output_fn,
            RowwiseParallel._prepare_output_fn,
            SequenceParallel._prepare_input_fn,
        ):
            mesh, placements = contents["device_mesh"], tuple(fn.args[0])  # type: ignore[union-attr]
        elif isinstance(style := contents.get("self"), PrepareModuleOutput):
            styled, mesh = True, contents["device_mesh"]
            layouts = style.desired_output_layouts
            placements = (layouts[0],) if len(layouts) == 1 else None
        elif styled and mesh is None:
            mesh = contents["device_mesh"]
    return (mesh, placements) if styled and mesh is not None else None


def prepared_input(module: nn.Module) -> tuple[DeviceMesh, Placement] | None:
    """The device mesh and the placement of the first positional input that
    ``PrepareModuleInput`` (or ``PrepareModuleInputOutput``) hands ``module``'s forward
    (its ``desired_input_layouts[0]``), or ``None`` where no style prepares that input."""
    from torch.distributed.tensor.parallel import PrepareModuleInput

    for contents in _style_hooks(module):
        style = contents.get("self")
        if isinstance(style, PrepareModuleInput) and style.input_layouts and style.input_layouts[0] is not None:
            desired = (style.desired_input_layouts or (None,))[0]
            return contents["device_mesh"], desired if desired is not None else style.input_layouts[0]
    return None


# -- torchtitan -------------------------------------------------------------------------------
def titan_backend() -> str | None:
    """torchtitan's SPMD backend in this process (``"spmd_types"``, ``"full_dtensor"``,
    ``"partial_dtensor"``), as its ``set_spmd_backend`` left it; ``None`` where torchtitan was
    never imported (it is not imported here)."""
    if "torchtitan.distributed.utils" not in sys.modules:
        return None
    backend = getattr(sys.modules["torchtitan.distributed.utils"], "get_spmd_backend", None)
    return None if backend is None else str(backend())


def titan_sharding(module: nn.Module) -> tuple[object | None, object | None, object | None] | None:
    """The layouts torchtitan's ``Module.parallelize`` applied to ``module`` (0.3.0, its private
    ``_sharding_config``, a ``ShardingConfig`` of ``SpmdLayout`` s): that of the output its
    caller receives (``out_dst_shardings``, else ``out_src_shardings``), that of the first
    positional input its forward is handed (``in_dst_shardings``, else ``in_src_shardings``)
    and that of the same input as the caller passes it (``in_src_shardings``); ``None`` for a
    module it did not parallelize."""
    config = getattr(module, "_sharding_config", None)
    if config is None or not getattr(module, "_parallelized", False):
        return None
    output = config.out_dst_shardings or config.out_src_shardings
    names = getattr(module, "_pos_arg_list", None) or []
    given = config.in_src_shardings or {}
    handed = {**given, **(config.in_dst_shardings or {})}
    first = names[0] if names else None
    return (None if isinstance(output, tuple) else output), handed.get(first), given.get(first)


def titan_state_shardings(module: nn.Module) -> list[object]:
    """The layouts torchtitan's ``Module.parallelize`` gave the parameters of ``module`` (0.3.0:
    its ``ShardingConfig``'s ``state_shardings``); none for a module it did not parallelize."""
    config = getattr(module, "_sharding_config", None)
    if config is None or not getattr(module, "_parallelized", False):
        return []
    return list((config.state_shardings or {}).values())


def titan_local_map_output(module: nn.Module) -> object | None:
    """The layout of what the forward of ``module`` returns from inside its local-tensor region,
    where torchtitan's ``Module.parallelize`` runs that forward as one (0.3.0: a
    ``ShardingConfig`` with ``local_map``, whose ``out_src_shardings`` is that layout); ``None``
    otherwise. Inside the region its submodules compute on plain local tensors."""
    config = getattr(module, "_sharding_config", None)
    if config is None or not getattr(module, "_parallelized", False) or config.local_map is None:
        return None
    return config.out_src_shardings  # type: ignore[no-any-return]


# -- torch function modes (attention statistics) -------------------------------------------------
def function_mode_on_top(mode: object) -> bool:
    """Whether ``mode`` is the innermost active ``TorchFunctionMode``
    (``torch.overrides._get_current_function_mode``): leaving a mode pops whichever is innermost."""
    return torch.overrides._get_current_function_mode() is mode


def context_parallel_mesh() -> DeviceMesh | None:
    """The mesh of the active ``torch.distributed.tensor.experimental.context_parallel``, whose
    ranks each hold a shard of the sequence of the same samples; ``None`` where none is active.
    It replaces ``F.scaled_dot_product_attention`` by a wrapper holding the mesh in its closure."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if sdpa is torch._C._nn.scaled_dot_product_attention:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    cells = getattr(sdpa, "__closure__", None) or ()
    return next((cell.cell_contents for cell in cells if isinstance(cell.cell_contents, DeviceMesh)), None)


@contextlib.contextmanager
def full_float32_matmul(device: torch.device) -> Iterator[None]:
    """Float32 matmuls on ``device`` in full IEEE float32 inside the block, whatever
    ``torch.set_float32_matmul_precision`` allows (TF32 in cuBLAS, bf16 or TF32 in oneDNN on the
    CPU); the user's setting is put back after through the same per-backend flag
    (``torch.backends.{cuda,mkldnn}.matmul.fp32_precision``, torch >= 2.9; ``allow_tf32`` before),
    so that it reads as it did, by either API. Matmuls other threads run meanwhile are in full
    float32 too (more precise, never less)."""
    backend: Any = None
    if device.type == "cuda":
        backend = torch.backends.cuda.matmul
    elif device.type == "cpu":
        backend = getattr(torch.backends.mkldnn, "matmul", None)
    name, full = ("fp32_precision", "ieee") if hasattr(backend, "fp32_precision") else ("allow_tf32", False)
    if not hasattr(backend, name):  # other devices; the CPU before torch 2.9, which had no such flag
        yield
        return
    before = getattr(backend, name)
    setattr(backend, name, full)
    try:
        yield
    finally:
        setattr(backend, name, before)


def varlen_attention_ops() -> frozenset[object]:
    """The op that ``torch.nn.attention.varlen.varlen_attn`` calls, as a ``TorchFunctionMode``
    sees it (``torch.ops.torch_attn._varlen_attn``, the packet and its overload), once that module
    is imported (which registers it); none before, nor on a torch without it."""
    if "torch.nn.attention.varlen" not in sys.modules or not hasattr(torch.ops.torch_attn, "_varlen_attn"):
        return frozenset()
    packet = torch.ops.torch_attn._varlen_attn
    return frozenset({packet, packet.default})


def flex_attention_file() -> str | None:
    """The source file of ``torch.nn.attention.flex_attention.flex_attention`` once that module
    is imported, else ``None``: its calls are frames named ``flex_attention`` of that file, also
    where dynamo runs its compiled code (a code object of its own, named and placed as the
    function's)."""
    module = sys.modules.get("torch.nn.attention.flex_attention")
    function = getattr(module, "flex_attention", None)
    return None if function is None else function.__code__.co_filename


#: The methods of ``torch.distributed.pipelining``'s stages that run a stage's module on data made
#: up to learn its shapes (torch >= 2.14: real tensors, ``torch.empty`` on later stages; before:
#: meta tensors under ``no_grad``), by name.
_PIPELINE_INFERENCE = frozenset({"_forward_metadata_inference", "_shape_inference"})


class PipelinePass(NamedTuple):
    """How the calling code runs under a ``torch.distributed.pipelining`` schedule."""

    inference: bool  # in a stage's shape inference (``_PIPELINE_INFERENCE``)
    microbatches: int  # what the schedule divides the stage's gradients by
    stages: tuple[int, ...]  # the indices of the stages this rank runs


def pipeline_pass() -> PipelinePass | None:
    """Where the calling code runs under a ``torch.distributed.pipelining`` schedule: whether in a
    stage's shape inference (``_PIPELINE_INFERENCE``), what the schedule divides the stage's
    gradients by (its microbatch count, ``scale_grads=True``, its default; else 1), and which of
    the pipeline's stages it runs on this rank; ``None``
    outside a schedule, and in code ``torch.compile`` traces (frames are no part of a graph: a walk
    of them would break it). Read off the calling frames (the schedule holds the stage, not the
    module the logger was given, and says nothing to its hooks); a few frame hops a call, logged
    steps only."""
    if "torch.distributed.pipelining" not in sys.modules or torch.compiler.is_compiling():
        return None
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    inference, frame = False, sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_name  # (a frame's locals are read only where its name matches: they cost)
        inference |= name in _PIPELINE_INFERENCE
        schedule = frame.f_locals.get("self") if name in ("step", "_step_microbatches") else None
        if isinstance(schedule, _PipelineSchedule):
            scale = getattr(schedule, "scale_grads", True)
            held = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
            stages = tuple(sorted(int(getattr(stage, "stage_index", -1)) for stage in held))
            return PipelinePass(inference, int(getattr(schedule, "_n_microbatches", 1)) if scale else 1, stages)
        frame = frame.f_back  # type: ignore[assignment]
    return None
