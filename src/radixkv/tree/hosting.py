"""How components join a `RadixCache`: added while it is empty, the hash chains an event
sink and an evict hook ask for, and the ``node.ext`` entries that follow them.

Owns: the cache's list of components and its event sink and evict hook. Must not touch:
the tree's structure (it only rewrites each node's ``ext`` list when the set changes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixkv.tree.component import TreeComponent
from radixkv.tree.hashes import BlockHashes, CacheEventSink, EventHashes, hash_components
from radixkv.tree.servable import Muted, ServableBlocks
from radixkv.tree.window import WindowKV

if TYPE_CHECKING:
    pass


class ComponentHost:
    """`RadixCache`'s components (a mixin: the cache's fields are its own)."""

    def add_component(self, component: TreeComponent) -> None:
        """Join a component to the tree (only while the cache is empty).

        Raises:
            TypeError: not a `TreeComponent`. ValueError: the cache holds pages, or the
                component belongs to a cache already.
        """
        if not isinstance(component, TreeComponent):
            raise TypeError(f"component must be a TreeComponent, got {type(component).__name__}")
        if self._num_nodes:
            raise ValueError("add_component: the cache must be empty (reset it first)")
        if component.index >= 0:
            raise ValueError(f"component {component.name!r} belongs to a cache already")
        self._own.append(component)
        self._set_components(self._own + self._hash_components())

    def component(self, name: str) -> TreeComponent | None:
        """The component called ``name``, if the cache has one."""
        return next((c for c in self._components if c.name == name), None)

    @property
    def components(self) -> tuple[TreeComponent, ...]:
        return tuple(self._components)

    def _set_components(self, components: list[TreeComponent]) -> None:
        """Make ``components`` the cache's, in ``node.ext`` order. Ones that leave hear
        nothing more (an event component is flushed first); every node's entries follow."""
        old = self._components
        for c in old:
            if c not in components and isinstance(c, EventHashes):
                c.flush()  # the old sink hears of every page it was told would come
        keep = {id(c): i for i, c in enumerate(old)}
        for i, c in enumerate(components):
            if id(c) not in keep:
                c.attach(self, i)
            c.index = i
        self._components = components
        self._empty_ext = [c.empty for c in components]
        self._lockers = [c for c in components if c.lock is not None]
        self._limiters = [c for c in components if c.match_limit is not None]
        self._inserters = [c for c in components if c.inserted is not None]
        for node in (self.root, *self.iter_nodes()):
            if components:  # a removed component's entries go; new ones start empty
                node.ext = [
                    node.ext[keep[id(c)]] if id(c) in keep and node.ext else c.empty
                    for c in components
                ]
            else:
                node.ext = None
        for c in old:
            if c not in components:
                c.index = -1

    def set_event_sink(self, sink: CacheEventSink | None) -> None:
        """Report pages entering and leaving the cache to ``sink`` (``None``: stop). Only
        while the cache is empty, so every page the sink hears of has a hash.

        Raises:
            ValueError: the cache holds pages.
        """
        if sink is not None and self._num_nodes:
            raise ValueError("set_event_sink: the cache must be empty (reset it first)")
        for name in ("stored", "removed", "cleared"):
            if sink is not None and not callable(getattr(sink, name, None)):
                raise TypeError(f"event_sink must have a {name}() method")
        self._sink = sink
        self._set_hash_components()

    def set_evict_hook(self, hook: Any) -> None:
        """Call ``hook(page_hashes, slots)`` with the pages `evict` is about to free
        (`HASH_BYTES` block hashes concatenated, and their slots in the same order), before the
        allocator reuses them: a host tier copies them out. Only while the cache is empty.

        Raises:
            ValueError: the cache holds pages.
        """
        if hook is not None and self._num_nodes:
            raise ValueError("set_evict_hook: the cache must be empty (reset it first)")
        self._evict_hook = hook
        self._set_hash_components()

    def _set_hash_components(self) -> None:
        """Which chains the nodes keep (`radixkv.tree.hashes.hash_components`): new ones
        only while empty; a chain no longer asked for leaves at any time."""
        if self._num_nodes:
            wanted = self._hash_components()
            kinds = {type(c) for c in wanted}
            now = [c for c in self._components if c in self._own or type(c) in kinds]
        else:
            now = self._own + self._hash_components()
        self._set_components(now)
        window = next((c for c in self._own if isinstance(c, WindowKV)), None)
        if window is not None and not any(isinstance(c, ServableBlocks) for c in now):
            window.watch = None  # no sink hears of windows any more

    def _hash_components(self) -> list[TreeComponent]:
        """The chains the sink and the evict hook ask for; with sliding-window KV, the
        event sink hears only servable blocks (`radixkv.tree.servable`), through a gate
        that reads the chain's hashes."""
        sink, hook = self._sink, self._evict_hook
        window = next((c for c in self._own if isinstance(c, WindowKV)), None)
        if window is None or sink is None:
            return hash_components(sink, hook)
        strong = bool(getattr(sink, "strong_hashes", False))
        out: list[TreeComponent] = hash_components(Muted(strong), hook)
        chain = next(c for c in out if isinstance(c, BlockHashes if strong else EventHashes))
        return [*out, ServableBlocks(sink, chain, window)]  # type: ignore[arg-type]

    def flush_events(self) -> None:
        """Hash the pages inserted since the last flush and report them to the event
        sink (`radixkv.tree.hashes.EventHashes.flush`); a no-op without one."""
        for c in self._components:
            if isinstance(c, EventHashes | ServableBlocks):
                c.flush()
