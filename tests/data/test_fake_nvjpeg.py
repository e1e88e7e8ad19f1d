"""_C.JpegDecoder's C paths without a GPU: a fake nvjpeg (fake_nvjpeg/fake_nvjpeg.c) opened beside the fake CUDA
driver, whose decodes write a pattern naming the nvjpeg path that decoded each image and the bytes it came from.
Every backend's batches, halved failures and host threads checked image by image and pixel by pixel, with
what nvjpeg requires of its caller (call order, one thread per state) checked by the fake."""
import ctypes
import os
import pickle
import shutil
import subprocess
import threading

import numpy as np
import pytest

from hotloop import _C

from ..seeding import derived_seed
from ..test_cuda_driver import fake_cuda as fake_driver  # noqa: F401  (a fixture: the fake libcuda)
from ..test_cuda_driver import needs_cuda_build, run
from .test_jpeg_decode import make_jpeg

FAKE_NVJPEG_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fake_nvjpeg",
                                  "fake_nvjpeg.c")

GUARD = 0xA5  # what every destination byte holds before a decode: one the decode must not touch stays so

# the fake's tag (the R of every pixel) for each path that decodes: nvjpegDecodeBatched on a hardware handle,
# on another handle; the decoupled API with the hybrid decoder, with another decoder
HARDWARE_BATCHED, BATCHED, HYBRID_DECOUPLED, DECOUPLED = 1, 2, 3, 4

# (status byte, tag) of each kind of JPEG by backend; "baseline" stands for 4:2:0, 4:2:2, 4:4:4 and greyscale
PATHS = {
    "hardware": {"baseline": (_C.JPEG_DECODED, HARDWARE_BATCHED), "progressive": (_C.JPEG_UNSUPPORTED, None),
                 "corrupt": (_C.JPEG_CORRUPT, None)},
    "cuda": {"baseline": (_C.JPEG_DECODED, BATCHED), "progressive": (_C.JPEG_DECODED, DECOUPLED),
             "corrupt": (_C.JPEG_CORRUPT, None)},
    "hybrid": {"baseline": (_C.JPEG_DECODED, HYBRID_DECOUPLED), "progressive": (_C.JPEG_DECODED, HYBRID_DECOUPLED),
               "corrupt": (_C.JPEG_CORRUPT, None)},
}


@pytest.fixture(scope="module")
def fake_nvjpeg(tmp_path_factory):
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    path = str(tmp_path_factory.mktemp("fake_nvjpeg") / "libfake_nvjpeg.so")
    # warnings fail the build: the fake stays clean under the warnings hotloop's own C meets
    subprocess.check_call([cc, "-shared", "-fPIC", "-O1", "-std=c11", "-Wall", "-Wextra", "-Werror", "-o", path,
                           FAKE_NVJPEG_SOURCE])
    return path


class Jpeg:
    """A JPEG PIL made from fresh random content, its size and kind ("420", "422", "444", "grey",
    "progressive", or "corrupt": 4:2:0 with a COM segment holding the fake's corruption mark)."""

    def __init__(self, rng, height, width, kind):
        if kind == "corrupt":
            self.data = make_jpeg(rng, height, width, "420", comment=b"FAKE-CORRUPT")
            assert b"FAKE-CORRUPT" in self.data
        else:
            self.data = make_jpeg(rng, height, width, kind)
        self.height, self.width, self.kind = height, width, kind

    def path(self, paths):
        """(status byte, tag) its decode gives, by `paths` (one of PATHS' values)"""
        return paths.get(self.kind, paths["baseline"])

    def pattern(self, tag):
        """the pixel the fake writes for this JPEG: the tag, a checksum and the length of its bytes"""
        return np.array([tag, sum(self.data) % 251, len(self.data) % 256], np.uint8)

    def __repr__(self):
        return f"{self.kind} {self.height}x{self.width} ({len(self.data)} bytes)"


