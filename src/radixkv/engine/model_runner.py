"""`ModelRunner`: a planned batch in, one row of logits per request out, and sampling."""

from __future__ import annotations

import torch

from radixkv.engine.model import ForwardBatch, LlamaForCausalLM
from radixkv.engine.request import EngineReq
from radixkv.memory import KVPool, ReqToTokenPool


class ModelRunner:
    """Runs the model over a ragged batch whose KV lives in ``kv`` by slot."""

    def __init__(self, model: LlamaForCausalLM, kv: KVPool, device: torch.device) -> None:
        self.model, self.kv, self.device = model, kv, device

    def forward(self, plan: list[tuple[EngineReq, int]], table: ReqToTokenPool) -> torch.Tensor:
        """Logits of the last new token of each planned request (``[len(plan), vocab]``):
        request ``r`` computes its tokens ``[kv_len - n, kv_len)``."""
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
        batch = ForwardBatch(
            torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), torch.cat(out), lens, kv
        )
        return self.model(batch, self.kv)  # the model runs under inference_mode

    @staticmethod
    def sample(r: EngineReq, logits: torch.Tensor) -> int:
        """Greedy at temperature 0; else temperature + top-p, from the request's generator."""
        s = r.sampling
        if s.temperature == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / s.temperature, dim=-1)
        if s.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < s.top_p
            probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
        return int(torch.multinomial(probs.cpu(), 1, generator=r.generator))
