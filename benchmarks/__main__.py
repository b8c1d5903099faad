"""Run the benchmarks, keep their figures, and write the benchmark table in
docs/performance.md from them.

    python -m benchmarks                      # every benchmark (hours)
    python -m benchmarks overhead multiworker # some of them
    python -m benchmarks --table              # only rewrite the benchmark table

Each benchmark runs as its own process (`python benchmarks/NAME.py ARGS`: a strategy and
logical devices can be set up once per process) and measures against its baseline in the
same run. Its figures (`benchmarks/record.py`) replace that benchmark's entry in
`benchmarks/results.json`, with the date, the machine and the command; the benchmark table,
between its two markers, is then written from that file, so no figure is copied by hand.
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results.json"
TABLE = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- benchmarks:table -->", "<!-- /benchmarks:table -->"

# name: the arguments the table's figures come from (in the table's order)
SCRIPTS = {
    "overhead": ["--rounds", "7"],
    "accumulation": ["--rounds", "7"],
    "multiworker": ["--rounds", "3"],
    "input": ["--rounds", "5"],
    "input_alone": ["--rounds", "7"],
    "augment": ["--epochs", "30", "--seeds", "2"],
    "planner": [],
    "pipeline": ["--rounds", "5", "--trace", "docs/pipeline_trace.svg"],
    "chaos": ["--kills", "20", "--worker-kills", "5", "--seed", "0"],
    "distill": ["--seeds", "5"],
    "compression": ["--rounds", "7"],
    "applications": [],
    "fallback": [],
    "deploy": ["--rounds", "7"],
    "sweep": ["--trials", "8", "--seeds", "3"],
    "elastic": ["--rounds", "5"],
    "first_step": ["--rounds", "3"],
    "search": ["--recipe", "image_transfer", "--repeat", "3", "--target", "max_latency_ratio=0.5",
               "--target", "fine_tune_epochs=6", "--target", "qat_epochs=3"],
    "backbones": [],
    # (its planner grid, 20 minutes more, is an entry of its own: recompute.py --only-grid)
    "recompute": ["--rounds", "31", "--no-grid"],
}


def machine() -> str:
    """The CPU model, core count and bfloat16 and int8 instructions (figures differ
    between machines)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from benchmarks.record import cpu_features

    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"{model}, {os.cpu_count()} cores ({cpu_features()})" + (f", GPUs {gpus}" if gpus else "")


def run(name: str) -> dict:
    """Run one benchmark; its entry for results.json."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as rows:
        command = [sys.executable, f"benchmarks/{name}.py", *SCRIPTS[name]]
        print(f"== {' '.join(['python', *command[1:]])}", flush=True)
        env = {**os.environ, "TFTRAIN_BENCHMARK_RESULTS": rows.name,
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        code = subprocess.run(command, cwd=ROOT, env=env).returncode
        figures = [json.loads(line) for line in rows.read().splitlines() if line.strip()]
    if code or not figures:
        raise SystemExit(f"benchmarks/{name}.py failed (exit {code}); results.json unchanged "
                         "for it")
    return {"date": datetime.date.today().isoformat(), "machine": machine(),
            "command": " ".join(["python", f"benchmarks/{name}.py", *SCRIPTS[name]]),
            "rows": [{"figure": f["figure"], "value": f["value"]} for f in figures]}


def table(results: dict) -> str:
    """The benchmark table: every kept figure, in SCRIPTS' order."""
    lines = ["| figure | value | measured | command |", "|---|---|---|---|"]
    # a benchmark's entry, then those of its other runs (`NAME:what`, e.g. other arguments)
    keys = [k for name in SCRIPTS for k in
            [name, *sorted(k for k in results if k.startswith(f"{name}:"))]]
    for key in keys:
        entry = results.get(key)
        if entry is None:
            continue
        when = f"{entry['date']}, {entry['machine']}" + (f"; {entry['note']}" if entry.get("note") else "")
        for i, row in enumerate(entry["rows"]):
            lines.append(f"| {row['figure']} | {row['value']} | {when if i == 0 else 'same run'} "
                         f"| {'`' + entry['command'] + '`' if i == 0 else 'same run'} |")
    return "\n".join(lines)


