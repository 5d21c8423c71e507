"""Every private TensorBoard API the read side (the dashboard plugin) uses, in one place, each with
why it is needed; tested with tensorboard 2.21.0. What TensorBoard loads never imports torch, so
this module imports none (the torch side's private APIs, and TensorBoard's writer reached through
torch's ``SummaryWriter``, are ``_compat.py``'s). A TensorBoard upgrade means reading this file.
"""

from __future__ import annotations

from collections.abc import Sequence

from tensorboard.data import grpc_provider, provider
from tensorboard.data.proto import data_provider_pb2

#: ``(steps, values)`` of one scalar tag, in step order.
Column = tuple[list[int], list[float]]


def read_scalar_columns(
    data_provider: provider.DataProvider, experiment_id: str, run: str, tags: Sequence[str], plugin: str, points: int
) -> dict[str, Column] | None:
    """``{tag: (steps, values)}`` of ``run``'s scalar ``tags`` (at most ``points`` values of each)
    as TensorBoard's data server answers, in columns; ``None`` where ``data_provider`` is not the
    client of that server. Its Python client turns the columns into an object per value (seconds for
    the millions of a deep model's run), and it has no public columnar read: the request it would
    make itself goes through its own stub (``_stub``), its errors translated as it translates them
    (``_translate_grpc_error``: a 400 or 404 rather than a gRPC error)."""
    if not isinstance(data_provider, grpc_provider.GrpcDataProvider):
        return None
    request = data_provider_pb2.ReadScalarsRequest(experiment_id=experiment_id)
    request.plugin_filter.plugin_name = plugin
    request.run_tag_filter.runs.names[:] = [run]
    request.run_tag_filter.tags.names[:] = sorted(tags)
    request.downsample.num_points = points
    with grpc_provider._translate_grpc_error():
        response = data_provider._stub.ReadScalars(request)
    return {
        entry.tag_name: (list(entry.data.step), list(entry.data.value))
        for found in response.runs
        if found.run_name == run
        for entry in found.tags
    }
