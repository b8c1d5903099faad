"""TensorBoard beyond the training curves (`progress.UpdateLog`, `epoch_logs`): the run's
config as hyperparameters with its final metrics (the HParams dashboard compares runs by
them) and the export's figures, each under the run's `tensorboard/`."""
from __future__ import annotations

from pathlib import Path

HPARAMS, EXPORT = "hparams", "export"


def flat(config: dict, prefix: str = "") -> dict:
    """A plain config (`dump_config`'s YAML, read) as `section.key: value` with values
    HParams takes (numbers, booleans, strings: lists and None written as text)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = str(value)
    return out


def write_hparams(directory: Path, config: dict, metrics: dict, run_name: str) -> None:
    """The config as one HParams session named `run_name`, with `metrics` (the final
    validation figures) as its scalars."""
    import tensorflow as tf
    from tensorboard.plugins.hparams import api as hp

    writer = tf.summary.create_file_writer(str(directory))
    with writer.as_default():
        hp.hparams(flat(config), trial_id=run_name)
        for name, value in metrics.items():
            if isinstance(value, (int, float)):
                tf.summary.scalar(f"final/{name}", float(value), step=0)
    writer.close()


FIGURES = (("size_kib", lambda a: a["size_bytes"] / 1024),
           ("gzip_kib", lambda a: a["gzip_bytes"] / 1024),
           ("accuracy", lambda a: a["accuracy"]),
           ("latency_ms", lambda a: a["latency_ms"]),
           ("logit_sqnr_db", lambda a: a["logit_sqnr_db"]))


def write_export(directory: Path, artifacts: dict) -> None:
    """Each artifact's figures (`FIGURES`, the ones it has) as scalars `<artifact>/<figure>`
    and its latency grid as `<artifact>/latency/<cell>`; each int8 artifact's layers as
    two curves over their depth (accumulated and added SQNR, dB) and a table."""
    import tensorflow as tf

    if not artifacts:
        return
    writer = tf.summary.create_file_writer(str(directory))
    with writer.as_default():
        for name, entry in artifacts.items():
            for figure, read in FIGURES:
                try:
                    value = read(entry)
                except (KeyError, TypeError):
                    continue
                if value is not None:
                    tf.summary.scalar(f"{name}/{figure}", float(value), step=0)
            for cell, ms in (entry.get("latency_grid") or {}).items():
                tf.summary.scalar(f"{name}/latency/{cell}", float(ms), step=0)
            rows = entry.get("layers") or []
            for depth, row in enumerate(rows):
                tf.summary.scalar(f"{name}/sqnr_db", row["sqnr_db"], step=depth)
                tf.summary.scalar(f"{name}/local_sqnr_db", row["local_sqnr_db"], step=depth)
            if rows:
                table = ("| layer | op | SQNR (dB) | added (dB) | max abs diff |\n"
                         "|---|---|---|---|---|\n" +
                         "\n".join(f"| {r['layer']} | {r['op']} | {r['sqnr_db']} | "
                                   f"{r['local_sqnr_db']} | {r['max_abs_diff']:.3g} |"
                                   for r in rows))
                tf.summary.text(f"{name}/layers", table, step=0)
    writer.close()
