"""`nccl_ddp.arrays.frameworks` loads adapters by name (importlib), so the import graph that
tests/test_layers.py reads cannot see those edges. This test covers them: every module the core can
load that way is named by the explicit table (`ADAPTERS`, `GENERIC`) or by a literal
`adapter_module("...")` call, lives in nccl_ddp/adapters/ (the layer allowed to import frameworks),
and defines the wrapper class the table names; and arrays/frameworks.py loads `<package>.<module>` only,
every row it ships having package nccl_ddp.adapters (a row a third party adds with
`frameworks.register` names its own package: tests/adapters/test_toy_framework.py)."""

import ast
from pathlib import Path

from paths import ROOT

from nccl_ddp.arrays import frameworks

PKG = ROOT / "nccl_ddp"
ADAPTERS_DIR = PKG / "adapters"


def _file(module: str) -> Path:
    """The file of `nccl_ddp.adapters.<module>` ("torch.ddp" -> adapters/torch/ddp.py)."""
    return ADAPTERS_DIR / (module.replace(".", "/") + ".py")


def _classes(module: str) -> set:
    tree = ast.parse(_file(module).read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def _adapter_module_calls() -> list:
    """(file, module) of every adapter_module("<literal>", ...) call in the package."""
    found = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == (
                "adapter_module"
            ):
                arg = node.args[0] if node.args else None
                assert isinstance(arg, ast.Constant) and isinstance(arg.value, str), (
                    f"{path.relative_to(ROOT)}:{node.lineno}: adapter_module takes a literal module "
                    "name, so this test can check where it points"
                )
                found.append((path.relative_to(ROOT).as_posix(), arg.value))
    return found


def test_every_dynamically_loaded_module_is_an_adapter():
    targets = {frameworks.GENERIC}
    for key, fw in frameworks.ADAPTERS.items():
        targets.add(fw.adapter)
        if fw.wrapper is not None:
            module, cls = fw.wrapper
            assert _file(module).is_file(), f"ADAPTERS[{key!r}].wrapper: no adapters/{module}.py"
            assert cls in _classes(module), (
                f"ADAPTERS[{key!r}].wrapper: adapters/{module}.py has no class {cls}"
            )
    calls = _adapter_module_calls()
    assert calls, "adapter_module is called somewhere (comm/api.py: torch.dist); the scan found none"
    targets |= {m for _, m in calls}
    missing = sorted(m for m in targets if not _file(m).is_file())
    assert not missing, f"loaded by name but not in nccl_ddp/adapters/: {missing}"


def test_frameworks_loads_only_under_adapters():
    tree = ast.parse((PKG / "arrays" / "frameworks.py").read_text())
    loads = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "import_module"
    ]
    assert len(loads) == 1, "frameworks.py imports by name in exactly one place (_load)"
    arg = loads[0].args[0]
    assert isinstance(arg, ast.JoinedStr) and getattr(arg.values[0].value, "id", "") == "package", (
        "frameworks._load imports only <package>.<module>"
    )
    assert frameworks.OURS == "nccl_ddp.adapters"
    foreign = {key: fw.package for key, fw in frameworks.ADAPTERS.items() if fw.package != frameworks.OURS}
    assert not foreign, f"rows of the shipped table whose adapter is not under nccl_ddp/adapters/: {foreign}"


def test_every_adapter_module_declares_the_contract():
    """Every adapter the core loads is checked by mypy against `FrameworkAdapter` where it is
    written: it assigns itself (or, for the generic one, an instance) to a variable annotated
    `FrameworkAdapter`, so a member missing or renamed fails mypy in that file."""
    for module in sorted({fw.adapter for fw in frameworks.ADAPTERS.values()} | {frameworks.GENERIC}):
        tree = ast.parse(_file(module).read_text())
        declared = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.AnnAssign)
            and isinstance(n.annotation, ast.Name)
            and n.annotation.id == "FrameworkAdapter"
        ]
        assert declared, (
            f"{_file(module).relative_to(ROOT)} does not declare itself a FrameworkAdapter; end it with "
            f"`if TYPE_CHECKING: _contract: FrameworkAdapter = <this module>` (see adapters/torch/adapter.py)"
        )
