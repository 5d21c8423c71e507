"""The example of ``docs/compare.md``: where fp32 and bf16 autocast part on a small GPT-2.

Trains a tiny ``transformers`` GPT-2 (2 layers, 2 heads, width 64, 64 tokens of vocabulary) twice
from the same seed on the same random tokens, logged every 5 steps for 40 steps, once in float32
and once under ``torch.autocast(dtype=torch.bfloat16)``, then prints ``tblog-hooks compare`` of
the two runs, with the default tolerance and with ``--rtol 0.01 --atol 1e-6`` (which leaves out
the round-off around zero of LayerNorm means):

    python scripts/compare_example.py [--logdir runs/compare] [--device cpu]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as transformers_logging

from tblog_hooks import HookLogger
from tblog_hooks.cli import main as cli

STEPS, EVERY = 40, 5


def train(run_dir: Path, device: str, autocast: bool) -> None:
    """40 AdamW steps on random tokens (the same in both runs), logged every 5 with ``spikes=True``."""
    transformers_logging.set_verbosity_error()  # a small vocabulary lacks GPT-2's special tokens: unused here
    torch.manual_seed(0)
    config = GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=64, n_positions=32, attn_implementation="sdpa")
    model = GPT2LMHeadModel(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.Generator().manual_seed(1)
    with HookLogger(model, log_dir=run_dir, every=EVERY, optimizer=opt, spikes=True) as hooks:
        for _ in range(STEPS):
            x = torch.randint(0, 64, (8, 32), generator=tokens).to(device)
            with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast):
                loss = model(x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logdir", type=Path, default=Path("runs/compare"))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    fp32, bf16 = args.logdir / "fp32", args.logdir / "bf16"
    train(fp32, args.device, autocast=False)
    train(bf16, args.device, autocast=True)
    for tolerance in ([], ["--rtol", "0.01", "--atol", "1e-6"]):
        command = ["compare", str(fp32), str(bf16), *tolerance]
        print(f"$ tblog-hooks {' '.join(command)}")
        status = cli(command)
        print(f"(exit status {status})\n")


if __name__ == "__main__":
    main()
