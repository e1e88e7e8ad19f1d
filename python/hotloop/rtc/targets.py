"""What NVRTC makes for a GPU: a CUBIN for its own architecture when this NVRTC knows it, else PTX for the
newest architecture it knows below it, which the driver compiles for the GPU when it loads it."""
import typing


class Target(typing.NamedTuple):
    arch: int  # 10 * major + minor: 90 for sm_90
    cubin: bool  # False: PTX

    @property
    def kind(self) -> str:
        return "cubin" if self.cubin else "ptx"

    def __str__(self):
        return f"sm_{self.arch} cubin" if self.cubin else f"compute_{self.arch} PTX"


def arch_of(capability) -> int:
    """(9, 0) -> 90"""
    major, minor = capability
    return 10 * int(major) + int(minor)


def target_for(arch: int, supported_archs, nvrtc_version=None) -> Target:
    """The image to make for a GPU of architecture `arch` with an NVRTC that compiles for
    `supported_archs`; RuntimeError when this NVRTC knows no architecture at or below it."""
    if arch in supported_archs:
        return Target(arch, True)
    older = [a for a in supported_archs if a < arch]
    if not older:
        version = "" if nvrtc_version is None else " %d.%d" % tuple(nvrtc_version)
        raise RuntimeError(f"NVRTC{version} compiles for sm_{min(supported_archs)} and newer only; this GPU is "
                           f"sm_{arch}: use an older NVRTC (HOTLOOP_NVRTC=/path/libnvrtc.so, or "
                           "pip install nvidia-cuda-nvrtc-cu12)")
    return Target(max(older), False)
