"""A new layer type is a manager with a tree component, built by its entry in the
registry (`radixkv.kvcache.layer_types`): the engine, the scheduler, the step and the
tree's core take it as they are. Shown with a test-only toy type: "every other page",
whose component lets a match end only at an even number of pages, served end to end."""

from __future__ import annotations

from radixkv.engine.engine import Engine
from radixkv.kvcache import layer_types
from radixkv.kvcache.managers import LayerManager
from radixkv.tree.component import TreeComponent


class EveryOtherPage(TreeComponent):
    """A match may end only every ``span`` tokens (two pages)."""

    name = "every_other_page"

    def __init__(self, span: int) -> None:
        self.span = span

    def match_limit(self, path, partial, units):  # type: ignore[override]
        matched = sum(len(n) for n in path) + (units if partial is not None else 0)
        return matched // self.span * self.span


class EveryOtherPageManager(LayerManager):
    kind = "every_other_page"

    def __init__(self, page: int) -> None:
        self.component = EveryOtherPage(2 * page)


def build(plan, arena, device, model):
    return EveryOtherPageManager(plan.config.page_size)


PROMPT = list(range(40, 70))  # 30 tokens: 28 cacheable (the last is always computed)


def serve_twice(engine: Engine) -> tuple[list[int], list[list[int]]]:
    cached, tokens = [], []
    for _ in range(2):
        out = engine.generate([PROMPT], max_new_tokens=6, chat=False, ignore_eos=True).outputs[0]
        cached.append(out.cached_tokens)
        tokens.append(out.token_ids)
    return cached, tokens


def test_a_layer_type_added_through_the_registry_alone_is_served(monkeypatch):
    plain = Engine("random", page_size=4)
    assert plain.mgr.managers == () and plain.cache.component("every_other_page") is None
    plain_cached, plain_tokens = serve_twice(plain)
    assert plain_cached == [0, 28]
    monkeypatch.setitem(layer_types.LAYER_TYPES, "every_other_page", build)
    engine = Engine("random", page_size=4, check_memory=True)
    assert [m.kind for m in engine.mgr.managers] == ["every_other_page"]
    assert engine.cache.component("every_other_page") is not None
    cached, tokens = serve_twice(engine)
    assert cached == [0, 24]  # 28 tokens cached; its limit lets a match end at 3 x 8
    assert tokens == plain_tokens  # a layer type's cache changes no token


def test_an_engine_names_each_types_manager_by_its_public_name_and_nothing_else():
    """``engine.window`` / ``engine.recurrent`` (`layer_types.ENGINE_NAMES`): the type's
    manager, or None on a model without such layers; any other missing name still fails."""
    import pytest

    plain = Engine("random", page_size=4)
    assert plain.window is None and plain.recurrent is None
    with pytest.raises(AttributeError, match="windows"):
        plain.windows  # noqa: B018
    assert set(layer_types.ENGINE_NAMES.values()) <= set(layer_types.LAYER_TYPES)
