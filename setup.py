"""Builds the extension posenc._posenc with this repository's CMake project (see pyproject.toml).

The CMake build directory is build-python/ at the repository root (kept between installs, so a
reinstall recompiles only what changed; ccache is used when installed), or the one named by
POSENC_CMAKE_BUILD_DIR, e.g. an existing build of the library, whose objects are then reused
(scripts/setup.sh and scripts/test.sh do that). Extra CMake arguments: POSENC_CMAKE_ARGS.
"""

import glob
import os
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
os.makedirs(os.path.join(ROOT, "build-python"), exist_ok=True)  # egg_base below


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = os.path.abspath(
            os.environ.get("POSENC_CMAKE_BUILD_DIR", os.path.join(ROOT, "build-python")))
        configure = ["cmake", "-S", ROOT, "-B", build_dir, "-DPOSENC_BUILD_PYTHON=ON"]
        if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            if shutil.which("ninja"):
                configure += ["-G", "Ninja"]
            configure += ["-DCMAKE_BUILD_TYPE=Release", "-DPOSENC_BUILD_TESTS=OFF",
                          # The interpreter the package is installed for (a venv's python is
                          # the system's with its site-packages).
                          f"-DPython_EXECUTABLE={sys.executable}"]
        configure += shlex.split(os.environ.get("POSENC_CMAKE_ARGS", ""))
        subprocess.check_call(configure)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        # The extension, and the CLI for posenc.demo() (shipped as posenc/bin/posenc).
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "posenc_python",
                               "posenc_cli", "-j", jobs])
        built = glob.glob(os.path.join(build_dir, "python", "_posenc*.so"))
        if len(built) != 1:
            raise RuntimeError(f"posenc: expected one _posenc*.so in {build_dir}/python, "
                               f"found {built}")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(built[0], target)
        cli = os.path.join(build_dir, "cli", "posenc")
        os.makedirs(os.path.join(os.path.dirname(target), "bin"), exist_ok=True)
        shutil.copy2(cli, os.path.join(os.path.dirname(target), "bin", "posenc"))


setup(
    ext_modules=[Extension("posenc._posenc", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    # Keep setuptools' own build files out of CMake's build/ directory.
    options={"build": {"build_base": os.path.join("build-python", "setuptools")},
             "egg_info": {"egg_base": "build-python"}},
)
