"""`kvprefix doctor`: what breaks prefix reuse in a request log, and what fixing each cause would win.

The log is rendered with ``kvprefix.prompts``, hashed with ``kvprefix.cache.BlockHasher`` and replayed through the
planner (``kvprefix.sim.replay``, the real cache manager) as it is and with each fix applied. docs/doctor.md.
"""
