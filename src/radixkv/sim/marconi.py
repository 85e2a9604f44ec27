"""Marconi's published simulator (MLSys 2025; github ruipeterpan/marconi), its three
policies replayed by their own rules, so that `radixkv simulate`'s Marconi rows are
Marconi's results and not an emulation of them. Reimplemented here from a reading of
its ``radix_cache_hybrid.py``, ``radix_cache_vllm.py``, ``config_tuner.py`` and
``utils.py``; none of its code is copied.

Its tree is not ours: every node holds one recurrent state (a node is a state), and
bytes are ``nodes x state + tokens x KV``. Per request, as its driver does: a lookup of
the input, then an insert of input + output. A lookup reuses the tokens of the nodes it
matches whole. A logical clock ticks on every lookup, insert and eviction.

    vllm+     (``radix_cache_vllm.py``, block 32) nodes of at most ``block`` tokens, a
              state in each; a lookup reuses whole blocks, and a last partial block only
              when a node holds exactly it; every node a lookup or an insert passes is
              touched; eviction pops leaves least recently used.
    sglang+   (V1) a radix tree whose nodes end at inputs' and outputs' ends and branch
              points; every node a lookup or an insert passes is touched; eviction pops
              leaves least recently used, each with its state and KV.
    marconi   (V2) the same admission; a lookup touches only the deepest node it reuses;
              eviction takes, one at a time, the node with at most one child of lowest
              ``recency + alpha x efficiency`` (min-max scaled; efficiency is the FLOPs
              the node saves over its parent per byte of its prefix), a leaf whole, an
              inner node's state alone (merged into its child). ``alpha`` starts at 0
              and is tuned once: when ``bootstrap`` x (the requests seen at the first
              eviction) requests have been seen, the window is replayed from an empty
              tree for each alpha of a grid and the one that saved the most FLOPs (over
              its last 500 requests) is kept.

Its quirks are kept, since they are part of its results: a lookup that leaves a node
part way goes on matching the node's children with the rest of the input; the bytes a
V2 leaf eviction counts are those of the last candidate scanned, not of the victim; an
insert's estimate of the bytes it needs is the one its code computes. (The first quirk
needs raw tokens to show; on a trace of interned units it cannot.)

FLOPs are Marconi's formulas with d = the spec's ``attn_dim``, n solved from its state
size (Mamba's: ``2dn + 8(2d + 2n)`` bytes, fp16), one MLP per layer.

Owns: Marconi's tree, its policies and its tuner. Must not touch: radixkv's own tree
(`radixkv.tree`): the rules differ on purpose.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

POLICIES = ("vllm+", "sglang+", "marconi")
ALPHAS = tuple(round(0.1 * i, 1) for i in range(21))  # the tuner's grid, 0 .. 2
TUNED_OVER = 500  # the tuner's score: FLOPs saved over the replay's last requests
VLLM_BLOCK = 32


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    eq = a[:n] == b[:n]
    return n if eq.all() else int(eq.argmin())


def _scaled(values: list[float]) -> list[float]:
    """Min-max scaled to [0, 1]; all ones when fewer than two or all equal."""
    if len(values) > 1:
        lo, hi = min(values), max(values)
        if lo != hi:
            return [(v - lo) / (hi - lo) for v in values]
    return [1.0] * len(values)


class Flops:
    """Marconi's FLOP formulas for one model (``utils.py``)."""

    def __init__(self, d: float, n: float, ssm: int, attn: int, mlp: int) -> None:
        self.d, self.n, self.ssm, self.attn, self.mlp = d, n, ssm, attn, mlp

    @classmethod
    def of(cls, spec: Any) -> Flops:
        d = float(spec.attn_dim)
        n = max((spec.state_bytes - 16 * d) / (2 * d + 16), 1.0) if spec.state_bytes else 1.0
        layers = spec.recurrent_layers + spec.full_layers + spec.window_layers
        return cls(d, n, spec.recurrent_layers, spec.full_layers, layers)

    def attn_one(self, tokens: float) -> float:
        return 8 * tokens * self.d**2 + 4 * tokens**2 * self.d

    def mlp_one(self, tokens: float) -> float:
        return 16 * tokens * self.d**2

    def mamba_one(self, tokens: float) -> float:
        return 12 * tokens * self.d**2 + 16 * tokens * self.d * self.n + 10 * tokens * self.d

    def saved(self, hits: list[int]) -> float:
        """What its stats count as saved by requests that reused ``hits`` tokens each."""
        return (self.ssm * self.mamba_one(sum(hits)) + sum(
            self.attn * self.attn_one(h) + self.mlp * self.mlp_one(h) for h in hits))  # fmt: skip


class _Node:
    __slots__ = ("children", "end", "key", "parent", "ts")

    def __init__(self, key: np.ndarray, parent: _Node | None, ts: int, end: int) -> None:
        self.key, self.parent, self.ts, self.end = key, parent, ts, end
        self.children: dict[Any, _Node] = {}

    def __lt__(self, other: _Node) -> bool:  # heapq's order: least recently used first
        return self.ts < other.ts


