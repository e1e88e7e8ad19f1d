"""Where hotloop looks for NVRTC and in which order: HOTLOOP_NVRTC alone when set, then the pip wheels with
the driver's CUDA major first and newer majors left out, then a CUDA toolkit; the errors when none is
usable. Fake library files in temporary folders stand in for real installs."""
import pytest

from hotloop.rtc import library_search, nvrtc_finder

CU13, CU12, CU11 = (relative for relative, _ in nvrtc_finder.WHEEL_LIBRARIES)


def touch(path, text="not a library"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """Two site-packages folders (the CUDA 13 and 11 wheels in one, the 12 wheel in the other) and a CUDA
    12.4 toolkit under CUDA_HOME; nothing else on sys.path, no HOTLOOP_NVRTC."""
    sites = [tmp_path / "site-a", tmp_path / "site-b"]
    wheels = {13: touch(sites[0] / CU13), 11: touch(sites[0] / CU11), 12: touch(sites[1] / CU12)}
    lib64 = tmp_path / "cuda-12.4" / "lib64"
    real = touch(lib64 / "libnvrtc.so.12.4.127")
    for alias in ("libnvrtc.so.12", "libnvrtc.so"):
        (lib64 / alias).symlink_to(real.name)
    touch(lib64 / "libnvrtc-builtins.so.12.4")  # not NVRTC itself
    monkeypatch.setattr(library_search, "site_packages_dirs", lambda: [str(s) for s in sites])
    monkeypatch.setattr(library_search, "environment_lib_dir", lambda: None)
    monkeypatch.setattr(library_search, "toolkit_lib_dirs", lambda: [str(lib64), str(tmp_path / "no-toolkit")])
    monkeypatch.delenv("HOTLOOP_NVRTC", raising=False)
    return {"sites": sites, "wheels": wheels, "toolkit": lib64 / "libnvrtc.so"}


def paths(candidates, tried=True):
    return [c.path for c in candidates if (c.skipped is None) == tried]


def test_without_a_driver_the_newest_wheel_comes_first_then_the_toolkit(machine):
    w = machine["wheels"]
    assert paths(nvrtc_finder.nvrtc_candidates(driver_version=None)) == [
        str(w[13]), str(w[12]), str(w[11]), str(machine["toolkit"])]


@pytest.mark.parametrize("driver,tried,skipped", [
    (13000, [13, 12, 11], []),
    (12080, [12, 11], [13]),
    (11080, [11], [13, 12]),
])
def test_the_drivers_major_comes_first_and_newer_ones_are_left_out(machine, driver, tried, skipped):
    w = machine["wheels"]
    toolkit = [str(machine["toolkit"])] if driver >= 12000 else []
    candidates = nvrtc_finder.nvrtc_candidates(driver_version=driver)
    assert paths(candidates) == [str(w[m]) for m in tried] + toolkit
    assert paths(candidates, tried=False) == [str(w[m]) for m in skipped] + ([] if toolkit else [str(machine["toolkit"])])
    for c in candidates:
        if c.skipped:
            assert f"NVRTC {c.major} is newer than the driver's CUDA {driver // 1000}.{driver % 1000 // 10}" == c.skipped


def test_the_toolkit_counts_once_under_its_shortest_name(machine):
    toolkit = [c for c in nvrtc_finder.nvrtc_candidates(driver_version=None) if c.origin == "CUDA toolkit"]
    assert [(c.path, c.major) for c in toolkit] == [(str(machine["toolkit"]), 12)]


def test_hotloop_nvrtc_is_the_only_candidate_when_set(machine, monkeypatch, tmp_path):
    chosen = touch(tmp_path / "mine" / "libnvrtc.so.12")
    monkeypatch.setenv("HOTLOOP_NVRTC", str(chosen))
    assert [(c.path, c.origin) for c in nvrtc_finder.nvrtc_candidates(driver_version=12000)] == [
        (str(chosen), "HOTLOOP_NVRTC")]


def test_hotloop_nvrtc_that_is_not_a_library_is_an_error_naming_it(monkeypatch, tmp_path, nvrtc_wheels):
    # in the real environment, where the wheels would do: the user's choice has no fallback
    chosen = touch(tmp_path / "mine" / "libnvrtc.so.12", "#!/bin/sh\n" * 200)
    monkeypatch.setenv("HOTLOOP_NVRTC", str(chosen))
    with pytest.raises(RuntimeError, match=f"HOTLOOP_NVRTC={chosen} is not a usable NVRTC library") as caught:
        nvrtc_finder.find_nvrtc(driver_version=None)
    assert "invalid ELF header" in str(caught.value)


def test_none_usable_names_every_place_looked_and_how_to_install(machine):
    with pytest.raises(RuntimeError) as caught:
        nvrtc_finder.find_nvrtc(driver_version=12080)
    message = str(caught.value)
    assert "no usable NVRTC" in message
    for site in machine["sites"]:
        for relative in (CU13, CU12, CU11):
            assert str(site / relative) in message
    assert str(machine["toolkit"].parent / "libnvrtc.so*") in message and "HOTLOOP_NVRTC (unset)" in message
    assert f"{machine['wheels'][12]} (pip nvidia-cuda-nvrtc-cu12): NVRTC {machine['wheels'][12]} cannot be used" in message
    assert f"{machine['wheels'][13]} (pip nvidia-cuda-nvrtc): NVRTC 13 is newer than the driver's CUDA 12.8" in message
    assert "pip install nvidia-cuda-nvrtc-cu12" in message and "pip install nvidia-cuda-nvrtc`" in message


def test_nothing_installed_says_how_to_install(machine, monkeypatch, tmp_path):
    monkeypatch.setattr(library_search, "site_packages_dirs", lambda: [])
    monkeypatch.setattr(library_search, "toolkit_lib_dirs", lambda: [])
    with pytest.raises(RuntimeError, match="pip install nvidia-cuda-nvrtc-cu12.*pip install nvidia-cuda-nvrtc`"):
        nvrtc_finder.find_nvrtc(driver_version=None)


def test_the_real_wheels_open_and_the_first_is_kept_for_the_process(nvrtc_wheels):
    if not nvrtc_wheels:
        pytest.skip("no NVRTC wheel in site-packages (pip install nvidia-cuda-nvrtc-cu12)")
    found = nvrtc_finder.find_nvrtc(driver_version=None)
    assert found.version[0] == max(nvrtc_wheels)  # no driver: the newest
    assert nvrtc_finder.find_nvrtc(driver_version=None) is found
    if 12 in nvrtc_wheels:
        assert nvrtc_finder.find_nvrtc(driver_version=12040).version[0] == 12


def test_toolkit_folders_from_the_environment_come_first(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "path"))
    dirs = library_search.toolkit_lib_dirs()
    assert dirs[:3] == [str(tmp_path / "home" / "lib64"), str(tmp_path / "path" / "lib64"), "/usr/local/cuda/lib64"]
    assert all(d.startswith("/usr/local/cuda-") for d in dirs[3:])
