"""Does a sweep find a configuration at least as good as the default? The quickstart
with its own values at the trials' seed (and the median of `--seeds` seeds, to show the
seed-to-seed spread) against the best of an N-trial `python -m tftrain.sweep` over
learning rate and weight decay (configs/spaces/quickstart.yaml), on the same validation
split.

    python benchmarks/sweep.py [--trials 8] [--seeds 3]
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import record

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
SPACE = ROOT / "configs" / "spaces" / "quickstart.yaml"
SETS = ["export.tflite=none", "export.saved_model=false"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tftrain-sweep-") as tmp:
        default = []
        for seed in range(args.seeds):
            sets = [*SETS, f"run.seed={42 + seed}", f"run.name=default-{seed}", f"run.dir={tmp}"]
            subprocess.run([sys.executable, "-m", "tftrain.run", str(QUICKSTART),
                            *[a for s in sets for a in ("--set", s)]], check=True, cwd=ROOT,
                           capture_output=True)
            summary = json.loads((Path(tmp) / f"default-{seed}" / "summary.json").read_text())
            default.append(summary["metrics"]["val_accuracy"])
        out = subprocess.run([sys.executable, "-m", "tftrain.sweep", str(QUICKSTART), "--space",
                              str(SPACE), "--trials", str(args.trials), "--dir", tmp,
                              *[a for s in SETS for a in ("--set", s)]],
                             check=True, cwd=ROOT, capture_output=True, text=True).stdout
        print(out)
        rows = (Path(tmp) / SPACE.stem / "trials.csv").read_text().splitlines()
        best = max(float(r.split(",")[4]) for r in rows[1:] if ",complete," in r)
        pruned = sum(",pruned," in r for r in rows[1:])
        median = statistics.median(default)
    same = default[0]                    # run.seed 42: the trials' seed
    record.rows([
        (f"quickstart val_accuracy: default values at the trials' seed (and median of "
         f"{args.seeds} seeds) vs best of a {args.trials}-trial sweep over learning rate and "
         f"weight decay ({pruned} pruned)",
         f"{same:.4f} ({median:.4f}) vs **{best:.4f}** ({(best - same) * 100:+.2f} pt)")])


if __name__ == "__main__":
    main()
