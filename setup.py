"""Builds hotloop._C: csrc/*.c with the C compiler and kernels/*.cu with nvcc, into one abi3 extension.

Environment:
  HOTLOOP_CUDA=0              CPU-only build (also the result when no nvcc is found); =1 requires nvcc
  HOTLOOP_CUDA_ARCHS=90       compute capabilities to build for, separated by commas or semicolons;
                              default: every one CUDA 13 supports from sm_75 up, plus PTX of the newest
  HOTLOOP_SANITIZE=address,undefined
                              the C part built with these sanitizers (for CI)
  HOTLOOP_WERROR=1            C warnings are errors
  CUDA_HOME / CUDA_PATH       where the CUDA toolkit lives (else nvcc on PATH, else /usr/local/cuda)
"""
import glob
import os
import re
import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
LIMITED_API = 0x030A0000  # Python 3.10: one built _C loads on 3.10 and every later CPython
DEFAULT_ARCHS = ["75", "80", "86", "87", "88", "89", "90", "100", "103", "110", "120", "121"]


def read_version():
    text = open(os.path.join(ROOT, "python", "hotloop", "_version.py")).read()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def find_cuda_home():
    """The toolkit folder holding both bin/nvcc and the runtime headers, or None."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:  # may be a wrapper script outside the toolkit, so this is one candidate among others
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for home in candidates:
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")) and \
                os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h")):
            return home
    return None


def cuda_home_for_build():
    wanted = os.environ.get("HOTLOOP_CUDA", "auto").strip().lower()
    if wanted in ("0", "no", "off", "false"):
        return None
    home = find_cuda_home()
    if home is None and wanted in ("1", "yes", "on", "true"):
        raise RuntimeError("HOTLOOP_CUDA=1 but no nvcc was found (set CUDA_HOME)")
    return home


def cuda_archs():
    text = os.environ.get("HOTLOOP_CUDA_ARCHS", "").strip()
    if not text:
        return DEFAULT_ARCHS
    archs = [a.strip().replace(".", "") for a in re.split(r"[,;\s]+", text) if a.strip()]
    for arch in archs:
        if not arch.isdigit():
            raise ValueError(f"HOTLOOP_CUDA_ARCHS: expected numbers such as 90 or 8.6, got {arch!r}")
    return archs


def sanitizers():
    text = os.environ.get("HOTLOOP_SANITIZE", "").strip()
    return [s.strip() for s in text.split(",") if s.strip()]


class BuildWithNvcc(build_ext):
    """Compiles the .cu files with nvcc first and hands their objects to the C link."""

    def build_extension(self, ext):
        # objects built under other options (archs, sanitizers, CPU-only) must not be reused
        stamp = os.path.join(self.build_temp, "hotloop-build-options.txt")
        options = repr(ext.build_options)
        if not os.path.exists(stamp) or open(stamp).read() != options:
            self.force = True
            os.makedirs(self.build_temp, exist_ok=True)
            with open(stamp, "w") as f:
                f.write(options)
        cuda_home = getattr(ext, "cuda_home", None)
        if cuda_home:
            ext.extra_objects = list(ext.extra_objects) + self.compile_cuda(ext, cuda_home)
        super().build_extension(ext)

    def compile_cuda(self, ext, cuda_home):
        nvcc = os.path.join(cuda_home, "bin", "nvcc")
        archs = ext.cuda_archs
        gencode = []
        for arch in archs:
            gencode += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        newest = max(archs, key=int)
        gencode += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
        out_dir = os.path.join(self.build_temp, "kernels")
        os.makedirs(out_dir, exist_ok=True)
        objects = []
        for source in ext.cuda_sources:
            obj = os.path.join(out_dir, os.path.basename(source) + ".o")
            cmd = [nvcc, "-c", source, "-o", obj, "-O3", "-std=c++17", "-Xcompiler", "-fPIC",
                   "-Xcompiler", "-fvisibility=hidden", "--threads", str(os.cpu_count() or 1),
                   "-I", os.path.join(ROOT, "kernels"), *gencode]
            if not self.force and os.path.exists(obj) and newer_than_all(obj, source, ext.cuda_headers):
                objects.append(obj)
                continue
            print(" ".join(cmd), flush=True)
            subprocess.check_call(cmd)
            objects.append(obj)
        return objects


def newer_than_all(target, source, headers):
    built = os.path.getmtime(target)
    return all(os.path.getmtime(p) < built for p in [source, *headers])


def make_extension():
    version = read_version()
    cuda_home = cuda_home_for_build()
    sanitize = sanitizers()
    c_sources = sorted(glob.glob("csrc/*.c"))
    cuda_sources = sorted(glob.glob("kernels/*.cu")) if cuda_home else []
    archs = cuda_archs() if cuda_home else []

    macros = [
        ("Py_LIMITED_API", hex(LIMITED_API)),
        ("HOTLOOP_VERSION", f'"{version}"'),
        ("HOTLOOP_CUDA_ARCHS", f'"{",".join(archs)}"'),
        ("HOTLOOP_SANITIZERS", f'"{",".join(sanitize)}"'),
        ("_GNU_SOURCE", None),
    ]
    compile_args = ["-std=c11", "-O3", "-Wall", "-Wextra", "-fvisibility=hidden",
                    "-Werror=implicit-function-declaration"]  # outside the limited API: must not link
    link_args = []
    libraries = []
    include_dirs = ["csrc", "kernels"]
    library_dirs = []
    if os.environ.get("HOTLOOP_WERROR", "") == "1":
        compile_args.append("-Werror")
    if sanitize:
        flag = "-fsanitize=" + ",".join(sanitize)
        compile_args += [flag, "-fno-omit-frame-pointer", "-fno-sanitize-recover=all", "-O1", "-g"]
        link_args += [flag]
    if cuda_home:
        macros.append(("HOTLOOP_WITH_CUDA", "1"))
        include_dirs.append(os.path.join(cuda_home, "include"))
        lib_dir = os.path.join(cuda_home, "lib64")
        if not os.path.isdir(lib_dir):
            lib_dir = os.path.join(cuda_home, "lib")
        library_dirs.append(lib_dir)
        # the CUDA runtime linked statically: no libcudart.so needed at run time, and no clash with
        # the one torch ships; the driver (libcuda.so) is found by the runtime itself, via dlopen.
        libraries += ["cudart_static", "rt", "pthread", "dl", "stdc++"]
    else:
        libraries += ["pthread", "dl"]

    ext = Extension(
        "hotloop._C",
        sources=c_sources,
        include_dirs=include_dirs,
        define_macros=macros,
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        libraries=libraries,
        library_dirs=library_dirs,
        py_limited_api=True,
        depends=sorted(glob.glob("csrc/*.h") + glob.glob("kernels/*.h")),
    )
    ext.cuda_home = cuda_home
    ext.cuda_sources = cuda_sources
    ext.cuda_headers = sorted(glob.glob("kernels/*.h") + glob.glob("kernels/*.cuh"))
    ext.cuda_archs = archs
    ext.build_options = (cuda_home, archs, sanitize, compile_args, link_args)
    return ext


setup(
    ext_modules=[make_extension()],
    cmdclass={"build_ext": BuildWithNvcc},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
