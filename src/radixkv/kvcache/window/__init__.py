"""The sliding-window layer type, in one home: what a layer that attends to its last
``window`` tokens keeps in the cache, and everything that keeps it.

    component.py  `WindowKV`: the tree component holding each cached node's window KV
                  (only the windows a match can end at are needed; the spare go first)
    servable.py   `ServableBlocks`: the event gate (`TreeComponent.event_gate`): KV
                  events tell only the pages a match can end at now
    slots.py      `WindowSlots`: the layer type's manager (`radixkv.kvcache.managers`):
                  the running requests' window slots, and `window_peak`

The spec is `radixkv.kvcache.spec.SlidingWindowSpec`; the pool's size is planned by
`radixkv.kvcache.plan`; the host and store tiers keep window pages apart
(`radixkv.storage.windows`, above this layer).

Owns: the package's names. Must not touch: anything above the cache.
"""

from radixkv.kvcache.window.component import RETAIN, WindowKV
from radixkv.kvcache.window.servable import ServableBlocks
from radixkv.kvcache.window.slots import WindowSlots, window_peak

__all__ = ["RETAIN", "ServableBlocks", "WindowKV", "WindowSlots", "window_peak"]
