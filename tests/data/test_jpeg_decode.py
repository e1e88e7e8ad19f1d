"""JPEG headers read in C (_C.jpeg_header) against PIL, fuzzed behind a guard page; nvjpeg found and loaded
at run time; _C.JpegDecoder's batched decoding on the GPU against PIL's decode (gpu marker).

Set HOTLOOP_JPEG_REPORT=path to have the GPU tests write what they measured (differences from PIL,
throughput, host blocking) there as JSON."""
import ctypes
import gc
import io
import json
import mmap
import os
import statistics
import struct
import sys
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

import hotloop
from hotloop import _C
from hotloop.data.image.nvjpeg import nvjpeg_library_candidates

from ..seeding import derived_seed

HANG_GUARD_S = 600  # the GPU tests encode and decode 100-megapixel images

REPORT = {}


def report(key, value):
    """Keep a measured figure (written at once: a run cut short still leaves what it measured)."""
    REPORT[key] = value
    path = os.environ.get("HOTLOOP_JPEG_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(REPORT, f, indent=1, sort_keys=True)


# ---------------------------------------------------------------------------------------------
# JPEGs made by PIL from fresh random content each run

def natural(h, w, rng, noise=6.0):
    """Smooth colour waves plus noise: what photographs look like to a JPEG coder (pure noise would make
    every decoder's rounding look like a large difference)."""
    y = np.linspace(0, 1, h)[:, None, None]
    x = np.linspace(0, 1, w)[None, :, None]
    f = rng.uniform(0.5, 4, size=(2, 3))
    phase = rng.uniform(0, 2 * np.pi, size=3)
    img = 127.5 + 90 * np.sin(2 * np.pi * (f[0] * x + f[1] * y) + phase) + rng.normal(0, noise, (h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def encode(image, **options):
    out = io.BytesIO()
    image.save(out, "JPEG", **options)
    return out.getvalue()


def make_jpeg(rng, h, w, kind="420", quality=90, **options):
    """kind: 420, 422, 444 (baseline colour), grey, progressive (4:2:0), cmyk, rgb (RGB-coded, Adobe transform 0)"""
    image = Image.fromarray(natural(h, w, rng))
    if kind == "grey":
        return encode(image.convert("L"), quality=quality, **options)
    if kind == "cmyk":
        return encode(image.convert("CMYK"), quality=quality, **options)
    if kind == "rgb":
        return encode(image, quality=quality, keep_rgb=True, **options)
    if kind == "progressive":
        return encode(image, quality=quality, subsampling=2, progressive=True, **options)
    return encode(image, quality=quality, subsampling={"444": 0, "422": 1, "420": 2}[kind], **options)


def pil_rgb(data):
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def segment(data, marker):
    """(start of the marker, end of its segment) of the first `marker` (e.g. 0xC0)"""
    i = data.index(bytes([0xFF, marker]))
    return i, i + 2 + struct.unpack(">H", data[i + 2:i + 4])[0]


def corrupt_huffman_table(data):
    """The first DHT made invalid: table id 7 and code counts summing past 256 (libjpeg: bogus DHT)."""
    start, _ = segment(data, 0xC4)
    bad = bytearray(data)
    bad[start + 4] = 0x17
    bad[start + 5:start + 21] = b"\xff" * 16
    return bytes(bad)


# ---------------------------------------------------------------------------------------------
# jpeg_header against PIL

SIZES = [(1, 1), (1, 7), (7, 1), (8, 8), (15, 17), (16, 16), (33, 65), (375, 500), (1500, 2000)]


@pytest.mark.parametrize("size", SIZES, ids=[f"{h}x{w}" for h, w in SIZES])
@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
@pytest.mark.parametrize("progressive", [False, True], ids=["baseline", "progressive"])
def test_header_matches_pil(size, mode, progressive):
    rng = np.random.default_rng(derived_seed())
    h, w = size
    image = Image.fromarray(natural(h, w, rng)).convert(mode)
    options = dict(quality=int(rng.choice([5, 50, 75, 90, 95, 100])), optimize=bool(rng.integers(2)),
                   progressive=progressive)
    if mode == "RGB":
        options["subsampling"] = int(rng.integers(3))
    data = encode(image, **options)
    info = _C.jpeg_header(data)
    pil = Image.open(io.BytesIO(data))
    assert (info.width, info.height) == pil.size == (w, h)
    assert info.components == {"RGB": 3, "L": 1, "CMYK": 4}[mode]
    assert info.process == (_C.JPEG_PROGRESSIVE if progressive else _C.JPEG_BASELINE)
    assert bool(pil.info.get("progressive")) == progressive
    assert info.adobe_transform == pil.info.get("adobe_transform", -1)
    assert info.ends_with_eoi and info.scan and info.precision == 8 and not info.rgb
    assert tuple(info) == (h, w, info.components, info.process, info.adobe_transform, True)
    pil.load()  # the file is whole: PIL decodes it


def test_header_other_markers_and_layouts():
    rng = np.random.default_rng(derived_seed())
    image = Image.fromarray(natural(48, 80, rng))
    # EXIF orientation 6 (rotate 90): PIL's loader (ImageFolder's) does not apply it, nor does the header
    exif = Image.Exif()
    exif[0x0112] = 6
    icc = bytes(rng.integers(0, 256, 150000, dtype=np.uint8))  # more than one APP2 segment
    cases = [
        (dict(exif=exif), 3, -1, False),
        (dict(icc_profile=icc, comment=b"made by hotloop's tests \xff\xd9"), 3, -1, False),
        (dict(keep_rgb=True), 3, 0, True),
        (dict(restart_marker_blocks=3), 3, -1, False),
        (dict(dpi=(300, 300), qtables="web_high"), 3, -1, False),
    ]
    for options, components, transform, rgb in cases:
        data = encode(image, **options)
        info = _C.jpeg_header(data)
        assert (info.width, info.height) == Image.open(io.BytesIO(data)).size == (80, 48), options
        assert (info.components, info.adobe_transform, info.rgb, info.ends_with_eoi) == \
            (components, transform, rgb, True), options


def test_header_end_of_file():
    """ends_with_eoi: EOI last, after any 00/FF padding. A file without it goes to PIL (the workers'
    CPU path), which refuses it as truncated, unless its scan happens to end whole: 12 of 400 random
    images here decode without their last byte or two."""
    rng = np.random.default_rng(derived_seed())
    data = make_jpeg(rng, 40, 56)
    padded = [data + b"\0" * int(rng.integers(1, 5000)), data + b"\xff" * 3, data + b"\0\xff\0"]
    for whole in [data] + padded:
        assert _C.jpeg_header(whole).ends_with_eoi
        assert pil_rgb(whole).shape == (40, 56, 3)
    for cut in [data[:-1], data[:-2], data[:len(data) // 2]]:
        assert not _C.jpeg_header(cut).ends_with_eoi
    with pytest.raises(OSError, match="truncated"):
        pil_rgb(data[:len(data) // 2])
    # zeros where the EOI was: no EOI (PIL decodes some such files: the zeros end the last MCU's data)
    assert not _C.jpeg_header(data[:-2] + b"\0\0").ends_with_eoi
    # trailing bytes other than padding: PIL decodes the file, the header says no EOI (documented)
    assert not _C.jpeg_header(data + b"trailer").ends_with_eoi
    assert pil_rgb(data + b"trailer").shape == (40, 56, 3)


def test_header_not_a_jpeg():
    rng = np.random.default_rng(derived_seed())
    png = io.BytesIO()
    Image.fromarray(natural(10, 10, rng)).save(png, "PNG")
    for data in [b"", b"\xff", b"\xd8\xff", png.getvalue(), b"GIF89a" + bytes(100), b"\x00\xff\xd8\xff"]:
        assert _C.jpeg_header(data) is None


def test_header_corrupt_raises_value_error():
    rng = np.random.default_rng(derived_seed())
    data = make_jpeg(rng, 16, 16)
    sof, sof_end = segment(data, 0xC0)
    cases = {
        "SOI only": data[:2],
        "a second SOI": data[:2] + b"\xff\xd8" + data[2:],
        "EOI first": b"\xff\xd8\xff\xd9",
        "scan before frame": b"\xff\xd8\xff\xda\x00\x02" + data[2:],
        "length below 2": b"\xff\xd8\xff\xe0\x00\x01" + data[2:],
        "frame cut": data[:sof_end - 1],
        "zero height": data[:sof + 5] + b"\x00\x00" + data[sof + 7:],
        "no components": data[:sof + 9] + b"\x00" + data[sof + 10:],
        "reserved marker": data[:2] + b"\xff\x02" + data[2:],
    }
    for name, bad in cases.items():
        with pytest.raises(ValueError, match="corrupt JPEG"):
            _C.jpeg_header(bad)
        try:
            Image.open(io.BytesIO(bad)).load()
        except Exception:
            pass
        else:
            # libjpeg steps over these three with a warning; the header calls them corrupt all the same
            if name not in ("a second SOI", "reserved marker", "length below 2"):
                raise AssertionError(f"{name}: PIL decoded what the header calls corrupt")


def test_header_buffer_kinds():
    rng = np.random.default_rng(derived_seed())
    data = make_jpeg(rng, 20, 30, "grey")
    expected = tuple(_C.jpeg_header(data))
    array = np.frombuffer(data, np.uint8).copy()
    for obj in [bytearray(data), memoryview(data), memoryview(data)[0:], array, torch.from_numpy(array).numpy(),
                mmap_copy(data)]:
        assert tuple(_C.jpeg_header(obj)) == expected
    with pytest.raises(TypeError, match="expected bytes or a C-contiguous buffer"):
        _C.jpeg_header(12)
    with pytest.raises((BufferError, TypeError), match="not C-contiguous"):
        _C.jpeg_header(memoryview(data)[::2])


def mmap_copy(data):
    m = mmap.mmap(-1, len(data))
    m[:] = data
    return m


def test_header_every_truncation():
    rng = np.random.default_rng(derived_seed())
    files = [make_jpeg(rng, 24, 32, "420", exif=b"Exif\0\0" + bytes(300)),
             make_jpeg(rng, 9, 17, "grey", progressive=True), make_jpeg(rng, 8, 8, "cmyk")]
    for data in files:
        full = _C.jpeg_header(data)
        _, frame_end = next(segment(data, m) for m in (0xC0, 0xC2) if bytes([0xFF, m]) in data)
        for n in range(len(data)):
            cut = data[:n]
            if n < 2:
                assert _C.jpeg_header(cut) is None
            elif n < frame_end:
                with pytest.raises(ValueError):
                    _C.jpeg_header(cut)
            else:
                info = _C.jpeg_header(cut)
                assert tuple(info)[:5] == tuple(full)[:5] and not info.ends_with_eoi, n


class GuardedBuffer:
    """Bytes placed to end exactly where a PROT_NONE page begins: a read past the end faults at once,
    with or without AddressSanitizer."""

    def __init__(self, capacity):
        page = mmap.PAGESIZE
        pages = (capacity + page - 1) // page + 1
        self.map = mmap.mmap(-1, (pages + 1) * page)
        self.end = pages * page
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        anchor = ctypes.c_char.from_buffer(self.map)
        self.base = ctypes.addressof(anchor)
        del anchor
        assert self.libc.mprotect(self.base + self.end, page, 0) == 0  # PROT_NONE
        self.page = page

    def view(self, data):
        assert len(data) <= self.end
        start = self.end - len(data)
        self.map[start:self.end] = data
        return memoryview(self.map)[start:self.end]

    def close(self):
        self.libc.mprotect(self.base + self.end, self.page, 3)  # back to read/write before unmapping
        self.map.close()


def parse_safely(view):
    try:
        result = _C.jpeg_header(view)
    except ValueError:
        return "corrupt"
    finally:
        view.release()
    assert result is None or len(result) == 6
    return result


def test_header_fuzz_behind_a_guard_page():
    rng = np.random.default_rng(derived_seed())
    guard = GuardedBuffer(1 << 16)
    try:
        seeds = [make_jpeg(rng, 24, 40, kind) for kind in ("420", "grey", "progressive", "cmyk", "rgb")]
        seeds.append(make_jpeg(rng, 16, 16, exif=b"Exif\0\0" + bytes(64), restart_marker_rows=1))
        outcomes = {"none": 0, "corrupt": 0, "info": 0}
        for _ in range(3000):  # random bytes, some behind an SOI
            data = bytes(rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8))
            if rng.integers(2):
                data = b"\xff\xd8" + data
            r = parse_safely(guard.view(data))
            outcomes["none" if r is None else "corrupt" if r == "corrupt" else "info"] += 1
        for _ in range(6000):  # valid files with bytes flipped, cut, or lengths made extreme
            data = bytearray(seeds[int(rng.integers(len(seeds)))])
            for _ in range(int(rng.integers(1, 9))):
                i = int(rng.integers(len(data)))
                choice = rng.integers(4)
                if choice == 0:
                    data[i] = int(rng.integers(256))
                elif choice == 1:
                    data[i] ^= 1 << int(rng.integers(8))
                elif choice == 2 and i + 1 < len(data):
                    data[i:i + 2] = [b"\xff\xff", b"\x00\x00", b"\x00\x01", b"\xff\xd8", b"\xff\xda"][rng.integers(5)]
                else:
                    del data[i:]
                    data += b"\xff"
            r = parse_safely(guard.view(bytes(data)))
            outcomes["none" if r is None else "corrupt" if r == "corrupt" else "info"] += 1
        for seed in seeds:  # every prefix, each ending at the guard page
            for n in range(len(seed)):
                parse_safely(guard.view(seed[:n]))
        assert min(outcomes.values()) > 0, outcomes  # the fuzz reached every outcome
    finally:
        gc.collect()
        guard.close()


@pytest.mark.skipif(bool(hotloop.build_info()["sanitizers"]), reason="timed: not under sanitizers")
def test_header_is_fast():
    rng = np.random.default_rng(derived_seed())
    data = encode(Image.fromarray(natural(375, 500, rng, noise=11)), quality=90,
                  exif=b"Exif\0\0" + bytes(2000))
    assert 50_000 < len(data) < 120_000
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(2000):
            _C.jpeg_header(data)
        times.append((time.perf_counter() - t0) / 2000)
    # the markers and the last bytes only: ~0.2 us here whatever the file's size
    assert statistics.median(times) < 5e-6, times


# ---------------------------------------------------------------------------------------------
# finding and loading nvjpeg

def test_load_reports_every_path_tried(tmp_path):
    missing = str(tmp_path / "libnvjpeg.so.13")
    with pytest.raises(RuntimeError) as err:
        _C.nvjpeg_load([missing, "libc.so.6"])
    text = str(err.value)
    assert "no nvjpeg library could be loaded" in text
    assert missing in text and "No such file" in text
    assert "libc.so.6" in text and "no nvjpegGetProperty" in text
    with pytest.raises(RuntimeError, match="paths is empty"):
        _C.nvjpeg_load([])
    with pytest.raises(TypeError):
        _C.nvjpeg_load([3])


def test_load_finds_a_real_nvjpeg_when_present():
    candidates = nvjpeg_library_candidates()
    try:
        path, version = _C.nvjpeg_load(candidates)
    except RuntimeError as err:
        if any(os.path.isabs(p) and os.path.exists(p) for p in candidates):
            raise AssertionError(f"an nvjpeg file exists but none loaded: {err}")
        pytest.skip(f"no nvjpeg on this machine: {err}")
    assert path in candidates and version[0] == 13, (path, version)
    assert _C.nvjpeg_load([path]) == (path, version)  # opened once, found again


def test_status_names_and_constants():
    assert _C.nvjpeg_status_name(0) == "NVJPEG_STATUS_SUCCESS"
    assert _C.nvjpeg_status_name(7) == "NVJPEG_STATUS_ARCH_MISMATCH"
    assert _C.nvjpeg_status_name(10) == "NVJPEG_STATUS_INCOMPLETE_BITSTREAM"
    assert _C.nvjpeg_status_name(99) == "NVJPEG_STATUS_UNKNOWN"
    assert (_C.JPEG_DECODED, _C.JPEG_UNSUPPORTED, _C.JPEG_CORRUPT) == (0, 1, 2)
    assert issubclass(hotloop._C.NvjpegError, RuntimeError)


def test_decoder_arguments_checked_first():
    with pytest.raises(ValueError, match="backend"):
        _C.JpegDecoder(["x"], 0, "software", 8)
    with pytest.raises(ValueError, match="max_batch"):
        _C.JpegDecoder(["x"], 0, "cuda", 0)
    with pytest.raises(TypeError):
        _C.JpegDecoder(["x"], 0, "cuda", 8, True)  # interpolate is keyword-only
    for threads in (-1, 65):
        with pytest.raises(ValueError, match="threads: expected 0 to 64"):
            _C.JpegDecoder(["x"], 0, "hybrid", 8, threads=threads)


@pytest.mark.skipif(hotloop.cuda_available(), reason="checks the refusal without a GPU")
def test_decoder_without_a_gpu_says_so():
    with pytest.raises(RuntimeError, match="built without CUDA|no CUDA driver"):
        _C.JpegDecoder(nvjpeg_library_candidates(), 0, "hardware", 8)


# ---------------------------------------------------------------------------------------------
# decoding on the GPU

def open_decoder(backend, max_batch=64, **options):
    try:
        return _C.JpegDecoder(nvjpeg_library_candidates(), torch.cuda.current_device(), backend, max_batch,
                              **options)
    except _C.NvjpegError as err:
        if backend == "hardware" and "no hardware JPEG decoder" in str(err):
            pytest.skip(str(err))
        raise


class Batch:
    """JPEG bytes in one pinned host buffer, and a device output of height x pitch per image (pitch
    padded past width * 3 so that writes beyond a row show), filled with `poison` first. `shapes`:
    (height, width) per image, where PIL cannot say (not a JPEG, truncated)."""

    def __init__(self, blobs, shapes=None, pad=5):
        self.blobs = blobs
        sizes = [len(b) for b in blobs]
        self.host = torch.empty(sum(sizes), dtype=torch.uint8).pin_memory()
        array, offset, pairs = self.host.numpy(), 0, []
        for b in blobs:
            array[offset:offset + len(b)] = np.frombuffer(b, np.uint8)
            pairs += [self.host.data_ptr() + offset, len(b)]
            offset += len(b)
        self.sources = struct.pack(f"{len(pairs)}q", *pairs)
        self.shapes = shapes or [Image.open(io.BytesIO(b)).size[::-1] for b in blobs]
        self.pad = pad

    def outputs(self, poison):
        outs, pairs = [], []
        for h, w in self.shapes:
            pitch = w * 3 + self.pad
            t = torch.full((h, pitch), poison, dtype=torch.uint8, device="cuda")
            outs.append(t)
            pairs += [t.data_ptr(), pitch]
        return outs, struct.pack(f"{len(pairs)}q", *pairs)

    def decode(self, decoder, poison=0, stream=None):
        """(statuses, images as HxWx3 numpy, the raw outputs, seconds the host was blocked)"""
        stream = stream or torch.cuda.current_stream()
        outs, dests = self.outputs(poison)
        with torch.cuda.stream(stream):
            t0 = time.perf_counter()
            status = decoder.decode(self.sources, dests, len(self.blobs), stream.cuda_stream)
            blocked = time.perf_counter() - t0
        stream.synchronize()
        images = [o[:, :w * 3].reshape(h, w, 3).cpu().numpy() for o, (h, w) in zip(outs, self.shapes, strict=True)]
        return list(status), images, outs, blocked


def differences(got, data):
    diff = np.abs(got.astype(np.int16) - pil_rgb(data).astype(np.int16))
    return int(diff.max()), float(diff.mean())


def check_written(batch, decoder, first, statuses):
    """A second decode into outputs poisoned 255 gives the same pixels (every one written, deterministic)
    and leaves the row padding alone."""
    status2, second, outs2, _ = batch.decode(decoder, poison=255)
    assert status2 == statuses
    for i, s in enumerate(statuses):
        if s == _C.JPEG_DECODED:
            np.testing.assert_array_equal(first[i], second[i], err_msg=f"image {i}")
            h, w = batch.shapes[i]
            assert bool((outs2[i][:, w * 3:] == 255).all()), f"image {i}: written past width * 3"


KINDS = ["420", "444", "422", "grey", "progressive"]
# what PIL decodes that each backend decodes (else JPEG_UNSUPPORTED), as seen on the H200: the engines
# refuse progressive JPEGs (nvjpegDecodeBatchedSupported), the cuda backend takes them one by one, the
# hybrid backend's decoder takes every kind
EXPECTED = {"hardware": {"420", "444", "422", "grey"}, "cuda": set(KINDS), "hybrid": set(KINDS)}
# (max abs, mean abs) difference from PIL's decode allowed, by (backend, interpolate). Measured on the
# H200, 64 images of each kind, nvjpeg 13.0.1 against PIL's libjpeg-turbo, the worst kind:
#   interpolated chroma (the default): hardware max 1, mean 0.0001 (4:4:4 and grey exact);
#                                      cuda max 3, mean 0.035 (progressive the same)
#   replicated chroma:                 hardware max 60, mean 3.3; cuda max 74, mean 3.0 (4:2:0, 4:2:2)
# The hybrid backend is held to the cuda backend's bounds.
BOUNDS = {("hardware", True): (4, 0.05), ("cuda", True): (8, 0.25), ("hybrid", True): (8, 0.25),
          ("hardware", False): (160, 8.0), ("cuda", False): (160, 8.0), ("hybrid", False): (160, 8.0)}


def within(backend, worst, mean, interpolate=True):
    bound_max, bound_mean = BOUNDS[backend, interpolate]
    return worst <= bound_max and mean <= bound_mean


@pytest.mark.gpu
@pytest.mark.parametrize("interpolate", [True, False], ids=["interpolate", "replicate"])
@pytest.mark.parametrize("backend", ["hardware", "cuda", "hybrid"])
def test_decode_batch_against_pil(backend, interpolate):
    rng = np.random.default_rng(derived_seed())
    kinds = [KINDS[i % len(KINDS)] for i in range(64)]
    rng.shuffle(kinds)
    blobs = [make_jpeg(rng, int(rng.integers(8, 700)), int(rng.integers(8, 700)), k,
                      quality=int(rng.integers(60, 100))) for k in kinds]
    before = torch.cuda.current_device()
    decoder = open_decoder(backend, 64, interpolate=interpolate)
    assert torch.cuda.current_device() == before
    batch = Batch(blobs)
    statuses, images, _, blocked = batch.decode(decoder)
    stats = {}
    for kind, status, got, data, shape in zip(kinds, statuses, images, blobs, batch.shapes, strict=True):
        entry = stats.setdefault(kind, {"statuses": [], "max": 0, "mean": [], "refused": []})
        entry["statuses"].append(status)
        if status != _C.JPEG_DECODED:
            entry["refused"].append([*shape, status])
        if status == _C.JPEG_DECODED:
            worst, mean = differences(got, data)
            entry["max"] = max(entry["max"], worst)
            entry["mean"].append(mean)
            if kind == "grey":
                entry["r=g=b"] = entry.get("r=g=b", True) and bool((got[..., 0] == got[..., 1]).all() and
                                                                   (got[..., 1] == got[..., 2]).all())
    for entry in stats.values():
        entry["mean"] = float(np.mean(entry["mean"])) if entry["mean"] else None
    report(f"accuracy {backend} interpolate={decoder.interpolate}", dict(stats, host_blocked_s=blocked))
    print(backend, decoder.interpolate, json.dumps(stats))
    assert stats["grey"].get("r=g=b", True)
    for kind, entry in stats.items():
        wanted = _C.JPEG_DECODED if kind in EXPECTED[backend] else _C.JPEG_UNSUPPORTED
        assert set(entry["statuses"]) == {wanted}, (kind, entry["statuses"])
        if entry["mean"] is not None:
            assert within(backend, entry["max"], entry["mean"], decoder.interpolate), (kind, entry)
    check_written(batch, decoder, images, statuses)
    decoder.close()


@pytest.mark.gpu
@pytest.mark.parametrize("max_batch", [40, 256])
def test_engine_order_and_preallocation_change_no_pixel(max_batch):
    """size_order and preallocate (on for the hardware backend: NOTE [ Largest first ] in nvjpeg_engine.c)
    change only when and where nvjpeg works: every image lands in its own output, pixel for pixel as
    in the caller's order, the two handles' images (4:2:0; 4:4:4 and grey) included. With room for
    256 images, one 2,400 x 1,800 image takes the preallocation past its budget (PREALLOCATE_PIXELS):
    nvjpeg then grows its own buffers, and the pixels are the same."""
    rng = np.random.default_rng(derived_seed())
    kinds = [["420", "420", "444", "grey"][i % 4] for i in range(40)]
    blobs = [make_jpeg(rng, int(rng.integers(8, 900)), int(rng.integers(8, 900)), k) for k in kinds]
    if max_batch == 256:
        kinds[7], blobs[7] = "420", make_jpeg(rng, 1800, 2400, "420")
    decoder = open_decoder("hardware", max_batch)
    assert decoder.size_order and decoder.preallocate
    batch = Batch(blobs)
    seen = {}
    for size_order, preallocate in ((False, False), (True, False), (True, True), (False, True)):
        decoder.size_order, decoder.preallocate = size_order, preallocate
        statuses, images, _, _ = batch.decode(decoder)
        assert statuses == [_C.JPEG_DECODED] * len(blobs)
        seen[size_order, preallocate] = images
    for key, images in seen.items():
        for i, (got, want) in enumerate(zip(images, seen[False, False], strict=True)):
            assert np.array_equal(got, want), (key, i, kinds[i])
    with pytest.raises(AttributeError, match="cannot be deleted"):
        del decoder.size_order
    decoder.close()
    whole_order = open_decoder("cuda", 2)
    assert not whole_order.size_order and not whole_order.preallocate
    whole_order.close()


@pytest.mark.gpu
def test_hybrid_threads_change_no_pixel():
    """The hybrid backend's images decoded on 1, 3 or every CPU's thread (NOTE [ Hybrid lanes ] in
    nvjpeg_hybrid.c), largest first or in the caller's order: each lands in its own output, pixel for
    pixel the same, progressive ones included."""
    rng = np.random.default_rng(derived_seed())
    kinds = [KINDS[i % len(KINDS)] for i in range(96)]
    rng.shuffle(kinds)
    blobs = [make_jpeg(rng, int(rng.integers(8, 900)), int(rng.integers(8, 900)), k) for k in kinds]
    decoder = open_decoder("hybrid", 96)
    assert decoder.size_order and not decoder.preallocate
    assert decoder.threads == min(len(os.sched_getaffinity(0)), 64)
    batch = Batch(blobs)
    seen = {}
    for threads, size_order in ((1, False), (3, True), (decoder.threads, True), (decoder.threads, False)):
        decoder.threads, decoder.size_order = threads, size_order
        statuses, images, _, _ = batch.decode(decoder)
        assert statuses == [_C.JPEG_DECODED] * len(blobs)
        seen[threads, size_order] = images
    for key, images in seen.items():
        for i, (got, want) in enumerate(zip(images, seen[1, False], strict=True)):
            assert np.array_equal(got, want), (key, i, kinds[i])
    for got, data in zip(seen[1, False], blobs, strict=True):
        assert within("hybrid", *differences(got, data), decoder.interpolate)
    with pytest.raises(ValueError, match="threads: expected 1 to 64"):
        decoder.threads = 0
    decoder.close()


@pytest.mark.gpu
def test_threads_beside_the_engines():
    """The hardware backend with host threads beside the engines (NOTE [ Lanes beside the engines ] in
    nvjpeg_beside.c): every image of every kind decoded, progressive ones included, each in its own
    output, within the hybrid backend's bounds (an image may go to either pool); the threads' share of
    the pixels moves from its first value as it is learnt, and stays within its bounds."""
    rng = np.random.default_rng(derived_seed())
    kinds = [KINDS[i % len(KINDS)] for i in range(96)]
    rng.shuffle(kinds)
    blobs = [make_jpeg(rng, int(rng.integers(8, 900)), int(rng.integers(8, 900)), k) for k in kinds]
    decoder = open_decoder("hardware", 96)
    assert decoder.threads == 0 and decoder.lane_share is None and decoder.lane_images == 0
    batch = Batch(blobs)
    statuses, _, _, _ = batch.decode(decoder)
    assert [s == _C.JPEG_DECODED for s in statuses] == [k != "progressive" for k in kinds]
    decoder.threads = 3
    shares = []
    for _ in range(6):
        statuses, images, _, _ = batch.decode(decoder)
        assert statuses == [_C.JPEG_DECODED] * len(blobs)
        shares.append(decoder.lane_share)
    report("lanes beside the engines: share per batch", shares)
    assert decoder.lane_images >= 6 * kinds.count("progressive")
    assert all(0.02 <= share <= 0.98 for share in shares) and len(set(shares)) > 1
    for kind, got, data in zip(kinds, images, blobs, strict=True):
        assert within("hybrid", *differences(got, data), decoder.interpolate), kind
    check_written(batch, decoder, images, statuses)
    with pytest.raises(ValueError, match="threads: expected 0 to 64"):
        decoder.threads = -1
    decoder.threads = 0  # the engines alone again: the progressive ones refused
    statuses, _, _, _ = batch.decode(decoder)
    assert [s == _C.JPEG_DECODED for s in statuses] == [k != "progressive" for k in kinds]
    decoder.close()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hardware", "cuda", "hybrid"])
def test_unsupported_and_corrupt_images_keep_the_others(backend):
    rng = np.random.default_rng(derived_seed())
    good = [make_jpeg(rng, int(rng.integers(32, 300)), int(rng.integers(32, 300))) for _ in range(12)]
    bad_table = corrupt_huffman_table(make_jpeg(rng, 64, 64))
    with pytest.raises(Exception):
        pil_rgb(bad_table)  # PIL refuses it too
    scan_start = segment(good[0], 0xDA)[1]
    noisy = bytearray(good[0])
    noisy[scan_start + 10:scan_start + 60] = rng.integers(0, 256, 50, dtype=np.uint8).tobytes()
    png = io.BytesIO()
    Image.fromarray(natural(8, 8, rng)).save(png, "PNG")
    batch_blobs = list(good)
    cases = {  # index -> (bytes, wanted statuses)
        2: (make_jpeg(rng, 40, 40, "cmyk"), {_C.JPEG_UNSUPPORTED}),
        4: (good[1][:len(good[1]) * 2 // 3], {_C.JPEG_CORRUPT}),  # truncated
        6: (bad_table, {_C.JPEG_CORRUPT}),
        7: (make_jpeg(rng, 40, 40, "rgb"), {_C.JPEG_UNSUPPORTED}),
        # corrupt entropy data: any status, never a crash (noise may even read as markers nvjpeg refuses)
        9: (bytes(noisy), {_C.JPEG_DECODED, _C.JPEG_UNSUPPORTED, _C.JPEG_CORRUPT}),
        11: (png.getvalue(), {_C.JPEG_CORRUPT}),
    }
    for i, (data, _) in cases.items():
        batch_blobs[i] = data
    shapes = []
    for data in batch_blobs:  # outputs sized from the header (PIL cannot open the PNG as a JPEG's size)
        info = _C.jpeg_header(data)
        shapes.append((info.height, info.width) if info else (8, 8))
    batch = Batch(batch_blobs, shapes)
    decoder = open_decoder(backend, 16)
    statuses, images, _, _ = batch.decode(decoder)
    report(f"bad images {backend}", statuses)
    for i, status in enumerate(statuses):
        if i in cases:
            assert status in cases[i][1], (i, status)
        else:
            assert status == _C.JPEG_DECODED, (i, status)
            worst, mean = differences(images[i], batch_blobs[i])
            assert within(backend, worst, mean), (i, worst, mean)
    decoder.close()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hardware", "cuda", "hybrid"])
def test_decode_checks_and_lifecycle(backend):
    rng = np.random.default_rng(derived_seed())
    blobs = [make_jpeg(rng, 50, 70) for _ in range(3)]
    decoder = open_decoder(backend, 4)
    assert decoder.backend == backend and decoder.device == torch.cuda.current_device()
    assert decoder.max_batch == 4 and not decoder.closed and decoder.version[0] == 13
    assert decoder.library in nvjpeg_library_candidates()
    if backend == "hardware":
        engines, cores = decoder.hardware_engines
        assert engines >= 1 and cores >= 1
        report("hardware engines", decoder.hardware_engines)
    batch = Batch(blobs)
    outs, dests = batch.outputs(0)
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(ValueError, match="count"):
        decoder.decode(batch.sources, dests, 5, stream)
    with pytest.raises(ValueError, match="expected 48 bytes"):
        decoder.decode(batch.sources[:-8], dests, 3, stream)
    narrow = struct.pack("6q", *[v if k % 2 == 0 else 70 * 3 - 1 for k, v in enumerate(struct.unpack("6q", dests))])
    with pytest.raises(ValueError, match="image 0: destination pitch"):
        decoder.decode(batch.sources, narrow, 3, stream)
    zero = struct.pack("6q", 0, 10, *struct.unpack("6q", batch.sources)[2:])
    with pytest.raises(ValueError, match="image 0: source pointer is 0"):
        decoder.decode(zero, dests, 3, stream)
    torch.cuda.synchronize()
    assert all(bool((o == 0).all()) for o in outs)  # refused before any work
    assert decoder.decode(b"", b"", 0, stream) == b""
    # two streams, one after the other: the second waits for the first's use of the decoder's buffers
    side = torch.cuda.Stream()
    s1, first, _, _ = batch.decode(decoder)
    s2, second, _, _ = batch.decode(decoder, stream=side)
    assert s1 == s2 == [0, 0, 0] and all((a == b).all() for a, b in zip(first, second, strict=True))
    with decoder:
        pass
    assert decoder.closed
    decoder.close()  # again: nothing
    with pytest.raises(ValueError, match="closed"):
        decoder.decode(batch.sources, dests, 3, stream)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hardware", "cuda", "hybrid"])
def test_decode_comes_after_the_work_queued_before_it(backend):
    """The decode's writes come after what the stream had to do first, a wait for another stream
    included: here reads of the outputs queued behind ~100 ms of GPU time see the poison, not pixels.
    nvjpeg's hardware batched decode was reported to write while the call runs (torchcodec #1634:
    12.3-13.2 on H100), hence nvjpeg_engine.c's host wait; on the H200 with 13.0.1 this passed without it."""
    rng = np.random.default_rng(derived_seed())
    blobs = [make_jpeg(rng, int(rng.integers(64, 500)), int(rng.integers(64, 500))) for _ in range(32)]
    decoder = open_decoder(backend, 32)
    batch = Batch(blobs)
    outs, dests = batch.outputs(7)
    other, stream = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(other):
        torch.cuda._sleep(200_000_000)
    with torch.cuda.stream(stream):
        stream.wait_stream(other)
        seen = [o.clone() for o in outs]
        status = decoder.decode(batch.sources, dests, len(blobs), stream.cuda_stream)
    stream.synchronize()
    assert list(status) == [_C.JPEG_DECODED] * len(blobs)
    for i, (before, out, (h, w), data) in enumerate(zip(seen, outs, batch.shapes, blobs, strict=True)):
        assert bool((before == 7).all()), f"image {i}: written before the work queued ahead of the decode ran"
        worst, mean = differences(out[:, :w * 3].reshape(h, w, 3).cpu().numpy(), data)
        assert within(backend, worst, mean), (i, worst, mean)
    decoder.close()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hardware", "cuda", "hybrid"])
def test_back_to_back_decodes_each_keep_their_images(backend):
    """Calls queued one after another on one stream, the host never waiting between them (as the
    loader's thread queues batch after batch): each call's images are its own, every one as PIL's."""
    rng = np.random.default_rng(derived_seed())
    decoder = open_decoder(backend, 48)
    stream = torch.cuda.Stream()
    calls = []
    for _ in range(6):
        blobs = [make_jpeg(rng, int(rng.integers(32, 600)), int(rng.integers(32, 600)),
                           ("420", "444", "grey")[int(rng.integers(3))], quality=int(rng.integers(60, 100)))
                 for _ in range(48)]
        batch = Batch(blobs)
        outs, dests = batch.outputs(7)
        status = decoder.decode(batch.sources, dests, len(blobs), stream.cuda_stream)
        calls.append((batch, outs, list(status)))
    stream.synchronize()
    for c, (batch, outs, status) in enumerate(calls):
        assert status == [_C.JPEG_DECODED] * len(batch.blobs), (c, status)
        for i, (out, (h, w), data) in enumerate(zip(outs, batch.shapes, batch.blobs, strict=True)):
            worst, mean = differences(out[:, :w * 3].reshape(h, w, 3).cpu().numpy(), data)
            assert within(backend, worst, mean), (c, i, worst, mean)
    decoder.close()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hardware", "cuda", "hybrid"])
def test_throughput_report(backend):
    """Not a benchmark gate: the figures for the report (256 PIL-made 500x375 q90 JPEGs, ~74 KB)."""
    rng = np.random.default_rng(derived_seed())
    blobs = [encode(Image.fromarray(natural(375, 500, rng, noise=11)), quality=90) for _ in range(256)]
    batch = Batch(blobs)
    outs, dests = batch.outputs(0)
    figures = {}
    for interpolate in (True, False):
        decoder = open_decoder(backend, 256, interpolate=interpolate)
        stream = torch.cuda.current_stream()
        rates, blocked = [], []
        for run in range(7):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            status = decoder.decode(batch.sources, dests, 256, stream.cuda_stream)
            t1 = time.perf_counter()
            stream.synchronize()
            t2 = time.perf_counter()
            statuses = set(status)
            if run >= 2:
                rates.append(256 / (t2 - t0))
                blocked.append(t1 - t0)
        figures[f"interpolate={decoder.interpolate}"] = {
            "images_per_s": statistics.median(rates), "host_blocked_ms": 1e3 * statistics.median(blocked),
            "mean_kb": sum(map(len, blobs)) / 256 / 1024, "statuses": sorted(statuses)}
        decoder.close()
    try:  # torchvision's GPU decode of the same bytes, for scale
        import torchvision.io

        tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
        rates = []
        for run in range(7):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torchvision.io.decode_jpeg(tensors, device="cuda")
            torch.cuda.synchronize()
            if run >= 2:
                rates.append(256 / (time.perf_counter() - t0))
        figures["torchvision.io.decode_jpeg(device='cuda') images_per_s"] = statistics.median(rates)
    except Exception as err:  # noqa: BLE001 - context only
        figures["torchvision"] = repr(err)
    report(f"throughput {backend}", figures)
    print(backend, json.dumps(figures), file=sys.stderr)
    assert all(f["statuses"] == [_C.JPEG_DECODED] for k, f in figures.items() if k.startswith("interpolate"))


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize("backend", ["hardware", "cuda", "hybrid"])
def test_very_large_image(backend):
    rng = np.random.default_rng(derived_seed())
    h = w = 10000
    y = np.linspace(0, 255, h, dtype=np.float32)[:, None]
    x = np.linspace(0, 255, w, dtype=np.float32)[None, :]
    image = np.stack([np.broadcast_to(y, (h, w)), np.broadcast_to(x, (h, w)), (y + x) / 2], -1).astype(np.uint8)
    big = encode(Image.fromarray(image), quality=80)
    del image
    small = make_jpeg(rng, 64, 96)
    batch = Batch([small, big, small])
    decoder = open_decoder(backend, 3)
    statuses, images, _, blocked = batch.decode(decoder)
    report(f"10000x10000 {backend}", {"statuses": statuses, "host_blocked_s": blocked})
    assert statuses[0] == statuses[2] == _C.JPEG_DECODED
    assert statuses[1] in (_C.JPEG_DECODED, _C.JPEG_UNSUPPORTED)
    if statuses[1] == _C.JPEG_DECODED:
        reference = pil_rgb(big)
        rows = slice(0, h, 97)
        diff = np.abs(images[1][rows].astype(np.int16) - reference[rows].astype(np.int16))
        report(f"10000x10000 {backend}", dict(REPORT[f"10000x10000 {backend}"], max=int(diff.max()),
                                               mean=float(diff.mean())))
        assert within(backend, int(diff.max()), float(diff.mean()))
    decoder.close()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hardware", "cuda", "hybrid"])
def test_no_leak_over_50_decoders(backend):
    rng = np.random.default_rng(derived_seed())
    batch = Batch([make_jpeg(rng, 120, 160), make_jpeg(rng, 90, 60, "progressive")])

    def one_round():
        decoder = open_decoder(backend, 8)
        batch.decode(decoder)
        decoder.close()

    one_round()  # first-use costs (CUDA context parts, nvjpeg's own tables)
    gc.collect()
    torch.cuda.synchronize()
    free_before, fds_before = torch.cuda.mem_get_info()[0], len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        one_round()
    gc.collect()
    torch.cuda.synchronize()
    free_after, fds_after = torch.cuda.mem_get_info()[0], len(os.listdir("/proc/self/fd"))
    report(f"leak {backend}", {"device_bytes_lost": free_before - free_after, "fds": fds_after - fds_before})
    assert free_before - free_after < 64 << 20, (free_before, free_after)
    assert fds_after - fds_before <= 2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hardware", "cuda", "hybrid"])
def test_a_forked_copy_leaves_the_decoder_to_its_parent(backend):
    """A DataLoader worker forked while a decoder lives (torch's, in the H200 suite) garbage-collected
    its copy; nvjpeg's destroy calls there threw and aborted the worker. The copy is let go of, and a
    decode in it says why it cannot run; the parent's decoder works on."""
    rng = np.random.default_rng(derived_seed())
    batch = Batch([make_jpeg(rng, 64, 96) for _ in range(2)])
    decoder = open_decoder(backend, 4)
    first = batch.decode(decoder)[1]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only os._exit leaves it, whatever happens
        code = 3
        try:
            os.close(read)
            try:
                decoder.decode(batch.sources, b"\0" * 32, 2, 0)
                said = "decoded"
            except RuntimeError as err:
                said = str(err)
            os.write(write, said.encode()[:500])
            del decoder
            gc.collect()
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the child ended with wait status {status}"
    assert "forked copy" in said and "open one in this process" in said, said
    again = batch.decode(decoder)[1]
    assert all((a == b).all() for a, b in zip(first, again, strict=True))
    decoder.close()


@pytest.mark.gpu
def test_one_decoder_per_thread():
    rng = np.random.default_rng(derived_seed())
    batches = [Batch([make_jpeg(rng, 200, 300) for _ in range(8)]) for _ in range(2)]
    results = [None, None]

    def work(k):
        decoder = open_decoder("cuda", 8)
        stream = torch.cuda.Stream()
        results[k] = [batches[k].decode(decoder, stream=stream)[0] for _ in range(5)]
        decoder.close()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == results[1] == [[0] * 8] * 5
