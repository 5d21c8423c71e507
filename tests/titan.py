"""torchtitan 0.3.0's own Llama 3 on CPU processes with gloo: a debug-sized config (two blocks,
four heads), its sharding configuration, ``parallelize_llama`` with a ``ParallelDims`` (FSDP2
always applied, as torchtitan applies it) under each of its three backends, and the same weights
in one process, in float64. torchtitan is installed by ``scripts/bootstrap`` (``--no-deps``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

DIM, HEADS, VOCAB, SEQ = 32, 4, 64, 8
EXPERTS = 4
HIDDEN = 96  # (its pieces, 48 wide, unlike the model width: see docs/sharded.md, Limits)


def config(*, sp: bool = True) -> Any:
    """torchtitan's debug Llama 3 made small, with its sharding configuration (``enable_sp``).
    Its language models' attention (FlexAttention, varlen) has no backward on the CPU: the
    blocks use torchtitan's own ``ScaledDotProductAttention`` instead (causal)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        ComplexRoPE,
        Embedding,
        Linear,
        Llama3Model,
        RMSNorm,
        _build_llama3_layers,
    )
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    rope = ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=10000, scaling="none")
    layers = _build_llama3_layers(n_layers=2, dim=DIM, n_heads=HEADS, hidden_dim=HIDDEN, rope=rope, attn_backend="flex")
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=layers,
    )
    set_llama3_sharding_config(cfg, enable_sp=sp)
    return cfg


def moe_config(*, sp: bool = True) -> Any:
    """torchtitan's debug Qwen3 MoE made small (two blocks, four heads, four routed experts of
    which each token takes two, no shared experts), with its sharding configuration; its
    attention as :func:`config`'s."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import (  # type: ignore[attr-defined]
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    head = DIM // HEADS
    rope = CosSinRoPE.Config(dim=head, max_seq_len=64, theta=1000000.0)
    layers = _build_qwen3_moe_layers(
        n_layers=2,
        dim=DIM,
        n_heads=HEADS,
        n_kv_heads=HEADS,
        head_dim=head,
        moe_hidden_dim=HIDDEN // 2,
        num_experts=EXPERTS,
        top_k=2,
        attn_backend="flex",
        moe_comm_backend="standard",
        rope=rope,
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg = Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=_qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=layers,
    )
    set_qwen3_sharding_config(cfg, enable_sp=sp, enable_ep=False)
    return cfg


def one_process(*, moe: bool = False) -> nn.Module:
    """The model (``moe``: :func:`moe_config`'s) unsharded, its weights drawn from seed 0, in float64."""
    with float64():
        torch.manual_seed(0)
        model = (moe_config() if moe else config()).build()
        with torch.no_grad():
            model.init_weights(buffer_device=None)
    return model


@contextlib.contextmanager
def float64() -> Iterator[None]:
    """Tensors made inside are float64 by default."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def parallel(
    backend: str,
    world: int,
    *,
    tp: int,
    sp: bool = True,
    compiled: bool = False,
    moe: bool = False,
    before: Callable[[nn.Module], object] | None = None,
    **parallelism: Any,
) -> tuple[nn.Module, Any]:
    """The model as torchtitan shards it on ``world`` ranks with tensor-parallel degree ``tp``
    (the rest data parallel, FSDP2), under ``backend``, with :func:`one_process`'s weights
    (``compiled``: each block compiled as torchtitan compiles it, ``fullgraph=True``, eager
    backend; ``moe``: :func:`moe_config`'s model, by ``parallelize_qwen3``); and its ``ParallelDims``.
    ``before`` is given the model as built, before it is sharded."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.qwen3 import parallelize_qwen3

    parallel_dims.device_type = "cpu"  # (torchtitan's device choice: the accelerator it finds, else CUDA)
    options = ParallelismConfig(
        tensor_parallel_degree=tp, spmd_backend=backend, enable_sequence_parallel=sp, **parallelism
    )
    dist_utils.set_spmd_backend(backend)
    dims = ParallelDims.from_config(options, world)
    dims.build_mesh()
    with torch.device("meta"), float64():
        model = (moe_config if moe else config)(sp=sp).build()
    if before is not None:
        before(model)
    TORCH_DTYPE_MAP.setdefault("float64", torch.float64)  # (its mixed precision offers float32 and bf16 only)
    training = TrainingConfig(mixed_precision_param="float64", mixed_precision_reduce="float64")
    model = (parallelize_qwen3 if moe else parallelize_llama)(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=options,
        compile_config=CompileConfig(enable=compiled, components=["model"], backend="eager"),
        ac_config=None,
        dump_folder="/tmp",
    )
    _load(model, moe=moe)
    return model, dims


def _load(model: nn.Module, *, moe: bool = False) -> None:
    """``model`` (sharded, on the meta device) made on the CPU with :func:`one_process`'s weights."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    model.to_empty(device="cpu")
    full = dict(one_process(moe=moe).named_parameters())
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # (the buffers: rotary angles)
        for name, param in model.named_parameters():
            whole = full[name.replace("_checkpoint_wrapped_module.", "")]
            if isinstance(param, DTensor):
                param.to_local().copy_(distribute_tensor(whole, param.device_mesh, param.placements).to_local())
            else:
                param.copy_(whole)


def pipelined(
    world: int, batch: int, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> tuple[Any, nn.Module]:
    """The model split into ``world`` pipeline stages by torchtitan's ``pipeline_llm`` (one a rank,
    its default ``1F1B`` schedule over microbatches of one sequence of a ``batch``), each stage
    sharded by ``parallelize_llama`` (FSDP2 over a data-parallel mesh of one rank), with
    :func:`one_process`'s weights; the schedule and this rank's stage. ``loss``: of a microbatch,
    its share of the batch's (torchtitan's schedules add the microbatches' gradients up)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import parallelize_llama

    parallel_dims.device_type = "cpu"
    options = ParallelismConfig(pipeline_parallel_degree=world, spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend("partial_dtensor")
    dims = ParallelDims.from_config(options, world)
    dims.build_mesh()
    cfg = config()
    with torch.device("meta"), float64():
        model = cfg.build()
    TORCH_DTYPE_MAP.setdefault("float64", torch.float64)
    training = TrainingConfig(mixed_precision_param="float64", mixed_precision_reduce="float64", local_batch_size=batch)
    schedule, (stage,), _, _ = pipeline_llm(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=options,
        compile_config=CompileConfig(enable=False),
        ac_config=None,
        dump_folder="/tmp",
        device=torch.device("cpu"),
        model_config=cfg,
        parallelize_fn=parallelize_llama,
        loss_fn=lambda logits, targets: (loss(logits, targets), None),
    )
    _load(stage)
    return schedule, stage


@contextlib.contextmanager
def spmd_context(dims: Any) -> Iterator[None]:
    """torchtitan's training context for its backend (the spmd_types meshes); none for one process."""
    if dims is None:
        yield
        return
    from torchtitan.distributed.utils import get_spmd_context

    with get_spmd_context(parallel_dims=dims)():
        yield


def inputs(tokens: torch.Tensor, dims: Any) -> torch.Tensor:
    """The batch as the backend takes it: a ``DTensor`` under ``full_dtensor``."""
    if dims is None or dims.spmd_backend != "full_dtensor":
        return tokens
    from torchtitan.distributed import full_dtensor

    return full_dtensor.parallelize_inputs(dims, tokens, tokens, {})[0]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t
