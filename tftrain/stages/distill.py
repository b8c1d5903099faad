"""Knowledge distillation: a smaller student learns from the trained model (the teacher).

    loss = alpha * CE(labels, student) + (1 - alpha) * T^2 * KL(softmax(teacher / T) ||
                                                                softmax(student / T))

(Hinton et al., 2015: the T^2 keeps the soft term's gradients at the scale of the hard
one's as T changes). The teacher is this run's trained model, or a SavedModel with a
`serving_default` signature returning `logits` (`compression.distillation.teacher`,
which then replaces the training stage). The student is any registry model; it trains
with training's optimizer and schedule under the run's strategy, precision and
accumulation, checkpointed and resumable like every stage, and it is what the later
stages (prune, QAT) and the export get. Validation reports the student's own loss and
metrics on the labels.
"""
from __future__ import annotations

from pathlib import Path

from tftrain.config import ConfigError
from tftrain.core import console
from tftrain.stages.base import Built, Stage


class Distill(Stage):
    name = "distill"
    section = "compression.distillation"

    retrains = True

    def supersedes(self) -> tuple[str, ...]:
        return ("train",) if self.settings(self.cfg).teacher else ()

    def plan(self, net, ctx):
        """The teacher (checked), and the student, built now (its initial weights from the
        run's seed) so that the later stages can check it."""
        from tftrain.core.keras import keras
        from tftrain.models import build_model

        cfg = self.settings(self.cfg)
        trust = self.cfg.model.trust_code
        self.teacher = net if cfg.teacher is None else load_teacher(cfg.teacher, ctx.source.spec,
                                                                    trust)
        keras.utils.set_random_seed(self.cfg.run.seed)
        self.student = ctx.parallel.build(lambda: ctx.precision.build(
            lambda: build_model(cfg.student, ctx.source.spec, f"{self.section}.student", trust)))
        return self.student

    def build(self, net, ctx) -> Built:
        if net is not None:          # the trained model, as the training stage finished it
            self.teacher = net
        return Built(self.student)

    def train_model(self):
        return distiller(self.teacher, self.settings(self.cfg))

    def describe(self, ctx) -> str:
        cfg = self.settings(self.cfg)
        teacher = cfg.teacher or "the trained model"
        return (f"{self.length()}; student {cfg.student.name} "
                f"({self.student.count_params():,} parameters) learns from {teacher} at "
                f"temperature {cfg.temperature:g}, alpha {cfg.alpha:g}")


def distiller(teacher, cfg):
    """`distiller_class()` learning from `teacher` at `cfg`'s (a `DistillationConfig`)
    temperature and alpha."""
    return type("Distiller", (distiller_class(),), {"teacher": staticmethod(teacher),
                                                    "temperature": float(cfg.temperature),
                                                    "alpha": float(cfg.alpha)})


def distiller_class():
    """`TrainModel` with the distillation loss (built on first use: TensorFlow loads only
    when a run needs it)."""
    import tensorflow as tf

    from tftrain.training.train_step import TrainModel

    global _DISTILLER
    if _DISTILLER is not None:
        return _DISTILLER

    class Distiller(TrainModel):
        """tftrain's train step with the distillation loss (`teacher`, `temperature` and
        `alpha` are set on a subclass per stage; the teacher is not the model's own
        state: it is neither trained nor checkpointed with the student)."""

        teacher = None
        temperature, alpha = 4.0, 0.1

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
            # The labels' term, as Keras computes it (mean over the micro-batch, divided by
            # the replicas): also what `loss` reports.
            hard = self.compiled_loss(y, y_pred, sample_weight)
            soft = soft_target_loss(self.teacher(x, training=False), y_pred, self.temperature,
                                    sample_weight)
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            loss = self.alpha * hard + (1.0 - self.alpha) * soft / replicas
            if self.losses:          # the layers' own (regularization) losses, as Keras adds them
                loss += tf.add_n(self.losses) / replicas
            return loss

    _DISTILLER = Distiller
    return _DISTILLER


_DISTILLER = None


def soft_target_loss(teacher_logits, student_logits, temperature: float, sample_weight=None):
    """T^2 * KL(softmax(teacher / T) || softmax(student / T)), the mean over the batch
    (weighted like Keras' losses: a weight-0 padding example counts for nothing)."""
    import tensorflow as tf

    t = tf.stop_gradient(tf.cast(teacher_logits, tf.float32)) / temperature
    s = tf.cast(student_logits, tf.float32) / temperature
    log_t, log_s = tf.nn.log_softmax(t), tf.nn.log_softmax(s)
    kl = tf.reduce_sum(tf.exp(log_t) * (log_t - log_s), axis=-1)
    if sample_weight is not None:
        kl = kl * tf.cast(tf.reshape(sample_weight, tf.shape(kl)), tf.float32)
    return temperature**2 * tf.reduce_sum(kl) / tf.cast(tf.size(kl), tf.float32)


def load_teacher(path: str, spec, trust_code: bool = False):
    """A SavedModel's `serving_default` logits as a callable `teacher(x, training)`; its
    graph is read first, and a teacher whose ops reach outside the model (files, Python)
    is refused unless `trust_code` (`model.trust_code`)."""
    import tensorflow as tf
    from tftrain.models import file_code

    key = "compression.distillation.teacher"
    if not (Path(path) / "saved_model.pb").is_file():
        raise ConfigError(f"{key}: {path} is not a SavedModel directory (no saved_model.pb); "
                          "give the export/saved_model directory of a finished run")
    code = file_code.check(path, key, trust_code)
    if code:
        console.warn(f"{key}: {path} holds code that runs as it computes (model.trust_code: "
                     f"true): {'; '.join(code[:3])}")
    loaded = tf.saved_model.load(path)
    serve = loaded.signatures.get("serving_default")
    outputs = serve.structured_outputs if serve is not None else {}
    if "logits" not in outputs or outputs["logits"].shape[-1] != spec.num_classes:
        raise ConfigError(f"{key}: {path} needs a serving_default signature returning `logits` "
                          f"for {spec.num_classes} classes (as tftrain's exports do)")

    def teacher(x, training=False):
        return serve(inputs=x)["logits"]
    teacher.saved_model = loaded      # keeps its variables alive
    return teacher
