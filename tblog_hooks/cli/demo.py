"""The demo: a stock torchvision ResNet-18 trained on generated images with the logger attached
(``healthy``), or a small model that shows one problem the logger finds."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import torch
import torchvision
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torchvision import transforms
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..logger import HookLogger

Batches = Iterator[tuple[Tensor, Tensor]]
Scenario = tuple[nn.Module, float, Batches, nn.Module]  # model, learning rate, batches, loss
#: Optimizer steps each scenario trains by default.
DEFAULT_STEPS = {"healthy": 300, "vanishing": 200, "exploding": 100, "dead-relu": 200, "nan": 60}


def pick_device(choice: str) -> torch.device:
    """``auto`` is CUDA when available, else the CPU."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for, but torch.cuda.is_available() is False")
    return torch.device(choice)


def run_demo(
    logdir: str | os.PathLike[str], scenario: str, steps: int | None, every: int, device: torch.device
) -> Path:
    """Train the ``scenario``'s model for ``steps`` optimizer steps; returns the run directory."""
    torch.manual_seed(0)
    steps = DEFAULT_STEPS[scenario] if steps is None else steps
    model, lr, batches, loss_fn = _SCENARIOS[scenario](steps)
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    run_dir = Path(logdir) / ("resnet18" if scenario == "healthy" else scenario)
    # Findings are logged; route them through tqdm so they do not break the progress bar.
    with HookLogger(model, log_dir=run_dir, every=every, optimizer=optimizer) as hooks, logging_redirect_tqdm():
        progress = tqdm(batches, total=steps, desc=scenario, unit="step")
        for x, y in progress:
            loss = loss_fn(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            hooks.step()
            if hooks.global_step % every == 1:
                progress.set_postfix(loss=f"{loss.item():.3g}", **hooks.summary())
    return run_dir


def _healthy(steps: int, batch_size: int = 16) -> Scenario:
    """Stock ResNet-18 (default init) on ``FakeData`` (nothing is downloaded)."""
    data = torchvision.datasets.FakeData(
        size=steps * batch_size, image_size=(3, 64, 64), num_classes=10, transform=transforms.ToTensor()
    )
    model = torchvision.models.resnet18(num_classes=10)
    return model, 0.05, iter(DataLoader(data, batch_size=batch_size)), nn.CrossEntropyLoss()


def _vanishing(steps: int) -> Scenario:
    """A deep sigmoid MLP: each layer scales the gradient by at most 1/4, so early layers learn nothing."""
    layers: list[nn.Module] = [nn.Linear(16, 64), nn.Sigmoid()]
    for _ in range(10):
        layers += [nn.Linear(64, 64), nn.Sigmoid()]
    return nn.Sequential(*layers, nn.Linear(64, 2)), 0.1, _blobs(steps), nn.CrossEntropyLoss()


def _exploding(steps: int) -> Scenario:
    """A deep ReLU regression MLP initialised with weights 1.8x too large (std 2.5/sqrt(fan_in)
    instead of He's 1.41/sqrt(fan_in)): gradients grow layer by layer, then the weights diverge."""
    layers: list[nn.Module] = [nn.Linear(16, 64), nn.ReLU()]
    for _ in range(6):
        layers += [nn.Linear(64, 64), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(64, 1))
    with torch.no_grad():
        for layer in model:
            if isinstance(layer, nn.Linear):
                layer.weight.normal_(0.0, 2.5 / layer.in_features**0.5)
    targets = ((x, x.sum(dim=1, keepdim=True)) for x, _ in _blobs(steps))
    return model, 1e-3, targets, nn.MSELoss()


def _dead_relu(steps: int) -> Scenario:
    """A ReLU MLP whose hidden biases start at -3: most units never fire and never recover."""
    hidden = [nn.Linear(16, 64), nn.Linear(64, 64)]
    with torch.no_grad():
        for layer in hidden:
            layer.bias.fill_(-3.0)
    model = nn.Sequential(hidden[0], nn.ReLU(), hidden[1], nn.ReLU(), nn.Linear(64, 2))
    return model, 0.05, _blobs(steps), nn.CrossEntropyLoss()


class RowNormalize(nn.Module):
    """``scale * x / ||x||`` per sample, without an epsilon: an all-zero sample gives 0/0 = NaN."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(features))

    def forward(self, x: Tensor) -> Tensor:
        norm: Tensor = torch.linalg.vector_norm(x, dim=1, keepdim=True)
        return self.scale * x / norm


def _nan(steps: int) -> Scenario:
    """Input normalisation without an epsilon; from step 30 on batches hold a padding row of zeros."""
    model = nn.Sequential(
        OrderedDict(
            normalize=RowNormalize(16),
            hidden=nn.Linear(16, 64),
            act=nn.ReLU(),
            norm=nn.LayerNorm(64),
            out=nn.Linear(64, 2),
        )
    )

    def batches() -> Batches:
        for step, (x, y) in enumerate(_blobs(steps)):
            if step >= 30:
                x[0] = 0.0
            yield x, y

    return model, 0.05, batches(), nn.CrossEntropyLoss()


def _blobs(steps: int, batch_size: int = 64) -> Batches:
    """Two Gaussian classes in 16 dimensions."""
    for _ in range(steps):
        y = torch.randint(0, 2, (batch_size,))
        yield torch.randn(batch_size, 16) + (2 * y[:, None] - 1), y


_SCENARIOS = {
    "healthy": _healthy,
    "vanishing": _vanishing,
    "exploding": _exploding,
    "dead-relu": _dead_relu,
    "nan": _nan,
}
