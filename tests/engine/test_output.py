"""Output processing: incremental detokenizing adds up to decoding at once, at a cost per
token that does not grow with the output; stop strings; thread-safe encoding."""

from __future__ import annotations

import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.engine.engine import Engine
from radixkv.engine.models.llama import ModelConfig
from radixkv.engine.output import Detokenizer
from radixkv.tokenizer import ByteTokenizer, HFTokenizer

CFG = ModelConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
TEXT = "Voilà — naïve café: 東京, Zürich, 🙂 and plain ascii words to merge well. " * 3


def _bpe() -> HFTokenizer:
    """A byte-level BPE trained here (as GPT-2's, SmolLM2's): tokens that split UTF-8."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator([TEXT] * 20, trainer)
    return HFTokenizer(tk, None, None, None, b"test-bpe")


BPE = _bpe()


class Counting:
    """A tokenizer that counts the tokens it decodes."""

    def __init__(self, inner) -> None:
        self.inner, self.decoded = inner, 0
        self.eos_token_id = inner.eos_token_id

    def decode(self, ids):
        self.decoded += len(ids)
        return self.inner.decode(ids)


def _stream(tokenizer, ids: list[int]) -> str:
    d = Detokenizer(tokenizer)
    return "".join(d.push(t) for t in ids) + d.finish()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 255), max_size=60))
def test_byte_tokens_stream_to_what_decoding_at_once_gives(ids):
    tk = ByteTokenizer()
    assert _stream(tk, ids) == tk.decode(ids)  # invalid UTF-8 included


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 399), max_size=60))
def test_bpe_tokens_stream_to_what_decoding_at_once_gives(ids):
    ids = [i for i in ids if BPE._tk.id_to_token(i) is not None]
    assert _stream(BPE, ids) == BPE.decode(ids)


def test_real_text_streams_back_exactly_and_text_is_final_only_when_whole():
    ids = BPE.encode(TEXT)
    d = Detokenizer(BPE)
    parts = [d.push(t) for t in ids]
    assert "".join(parts) + d.finish() == TEXT
    assert all("\ufffd" not in p for p in parts)  # a character's bytes never split


def test_the_cost_per_token_does_not_grow_with_the_output():
    """Decoding the whole output every step made a long output quadratic."""
    for n in (200, 2000):
        tk = Counting(ByteTokenizer())
        d = Detokenizer(tk)
        for t in ("x" * n).encode():
            d.push(t)
        assert tk.decoded <= 4 * n  # a window of a few tokens a step


def test_engine_outputs_equal_their_tokens_decoded_and_stop_strings_still_cut():
    engine = Engine(CFG)
    out = engine.generate(["héllo wörld"] * 2, max_new_tokens=40, ignore_eos=True).outputs[0]
    assert out.text == engine.tokenizer.decode(out.token_ids)
    stop = out.text[7:9]
    if stop:
        from radixkv.engine.request import SamplingParams

        rid = engine.add_request("héllo wörld", SamplingParams(max_new_tokens=40, stop=(stop,),
                                                                ignore_eos=True))  # fmt: skip
        text = ""
        while engine.has_unfinished():
            text += "".join(o.text for o in engine.step() if o.rid == rid)
        assert text == out.text[: out.text.find(stop)]


def test_encode_is_safe_from_other_threads_while_the_engine_steps():
    """The server tokenizes off the engine's thread (the engine's docstring says what is
    safe): many threads encoding while the engine steps get what one thread gets."""
    engine = Engine(CFG, max_context_len=256)
    prompts = [f"prompt {i} " * (i % 5 + 1) for i in range(40)]
    want = [engine.encode(p) for p in prompts]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def encode(i: int) -> None:
        try:
            for _ in range(5):
                got[i] = engine.encode(prompts[i])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=encode, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    engine.generate(["steps meanwhile"] * 4, max_new_tokens=8)
    for t in threads:
        t.join()
    assert not errors and [got[i] for i in range(len(prompts))] == want
