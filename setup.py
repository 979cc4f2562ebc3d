"""Build hook only (everything else is in pyproject.toml): copy the top-level kernels/*.cu into the
built package as nccl_ddp/_kernels/, so an installed wheel finds its CUDA sources.
Editable installs read kernels/ from the checkout (nccl_ddp.kernels.kernel_source_dir)."""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dst = Path(self.build_lib) / "nccl_ddp" / "_kernels"
        self.mkpath(str(dst))
        for cu in sorted((HERE / "kernels").glob("*.cu")):
            self.copy_file(str(cu), str(dst / cu.name))


setup(cmdclass={"build_py": BuildPyWithKernels})
