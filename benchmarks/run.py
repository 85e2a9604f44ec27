"""radixkv against SGLang and vLLM, side by side, in one run.

    python benchmarks/run.py [--repeats 3] [--out benchmarks/results/latest.json]

Each implementation runs in its own virtual environment: the runner starts its adapter
(``adapters/*_adapter.py``) with that environment's Python, the adapters rebuild the same
seeded workloads (``workloads.py``) and print JSON, and the runner prints one table of
µs per operation with the ratio peer ÷ radixkv (above 1: radixkv is faster). Peers are
built by ``benchmarks/peers/setup.sh sglang|vllm``; a missing one is skipped with a note.

Workloads: (a) shared system prompt, match+insert; (b) multi-turn chat, match+insert;
(c) evict(1000) with ~5k leaves; (d) match a 32k-token prompt in a 256-node chain;
(e) full request path at page 16 (ample pool, and a tight one of 1,024 pages);
(f) RSS bytes per cached token, 1M tokens in 10k leaves; (g) one scheduler step of 64
requests (admissions, prefill chunks, decodes, finishes), µs per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = Path.home() / ".cache" / "radixkv-peers"


def run_adapter(name: str, python: str, workloads: str, pages: str, repeats: int) -> dict:
    cmd = [
        python,
        str(HERE / "adapters" / f"{name}_adapter.py"),
        "--workloads",
        workloads,
        "--page-sizes",
        pages,
        "--repeats",
        str(repeats),
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if name == "sglang_rust":  # the peer shim must leave memory_pool to the real module
        env["SGLANG_PEER_UNIFIED"] = "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} adapter failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def key(row: dict) -> tuple:
    return (row["workload"], row.get("variant", ""), row["page_size"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workloads", default="a,b,c,d,e,f,g")
    p.add_argument("--page-sizes", default="1,16")
    p.add_argument("--radixkv-python", default=sys.executable)
    p.add_argument("--sglang-python", default=str(PEERS / "sglang" / "bin" / "python"))
    p.add_argument("--vllm-python", default=str(PEERS / "vllm" / "bin" / "python"))
    p.add_argument("--out", type=Path, default=HERE / "results" / "latest.json")
    args = p.parse_args()

    from rich.console import Console
    from rich.table import Table

    console = Console()
    results: dict[str, dict] = {}
    for name, python in (
        ("radixkv", args.radixkv_python),
        ("sglang_rust", args.sglang_python),  # the production UnifiedRadixCache
        ("sglang", args.sglang_python),  # the legacy Python RadixCache
        ("vllm", args.vllm_python),
    ):
        if not Path(python).exists():
            console.print(
                f"[yellow]skipping {name}:[/yellow] no interpreter at {python} "
                f"(build it with benchmarks/peers/setup.sh {name.split('_')[0]})"
            )
            continue
        with console.status(f"running {name} ..."):
            try:
                results[name] = run_adapter(
                    name, python, args.workloads, args.page_sizes, args.repeats
                )
            except RuntimeError as e:
                console.print(f"[red]{e}[/red]")
    if "radixkv" not in results:
        sys.exit("radixkv's adapter did not run")
    rows = {name: {key(r): r for r in res["rows"]} for name, res in results.items()}
    ours = rows["radixkv"]
    table = Table(
        title=f"µs per operation, median of {args.repeats}, GC on (GC off in "
        "brackets); ratio = peer ÷ radixkv"
    )
    for col in ("workload", "page", "radixkv", "SGLang Rust core", "ratio", "SGLang legacy",
                "ratio", "vLLM", "ratio", "hit rates"):  # fmt: skip
        table.add_column(col, justify="left" if col == "workload" else "right")

    def cell(row: dict | None) -> str:
        if row is None:
            return "-"
        if "bytes_per_token" in row:
            return f"{row['bytes_per_token']:.1f} B/tok"
        return f"{row['us_gc_on']:.1f} ({row['us_gc_off']:.1f})"

    def ratio(peer: dict | None, mine: dict) -> str:
        if peer is None:
            return "-"
        if "bytes_per_token" in mine:
            return f"{mine['bytes_per_token'] / peer['bytes_per_token']:.2f}x size"
        on = peer["us_gc_on"] / mine["us_gc_on"]
        return f"{on:.1f}x ({peer['us_gc_off'] / mine['us_gc_off']:.1f}x)"

    for k, mine in ours.items():
        w, variant, page = k
        rs = rows.get("sglang_rust", {}).get(k)
        sg, vl = rows.get("sglang", {}).get(k), rows.get("vllm", {}).get(k)
        hits = [f"{r['hit_rate']:.4f}" for r in (mine, rs, sg, vl) if r and "hit_rate" in r]
        table.add_row(
            f"({w}) {variant}".strip(),
            str(page),
            cell(mine),
            cell(rs),
            ratio(rs, mine),
            cell(sg),
            ratio(sg, mine),
            cell(vl),
            ratio(vl, mine),
            " / ".join(hits),
        )
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    console.print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
