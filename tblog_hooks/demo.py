"""The demo: a stock torchvision ResNet-18 trained on generated images with the logger attached."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torchvision
from torch import nn
from torch.utils.data import DataLoader
from torchvision import transforms
from tqdm import tqdm

from .logger import HookLogger


def pick_device(choice: str) -> torch.device:
    """``auto`` is CUDA when available, else the CPU."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for, but torch.cuda.is_available() is False")
    return torch.device(choice)


def run_demo(
    logdir: str | os.PathLike[str], steps: int, every: int, device: torch.device, batch_size: int = 16
) -> Path:
    """Train ResNet-18 on ``FakeData`` (nothing is downloaded) for ``steps`` optimizer steps."""
    torch.manual_seed(0)
    data = torchvision.datasets.FakeData(
        size=steps * batch_size, image_size=(3, 64, 64), num_classes=10, transform=transforms.ToTensor()
    )
    loader = DataLoader(data, batch_size=batch_size, shuffle=False)
    model = torchvision.models.resnet18(num_classes=10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    run_dir = Path(logdir) / "resnet18"
    with HookLogger(model, log_dir=run_dir, every=every, optimizer=optimizer) as hooks:
        progress = tqdm(loader, total=steps, desc="resnet18", unit="step")
        for images, labels in progress:
            loss = loss_fn(model(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            hooks.step()
            if hooks.global_step % every == 1:
                progress.set_postfix(loss=f"{loss.item():.3f}")
    return run_dir
