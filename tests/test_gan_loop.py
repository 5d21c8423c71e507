"""A GAN trained as PyTorch's DCGAN example trains it (two models, one writer, the generator's
backward running through the discriminator after it stepped, a sample pass of ``netG(fixed_noise)``
in training mode): the advice docs/training-loops.md gives for it, followed, logs what each
optimizer used and the training batch's statistics."""

from __future__ import annotations

import torch
from conftest import read_run
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from tblog_hooks import HookLogger

NZ, NX, BATCH, STEPS = 4, 6, 16, 3


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    net_g = nn.Sequential(nn.Linear(NZ, 16), nn.ReLU(), nn.Linear(16, NX), nn.Tanh())
    net_d = nn.Sequential(nn.Linear(NX, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())
    return net_g, net_d


def _norm(model: nn.Module) -> float:
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()


def _train(log_dir, *, advice: bool) -> tuple[list[float], list[float], list[float]]:
    """The example's loop; with ``advice``, both optimizers given and the sample pass under
    ``no_grad``. Returns what D's and G's optimizers used at each step (their ``.grad`` norms at
    ``step()``), and the mean of G's first layer over each step's training batch."""
    net_g, net_d = _models()
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-3, betas=(0.5, 0.999))
    criterion, fixed_noise = nn.BCELoss(), torch.randn(8, NZ)
    data = torch.Generator().manual_seed(1)
    used_d, used_g, g_first = [], [], []
    first = net_g[0].register_forward_hook(lambda m, i, out: g_first.append(out.detach().mean().item()))
    writer = SummaryWriter(log_dir)
    options = {"optimizer": [opt_g, opt_d]} if advice else {}
    g_hooks = HookLogger(net_g, writer=writer, prefix="G", every=1, histograms=False, **options)
    d_hooks = HookLogger(net_d, writer=writer, prefix="D", every=1, histograms=False, **options)
    with g_hooks, d_hooks:
        for _ in range(STEPS):
            real = torch.randn(BATCH, NX, generator=data)
            net_d.zero_grad()
            err_real = criterion(net_d(real).view(-1), torch.ones(BATCH))
            err_real.backward()
            noise = torch.randn(BATCH, NZ, generator=data)
            fake = net_g(noise)
            err_fake = criterion(net_d(fake.detach()).view(-1), torch.zeros(BATCH))
            err_fake.backward()
            used_d.append(_norm(net_d))
            opt_d.step()
            net_g.zero_grad()
            err_g = criterion(net_d(fake).view(-1), torch.ones(BATCH))  # into D's .grad too, after D stepped
            err_g.backward()
            used_g.append(_norm(net_g))
            opt_g.step()
            first.remove()  # the training batch's alone
            if advice:
                with torch.no_grad():
                    net_g(fixed_noise)
            else:
                net_g(fixed_noise)
            first = net_g[0].register_forward_hook(lambda m, i, out: g_first.append(out.detach().mean().item()))
            g_hooks.step()
            d_hooks.step()
    first.remove()
    writer.close()
    return used_d, used_g, g_first


def test_the_advice_for_a_gan_logs_what_each_optimizer_used_and_the_training_batch(tmp_path) -> None:
    used_d, used_g, g_first = _train(tmp_path, advice=True)
    run = read_run(tmp_path)
    for step in range(STEPS):
        assert abs(run.scalar("D/param_grad/global_norm", step) / used_d[step] - 1) < 1e-6
        assert abs(run.scalar("G/param_grad/global_norm", step) / used_g[step] - 1) < 1e-6
        assert abs(run.scalar("G/activation/mean/0", step) - g_first[step]) < 1e-6


def test_without_the_advice_the_numbers_differ_as_the_docs_say(tmp_path) -> None:
    """What the docs warn of: without ``optimizer=``, D's gradient is read when the last backward
    through it ends (the generator's, after D stepped); the sample pass pools into G's step."""
    used_d, used_g, g_first = _train(tmp_path, advice=False)
    run = read_run(tmp_path)
    for step in range(STEPS):
        assert abs(run.scalar("D/param_grad/global_norm", step) / used_d[step] - 1) > 1e-3
        assert abs(run.scalar("G/param_grad/global_norm", step) / used_g[step] - 1) < 1e-6
        assert abs(run.scalar("G/activation/mean/0", step) - g_first[step]) > 1e-4
