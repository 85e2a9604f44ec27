"""Qwen3_5ForCausalLM (Qwen3.5 / Qwen3.6 text, dense): Gated DeltaNet (linear-attention)
layers and gated full-attention layers, as ``config.layer_types`` says (three to one in
the released models).

**Gated DeltaNet** keeps, per sequence and layer, a fixed-size state updated in place:
the last ``K - 1`` inputs of a short causal depthwise convolution over q, k and v, and a
``[v_heads, k_dim, v_dim]`` matrix ``S``. Per token, with ``q, k`` L2-normalised (``q``
then scaled by ``k_dim ** -0.5``), ``beta = sigmoid(b)`` and the decay
``g = -exp(A_log) * softplus(a + dt_bias)``::

    S <- exp(g) * S;  S <- S + k (x) beta * (v - S^T k);  o = S^T q

then ``o`` is RMS-normalised per head, times ``silu(z)``, and projected out. Prefill runs
the same recurrence chunk-parallel (`_chunked`: within a chunk the updates are solved as
one unit-lower-triangular system, across chunks the state is carried), decode one token
at a time (`_recurrent`); both give the recurrence's result.

**Full attention** has q/k RMSNorm (``x * (1 + w)``), RoPE on the first
``partial_rotary_factor`` of each head (text positions: the three multimodal RoPE grids
coincide, so ``mrope_section`` changes nothing for text), and an output gate:
``o_proj(attn * sigmoid(gate))`` where ``q_proj`` yields each head's query and gate.

The recurrent states live in the model (`states`: one row per request-table row, the
``ForwardBatch.state_slots``); a sequence whose new tokens start at position 0 starts
from a zero state, any other continues the state in its row (the engine copies a
checkpoint there on a cache hit). ``ForwardBatch.snapshots`` asks for the state after
some of a sequence's new tokens, copied to another row during the same pass (the
engine's checkpoints inside a prefill chunk). Parameter names follow transformers'
``Qwen3_5ForCausalLM``.

Owns: Qwen3.5's hyper-parameters, layers, forward pass and per-row recurrent states.
Must not touch: the KV pool's layout (it reads and writes by slot), the cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from radixkv.engine.models.base import (
    CenteredRMSNorm,
    ForwardBatch,
    GatedMLP,
    UnsupportedModel,
    attend,
    check_fields,
    last_rows,
    rotate_half,
)
from radixkv.kvcache.memory import KVPool
from radixkv.kvcache.recurrent.pool import StatePool
from radixkv.kvcache.spec import LayerSpecs, RecurrentSpec

ARCHITECTURE = "Qwen3_5ForCausalLM"
LAYER_TYPES = ("linear_attention", "full_attention")
FIXED = {"hidden_act": ("silu",)}
CHUNK = 64  # tokens per chunk of the chunk-parallel prefill, at most
MIN_CHUNK = 8  # a shorter run pads to the power of two that covers it, from this


@dataclass
class ModelConfig:
    """Qwen3.5's hyper-parameters (transformers' ``config.json`` names)."""

    vocab_size: int = 384
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    layer_types: tuple[str, ...] = ()
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    architecture: str = ARCHITECTURE

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        rot = self.head_dim * self.partial_rotary_factor
        if not (0 < self.partial_rotary_factor <= 1 and rot == int(rot) and int(rot) % 2 == 0):
            raise UnsupportedModel(f"{ARCHITECTURE}: partial_rotary_factor "
                                   f"{self.partial_rotary_factor!r} must rotate an even part of "
                                   f"each head (head_dim {self.head_dim})")  # fmt: skip
        if self.linear_conv_kernel_dim < 2:
            raise UnsupportedModel(f"{ARCHITECTURE}: linear_conv_kernel_dim must be at least 2, "
                                   f"config.json has {self.linear_conv_kernel_dim!r}")  # fmt: skip
        if not self.layer_types:  # transformers' default: every 4th layer full attention
            self.layer_types = tuple(
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            )
        self.layer_types = tuple(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(
            LAYER_TYPES
        ):
            raise UnsupportedModel(f"{ARCHITECTURE}: layer_types must list "
                                   f"{self.num_hidden_layers} of {LAYER_TYPES}")  # fmt: skip

    @property
    def kv_layers(self) -> int:
        """Layers with KV in the pool: the full-attention ones."""
        return self.layer_types.count("full_attention")

    def state_spec(self) -> RecurrentSpec:
        """Its Gated DeltaNet layers' states per sequence: the short convolution's last
        inputs and the DeltaNet matrix, float32 (as `States` keeps them)."""
        kd, vd = self.linear_num_key_heads * self.linear_key_head_dim, self.linear_num_value_heads
        conv = (2 * kd + vd * self.linear_value_head_dim, self.linear_conv_kernel_dim - 1)
        ssm = (vd, self.linear_key_head_dim, self.linear_value_head_dim)
        return RecurrentSpec(self.layer_types.count("linear_attention"), (conv, ssm))

    def layer_specs(self) -> LayerSpecs:
        """Its full-attention layers (places 0 .. kv_layers - 1 of the KV pool) and its
        recurrent ones (`radixkv.kvcache.spec`)."""
        state = self.state_spec()
        return LayerSpecs.attention((0,) * self.kv_layers, self.num_key_value_heads,
                                    self.head_dim, state if state.layers else None)  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Every field honored, neutral, or refused, naming it.

        Raises:
            UnsupportedModel: a field or value radixkv does not implement for Qwen3.5.
        """
        names = {f.name for f in fields(cls)} - {"architecture", "rope_theta",
                                                  "partial_rotary_factor"}  # fmt: skip
        check_fields(d, ARCHITECTURE, names | {"rope_parameters", "rope_scaling"}, FIXED)
        kw: dict[str, Any] = {k: v for k, v in d.items() if k in names and v is not None}
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        if "layer_types" in kw:
            kw["layer_types"] = tuple(kw["layer_types"])
        rope = dict(d.get("rope_parameters") or {})
        rope.update(d.get("rope_scaling") or {})
        kind = rope.pop("rope_type", rope.pop("type", "default"))
        if kind != "default":
            raise UnsupportedModel(f"{ARCHITECTURE}: config.json asks for rope_type {kind!r}; "
                                   "radixkv implements the default RoPE only")  # fmt: skip
        kw["rope_theta"] = float(rope.pop("rope_theta", d.get("rope_theta", cls.rope_theta)))
        kw["partial_rotary_factor"] = float(rope.pop("partial_rotary_factor", 1.0))
        # text positions give the three multimodal grids the same angles: no effect
        rope.pop("mrope_section", None)
        rope.pop("mrope_interleaved", None)
        if rope:
            raise UnsupportedModel(f"{ARCHITECTURE}: config.json's RoPE parameters "
                                   f"{sorted(rope)} are not implemented by radixkv")  # fmt: skip
        return cls(**kw)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class GatedRMSNorm(nn.Module):
    """``w * rms_norm(x) * silu(z)`` over each head (the DeltaNet output's norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * y.to(dtype)
        return (y * F.silu(z.float())).to(dtype)


def _l2(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _step(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]
    """One token of the gated delta rule, over any leading dims: ``q, k``: ``[..., dk]``;
    ``v``: ``[..., dv]``; ``g, beta``: ``[...]``; ``state``: ``[..., dk, dv]``. Returns
    (``[..., dv]``, the next state)."""
    state = state * g.exp()[..., None, None]
    err = v - torch.einsum("...kv,...k->...v", state, k)
    state = state + k[..., None] * (beta[..., None] * err)[..., None, :]
    return torch.einsum("...kv,...k->...v", state, q), state


def _recurrent(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]
    """The recurrence token by token. ``q, k``: ``[H, T, dk]``; ``v``: ``[H, T, dv]``;
    ``g, beta``: ``[H, T]``; ``state``: ``[H, dk, dv]``. Returns (``[H, T, dv]``, state)."""
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        out[:, t], state = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
    return out, state


def chunk_size(tokens: int) -> int:
    """Tokens per chunk for a run of ``tokens``: ``CHUNK``, or for a short run (a prompt's
    last tokens after a cache hit) the smallest power of two from ``MIN_CHUNK`` that holds
    it, since the padding to a whole chunk costs more than the run (measured: 8 tokens in
    0.17 ms at size 8, 0.27 ms at 64)."""
    return min(CHUNK, max(MIN_CHUNK, 1 << (tokens - 1).bit_length()))


def _grid(tokens: int, cuts: Sequence[int]) -> int:
    """The chunk size for a run of ``tokens`` with states wanted after ``cuts``: the
    largest power of two up to `chunk_size` that divides every cut, at least
    ``MIN_CHUNK`` (cuts off that grid need the run split)."""
    size = chunk_size(tokens)
    while size > MIN_CHUNK and any(c % size for c in cuts):
        size //= 2
    return size


def _prefill_groups(seqs: list[int], lens: Sequence[int],
                    snaps: dict[int, list[tuple[int, int]]]) -> list[list[int]]:  # fmt: skip
    """Which prefill chunks run together (`GatedDeltaNet._prefill`): those longer than a
    token whose snapshots lie on the ``MIN_CHUNK`` grid, while padding them to the
    longest at most doubles the work (as decode attention's rule); every other one
    alone."""
    fit = [i for i in seqs if lens[i] > 1
           and not any(0 < c < lens[i] and c % MIN_CHUNK for c, _ in snaps.get(i, ()))]  # fmt: skip
    if len(fit) > 1 and max(lens[i] for i in fit) * len(fit) <= 2 * sum(lens[i] for i in fit):
        return [fit] + [[i] for i in seqs if i not in fit]
    return [[i] for i in seqs]


def _chunked(q, k, v, g, beta, state, size: int | None = None):  # type: ignore[no-untyped-def]
    """The same recurrence, ``size`` tokens (default: `chunk_size`) at a time; returns
    (the output, the final state, the state at each chunk's start ``[H, C, dk, dv]``).
    Within a chunk, with ``c`` the cumulative log-decay from the chunk's start and
    ``D[i, j] = exp(c_i - c_j)``
    (``j <= i``), each token's written value ``u_i = beta_i (v_i - S_{i-1}^T k_i)``
    satisfies ``u_i + beta_i sum_{j<i} D[i, j] (k_i . k_j) u_j = beta_i (v_i -
    exp(c_i) S_0^T k_i)``: a unit-lower-triangular system ``A u = ...``, so
    ``u = A^-1 beta v - (A^-1 beta exp(c) k) S_0``. Both inverses' products do not
    depend on the state and are solved for every chunk at once; only the state is
    carried chunk to chunk: ``o_i = exp(c_i) S_0^T q_i + sum_{j<=i} D[i, j] (q_i . k_j)
    u_j`` and the next state is ``exp(c_n) S_0 + sum_j exp(c_n - c_j) k_j u_j^T``."""
    h, t = k.shape[:2]
    size = size or chunk_size(t)
    pad = (-t) % size
    if pad:  # zero tokens with no decay (g = 0) and no write (beta = 0) at the end
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    m = (t + pad) // size
    q, k, v = (x.reshape(h, m, size, x.shape[-1]) for x in (q, k, v))
    c = g.reshape(h, m, size).cumsum(-1)  # [H, C, n]
    b = beta.reshape(h, m, size)
    # D (0 above the diagonal: those differences' exp may overflow, tril_ drops them)
    decay = (c[..., :, None] - c[..., None, :]).exp_().tril_()
    # A = I + strict lower part of this: the solve reads neither diagonal nor upper part
    system = (k @ k.transpose(-1, -2)).mul_(decay).mul_(b[..., None])
    ec = c.exp()[..., None]
    both = torch.linalg.solve_triangular(
        system, torch.cat([b[..., None] * v, b[..., None] * ec * k], dim=-1),
        upper=False, unitriangular=True,
    )  # fmt: skip
    u_v, w = both[..., : v.shape[-1]], both[..., v.shape[-1] :]
    qk = (q @ k.transpose(-1, -2)) * decay
    ktt = (k * (c[..., -1:] - c).exp()[..., None]).transpose(-1, -2)
    # with u = u_v - w S (S: the state at the chunk's start), everything but S is known
    # for every chunk at once: o = (qe - qk w) S + qk u_v, and the next state is
    # S' = (exp(c_n) I - kt^T w) S + kt^T u_v; only that product runs chunk by chunk
    read = q * ec - qk @ w  # [H, C, n, dk]
    eye = torch.eye(k.shape[-1], device=k.device)
    step = c[..., -1].exp()[..., None, None] * eye - ktt @ w  # [H, C, dk, dk]
    write = ktt @ u_v  # [H, C, dk, dv]
    starts = torch.empty(h, m, *state.shape[1:], dtype=state.dtype, device=state.device)
    for i in range(m):
        starts[:, i] = state
        state = step[:, i] @ state + write[:, i]
    out = read @ starts + qk @ u_v
    return out.reshape(h, m * size, -1)[:, :t], state, starts


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index  # among the linear-attention layers
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        key_dim, value_dim = self.nk * self.dk, self.nv * self.dv
        self.split = (key_dim, key_dim, value_dim)
        self.conv_dim = 2 * key_dim + value_dim
        h = cfg.hidden_size
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, bias=False,
                                groups=self.conv_dim, padding=self.kernel - 1)  # fmt: skip
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, h, bias=False)
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.nv, bias=False)
        self.in_proj_a = nn.Linear(h, self.nv, bias=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, states: States) -> torch.Tensor:
        mixed = self.in_proj_qkv(x)  # [T, conv_dim]
        z = self.in_proj_z(x).view(-1, self.nv, self.dv)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        weight = self.conv1d.weight.squeeze(1)  # [conv_dim, K]
        out = torch.empty(x.shape[0], self.nv, self.dv, dtype=x.dtype, device=x.device)
        snaps: dict[int, list[tuple[int, int]]] = {}
        for i, offset, dst in batch.snapshots:
            snaps.setdefault(i, []).append((offset, dst))
        lens, firsts = batch.extend_lens, batch.first_positions
        offsets = [0, *itertools.accumulate(lens)]
        # one-token steps (decodes) run together, a snapshot after their token too; the
        # others (prefill chunks) one by one
        single = [i for i, n in enumerate(lens)
                  if n == 1 and all(c == 1 for c, _ in snaps.get(i, ()))]  # fmt: skip
        if not (len(single) > 1 or len(single) == len(lens)):
            single = []  # a lone decode among prefill chunks runs with them
        if single:
            at = torch.tensor([offsets[i] for i in single], device=x.device)
            rows = [batch.state_slots[i] for i in single]
            out[at] = self._decode(mixed[at], g[at], beta[at], weight, rows,
                                   [firsts[i] for i in single], states).to(x.dtype)  # fmt: skip
            for i, row in zip(single, rows, strict=True):  # the state after it, copied
                for _, dst in snaps.get(i, ()):
                    states.ssm[self.index, dst].copy_(states.ssm[self.index, row])
                    states.conv[self.index, dst].copy_(states.conv[self.index, row])
        decoded = set(single)
        rest = [i for i in range(len(lens)) if i not in decoded]
        for members in _prefill_groups(rest, lens, snaps):
            self._prefill(members, batch, snaps, offsets, mixed, g, beta, weight, states, out)
        o = self.norm(out, z)
        return self.out_proj(o.reshape(x.shape[0], -1))

    def _prefill(self, members: list[int], batch: ForwardBatch,
                 snaps: dict[int, list[tuple[int, int]]], offsets: list[int], mixed, g, beta,
                 weight, states: States, out: torch.Tensor) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
        """Prefill chunks of the sequences ``members`` (indices into the batch), padded at
        the end to the longest and run together: the conv over each one's previous
        inputs and its new ones, then the delta rule from its state row. Padding tokens
        neither decay nor write (g = beta = 0), so each state after the padding is the
        state after its own tokens. Writes ``out`` rows, each row's conv and state, and
        the snapshots."""
        lens = [batch.extend_lens[i] for i in members]
        b, longest, k1 = len(members), max(lens), self.kernel - 1
        rows = [batch.state_slots[i] for i in members]
        at_rows = torch.tensor(rows, device=mixed.device)
        conv, ssm = states.conv[self.index, at_rows], states.ssm[self.index, at_rows].float()
        fresh = [j for j, i in enumerate(members) if batch.first_positions[i] == 0]
        if fresh:  # a sequence's first chunk: its states start from zero
            conv[fresh] = 0
            ssm[fresh] = 0
        new = torch.zeros(b, longest, self.conv_dim, dtype=mixed.dtype, device=mixed.device)
        gs = torch.zeros(b, longest, self.nv, dtype=g.dtype, device=g.device)
        bs = torch.zeros(b, longest, self.nv, dtype=torch.float32, device=g.device)
        for j, (i, n) in enumerate(zip(members, lens, strict=True)):
            part = slice(offsets[i], offsets[i] + n)
            new[j, :n], gs[j, :n], bs[j, :n] = mixed[part], g[part], beta[part]
        seq = torch.cat([conv, new.transpose(1, 2).to(conv.dtype)], dim=2)  # [B, C, K-1+N]
        # the conv runs in the states' dtype (float32), whatever the weights' dtype
        y = F.silu(F.conv1d(seq, weight.to(seq.dtype)[:, None, :], groups=self.conv_dim))
        y = y.transpose(1, 2)
        q, k, v = (t.view(b, longest, self.nv, -1).transpose(1, 2)  # [B, H, N, d]
                   for t in self._heads(y.reshape(b * longest, -1).to(mixed.dtype)))  # fmt: skip
        gs, bs = gs.transpose(1, 2), bs.transpose(1, 2)  # [B, H, N]
        cuts = [sorted(snaps.get(i, ())) for i in members]
        if b == 1:
            ats = [dict(self._delta_rule(q[0], k[0], v[0], gs[0], bs[0], ssm[0], cuts[0]))]
        else:
            size = _grid(longest, [c for n, cs in zip(lens, cuts, strict=True)
                                   for c, _ in cs if 0 < c < n])  # fmt: skip
            flat = [t.flatten(0, 1) for t in (q, k, v, gs, bs, ssm)]  # B x H as one dim
            o, final, starts = _chunked(*flat, size=size)
            o, final = o.unflatten(0, (b, -1)), final.unflatten(0, (b, -1))
            starts = starts.unflatten(0, (b, -1))  # [B, H, C, dk, dv]
            ats = []
            for j, n in enumerate(lens):
                at = {0: ssm[j], n: final[j], -1: o[j, :, :n]}
                at.update((c, starts[j, :, c // size]) for c, _ in cuts[j] if 0 < c < n)
                ats.append(at)
        for j, (i, n) in enumerate(zip(members, lens, strict=True)):
            at = ats[j]
            out[offsets[i] : offsets[i] + n] = at[-1].transpose(0, 1)
            # each snapshot: the state after its offset, and the conv state (the K - 1
            # inputs before that position), copied to its row
            for c, dst in cuts[j]:
                states.ssm[self.index, dst].copy_(at[c])
                states.conv[self.index, dst].copy_(seq[j, :, c : c + k1])
            states.ssm[self.index, rows[j]] = at[n].to(states.ssm.dtype)
            states.conv[self.index, rows[j]] = seq[j, :, n : n + k1]

    @staticmethod
    def _delta_rule(q, k, v, g, beta, state, cuts: list[tuple[int, int]]):  # type: ignore[no-untyped-def]  # fmt: skip
        """The delta rule over one sequence's ``n`` new tokens (``[H, n, d]``) from
        ``state``: yields (offset, the state after it) for 0, each cut's offset and ``n``,
        then (-1, the output ``[H, n, dv]``). Cuts on a chunk grid (a page-aligned
        prompt's checkpoints) come from one chunked pass; others split it in segments."""
        n = q.shape[1]
        inner = [b for b, _ in cuts if 0 < b < n]
        size = _grid(n, inner)
        yield 0, state
        if n > 1 and not any(b % size for b in inner):
            out, final, starts = _chunked(q, k, v, g, beta, state, size)
            for b in inner:
                yield b, starts[:, b // size]
            yield n, final
            yield -1, out
            return
        a, parts = 0, []
        for b in [*inner, n]:
            if b > a:
                seg = [x[:, a:b] for x in (q, k, v, g, beta)]
                o, state = _recurrent(*seg, state) if b - a == 1 else _chunked(*seg, state)[:2]
                parts.append(o)
                a = b
            yield b, state
        yield -1, torch.cat(parts, dim=1)

    def _decode(self, mixed, g, beta, weight, slots: list[int], firsts: list[int],
                states: States):  # type: ignore[no-untyped-def]  # fmt: skip
        """One new token for each of several sequences (state rows ``slots``), all at
        once (the loop above would run each alone): the conv over the last K inputs,
        then one step of the delta rule, on the rows gathered and written back.
        ``[B, nv, dv]``."""
        rows = torch.tensor(slots, device=mixed.device)
        conv, ssm = states.conv[self.index, rows], states.ssm[self.index, rows].float()
        fresh = [i for i, first in enumerate(firsts) if first == 0]
        if fresh:  # a one-token prompt: its states start from zero
            conv[fresh] = 0
            ssm[fresh] = 0
        seq = torch.cat([conv, mixed.to(conv.dtype)[:, :, None]], dim=2)  # [B, C, K]
        states.conv[self.index, rows] = seq[:, :, 1:]
        y = F.silu((seq * weight).sum(-1)).to(mixed.dtype)  # the conv's last output
        out, ssm = _step(*self._heads(y), g, beta.float(), ssm)
        states.ssm[self.index, rows] = ssm.to(states.ssm.dtype)
        return out

    def _heads(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output ``[T, conv_dim]`` as float ``q, k`` (L2-normed, the key heads
        repeated over the value heads, ``q`` scaled) ``[T, nv, dk]`` and ``v``
        ``[T, nv, dv]``."""
        q, k, v = torch.split(y, self.split, dim=-1)
        n, rep = y.shape[0], self.nv // self.nk
        q = _l2(q.view(n, self.nk, self.dk).float()).repeat_interleave(rep, 1) * self.dk**-0.5
        k = _l2(k.view(n, self.nk, self.dk).float()).repeat_interleave(rep, 1)
        return q, k, v.view(n, self.nv, self.dv).float()


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, kv_layer: int) -> None:
        super().__init__()
        self.kv_layer = kv_layer  # its layer in the KV pool
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rot = int(self.hd * cfg.partial_rotary_factor)
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.nh * self.hd * 2, bias=bias)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=bias)
        self.q_norm = CenteredRMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = CenteredRMSNorm(self.hd, cfg.rms_norm_eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rot
        return torch.cat([x[..., :r] * cos + rotate_half(x[..., :r]) * sin, x[..., r:]], -1)

    def forward(self, x, cos, sin, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:  # type: ignore[no-untyped-def]
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.nh, 2 * self.hd).chunk(2, dim=-1)
        q = self._rope(self.q_norm(q), cos, sin)
        k = self._rope(self.k_norm(self.k_proj(x).view(t, self.nkv, self.hd)), cos, sin)
        v = self.v_proj(x).view(t, self.nkv, self.hd)
        pool.write(self.kv_layer, batch.out_slots, k.to(pool.dtype), v.to(pool.dtype))
        out = attend(q, batch, lambda slots: pool.read(self.kv_layer, slots))
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, kind_index: int) -> None:
        super().__init__()
        self.linear = cfg.layer_types[layer_id] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, kind_index)
        else:
            self.self_attn = GatedAttention(cfg, layer_id, kind_index)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, batch, pool, states):  # type: ignore[no-untyped-def]
        h = self.input_layernorm(x)
        if self.linear:
            x = x + self.linear_attn(h, batch, states)
        else:
            x = x + self.self_attn(h, cos, sin, batch, pool)
        return x + self.mlp(self.post_attention_layernorm(x))


class States(NamedTuple):
    """The state pool's tensors (`radixkv.kvcache.recurrent.pool`) by name: per row, every
    linear layer's conv inputs ``[layers, rows, conv_dim, K - 1]`` and DeltaNet matrix
    ``[layers, rows, heads, dk, dv]`` (the two shapes of `ModelConfig.state_spec`)."""

    conv: torch.Tensor
    ssm: torch.Tensor


class Qwen3_5Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        counters = {t: 0 for t in LAYER_TYPES}
        layers = []
        for i, t in enumerate(cfg.layer_types):
            layers.append(DecoderLayer(cfg, i, counters[t]))
            counters[t] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3_5ForCausalLM(nn.Module):
    """Qwen3.5 with a slot-indexed KV pool for its full-attention layers (``kv_layers``
    of them) and per-row recurrent states; ``forward`` as Llama's."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3_5Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        rot = int(cfg.head_dim * cfg.partial_rotary_factor)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2).float() / rot))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.kv_layers = cfg.layer_types.count("full_attention")
        self.states: States | None = None

    def use_states(self, pool: StatePool) -> None:
        """Run on ``pool``'s state rows (a sequence's row is its ``state_slots`` entry);
        the pool is the engine's, built from ``config.state_spec()``."""
        if pool.spec != self.config.state_spec():
            raise ValueError("use_states: the pool's spec is not this model's state_spec()")
        self.states = States(*pool.tensors)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool, all_logits: bool = False) -> torch.Tensor:
        if self.states is None:
            raise RuntimeError("call use_states(pool) before running Qwen3.5")
        x = self.model.embed_tokens(batch.input_ids)
        freqs = batch.positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, batch, pool, self.states)
        x = self.model.norm(x)
        return self.lm_head(x if all_logits else last_rows(x, batch)).float()


MODEL_CLASS = Qwen3_5ForCausalLM
