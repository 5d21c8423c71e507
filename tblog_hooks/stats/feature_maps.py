"""Feature-map grids: one sample's output channels as one image, assembled on the device with torchvision."""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: Most channels a feature-map grid shows (the first ones), and the largest side of a tile:
#: larger maps are average-pooled down, which keeps the grid's share of the transfer small.
MAX_FEATURE_CHANNELS, MAX_FEATURE_SIDE = 64, 64


def feature_grid(x: Tensor) -> Tensor:
    """One sample's channels (``C x H x W``, or more dims: first slice; ``C x L``: one row
    each) as a grey ``1 x H x W`` grid in [0, 1], each channel scaled to its own range and
    pooled to at most ``MAX_FEATURE_SIDE`` pixels a side. Stays on the device."""
    while x.dim() > 3:
        x = x[:, 0]
    if x.dim() == 2:
        x = x.unsqueeze(1)
    x = x[:MAX_FEATURE_CHANNELS].float()
    x = torch.nn.functional.adaptive_avg_pool2d(
        x, (min(x.shape[1], MAX_FEATURE_SIDE), min(x.shape[2], MAX_FEATURE_SIDE))
    )
    lo = x.amin(dim=(1, 2), keepdim=True)
    span = (x.amax(dim=(1, 2), keepdim=True) - lo).clamp_min(1e-12)
    x = ((x - lo) / span).nan_to_num_(0.0, 0.0, 0.0)
    import torchvision  # here, where a grid is drawn: importing it takes a second and most runs draw none

    grid = torchvision.utils.make_grid(x.unsqueeze(1), nrow=math.ceil(math.sqrt(x.shape[0])), padding=1, pad_value=1)
    return grid[:1]  # type: ignore[no-any-return]  # torchvision is untyped
