"""The import graph follows the layers in the README: a module imports only its own layer or
lower ones, and a framework (torch, JAX, MindSpore) only inside nccl_ddp/adapters/ and the Horovod
facade nccl_ddp/horovod/ (whose modules are named after the framework they imitate), which sits
on top: nothing in the package imports it. Inside a layer
(and among the scripts) no modules import each other in a circle. Every import statement counts,
those inside functions too; `nccl_ddp.arrays.frameworks` loads adapters by name."""

import ast
import functools
import pathlib
from typing import Dict, Iterator, List, Set

import pytest
from paths import ROOT

from nccl_ddp.arrays import frameworks

PKG = ROOT / "nccl_ddp"
SCRIPTS = PKG.parent / "scripts"

# lowest first; a module may import from its own layer and the layers before it
LAYERS = [
    ["errors", "job", "validate"],  # job: the launcher <-> worker contract (env, failure_record)
    ["arrays"],  # which framework an array belongs to (the adapter table), DLPack in and out
    ["store"],
    ["device", "kernels"],
    ["comm", "profiling"],
    ["buckets"],  # bucket layout and flat buffers, shared by sharding and the DDP core
    ["zero"],  # sharding: a mode the reducer is built with (its reduce-scatter, shards, gathers)
    ["ddp"],  # the DDP core and its wrappers
    ["adapters"],
    [
        "",
        "launch",
        "hooks",
        "frameworks",
        "lightning",
        "accelerate",
        "keras",
        "transformers",
    ],  # "" is the package (__init__.py)
    ["horovod"],  # a facade above everything: nothing imports it
]
# the frameworks (every key of the adapters' table) and the libraries built on them that an
# adapter package integrates: a row added to frameworks.ADAPTERS is checked here as it lands
FRAMEWORKS = set(frameworks.ADAPTERS) | {
    lib for fw in frameworks.ADAPTERS.values() for lib in fw.integrations
}
FRAMEWORK_HOMES = ("adapters", "horovod")  # the folders that may import a framework


def layer_of(module: str) -> int:
    """Layer index of a dotted module name under nccl_ddp ('nccl_ddp.comm.api' -> comm's)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module}: not in any layer of tests/test_layers.py; add it to LAYERS")


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _from_base(node: ast.ImportFrom, package: str) -> str:
    """The module a `from ... import` names, relative ones resolved against `package`."""
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    return base


@functools.cache
def _tree(path: pathlib.Path, text: str) -> ast.AST:
    return ast.parse(text, str(path))


def parse(path: pathlib.Path) -> ast.AST:
    """The file's syntax tree (parsed once per content: every check reads every file)."""
    return _tree(path, path.read_text())


def _package(path: pathlib.Path, me: str) -> str:
    return me if path.name == "__init__.py" else me.rpartition(".")[0]


def imports(path: pathlib.Path):
    """(line, imported module) for every import statement, resolving relative ones."""
    tree = parse(path)
    package = _package(path, module_name(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, package)
            if base == "nccl_ddp":  # `from nccl_ddp import kernels`: the names are modules
                for alias in node.names:
                    yield node.lineno, f"{base}.{alias.name}"
            else:
                yield node.lineno, base


def imported_modules(path: pathlib.Path, me: str, known: Set[str]) -> Iterator[str]:
    """The modules of `known` that `path` (module `me`) imports; `from a.b import c` counts as
    a.b.c when that is a module, else as a.b."""
    package = _package(path, me)
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, package)
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                if sub in known:
                    yield sub
                elif base in known:
                    yield base


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The import circles of `graph` (module -> modules it imports): its strongly connected
    components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph(sources: List[pathlib.Path], scripts: List[pathlib.Path]) -> Dict[str, Set[str]]:
    """module -> the package modules (or, for a script, the scripts) it imports, itself left out
    (a package's __init__ naming its own submodules)."""
    named = {module_name(p): p for p in sources}
    named.update({p.stem: p for p in scripts})  # scripts import each other by bare name
    known = set(named)
    return {me: set(imported_modules(path, me, known)) - {me} for me, path in named.items()}


SOURCES = sorted(PKG.rglob("*.py"))
SCRIPT_SOURCES = sorted(SCRIPTS.glob("*.py"))


def test_every_module_has_a_layer():
    for path in SOURCES:
        layer_of(module_name(path))


def test_no_import_runs_against_the_layers():
    bad = []
    for path in SOURCES:
        me = module_name(path)
        mine = layer_of(me)
        for line, target in imports(path):
            if target != "nccl_ddp" and not target.startswith("nccl_ddp."):
                continue
            theirs = layer_of(target)
            if theirs > mine:
                bad.append(
                    f"{path.relative_to(PKG.parent)}:{line}: {me} (layer {mine}) imports "
                    f"{target} (layer {theirs})"
                )
    assert not bad, "imports against the flow:\n" + "\n".join(bad)


