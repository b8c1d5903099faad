"""Compression to a budget, measured: a recipe's dense run searched for a target
(`python -m tftrain.search`), then the chosen file timed again on its own against the
dense float file (LiteRT, the target's batch and threads, rounds alternating between the
two files, the median of the rounds' ratios) and scored again on the validation split,
beside what the search recorded. Reports the search's wall time against the estimate it
printed, how many candidates it ran before the first that met the target, and the CPU's
int8 and bfloat16 instructions (int8 outruns float only with VNNI).

`--repeat N`: the one trained run searched N times afresh (each in a copy of the run
directory, its checkpoints hard-linked), and each candidate's decision in each search
(meets, misses, borderline) with its latency interval: whether the searches agree on
every candidate that is not borderline.

    python benchmarks/search.py --recipe image_transfer --target max_latency_ratio=0.5
    python benchmarks/search.py --run runs/image-transfer --rounds 15      # a searched run
    python benchmarks/search.py --repeat 3 --target max_latency_ratio=0.5 \
        --target fine_tune_epochs=6 --target qat_epochs=3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import record

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
ROOT = Path(__file__).resolve().parents[1]


def trained(recipe: str, runs: Path) -> Path:
    """The recipe's run under `runs`, trained once."""
    import yaml
    name = yaml.safe_load((ROOT / "configs" / f"{recipe}.yaml").read_text())["run"]["name"]
    run_dir = runs / name
    if not (run_dir / "summary.json").exists():
        subprocess.run([sys.executable, "-m", "tftrain.run", f"configs/{recipe}.yaml",
                        "--run-dir", str(runs)], cwd=ROOT, check=False)
    return run_dir


def searched(recipe: str, targets: list[str], runs: Path) -> Path:
    """The recipe trained (once) under `runs` and searched for `targets`."""
    return search(trained(recipe, runs), targets)


def search(run_dir: Path, targets: list[str]) -> Path:
    """`python -m tftrain.search` on a trained run (resumed where it was searched)."""
    args = [a for t in targets for a in ("--target", t)]
    code = subprocess.run([sys.executable, "-m", "tftrain.search", str(run_dir), *args],
                          cwd=ROOT).returncode
    if code not in (0, 3):
        raise SystemExit(f"the search failed (exit {code})")
    return run_dir


def timed_again(chosen: Path, dense: Path, batch: int, threads: int, rounds: int) -> float:
    """The chosen file's latency over the dense file's, on its own: `rounds` rounds
    alternating between them (`search.timing.retimed`, 0.25 s a file a round), the median
    ratio."""
    from types import SimpleNamespace

    from tftrain.search import timing
    return float(np.median(timing.retimed(chosen, dense, SimpleNamespace(
        batch=batch, threads=threads), rounds, round_seconds=0.25)))


def accuracy_again(run_dir: Path, chosen: Path) -> float:
    from tftrain.config import load_config
    from tftrain.data import BatchPlan, load_source, val_dataset
    from tftrain.export.artifacts import tflite_logits
    cfg = load_config(run_dir / "config.yaml")
    source = load_source(cfg.data, cfg.run.seed)
    x, y = (np.concatenate(p) for p in zip(*val_dataset(source, BatchPlan(256, 1, 1), cfg.data)
                                           .as_numpy_iterator()))
    return float(np.mean(np.argmax(tflite_logits(chosen.read_bytes(), x)[0], -1) == y))


