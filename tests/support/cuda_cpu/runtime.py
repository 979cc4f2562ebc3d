"""Builds kernels/bucket.cu for the CPU (translate.py + cuda_cpu.h, g++/clang++), caches the
library by source hash, and launches its kernels with the checks of cuLaunchKernel: argument
count, each argument's byte size and kind against the C++ parameter (by-value structs included),
the 4 KiB parameter limit and the kernel's __launch_bounds__. Memory/race/vote errors found while
a kernel runs raise `KernelFault` with compute-sanitizer-like messages."""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cuda_cpu import translate

PARAM_LIMIT = 4096  # bytes of kernel parameters (cuLaunchKernel, pre-12.1)
FLAGS = (
    "-std=c++17",
    "-O1",
    "-fPIC",
    "-shared",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
    "-fno-fast-math",
    "-U_FORTIFY_SOURCE",
    "-D_FORTIFY_SOURCE=0",
    "-Wall",
    "-Wno-unused-function",
)
KINDS = ("pointer", "integer", "float", "struct")


class LaunchError(Exception):
    """The launch would be refused (or misread) by cuLaunchKernel."""


class KernelFault(Exception):
    """The kernel broke a memory, race or warp rule while it ran."""


class BuildError(Exception):
    """The CPU build failed (compiler message attached)."""