def test_frameworks_are_imported_only_in_adapters():
    bad = []
    for path in SOURCES:
        if path.relative_to(PKG).parts[0] in FRAMEWORK_HOMES:
            continue
        for line, target in imports(path):
            if target.split(".")[0] in FRAMEWORKS:
                bad.append(f"{path.relative_to(PKG.parent)}:{line}: imports {target}")
    assert not bad, "framework imports outside nccl_ddp/adapters/ and horovod/:\n" + "\n".join(bad)


def framework_package(module: str) -> str:
    """The framework package of an adapter module ('nccl_ddp.adapters.torch.zero.step' -> 'torch'),
    '' for the framework-neutral modules at the adapters' root (generic, arrays, per_variables)."""
    parts = module.split(".")
    if parts[:2] != ["nccl_ddp", "adapters"] or len(parts) < 3:
        return ""
    return parts[2] if (PKG / "adapters" / parts[2]).is_dir() else ""


def test_one_framework_package_never_imports_another():
    """adapters/<fw>/ may import its own package and the neutral root, never another framework's:
    each framework's code is found, loaded and broken alone."""
    bad = []
    for path in SOURCES:
        me = module_name(path)
        mine = framework_package(me)
        if not mine:
            continue
        for line, target in imports(path):
            theirs = framework_package(target)
            if theirs and theirs != mine:
                bad.append(f"{path.relative_to(PKG.parent)}:{line}: {me} imports {target}")
    assert not bad, "adapter packages that import another framework's:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from nccl_ddp.ddp.reducer import Reducer\n", "nccl_ddp/store/x.py"),
        ("import torch\n", "nccl_ddp/comm/x.py"),
        ("from nccl_ddp.adapters.torch.tensors import to_native\n", "nccl_ddp/adapters/jax/x.py"),
    ],
)
def test_the_checks_catch_a_planted_violation(tmp_path, monkeypatch, source, expected):
    """Plant an upward import and a framework import in a copy: each check must fail."""
    fake = tmp_path / "nccl_ddp"
    target = fake / expected.split("/", 1)[1]
    target.parent.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    target.write_text(source)
    monkeypatch.setattr(__import__(__name__), "PKG", fake)
    monkeypatch.setattr(__import__(__name__), "SOURCES", sorted(fake.rglob("*.py")))
    (fake / "adapters" / "torch").mkdir(parents=True, exist_ok=True)
    if "adapters" in source:
        check = test_one_framework_package_never_imports_another
    elif "ddp" in source:
        check = test_no_import_runs_against_the_layers
    else:
        check = test_frameworks_are_imported_only_in_adapters
    with pytest.raises(AssertionError, match="imports"):
        check()


def test_no_import_circles():
    """No modules import each other in a loop, inside a folder either (the layer check sees
    only imports across layers), nor do the scripts."""
    found = circles(import_graph(SOURCES, SCRIPT_SOURCES))
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize(
    "files, circle",
    [
        (
            {
                "nccl_ddp/launch/cli.py": "def main():\n    from nccl_ddp.launch.launcher import launch\n",
                "nccl_ddp/launch/launcher.py": "from nccl_ddp.launch.cli import main\n",
            },
            "nccl_ddp.launch.cli <-> nccl_ddp.launch.launcher",
        ),
        (
            {
                "nccl_ddp/ddp/a.py": "from nccl_ddp.ddp import b\n",
                "nccl_ddp/ddp/b.py": "from . import c\n",
                "nccl_ddp/ddp/c.py": "import nccl_ddp.ddp.a\n",
            },
            "nccl_ddp.ddp.a <-> nccl_ddp.ddp.b <-> nccl_ddp.ddp.c",
        ),
        (
            {"scripts/bench_a.py": "import bench_b\n", "scripts/bench_b.py": "from bench_a import x\n"},
            "bench_a <-> bench_b",
        ),
    ],
)
def test_the_circle_check_catches_a_planted_circle(tmp_path, monkeypatch, files, circle):
    """Plant a circle (a function-level import, package-relative imports, scripts) in a copy."""
    fake = tmp_path / "nccl_ddp"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (tmp_path / "scripts").mkdir()
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    me = __import__(__name__)
    monkeypatch.setattr(me, "PKG", fake)
    monkeypatch.setattr(me, "SOURCES", sorted(fake.rglob("*.py")))
    monkeypatch.setattr(me, "SCRIPT_SOURCES", sorted((tmp_path / "scripts").glob("*.py")))
    with pytest.raises(AssertionError, match=circle):
        test_no_import_circles()
