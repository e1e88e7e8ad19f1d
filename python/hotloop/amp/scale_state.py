"""The scale side of hotloop.GradScaler: its settings checked, the scale's update on the device, and its
state (getters and setters, state_dict, pickling). ScaleState is a base class of GradScaler and
keeps torch's attribute names (``_scale``, ``_growth_tracker``, the factors and interval, ``_init_scale``)."""
import math
import weakref
from collections import defaultdict

import torch

from .. import _C
from .._arguments import expect_count, expect_number
from .tensor_table import runs_eagerly

try:  # torch's own enum, so that code comparing a stage with torch's OptState works with this scaler
    from torch.amp.grad_scaler import OptState
except ImportError:  # torch < 2.3 keeps it under torch.cuda.amp
    from torch.cuda.amp.grad_scaler import OptState


def refresh_per_optimizer_state():
    # torch's two keys and nothing else: code (and torch's tests) compare this dict with torch's
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def device_type(device):
    """'cuda' or 'cpu' for a device spec torch's GradScaler takes: 'cuda', 'cuda:1', 'cpu:0', 'CPU',
    torch.device('cuda', 1). As with torch, the spec says which kind of device, not where the scale
    lives: the scale goes to the device of the first tensor scale() is given."""
    if isinstance(device, torch.device):
        kind = device.type
    elif isinstance(device, str):
        kind = device.split(":", 1)[0].strip().lower()
    else:
        raise TypeError(f"device: expected a str or torch.device such as 'cuda' or 'cuda:1', got "
                        f"{type(device).__name__}")
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"device: expected a cuda or cpu device such as 'cuda', 'cuda:1' or 'cpu', got {device!r} "
                         f"(hotloop.GradScaler has kernels for these two)")
    return kind


def number(name, value):
    return expect_number("GradScaler", name, value)


def interval(name, value):
    return expect_count("GradScaler", name, value, least=1)


def check_factors(growth_factor, backoff_factor, growth_interval):
    """torch's two checks (AssertionError, as torch raises), then what torch lets through in silence
    and then misbehaves on: a NaN factor, a backoff that zeroes or flips the scale, a growth interval
    that is not a positive int (torch fails at the first update, or never grows)."""
    number("growth_factor", growth_factor)
    number("backoff_factor", backoff_factor)
    if growth_factor <= 1.0:
        raise AssertionError("The growth factor must be > 1.0.")
    if backoff_factor >= 1.0:
        raise AssertionError("The backoff factor must be < 1.0.")
    if math.isnan(growth_factor):
        raise ValueError("growth_factor: expected a number > 1.0, got nan")
    if math.isnan(backoff_factor) or backoff_factor <= 0.0:
        raise ValueError(f"backoff_factor: expected a number in (0, 1), got {backoff_factor}")
    interval("growth_interval", growth_interval)


