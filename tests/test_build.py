"""The built extension: build_info, importing without a GPU, error types, and one _C for every Python >= 3.10."""
import glob
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import hotloop


def test_build_info_fields():
    info = hotloop.build_info()
    assert info["version"] == hotloop.__version__
    assert info["abi3"] is True
    assert isinstance(info["sanitizers"], list)
    if info["cuda"] is None:
        assert info["cuda_archs"] == [] and info["ptx_arch"] is None
    else:
        major, minor = (int(x) for x in info["cuda"].split("."))
        assert major >= 12 and minor >= 0
        assert info["cuda_archs"] and all(a >= 75 for a in info["cuda_archs"])
        assert info["ptx_arch"] == max(info["cuda_archs"])
    assert hotloop._C.__file__.endswith(".abi3.so")


def test_exceptions_are_runtime_errors():
    assert issubclass(hotloop.CudaError, RuntimeError)
    assert issubclass(hotloop.NvmlError, RuntimeError)
    assert issubclass(hotloop.NvjpegError, RuntimeError)
    assert len({hotloop.CudaError, hotloop.NvmlError, hotloop.NvjpegError}) == 3
    # where their names say they are: `except hotloop.NvjpegError` is what a message leads a user to write
    for error in (hotloop.CudaError, hotloop.NvmlError, hotloop.NvjpegError):
        assert f"{error.__module__}.{error.__name__}" == f"hotloop.{error.__name__}"
        assert error.__name__ in hotloop.__all__
    assert "file" in hotloop.CudaError.__doc__


HIDDEN_GPU_SCRIPT = textwrap.dedent("""
    import sys
    import hotloop
    assert "torch" not in sys.modules, "import hotloop must not import torch"
    assert hotloop.cuda_available() is False
    reason = hotloop._C.cuda_unavailable_reason()
    assert reason, reason
    import torch
    from hotloop.amp import tensor_table
    packed = tensor_table.pack([torch.ones(4)])
    # the same table, claiming to live on cuda:0: a GPU-only call must refuse clearly
    import struct
    fields = list(struct.unpack("4q", packed)); fields[3] = 0
    try:
        hotloop._C.non_finite_check(struct.pack("4q", *fields), None, None, 0)
    except RuntimeError as err:
        print("REFUSED:", err)
    else:
        raise SystemExit("a GPU-only call ran without a GPU")
""")


def test_import_and_refusal_without_a_gpu():
    # CUDA_VISIBLE_DEVICES="" hides every GPU, so this holds on the GPU machine too
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", HIDDEN_GPU_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "REFUSED:" in out.stdout
    assert ("built without CUDA" in out.stdout) or ("no CUDA driver found" in out.stdout)


ABI3_SCRIPT = textwrap.dedent("""
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("hotloop._C", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    info = module.build_info()
    assert info["abi3"] is True
    print(sys.version_info[:2], info["version"])
""")


def other_pythons():
    """(minor, path) of each CPython 3.10+ on this machine that runs, pyenv's versions included."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = []
    for minor in (10, 11, 12, 13, 14):
        candidates = sorted(glob.glob(os.path.join(root, "versions", f"3.{minor}.*", "bin", f"python3.{minor}")))
        candidates += [p for p in [shutil.which(f"python3.{minor}")] if p]
        for exe in candidates:
            if subprocess.run([exe, "-c", "pass"], capture_output=True).returncode == 0:
                found.append((minor, exe))
                break
    return found


@pytest.mark.parametrize("minor,exe", other_pythons() or [pytest.param(0, "", marks=pytest.mark.skip(
    reason="no python3.1x interpreters on PATH"))])
def test_one_built_module_loads_on_every_python(minor, exe):
    # the very file this interpreter imported, loaded by another CPython: the stable ABI at work
    out = subprocess.run([exe, "-c", ABI3_SCRIPT, hotloop._C.__file__], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"(3, {minor})" in out.stdout


SOURCES = ["setup.py", "pyproject.toml", "README.md", "csrc", "kernels", "python"]


def test_a_second_install_compiles_nothing(tmp_path):
    """The README's two commands build once: the second reuses the first's objects (build/ in the
    source tree, which pip builds in). A CPU-only build stands for both: the .cu objects are reused by
    the same test (setup.py's newer_than_all) as the C ones are by setuptools."""
    pytest.importorskip("setuptools")  # --no-build-isolation: nothing is downloaded
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name)
        if os.path.isdir(here):
            shutil.copytree(here, src / name, ignore=shutil.ignore_patterns("*.so", "*.egg-info", "__pycache__"))
        else:
            shutil.copy(here, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "HOTLOOP_SANITIZE", "HOTLOOP_WERROR")}
    env["HOTLOOP_CUDA"] = "0"
    built = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                              "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, env=env,
                             timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        objects = glob.glob(os.path.join(src, "build", "temp.*", "csrc", "*.o"))
        built.append({path: os.stat(path).st_mtime_ns for path in objects})
    assert len(built[0]) == len(glob.glob(os.path.join(src, "csrc", "*.c")))
    assert built[1] == built[0], "the second build compiled again"