def mixed_jpegs(rng):
    """Each kind the backends tell apart, 8 x 8 and 500 x 700 among them, the other sizes drawn."""
    fixed = [(8, 8, "420"), (500, 700, "420"), (8, 8, "progressive"), (16, 16, "444"), (9, 15, "grey")]
    drawn = [(int(rng.integers(8, 300)), int(rng.integers(8, 400)), kind)
             for kind in ("420", "420", "422", "444", "grey", "progressive", "corrupt")]
    return [Jpeg(rng, h, w, kind) for h, w, kind in fixed + drawn]


DECODE_SCRIPT = """
    import ctypes, json, os, pickle
    import numpy as np
    from hotloop import _C
    with open(os.environ["FAKE_NVJPEG_JOB"], "rb") as f:
        job = pickle.load(f)
    fake = ctypes.CDLL(job["library"])
    fake.fake_nvjpeg_last_misuse.restype = ctypes.c_char_p

    def failure(err):
        return {"type": type(err).__name__, "message": str(err), "call": getattr(err, "call", None),
                "code": getattr(err, "code", None)}

    def misuses():
        return {"misuses": fake.fake_nvjpeg_misuses(), "races": fake.fake_nvjpeg_races(),
                "last_misuse": fake.fake_nvjpeg_last_misuse().decode()}

    out = {"calls": [], "open": None, "close": None}
    try:
        decoder = _C.JpegDecoder([job["library"]], 0, job["backend"], job["max_batch"], **job["options"])
    except RuntimeError as err:
        out["open"] = failure(err)
        decoder = None
    out["opening"] = misuses()
    if decoder is not None:
        out["version"], out["engines"] = list(decoder.version), decoder.hardware_engines
        dests = {}
        for n, call in enumerate(job["calls"]):
            if call["threads"] is not None:
                decoder.threads = call["threads"]
            jpegs = [np.frombuffer(job["jpegs"][i], np.uint8) for i in call["images"]]
            # a guard row above and below each image's rows
            buffers = [np.full((job["heights"][i] + 2, pitch), job["guard"], np.uint8)
                       for i, pitch in zip(call["images"], call["pitches"])]
            sources = np.array([(j.ctypes.data, j.size) for j in jpegs], np.int64).tobytes()
            targets = np.array([(b.ctypes.data + b.shape[1], b.shape[1]) for b in buffers], np.int64).tobytes()
            fake.fake_nvjpeg_reset()
            try:
                status, error = list(decoder.decode(sources, targets, len(jpegs), 0)), None
            except RuntimeError as err:
                status, error = None, failure(err)
            out["calls"].append(dict(misuses(), status=status, error=error,
                                     images=[fake.fake_nvjpeg_images(t) for t in range(1, 5)],
                                     most_concurrent_host=fake.fake_nvjpeg_most_concurrent_host(),
                                     lane_share=decoder.lane_share, lane_images=decoder.lane_images,
                                     lane_failure=decoder.lane_failure))
            dests.update({f"{n}_{k}": b for k, b in enumerate(buffers)})
        np.savez(job["out"], **dests)
        fake.fake_nvjpeg_reset()
        try:
            decoder.close()
        except RuntimeError as err:
            out["close"] = failure(err)
        out["closing"] = misuses()
    out["live"] = fake.fake_nvjpeg_live_objects()
    print(json.dumps(out))
"""


def decode(libraries, tmp_path, jpegs, backend, calls, rng, max_batch=16, env=None, **options):
    """`calls` (each a list of indices into `jpegs`, or (indices, threads set before the call)) by a
    JpegDecoder(backend) in a fresh process with the fakes, each image's destination a pitch of width * 3
    or a little more. (what the process reports, each call's destinations: the images' rows between
    guard rows)"""
    fake_cuda, fake_nvjpeg = libraries
    job_calls = []
    for call in calls:
        images, threads = call if isinstance(call, tuple) else (call, None)
        pitches = [jpegs[i].width * 3 + int(rng.choice([0, 1, 7, 64])) for i in images]
        job_calls.append({"images": list(images), "threads": threads, "pitches": pitches})
    job = {"library": fake_nvjpeg, "backend": backend, "max_batch": max_batch, "options": options,
           "calls": job_calls, "jpegs": [j.data for j in jpegs], "heights": [j.height for j in jpegs],
           "guard": GUARD, "out": str(tmp_path / "dests.npz")}
    with open(tmp_path / "job.pickle", "wb") as f:
        pickle.dump(job, f)
    got = run(DECODE_SCRIPT, HOTLOOP_LIBCUDA=fake_cuda, FAKE_NVJPEG_JOB=str(tmp_path / "job.pickle"), **(env or {}))
    dests = []
    if got["open"] is None:
        with np.load(job["out"]) as saved:
            dests = [[saved[f"{n}_{k}"] for k in range(len(call["images"]))] for n, call in enumerate(job_calls)]
    return got, dests


