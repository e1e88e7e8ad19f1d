"""The kernel cache: what its key depends on, damaged files never loaded, a folder that cannot be written,
the in-process copy, and two processes compiling the same kernel at once."""
import random
import subprocess
import sys
import textwrap
import warnings

import pytest

from hotloop.rtc import images, kernel_cache, kernel_sources, targets

SM_80 = targets.Target(80, True)


def key_parts(**changed):
    parts = dict(source_name="amp", source_bytes=b"__global__ void k() {}", headers_digest=b"\1" * 32,
                 nvrtc_version=(12, 9), arch=90, cubin=True, options=["-std=c++17", "-arch=sm_90", "--fmad=true"])
    parts.update(changed)
    return parts


def test_the_key_changes_with_everything_that_decides_the_image():
    base = kernel_cache.cache_key(**key_parts())
    variants = [key_parts(source_name="optim"), key_parts(source_bytes=b"__global__ void k() { }"),
                key_parts(headers_digest=b"\2" * 32), key_parts(nvrtc_version=(13, 0)), key_parts(arch=80),
                key_parts(cubin=False), key_parts(options=["-std=c++17", "-arch=sm_90"])]
    keys = [kernel_cache.cache_key(**v) for v in variants]
    assert base == kernel_cache.cache_key(**key_parts()) and len(set(keys + [base])) == len(variants) + 1


def test_the_key_follows_header_bytes_but_not_the_include_path(nvrtc, tiny_kernels, tmp_path):
    other = tmp_path / "elsewhere" / "kernels"
    other.mkdir(parents=True)
    for path in tiny_kernels.iterdir():
        (other / path.name).write_bytes(path.read_bytes())
    same = [images.entry_for(nvrtc, "tiny", SM_80, folder)[1] for folder in (tiny_kernels, other)]
    assert same[0] == same[1]  # installed elsewhere, the same entry
    (other / "tiny.h").write_text("#define TINY_OFFSET 3.5f\n")
    (other / "unused.cuh").write_text("// any header of the folder counts\n")
    kernel_sources.headers_digest.cache_clear()
    assert images.entry_for(nvrtc, "tiny", SM_80, other)[1] != same[0]
    assert images.entry_for(nvrtc, "tiny", targets.Target(90, True), tiny_kernels)[1] != same[0]
    assert images.entry_for(nvrtc, "tiny", targets.Target(80, False), tiny_kernels)[1] != same[0]


def test_a_compiled_image_is_stored_whole_and_read_back(nvrtc, tiny_kernels, fresh_cache):
    made = images.kernel_image(nvrtc, "tiny", SM_80, fresh_cache, tiny_kernels)
    assert not made.cached and made.image[:4] == b"\x7fELF"
    path = fresh_cache.path(made.entry)
    assert made.entry.startswith("tiny.sm_80.") and path.is_file()
    assert kernel_cache.unpack(path.read_bytes()) == made.image
    assert not [p for p in fresh_cache.folder.iterdir() if p.suffix == ".tmp"]
    # another process (a new cache object) reads it from disk
    again = images.kernel_image(nvrtc, "tiny", SM_80, kernel_cache.KernelCache(fresh_cache.folder), tiny_kernels)
    assert again.cached and again.image == made.image


def test_a_second_call_does_not_read_the_disk_again(nvrtc, tiny_kernels, fresh_cache):
    made = images.kernel_image(nvrtc, "tiny", SM_80, fresh_cache, tiny_kernels)
    fresh_cache.path(made.entry).unlink()
    again = images.kernel_image(nvrtc, "tiny", SM_80, fresh_cache, tiny_kernels)
    assert again.cached and again.image == made.image and not fresh_cache.path(made.entry).exists()


def flip_a_byte(data):
    at = random.randrange(len(data))
    return data[:at] + bytes([data[at] ^ (1 << random.randrange(8))]) + data[at + 1:]


@pytest.mark.parametrize("damage", ["flipped byte in the payload", "flipped byte in the header", "truncated",
                                    "empty", "foreign file"])