class ScaleState:
    """The scale, its update and its state, for GradScaler (see the module's docstring). update() reads
    the found_infs the checks recorded and adds them with GradChecks._sum_found."""

    @runs_eagerly  # see NOTE [ hotloop under torch.compile ]
    def update(self, new_scale=None) -> None:
        """Update the scale on the device: back off when a step was skipped, grow after
        ``growth_interval`` clean steps in a row (as torch), with hysteresis and min/max when set."""
        if not self._enabled:
            return
        _scale, _growth_tracker = self._check_scale_growth_tracker("update")
        found_infs = [found_inf for state in self._per_optimizer_states.values()
                      for found_inf in state["found_inf_per_device"].values()]
        if new_scale is not None:
            if isinstance(new_scale, (float, int)) and not isinstance(new_scale, bool):
                self._scale.fill_(float(new_scale))
            else:
                reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                          "torch.FloatTensor with requires_grad=False.")
                if new_scale.device.type != self._device:
                    raise AssertionError(reason)
                if new_scale.numel() != 1:
                    raise AssertionError(reason)
                if new_scale.requires_grad is True:
                    raise AssertionError(reason)
                self._scale.copy_(new_scale)
            if found_infs:  # the scale was set by hand; still count a skipped step
                self._launch_update(found_infs, adjust=False)
        else:
            if len(found_infs) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            self._launch_update(found_infs, adjust=True)
        if found_infs:
            self._last_found_inf = found_infs[0] if len(found_infs) == 1 else self._sum_found(found_infs)
        self._updates += 1
        self._per_optimizer_states = defaultdict(refresh_per_optimizer_state)
        self._pending = {}

    def _launch_update(self, found_infs, adjust):
        dev = self._scale.device
        # gradients may live on other devices than the scale; a copy to the CPU must land before C reads it
        found_infs = [f.to(dev, non_blocking=dev.type == "cuda") for f in found_infs]
        if len(found_infs) > _C.AMP_MAX_FOUND:
            found_infs = [torch.stack(found_infs).sum()]
        stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
        _C.amp_update(device=dev.index if dev.type == "cuda" else -1, scale=self._scale.data_ptr(),
                      growth_tracker=self._growth_tracker.data_ptr(), state=self._amp_state.data_ptr(),
                      found=tuple(f.data_ptr() for f in found_infs), growth_factor=float(self._growth_factor),
                      backoff_factor=float(self._backoff_factor), growth_interval=int(self._growth_interval),
                      hysteresis=self._hysteresis,
                      min_scale=float(self._min_scale) if self._min_scale is not None else 0.0,
                      max_scale=float(self._max_scale) if self._max_scale is not None else math.inf,
                      adjust=adjust, stream=stream)
        # keep the found tensors alive until the kernel has read them (stream order does the rest)
        self._update_inputs = found_infs

    def _get_scale_async(self):
        return self._scale

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Waits for the device."""
        if self._enabled:
            return self._init_scale if (scale := self._get_scale_async()) is None else scale.item()
        return 1.0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = number("new_factor", new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = number("new_factor", new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = interval("new_interval", new_interval)

    def _get_growth_tracker(self) -> int:
        if self._enabled:
            return self._init_growth_tracker if self._growth_tracker is None else self._growth_tracker.item()
        return 0

    def is_enabled(self) -> bool:
        return self._enabled

    def _get_amp_state(self):
        if self._amp_state is None:
            return self._init_skipped, self._init_hysteresis
        values = self._amp_state.tolist()
        return values[_C.AMP_STATE_SKIPPED], values[_C.AMP_STATE_HYSTERESIS]

    @runs_eagerly  # see NOTE [ hotloop under torch.compile ]
    def state_dict(self) -> dict:
        """torch's five entries (loadable by torch.amp.GradScaler), plus "hysteresis",
        "_hysteresis_tracker", "min_scale", "max_scale" only where they differ from the defaults."""
        if not self._enabled:
            return {}
        state = {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }
        if self._hysteresis != 1:
            state["hysteresis"] = self._hysteresis
            state["_hysteresis_tracker"] = self._get_amp_state()[1]
        if self._min_scale is not None:
            state["min_scale"] = self._min_scale
        if self._max_scale is not None:
            state["max_scale"] = self._max_scale
        return state

    @runs_eagerly  # see NOTE [ hotloop under torch.compile ]
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this class or of torch.amp.GradScaler (settings it lacks are kept)."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        # checked before anything changes; a NaN scale loads and stays NaN, as with torch
        number("state_dict['scale']", state_dict["scale"])
        check_factors(state_dict["growth_factor"], state_dict["backoff_factor"], state_dict["growth_interval"])
        tracker = state_dict["_growth_tracker"]
        if isinstance(tracker, bool) or not isinstance(tracker, int) or tracker < 0:
            raise TypeError(f"state_dict['_growth_tracker']: expected an int >= 0, got {tracker!r}")
        self._init_scale = state_dict["scale"]
        if self._scale is not None:
            self._scale.fill_(state_dict["scale"])
        self._growth_factor = state_dict["growth_factor"]
        self._backoff_factor = state_dict["backoff_factor"]
        self._growth_interval = state_dict["growth_interval"]
        self._init_growth_tracker = state_dict["_growth_tracker"]
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(state_dict["_growth_tracker"])
        self._hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
        self._min_scale = state_dict.get("min_scale", self._min_scale)
        self._max_scale = state_dict.get("max_scale", self._max_scale)
        self._init_hysteresis = int(state_dict.get("_hysteresis_tracker", self._hysteresis))
        if self._amp_state is not None:
            self._amp_state[_C.AMP_STATE_HYSTERESIS] = self._init_hysteresis

    def __getstate__(self):
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError("A GradScaler instance may only be pickled at the beginning "
                                     "of an iteration, or at the end after scaler.update().")
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_init_skipped"], state["_init_hysteresis"] = self._get_amp_state()
            state["_scale"] = None
            state["_growth_tracker"] = None
            state["_amp_state"] = None
        state["_caches"] = None
        state["_pending"] = {}
        state["_last_found_inf"] = None
        state.pop("_update_inputs", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._caches = weakref.WeakKeyDictionary()