def check_clean(got, opened=True):
    """The decoder opened (or not), closed, and nvjpeg was used as it must be on the way; close() destroyed
    every object nvjpeg made for it (for a decoder that did not open: whatever it made before failing)."""
    assert (got["open"] is None) == opened, got["open"] or "the decoder opened"
    assert got["close"] is None, got["close"]
    for stage in ("opening", "closing") if opened else ("opening",):
        assert got[stage]["misuses"] == 0 and got[stage]["races"] == 0, (stage, got[stage])
    assert got["live"] == 0


def check_call(jpegs, images, paths, result, dests):
    """Each image's status and every byte of its destination: the pattern of the path that decoded it on
    its rows' first width * 3 bytes, the guard elsewhere; each image decoded once; nvjpeg used as it must be.
    paths: one of PATHS' values, or a list of (status byte, tag), one per image."""
    assert result["error"] is None, result["error"]
    assert result["misuses"] == 0, result["last_misuse"]
    assert result["races"] == 0
    painted = [0, 0, 0, 0]
    for k, (i, got) in enumerate(zip(images, dests, strict=True)):
        jpeg = jpegs[i]
        status, tag = paths[k] if isinstance(paths, list) else jpeg.path(paths)
        assert result["status"][k] == status, f"image {k}: {jpeg}"
        want = np.full_like(got, GUARD)
        if tag is not None:
            want[1:jpeg.height + 1, :jpeg.width * 3] = np.tile(jpeg.pattern(tag), (jpeg.height, jpeg.width))
            painted[tag - 1] += 1
        differ = got != want
        if differ.any():
            row, byte = np.argwhere(differ)[0]
            pytest.fail(f"image {k}: {jpeg}, pitch {got.shape[1]}: {differ.sum()} bytes differ, the first at row "
                        f"{row - 1}, byte {byte}: {got[row, byte]} instead of {want[row, byte]}")
    assert result["images"] == painted  # each decoded once, by the path its tag names


def lanes(backend):
    """JpegDecoder's threads: two lanes for the hybrid backend; the others left at their default"""
    return {"threads": 2} if backend == "hybrid" else {}


@pytest.fixture
def libraries(fake_driver, fake_nvjpeg):
    return fake_driver, fake_nvjpeg


@pytest.fixture
def rng():
    return np.random.default_rng(derived_seed())


@needs_cuda_build
@pytest.mark.parametrize("backend", ["hardware", "cuda", "hybrid"])
def test_every_backend_decodes_each_image_by_its_path(libraries, tmp_path, rng, backend):
    """Two calls of different sizes (a batched state initialised again): progressive JPEGs refused by the
    engines and decoded one by one by the cuda backend, the corrupt one found (a batched backend halving
    the batch that failed), every other image decoded on its rows and nothing written beside them."""
    jpegs = mixed_jpegs(rng)
    first = [int(i) for i in rng.permutation(len(jpegs))]
    second = first[:5]
    got, dests = decode(libraries, tmp_path, jpegs, backend, [first, second], rng, **lanes(backend))
    check_clean(got)
    assert got["version"] == [13, 0, 0]
    assert got["engines"] == ([7, 1] if backend == "hardware" else None)
    for n, images in enumerate([first, second]):
        check_call(jpegs, images, PATHS[backend], got["calls"][n], dests[n])


