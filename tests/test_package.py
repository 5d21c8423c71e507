"""The package's shape: every module imports, folders and classes stay small, private torch and
tensorboard APIs are used from ``_compat.py`` only."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import tblog_hooks

ROOT = Path(tblog_hooks.__file__).parent
SOURCES = sorted(ROOT.rglob("*.py"))


def test_every_module_imports() -> None:
    names = [m.name for m in pkgutil.walk_packages([str(ROOT)], prefix="tblog_hooks.")]
    assert len(names) == len(SOURCES) - 1  # every file but the package's own __init__.py
    for name in names:
        importlib.import_module(name)


def test_no_folder_holds_more_than_a_dozen_modules() -> None:
    for folder in {p.parent for p in SOURCES}:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 12, folder


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_classes_and_functions_are_small(path: Path) -> None:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            limit = 250 if isinstance(node, ast.ClassDef) else 80
            assert size <= limit, f"{node.name} is {size} lines"


#: ``torch._foreach_norm``, ``torch.utils._pytree``, ... and the private attributes of torch and
#: tensorboard objects the package needs (``scaler._get_scale_async``, ``module._parameters``, ...).
_PRIVATE = re.compile(
    r"\b(?:torch|tensorboard)(?:\.[a-z]\w*)*\._[a-zA-Z]\w*"
    r"|(?<!self)\._(?:get_scale_async|per_optimizer_states|init_scale|execution_engine|parameters|forward_hooks"
    r"|version|values|indices|get_file_writer|compiled_call_impl|async_writer|current_graph_task_id)\b"
)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_private_apis_only_in_compat(path: Path) -> None:
    if path.name == "_compat.py":
        return
    code = "\n".join(line.split("#", 1)[0] for line in path.read_text(encoding="utf-8").splitlines())
    assert not _PRIVATE.findall(code)
