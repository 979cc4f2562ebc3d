"""docs/architecture.md names every module of the package (so the layer picture stays true)."""

import re
from pathlib import Path

from paths import ROOT


def test_every_module_is_in_the_architecture_page():
    text = (ROOT / "docs" / "architecture.md").read_text()
    listing = text[text.index("```\nnccl_ddp/") :]
    listing = listing[: listing.index("```", 4)]
    named = set(re.findall(r"[a-z_][a-z0-9_]*", listing))
    modules = sorted(
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "nccl_ddp").rglob("*.py")
        if p.stem not in ("__init__", "__main__")
    )
    missing = [m for m in modules if Path(m).stem not in named]
    assert not missing, f"modules missing from docs/architecture.md's listing: {missing}"
    for cu in sorted((ROOT / "kernels").glob("*.cu")):
        assert cu.name in listing, f"kernels/{cu.name} is missing from docs/architecture.md"
