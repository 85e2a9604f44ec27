"""What every model family shares: the ragged batch a forward pass takes, the layers every
family uses, and the strict reading of ``config.json``.

Owns: `ForwardBatch`, `RMSNorm`, `CenteredRMSNorm`, `GatedMLP`, `rotate_half`,
`last_rows`, `attend` (attention over the KV pool by
slot, with a causal window), and `check_fields`: a
checkpoint's config field is either honored by the family, known to shape no forward
pass (training knobs, bookkeeping), or refused with an error naming it
(`UnsupportedModel`); no field is silently ignored. Must not touch: any one family's architecture.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# config.json fields that change no computation of a forward pass: bookkeeping, training
# knobs, generation defaults (the engine takes those from the request)
NEUTRAL_FIELDS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype",
    "dtype", "use_cache", "initializer_range", "attention_dropout", "pad_token_id",
    "pretraining_tp",  # a tensor-parallel split of the same matmuls in Hugging Face's code
    "output_attentions", "output_hidden_states", "return_dict", "tie_encoder_decoder",
})  # fmt: skip


class UnsupportedModel(ValueError):
    """A checkpoint radixkv cannot run exactly: an unknown architecture, or a config
    field its family does not implement. One line, naming it."""


def check_fields(
    config: Mapping[str, Any],
    architecture: str,
    honored: Iterable[str],
    fixed: Mapping[str, tuple[Any, ...]] = {},
) -> None:
    """Refuse a config field the family neither honors nor knows to be neutral, and a
    field in ``fixed`` set to a value other than the ones listed (what the family
    implements: ``hidden_act`` ``silu``, no ``sliding_window``, ...).

    Raises:
        UnsupportedModel: naming the field and the architecture.
    """
    honored = set(honored)
    for name, value in config.items():
        if name in honored or name in NEUTRAL_FIELDS:
            continue
        if name in fixed:
            if value not in fixed[name]:
                raise UnsupportedModel(
                    f"{architecture}: config.json sets {name}={value!r}, which radixkv does "
                    f"not implement for this architecture"
                )
            continue
        raise UnsupportedModel(
            f"{architecture}: config.json field {name!r} is not implemented by radixkv for "
            "this architecture"
        )


def rope_theta(config: Mapping[str, Any], architecture: str, default: float) -> float:
    """The RoPE base from ``rope_parameters`` (transformers 5) or ``rope_theta`` /
    ``rope_scaling`` (earlier); only plain RoPE (``rope_type`` default) is implemented.

    Raises:
        UnsupportedModel: another RoPE type (``llama3``, ``yarn``, ...) or parameter.
    """
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling")
    if scaling:
        params.update(scaling)
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind != "default":
        raise UnsupportedModel(f"{architecture}: config.json asks for rope_type {kind!r}; "
                               "radixkv implements the default RoPE only")  # fmt: skip
    theta = params.pop("rope_theta", config.get("rope_theta", default))
    if params:
        raise UnsupportedModel(f"{architecture}: config.json's RoPE parameters "
                               f"{sorted(params)} are not implemented by radixkv")  # fmt: skip
    return float(theta)


@dataclass
class ForwardBatch:
    """The new tokens of several sequences, end to end.

    Attributes:
        input_ids, positions, out_slots: one entry per new token (``[T]``).
        extend_lens: new tokens per sequence.
        kv_slots: per sequence, the slots of its whole context so far, new tokens
            included (``len >= extend_len``).
        state_slots: per sequence, its row of recurrent states (models with
            recurrent layers; the request table's row).
        snapshots: ``(sequence, new tokens, row)``: copy that sequence's recurrent
            state after that many of its new tokens to that row, during the pass.
        window: the same tokens in the sliding layers' slot space, when their KV lives
            apart (`radixkv.kvcache.window.slots`): ``out_slots`` there, and per sequence the
            window slots of only its last context tokens a new token can see (its
            window less one, and the new ones), ``kv_slots[i]`` ending at the same
            position; ``None``: every layer uses the slots above.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    extend_lens: list[int]
    kv_slots: list[torch.Tensor]
    state_slots: list[int] = field(default_factory=list)
    snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    window: ForwardBatch | None = None

    def take(self, inputs: Mapping[str, Any], device: torch.device) -> None:
        """The cache managers' parts of the step (`CacheManager.step_inputs`), by the
        kinds the models read: a recurrent model's ``"states"``, the snapshots; the
        sliding layers' ``"window"``, per sequence its window slots and where its new
        tokens' start (`WindowSlots.forward`), as the window view."""
        self.snapshots = list(inputs.get("states", ()))
        window = inputs.get("window")
        if not window:
            return
        out, ctx = [], []
        for slots, first in window:
            if device.type != "cpu":
                slots = slots.to(device)
            ctx.append(slots)
            out.append(slots[first:])
        self.window = ForwardBatch(self.input_ids, self.positions, torch.cat(out),
                                   self.extend_lens, ctx, self.state_slots)  # fmt: skip

    def for_layer(self, window: int) -> ForwardBatch:
        """The batch as a layer with sliding window ``window`` (0: full attention)
        reads and writes its KV: the window view when sliding layers live apart."""
        return self.window if window and self.window is not None else self

    @property
    def first_positions(self) -> list[int]:
        """Per sequence, the position of its first new token."""
        return [len(s) - n for s, n in zip(self.kv_slots, self.extend_lens, strict=True)]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class CenteredRMSNorm(nn.Module):
    """``x * (1 + w)``, computed in float32 and cast back (Gemma's and Qwen3.5's, where
    Llama's multiplies by ``w`` after the cast)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU with ``silu``, GeGLU with ``gelu_tanh``."""

    def __init__(self, hidden: int, inner: int, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate_proj(x)
        g = F.silu(g) if self.act == "silu" else F.gelu(g, approximate="tanh")
        return self.down_proj(g * self.up_proj(x))


def last_rows(x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Each sequence's last new token's row of ``x`` (``[num_seqs, ...]``)."""
    return x[torch.tensor(batch.extend_lens, device=x.device).cumsum(0) - 1]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attend(
    q: torch.Tensor,
    batch: ForwardBatch,
    keys_values: Any,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of each sequence's new queries (``q``: ``[T, nh, hd]``, end to end)
    over its whole context, read by ``keys_values(slots)`` (``[S, nkv, hd]`` each).
    Query ``j`` of a sequence with ``n`` new tokens and ``s`` in all sits at position
    ``s - n + j`` and sees keys up to it, only the last ``window`` of them (itself
    included) when ``window``; ``scale`` defaults to ``hd ** -0.5``. Returns
    ``[T, nh * hd]``."""
    nh, hd = q.shape[1], q.shape[2]
    out = torch.empty(q.shape[0], nh * hd, dtype=q.dtype, device=q.device)
    offsets = [0, *itertools.accumulate(batch.extend_lens)]
    # one-token steps (decodes) of similar context lengths: one padded pass for all
    single = [i for i, n in enumerate(batch.extend_lens) if n == 1]
    lens = [len(batch.kv_slots[i]) for i in single]
    together = len(single) > 1 and max(lens) * len(lens) <= 2 * sum(lens)
    if together:
        at = torch.tensor([offsets[i] for i in single], device=q.device)
        slots = [batch.kv_slots[i] for i in single]
        out[at] = _attend_decode(q[at], slots, keys_values, lens, window, scale)
    done = set(single) if together else set()
    for i, (n, slots) in enumerate(zip(batch.extend_lens, batch.kv_slots, strict=True)):
        if i in done:
            continue
        start = offsets[i]
        keys, values = keys_values(slots)
        s = keys.shape[0]
        group = nh // keys.shape[1]
        # [1, heads, tokens, hd], contiguous: the layout PyTorch's fused CPU kernels take
        # (a 3-D or strided input falls back to the ~10x slower reference path)
        qi = q[start : start + n].transpose(0, 1).contiguous()[None]
        if n == s and not 0 < window < s:  # a whole causal prefill: the fast kernel
            ki, vi = (x.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
                      .contiguous()[None] for x in (keys, values))  # fmt: skip
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
        else:  # new tokens over a longer context: KV heads shared natively (measured
            # 24 queries over 2,024 keys, 9 / 3 heads: 1.4 ms against 2.8 repeated)
            ki, vi = (x.to(q.dtype).transpose(0, 1).contiguous()[None] for x in (keys, values))
            ahead = (
                torch.arange(n, device=q.device)[:, None]
                + (s - n)
                - torch.arange(s, device=q.device)[None, :]
            )  # how far each key lies behind each query
            mask = ahead >= 0
            if window:
                mask &= ahead < window
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale,
                                               enable_gqa=group > 1)  # fmt: skip
        out[start : start + n] = o[0].transpose(0, 1).reshape(n, nh * hd)
    return out


def _attend_decode(
    q: torch.Tensor, kv_slots: list[torch.Tensor], keys_values: Any, lens: list[int],
    window: int, scale: float | None,
) -> torch.Tensor:  # fmt: skip
    """`attend` for one new token per sequence: every sequence's context gathered at
    once, padded to the longest (the padding masked out), one attention call.

    A sequence's padding reads its own newest slot again. A masked key still reaches
    the output (PyTorch's attention adds the mask to ``q.k`` and weighs ``v`` by 0, so an
    inf or NaN there makes the row NaN), and a slot the sequence does not own may hold
    anything: padding with slot 0 once read the non-finite KV a failed request had left
    there and failed the clean request beside it. Its own slots it reads unmasked anyway."""
    b, nh, hd = q.shape
    longest = max(lens)
    idx = torch.empty(b, longest, dtype=torch.int64, device=q.device)
    for i, slots in enumerate(kv_slots):
        idx[i, : lens[i]] = slots
        idx[i, lens[i] :] = slots[-1]
    keys, values = keys_values(idx.view(-1))
    nkv = keys.shape[1]
    k = keys.to(q.dtype).view(b, longest, nkv, hd).transpose(1, 2)  # [B, nkv, S, hd]
    v = values.to(q.dtype).view(b, longest, nkv, hd).transpose(1, 2)
    at = torch.arange(longest, device=q.device)[None, :]
    end = torch.tensor(lens, device=q.device)[:, None]
    mask = at < end  # the query sits at its sequence's last position
    if window:
        mask &= at >= end - window
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], scale=scale,
        enable_gqa=nh != nkv,
    )  # fmt: skip
    return out.reshape(b, nh * hd)
