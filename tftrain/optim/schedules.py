"""Learning-rate schedules: one class per schedule, holding its config fields and how it
is built. `train.schedule.name` selects the class; a field another schedule takes is
refused ("not used by schedule 'constant'"). Adding a schedule is one class here and its
entry in `SCHEDULES`.

Every schedule is a function of `optimizer.iterations`, which counts optimizer updates
(not micro-batches), so warmup and decay are the same whatever the accumulation steps.
Durations ("3 epochs" or a number of updates) become updates through
`Duration.steps(steps_per_epoch, total)`, the one conversion.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from tftrain.core.config_types import ConfigError, Duration, Strict, _parse_duration


@dataclass(frozen=True)
class Horizon:
    """What schedules need to know about the length of training, in updates."""
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int

    @property
    def decay_steps(self) -> int:
        return max(1, self.total_steps - self.warmup_steps)


def _duration(v):
    return None if v is None else _parse_duration(v)


class Schedule(Strict):
    """Fields every schedule takes."""
    if TYPE_CHECKING:
        name: str                  # each schedule's own literal (not a field of the base)
    warmup_steps: Duration = Duration(value=0, unit="steps")

    @field_validator("warmup_steps", mode="before")
    @classmethod
    def _warmup(cls, v):
        return _duration(v)

    def build(self, lr: float, h: Horizon):
        """A LearningRateSchedule of optimizer updates (None: a plain rate)."""
        raise NotImplementedError


def _keras():
    from tftrain.core.keras import keras
    return keras


def _piecewise(lr, boundaries, gamma):
    """lr * gamma**k after the k-th boundary has been reached (update >= boundary)."""
    values = [lr * gamma**i for i in range(len(boundaries) + 1)]
    # PiecewiseConstantDecay switches after step > boundary; ours switch at step == boundary.
    return _keras().optimizers.schedules.PiecewiseConstantDecay([b - 1 for b in boundaries],
                                                                values)


class Constant(Schedule):
    name: Literal["constant"] = "constant"

    def build(self, lr, h):
        from tftrain.optim.rates import Constant as ConstantRate
        return ConstantRate(lr)


class Step(Schedule):
    """lr x gamma every `step_size` (default: every epoch)."""
    name: Literal["step"]
    step_size: Optional[Duration] = None
    gamma: float = Field(0.1, gt=0)

    @field_validator("step_size", mode="before")
    @classmethod
    def _size(cls, v):
        return _duration(v)

    def build(self, lr, h):
        size = self.step_size.steps(h.steps_per_epoch, h.total_steps) if self.step_size \
            else h.steps_per_epoch
        return _piecewise(lr, list(range(size, h.decay_steps, size)) or [h.decay_steps],
                          self.gamma)


class MultiStep(Schedule):
    """lr x gamma at each milestone."""
    name: Literal["multistep"]
    milestones: list[Duration] = []
    gamma: float = Field(0.1, gt=0)

    @field_validator("milestones", mode="before")
    @classmethod
    def _durations(cls, v):
        if not isinstance(v, list):
            raise ValueError("expected a list of durations, e.g. [10, 20] or ['3 epochs', '6 epochs']")
        return [_parse_duration(x) for x in v]

    @model_validator(mode="after")
    def _increasing(self):
        for unit in ("steps", "epochs", "fraction"):
            values = [int(m.value) if float(m.value).is_integer() else m.value
                      for m in self.milestones if m.unit == unit]
            if values != sorted(set(values)):
                raise ValueError(f"train.schedule.milestones: {values} must be increasing "
                                 "(each a later point of training), e.g. [30, 60, 90]")
        return self

    def build(self, lr, h):
        bounds = [m.steps(h.steps_per_epoch, h.total_steps) - h.warmup_steps
                  for m in self.milestones]
        if any(b <= a for a, b in zip(bounds, bounds[1:])):     # mixed units, resolved
            raise ConfigError(f"train.schedule.milestones: they fall at updates "
                              f"{[b + h.warmup_steps for b in bounds]}, which must be "
                              "increasing; list them in order, each at a later update")
        return _piecewise(lr, [max(b, 1) for b in bounds] or [h.decay_steps], self.gamma)


class _Decay(Schedule):
    decay_steps: Optional[Duration] = None      # default: the rest of training

    @field_validator("decay_steps", mode="before")
    @classmethod
    def _decay(cls, v):
        return _duration(v)

    def _steps(self, h: Horizon, default: int) -> int:
        return self.decay_steps.steps(h.steps_per_epoch, h.total_steps) if self.decay_steps \
            else default


class Exponential(_Decay):
    """lr x decay_rate ** (update / decay_steps) (default decay_steps: an epoch)."""
    name: Literal["exponential"]
    decay_rate: float = Field(0.96, gt=0)
    staircase: bool = False

    def build(self, lr, h):
        return _keras().optimizers.schedules.ExponentialDecay(
            lr, self._steps(h, h.steps_per_epoch), self.decay_rate, self.staircase)


class Polynomial(_Decay):
    name: Literal["polynomial"]
    end_learning_rate: float = Field(0.0, ge=0)
    power: float = Field(1.0, gt=0)

    def build(self, lr, h):
        return _keras().optimizers.schedules.PolynomialDecay(
            lr, self._steps(h, h.decay_steps), self.end_learning_rate, self.power)


class Cosine(_Decay):
    name: Literal["cosine"]
    alpha: float = Field(0.0, ge=0, le=1)

    def build(self, lr, h):
        return _keras().optimizers.schedules.CosineDecay(lr, self._steps(h, h.decay_steps),
                                                         self.alpha)


class Plateau(Schedule):
    """A plain rate lowered by `ReduceLROnPlateau` when `monitor` stops improving."""
    name: Literal["plateau"]
    factor: float = Field(0.5, gt=0, lt=1)
    patience: int = Field(3, ge=0)
    min_lr: float = Field(0.0, ge=0)
    min_delta: float = Field(1e-4, ge=0)      # smaller changes are no improvement
    monitor: str = "val_loss"

    @field_validator("warmup_steps")
    @classmethod
    def _no_warmup(cls, v):
        if v.value:
            raise ValueError("warmup is not available with 'plateau'; use cosine/step/... "
                             "with warmup, or drop warmup")
        return v

    def build(self, lr, h):
        return None


# The schedules by `name` (adding one: its class above and its entry here).
SCHEDULES = (Constant, Step, MultiStep, Exponential, Polynomial, Cosine, Plateau)
if TYPE_CHECKING:      # (a union built from SCHEDULES: a type checker sees their base)
    ScheduleConfig = Schedule
else:
    ScheduleConfig = Annotated[Union[SCHEDULES], Field(discriminator="name")]


def names() -> list[str]:
    return [cls.model_fields["name"].annotation.__args__[0] for cls in SCHEDULES]
