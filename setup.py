"""Builds hotloop._C from csrc/*.c with the C compiler alone, into one abi3 extension.

No CUDA toolkit is needed: the driver (libcuda), NVRTC, NVML and nvjpeg are opened at run time, and
kernels/*.cu ship as package data that NVRTC compiles for the GPU at hand on first use.

Environment:
  HOTLOOP_CUDA=0              a build that never touches a GPU (no driver calls, no kernels)
  HOTLOOP_SANITIZE=address,undefined
                              the C part built with these sanitizers (for CI)
  HOTLOOP_WERROR=1            C warnings are errors
  HOTLOOP_MANYLINUX=2.28      _C built by zig cc against glibc 2.28's symbols, the wheel tagged
                              manylinux_2_28_<arch>: the release build (NOTE [ One wheel for every Linux ])
  HOTLOOP_ARCH=aarch64        with HOTLOOP_MANYLINUX, the machine to build for (default: this one's)
"""
import glob
import os
import platform
import re
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
LIMITED_API = 0x030A0000  # Python 3.10: one built _C loads on 3.10 and every later CPython
ZIG = "ziglang==0.17.1"  # the release build's compiler, pinned: a wheel rebuilt later links the same way
ARCHES = ("x86_64", "aarch64")  # the machines torch ships Linux wheels for

# NOTE [ One wheel for every Linux ]
# _C links libc alone (libcuda, NVRTC, NVML and nvjpeg are opened by dlopen), so its only tie to the
# machine that built it is the newest glibc symbol version it asks for. A system compiler binds to the
# build machine's glibc (dlopen@GLIBC_2.34 on a 2.34+ system), and that wheel then refuses to load where
# glibc is older. zig cc links against stub libraries of any glibc version it is told, on any host and
# for x86_64 or aarch64 alike, with no sysroot, container or root: built with -target <arch>-linux-gnu.2.28
# (torch's own floor), _C asks for nothing newer than GLIBC_2.28 and its wheel is tagged
# manylinux_2_28_<arch>. It comes from PyPI as a wheel (`ziglang`); `pip wheel` and `python -m build`
# install it into their isolated build environment from setup_requires below. An aarch64 build on an
# x86_64 machine compiles against this interpreter's headers, which is sound because under the limited
# API they declare the same things on both 64-bit Linux ABIs.


def read_version():
    text = open(os.path.join(ROOT, "python", "hotloop", "_version.py")).read()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def with_cuda():
    return os.environ.get("HOTLOOP_CUDA", "1").strip().lower() not in ("0", "no", "off", "false")


def manylinux():
    """(glibc version, arch) of a release build through zig cc, or None for the system compiler."""
    glibc = os.environ.get("HOTLOOP_MANYLINUX", "").strip()
    if not glibc:
        return None
    if not re.fullmatch(r"2\.\d+", glibc):
        raise SystemExit(f"HOTLOOP_MANYLINUX: expected a glibc version such as 2.28, got {glibc!r}")
    arch = os.environ.get("HOTLOOP_ARCH", "").strip() or platform.machine()
    if arch not in ARCHES:
        raise SystemExit(f"HOTLOOP_ARCH: expected one of {', '.join(ARCHES)}, got {arch!r}")
    return glibc, arch


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

    def build_extensions(self):
        target = manylinux()
        if target is not None:
            # the whole command line is zig's: the interpreter's own CFLAGS and LDSHARED would add an
            # rpath into its install folder, which a wheel must not carry
            glibc, arch = target
            zig = [sys.executable, "-m", "ziglang", "cc", "-target", f"{arch}-linux-gnu.{glibc}"]
            # Python.h sets _POSIX_C_SOURCE/_XOPEN_SOURCE to its own values after zig's newer glibc
            # headers set theirs: the same feature set either way, so the warning is noise
            # -s: no debug sections in the release wheel's _C
            self.compiler.set_executables(compiler=zig, compiler_so=zig + ["-fPIC", "-Wno-macro-redefined"],
                                          linker_so=zig + ["-shared", "-s"])
        super().build_extensions()


def make_extension():
    sanitize = sanitizers()
    if sanitize and manylinux():
        raise SystemExit("HOTLOOP_SANITIZE and HOTLOOP_MANYLINUX: a sanitizer build is for tests, not for release")
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
    ext.build_options = (macros, compile_args, link_args, manylinux())
    return ext


def wheel_options():
    options = {"py_limited_api": "cp310"}
    target = manylinux()
    if target is not None:
        glibc, arch = target
        options["plat_name"] = f"manylinux_{glibc.replace('.', '_')}_{arch}"
    return options


setup(
    ext_modules=[make_extension()],
    cmdclass={"build_ext": BuildExt},
    options={"bdist_wheel": wheel_options()},
    setup_requires=[ZIG] if manylinux() else [],
)
