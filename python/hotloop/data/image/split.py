"""Sharing a batch's decode between the GPU decoder and the workers.

NOTE [ Two pools for one batch ]
With a GPU decoder, every JPEG it takes used to go to it, and the workers only read bytes and drew
crops. When the decoder's call is what the loop waits for (the main thread blocks in nvjpeg for the
whole batch: maker.py), the workers' cores sit idle, and where the loop waits for the workers, the
decoder does. So, with GpuDecode(worker_decode=True), the workers decode a share of the JPEGs
themselves, as the CPU backend does (at a DCT scale where the crop allows), and ship pixels; the rest
go to the GPU decoder. (Off by default: docs/gpu-decode.md says what it did on the GPU.) Which share: the
one at which the slower pool takes least per batch, from what each measured on the batches before:

- the main thread, per image the decoder took: the decoder's call (c_gpu); per image a worker
  decoded: the upload of its pixels from the slot (c_upload);
- a worker, per image (its own perf_counter, in the table's worker_us column): the read, header and
  draw of an image it ships as JPEG bytes (c_read), the same plus the decode of one it decodes (c_cpu).

With `workers` processes and a share x of a batch of B, the main thread spends B ((1 - x) c_gpu +
x c_upload) and the workers B ((1 - x) c_read + x c_cpu) / workers. The share is the x in
[PROBE_SHARE, SPLIT_CAP] at which the slower of the two takes least: usually (c_upload < c_gpu, the
first falling with x; c_cpu > c_read, the second rising) where they are equal,
    x = (c_gpu - c_read / workers) / (c_gpu - c_upload + (c_cpu - c_read) / workers);
where the slot's pageable pixels cost the main thread as much to upload as the decoder's call per
image, PROBE_SHARE: nothing is gained. PROBE_SHARE keeps a few images a batch on the workers, so that
c_cpu stays measured. SPLIT_CAP bounds the pixels a batch ships (the ring's slots are sized for it:
gpu_decode.py). Each figure is a running average, so the share follows a change (the training step
taking more of the GPU, a slower file system) over a few dozen batches.

The share lives in one double of shared memory, which forked workers inherit; each worker takes every
(1 / x)-th image it could ship as JPEG bytes, by an error accumulator, so the random draws (crop, flip)
stay the transform's: who decodes changes nothing else.

Should the GPU decoder fail (an nvjpeg error mid-epoch), the share becomes 1 (without worker_decode it
is there too, held at 0 until then): the workers decode
everything, and the batches already on their way decode with PIL in the main process (maker.py), after
one warning; later epochs run the CPU backend.
"""
import multiprocessing

SPLIT_CAP = 0.25  # at most this share of a batch's JPEGs decoded by the workers
PROBE_SHARE = 1 / 64  # at least this share, so that the workers' decode cost stays measured
AVERAGE_WEIGHT = 0.1  # weight of the newest batch in the running averages


class DecodeShare:
    """The share of JPEGs the workers decode: set by the main process (SplitBalance), read by workers
    per sample."""

    def __init__(self):
        self._value = multiprocessing.RawValue("d", PROBE_SHARE)

    def get(self) -> float:
        return self._value.value

    def set(self, value):
        self._value.value = value


class ShareTaker:
    """A worker's choice, per image the GPU decoder could take, of decoding it here: the first one,
    so that the workers' cost is measured from the first batches on, then every time the share
    accumulated reaches one image (share x of the images, with no random draw)."""

    def __init__(self, share: DecodeShare):
        self.share = share
        self._owed = 1.0

    def decode_here(self) -> bool:
        x = self.share.get()
        if x <= 0.0:
            return False
        self._owed += x
        if self._owed >= 1.0:
            self._owed -= 1.0
            return True
        return False


class _Average:
    def __init__(self):
        self.value = None

    def add(self, total, count):
        if count <= 0:
            return
        v = total / count
        self.value = v if self.value is None else (1 - AVERAGE_WEIGHT) * self.value + AVERAGE_WEIGHT * v


class SplitBalance:
    """The main process's side: per batch, what each pool spent (observe); sets the share at which the
    slower pool takes least (NOTE [ Two pools for one batch ]). One that does not `adapt` holds the
    share at 0 (GpuDecode(worker_decode=False)) until the decoder fails."""

    def __init__(self, share: DecodeShare, workers: int, adapt=True):
        self.share, self.workers, self.adapt = share, max(1, workers), adapt
        self.gpu, self.upload, self.read, self.cpu = _Average(), _Average(), _Average(), _Average()
        self.failed = False
        if not adapt:
            share.set(0.0)

    def observe(self, gpu_images, gpu_seconds, worker_images, upload_seconds, read_seconds, cpu_seconds):
        """One batch: `gpu_images` decoded by the GPU decoder in `gpu_seconds` of its call, whose
        workers spent `read_seconds` on them; `worker_images` decoded by the workers in `cpu_seconds`
        of theirs, uploaded here in `upload_seconds`."""
        if self.failed or not self.adapt:
            return
        self.gpu.add(gpu_seconds, gpu_images)
        self.read.add(read_seconds, gpu_images)
        self.upload.add(upload_seconds, worker_images)
        self.cpu.add(cpu_seconds, worker_images)
        self.share.set(balanced_share(self.gpu.value, self.upload.value, self.read.value, self.cpu.value,
                                      self.workers, self.share.get()))

    def fail(self):
        """The GPU decoder failed: the workers decode everything from now on."""
        self.failed = True
        self.share.set(1.0)


def balanced_share(c_gpu, c_upload, c_read, c_cpu, workers, current):
    """The share in [PROBE_SHARE, SPLIT_CAP] at which the slower of the main thread and the workers takes
    least per batch (the smaller share of equals); `current` while a figure is not measured yet."""
    if None in (c_gpu, c_upload, c_read, c_cpu):
        return current

    def slower(x):
        return max((1 - x) * c_gpu + x * c_upload, ((1 - x) * c_read + x * c_cpu) / workers)

    # both times are straight lines in x: the least of their maximum is at a bound or where they cross
    shares = [PROBE_SHARE, SPLIT_CAP]
    denominator = c_gpu - c_upload + (c_cpu - c_read) / workers
    if denominator != 0:
        shares.append(min(SPLIT_CAP, max(PROBE_SHARE, (c_gpu - c_read / workers) / denominator)))
    return min(shares, key=lambda x: (slower(x), x))
