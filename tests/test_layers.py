"""The import graph follows the layers in the README: a module imports only its own layer or
lower ones, and a framework (torch, JAX, MindSpore) only inside nccl_ddp/adapters/. Every import
statement counts, those inside functions too; `nccl_ddp.frameworks` loads adapters by name."""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "nccl_ddp"

# lowest first; a module may import from its own layer and the layers before it
LAYERS = [
    ["errors", "env", "validate"],
    ["frameworks", "dlpack"],
    ["store"],
    ["device", "kernels"],
    ["comm", "profiling"],
    ["ddp"],
    ["adapters"],
    ["", "launch", "hooks"],          # "" is the package itself (nccl_ddp/__init__.py)
]
FRAMEWORKS = {"torch", "jax", "jaxlib", "flax", "mindspore"}


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


def imports(path: pathlib.Path):
    """(line, imported module) for every import statement, resolving relative ones."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base == "nccl_ddp":   # `from nccl_ddp import kernels`: the names are modules
                for alias in node.names:
                    yield node.lineno, f"{base}.{alias.name}"
            else:
                yield node.lineno, base


SOURCES = sorted(PKG.rglob("*.py"))


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
                bad.append(f"{path.relative_to(PKG.parent)}:{line}: {me} (layer {mine}) imports "
                           f"{target} (layer {theirs})")
    assert not bad, "imports against the flow:\n" + "\n".join(bad)


def test_frameworks_are_imported_only_in_adapters():
    bad = []
    for path in SOURCES:
        if "adapters" in path.relative_to(PKG).parts:
            continue
        for line, target in imports(path):
            if target.split(".")[0] in FRAMEWORKS:
                bad.append(f"{path.relative_to(PKG.parent)}:{line}: imports {target}")
    assert not bad, "framework imports outside nccl_ddp/adapters/:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, expected", [
    ("from nccl_ddp.ddp.reducer import Reducer\n", "nccl_ddp/store/x.py"),
    ("import torch\n", "nccl_ddp/comm/x.py"),
])
def test_the_checks_catch_a_planted_violation(tmp_path, monkeypatch, source, expected):
    """Plant an upward import and a framework import in a copy: each check must fail."""
    fake = tmp_path / "nccl_ddp"
    target = fake / expected.split("/", 1)[1]
    target.parent.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    target.write_text(source)
    monkeypatch.setattr(__import__(__name__), "PKG", fake)
    monkeypatch.setattr(__import__(__name__), "SOURCES", sorted(fake.rglob("*.py")))
    check = (test_no_import_runs_against_the_layers if "ddp" in source
             else test_frameworks_are_imported_only_in_adapters)
    with pytest.raises(AssertionError, match="imports"):
        check()