def cited(root: Path = ROOT) -> dict[str, list[str]]:
    """The benchmarks whose figures are documented: every one in SCRIPTS (the table's),
    and every `benchmarks/NAME.py` README or a docs page cites, with where."""
    import re
    found: dict[str, list[str]] = {name: ["the benchmark table"] for name in SCRIPTS}
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for name in re.findall(r"benchmarks/(\w+)\.py", page.read_text()):
            found.setdefault(name, []).append(str(page.relative_to(root)))
    return found


def missing(results: dict, root: Path = ROOT) -> list[str]:
    """One line per documented benchmark without a figure its command wrote on a named
    machine: no entry in results.json, or one copied by hand."""
    lines = []
    for name, where in cited(root).items():
        entries = [e for k, e in results.items() if k == name or k.startswith(f"{name}:")]
        pages = ", ".join(sorted(set(where)))
        if not entries:
            lines.append(f"{name}: no entry in benchmarks/results.json (cited in {pages}); "
                         f"run python -m benchmarks {name}")
        for key, entry in ((k, e) for k, e in results.items()
                           if k == name or k.startswith(f"{name}:")):
            if "copied" in entry.get("note", "") or "see README" in entry.get("machine", ""):
                lines.append(f"{name}: its entry was copied by hand, not written by its command "
                             f"on a named machine; run python -m benchmarks {name}")
            elif not _its_command(key, entry.get("command", "")):
                lines.append(f"{key}: its entry's command ({entry.get('command')!r}) is not "
                             f"one python -m benchmarks runs; run python -m benchmarks {name}")
    return lines


def unrecorded(results: dict, root: Path = ROOT) -> list[str]:
    """One line per speed ratio (`1.19x`) that README or a docs page writes beside a
    benchmark's command (in the same paragraph or list item, outside tables) and that
    none of that benchmark's entries holds: a figure from another run, or older than the
    entry its command wrote."""
    import re
    lines = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for part in re.split(r"\n\s*\n|\n(?=[-*] )", page.read_text()):
            if part.lstrip().startswith("|"):
                continue
            names = set(re.findall(r"benchmarks/(\w+)\.py", part)) | set(
                re.findall(r"python -m benchmarks (\w+)", part))
            held = json.dumps([e for k, e in results.items()
                               if k.partition(":")[0] in names])
            for figure in re.findall(r"(?<![\w.])(\d+\.\d+)x\b", part) if names else []:
                if figure not in held:
                    lines.append(f"{page.relative_to(root)}: {figure}x, beside "
                                 f"{', '.join(sorted(names))}, is in none of its entries; "
                                 "rerun the benchmark or take the figure out")
    return lines


def _its_command(key: str, command: str) -> bool:
    """Whether an entry's command is its benchmark's: the harness's own for NAME, the
    script with other arguments for NAME:what."""
    name, _, other = key.partition(":")
    script = f"python benchmarks/{name}.py"
    if name not in SCRIPTS:
        return command.startswith(script)
    return command.startswith(script + (" " if other else "")) if other else \
        command == " ".join([script, *SCRIPTS[name]])


def write_readme(results: dict) -> None:
    text = TABLE.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"docs/performance.md has no {BEGIN} ... {END} markers for the table")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    TABLE.write_text(f"{head}{BEGIN}\n{table(results)}\n{END}{tail}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"benchmarks to run (default: all): {', '.join(SCRIPTS)}")
    p.add_argument("--table", action="store_true", help="only rewrite the benchmark table")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in SCRIPTS]
    if unknown:
        p.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(SCRIPTS)}")
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for name in [] if args.table else (args.names or list(SCRIPTS)):
        results[name] = run(name)
        RESULTS.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    write_readme(results)
    print(f"docs/performance.md's table written from {os.path.relpath(RESULTS, ROOT)}")
    gaps = missing(results) + unrecorded(results)
    if gaps:
        raise SystemExit("documented figures without their benchmark's entry:\n  "
                         + "\n  ".join(gaps))


if __name__ == "__main__":
    main()
