"""Train a small classifier with the logger attached: AMP with GradScaler, gradient
accumulation and, when started by torchrun, DDP (gloo on the CPU, NCCL on CUDA).

    python scripts/train.py --logdir runs/train
    torchrun --nproc_per_node=2 scripts/train.py --logdir runs/train

Each optimizer step runs ``--accumulate`` micro-batches; the logger counts optimizer steps,
pools the micro-batches of a logged step, reports unscaled gradients and the steps the
scaler skips, and only rank 0 writes.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from tblog_hooks import HookLogger

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", default="runs/train", help="TensorBoard run directory (default: runs/train)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step (default: 4)")
    parser.add_argument("--batch-size", type=int, default=32, help="examples per micro-batch and rank (default: 32)")
    parser.add_argument("--every", type=int, default=10, help="log every N optimizer steps (default: 10)")
    parser.add_argument("--dtype", choices=DTYPES, default="float16", help="autocast dtype (default: float16)")
    parser.add_argument("--reduce-ranks", action="store_true", help="pool activation statistics over all ranks")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    distributed = "RANK" in os.environ  # started by torchrun
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    model: nn.Module = nn.parallel.DistributedDataParallel(net) if distributed else net
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dtype = DTYPES[args.dtype]
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)  # bf16 needs no loss scaling
    data = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
    centres = torch.randn(10, 32, generator=torch.Generator().manual_seed(0))

    with HookLogger(
        model, log_dir=args.logdir, every=args.every, optimizer=optimizer, scaler=scaler, reduce_ranks=args.reduce_ranks
    ) as hooks:
        progress = tqdm(range(args.steps), desc="train", unit="step", disable=rank != 0)
        for _ in progress:
            for micro in range(args.accumulate):
                labels = torch.randint(0, 10, (args.batch_size,), generator=data)
                x = (centres[labels] + torch.randn(args.batch_size, 32, generator=data)).to(device)
                # DDP averages gradients once, on the last micro-batch of the step.
                last = micro == args.accumulate - 1
                sync = model.no_sync() if distributed and not last else nullcontext()  # type: ignore[operator]
                with sync:
                    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                        loss = nn.functional.cross_entropy(model(x), labels.to(device)) / args.accumulate
                    scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            hooks.step()
            if hooks.global_step % args.every == 0:
                progress.set_postfix(loss=f"{loss.item() * args.accumulate:.3f}")
    if distributed:
        dist.destroy_process_group()
        # DDP keeps the gloo process group and its worker threads alive into interpreter teardown,
        # where a worker dropping its last collective's tensors must take the GIL of a finalizing
        # interpreter, which aborts the process (SIGABRT, "terminate called without an active
        # exception"; pytorch/pytorch#179291): training is done and written, so leave without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
