"""The docs' code runs as written and writes what it promises, and the docs list exactly the finding
kinds and tags the code declares and writes."""

from __future__ import annotations

import inspect
import re
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from conftest import read_run, read_tags
from tensorboard.plugins.custom_scalar.metadata import CONFIG_SUMMARY_TAG
from torch import nn

from tblog_hooks import Histograms, HookLogger, Spikes
from tblog_hooks.dashboard.documents import SEVERITY
from tblog_hooks.diagnostics.attention_rules import PICTURES
from tblog_hooks.diagnostics.findings import FINDING_KINDS
from tblog_hooks.diagnostics.numerics_rules import PICTURE_TAGS
from tblog_hooks.diagnostics.per_step import FINDINGS_TAG, FLOW_TAG
from tblog_hooks.options import NAMES
from tblog_hooks.stats.kinds import Kind
from tblog_hooks.stats.numerics import FORMATS
from tblog_hooks.stats.recipe import Recipe, Source
from tblog_hooks.stats.tags import (
    HEADS_TABLE_TAG,
    HISTOGRAM_KINDS,
    NUMERICS_TABLE_TAG,
    ORDER_TAG,
    SCALE_TAG,
    SKIPPED_TAG,
    Root,
    Stat,
    escape,
    rows_tag,
)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"

#: The placeholders of the tag table: a watched module's name, one of its own parameters, a
#: ``numerics=`` format.
MODULE, PARAM, FORMAT = "{module}", "{module}.{param}", "{format}"
#: The tag table's types, and the kinds of tag TensorBoard's ``EventAccumulator`` reads them back as.
TYPES = ("scalar", "histogram", "image", "tensor", "text", "layout")
_ROW = re.compile(r"\| `(?P<pattern>[^`]+)` \| (?P<type>\w+) \| .+ \|")


# -- code blocks ---------------------------------------------------------------------------------
def _run_block(path: Path, heading: str) -> None:
    """Run the first Python block after the line ``heading`` of ``path`` as a script."""
    block = re.search(rf"^{re.escape(heading)}$.*?^```python\n(.*?)^```", path.read_text(), re.S | re.M)
    assert block is not None, f"no Python block after {heading!r} in {path.name}"
    exec(compile(block.group(1), str(path), "exec"), {"__name__": "docs"})


