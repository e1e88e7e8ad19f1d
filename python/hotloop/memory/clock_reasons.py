"""NVML's clock-event ("throttle") reasons: the bits C exports, the names the reports print."""
from .. import _C

REASON_NAMES = {
    _C.NVML_REASON_GPU_IDLE: "GPU idle",
    _C.NVML_REASON_APP_CLOCKS: "application clocks setting",
    _C.NVML_REASON_SW_POWER_CAP: "software power cap",
    _C.NVML_REASON_HW_SLOWDOWN: "hardware slowdown",
    _C.NVML_REASON_SYNC_BOOST: "sync boost",
    _C.NVML_REASON_SW_THERMAL: "software thermal slowdown",
    _C.NVML_REASON_HW_THERMAL: "hardware thermal slowdown",
    _C.NVML_REASON_HW_POWER_BRAKE: "hardware power brake",
    _C.NVML_REASON_DISPLAY_CLOCKS: "display clocks setting",
}
POWER_REASONS = _C.NVML_REASON_SW_POWER_CAP | _C.NVML_REASON_HW_POWER_BRAKE
# heat, or the hardware slowing itself down (which is mostly heat, sometimes a power supply's signal)
SLOWDOWN_REASONS = _C.NVML_REASON_SW_THERMAL | _C.NVML_REASON_HW_THERMAL | _C.NVML_REASON_HW_SLOWDOWN


def reason_names(bits: int) -> list:
    """NVML clock-event reason bits -> names (idle excluded: an idle GPU is not held back)."""
    return [name for bit, name in REASON_NAMES.items() if bits & bit and bit != _C.NVML_REASON_GPU_IDLE]


def reason_bits(names) -> int:
    """reason_names undone: the bits of these names."""
    bits = 0
    for bit, name in REASON_NAMES.items():
        if name in names:
            bits |= bit
    return bits