def test_a_damaged_entry_is_never_loaded_and_is_compiled_again(nvrtc, tiny_kernels, fresh_cache, damage):
    made = images.kernel_image(nvrtc, "tiny", SM_80, fresh_cache, tiny_kernels)
    path = fresh_cache.path(made.entry)
    data = path.read_bytes()
    header = kernel_cache.HEADER.size
    damaged = {
        "flipped byte in the payload": lambda: data[:header] + flip_a_byte(data[header:]),
        "flipped byte in the header": lambda: flip_a_byte(data[:header]) + data[header:],
        "truncated": lambda: data[:random.randrange(1, len(data))],
        "empty": lambda: b"",
        "foreign file": lambda: random.randbytes(len(data)),
    }[damage]()
    path.write_bytes(damaged)
    assert kernel_cache.unpack(damaged) is None
    reader = kernel_cache.KernelCache(fresh_cache.folder)
    assert reader.lookup(made.entry, made.entry.split(".")[2]) is None
    again = images.kernel_image(nvrtc, "tiny", SM_80, reader, tiny_kernels)
    assert not again.cached and again.image == made.image
    assert kernel_cache.unpack(path.read_bytes()) == made.image  # overwritten with a good entry


def test_a_folder_that_cannot_be_made_keeps_images_in_memory_with_one_warning(nvrtc, tiny_kernels, tmp_path,
                                                                              monkeypatch):
    # a folder under a regular file cannot be created, even by root (for whom chmod does not stop writes)
    (tmp_path / "afile").write_text("a file, not a folder")
    monkeypatch.setenv("HOTLOOP_CACHE_DIR", str(tmp_path / "afile" / "cache"))
    cache = images.kernel_cache_for_now()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = [images.kernel_image(nvrtc, "tiny", target, cache, tiny_kernels)
                for target in (SM_80, targets.Target(90, True), SM_80)]
    assert [m.cached for m in made] == [False, False, True]
    assert made[0].image[:4] == made[1].image[:4] == b"\x7fELF" and made[2].image == made[0].image
    assert len(caught) == 1 and issubclass(caught[0].category, RuntimeWarning)
    assert str(tmp_path / "afile" / "cache" / "kernels") in str(caught[0].message)
    assert "Not a directory" in str(caught[0].message) and cache.disk_error is not None


CONCURRENT_COMPILE = textwrap.dedent("""
    import os, pathlib, sys, time
    from hotloop.rtc import images, kernel_cache, nvrtc_finder, targets
    folder, go, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
    nvrtc = nvrtc_finder.open_nvrtc(sys.argv[4])
    while not go.exists():  # both processes start compiling at the same moment
        time.sleep(0.001)
    made = images.kernel_image(nvrtc, "tiny", targets.Target(80, True), images.kernel_cache_for_now(), folder)
    out.write_bytes(made.image)
    print("cached" if made.cached else "compiled")
""")


def test_two_processes_compiling_the_same_kernel_both_end_with_a_good_entry(nvrtc, tiny_kernels, cache_dir, tmp_path):
    go = tmp_path / "go"
    script = tmp_path / "compile_one.py"
    script.write_text(CONCURRENT_COMPILE)
    processes = [subprocess.Popen([sys.executable, str(script), str(tiny_kernels), str(go), str(tmp_path / f"out{i}"),
                                   nvrtc.path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
    go.touch()
    results = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], [err for _, err in results]
    outs = [(tmp_path / f"out{i}").read_bytes() for i in range(2)]
    assert outs[0] == outs[1] and outs[0][:4] == b"\x7fELF"
    entries = [p for p in (cache_dir / "kernels").iterdir() if p.name.startswith("tiny.")]
    assert len(entries) == 1 and kernel_cache.unpack(entries[0].read_bytes()) == outs[0]
    assert not [p for p in entries[0].parent.iterdir() if p.suffix == ".tmp"]
    assert sorted(out.strip() for out, _ in results) == ["cached", "compiled"]  # the folder lock: one compile
