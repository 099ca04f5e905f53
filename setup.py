"""setuptools hook: building the wheel compiles the prebuilt kernels where nvcc is found.

Everything else is in pyproject.toml. ``python echonccl/build.py`` runs by path (it needs no numpy
or cupy); without nvcc it says so and the wheel carries no kernels (they compile on demand at run
time). Editable installs skip it: a checkout builds them with ``make kernels``.
"""
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithKernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        out = Path(self.build_lib) / "echonccl" / "prebuilt"
        here = Path(__file__).resolve().parent
        subprocess.run([sys.executable, str(here / "echonccl" / "build.py"), "--if-nvcc", "--out", str(out)],
                       check=True)


setup(cmdclass={"build_py": BuildWithKernels})
