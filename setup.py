"""Builds hotloop._C from csrc/*.c with the C compiler alone, into one abi3 extension.

No CUDA toolkit is needed: the driver (libcuda), NVRTC, NVML and nvjpeg are opened at run time, and
kernels/*.cu ship as package data that NVRTC compiles for the GPU at hand on first use.

Environment:
  HOTLOOP_CUDA=0              a build that never touches a GPU (no driver calls, no kernels)
  HOTLOOP_SANITIZE=address,undefined
                              the C part built with these sanitizers (for CI)
  HOTLOOP_WERROR=1            C warnings are errors
"""
import glob
import os
import re

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
LIMITED_API = 0x030A0000  # Python 3.10: one built _C loads on 3.10 and every later CPython


def read_version():
    text = open(os.path.join(ROOT, "python", "hotloop", "_version.py")).read()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def with_cuda():
    return os.environ.get("HOTLOOP_CUDA", "1").strip().lower() not in ("0", "no", "off", "false")


def sanitizers():
    text = os.environ.get("HOTLOOP_SANITIZE", "").strip()
    return [s.strip() for s in text.split(",") if s.strip()]


class BuildExt(build_ext):
    """Rebuilds every object when the options changed (CPU-only, sanitizers), not only the stale ones."""

    def build_extension(self, ext):
        stamp = os.path.join(self.build_temp, "hotloop-build-options.txt")
        options = repr(ext.build_options)
        if not os.path.exists(stamp) or open(stamp).read() != options:
            self.force = True
            os.makedirs(self.build_temp, exist_ok=True)
            with open(stamp, "w") as f:
                f.write(options)
        super().build_extension(ext)


def make_extension():
    sanitize = sanitizers()
    macros = [
        ("Py_LIMITED_API", hex(LIMITED_API)),
        ("HOTLOOP_VERSION", f'"{read_version()}"'),
        ("HOTLOOP_SANITIZERS", f'"{",".join(sanitize)}"'),
        ("_GNU_SOURCE", None),
    ]
    if with_cuda():
        macros.append(("HOTLOOP_WITH_CUDA", "1"))
    compile_args = ["-std=c11", "-O3", "-Wall", "-Wextra", "-fvisibility=hidden",
                    "-Werror=implicit-function-declaration"]  # outside the limited API: must not link
    link_args = []
    if os.environ.get("HOTLOOP_WERROR", "") == "1":
        compile_args.append("-Werror")
    if sanitize:
        flag = "-fsanitize=" + ",".join(sanitize)
        compile_args += [flag, "-fno-omit-frame-pointer", "-fno-sanitize-recover=all", "-O1", "-g"]
        link_args += [flag]
    ext = Extension(
        "hotloop._C",
        sources=sorted(glob.glob("csrc/*.c")),
        include_dirs=["csrc", "kernels"],
        define_macros=macros,
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        libraries=["pthread", "dl"],
        py_limited_api=True,
        depends=sorted(glob.glob("csrc/*.h") + glob.glob("kernels/*.h")),
    )
    ext.build_options = (macros, compile_args, link_args)
    return ext


setup(
    ext_modules=[make_extension()],
    cmdclass={"build_ext": BuildExt},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
