"""Builds kvtier's Python package with what pyproject.toml cannot say:
  - the gRPC stubs (kvtier.v1), generated from ../proto by grpcio-tools when
    the build environment has it, else by protoc and grpc_python_plugin
    (Debian's protobuf-compiler-grpc); stubs from protoc 3.21 load on
    protobuf runtimes from 3.21 to at least 7.36;
  - the version, from the project's CMakeLists.txt;
  - the in-process worker (kvtier._inproc), optional: copied from a C++ build
    when KVTIER_BUILD_DIR names one that has it (built for that build's
    Python); `import kvtier` never needs it.
"""

import os
import re
import shutil
import subprocess
import sys
import glob

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROTOS = ["tensor", "store", "worker", "controller"]


def project_version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        m = re.search(r"project\(kvtier VERSION ([0-9.]+)", f.read())
    if m is None:
        raise RuntimeError("no project(kvtier VERSION ...) in CMakeLists.txt")
    return m.group(1)


def generate_stubs(out):
    os.makedirs(os.path.join(out, "kvtier", "v1"), exist_ok=True)
    open(os.path.join(out, "kvtier", "v1", "__init__.py"), "w").close()
    protos = [os.path.join(ROOT, "proto", "kvtier", "v1", f"{p}.proto") for p in PROTOS]
    try:
        import grpc_tools  # noqa: F401
        cmd = [sys.executable, "-m", "grpc_tools.protoc"]
    except ImportError:
        protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
        if not protoc or not plugin:
            raise RuntimeError("kvtier's stubs need grpcio-tools, or protoc and "
                               "grpc_python_plugin (Debian: protobuf-compiler, "
                               "protobuf-compiler-grpc)")
        cmd = [protoc, f"--plugin=protoc-gen-grpc_python={plugin}"]
    subprocess.check_call(cmd + [f"--proto_path={os.path.join(ROOT, 'proto')}",
                                 f"--python_out={out}", f"--grpc_python_out={out}", *protos])


class BuildPy(build_py):
    def run(self):
        super().run()
        pkg = os.path.join(self.build_lib, "kvtier")
        generate_stubs(self.build_lib)
        with open(os.path.join(pkg, "_version.py"), "w") as f:
            f.write('"""kvtier\'s version, from the project\'s CMakeLists.txt."""\n\n'
                    f'__version__ = "{project_version()}"\n')
        build = os.environ.get("KVTIER_BUILD_DIR")
        if build:
            for so in glob.glob(os.path.join(build, "python", "kvtier", "_inproc*.so")):
                shutil.copy2(so, pkg)


setup(version=project_version(), cmdclass={"build_py": BuildPy})
