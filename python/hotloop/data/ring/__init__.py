"""The ring: a batch as a slot holds it (layout.py), the slots of a pool's ring (slots.py) and the
copy engine, which copies a slot's bytes to the device and applies leaf transforms (copies.py)."""
