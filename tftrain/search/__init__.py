"""Compression to a budget: `python -m tftrain.search RUN_DIR --target KEY=VALUE ...`
finds the smallest, fastest deployable file within an accuracy budget, starting from a
completed run's dense model (`search` from Python).

The target is `compression.target` (the run's config, changed by `--target`): the
accuracy the file may lose against the dense model's float file, and optionally its
bytes, its latency in ms or as a share of the dense file's, measured as a deployment
runs it (`latency`). Candidates (`candidates.py`) are tried cheap and likely first, then
Optuna proposes more; each fine-tunes from the dense checkpoints for a bounded number of
updates (`runner.py`). Every candidate's figures, the Pareto front and the chosen one
are kept in `RUN_DIR/search/`; when nothing meets the target the closest is exported
and the command exits 3 (`tftrain.core.exit_codes.TARGET_MISSED`).

May import: `tftrain.core`, `tftrain.config`, `tftrain.runtime`, `tftrain.training`
(candidates run as `python -m tftrain.run` processes, never in this one).
"""
from __future__ import annotations


def search(run_dir, target=(), sets=(), dry_run: bool = False) -> dict:
    """Search `run_dir` (a completed run) for `target` (`KEY=VALUE` items of
    `compression.target`, or a dict); `sets`: config overrides for every candidate.
    Returns the search's record (`search/search.json`): `met`, `chosen`,
    `chosen_file`, `front` and each candidate's figures. `dry_run`: the plan and the
    estimate only."""
    from tftrain.core import console
    from tftrain.search.runner import Search

    if isinstance(target, dict):
        target = [f"{k}={v}" for k, v in target.items()]
    found = Search(run_dir, list(target), list(sets))
    if dry_run:
        for line in found.describe(found.plan()).splitlines():
            console.say(line)
        return found.record
    return found.run()
