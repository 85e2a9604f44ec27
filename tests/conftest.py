"""Test settings shared by every module."""

from hypothesis import settings

# No per-example deadline: CI machines are shared and a slow example is not a bug.
settings.register_profile("radixkv", deadline=None)
settings.load_profile("radixkv")
