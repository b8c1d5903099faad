"""Fixtures the export tests share."""
import numpy as np
import pytest

from tftrain.compress import quantization
from tftrain.config import load_config
from tftrain.core.keras import keras
from tftrain.data import load_source
from tftrain.export import artifacts
from tftrain.models import MODELS

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="session")
def qat_cnn():
    """A digits CNN trained briefly, then QAT (ranges calibrated, one epoch): (model,
    validation inputs, labels)."""
    source = load_source(load_config().data, 0)
    x, y = (np.concatenate(p) for p in zip(*source.val.batch(512).as_numpy_iterator()))
    keras.utils.set_random_seed(0)
    net = MODELS.get("cnn")(source.spec, filters=[8, 16], dense=[32])
    net.compile(keras.optimizers.Adam(0.003), LOSS)
    net.fit(source.calibration(source.num_train).batch(64), epochs=2, verbose=0)
    cfg = load_config(None, ["compression.quantization.enabled=true"]).compression.quantization
    q = quantization.quantize_model(artifacts.inference_model(net), cfg, False)
    quantization.calibrate_ranges(q, [x[:128]])
    q.compile(keras.optimizers.Adam(0.0003), LOSS)
    q.fit(source.calibration(source.num_train).batch(64), epochs=1, verbose=0)
    return q, x, y, source
