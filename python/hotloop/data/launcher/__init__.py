"""The launcher process: one fork of the main process that forks workers 1.. (zygote.py)."""
