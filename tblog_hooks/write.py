"""Encode a :class:`~tblog_hooks.summarize.StepSummary` as the event a ``SummaryWriter`` writes.

A logged step becomes one event holding every scalar and histogram, instead of one event
per value: a few hundred values cost one record, one queue slot and one checksum.
"""

from __future__ import annotations

import numpy as np
from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary

from .pictures import png
from .summarize import StepSummary


def to_proto(summary: StepSummary) -> Summary:
    """The ``Summary`` protobuf ``SummaryWriter.add_scalar``/``add_histogram_raw``/``add_image`` would write."""
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
    return Summary(value=values)


def image_proto(image: np.ndarray) -> Summary.Image:
    """A PNG-encoded TensorBoard image of a uint8 array, channels first (1 or 3)."""
    channels, height, width = image.shape
    return Summary.Image(height=height, width=width, colorspace=channels, encoded_image_string=png(image))


def use_fast_checksum() -> bool:
    """Give TensorBoard's record writer a C CRC-32C (``google-crc32c``) in place of its
    pure-Python one, which holds the GIL ~0.3 ms per kB. Bytes written are identical.
    Returns whether the C implementation is in use."""
    try:
        import google_crc32c
        from tensorboard.summary.writer import record_writer
    except ImportError:
        return False
    if google_crc32c.implementation != "c":
        return False
    from .event_files import masked_crc32c

    record_writer.masked_crc32c = masked_crc32c
    return True
