"""radixkv: automatic prefix caching for LLM KV caches.

``import radixkv`` is light: the key, the tree and its policies. The engine, the
simulator and plotting import lazily from their own subpackages.
"""

from radixkv.key import RadixKey
from radixkv.policy import POLICIES
from radixkv.tree import InsertResult, MatchResult, RadixCache, TreeNode

__version__ = "0.1.0"

__all__ = [
    "POLICIES",
    "InsertResult",
    "MatchResult",
    "RadixCache",
    "RadixKey",
    "TreeNode",
    "__version__",
]
