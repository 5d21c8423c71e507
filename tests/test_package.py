"""The package's shape: every module imports, folders and classes stay small, private torch and
tensorboard APIs are used from the two compat modules only (:data:`COMPAT`)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
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


#: The only modules that use private torch or tensorboard APIs: the torch side (the logger's
#: private torch APIs, and TensorBoard's writer as torch's ``SummaryWriter`` holds it) and the
#: tensorboard side (what the read side, loaded by TensorBoard, uses of TensorBoard: no torch).
COMPAT = {"_compat.py": "torch side", "_tensorboard_compat.py": "tensorboard side, torch-free"}
#: ``torch._foreach_norm``, ``torch.utils._pytree``, ... and the private attributes of torch and
#: tensorboard objects the package needs (``scaler._get_scale_async``, ``module._parameters``,
#: the data provider's ``_stub``, ...).
_PRIVATE = re.compile(
    r"\b(?:torch|tensorboard)(?:\.[a-z]\w*)*\._[a-zA-Z]\w*"
    r"|(?<!self)\._(?:get_scale_async|per_optimizer_states|init_scale|execution_engine|parameters|forward_hooks"
    r"|version|values|indices|get_file_writer|compiled_call_impl|async_writer|current_graph_task_id"
    r"|stub|translate_grpc_error)\b"
)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_private_apis_only_in_compat(path: Path) -> None:
    if path.relative_to(ROOT).as_posix() in COMPAT:
        return
    code = "\n".join(line.split("#", 1)[0] for line in path.read_text(encoding="utf-8").splitlines())
    assert not _PRIVATE.findall(code)


def _imports(path: Path, *, typing_too: bool = False) -> set[str]:
    """The package modules ``path`` imports when it is imported: its top-level imports, not those
    under ``if TYPE_CHECKING:`` nor inside functions (with ``typing_too``, those as well)."""
    module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree) if typing_too else tree.body:
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = f"{base}.{node.module}" if node.level and node.module else node.module or base
            for alias in node.names:  # ``from . import pictures`` imports a module
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in _MODULES else target)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name in _MODULES and name != module}


_MODULES = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__") for p in SOURCES}
#: The data flow, downhill: a module imports from its own layer or those before it, never after.
_LAYERS = [
    {"errors", "_compat", "_tensorboard_compat", "keywords"},
    {"stats", "topology", "kernels"},
    {"capture", "transport"},
    {"output"},
    {"diagnostics"},
    {"options", "spike_log", "logger", "cli", "integrations"},
    {"dashboard"},
]


def _layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    return next((i for i, names in enumerate(_LAYERS) if part in names), len(_LAYERS))


def test_imports_run_downhill_without_circles() -> None:
    graph = {
        ".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): _imports(p)
        for p in SOURCES
    }
    uphill = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if _layer(b) > _layer(a))
    assert uphill == [], "imports against the data flow"
    # No circle even through the imports only type checking or a function body make.
    graph = {module: _imports(path, typing_too=True) for module, path in zip(graph, SOURCES, strict=True)}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import circle: {' -> '.join((*path[path.index(module) :], module))}"
        if module in done:
            return
        for target in graph[module]:
            visit(target, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())


#: The only state the package keeps for the whole process, each with why: every other piece of
#: state belongs to one logger, so that a closed or collected logger leaves nothing behind
#: (``tests/test_lifecycle.py``). Keys: ``{module}:{name}``, the module relative to the package.
_PROCESS_WIDE = {
    "output/destination.py:_LIVE": "the live loggers' destinations, held weakly and each removed at close: loggers "
    "sharing a run directory write one merged custom-scalars layout, and a second logger writing the same tags "
    "into it is warned about",
    "output/destination.py:_LIVE_LOCK": "_LIVE's lock: loggers are made and closed (or collected) on any thread",
    "kernels/fused.py:_constants": "the kernels' rounding boundaries, a handful of numbers per (device, dtype), "
    "the same for every logger",
    "__init__.py:globals()": "PEP 562: each public name kept once it was first imported",
}
#: What makes a mutable value: the constructors of containers, caches, registries and locks.
_MUTABLE_CALLS = re.compile(
    r"(?:dict|list|set|bytearray|OrderedDict|defaultdict|deque|Counter|ChainMap|local|\w*Cache|\w*Registry"
    r"|WeakSet|WeakValueDictionary|WeakKeyDictionary|Lock|RLock|Condition|Semaphore|Event|Queue)"
)
#: The methods that change a container in place.
_MUTATORS = frozenset(
    [
        "append",
        "add",
        "update",
        "setdefault",
        "pop",
        "popitem",
        "clear",
        "extend",
        "insert",
        "remove",
        "discard",
        "appendleft",
        "extendleft",
        "sort",
        "reverse",
        "move_to_end",
        "__setitem__",
        "__delitem__",
        "__ior__",
    ]
)
#: Annotations of what a cache must not keep for the whole process: tensors (device memory),
#: modules and optimizers (a model), devices.
_HEAVY = re.compile(r"\b(?:Tensor|Module|Optimizer|device|Parameter)\b")


def _mutable(value: ast.expr | None) -> bool:
    """Whether ``value`` makes a mutable container, cache, registry or lock."""
    if isinstance(value, (ast.Dict, ast.DictComp, ast.List, ast.ListComp, ast.Set, ast.SetComp)):
        return True
    return isinstance(value, ast.Call) and bool(_MUTABLE_CALLS.fullmatch(ast.unparse(value.func).split(".")[-1]))


def _bodies(tree: ast.Module) -> Iterator[ast.stmt]:
    """The statements that run once per process: the module's and its classes' bodies (and the
    ``if``/``try``/``with`` blocks in them), not function bodies."""
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.ClassDef):
            todo += node.body
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            todo += [s for handler in getattr(node, "handlers", []) for s in handler.body]


def _changed(tree: ast.Module) -> Iterator[str]:
    """The names (or attributes, by their last name) that ``tree`` changes in place anywhere."""

    def name(node: ast.expr) -> str | None:
        return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                if isinstance(target, ast.Subscript):
                    yield name(target.value) or ""
                elif isinstance(node, ast.AugAssign):
                    yield name(target) or ""
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
            yield name(node.func.value) or ""


def _process_wide(tree: ast.Module, changed: set[str]) -> Iterator[str]:
    """``{name}`` of each piece of process-wide mutable state ``tree`` keeps: a mutable value
    bound once per process that is made by a registry, cache or lock constructor or changed
    somewhere in the package; ``global`` and ``globals()``; a cache decorator on a function
    of the module or its classes that takes or gives tensors, modules or devices."""
    for node in _bodies(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and _mutable(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            # A registry, cache or lock is state however it is changed (handed to the code that changes it).
            kept = isinstance(node.value, ast.Call) and ast.unparse(node.value.func) not in ("dict", "list", "set")
            yield from (t.id for t in targets if isinstance(t, ast.Name) and (kept or t.id in changed))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            cached = any(re.search(r"\b(?:cache|lru_cache)\b", ast.unparse(d)) for d in node.decorator_list)
            signature = ast.unparse(node.args) + " -> " + (ast.unparse(node.returns) if node.returns else "")
            if cached and _HEAVY.search(signature):
                yield node.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            yield from (f"global {n}" for n in node.names)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "globals":
            yield "globals()"


def test_no_process_wide_state_but_the_listed() -> None:
    """Module-level (and class-level) mutable state outlives every logger: a registry, a cache, a
    lock, a container changed in place, a ``global``, a cache of tensors or models. None is kept
    but :data:`_PROCESS_WIDE`'s, each with its reason; and each of those is still there."""
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in SOURCES}
    changed = {name for tree in trees.values() for name in _changed(tree)}
    found = {
        f"{path.relative_to(ROOT).as_posix()}:{name}"
        for path, tree in trees.items()
        for name in _process_wide(tree, changed)
    }
    assert sorted(found - set(_PROCESS_WIDE)) == [], "process-wide state: make it the logger's, or list it with why"
    assert sorted(set(_PROCESS_WIDE) - found) == [], "listed, but no longer there"
    assert all(reason.strip() for reason in _PROCESS_WIDE.values())


#: What reads runs back (``tblog-hooks report``, the TensorBoard plugin) imports these.
_READ_SIDE = [
    "tblog_hooks",
    "tblog_hooks._tensorboard_compat",
    "tblog_hooks.stats.tags",
    "tblog_hooks.diagnostics.replay",
    "tblog_hooks.cli.report",
    "tblog_hooks.diagnostics.compare",
    "tblog_hooks.cli.compare",
    "tblog_hooks.dashboard.plugin",
]


def test_the_read_side_imports_without_torch() -> None:
    heavy = "sorted(m for m in ('torch', 'torchvision') if m in sys.modules)"
    code = f"import sys; import {', '.join(_READ_SIDE)}; print({heavy})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stderr


def test_the_wheel_holds_every_file_of_the_package_and_the_license(tmp_path) -> None:
    """What a user installs: every tracked file under ``tblog_hooks/`` (the tab's frontend too) and
    the license pyproject names."""
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path]
    subprocess.run([*build, str(ROOT.parent)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(
        ["git", "ls-files", "tblog_hooks"], cwd=ROOT.parent, check=True, capture_output=True, text=True
    ).stdout.split()
    assert {path for path in tracked if "__pycache__" not in path} - shipped == set()
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in shipped)