def compiler() -> str | None:
    """$CXX, else g++, else clang++; None when there is none."""
    for c in (os.environ.get("CXX"), "g++", "clang++"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def cache_dir() -> Path:
    d = os.environ.get("NCCL_DDP_CPU_KERNEL_CACHE")
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nccl_ddp" / "cuda_cpu"


def effective_ftz(options: Sequence[str]) -> bool:
    """Whether NVRTC flushes f32 subnormals for these options (the last -ftz wins;
    --use_fast_math implies it)."""
    ftz = False
    for o in options:
        if o.startswith(("-ftz=", "--ftz=")):
            ftz = o.split("=", 1)[1] == "true"
        elif o in ("-use_fast_math", "--use_fast_math"):
            ftz = True
    return ftz


def build(prog: str, path: str = "bucket.cu") -> Path:
    """The library of the translation unit `prog` (translate.program), from the cache when the
    same text, header, compiler and flags were built before."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler (g++ or clang++; or set CXX)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(
        "\0".join([prog, translate.HEADER.read_text(), version, *FLAGS]).encode()
    ).hexdigest()[:24]
    out_dir = cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"bucket_{key}.so"
    if lib.exists():
        return lib
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; another may have finished it
        if lib.exists():
            return lib
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            cpp = Path(tmp) / "bucket_cpu.cpp"
            cpp.write_text(prog)
            so = Path(tmp) / "lib.so"
            r = subprocess.run(
                [cxx, *FLAGS, "-o", str(so), str(cpp)],
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            if r.returncode != 0:
                raise BuildError(f"{Path(cxx).name} failed on {path} (translated):\n{r.stderr[-6000:]}")
            os.replace(so, lib)
    return lib


class Module:
    """A loaded CPU build: its kernels by name expression, with parameter descriptions."""

    def __init__(self, lib_path: Path) -> None:
        self.path = lib_path
        lib = self.lib = ctypes.CDLL(str(lib_path))
        lib.cc_heap_new.restype = ctypes.c_void_p
        lib.cc_heap_new.argtypes = [ctypes.c_size_t]
        lib.cc_heap_delete.argtypes = [ctypes.c_void_p]
        lib.cc_heap_base.restype = ctypes.c_uint64
        lib.cc_heap_base.argtypes = [ctypes.c_void_p]
        lib.cc_heap_host.restype = ctypes.c_void_p
        lib.cc_heap_host.argtypes = [ctypes.c_void_p]
        lib.cc_heap_cap.restype = ctypes.c_size_t
        lib.cc_heap_cap.argtypes = [ctypes.c_void_p]
        lib.cc_alloc.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        lib.cc_free.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
        lib.cc_free.restype = ctypes.c_int
        lib.cc_kernel_name.restype = ctypes.c_char_p
        lib.cc_launch.restype = ctypes.c_long
        lib.cc_launch.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        self.kernels = {}
        for k in range(lib.cc_kernel_count()):
            params = []
            for i in range(lib.cc_param_count(k)):
                size, align, kind = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
                lib.cc_param(k, i, ctypes.byref(size), ctypes.byref(align), ctypes.byref(kind))
                params.append((size.value, align.value, KINDS[kind.value]))
            self.kernels[lib.cc_kernel_name(k).decode()] = (k, lib.cc_kernel_bounds(k), params)

    def new_heap(self, nbytes: int) -> Heap:
        return Heap(self, nbytes)

    def pack(self, name: str, args: Sequence[tuple]) -> bytes:
        """The parameter buffer of a launch of `name` from CuPy-converted arguments
        `(bytes, kind, description)`, checked like cuLaunchKernel."""
        if name not in self.kernels:
            raise LaunchError(f"no kernel {name!r} in the module")
        _, _, params = self.kernels[name]
        if len(args) != len(params):
            raise LaunchError(f"{name}: {len(args)} arguments for {len(params)} parameters")
        buf = bytearray()
        for i, ((data, kind, what), (size, align, pkind)) in enumerate(zip(args, params)):
            ok = len(data) == size and (
                kind == pkind
                or (pkind == "pointer" and kind == "integer" and size == 8)
                or (pkind == "integer" and kind == "pointer" and size == 8)
            )
            if not ok:
                raise LaunchError(
                    f"{name}: argument {i} is {what} ({len(data)} bytes, {kind}) "
                    f"but parameter {i} is a {size}-byte {pkind}"
                )
            buf += bytes(-len(buf) % align) + data
        if len(buf) > PARAM_LIMIT:
            raise LaunchError(
                f"{name}: {len(buf)} bytes of parameters exceed the "
                f"{PARAM_LIMIT}-byte limit of a kernel launch"
            )
        return bytes(buf)

    def launch(self, heap: Heap, name: str, grid: int, block: int, args: Sequence[tuple]) -> None:
        params = self.pack(name, args)
        k, bounds, _ = self.kernels[name]
        if not 1 <= block <= min(bounds, 1024):
            raise LaunchError(
                f"{name}: block of {block} threads; __launch_bounds__ allows {bounds} (cudaErrorInvalidValue)"
            )
        if not 1 <= grid < 2**31:
            raise LaunchError(f"{name}: grid of {grid} blocks")
        err = ctypes.create_string_buffer(8192)
        n = self.lib.cc_launch(heap.handle, k, params, grid, block, err, len(err))
        if n:
            raise KernelFault(
                f"{name} (grid {grid}, block {block}): {n} error(s) found by the CPU "
                f"sanitizer:\n{err.value.decode(errors='replace').rstrip()}"
            )


class Heap:
    """Device memory of the CPU build: device addresses in a PROT_NONE range, storage on the
    host (zeroed, committed as touched), allocations registered for the memory checks."""

    def __init__(self, module: Module, nbytes: int) -> None:
        self.module = module
        h = module.lib.cc_heap_new(nbytes)
        if not h:
            raise MemoryError(f"could not reserve {nbytes} bytes for the CPU device heap")
        self.handle = h
        self.base = int(module.lib.cc_heap_base(h))
        cap = int(module.lib.cc_heap_cap(h))
        raw = (ctypes.c_uint8 * cap).from_address(module.lib.cc_heap_host(h))
        self.mem = np.ctypeslib.as_array(raw)
        self._finalizer = weakref.finalize(self, module.lib.cc_heap_delete, h)

    def register(self, addr: int, nbytes: int) -> None:
        self.module.lib.cc_alloc(self.handle, addr, nbytes)

    def unregister(self, addr: int) -> None:
        self.module.lib.cc_free(self.handle, addr)


_LOADED: dict = {}  # library path -> Module
_BUILT: dict = {}  # hash of the translation unit -> Module (skips the compiler --version)


def load(src: str, names: Sequence[str], ftz: bool, path: str = "bucket.cu") -> Module:
    """Build (or reuse) and load `src` with kernels `names`; one Module per library file."""
    return _load(translate.program(src, names, ftz, path), path)


def load_variants(variants: dict, names: Sequence[str], ftz: bool, path: str = "bucket.cu") -> Module:
    """Several versions of a source in one library: kernel "prefix::name" of each."""
    return _load(translate.program_variants(variants, names, ftz, path), path)


def _load(prog: str, path: str) -> Module:
    key = hashlib.sha256(prog.encode()).hexdigest()
    if key in _BUILT:
        return _BUILT[key]
    lib = build(prog, path)
    if lib not in _LOADED:
        _LOADED[lib] = Module(lib)
    _BUILT[key] = _LOADED[lib]
    return _LOADED[lib]
