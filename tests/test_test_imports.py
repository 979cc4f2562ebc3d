"""Test modules take helpers only from tests/support/ (on pytest's pythonpath), never from another
test module or a conftest: such an import works only when pytest happened to put the other folder
on sys.path first, and collecting one file alone then fails."""

import ast
import pathlib

from paths import ROOT

TESTS = ROOT / "tests"


def _imported(path: pathlib.Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _borrowed(tests: pathlib.Path) -> list:
    """(importing file, imported test module or conftest) for every such import under `tests`."""
    files = sorted(tests.rglob("*.py"))
    modules = {p.stem for p in files if p.stem.startswith("test_") or p.stem == "conftest"}
    return [(str(p.relative_to(tests)), name) for p in files for name in sorted(_imported(p) & modules)]


def test_no_test_module_imports_another_or_a_conftest():
    bad = _borrowed(TESTS)
    assert not bad, "move these helpers into tests/support/ and import them from there: " + ", ".join(
        f"{f} imports {m}" for f, m in bad
    )


def test_the_check_catches_a_planted_import(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "test_one.py").write_text("X = 1\n")
    (tmp_path / "test_two.py").write_text("def f():\n    from test_one import X\n    return X\n")
    (tmp_path / "support.py").write_text("import conftest\n")
    (tmp_path / "conftest.py").write_text("")
    assert _borrowed(tmp_path) == [("support.py", "conftest"), ("test_two.py", "test_one")]


def _test_folder_faults(root: pathlib.Path) -> list:
    """Each framework package adapters/<fw>/ has its tests in tests/adapters/<fw>_tests/, and no
    tests/adapters/<fw>/ exists (a namespace package that `import <fw>` would find)."""
    adapters = root / "nccl_ddp" / "adapters"
    frameworks = sorted(p.name for p in adapters.iterdir() if (p / "__init__.py").is_file())
    tests = root / "tests" / "adapters"
    missing = [fw for fw in frameworks if not (tests / f"{fw}_tests").is_dir()]
    faults = [f"tests/adapters/{fw}_tests/ is missing" for fw in missing]
    return faults + [f"tests/adapters/{fw}/ shadows {fw}" for fw in frameworks if (tests / fw).exists()]


def test_every_framework_has_its_tests_folder():
    faults = _test_folder_faults(ROOT)
    assert not faults, "tests/adapters/<fw>_tests/ for each adapters/<fw>/: " + ", ".join(faults)


def test_the_folder_check_catches_a_flat_or_shadowing_layout(tmp_path):
    for fw in ("torch", "paddle"):
        (tmp_path / "nccl_ddp" / "adapters" / fw).mkdir(parents=True)
        (tmp_path / "nccl_ddp" / "adapters" / fw / "__init__.py").write_text("")
    (tmp_path / "tests" / "adapters" / "torch").mkdir(parents=True)
    (tmp_path / "tests" / "adapters" / "torch_tests").mkdir()
    assert _test_folder_faults(tmp_path) == [
        "tests/adapters/paddle_tests/ is missing",
        "tests/adapters/torch/ shadows torch",
    ]