def test_quickstart_runs(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    _run_block(README, "## Quickstart")
    assert "('0', '2', '4')" in capsys.readouterr().out
    run = read_run(tmp_path / "runs" / "quickstart")
    assert sorted(run.scalars["param_grad/global_norm"]) == list(range(0, 100, 10))


def test_adding_a_statistic_section_runs(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _run_block(DOCS / "architecture.md", "## Adding a statistic")
    run = read_run(tmp_path / "runs" / "peak")
    written = {f"{kind}/{module}" for kind in ("gradient/peak_ratio", "activation/norm") for module in ("0", "2")}
    assert written <= set(run.scalars)


def test_lightning_section_runs(tmp_path, monkeypatch) -> None:
    pytest.importorskip("lightning")
    monkeypatch.chdir(tmp_path)
    _run_block(DOCS / "integrations.md", "## Lightning")
    run = read_run(tmp_path / "runs" / "lightning" / "lightning_logs" / "version_0")
    assert sorted(run.scalars["param_grad/global_norm"]) == [0, 4, 8, 12]
    assert sorted(run.scalars["loss"]) == [3, 7, 11, 15]
    assert "activation/mean/net.1" in run.scalars  # modules=["net.*"] watches the ReLU too


def test_transformers_section_runs(tmp_path, monkeypatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    _run_block(DOCS / "integrations.md", "## Hugging Face Trainer")
    (run_dir,) = (tmp_path / "runs" / "hf" / "runs").iterdir()
    run = read_run(run_dir)
    assert sorted(run.scalars["param_grad/global_norm"]) == sorted(run.scalars["train/loss"]) == [4, 8, 12, 16]


def test_readme_links_resolve() -> None:
    """The README is read outside the docs site (no link check there): its relative links and
    its picture point at files that exist."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [t for t in targets if "://" not in t]
    assert "docs/dashboard.png" in local  # the picture is the Model health tab
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


# -- health findings -----------------------------------------------------------------------------
def test_health_page_documents_every_finding_kind() -> None:
    """One ``### `kind``` section per finding kind the code has, and none for a kind it lacks."""
    documented = re.findall(r"^### `([^`]+)`$", (DOCS / "health.md").read_text(), re.M)
    assert len(documented) == len(set(documented)), f"a kind documented twice: {documented}"
    assert set(documented) - set(FINDING_KINDS) == set(), "docs/health.md documents kinds the code does not have"
    assert set(FINDING_KINDS) - set(documented) == set(), "docs/health.md lacks a section for these kinds"


# -- the tag table -------------------------------------------------------------------------------
def documented_tags() -> dict[str, set[str]]:
    """``{type: tag patterns}`` of the tag table in docs/logged.md (one pattern per row)."""
    text = (DOCS / "logged.md").read_text()
    assert "\n## Tag table\n" in text, "docs/logged.md has no '## Tag table' section"
    section = text.split("\n## Tag table\n", 1)[1].split("\n## ", 1)[0]
    header, _rule, *rows = [line for line in section.splitlines() if line.startswith("|")]
    assert header == "| tag | type | value |", f"unexpected tag table header {header!r}"
    assert rows, "the tag table has no rows"
    tags: dict[str, set[str]] = {t: set() for t in TYPES}
    for row in rows:
        match = _ROW.fullmatch(row)
        assert match is not None, f"not a '| `pattern` | type | value |' row: {row!r}"
        pattern, kind = match["pattern"], match["type"]
        assert kind in TYPES, f"{pattern}: unknown type {kind!r} (types: {TYPES})"
        assert pattern not in tags[kind], f"{pattern} is listed twice"
        tags[kind].add(pattern)
    return tags


#: The value tables, each written with its rows' names.
TABLES = (HEADS_TABLE_TAG, NUMERICS_TABLE_TAG)


def declared_tags() -> dict[str, set[str]]:
    """``{type: tag patterns}`` as the code declares them."""
    full, counted = Recipe.build(inputs=True, numerics=True, rowwise=True), Recipe.build()  # (inputs counted only)
    on_params = (Source.PARAM_GRAD, Source.UPDATE)
    per_module = (
        *(k for s, k in full.kinds.items() if s not in on_params),
        counted[Source.NONFINITE_INPUT],
        *(k for s, k in full.numerics.items() if s not in (*on_params, Source.FP8_WEIGHT)),
    )
    per_parameter = (*(full[s] for s in on_params), full.numerics[Source.PARAM_GRAD], full.numerics[Source.FP8_WEIGHT])

    def stat(kind: Kind, name: str) -> str:  # a per-format statistic with the format's placeholder
        fmt = full.formats.get(kind, {}).get(name)
        return name if fmt is None else name.removesuffix(fmt) + FORMAT

    scalars = {f"{kind.name}/{stat(kind, s)}/{MODULE}" for kind in per_module for s in kind.stats}
    scalars |= {f"{kind.name}/{stat(kind, s)}/{PARAM}" for kind in per_parameter for s in kind.stats}
    scalars |= {f"{k.name}/{m.total}" for k in (*per_module, *per_parameter) for m in k.measures if m.total}
    scalars |= {SCALE_TAG, SKIPPED_TAG}
    scalars |= {f"{Root.HEALTH}/{kind}" for kind in FINDING_KINDS}
    scalars |= {f"{Root.STEP}/{Stat.GRAD_NORM}", f"{Root.STEP}/{Stat.LOSS}", f"{Root.SPIKE}/{Stat.GRAD_NORM}/{MODULE}"}
    scalars.add(f"{Root.STEP}/{Stat.SAMPLES}")
    histograms = {f"{root}/{PARAM if root in (Root.PARAM_GRAD, Root.PARAM) else MODULE}" for root in HISTOGRAM_KINDS}
    return {
        "scalar": scalars,
        "histogram": histograms,
        "image": {FLOW_TAG, f"{Root.FEATURE_MAP}/{MODULE}", *PICTURES.values(), *PICTURE_TAGS.values()},
        "tensor": {ORDER_TAG}
        | {t for table in (HEADS_TABLE_TAG, NUMERICS_TABLE_TAG) for t in (table, rows_tag(table))},
        "text": {FINDINGS_TAG, ORDER_TAG},
        "layout": {CONFIG_SUMMARY_TAG},
    }


def test_declared_tags_cover_every_root_and_stat() -> None:
    """A root or statistic added to ``stats/tags.py`` must reach ``declared_tags`` (and so the docs)."""
    every = set().union(*declared_tags().values())
    assert set(Root) - {t.split("/")[0] for t in every} == set(), "a Root no declared tag uses"
    assert set(Stat) - {t.split("/")[1] for t in every if "/" in t} == set(), "a Stat no declared tag uses"


def test_tag_table_matches_the_code() -> None:
    documented, declared = documented_tags(), declared_tags()
    for kind in TYPES:
        assert documented[kind] - declared[kind] == set(), f"docs/logged.md lists {kind} tags the code does not declare"
        assert declared[kind] - documented[kind] == set(), f"docs/logged.md lacks these {kind} tags"


def _regex(pattern: str, modules: list[str], params: list[str]) -> re.Pattern[str]:
    """A tag pattern of the table, with its placeholders standing for the given (escaped) names."""

    def either(names: list[str]) -> str:
        return "(?:" + "|".join(re.escape(escape(n)) for n in names) + ")"

    out = re.escape(pattern).replace(re.escape(PARAM), either(params)).replace(re.escape(MODULE), either(modules))
    return re.compile(out.replace(re.escape(FORMAT), either(list(FORMATS))))


def _written(log_dir: Path) -> dict[str, set[str]]:
    """``{type: tags}`` of a run, read back with TensorBoard's ``EventAccumulator``."""
    tags = read_tags(log_dir)
    tensors = set(tags["tensors"])
    text = {t.removesuffix("/text_summary") for t in tensors if t.endswith("/text_summary")}
    return {
        "scalar": set(tags["scalars"]),
        "histogram": set(tags["histograms"]),
        "image": set(tags["images"]),
        "tensor": tensors - {f"{t}/text_summary" for t in text} - {CONFIG_SUMMARY_TAG},
        "text": text,
        "layout": tensors & {CONFIG_SUMMARY_TAG},
    }


class _SelfAttention(nn.Module):
    """One-head self-attention over the positions of a feature map, without parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(2).transpose(1, 2)
        return nn.functional.scaled_dot_product_attention(tokens, tokens, tokens).transpose(1, 2).reshape(x.shape)


def test_every_written_tag_is_documented(tmp_path) -> None:
    """A run with every option that adds tags writes exactly what the tag table lists."""
    model = nn.Sequential(
        OrderedDict(
            conv=nn.Conv2d(3, 4, 3, padding=1),
            act=nn.ReLU(),
            attn=_SelfAttention(),  # no parameters: not watched, but its attention is logged
            flat=nn.Flatten(),
            head=nn.Sequential(nn.Linear(4 * 8 * 8, 8), nn.Tanh(), nn.Linear(8, 2)),
        )
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    everything = Histograms(every_logged=1, weights_every_logged=1, kinds=HISTOGRAM_KINDS)
    with HookLogger(
        model,
        log_dir=tmp_path,
        every=2,
        inputs=True,
        feature_maps=["conv"],
        optimizer=opt,
        scaler=scaler,
        histograms=everything,
        attention=True,
        spikes=Spikes(warmup=3, window=3),
        numerics=tuple(FORMATS),
        fp8_scaling="rowwise",
        logits=True,
    ) as hooks:
        for step in range(6):  # logged steps 0, 2, 4; a spike at 5 (spike/*)
            x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 2, (4,))
            loss = nn.functional.cross_entropy(model(x), y) * (100 if step == 5 else 1)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            hooks.step(loss=loss)
        modules = list(hooks.module_names)
    assert modules == ["conv", "head.0", "head.2"]
    params = [f"{m}.{p}" for m in modules for p, _ in model.get_submodule(m).named_parameters(recurse=False)]

    documented, written = documented_tags(), _written(tmp_path)
    for kind in TYPES:
        patterns = {p: _regex(p, [*modules, "attn"], params) for p in documented[kind]}
        undocumented = {t for t in written[kind] if not any(r.fullmatch(t) for r in patterns.values())}
        assert not undocumented, f"{kind} tags written but not in docs/logged.md's tag table: {sorted(undocumented)}"
        unwritten = {p for p, r in patterns.items() if not any(r.fullmatch(t) for t in written[kind])}
        assert not unwritten, f"documented {kind} tags this run (every option on) did not write: {sorted(unwritten)}"


# -- pages that restate the code ----------------------------------------------------------------
def test_dashboard_page_ranks_findings_as_the_module_table_does() -> None:
    bullet = next(p for p in (DOCS / "dashboard.md").read_text().split("\n- ") if p.startswith("**Modules.**"))
    documented = [k for k in re.findall(r"`(\w+)`", bullet) if k in FINDING_KINDS]
    assert documented == [kind.value for kind in SEVERITY]


def test_options_page_lists_every_option() -> None:
    page = (DOCS / "options.md").read_text()
    signature = page[page.index("```python\nHookLogger(") : page.index("```\n", page.index("```python"))]
    defaults = inspect.signature(HookLogger).parameters
    shown = re.findall(r"(\w+)=('\w+'|\w+(?:\(\))?)", signature)  # (a str default quoted, as repr gives it)
    assert shown == [(name, repr(defaults[name].default)) for name in NAMES]
    table = page[page.index("## Arguments") : page.index("## Methods and properties")]
    listed = [name for cell in re.findall(r"^\| (`[^|]+`) \|", table, re.M) for name in re.findall(r"`(\w+)`", cell)]
    assert sorted(listed) == sorted(["model", *NAMES])
