"""gpu_decode's nvjpeg decoder, opened in a thread of its own while the script goes on.

Opening nvjpeg's hardware decoder is slow, and as slow every time: nvjpegCreateEx and the decoder's
state each take a large share, and a second decoder in the same process costs the same again. Opened
at the first iter(), it would be most of the time before the first batch. A loader that knows its
device when it is made starts the open then (DataLoader.__init__ -> ImageMaker.open_early), and the
script's own set-up (the model, the optimizer) hides it; iter() waits only for what is left. For
"auto" the thread goes on down the chain of backends (the engines, then the hybrid backend) until one
opens, so that a GPU without engines gets its decoder in the background too.

JpegDecoder's constructor releases the GIL while nvjpeg works, so the thread takes nothing from
the script's own Python.
"""
import threading

from ... import _C
from ..at_exit import DECODER_OPENINGS, close_at_exit, forget


def open_decoder(device, backend, max_batch):
    """(JpegDecoder on `device`, None), or (None, the RuntimeError that refused it: no nvjpeg, no
    hardware decoder on this GPU...). Other exceptions propagate."""
    from .nvjpeg import nvjpeg_library_candidates

    try:
        return _C.JpegDecoder(nvjpeg_library_candidates(), device.index, backend, max_batch), None
    except RuntimeError as exc:
        return None, exc


def open_first(device, backends, max_batch):
    """(JpegDecoder, its backend, refusals): the first of `backends` that opens on `device`, after the
    (backend, RuntimeError) of each one before it that refused; (None, None, every refusal) if none opens.
    Other exceptions propagate."""
    refusals = []
    for backend in backends:
        decoder, refusal = open_decoder(device, backend, max_batch)
        if decoder is not None:
            return decoder, backend, refusals
        refusals.append((backend, refusal))
    return None, None, refusals


class DecoderOpening:
    """open_first(device, backends, max_batch) running in a daemon thread; result() waits for it."""

    def __init__(self, device, backends, max_batch):
        self.device, self.backends = device, tuple(backends)
        self._outcome = None  # open_first's result, or the exception the thread raised
        self._thread = threading.Thread(target=self._run, args=(device, self.backends, max_batch),
                                        name="hotloop-nvjpeg-open", daemon=True)
        self._thread.start()
        close_at_exit(self, DECODER_OPENINGS)  # no decoder left opening while CUDA is torn down

    def _run(self, device, backends, max_batch):
        try:
            self._outcome = open_first(device, backends, max_batch)
        except BaseException as exc:  # handed to the thread that asks for the result
            self._outcome = exc

    def result(self):
        """open_first's (decoder, backend, refusals) once the thread is done; what else it raised, raised
        here."""
        self._thread.join()
        forget(self)
        outcome = self._outcome
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def close(self):
        """Wait for the open and close what it opened (the device changed, or the loader was closed)."""
        try:
            decoder, _, _ = self.result()
        except Exception:  # nothing was opened
            return
        if decoder is not None:
            decoder.close()
