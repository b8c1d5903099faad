"""The export phase: every artifact the config asks for (`kinds.KINDS`, in order),
written from one `context.ExportContext`, each made inside `errors.making` (a failure
names its artifact), then each checked against the model (`verification.verify`)."""
from __future__ import annotations

from pathlib import Path

from tftrain.export import kinds, verification
from tftrain.export.context import ExportContext, ExportFlags
from tftrain.export.errors import making


def export_all(model, cfg, out: Path, source, flags: ExportFlags = ExportFlags(),
               float_model=None) -> dict:
    """Write and verify every artifact the run's config `cfg` asks for from `model`;
    returns their report entries by name. `float_model`: the float model before any QAT
    (what a Keras 3 file hands back; default `model`)."""
    wanted = [kind for kind in kinds.enabled(cfg, flags.qat)
              if kind.in_preflight or not flags.untrained]
    if not wanted:
        return {}
    out.mkdir(parents=True, exist_ok=True)
    ctx = ExportContext(model, cfg, out, source, flags, float_model)
    report = {}
    try:
        ctx.write_vocabulary()
        for kind in wanted:
            with making(kind.name):
                report[kind.name] = {**kind.make(ctx), "path": kind.path}
    finally:
        ctx.close()
    # (the accuracy is only read by labels: a QAT model's costs a traced pass)
    return verification.verify(report, cfg.export,
                               ctx.reference_accuracy if flags.by_labels else None, flags.qat,
                               flags.by_labels, flags.untrained)
