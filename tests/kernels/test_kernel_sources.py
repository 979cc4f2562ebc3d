"""The comments of every kernels/*.cu name only modules and names that exist: a reader (or a
reviewer) following "mirrored in X" must land on the file that really mirrors the layout."""

import importlib
import re

import pytest
from paths import ROOT

SOURCES = sorted((ROOT / "kernels").glob("*.cu"))
PATH = re.compile(r"\bnccl_ddp(?:/\w+)*\.py\b|\b_?\w+\.py\b")
DOTTED = re.compile(r"\bnccl_ddp(?:\.\w+)+")


def _module_or_attr(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("cu", SOURCES, ids=lambda p: p.name)
def test_kernel_comments_name_existing_files_and_names(cu):
    text = cu.read_text()
    missing = [
        p
        for p in set(PATH.findall(text))
        if not (ROOT / p).is_file() and not list(ROOT.glob(f"nccl_ddp/**/{p}"))
    ]
    missing += [d for d in set(DOTTED.findall(text)) if not _module_or_attr(d)]
    # the names a layout comment says mirror the C structs
    for mirror in re.findall(r"mirrored by (nccl_ddp/\S+\.py): ([\w, ]+)\)", text):
        mod = importlib.import_module(mirror[0][:-3].replace("/", "."))
        missing += [f"{mirror[0]}:{n.strip()}" for n in mirror[1].split(",") if not hasattr(mod, n.strip())]
    assert not missing, f"{cu.name} names what does not exist: {sorted(missing)}"
