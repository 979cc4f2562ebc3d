"""Turns kernels/bucket.cu into C++ that g++ compiles against cuda_cpu.h: every inline PTX
statement becomes a call of the software function of the same semantics, `#pragma unroll` goes,
and anything the CPU build does not model (an unknown `asm`, intrinsic or preprocessor directive)
is refused with a `TranslateError` naming the line, so a kernel change cannot escape the check.
Line numbers are kept (`#line`), so compiler errors point into bucket.cu."""

from __future__ import annotations

import re
from pathlib import Path

HEADER = Path(__file__).resolve().parent / "cuda_cpu.h"

# PTX statement -> (software function in cuda_cpu.h, output constraint, input constraints)
PTX = {
    "cvt.rn.bf16.f32": ("ptx_cvt_rn_bf16_f32", "h", ("f",)),
    "cvt.rn.f16.f32": ("ptx_cvt_rn_f16_f32", "h", ("f",)),
    "cvt.f32.f16": ("ptx_cvt_f32_f16", "f", ("h",)),
    "cvt.rn.f32.f64": ("ptx_cvt_rn_f32_f64", "f", ("d",)),
    "mul.rn.f32": ("ptx_mul_rn_f32", "f", ("f", "f")),
    "add.rn.f32": ("ptx_add_rn_f32", "f", ("f", "f")),
    "sub.rn.f32": ("ptx_sub_rn_f32", "f", ("f", "f")),
    "div.rn.f32": ("ptx_div_rn_f32", "f", ("f", "f")),
    "sqrt.rn.f32": ("ptx_sqrt_rn_f32", "f", ("f",)),
    "fma.rn.f32": ("ptx_fma_rn_f32", "f", ("f", "f", "f")),
    "mul.rn.ftz.f32": ("ptx_mul_rn_ftz_f32", "f", ("f", "f")),
    "add.rn.ftz.f32": ("ptx_add_rn_ftz_f32", "f", ("f", "f")),
}

# CUDA names the header implements; any other __name, atomic*, *_sync or asm is refused.
KNOWN = {
    "__device__",
    "__global__",
    "__forceinline__",
    "__restrict__",
    "__grid_constant__",
    "__launch_bounds__",
    "__ldg",
    "__ldca",
    "__stwb",
    "__any_sync",
    "__float_as_uint",
    "__uint_as_float",
    "__double_as_longlong",
    "__fmul_rn",
    "__fadd_rn",
    "__dmul_rn",
    "__dadd_rn",
    "atomicExch",
}
_CUDA_NAME = re.compile(r"\b(__\w+|atomic\w+|\w+_sync|__syncthreads\w*)\b")


class TranslateError(Exception):
    """The kernel source uses something the CPU build does not model."""


def _strip(src: str) -> tuple:
    """(code with comments blanked, code with comments and string contents blanked); newlines
    and columns are kept."""
    code, bare = [], []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            code.append(" " * (j - i))
            bare.append(" " * (j - i))
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank = re.sub(r"[^\n]", " ", src[i:j])
            code.append(blank)
            bare.append(blank)
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            j += 1
            code.append(src[i:j])
            bare.append(c + " " * (j - i - 2) + c)
            i = j
        else:
            code.append(c)
            bare.append(c)
            i += 1
    return "".join(code), "".join(bare)


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _split_top(s: str, sep: str) -> list:
    """Split at `sep` outside parentheses and string literals."""
    parts, depth, quote, cur = [], 0, None, []
    for ch in s:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return parts


_OPERAND = re.compile(r'^\s*"([=+]?)(\w)"\s*\((.*)\)\s*$', re.DOTALL)


def _asm(stmt: str, line: int, path: str) -> str:
    """One `asm(...)` statement -> `out = ::cuda_cpu::fn(in...);`."""
    inner = stmt[stmt.index("(") + 1 : stmt.rindex(")")]
    parts = _split_top(inner, ":")
    where = f"{path}:{line}"
    if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3].strip()):
        raise TranslateError(
            f"{where}: asm statement the CPU build does not model (it takes "
            f'exactly `"template" : output : inputs`, no clobbers): {stmt!r}'
        )
    template = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', parts[0]))
    m = re.fullmatch(r"\s*([\w.]+)\s+%0\s*,\s*%1\s*(?:,\s*%2\s*(?:,\s*%3\s*)?)?;?\s*", template)
    if not m or m.group(1) not in PTX:
        raise TranslateError(
            f"{where}: inline PTX {template.strip()!r} is not modelled by the CPU build; add its "
            f"software semantics to tests/cuda_cpu/cuda_cpu.h and translate.PTX (known: "
            f"{', '.join(sorted(PTX))})"
        )
    fn, out_c, in_cs = PTX[m.group(1)]
    outs = [_OPERAND.match(o) for o in _split_top(parts[1], ",") if o.strip()]
    ins = [_OPERAND.match(o) for o in _split_top(parts[2], ",") if o.strip()]
    if len(outs) != 1 or not outs[0] or outs[0].group(1) != "=" or outs[0].group(2) != out_c:
        raise TranslateError(f'{where}: {m.group(1)} needs one "={out_c}" output: {stmt!r}')
    if len(ins) != len(in_cs) or any(not x or x.group(2) != c for x, c in zip(ins, in_cs)):
        raise TranslateError(
            f"{where}: {m.group(1)} needs inputs {', '.join(repr(c) for c in in_cs)}: {stmt!r}"
        )
    if template.count("%") != 1 + len(in_cs):
        raise TranslateError(f"{where}: operand count of {template.strip()!r} does not match")
    args = ", ".join(x.group(3) for x in ins)
    return f"{outs[0].group(3)} = ::cuda_cpu::{fn}({args});" + "\n" * stmt.count("\n")


