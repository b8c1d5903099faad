"""QAT of the speech features' int8 spectrum (`spectrum: matrix`): each frame at its own
scale times the int8 DFT matrix, the spectrum's range calibrated at a percentile and held,
and a DS-CNN through QAT to an int8 file whose spectrum is one int8 FULLY_CONNECTED."""
import numpy as np
import pytest
import tensorflow as tf

from tftrain.compress import quantization
from tftrain.compress.qat_audio import HeldQuantizer
from tftrain.config import load_config
from tftrain.core.keras import keras
from tftrain.models.audio import AudioFeatures

from helpers import quick_config


def _model(spectrum="matrix"):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4000,))
    x = AudioFeatures(16000, frame_ms=32, step_ms=20, num_mel_bins=20, num_mfcc=8,
                      band=(20.0, 4000.0), spectrum=spectrum, name="features")(inputs)
    x = keras.layers.Flatten(name="flat")(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(x))


def test_the_spectrum_range_is_calibrated_at_its_percentile_and_held_through_updates():
    net = _model()
    cfg = load_config(None, ["compression.quantization.enabled=true"]).compression.quantization
    q = quantization.quantize_model(net, cfg, preserve_sparsity=False)
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(64, 4000)) * rng.uniform(0.01, 1.0, size=(64, 1))).astype(np.float32)
    quantization.calibrate_ranges(q, [x[:32], x[32:]])
    layer = net.get_layer("features")
    frames = layer.frames(tf.constant(x))
    peak = np.maximum(np.abs(frames.numpy()).max(-1, keepdims=True), 1e-4)
    parts = (frames.numpy() / peak) @ layer.dft.numpy()
    ranges = {v.name: float(v.numpy()) for v in q.get_layer("quant_features").weights
              if "spectrum" in v.name.lower() or "activation" in v.name}
    low = [v for k, v in ranges.items() if k.endswith("_min:0")]
    high = [v for k, v in ranges.items() if k.endswith("_max:0")]
    assert len(low) == len(high) == 1, ranges
    # each batch's 99.9th percentile of each tail, the widest of the two batches: inside
    # the values' extent, where the min and max of a moving average would be at it
    want_high = max(np.percentile(p, 99.9) for p in (parts[:32], parts[32:]))
    want_low = min(np.percentile(p, 0.1) for p in (parts[:32], parts[32:]))
    np.testing.assert_allclose([low[0], high[0]], [want_low, want_high], rtol=2e-3)
    assert parts.max() > 1.2 * high[0] and parts.min() < 1.2 * low[0]
    q(x[:32], training=True)                 # an update's forward pass moves no held range
    after = {v.name: float(v.numpy()) for v in q.get_layer("quant_features").weights
             if v.name in ranges}
    assert after == ranges
    assert HeldQuantizer.percentile == 99.9


def test_an_uncalibrated_int8_spectrum_is_refused_and_the_fft_is_not():
    from tftrain.compress.qat_audio import refuse_uncalibrated
    from tftrain.config import ConfigError
    none = load_config(None, ["compression.quantization={enabled: true, calibration_batches: 0}"])
    with pytest.raises(ConfigError, match=r"calibration_batches: 0 leaves the int8 spectrum "
                                          r"of layer features \(spectrum: matrix\)"):
        refuse_uncalibrated(_model(), none.compression.quantization)
    refuse_uncalibrated(_model("fft"), none.compression.quantization)
    auto = load_config(None, ["compression.quantization.enabled=true"])
    refuse_uncalibrated(_model(), auto.compression.quantization)


def test_the_qat_layer_computes_the_spectrum_by_its_quantized_matrix():
    """The QAT model's feature layer reads the fake-quantized `dft` (8 bits, symmetric)
    and frames quantized on [-1, 1] at their own peaks: its features are the float
    layer's within what 8 bits allow, and not equal to them."""
    net = _model()
    cfg = load_config(None, ["compression.quantization.enabled=true"]).compression.quantization
    q = quantization.quantize_model(net, cfg, preserve_sparsity=False)
    x = (np.random.default_rng(1).normal(size=(16, 4000)) * 0.3).astype(np.float32)
    quantization.calibrate_ranges(q, [x])
    want = keras.Model(net.inputs, net.get_layer("features").output)(x).numpy()
    wrapper = q.get_layer("quant_features")
    got = wrapper.layer(x).numpy()           # the wrapped layer with its quantized matrix
    assert wrapper.layer.quantized_dft is not None and not np.array_equal(got, want)
    error = 10 * np.log10(np.var(want) / np.mean((got - want) ** 2))
    assert error > 20, error