@needs_cuda_build
def test_hybrid_lanes_decode_on_threads_each_on_its_own_state(libraries, tmp_path, rng):
    """32 images over 4 threads: several host decodes at once, never two on one state or jpeg stream; a
    change of threads between calls (fewer, then more lanes) keeps every image decoded once."""
    kinds = ["420", "444", "grey", "progressive"]
    jpegs = [Jpeg(rng, int(rng.integers(8, 64)), int(rng.integers(8, 64)), kinds[k % 4]) for k in range(32)]
    everything = list(range(32))
    got, dests = decode(libraries, tmp_path, jpegs, "hybrid", [everything, (everything, 1), (everything, 4)], rng,
                        max_batch=32, env={"FAKE_NVJPEG_HYBRID_US": "2000"}, threads=4)
    check_clean(got)
    for result, destinations in zip(got["calls"], dests, strict=True):
        check_call(jpegs, everything, PATHS["hybrid"], result, destinations)
    most = [result["most_concurrent_host"] for result in got["calls"]]
    assert most[0] >= 2 and most[1] == 1 and most[2] >= 2, most  # threads=1: the caller's thread alone


@needs_cuda_build
def test_a_gpu_without_engines(libraries, tmp_path, rng):
    """FAKE_NVJPEG_ENGINES=0: the hardware backend refuses to open, saying why; the hybrid one decodes."""
    jpegs = [Jpeg(rng, 24, 40, "420"), Jpeg(rng, 8, 8, "grey")]
    env = {"FAKE_NVJPEG_ENGINES": "0"}
    got, _ = decode(libraries, tmp_path, jpegs, "hardware", [[0, 1]], rng, env=env)
    check_clean(got, opened=False)
    assert got["open"]["type"] == "NvjpegError" and got["open"]["call"] == "nvjpegCreateEx", got["open"]
    assert "NVJPEG_STATUS_ARCH_MISMATCH" in got["open"]["message"]
    assert "no hardware JPEG decoder" in got["open"]["message"]
    got, dests = decode(libraries, tmp_path, jpegs, "hybrid", [[0, 1]], rng, env=env, threads=2)
    check_clean(got)
    check_call(jpegs, [0, 1], PATHS["hybrid"], got["calls"][0], dests[0])


@needs_cuda_build
@pytest.mark.parametrize("backend, call, kind", [
    ("hybrid", "nvjpegDecodeJpegDevice", "420"),
    ("hardware", "nvjpegDecodeBatched", "444"),
    ("cuda", "nvjpegDecodeJpegHost", "progressive"),
])
def test_a_failing_nvjpeg_call_raises_naming_it(libraries, tmp_path, rng, backend, call, kind):
    """A call that fails for every image (NVJPEG_STATUS_EXECUTION_FAILED: not the images' fault) raises
    NvjpegError naming it once each image failed alone (a batch halved down to single images); the decoder
    still closes."""
    jpegs = [Jpeg(rng, int(rng.integers(8, 80)), int(rng.integers(8, 80)), kind) for _ in range(5)]
    got, dests = decode(libraries, tmp_path, jpegs, backend, [list(range(5))], rng,
                        env={"FAKE_NVJPEG_FAIL": f"{call}:6"}, **lanes(backend))
    check_clean(got)
    result = got["calls"][0]
    error = result["error"]
    assert error is not None and error["type"] == "NvjpegError", result
    assert error["call"] == call and error["code"] == 6
    assert error["message"].startswith(f"{call} failed with NVJPEG_STATUS_EXECUTION_FAILED (6)"), error
    assert "every image of the call failed" in error["message"]
    assert result["images"] == [0, 0, 0, 0] and result["misuses"] == 0, result
    assert all((d == GUARD).all() for d in dests[0])


