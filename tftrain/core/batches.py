"""How `train.global_batch_size` divides among replicas and accumulation steps: the
one division of the batch arithmetic (`tftrain.data.batching` builds the rest on it),
here without TensorFlow so that `--dry-run` refuses what the run refuses."""
from __future__ import annotations

from tftrain.core.config_types import ConfigError


def per_replica_batch(cfg, replicas: int, accumulation: int) -> int:
    """Examples per replica per micro-batch: `data.per_replica_batch_size`, or
    `train.global_batch_size` divided by replicas x accumulation steps, which must divide
    it (each replica's micro-batch is the same size, so an update's mean over replicas
    and micro-batches is the global batch's mean). Needs no TensorFlow: `--dry-run`
    calls it too."""
    if cfg.train.global_batch_size is None:
        return cfg.data.per_replica_batch_size
    per_update = replicas * accumulation
    if cfg.train.global_batch_size % per_update:
        raise ConfigError(
            f"train.global_batch_size: {cfg.train.global_batch_size} is not divisible by "
            f"replicas x accumulation_steps = {replicas} x {accumulation}; use a multiple "
            f"of {per_update}")
    return cfg.train.global_batch_size // per_update