def repeated(recipe: str, targets: list[str], runs: Path, n: int) -> None:
    """The recipe trained once, searched `n` times afresh, each candidate's decision in
    each search beside the others'."""
    import shutil
    base = trained(recipe, runs)
    records = []
    for i in range(n):
        copy = runs / f"search-{i + 1}" / base.name
        if not copy.exists():
            shutil.copytree(base, copy, copy_function=os.link,
                            ignore=shutil.ignore_patterns("search"))
        search(copy, targets)
        records.append(json.loads((copy / "search" / "search.json").read_text()))
    from tftrain.config.compression import TargetConfig
    from tftrain.search import timing
    from tftrain.search.front import meets
    target = TargetConfig(**records[0]["target"])
    names = [c for c in records[0]["candidates"] if c != "float"]
    names += [c for r in records[1:] for c in r["candidates"] if c not in names and c != "float"]
    found, agree = [], []
    for name in names:
        seen = []
        for r in records:
            f = (r["candidates"].get(name) or {}).get("figures")
            if f is None:
                seen.append((r["candidates"].get(name) or {}).get("status", "not tried"))
                continue
            # the interval and whether it straddles the limit, from the recorded rounds by
            # the rule of this tree (`search.timing`), whichever tree ran the search
            low, high = timing.ratio_interval(f.get("latency_rounds", [f["latency_ratio"]]))
            borderline = timing.straddles((low, high), timing.ratio_limit(target, r["dense"]))
            word = ("meets" if meets(f, target) else "misses") + \
                (" (borderline)" if borderline else "")
            seen.append(f"{word} {f['latency_ratio']:.2f}x [{low:.2f}, {high:.2f}], "
                        f"{len(f.get('latency_rounds', [1]))} rounds, {f['accuracy']:.4f}")
        decided = {s.split()[0] for s in seen if s.startswith(("meets", "misses"))
                   and "borderline" not in s}
        agree.append(len(decided) <= 1)
        found.append((f"search x{n}: {name}", " | ".join(seen)))
    chosen = [r.get("chosen") for r in records]
    found += [(f"search x{n}: chosen in each search", ", ".join(map(str, chosen))),
              (f"search x{n}: every candidate not borderline decided alike",
               f"{'yes' if all(agree) else 'no'} ({sum(agree)} of {len(agree)}); CPU: "
               f"{record.cpu_features()}"),
              (f"search x{n}: wall time of each search",
               ", ".join(f"{r.get('seconds', 0) / 60:.1f} min" for r in records))]
    record.rows(found)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="image_transfer")
    parser.add_argument("--target", action="append", default=[])
    parser.add_argument("--run", type=Path, help="a run searched already: time its choice")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeat", type=int, default=0, help="search the trained run N times")
    parser.add_argument("--runs", type=Path, default=None, help="where the runs go")
    args = parser.parse_args()
    if args.repeat:
        return repeated(args.recipe, args.target or ["max_latency_ratio=0.5"],
                        args.runs or Path(tempfile.mkdtemp(prefix="tftrain-search-")), args.repeat)
    run_dir = args.run or searched(args.recipe, args.target or ["max_latency_ratio=0.5"],
                                   Path(tempfile.mkdtemp(prefix="tftrain-search-")))
    rec = json.loads((run_dir / "search" / "search.json").read_text())
    setting = rec["target"]["latency"]
    chosen = rec["candidates"][rec["chosen"]]["figures"]
    dense_file = run_dir / "search" / "runs" / "float" / "export" / "model.tflite"
    again = timed_again(Path(rec["chosen_file"]), dense_file, setting["batch"],
                        setting["threads"], args.rounds)
    from tftrain.config.compression import TargetConfig
    from tftrain.search.front import meets
    target = TargetConfig(**rec["target"])
    ran = list(rec["candidates"])
    first = next((i for i, n in enumerate(ran)
                  if n != "float" and rec["candidates"][n].get("figures") and
                  meets(rec["candidates"][n]["figures"], target)), None)
    record.rows([
        ("search: target", ", ".join(f"{k} {v}" for k, v in rec["target"].items()
                                     if k.startswith("max_") and v is not None)),
        ("search: met; chosen", f"{rec['met']}; {rec['chosen']}"),
        ("search: candidates run; first meeting the target",
         f"{len(ran) - 1} and the dense reference; "
         + (f"candidate {first}" if first is not None else "none")),
        ("search: chosen file's accuracy (recorded / again); drop vs dense",
         f"{chosen['accuracy']:.4f} / {accuracy_again(run_dir, Path(rec['chosen_file'])):.4f}; "
         f"{chosen['drop'] * 100:.2f} pt"),
        ("search: chosen latency / dense (recorded in the search / timed again)",
         f"{chosen['latency_ratio']:.3f} / {again:.3f} ({args.rounds} rounds, batch "
         f"{setting['batch']}, {setting['threads'] or 'every'} thread; CPU: "
         f"{record.cpu_features()})"),
        ("search: wall time / estimate printed",
         f"{rec.get('seconds', 0) / 60:.1f} / {rec.get('estimate_seconds', 0) / 60:.1f} min"),
    ])


if __name__ == "__main__":
    main()