@needs_cuda_build
def test_a_lane_that_could_not_be_made_is_made_again(libraries, tmp_path, rng):
    """An allocation nvjpeg refuses once, while a lane is made (its first jpeg stream): that call's images
    come back unsupported, and the next call makes the lane again and decodes them."""
    jpegs = [Jpeg(rng, int(rng.integers(8, 80)), int(rng.integers(8, 80)), "420") for _ in range(3)]
    got, dests = decode(libraries, tmp_path, jpegs, "hybrid", [[0, 1, 2], [0, 1, 2]], rng, threads=1,
                        env={"FAKE_NVJPEG_FAIL": "nvjpegJpegStreamCreate:5:1"})  # 5: NVJPEG_STATUS_ALLOCATOR_FAILURE
    check_clean(got)
    assert got["calls"][0]["status"] == [_C.JPEG_UNSUPPORTED] * 3, got["calls"][0]
    check_call(jpegs, [0, 1, 2], PATHS["hybrid"], got["calls"][1], dests[1])


# what comes of each kind when every nvjpegDecodeBatched call says NVJPEG_STATUS_JPEG_NOT_SUPPORTED
REFUSED_PATHS = {
    "hardware": {"baseline": (_C.JPEG_UNSUPPORTED, None)},
    "cuda": {"baseline": (_C.JPEG_DECODED, DECOUPLED), "corrupt": (_C.JPEG_CORRUPT, None)},
}


@needs_cuda_build
@pytest.mark.parametrize("backend", ["hardware", "cuda"])
def test_what_the_batched_call_refuses(libraries, tmp_path, rng, backend):
    """Every batch refused: halved down to single images, each unsupported on the engines, and decoded
    one by one through the decoupled API by the cuda backend (the corrupt one found corrupt there)."""
    jpegs = mixed_jpegs(rng)
    everything = list(range(len(jpegs)))
    got, dests = decode(libraries, tmp_path, jpegs, backend, [everything], rng,
                        env={"FAKE_NVJPEG_FAIL": "nvjpegDecodeBatched:4"})
    check_clean(got)
    check_call(jpegs, everything, REFUSED_PATHS[backend], got["calls"][0], dests[0])


class Image(ctypes.Structure):
    _fields_ = [("channel", ctypes.c_void_p * 4), ("pitch", ctypes.c_size_t * 4)]


