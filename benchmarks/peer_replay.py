"""What the peer replays (`peer_sglang_hybrid.py`, `peer_vllm_hybrid.py`) share: their
arguments, the trace and spec they load, and running the peer's side in its own venv
with a job file. Standard library only at import: the peer's interpreter imports it too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DATA = HERE.parents[1] / "shared" / "data" / "marconi"
PEERS = Path.home() / ".cache" / "radixkv-peers"
TOLERANCE = 0.01


def arguments(doc: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DATA / "chat120_seed7.jsonl.gz")
    ap.add_argument("--model-spec", default=str(DATA / "marconi-7b-hybrid.json"))
    ap.add_argument("--sizes", default="0.5,1,2,5", help="GB (10^9 bytes) [0.5,1,2,5]")
    ap.add_argument("--requests", type=int, default=None, help="the first N requests only")
    ap.add_argument("--no-outputs", action="store_true", help="cache prompts only")
    ap.add_argument("--peer", help=argparse.SUPPRESS)  # (the child: a job file)
    return ap.parse_args()


def serve_child(args: argparse.Namespace, peer: Any) -> bool:
    """In the peer's venv (``--peer JOB``): print ``peer(job)`` as JSON; True if so."""
    if not args.peer:
        return False
    print(json.dumps(peer(json.loads(Path(args.peer).read_text()))))
    return True


def begin(doc: str, peer: Any, python: Path, name: str) -> argparse.Namespace | int:
    """A peer script's first steps: its arguments; or, run in the peer's venv as the
    child, the job served (exit 0); or, without the venv, how to build it (exit 2)."""
    args = arguments(doc)
    if serve_child(args, peer):
        return 0
    if not python.exists():
        print(f"no {name} peer at {python}: run benchmarks/peers/setup.sh {name.lower()}",
              file=sys.stderr)  # fmt: skip
        return 2
    return args


def inputs(args: argparse.Namespace) -> tuple[Any, Any, bool, list[int]]:
    """The trace (page 1), the model spec, whether outputs are cached, the sizes in bytes."""
    sys.path.insert(0, str(HERE))
    from bench_marconi import load

    from radixkv.sim.hybrid import model_spec

    trace, spec = load(args.trace, 1), model_spec(args.model_spec)
    if args.requests:
        trace.requests = trace.requests[: args.requests]
    return trace, spec, not args.no_outputs, [int(float(s) * 1e9) for s in args.sizes.split(",")]


def run_peer(python: Path, script: str, job: dict, env: dict[str, str]) -> tuple[list, float]:
    """Run ``script --peer`` under the peer's ``python`` on ``job``: its rates and seconds.

    Raises:
        RuntimeError: the peer's side failed (the end of its stderr).
    """
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([str(python), script, "--peer", f.name], capture_output=True,
                              text=True, env={**os.environ, **env})  # fmt: skip
    finally:
        os.unlink(f.name)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])["rates"], time.perf_counter() - t0