def translate(src: str, path: str = "bucket.cu") -> tuple:
    """(C++ text of the kernels, {kernel: launch-bounds expression}). Raises TranslateError."""
    code, bare = _strip(src)
    # preprocessor: only `#pragma unroll` (dropped: g++ would warn) and `#line N "file"` (kept)
    for m in re.finditer(r"^[ \t]*#[^\n]*", bare, re.MULTILINE):
        directive = m.group(0).strip()
        if re.fullmatch(r"#\s*pragma\s+unroll(\s+\d+)?", directive):
            code = code[: m.start()] + " " * (m.end() - m.start()) + code[m.end() :]
            continue
        if re.fullmatch(r'#\s*line\s+\d+\s+"[^"\n]*"', directive):  # module_source's file marks
            continue
        raise TranslateError(
            f"{path}:{_line(bare, m.start())}: preprocessor directive {directive!r} is not "
            "supported by the CPU build (tests/support/cuda_cpu): the kernel must not include headers "
            "or define macros the CPU model does not know"
        )
    # inline PTX (replaced back to front so that positions stay valid)
    stmts = list(re.finditer(r"\basm\s*(?:volatile\s*)?\((?:[^;]|;(?=[^)]*\"))*?\)\s*;", code, re.DOTALL))
    for m in reversed(stmts):
        repl = _asm(m.group(0), _line(code, m.start()), path)
        code = code[: m.start()] + repl + code[m.end() :]
        bare = bare[: m.start()] + " " * len(repl) + bare[m.end() :]
    for m in re.finditer(r"\basm\b", bare):
        raise TranslateError(f"{path}:{_line(bare, m.start())}: an asm statement the CPU build cannot parse")
    for m in _CUDA_NAME.finditer(bare):
        if m.group(1) not in KNOWN:
            raise TranslateError(
                f"{path}:{_line(bare, m.start())}: {m.group(1)} is not modelled by the CPU build "
                "(tests/cuda_cpu/cuda_cpu.h); add it there, with its semantics and checks, and "
                "to translate.KNOWN"
            )
    # __launch_bounds__(X) of each __global__ function: recorded, then removed
    bounds = {}
    for m in re.finditer(r"__global__\s+void\s+(?:__launch_bounds__\s*\(([^()]*)\)\s*)?(\w+)\s*\(", code):
        bounds[m.group(2)] = m.group(1) or "1024"
    code = re.sub(r"__launch_bounds__\s*\([^()]*\)", lambda m: " " * len(m.group(0)), code)
    return code, bounds


def _entries(prefix: str, names, bounds: dict) -> str:
    """A function adding every name expression (with its launch bounds and parameter types) to
    the entry table; inside namespace `prefix` when there is one."""
    rows = []
    for name in names:
        base = name.split("<")[0]
        if base not in bounds:
            raise TranslateError(f"kernel {name!r}: no __global__ function {base} in the source")
        full = f"{prefix}::{name}" if prefix else name
        rows.append(f'  e.push_back(::cuda_cpu::make_entry("{full}", ({bounds[base]}), &{name}));')
    return "inline void cuda_cpu_register(std::vector<::cuda_cpu::Entry>& e) {\n" + "\n".join(rows) + "\n}\n"


def program(src: str, names, ftz: bool, path: str = "bucket.cu") -> str:
    """The whole translation unit."""
    return program_variants({"": src}, names, ftz, path)


def program_variants(variants: dict, names, ftz: bool, path: str = "bucket.cu") -> str:
    """One translation unit holding several versions of the source (planted bugs), each in its
    namespace (its kernels are named "prefix::name"); prefix "" is the global namespace."""
    out = [f'#define CUDA_CPU_FTZ {int(ftz)}\n#include "{HEADER}"\n']
    for prefix, src in variants.items():
        code, bounds = translate(src, path)
        body = f'#line 1 "{path}"\n{code}\n#line 1 "glue"\n' + _entries(prefix, names, bounds)
        out.append(f"namespace {prefix} {{\n{body}}}\n" if prefix else body)
    calls = "\n".join(f"  {p + '::' if p else '::'}cuda_cpu_register(e);" for p in variants)
    out.append(
        "namespace cuda_cpu {\nstd::vector<Entry>& entries() {\n"
        "  static std::vector<Entry> e = [] {\n    std::vector<Entry> e;\n"
        + calls
        + "\n    return e;\n  }();\n  return e;\n}\n}\n"
    )
    return "".join(out)
