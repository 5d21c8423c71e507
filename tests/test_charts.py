"""Pictures and the extra statistics: gradient-flow heatmap, custom-scalars layout, feature
maps, log10 gradient histograms, input statistics and update-to-weight ratios."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from conftest import read_images, read_layout, read_run, read_tags
from models import conv_net, mlp, train
from torch import nn
from torchvision.io import ImageReadMode, decode_png

from tblog_hooks import HookLogger
from tblog_hooks.diagnostics.per_step import gradient_flow_image
from tblog_hooks.diagnostics.pictures import BACKGROUND, MAX_COLUMNS, gradient_flow, heads_grid
from tblog_hooks.diagnostics.pictures import NONFINITE_COLOUR as NONFINITE
from tblog_hooks.diagnostics.pictures import ZERO_COLOUR as ZERO
from tblog_hooks.output.events import png
from tblog_hooks.stats.feature_maps import feature_grid

PURPLE, YELLOW = (68, 1, 84), (253, 231, 37)  # the ends of the colour scale


def _where(image: np.ndarray, colour: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    return np.nonzero(np.all(image == colour, axis=-1))


@pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities of TorchVision are deprecated")
def test_png_round_trips_through_libpng() -> None:
    """Encoded with Pillow, decoded with libpng (torchvision's decoder): a fault of either shows."""
    rng = np.random.default_rng(0)
    for channels in (1, 3):
        image = rng.integers(0, 256, size=(channels, 7, 5), dtype=np.uint8)
        decoded = decode_png(torch.frombuffer(bytearray(png(image)), dtype=torch.uint8), ImageReadMode.UNCHANGED)
        assert decoded.shape == (channels, 7, 5)
        assert np.array_equal(decoded.numpy(), image)


def test_heatmap_rows_are_modules_columns_steps_colour_log10() -> None:
    norms = np.array([[1e-3, 0.0], [math.nan, 10.0]])  # rows: modules a, b; columns: steps 0, 5
    logged = np.array([[True, True], [True, True]])
    image = gradient_flow(["a", "b"], [0, 5], norms, logged).transpose(1, 2, 0)
    zero_y, zero_x = _where(image, ZERO)  # a at step 5
    bad_y, bad_x = _where(image, NONFINITE)  # b at step 0
    assert zero_y.max() < bad_y.min() and bad_x.max() < zero_x.min()
    # 1e-3 is the bottom of the scale (row a, step 0), 10 the top (row b, step 5).
    assert tuple(image[int(zero_y.mean()), int(bad_x.mean())]) == PURPLE
    assert tuple(image[int(bad_y.mean()), int(zero_x.mean())]) == YELLOW
    # A cell that was not logged shows the background.
    unlogged = gradient_flow(["a", "b"], [0, 5], norms, np.array([[True, True], [False, True]]))
    assert not _where(unlogged.transpose(1, 2, 0), NONFINITE)[0].size
    assert tuple(unlogged.transpose(1, 2, 0)[int(bad_y.mean()), int(bad_x.mean())]) == BACKGROUND


@pytest.mark.parametrize("log", [True, False])
def test_heads_picture_rows_are_layers_columns_heads(log: bool) -> None:
    """The attention pictures: a row per layer, a column per head, a head without a value (NaN)
    red, larger values brighter along the scale; the colour bar is labelled."""
    values = np.array([[0.5, 100.0], [math.nan, 3.0]])  # rows: layers a, b; columns: heads 0, 1
    image = heads_grid(["a", "b"], values, "title", log=log).transpose(1, 2, 0)
    bad_y, bad_x = _where(image, NONFINITE)  # b, head 0: one cell, which locates the others
    height, width = bad_y.max() - bad_y.min() + 1, bad_x.max() - bad_x.min() + 1
    y, x = int(bad_y.mean()), int(bad_x.mean())
    cell = {(0, 0): image[y - height, x], (0, 1): image[y - height, x + width], (1, 1): image[y, x + width]}
    brightness = {k: int(v.astype(int).sum()) for k, v in cell.items()}  # (viridis brightens as it rises)
    assert brightness[(0, 0)] < brightness[(1, 1)] < brightness[(0, 1)]
    assert tuple(cell[(0, 1)]) == YELLOW  # 100: the top of the scale
    right = x + 3 * width // 2  # the grid's right edge; then the bar and its labels
    assert (image[:, right + 30 :] != BACKGROUND).any(axis=-1).any()


def test_heatmap_names_keep_their_case_and_the_picture_fits_a_tensorboard_card() -> None:
    norms, logged = np.ones((1, 3)), np.ones((1, 3), dtype=bool)
    lower = gradient_flow(["layer1.0.conv1"], [0, 1, 2], norms, logged)
    upper = gradient_flow(["LAYER1.0.CONV1"], [0, 1, 2], norms, logged)
    assert not np.array_equal(lower, upper)  # drawn as given, not upper-cased
    # Many modules with long names over the most steps: as wide as a card, one row per module.
    names = [f"encoder.layers.encoder_layer_{i}.self_attention.out_proj" for i in range(100)]
    steps = list(range(0, 10 * MAX_COLUMNS, 10))
    wide = gradient_flow(names, steps, np.ones((100, MAX_COLUMNS)), np.ones((100, MAX_COLUMNS), dtype=bool))
    assert wide.shape[0] == 3 and wide.shape[2] <= 520 and wide.shape[1] >= 100 * 12
    # Names that differ only at the start are cut there, so their ends stay readable.
    end_a = gradient_flow(["a." + "block." * 20 + "conv1"], [0], np.ones((1, 1)), np.ones((1, 1), dtype=bool))
    end_b = gradient_flow(["b." + "block." * 20 + "conv1"], [0], np.ones((1, 1)), np.ones((1, 1), dtype=bool))
    assert np.array_equal(end_a, end_b)
    # The colour scale runs from purple (small) to yellow (large) beside the grid.
    image = wide.transpose(1, 2, 0)
    assert _where(image, PURPLE)[0].size and _where(image, YELLOW)[0].size


def test_heatmap_image_and_custom_scalars_layout_in_the_run(tmp_path) -> None:
    model = conv_net(6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookLogger(model, log_dir=tmp_path, every=2, optimizer=opt) as hooks:
        train(hooks, (model(torch.randn(4, 3, 8, 8)).square().mean() for _ in range(5)), opt)
    order = ["0.0", "1.0", "3"]
    run = read_run(tmp_path)
    images = read_images(tmp_path, "health/gradient_flow")
    assert set(images) == {0, 4}  # the first logged step, then every FLOW_EVERY logged steps, and at close
    history = {s: {m: run.scalar(f"gradient/norm/{m}", s) for m in order} for s in (0, 2, 4)}
    assert np.array_equal(images[4], gradient_flow_image(order, history).transpose(1, 2, 0))

    charts = {c.title: list(c.multiline.tag) for cat in read_layout(tmp_path).category for c in cat.chart}
    assert charts["gradient/norm"] == [f"^{re.escape(f'gradient/norm/{m}')}$" for m in order]
    assert charts["param_grad/norm"][:2] == ["^param_grad/norm/0\\.0\\.weight$", "^param_grad/norm/0\\.0\\.bias$"]
    for patterns in charts.values():  # every line of every chart is exactly one logged tag
        for pattern in patterns:
            assert len([t for t in run.scalars if re.search(pattern, t)]) == 1, pattern


def test_the_layout_charts_the_gradients_when_the_first_written_step_was_skipped(tmp_path) -> None:
    """A ``GradScaler`` whose first scale overflows skips step 0, which writes no gradient
    statistic: the layout still charts ``gradient/norm``, ``param_grad/*`` and the update ratio
    once the run writes them, every line one logged tag."""
    model = mlp(4, 8, 2, act=nn.ReLU, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, backoff_factor=2.0**-100, growth_interval=1000)
    with HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt, scaler=scaler) as hooks:
        for _ in range(3):
            scaler.scale(model(torch.randn(8, 4)).square().mean() * 1e6).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            hooks.step()
    run = read_run(tmp_path)
    assert run.scalar("amp/skipped_step", 0) == 1.0 and run.scalar("amp/skipped_step", 2) == 0.0
    charts = {c.title: list(c.multiline.tag) for cat in read_layout(tmp_path).category for c in cat.chart}
    for quantity in ("gradient/norm", "param_grad/norm", "param/update_ratio"):
        assert quantity in charts, quantity
    for patterns in charts.values():
        for pattern in patterns:
            assert len([t for t in run.scalars if re.search(pattern, t)]) == 1, pattern


def test_a_diagnostics_failure_warns_once_and_keeps_the_statistics(tmp_path, monkeypatch) -> None:
    def broken(*args: object) -> None:
        raise ZeroDivisionError("in the heatmap")

    monkeypatch.setattr("tblog_hooks.diagnostics.per_step.gradient_flow_image", broken)
    model = conv_net(6)
    warned = pytest.warns(RuntimeWarning, match="diagnostics failed.*in the heatmap")
    with warned as caught, HookLogger(model, log_dir=tmp_path, every=1) as hooks:
        for _ in range(2):
            model(torch.randn(2, 3, 8, 8)).sum().backward()
            hooks.step()
    assert len([w for w in caught if "diagnostics" in str(w.message)]) == 1
    assert set(read_run(tmp_path).scalars["gradient/norm/3"]) == {0, 1}
    assert "health/gradient_flow" not in read_tags(tmp_path)["images"]
    assert hooks.summary()["min_layer_grad"] > 0


def test_feature_map_grid_of_the_first_sample(tmp_path) -> None:
    model = conv_net(6)
    with HookLogger(model, log_dir=tmp_path, every=1, feature_maps="1.0") as hooks:
        x = torch.randn(2, 3, 8, 8)
        with torch.no_grad():
            maps = model[1][0](model[0](x))[0]  # 6 channels of 4 x 4
        model(x).sum().backward()
        hooks.step()
    (grid,) = read_images(tmp_path, "feature_map/1.0").values()
    assert grid.shape == (2 * 5 + 1, 3 * 5 + 1)  # 2 rows x 3 columns of 4 px tiles, 1 px padding; grey
    for c in range(6):
        row, col = divmod(c, 3)
        tile = grid[1 + 5 * row : 5 + 5 * row, 1 + 5 * col : 5 + 5 * col].astype(np.float64)
        m = maps[c].double().numpy()
        expected = np.round((m - m.min()) / (m.max() - m.min()) * 255)
        assert np.abs(tile - expected).max() <= 1, c


def test_large_feature_maps_are_pooled_to_small_tiles() -> None:
    assert feature_grid(torch.rand(2, 100, 130)).shape == (1, 64 + 2, 2 * 65 + 1)


def test_feature_maps_must_be_watched(tmp_path) -> None:
    with pytest.raises(ValueError, match="not watched"):
        HookLogger(conv_net(6), log_dir=tmp_path, modules=["0.0"], feature_maps=["1.0"])
    with pytest.raises(ValueError, match="feature_maps="):
        HookLogger(conv_net(6), log_dir=tmp_path, feature_maps=["nope"])


def test_log10_gradient_histogram_and_input_statistics(tmp_path) -> None:
    model = mlp(5, 40, 2)
    with HookLogger(model, log_dir=tmp_path, every=1, inputs=True) as hooks:
        x = torch.randn(30, 5) * 2
        hidden = model[0](x)
        hidden.retain_grad()
        out = model[2](model[1](hidden))
        out.square().sum().backward()
        hooks.step()
    run = read_run(tmp_path)
    grad = hidden.grad.double().abs().numpy().ravel()
    logs = np.log10(grad[grad > 0])
    hist = run.histograms["gradient_log10/0"][0]
    assert hist.min == pytest.approx(logs.min(), rel=1e-5)
    assert hist.max == pytest.approx(logs.max(), rel=1e-5)
    assert hist.num == logs.size
    given = model[1](hidden).detach().double()  # the input of module 2
    assert run.scalar("input/mean/2", 0) == pytest.approx(float(given.mean()), rel=1e-5)
    assert run.scalar("input/std/2", 0) == pytest.approx(float(given.std()), rel=1e-5)
    assert run.scalar("input/max/0", 0) == pytest.approx(float(x.max()), rel=1e-6)
    assert run.scalar("input/nonfinite/0", 0) == 0


def test_update_to_weight_ratio(tmp_path) -> None:
    model = mlp(4, 8, 1, act=nn.ReLU)
    with torch.no_grad():
        model[2].bias.zero_()  # ||W|| = 0: the ratio is undefined and left out
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    expected = []
    with HookLogger(model, log_dir=tmp_path, every=2, optimizer=opt) as hooks:
        for step in range(3):
            model(torch.randn(16, 4)).square().mean().backward()
            global_norm = math.sqrt(sum(float(p.grad.double().norm()) ** 2 for p in model.parameters()))
            before = {n: p.detach().clone().double() for n, p in model.named_parameters()}
            opt.step()
            after = {n: p.detach().double() for n, p in model.named_parameters()}
            if step % 2 == 0:
                expected.append({n: float((after[n] - w).norm() / w.norm()) for n, w in before.items()})
            opt.zero_grad()
            hooks.step()
            if step == 0:  # written by this step() on the CPU
                assert hooks.summary()["grad_norm"] == pytest.approx(global_norm, rel=1e-5)
    run = read_run(tmp_path)
    for step, ratios in zip((0, 2), expected):
        for name, ratio in ratios.items():
            if name == "2.bias" and step == 0:
                assert step not in run.scalars.get("param/update_ratio/2.bias", {})
            else:
                assert run.scalar(f"param/update_ratio/{name}", step) == pytest.approx(ratio, rel=1e-4), name


def test_a_deep_model_keeps_bounded_charts(tmp_path) -> None:
    """300 watched modules: the heatmap groups consecutive modules into at most MAX_ROWS rows (each
    the smallest norm of its group), and every custom-scalars chart holds at most MAX_CHART_LINES."""
    from tblog_hooks.diagnostics.per_step import MAX_CHART_LINES, MAX_ROWS

    depth = 300
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(depth)])
    with HookLogger(model, log_dir=tmp_path, every=1, histograms=False, health=None) as hooks:
        model(torch.randn(2, 4)).sum().backward()
        hooks.step()
    (image,) = read_images(tmp_path, "health/gradient_flow").values()
    shallow = gradient_flow_image([str(i) for i in range(MAX_ROWS)], {0: {str(i): 1.0 for i in range(MAX_ROWS)}})
    assert image.shape[0] <= shallow.shape[1] + 40  # as tall as a MAX_ROWS-module picture (a longer label)
    norms = {0: {str(i): 10.0 ** -(i // 10) for i in range(depth)}}
    grouped = gradient_flow_image([str(i) for i in range(depth)], norms)
    smallest_first = gradient_flow_image(
        [f"{g[0]} (+{len(g) - 1})" for g in np.array_split(np.arange(depth), MAX_ROWS)],
        {0: {f"{g[0]} (+{len(g) - 1})": 10.0 ** -(g[-1] // 10) for g in np.array_split(np.arange(depth), MAX_ROWS)}},
    )
    assert np.array_equal(grouped, smallest_first)
    charts = {c.title: list(c.multiline.tag) for cat in read_layout(tmp_path).category for c in cat.chart}
    assert all(len(tags) <= MAX_CHART_LINES for tags in charts.values())
    norm_charts = [tags for title, tags in charts.items() if title.startswith("gradient/norm")]
    assert len(norm_charts) == math.ceil(depth / MAX_CHART_LINES)
    assert [t for tags in norm_charts for t in tags] == [f"^gradient/norm/{i}$" for i in range(depth)]
