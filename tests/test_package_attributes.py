"""Every public module at the package's top (nccl_ddp/*.py: the glue modules lightning, accelerate,
transformers, keras, and the rest) is reachable as an attribute after a plain `import nccl_ddp`, as
the README spells them (`nccl_ddp.keras.DistributedOptimizer(...)`), without importing a framework."""

import json
import subprocess
import sys

from paths import ROOT

FRAMEWORKS = ["torch", "jax", "lightning", "accelerate", "transformers", "keras", "tensorflow", "paddle"]


def test_top_level_modules_are_package_attributes_and_import_no_framework():
    names = sorted(p.stem for p in (ROOT / "nccl_ddp").glob("*.py") if not p.stem.startswith("_"))
    code = (
        "import json, sys, nccl_ddp\n"
        f"names, fws = {names!r}, {FRAMEWORKS!r}\n"
        "got = {n: getattr(nccl_ddp, n).__name__ for n in names}\n"
        "print(json.dumps({'got': got, 'loaded': [f for f in fws if f in sys.modules]}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["got"] == {n: f"nccl_ddp.{n}" for n in names}
    assert res["loaded"] == [], f"import nccl_ddp + attribute access loaded {res['loaded']}"
