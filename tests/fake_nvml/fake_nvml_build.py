"""Builds tests/fake_nvml/fake_nvml.c into a shared library in a tmp dir and opens it for scripting."""
import ctypes
import os
import shutil
import subprocess

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_nvml.c")


def build(directory, name="libfake_nvml.so"):
    """Compile the fake NVML into `directory`; returns the library's path."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) to build the fake NVML")
    path = os.path.join(str(directory), name)
    subprocess.check_call([cc, "-shared", "-fPIC", "-O1", "-std=c11", "-o", path, SOURCE])
    return path


class FakeNvml:
    """The fake library's control functions (the same loaded copy hotloop._C opens by path)."""

    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.lib.fake_nvml_set.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_longlong]
        self.lib.fake_nvml_get.argtypes = [ctypes.c_int, ctypes.c_char_p]
        self.lib.fake_nvml_get.restype = ctypes.c_longlong
        self.lib.fake_nvml_fail.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_longlong]
        self.lib.fake_nvml_set_device_count.argtypes = [ctypes.c_int]

    def reset(self):
        self.lib.fake_nvml_reset()

    def set(self, field, value, device=0):
        assert self.lib.fake_nvml_set(device, field.encode(), int(value)) == 0, field

    def get(self, field, device=0):
        return self.lib.fake_nvml_get(device, field.encode())

    def fail(self, function, code, after=0):
        assert self.lib.fake_nvml_fail(function.encode(), code, after) == 0

    def set_device_count(self, n):
        self.lib.fake_nvml_set_device_count(n)
