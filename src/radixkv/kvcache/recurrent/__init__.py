"""The recurrent layer type (Gated DeltaNet, Mamba), in one home: a layer with one
fixed-size state per sequence, so a cached prefix is reusable only where a checkpoint
of that state exists.

    component.py  `StateCheckpoints`: the tree component holding the checkpoints, their
                  use history and Marconi's utility
    manager.py    `RecurrentStates`: the layer type's manager (`radixkv.kvcache.managers`):
                  which positions a request snapshots, restoring a hit's checkpoint
    pool.py       `StatePool`: the state rows, out of the model

The spec is `radixkv.kvcache.spec.RecurrentSpec`; the rows are planned by
`radixkv.kvcache.plan`; the host and store tiers keep checkpoints apart
(`radixkv.storage.states`, above this layer).

Owns: the package's names. Must not touch: anything above the cache.
"""

from radixkv.kvcache.recurrent.component import (
    KINDS,
    STATE_POLICIES,
    Checkpoint,
    StateCheckpoints,
    utility,
)
from radixkv.kvcache.recurrent.manager import RecurrentStates
from radixkv.kvcache.recurrent.pool import StatePool

__all__ = ["KINDS", "STATE_POLICIES", "Checkpoint", "RecurrentStates", "StateCheckpoints",
           "StatePool", "utility"]  # fmt: skip
