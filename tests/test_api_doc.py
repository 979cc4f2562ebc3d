"""docs/api.md stays true to the code: its "Every public name" block lists exactly `nccl_ddp.__all__`,
each callable with its signature as `inspect.signature` gives it (names and defaults, no
annotations), and every dotted `nccl_ddp.` name the page mentions exists. A failure says which
line to add, change or remove."""

from __future__ import annotations

import enum
import importlib
import inspect
import re

import pytest
from paths import ROOT

import nccl_ddp

PAGE = ROOT / "docs" / "api.md"
HEADING = "## Every public name"


def _documented() -> dict:
    """{name: the text in parentheses, or None for a name listed without them}."""
    text = PAGE.read_text()
    assert HEADING in text, f"docs/api.md has no '{HEADING}' section"
    block = text[text.index(HEADING) :]
    block = block[block.index("```python\n") + 10 :]
    block = block[: block.index("```")]
    block = re.sub(r"#[^\n]*", "", block)  # comments
    entries = {}
    for m in re.finditer(r"\bnd\.(\w+)(\((.*?)\))?(?=\s*(?:\bnd\.|$))", block, re.S):
        entries[m.group(1)] = None if m.group(2) is None else " ".join(m.group(3).split())
    return entries


def _callable_signature(obj) -> inspect.Signature | None:
    """The signature users call, or None for what they do not call (modules, values, exception
    classes, abstract bases, enums). A class's is its `__init__`'s without self (the wrappers'
    `__new__` only picks the framework's subclass)."""
    if (
        not callable(obj)
        or isinstance(obj, type)
        and (issubclass(obj, (BaseException, enum.Enum)) or inspect.isabstract(obj))
    ):
        return None
    if isinstance(obj, type):
        sig = inspect.signature(obj.__init__)
        return sig.replace(parameters=list(sig.parameters.values())[1:])
    return inspect.signature(obj)


def render(sig: inspect.Signature) -> str:
    """`a, b=1, *, c=None, **kw`: what the block writes for a signature."""
    out, star = [], False
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            star = True
            out.append(f"*{p.name}")
        elif p.kind is p.VAR_KEYWORD:
            out.append(f"**{p.name}")
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                star = True
                out.append("*")
            out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
        if p.kind is p.POSITIONAL_ONLY and (
            len(out) == len(sig.parameters)
            or list(sig.parameters.values())[len(out)].kind is not p.POSITIONAL_ONLY
        ):
            out.append("/")
    return ", ".join(out)


def _line(name: str) -> str:
    sig = _callable_signature(getattr(nccl_ddp, name))
    return f"nd.{name}" if sig is None else f"nd.{name}({render(sig)})"


def test_every_public_name_is_listed_and_nothing_else():
    documented = set(_documented())
    public = set(nccl_ddp.__all__)
    missing = sorted(public - documented)
    extra = sorted(documented - public)
    assert not missing, f"add to the '{HEADING}' block of docs/api.md: " + "; ".join(
        _line(n) for n in missing
    )
    assert not extra, (
        f"remove from the '{HEADING}' block of docs/api.md (not in nccl_ddp.__all__): "
        + ", ".join(f"nd.{n}" for n in extra)
    )


def _wrong_signatures(names) -> list:
    wrong = []
    documented = _documented()
    for name in sorted(set(names) & set(documented)):
        args = documented[name]
        sig = _callable_signature(getattr(nccl_ddp, name))
        if args != (None if sig is None else render(sig)):
            written = f"nd.{name}" if args is None else f"nd.{name}({args})"
            wrong.append(f"{written}  ->  {_line(name)}")
    return wrong


# names the package binds at import; the others load their framework when first used
EAGER = [n for n in nccl_ddp.__all__ if n in vars(nccl_ddp)]
LAZY = [n for n in nccl_ddp.__all__ if n not in vars(nccl_ddp)]


def test_each_documented_signature_is_the_code_s():
    wrong = _wrong_signatures(EAGER)
    assert not wrong, f"in the '{HEADING}' block of docs/api.md, change:\n" + "\n".join(wrong)


@pytest.mark.slow
@pytest.mark.parametrize("name", LAZY)
def test_documented_signature_of_a_framework_name(name):
    try:
        getattr(nccl_ddp, name)
    except ImportError as e:
        pytest.skip(f"nd.{name} needs a framework that is not installed: {e}")
    wrong = _wrong_signatures([name])
    assert not wrong, f"in the '{HEADING}' block of docs/api.md, change:\n" + "\n".join(wrong)


def test_every_dotted_name_on_the_page_exists():
    missing = []
    for dotted in sorted(set(re.findall(r"\bnccl_ddp(?:\.\w+)+", PAGE.read_text()))):
        parts = dotted.split(".")
        obj, i = importlib.import_module("nccl_ddp"), 1
        try:
            while i < len(parts):
                try:
                    obj = getattr(obj, parts[i])
                except AttributeError:
                    obj = importlib.import_module(".".join(parts[: i + 1]))
                i += 1
        except ImportError:
            missing.append(dotted)
    assert not missing, f"docs/api.md names what does not exist: {missing}"


@pytest.mark.parametrize(
    "fn, text",
    [
        (lambda a, b=1, *c, d, e=None, **f: None, "a, b=1, *c, d, e=None, **f"),
        (lambda a, *, b="x": None, "a, *, b='x'"),
    ],
)
def test_render_writes_what_the_block_holds(fn, text):
    assert render(inspect.signature(fn)) == text