def test_the_int8_saved_model_computes_the_features_as_the_qat_model_does():
    """The int8 SavedModel's feature layer (`HeldSpectrum`) quantizes the frames, the
    matrix and the spectrum as the QAT model does at inference; its spectrum range is
    not taken for the layer's output range (which would be the features' 3 dB SQNR)."""
    from tftrain.compress.qat_audio import HeldSpectrum
    from tftrain.export.int8_saved_model import quantized_model
    net = _model()
    cfg = load_config(None, ["compression.quantization.enabled=true"]).compression.quantization
    q = quantization.quantize_model(net, cfg, preserve_sparsity=False)
    x = (np.random.default_rng(2).normal(size=(16, 4000)) * 0.3).astype(np.float32)
    quantization.calibrate_ranges(q, [x])
    int8, _ = quantized_model(q, qat=True)
    layer = int8.get_layer("features")
    assert isinstance(getattr(layer, "layer", layer), HeldSpectrum)
    want = q(x, training=False).numpy()
    np.testing.assert_allclose(int8(x).numpy(), want, atol=1e-4 * np.abs(want).max())


@pytest.mark.slow
def test_a_ds_cnn_with_the_matrix_spectrum_goes_through_qat_to_one_int8_product(
        tmp_path, spoken_digits):
    from ai_edge_litert.interpreter import Interpreter
    from tftrain.core import internals
    from tftrain.run import run
    summary = run(quick_config(
        tmp_path, "run.name=kws", "data.name=audio_folder",
        f"data.params={{path: {spoken_digits}, sample_rate: 16000}}",
        "data.validation_fraction=0.25", "data.per_replica_batch_size=16",
        "model={name: ds_cnn, params: {filters: 16, dropout: 0.0, frames: [32.0, 20.0], "
        "band: [20.0, 4000.0], spectrum: matrix}}", "train.epochs=2",
        "compression.quantization={enabled: true, epochs: 1}", "export.tflite=int8"))
    art = summary["artifacts"]["tflite_int8"]
    assert art["verified"] and art["input"] == "float32 [16000]"
    blob = (tmp_path / "kws" / "export" / "model.tflite").read_bytes()
    interp = Interpreter(model_content=blob)
    interp.allocate_tensors()
    ops = internals.ops_details(interp)
    details = {t["index"]: t for t in interp.get_tensor_details()}
    kinds = [op["op_name"] for op in ops]
    assert "RFFT2D" not in kinds and "COMPLEX_ABS" not in kinds
    # the first matrix product is the spectrum: int8 frames times the int8 [256, 512]
    # matrix (128 bins up to 4 kHz, real and imaginary, of 512-sample frames)
    first = next(op for op in ops if op["op_name"] == "FULLY_CONNECTED")
    dtypes = [details[t]["dtype"] for t in first["inputs"][:2]]
    assert dtypes == [np.int8, np.int8]
    assert list(details[first["inputs"][1]]["shape"]) == [256, 512]
    # the matrix is counted as front end (with the float 128 x 40 mel and 40 x 10 DCT
    # matrices, and at most 4 KB of indices and shapes), the convolutions as network
    front_end = art["weight_bytes"]["front_end"]
    assert 256 * 512 + 4 * (128 * 40 + 40 * 10) <= front_end < 256 * 512 + 4 * (128 * 40 + 40 * 10) + 4096
    assert art["weight_bytes"]["network"] < 256 * 512
    assert art["label"] == f"int8 with {len(art['float_ops'])} float ops"
    assert not [op for op in art["float_ops"] if op.startswith(("CONV_2D", "DEPTHWISE"))]
