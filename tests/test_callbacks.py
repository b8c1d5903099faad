"""Training hooks: resume point, checkpoint cadence, throughput, learning rate."""
import numpy as np
import tensorflow as tf

from tftrain._keras import keras
from tftrain.callbacks import Checkpointer, LearningRateLogger, ResumePoint, Throughput


def tiny():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def fit(model, callbacks, epochs=2, steps=5, start=0):
    x, y = np.ones((10, 3), np.float32), np.zeros((10, 2), np.float32)
    model._training_state = ResumePoint(start)
    history = model.fit(tf.data.Dataset.from_tensors((x, y)).repeat(), epochs=epochs,
                        steps_per_epoch=steps, callbacks=callbacks, verbose=0)
    model._training_state = None
    return history


def test_resume_point_maps_updates_to_epoch_and_step():
    assert ResumePoint(23).maybe_load_initial_counters_from_ckpt(10, 0) == (2, 3)


def test_fit_resumes_mid_epoch_and_runs_only_the_rest(tmp_path):
    model = tiny()
    fit(model, [], epochs=3, steps=5, start=7)
    assert int(model.optimizer.iterations.numpy()) == 15 - 7


def test_checkpoint_every_n_updates_and_at_end(tmp_path):
    model = tiny()
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    manager = tf.train.CheckpointManager(ckpt, str(tmp_path), max_to_keep=10)
    fit(model, [Checkpointer(manager, every=4, steps_per_epoch=5)], epochs=2, steps=5)
    numbers = sorted(int(p.name.split("-")[1].split(".")[0]) for p in tmp_path.glob("ckpt-*.index"))
    assert numbers == [4, 8, 10]


def test_throughput_and_lr_logged():
    model = tiny()
    throughput = Throughput(global_batch=10)
    history = fit(model, [throughput, LearningRateLogger()], epochs=3)
    assert len(throughput.per_epoch) == 3 and all(r > 0 for r in throughput.per_epoch)
    assert history.history["lr"] == [0.10000000149011612] * 3
    assert throughput.steady_rate() in throughput.per_epoch[1:]
