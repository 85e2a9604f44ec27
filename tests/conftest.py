"""Test settings shared by every module."""

import pytest
from hypothesis import settings

# No per-example deadline: CI machines are shared and a slow example is not a bug.
settings.register_profile("radixkv", deadline=None)
settings.load_profile("radixkv")


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory):
    """Tiny Qwen3.5 and Gemma 3 (sliding window 10) folders, written by transformers'
    ``save_pretrained``: ``{"qwen3.5": path, "gemma3": path}``."""
    from helpers import qwen3_5_folder
    from support.models import GEMMA, folder

    arch, config = GEMMA
    return {
        "qwen3.5": qwen3_5_folder(tmp_path_factory.mktemp("q") / "ckpt"),
        "gemma3": str(folder(tmp_path_factory.mktemp("g") / "ckpt", arch, **config)),
    }