class MarconiCache:
    """One policy's cache (see the module docstring). ``state_bytes``: one node's state
    (every recurrent layer); ``token_bytes``: one token's KV (every attention layer)."""

    def __init__(
        self,
        policy: str,
        capacity: float,
        state_bytes: int,
        token_bytes: int,
        flops: Flops,
        alpha: float = 0.0,
        tune: bool = True,
        bootstrap: int = 5,
        block: int = VLLM_BLOCK,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: unknown {policy!r}; valid: {', '.join(POLICIES)}")
        self.policy, self.capacity, self.alpha = policy, capacity, alpha
        self.state_bytes, self.token_bytes, self.flops = state_bytes, token_bytes, flops
        self.tune, self.bootstrap, self.block = tune and policy == "marconi", bootstrap, block
        self.root = _Node(np.empty(0, dtype=np.int64), None, 0, 0)
        self.clock = 0
        self.nodes = self.tokens = 0
        self.created = 0  # nodes (states) ever made
        self.hits: list[int] = []  # tokens each lookup reused
        self.window: list[tuple[np.ndarray, np.ndarray]] = []  # (input, output) since start
        self.window_size: int | None = None  # set at the first eviction
        self.alpha_tuned: float | None = None

    # --- sizes ------------------------------------------------------------------------
    def held(self) -> float:
        return self.nodes * self.state_bytes + self.tokens * self.token_bytes

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    # --- lookup -----------------------------------------------------------------------
    def lookup(self, tokens: np.ndarray) -> int:
        """The tokens a request with input ``tokens`` reuses (recorded)."""
        hit, _, _ = self._match(tokens)
        self.hits.append(hit)
        if self.tune:
            self.window.append((tokens, tokens[:0]))
        return hit

    def _match(self, key: np.ndarray) -> tuple[int, int, int]:
        """(reused tokens, matched tokens, nodes reused), touching as the policy does."""
        now = self._tick()
        if self.policy == "vllm+":
            return self._match_blocks(key, now)
        node, pos, hit, deepest, reused = self.root, 0, 0, None, 0
        if self.policy == "sglang+":
            node.ts = now
        while pos < len(key):
            child = node.children.get(int(key[pos]))
            if child is None:
                break
            m = _common(child.key, key[pos:])
            pos += m
            if m == len(child.key):  # reused whole
                hit += m
                deepest, reused = child, reused + 1
            if self.policy == "sglang+":
                child.ts = now
            node = child  # (part way too: its children meet the rest of the input)
        if self.policy == "marconi" and deepest is not None:
            deepest.ts = now
        return hit, pos, reused

    def _match_blocks(self, key: np.ndarray, now: int) -> tuple[int, int, int]:
        node, pos, reused = self.root, 0, 0
        while True:
            node.ts = now
            if not node.children:
                return pos, pos, reused
            lens = [(_common(c.key, key[pos:]), len(c.key), c) for c in node.children.values()]
            best = max(m for m, _, _ in lens)
            if best == self.block:
                node = next(c for m, _, c in lens if m == best)
                pos, reused = pos + best, reused + 1
                continue
            if best:
                for m, n, _ in lens:
                    if m == n != 0:  # a partial block held whole: reused, and the end
                        return pos + n, pos + n, reused + 1
            return pos, pos, reused

    # --- insert -----------------------------------------------------------------------
    def insert(self, tokens: np.ndarray, input_len: int) -> None:
        """Cache ``tokens`` (input + output), evicting first as the policy estimates."""
        self._tick()
        if self.tune:
            self.window[-1] = (tokens[:input_len], tokens[input_len:])
            if self.window_size is not None and len(self.hits) == self.window_size:
                self.alpha = self.alpha_tuned = self._tune()
                self.window, self.tune = [], False  # it tunes once: nothing more to keep
        hit, matched, reused = self._match(tokens)
        if self.policy == "vllm+":  # its estimate: off by a block or two, as it says
            extra = len(tokens) - self.block * (reused + 1)
            need = extra / self.block * self.state_bytes + extra * self.token_bytes
        else:
            states = 2 if matched > hit else 1
            need = states * self.state_bytes + (len(tokens) - matched) * self.token_bytes
        if self.held() + need > self.capacity:
            self._evict(self.held() + need - self.capacity)
        if self.policy == "vllm+":
            self._insert_blocks(self.root, tokens)
        else:
            self._insert_radix(tokens)

    def _insert_radix(self, key: np.ndarray) -> None:
        node, pos, now = self.root, 0, self.clock
        while True:
            if self.policy == "sglang+":
                node.ts = now
            if pos == len(key):
                return
            first = int(key[pos])
            child = node.children.get(first)
            if child is None:
                node.children[first] = _Node(key[pos:], node, now, node.end + len(key) - pos)
                self.nodes, self.tokens = self.nodes + 1, self.tokens + len(key) - pos
                self.created += 1
                return
            m = _common(child.key, key[pos:])
            if m == len(child.key) == len(key) - pos:  # held already (not entered)
                return
            if m < len(child.key):  # a branch point: the upper part is a new node
                upper = _Node(child.key[:m], node, now, child.end - len(child.key) + m)
                child.key, child.parent = child.key[m:], upper
                upper.children[int(child.key[0])] = child
                node.children[first] = upper
                self.nodes, self.created = self.nodes + 1, self.created + 1
                child = upper
            node, pos = child, pos + m

    def _insert_blocks(self, node: _Node, key: np.ndarray) -> None:
        now, pos = self.clock, 0
        while True:
            node.ts = now
            if node.children:
                lens = [(_common(c.key, key[pos:]), c) for c in node.children.values()]
                best = max(m for m, _ in lens)
                nxt = next((c for m, c in lens if m == len(c.key) == best), None)
                if nxt is not None:
                    node, pos = nxt, pos + best
                    continue
            if pos == len(key):
                return
            if node is self.root or len(node.key) == self.block:  # a new block below
                part = key[pos : pos + self.block]
                new = _Node(part, node, now, node.end + len(part))
                node.children[tuple(part.tolist())] = new
                self.nodes, self.tokens = self.nodes + 1, self.tokens + len(part)
                self.created += 1
                node, pos = new, pos + len(part)
            else:  # fill a partial block (a leaf), re-keyed under its parent
                part = key[pos : pos + self.block - len(node.key)]
                assert node.parent is not None and not node.children
                del node.parent.children[tuple(node.key.tolist())]
                node.key = np.concatenate((node.key, part))
                node.end += len(part)
                node.parent.children[tuple(node.key.tolist())] = node
                self.tokens += len(part)
                pos += len(part)

    # --- eviction ---------------------------------------------------------------------
    def _preorder(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(node.children.values()))
        return out

    def _unlink(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None
        for k, v in parent.children.items():
            if v is node:
                del parent.children[k]
                break
        self.nodes, self.tokens = self.nodes - 1, self.tokens - len(node.key)

    def _evict(self, nbytes: float) -> None:
        self._tick()
        if self.window_size is None:
            self.window_size = self.bootstrap * len(self.hits)
        if self.policy == "marconi":
            self._evict_by_utility(nbytes)
            return
        leaves = [n for n in self._preorder() if not n.children]
        heapq.heapify(leaves)
        freed = 0.0
        while freed < nbytes and leaves:
            leaf = heapq.heappop(leaves)
            if leaf is self.root:
                break
            freed += self.state_bytes + len(leaf.key) * self.token_bytes
            self._unlink(leaf)
            assert leaf.parent is not None
            if not leaf.parent.children:
                heapq.heappush(leaves, leaf.parent)

    def _evict_by_utility(self, nbytes: float) -> None:
        freed, f = 0.0, self.flops
        while freed < nbytes and self.nodes > 0:
            cands = [n for n in self._preorder()[1:] if len(n.children) <= 1]
            recency = _scaled([1.0 / (self.clock - n.ts) for n in cands])
            eff = []
            for n in cands:
                total, own = n.end, len(n.key)
                saved = (f.ssm * f.mamba_one(own)
                         + f.attn * (f.attn_one(total) - f.attn_one(total - own))
                         + f.mlp * (f.mlp_one(total) - f.attn_one(total - own)))  # fmt: skip
                eff.append(saved / (self.state_bytes + total * self.token_bytes))
            score = [self.alpha * e + r for e, r in zip(_scaled(eff), recency, strict=True)]
            victim = cands[score.index(min(score))]
            if not victim.children:
                freed += self.state_bytes + len(cands[-1].key) * self.token_bytes
                self._unlink(victim)
            else:
                freed += self.state_bytes
                self._merge(victim)

    def _merge(self, node: _Node) -> None:
        """Drop an inner node's state: it and its only child become one node."""
        (child,) = node.children.values()
        parent = node.parent
        assert parent is not None
        merged = _Node(np.concatenate((node.key, child.key)), parent, max(node.ts, child.ts),
                       child.end)  # fmt: skip
        merged.children = child.children
        for grandchild in merged.children.values():
            grandchild.parent = merged
        parent.children[int(node.key[0])] = merged
        self.nodes -= 1

    # --- the tuner --------------------------------------------------------------------
    def _tune(self) -> float:
        """The grid's alpha that saved the most FLOPs replaying the window from an empty
        tree (ties: the smallest)."""
        best, best_saved = 0.0, -1.0
        for alpha in ALPHAS:
            replay = MarconiCache(self.policy, self.capacity, self.state_bytes, self.token_bytes,
                                  self.flops, alpha, tune=False)  # fmt: skip
            for inp, out in self.window:
                replay.lookup(inp)
                replay.insert(np.concatenate((inp, out)), len(inp))
            saved = self.flops.saved(replay.hits[-TUNED_OVER:])
            if saved > best_saved:
                best, best_saved = alpha, saved
        return best


__all__ = ["ALPHAS", "POLICIES", "Flops", "MarconiCache"]
