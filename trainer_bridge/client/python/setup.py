"""Packs the C client library into the package at build time.

A wheel or a plain `pip install` copies the package out of the tree, where
it could not find the library of the build folder; so the build step copies
libfp4rollout_client.so (from $FP4ROLLOUT_CLIENT_LIB, else the tree's
build folder: build/, or $BUILD) into the package beside _native.py, where
the package looks first. An editable install (`pip install -e`) finds the
tree's build folder at run time instead. Build the library first:
`make build/libfp4rollout_client.so`.
"""
import glob
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
LIB = "libfp4rollout_client.so"


def built_library():
    env = os.environ.get("FP4ROLLOUT_CLIENT_LIB")
    if env:
        return env
    build = os.environ.get("BUILD", "build")
    candidates = [os.path.join(build if os.path.isabs(build) else os.path.join(REPO, build), LIB)]
    candidates += sorted(glob.glob(os.path.join(REPO, "build", "*", LIB)))
    for path in candidates:
        if os.path.exists(path):
            return path
    raise SystemExit(f"fp4rollout-client: {LIB} is not built; run `make build/{LIB}` in {REPO} first")


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:
            dest = os.path.join(self.build_lib, "fp4rollout_client", LIB)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(built_library(), dest)


setup(cmdclass={"build_py": BuildWithLibrary})
