"""`python -m hotloop compile`: fills the cache, says what it did, and refuses a bad --arch."""
import os
import subprocess
import sys

import pytest

from hotloop import _C, cli
from hotloop.rtc import kernel_sources, nvrtc_finder


def run_compile(*args, env=None):
    return subprocess.run([sys.executable, "-m", "hotloop", "compile", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_compile_fills_the_cache_then_finds_it_there(tmp_path):
    env = {"HOTLOOP_CACHE_DIR": str(tmp_path / "cache")}
    first = run_compile("--arch", "80", env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    sources = kernel_sources.source_names()
    rows = [line.split() for line in first.stdout.splitlines() if line.split()[:1] and line.split()[0] in sources]
    assert sorted(r[0] for r in rows) == sorted(sources)
    assert all(r[1:5] == ["sm_80", "sm_80", "cubin", "compiled"] and float(r[5]) >= 0 for r in rows)
    assert f"cache: {tmp_path / 'cache' / 'kernels'}" in first.stdout
    assert len(list((tmp_path / "cache" / "kernels").glob("*.sm_80.*.cubin"))) == len(sources)
    second = run_compile("--arch", "8.0", env=env)
    assert second.returncode == 0 and second.stdout.count(" cached ") == len(sources)


@pytest.fixture
def tiny_sources(monkeypatch, tiny_kernels, cache_dir):
    monkeypatch.setattr(kernel_sources, "kernels_dir", lambda: tiny_kernels)
    monkeypatch.setattr(kernel_sources, "source_names", lambda: ("tiny",))


def test_compile_with_a_chosen_nvrtc_and_ptx(tiny_sources, nvrtc, capsys, cache_dir):
    assert cli.main(["compile", "--arch", "80,sm_90", "--ptx", "--nvrtc", nvrtc.path]) == 0
    out = capsys.readouterr().out
    assert f"NVRTC {nvrtc.version[0]}.{nvrtc.version[1]} ({nvrtc.path})" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("tiny")]
    assert [r[1:5] for r in rows] == [["sm_80", "compute_80", "PTX", "compiled"], ["sm_90", "compute_90", "PTX", "compiled"]]
    assert len(list((cache_dir / "kernels").glob("tiny.compute_*.ptx"))) == 2


def test_compile_defaults_to_the_gpus_here(tiny_sources, nvrtc, capsys, monkeypatch):
    monkeypatch.setattr(nvrtc_finder, "find_nvrtc", lambda driver_version=None: nvrtc)
    monkeypatch.setattr(_C, "cuda_device_capability", lambda device: [(8, 9), (8, 9), (12, 0)][device], raising=False)
    monkeypatch.setattr(_C, "cuda_device_count", lambda: 3)
    assert cli.main(["compile"]) == 0
    rows = [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("tiny")]
    assert rows == ["sm_89", "sm_120"]


def test_a_compile_error_fails_the_command_with_the_log(tiny_sources, tiny_kernels, nvrtc, capsys):
    (tiny_kernels / "tiny.cu").write_text('extern "C" __global__ void k() { not_declared(); }\n')
    assert cli.main(["compile", "--arch", "80", "--nvrtc", nvrtc.path]) == 1
    captured = capsys.readouterr()
    assert "FAILED" in captured.out and 'identifier "not_declared" is undefined' in captured.err


def test_a_bad_arch_is_refused(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["compile", "--arch", "foo"])
    assert exited.value.code == 2
    assert "expected compute capabilities such as 80,90 or 8.6, got 'foo'" in capsys.readouterr().err


def test_an_unusable_nvrtc_fails_the_command(tmp_path, capsys):
    assert cli.main(["compile", "--nvrtc", str(tmp_path / "libnvrtc.so.12")]) == 1
    assert f"NVRTC {tmp_path / 'libnvrtc.so.12'} cannot be used" in capsys.readouterr().err
