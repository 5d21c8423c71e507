"""Encode a :class:`~tblog_hooks.output.summary.StepSummary` as the event a ``SummaryWriter`` writes.

A logged step becomes one event holding every scalar, histogram, image and value table, instead of one event
per value: a few hundred values cost one record, one queue slot and one checksum.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image
from tensorboard.compat.proto.summary_pb2 import DataClass, HistogramProto, Summary, SummaryMetadata
from tensorboard.util import tensor_util

from ..stats.tags import TABLE_PLUGIN
from .summary import StepSummary


def to_proto(summary: StepSummary) -> Summary:
    """The ``Summary`` protobuf ``SummaryWriter.add_scalar``/``add_histogram_raw``/``add_image`` would
    write, and the value tables and the forward order as tensors of this package's dashboard plugin."""
    values = [Summary.Value(tag=t, simple_value=v) for t, v in summary.scalars.items()]
    values += [
        Summary.Value(
            tag=t,
            histo=HistogramProto(
                min=h.min,
                max=h.max,
                num=h.num,
                sum=h.sum,
                sum_squares=h.sum_squares,
                bucket_limit=h.limits,
                bucket=h.counts,
            ),
        )
        for t, h in summary.histograms.items()
    ]
    values += [Summary.Value(tag=t, image=image_proto(image)) for t, image in summary.images.items()]
    values += [
        Summary.Value(tag=t, metadata=_TABLE_METADATA, tensor=tensor_util.make_tensor_proto(table))
        for t, table in summary.tensors.items()
    ]
    return Summary(value=values)


#: A tensor of the dashboard's plugin; the data class is what TensorBoard's data server files it under.
_TABLE_METADATA = SummaryMetadata(
    plugin_data=SummaryMetadata.PluginData(plugin_name=TABLE_PLUGIN), data_class=DataClass.DATA_CLASS_TENSOR
)


def image_proto(image: np.ndarray) -> Summary.Image:
    """A PNG-encoded TensorBoard image of a uint8 array, channels first (1 or 3)."""
    channels, height, width = image.shape
    return Summary.Image(height=height, width=width, colorspace=channels, encoded_image_string=png(image))


def png(image: np.ndarray) -> bytes:
    """A uint8 ``C x H x W`` array (1 or 3 channels) as PNG bytes, encoded by Pillow."""
    pixels = np.ascontiguousarray(image.transpose(1, 2, 0))
    buffer = io.BytesIO()
    # Level 1: the heatmap is flat blocks of colour, which compress well at the fastest level.
    Image.fromarray(pixels[..., 0] if pixels.shape[2] == 1 else pixels).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()
