"""Small runs written once per test module of the dashboard: the logger on a model with attention,
a dead layer, a NaN and spikes; two prefixed loggers in one directory; a run of user tags only;
and more every-step values than TensorBoard keeps by default."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.tensorboard import SummaryWriter

from tblog_hooks import HookLogger

#: The run directories and the models (``(run, prefix)``) the dashboard should list.
MODELS = [("gan", "D"), ("gan", "G"), ("long", ""), ("net", "")]
#: Steps of the run ``long``: more than TensorBoard's default reservoir of 1,000 scalars per tag.
LONG_STEPS = 1500
NET_STEPS, NET_EVERY = 40, 4


class SelfAttention(nn.Module):
    """Two heads of causal self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, w))


class Poison(nn.Module):
    """The identity, until ``armed``: then its output holds a NaN (the ``nonfinite`` finding)."""

    armed = False

    def forward(self, x: Tensor) -> Tensor:
        return x.index_fill(-1, torch.tensor([0]), math.nan) if self.armed else x


def net() -> nn.Sequential:
    """Embedding, attention in a module whose name must be escaped, a dead ReLU layer, a NaN, a head."""
    model = nn.Sequential()
    model.add_module("embed", nn.Linear(6, 8))
    model.add_module("a/b c", SelfAttention(8))
    model.add_module("dead", nn.Linear(8, 8))
    model.add_module("relu", nn.ReLU())
    model.add_module("poison", Poison())
    model.add_module("head", nn.Linear(8, 1))
    with torch.no_grad():
        model.dead.bias.fill_(-50.0)  # never positive: the ReLU after it is dead
    return model


def write_net(run_dir: Path) -> None:
    """``NET_STEPS`` steps of :func:`net`, logged every ``NET_EVERY``, with a loss spike at step 30
    and a NaN at the last logged step."""
    torch.manual_seed(0)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with HookLogger(
        model, log_dir=run_dir, every=NET_EVERY, optimizer=opt, attention=True, spikes=True, numerics=True
    ) as hooks:
        for step in range(NET_STEPS):
            model.poison.armed = step == NET_STEPS - NET_EVERY
            loss = model(torch.randn(4, 5, 6)).square().mean() * (100.0 if step == 30 else 1.0)
            loss.backward()
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss)


def write_gan(run_dir: Path) -> None:
    """A generator and a discriminator, each logged with its own ``prefix=`` into one directory."""
    torch.manual_seed(0)
    g, d = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD([*g.parameters(), *d.parameters()], lr=0.05)
    with (
        HookLogger(g, log_dir=run_dir, every=2, prefix="G", optimizer=opt) as hooks_g,
        HookLogger(d, log_dir=run_dir, every=3, prefix="D", optimizer=opt) as hooks_d,
    ):
        for _ in range(12):
            d(g(torch.randn(5, 3))).mean().backward()
            opt.step()
            opt.zero_grad()
            hooks_g.step()
            hooks_d.step()


def write_long(run_dir: Path) -> None:
    """The tags of ``spikes=`` at every one of ``LONG_STEPS`` steps, a logged step every 100."""
    with SummaryWriter(run_dir) as writer:
        for step in range(LONG_STEPS):
            writer.add_scalar("step/grad_norm", 1.0 + (step % 7) / 7, step)
            writer.add_scalar("step/loss", 2.0 - step / LONG_STEPS, step)
            if step % 100 == 0:
                writer.add_scalar("gradient/norm/0", 1.0 / (step + 1), step)


def write_user_tags(run_dir: Path) -> None:
    """A run of someone else's tags, among them one that ends like this package's (``step/loss``)."""
    with SummaryWriter(run_dir) as writer:
        for step in range(5):
            writer.add_scalar("loss", 1.0 / (step + 1), step)
            writer.add_scalar("train/step/loss", 1.0 / (step + 1), step)


def write_all(logdir: Path) -> None:
    """Every run above, each in its own directory under ``logdir``."""
    write_net(logdir / "net")
    write_gan(logdir / "gan")
    write_long(logdir / "long")
    write_user_tags(logdir / "user")
