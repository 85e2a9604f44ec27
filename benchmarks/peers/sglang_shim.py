"""Minimal import shim so SGLang 0.5.23's RadixCache loads on a CPU-only box.

Usage:  import sglang_shim   # before any `import sglang...`

What it does (and nothing else):
1. Stubs `sglang.srt.mem_cache.memory_pool` with a placeholder `ReqToTokenPool`.
   base_prefix_cache.py imports that name only for a type annotation, but the real
   module pulls in attention layers, quantization kernels, DSA utils, etc.
   RadixCache never touches it at runtime when req_to_token_pool=None.
2. Installs a permissive stub for the `torchvision` package. It is reached only via
   base_prefix_cache -> observability.metrics_collector -> disaggregation.utils ->
   sglang.srt.configs -> nano_nemotron_vl -> multimodal.internvl_utils, which uses
   torchvision.transforms at call time only. PyPI's torchvision wheels are CUDA
   builds whose _C.so cannot load against torch 2.13.0+cpu.
3. Stubs `triton` too when it is not installed (or SGLANG_PEER_STUB=triton):
   sglang imports triton at module level (utils/common.py, kernel modules with
   @triton.jit) but RadixCache never runs a kernel. torch is first made to cache
   "triton absent" (torch.compile is invoked at sglang import time, and inductor
   would otherwise probe the stub); after that sglang gets the stub. Saves the
   ~900 MB triton wheel. Stub attributes are classes whose call with a single
   callable returns it unchanged (so decorators are no-ops).
SGLANG_PEER_UNIFIED=1 skips stub 1, for UnifiedRadixCache (see README.md).
SGLANG_PEER_STUB="a,b" adds more top-level packages to stub (transformers can NOT
be stubbed: sglang/__init__ monkeypatches it at import time).
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os as _os
import sys
import types

# Extra top-level packages to stub, e.g. SGLANG_PEER_STUB="triton".
_STUB_PREFIXES = ("torchvision",) + tuple(
    x.strip() for x in _os.environ.get("SGLANG_PEER_STUB", "").split(",") if x.strip()
)
if "triton" not in _STUB_PREFIXES and importlib.util.find_spec("triton") is None:
    _STUB_PREFIXES += ("triton",)  # auto: lite venv without the triton wheel


class _AnyMeta(type):
    """Metaclass of stub 'classes': any attribute is another stub class, calling
    one with a single callable (decorator use) returns that callable unchanged,
    otherwise returns the stub class itself. Being real classes, stubs also work
    as isinstance() targets and base classes."""

    def __getattr__(cls, item):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _make_stub(f"{cls.__name__}.{item}")

    def __call__(cls, *a, **k):
        if len(a) == 1 and not k and callable(a[0]):
            return a[0]
        return cls

    def __getitem__(cls, item):
        return cls

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False

    def __or__(cls, other):
        return cls

    __ror__ = __or__


def _make_stub(name):
    return _AnyMeta(name, (), {"__module__": "sglang_shim_stub"})


class _StubModule(types.ModuleType):
    def __getattr__(self, item):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _make_stub(f"{self.__name__}.{item}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    blocking = False  # while True, stubbed names raise ImportError instead

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in _STUB_PREFIXES:
            if self.blocking:
                raise ImportError(f"{fullname} hidden by sglang_shim")
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        m.__sglang_peer_stub__ = True
        m.__version__ = "0.0.0+sglang_peer_stub"
        return m

    def exec_module(self, module):
        pass


def install():
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        finder = _StubFinder()
        sys.meta_path.insert(0, finder)
        if "triton" in _STUB_PREFIXES and "triton" not in sys.modules:
            # torch must see "no triton" (it caches that), sglang gets the stub.
            finder.blocking = True
            try:
                import torch._inductor.runtime.triton_compat  # noqa: F401
                import torch.utils._triton as _tt

                _tt.has_triton_package()
            finally:
                finder.blocking = False

    name = "sglang.srt.mem_cache.memory_pool"
    # SGLANG_PEER_UNIFIED=1 keeps the real module: UnifiedRadixCache (SGLang's production
    # cache, Rust tree core) imports MHATokenToKVPool and friends from it.
    if name not in sys.modules and _os.environ.get("SGLANG_PEER_UNIFIED") != "1":
        stub = types.ModuleType(name)

        class ReqToTokenPool:  # annotation-only placeholder
            pass

        stub.ReqToTokenPool = ReqToTokenPool
        stub.__sglang_peer_stub__ = True
        sys.modules[name] = stub


install()
