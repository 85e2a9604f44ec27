"""`ModelRunner`: a planned batch in, one row of logits per request out, and sampling.

Owns: batching a plan into one forward pass, and sampling. Must not touch: the cache,
the scheduler, outputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from radixkv.engine.models.base import ForwardBatch
from radixkv.engine.request import EngineReq
from radixkv.kvcache.memory import KVPool
from radixkv.kvcache.req_table import ReqToTokenPool


class ModelRunner:
    """Runs the model over a ragged batch whose KV lives in ``kv`` by slot (the sliding
    layers' by the window manager's slots, when they live apart)."""

    knows_ahead = False  # a model samples: it cannot say a request's next tokens (`ahead`)

    def __init__(self, model: torch.nn.Module, kv: KVPool, device: torch.device) -> None:
        self.model, self.kv, self.device = model, kv, device

    def forward(
        self,
        plan: list[tuple[EngineReq, int]],
        table: ReqToTokenPool,
        inputs: Mapping[str, Sequence] | None = None,
    ) -> torch.Tensor:
        """Logits of the last new token of each planned request (``[len(plan), vocab]``):
        request ``r`` computes its tokens ``[kv_len - n, kv_len)``. ``inputs``: the cache
        managers' parts of the step (`CacheManager.step_inputs`), which the batch takes
        (`ForwardBatch.take`)."""
        ids, pos, out, lens, kv = [], [], [], [], []
        for r, n in plan:
            start = r.kv_len - n
            ids.extend(r.token_array()[start : r.kv_len])
            pos.extend(range(start, r.kv_len))
            row = table.read(r.row, 0, r.kv_len)
            out.append(row[start:])
            kv.append(row)
            lens.append(n)
        dev = self.device
        batch = ForwardBatch(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev),
                             torch.cat(out), lens, kv, [r.row for r, _ in plan])  # fmt: skip
        batch.take(inputs or {}, dev)  # each layer type's part of the step
        return self.model(batch, self.kv)  # the model runs under inference_mode

    def ahead(self, r: EngineReq, k: int) -> list[int]:
        """The next ``k`` tokens ``r`` will sample, where the runner knows them
        (`knows_ahead`: a replay's, its trace's record)."""
        raise NotImplementedError("a model's runner does not know the tokens ahead")

    @staticmethod
    def sample(r: EngineReq, logits: torch.Tensor) -> int:
        """Penalties and bias shape the logits; then greedy at a temperature below
        `SAMPLING_EPS`, else temperature + top-p from the request's generator. With
        ``logprobs`` the chosen token's log-probability and the top alternatives are
        appended to the request. ``logits`` are finite (the engine checks the batch).

        Raises:
            NonFiniteLogits: the shaped logits or the probabilities are not finite (the
                request fails alone; nothing was appended to it).
        """
        s = r.sampling
        if s.shapes_logits:
            logits = shape_logits(r, logits)
            if not bool(torch.isfinite(logits).all()):
                raise NonFiniteLogits("the logits are not finite after the penalties and bias")
        if s.greedy:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(logits.float() / s.temperature, dim=-1)
            if s.top_p < 1.0:
                sorted_p, idx = probs.sort(descending=True)
                keep = sorted_p.cumsum(0) - sorted_p < s.top_p
                probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
            if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
                raise NonFiniteLogits(f"the probabilities at temperature {s.temperature} are "
                                      "not finite")  # fmt: skip
            token = int(torch.multinomial(probs.cpu(), 1, generator=r.generator))
        if s.logprobs is not None:
            lp = torch.log_softmax(logits.float(), dim=-1)
            top = lp.topk(s.logprobs) if s.logprobs else None
            alts = (
                list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                if top is not None
                else []
            )
            r.output_logprobs.append((float(lp[token]), alts))
        return token


class NonFiniteLogits(ArithmeticError):
    """A request's logits (or its sampling distribution) hold NaN or inf: that request
    cannot be sampled, and fails alone."""


def shape_logits(r: EngineReq, logits: torch.Tensor) -> torch.Tensor:
    """A copy of ``logits`` with the request's logit bias, repetition penalty (prompt and
    output tokens) and presence / frequency penalties (output tokens) applied."""
    s = r.sampling
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    if s.logit_bias:
        ids = torch.tensor([t for t, _ in s.logit_bias], device=logits.device)
        bias = torch.tensor([b for _, b in s.logit_bias], device=logits.device)
        keep = ids < vocab  # the server refuses ids beyond the vocabulary
        logits[ids[keep]] += bias[keep]
    if s.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.input_ids) | set(r.output_ids)), device=logits.device)
        vals = logits[seen]
        p = s.repetition_penalty
        logits[seen] = torch.where(vals > 0, vals / p, vals * p)
    if (s.presence_penalty or s.frequency_penalty) and r.output_ids:
        out = torch.tensor(r.output_ids, device=logits.device)
        counts = torch.bincount(out, minlength=vocab).float()
        logits -= counts * s.frequency_penalty + (counts > 0).float() * s.presence_penalty
    return logits
