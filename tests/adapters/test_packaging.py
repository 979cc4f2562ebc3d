"""What an install with one extra gives: `pip install "nccl_ddp[torch]"` (or `[jax]`) alone, then
wrapping a model, must work. ml_dtypes (NumPy's bfloat16) is imported only for bfloat16 data:
a float32 torch model trains without it (issue 21: dlpack.py imported it on every torch path).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import venv

import pytest
from paths import ROOT as REPO

ROOT = str(REPO)

# One step of DDP on a CPU model, world of one, with ml_dtypes made unimportable when asked.
TORCH_STEP = """
    import sys
    if {block_ml_dtypes}:
        sys.modules["ml_dtypes"] = None     # `import ml_dtypes` raises ImportError
    import torch
    import nccl_ddp as nd
    nd.init_process_group("host", rank=0, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    ddp = nd.DistributedDataParallel(model)
    ddp(torch.ones(2, 4)).sum().backward()
    torch.optim.SGD(ddp.parameters(), lr=0.1).step()
    assert all(p.grad is not None for p in model.parameters())
    ddp.close()
    nd.destroy_process_group()
    assert not {block_ml_dtypes} or sys.modules["ml_dtypes"] is None   # still blocked
    print("ok")
"""

JAX_STEP = """
    import jax.numpy as jnp
    import nccl_ddp as nd
    nd.init_process_group("host", rank=0, world_size=1)
    out = nd.all_reduce(jnp.arange(4.0))
    assert float(out.sum()) == 6.0, out
    nd.destroy_process_group()
    print("ok")
"""


def _run(python: str, code: str, cwd: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_torch_model_wraps_without_ml_dtypes(tmp_path):
    """float32 torch DDP, forward, backward and a step with ml_dtypes unimportable."""
    pytest.importorskip("torch", reason="PyTorch is not installed")
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = _run(sys.executable, TORCH_STEP.format(block_ml_dtypes=True), str(tmp_path), env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_bfloat16_without_ml_dtypes_says_what_to_install():
    from nccl_ddp.arrays.dlpack import bfloat16_dtype
    from nccl_ddp.errors import ConfigError

    saved = sys.modules.get("ml_dtypes")
    sys.modules["ml_dtypes"] = None  # type: ignore[assignment]
    try:
        with pytest.raises(ConfigError, match="pip install ml_dtypes"):
            bfloat16_dtype()
    finally:
        if saved is None:
            del sys.modules["ml_dtypes"]
        else:
            sys.modules["ml_dtypes"] = saved


def _copy_project(dst: str) -> str:
    """The files a wheel is built from (an install from the checkout itself would leave build/
    and *.egg-info in it)."""
    os.makedirs(dst)
    for name in ("pyproject.toml", "setup.py", "README.md", "MANIFEST.in"):
        shutil.copy(os.path.join(ROOT, name), dst)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("nccl_ddp", "kernels"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(dst, name), ignore=ignore)
    return dst


# extra -> (pins that keep pip on the local wheels, the check run in the new environment)
EXTRAS = {
    # torch 2.13.0 is the local CPU wheel; a plain "torch" would fetch a CUDA build of several GB
    "torch": (["torch==2.13.0"], TORCH_STEP.format(block_ml_dtypes=False)),
    "jax": ([], JAX_STEP),
}


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_each_extra_alone_in_a_fresh_venv(extra, tmp_path):
    """`python -m venv`, `pip install ".[extra]"` (from local wheels/indexes only), wrap a model
    (torch) or reduce an array (jax) in the new environment. --no-compile: byte-compiling torch
    took over 15 minutes on a busy 2-core machine; without it, about 3."""
    src = _copy_project(str(tmp_path / "src"))
    env_dir = str(tmp_path / "venv")
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = os.path.join(env_dir, "bin", "python")
    pins, check = EXTRAS[extra]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-compile",
            f"{src}[{extra}]",
            *pins,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=2200,
    )
    if r.returncode != 0 and (
        "No matching distribution" in r.stderr or "Could not find a version" in r.stderr
    ):
        pytest.skip(
            f"the {extra} extra's packages are not available offline here: "
            f"{r.stderr.strip().splitlines()[-1]}"
        )
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run(python, check, str(tmp_path), env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
