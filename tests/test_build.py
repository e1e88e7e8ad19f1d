"""The built extension: build_info, importing without a GPU, error types, and one _C for every Python >= 3.10."""
import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

import hotloop


def test_build_info_fields():
    info = hotloop.build_info()
    assert info["version"] == hotloop.__version__
    assert info["abi3"] is True
    assert isinstance(info["sanitizers"], list)
    # no architectures are chosen at build time any more: NVRTC compiles for the GPU at hand
    assert info["cuda"] in (None, "driver+nvrtc")
    assert set(info) == {"version", "cuda", "abi3", "sanitizers"}
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


MODULE_FACTS_SCRIPT = textwrap.dedent("""
    import importlib.util, json, sys
    spec = importlib.util.spec_from_file_location("hotloop._C", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    info = module.build_info()
    info.pop("sanitizers")
    print(json.dumps({"names": sorted(n for n in dir(module) if not n.startswith("__")), "info": info,
                      "kernels": [list(k) for k in module.KERNEL_NAMES]}))
""")


def module_facts(path):
    """What a built _C offers (its names, build_info less the sanitizers, its kernel table)."""
    # the environment as it is: under CI's sanitizer step the installed _C needs its preloaded runtime
    out = subprocess.run([sys.executable, "-c", MODULE_FACTS_SCRIPT, path], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_install_needs_a_c_compiler_only_and_compiles_once(tmp_path):
    """A build with no nvcc on PATH and no CUDA_HOME is the whole extension: the same names, build
    facts and kernel table as the installed one, the kernels' sources in the wheel as data. The
    README's two commands build once: a second build reuses the first's objects (build/ in the
    source tree, which pip builds in)."""
    pytest.importorskip("setuptools")  # --no-build-isolation: nothing is downloaded
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name)
        if os.path.isdir(here):
            shutil.copytree(here, src / name, ignore=shutil.ignore_patterns("*.so", "*.egg-info", "__pycache__"))
        else:
            shutil.copy(here, src / name)
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "HOTLOOP_SANITIZE", "HOTLOOP_WERROR", "HOTLOOP_CUDA", "CUDA_HOME", "CUDA_PATH")}
    # PATH without any folder that holds nvcc
    env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                  if d and not os.path.exists(os.path.join(d, "nvcc")))
    built = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                              "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, env=env,
                             timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "nvcc" not in out.stdout + out.stderr
        objects = glob.glob(os.path.join(src, "build", "temp.*", "csrc", "*.o"))
        built.append({path: os.stat(path).st_mtime_ns for path in objects})
    assert len(built[0]) == len(glob.glob(os.path.join(src, "csrc", "*.c")))
    assert built[1] == built[0], "the second build compiled again"
    (wheel,) = glob.glob(str(tmp_path / "dist" / "*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (so,) = [n for n in names if n.startswith("hotloop/_C.") and n.endswith(".so")]
        z.extract(so, tmp_path / "unpacked")
    shipped = {os.path.basename(n) for n in names if n.startswith("hotloop/kernels/")}
    assert shipped == {os.path.basename(p) for p in glob.glob(os.path.join(src, "kernels", "*"))}
    assert module_facts(str(tmp_path / "unpacked" / so)) == module_facts(hotloop._C.__file__)
