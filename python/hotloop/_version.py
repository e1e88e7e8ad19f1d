"""The package version: setup.py reads it and compiles it into hotloop._C."""
__version__ = "0.1.0"
