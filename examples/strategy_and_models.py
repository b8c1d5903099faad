"""Use tftrain's pieces from Python: a strategy from config, a registry model, plain fit.

    python examples/strategy_and_models.py
"""
import tftrain  # noqa: F401  (first: sets TF_USE_LEGACY_KERAS)
import tf_keras as keras
from tftrain import build_model, build_strategy, load_config
from tftrain.data import distribute, epoch_layout, load_source, plan_batches, val_dataset
from tftrain.runtime.strategy import device_table
from tftrain.training.losses import build_loss
from tftrain.training.train_step import TrainModel

cfg = load_config("configs/quickstart.yaml", ["train.accumulation_steps=2"])
strategy = build_strategy(cfg)                     # mirrored over 2 virtual CPUs
print(device_table(strategy))

source = load_source(cfg.data, seed=0)
plan = plan_batches(cfg, strategy.num_replicas_in_sync)
with strategy.scope():
    model = TrainModel.wrap(build_model(cfg.model, source.spec), plan.accumulation)
    model.compile(keras.optimizers.Adam(0.003), build_loss("sparse_categorical_crossentropy"),
                  metrics=["accuracy"])
# one input pipeline per worker, each replica its share of every update
model.fit(distribute(strategy, source, plan, cfg.data, seed=0), epochs=15,
          steps_per_epoch=epoch_layout(source, plan, cfg.data).steps(),
          validation_data=val_dataset(source, plan), verbose=2)
print("global batch per update:", plan.global_batch)