def test_the_fake_refuses_steps_out_of_order_and_sees_races(fake_nvjpeg, rng, monkeypatch):
    """The fake itself, by ctypes: each decoupled step before the one it needs, a missing buffer or
    output format, a handle destroyed before what was made on it: refused and counted; two threads on
    one state: a race. (The other tests' zero misuses and races mean something only if it sees these.)"""
    monkeypatch.setenv("FAKE_NVJPEG_HYBRID_US", "50000")
    monkeypatch.delenv("FAKE_NVJPEG_FAIL", raising=False)
    fake = ctypes.CDLL(fake_nvjpeg)
    fake.fake_nvjpeg_last_misuse.restype = ctypes.c_char_p
    fake.fake_nvjpeg_reset()
    live = fake.fake_nvjpeg_live_objects()
    handle, decoder, state, params, stream, pinned, device = (ctypes.c_void_p() for _ in range(7))
    assert fake.nvjpegCreateEx(1, None, None, 0, ctypes.byref(handle)) == 0
    assert fake.nvjpegDecoderCreate(handle, 1, ctypes.byref(decoder)) == 0
    assert fake.nvjpegDecoderStateCreate(handle, decoder, ctypes.byref(state)) == 0
    assert fake.nvjpegDecodeParamsCreate(handle, ctypes.byref(params)) == 0
    assert fake.nvjpegJpegStreamCreate(handle, ctypes.byref(stream)) == 0
    assert fake.nvjpegBufferPinnedCreate(handle, None, ctypes.byref(pinned)) == 0
    assert fake.nvjpegBufferDeviceCreate(handle, None, ctypes.byref(device)) == 0
    jpeg = Jpeg(rng, 12, 20, "420")
    assert fake.nvjpegJpegStreamParse(handle, jpeg.data, ctypes.c_size_t(len(jpeg.data)), 0, 0, stream) == 0
    out = np.full((jpeg.height, jpeg.width * 3), GUARD, np.uint8)
    image = Image((out.ctypes.data, None, None, None), (jpeg.width * 3, 0, 0, 0))

    def host():
        return fake.nvjpegDecodeJpegHost(handle, decoder, state, params, stream)

    def to_device():
        return fake.nvjpegDecodeJpegTransferToDevice(handle, decoder, state, stream, None)

    def on_device():
        return fake.nvjpegDecodeJpegDevice(handle, decoder, state, ctypes.byref(image), None)

    refused = [on_device() == 6, to_device() == 6, host() == 2]  # no pinned buffer attached
    assert fake.nvjpegStateAttachPinnedBuffer(state, pinned) == 0
    refused.append(host() == 2)  # no output format
    assert fake.nvjpegDecodeParamsSetOutputFormat(params, 5) == 0
    assert host() == 0
    refused.append(to_device() == 2)  # no device buffer attached
    assert fake.nvjpegStateAttachDeviceBuffer(state, device) == 0
    assert to_device() == 0 and on_device() == 0
    refused += [on_device() == 6, fake.nvjpegDestroy(handle) == 2]
    assert refused == [True] * 7 and fake.fake_nvjpeg_misuses() == 7, fake.fake_nvjpeg_last_misuse()
    assert fake.fake_nvjpeg_last_misuse().startswith(b"nvjpegDestroy: ")
    assert (out == np.tile(jpeg.pattern(HYBRID_DECOUPLED), (jpeg.height, jpeg.width))).all()
    assert fake.fake_nvjpeg_images(HYBRID_DECOUPLED) == 1

    # ctypes lets go of the GIL for the call: both threads sleep inside nvjpegDecodeJpegHost at once
    start = threading.Barrier(2)
    results = []

    def decode_host():
        start.wait()
        results.append(host())

    threads = [threading.Thread(target=decode_host) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [0, 0]
    assert fake.fake_nvjpeg_races() >= 1 and fake.fake_nvjpeg_most_concurrent_host() == 2

    assert fake.nvjpegJpegStateDestroy(state) == 0
    for destroy, obj in [(fake.nvjpegJpegStreamDestroy, stream), (fake.nvjpegBufferPinnedDestroy, pinned),
                         (fake.nvjpegBufferDeviceDestroy, device), (fake.nvjpegDecodeParamsDestroy, params),
                         (fake.nvjpegDecoderDestroy, decoder), (fake.nvjpegDestroy, handle)]:
        assert destroy(obj) == 0
    assert fake.fake_nvjpeg_live_objects() == live



def beside_paths(jpegs, images, dests):
    """(status byte, tag) per image of a call on the engines with lanes beside them: the corrupt one found
    corrupt and the progressive ones decoded by the lanes, whatever pool took it; any other by the pool
    whose tag its first pixel holds, the engines or the lanes (check_call then checks every byte)."""
    paths = []
    for k, i in enumerate(images):
        kind = jpegs[i].kind
        if kind == "corrupt":
            paths.append((_C.JPEG_CORRUPT, None))
        elif kind == "progressive":
            paths.append((_C.JPEG_DECODED, HYBRID_DECOUPLED))
        else:
            tag = int(dests[k][1, 0])
            assert tag in (HARDWARE_BATCHED, HYBRID_DECOUPLED), f"image {k}: {jpegs[i]}: tag {tag}"
            paths.append((_C.JPEG_DECODED, tag))
    return paths


@needs_cuda_build
def test_threads_beside_the_engines_decode_each_image_once(libraries, tmp_path, rng):
    """The hardware backend with two threads beside the engines (NOTE [ Lanes beside the engines ] in
    csrc/nvjpeg_beside.c): in every call each image decoded once, by the engines or by the hybrid lanes,
    both pools taking a part; the progressive JPEGs, which the engines refuse, by the lanes; the corrupt
    one found by whichever pool took it. Then threads=0: the engines alone, as without lanes."""
    jpegs = mixed_jpegs(rng)
    everything = [int(i) for i in rng.permutation(len(jpegs))]
    calls = [everything] * 4 + [(everything, 0)]
    got, dests = decode(libraries, tmp_path, jpegs, "hardware", calls, rng, threads=2)
    check_clean(got)
    progressive = sum(j.kind == "progressive" for j in jpegs)
    for n, (result, destinations) in enumerate(zip(got["calls"][:4], dests, strict=False)):
        check_call(jpegs, everything, beside_paths(jpegs, everything, destinations), result, destinations)
        by_engines, by_lanes = result["images"][HARDWARE_BATCHED - 1], result["images"][HYBRID_DECOUPLED - 1]
        assert by_engines > 0 and by_lanes > progressive, (n, result["images"])
        assert 0.02 <= result["lane_share"] <= 0.98
    assert got["calls"][3]["lane_images"] >= 4 * (progressive + 1)
    check_call(jpegs, everything, PATHS["hardware"], got["calls"][4], dests[4])


@needs_cuda_build
@pytest.mark.parametrize("faster", ["engines", "lanes"])
def test_the_lanes_share_follows_the_faster_pool(libraries, tmp_path, rng, faster):
    """The share of each batch's pixels the lanes take is learnt from how long each pool took on the
    batch before: with the engines (in the fake) many times faster per image than two lanes, it falls
    from its first value toward what the lanes can match; with the lanes faster, it rises past a half.
    Both pools keep a part of every batch, so both stay measured."""
    jpegs = [Jpeg(rng, 48, 64, "420") for _ in range(24)]
    everything = list(range(24))
    # sleeps long enough that a loaded machine's late wake-ups do not change which pool is faster
    env = ({"FAKE_NVJPEG_HARDWARE_US": "300", "FAKE_NVJPEG_HYBRID_US": "12000"} if faster == "engines" else
           {"FAKE_NVJPEG_HARDWARE_US": "12000", "FAKE_NVJPEG_HYBRID_US": "300"})
    got, dests = decode(libraries, tmp_path, jpegs, "hardware", [everything] * 10, rng, max_batch=24, env=env,
                        threads=2)
    check_clean(got)
    shares = [result["lane_share"] for result in got["calls"]]
    for result, destinations in zip(got["calls"], dests, strict=True):
        check_call(jpegs, everything, beside_paths(jpegs, everything, destinations), result, destinations)
        by_engines, by_lanes = result["images"][HARDWARE_BATCHED - 1], result["images"][HYBRID_DECOUPLED - 1]
        assert by_engines > 0 and by_lanes > 0, (shares, result["images"])
    if faster == "engines":
        assert shares[-1] < 0.1, shares
    else:
        assert shares[-1] > 0.6, shares


@needs_cuda_build
def test_lanes_that_fail_stop_and_the_engines_go_on(libraries, tmp_path, rng):
    """nvjpeg failing the lanes' every image (NVJPEG_STATUS_EXECUTION_FAILED, no fault of the images): no
    exception, the engines' images decoded, the lanes' ones refused with nothing written (the caller
    decodes refused images itself), lane_failure naming the call; the next call on the engines alone."""
    kinds = ["420", "444", "grey", "progressive"]
    jpegs = [Jpeg(rng, int(rng.integers(8, 64)), int(rng.integers(8, 64)), kinds[k % 4]) for k in range(16)]
    everything = list(range(16))
    got, dests = decode(libraries, tmp_path, jpegs, "hardware", [everything, everything], rng,
                        env={"FAKE_NVJPEG_FAIL": "nvjpegDecodeJpegDevice:6"}, threads=2)
    check_clean(got)
    first, second = got["calls"]
    paths = [(_C.JPEG_DECODED, HARDWARE_BATCHED) if status == _C.JPEG_DECODED else (_C.JPEG_UNSUPPORTED, None)
             for status in first["status"]]
    check_call(jpegs, everything, paths, first, dests[0])
    progressive = sum(j.kind == "progressive" for j in jpegs)  # the lanes' whatever the share, and one more
    assert first["status"].count(_C.JPEG_UNSUPPORTED) > progressive and first["images"][HARDWARE_BATCHED - 1] > 0
    assert first["lane_failure"] == "nvjpegDecodeJpegDevice failed with NVJPEG_STATUS_EXECUTION_FAILED (6)"
    assert first["lane_images"] == 0
    check_call(jpegs, everything, PATHS["hardware"], second, dests[1])
    assert second["lane_failure"] == first["lane_failure"]
