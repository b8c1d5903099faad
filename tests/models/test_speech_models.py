"""Speech models: the in-model features (against tf.signal, and the same in LiteRT) and
a Conv1D model through pruning and prune-preserving QAT to an int8 TFLite file that
takes the raw waveform, with the pruned zeros read back from the file."""

import numpy as np
import pytest
import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.data.source import InputSpec
from tftrain.export.artifacts import tflite_logits, tflite_weights
from tftrain.models import MODELS
from tftrain.models.audio import AudioFeatures

from helpers import quick_config


def test_features_are_tf_signal_mfccs_and_litert_computes_the_same():
    rate = 16000
    x = np.random.default_rng(0).normal(size=(3, rate)).astype(np.float32) * 0.1
    layer = AudioFeatures(rate, frame_ms=40, step_ms=20, num_mel_bins=40, num_mfcc=10)
    got = layer(x).numpy()
    stft = tf.signal.stft(x, 640, 320, 1024)
    mel = tf.signal.linear_to_mel_weight_matrix(40, 513, rate, 20.0, 8000.0)
    logmel = tf.math.log(tf.tensordot(tf.abs(stft) ** 2, mel, 1) + 1e-6)
    want = tf.signal.mfccs_from_log_mel_spectrograms(logmel)[..., :10].numpy()
    assert got.shape == (3, 49, 10) == layer.compute_output_shape((3, rate))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    inputs = keras.Input((rate,))
    model = keras.Model(inputs, layer(inputs))
    blob = tf.lite.TFLiteConverter.from_keras_model(model).convert()
    lite, _ = tflite_logits(blob, x)
    np.testing.assert_allclose(lite.reshape(got.shape), got, rtol=1e-3, atol=2e-2)


def test_speech_models_refuse_inputs_that_are_not_waveforms():
    with pytest.raises(ValueError, match=r"needs raw waveforms \[samples\] with a sample rate"):
        MODELS.get("ds_cnn")(InputSpec((8, 8, 1), "float32", 10))


@pytest.mark.slow
def test_conv1d_model_goes_through_pqat_with_sparsity_in_the_int8_file(tmp_path, spoken_digits):
    from tftrain.run import run
    summary = run(quick_config(
        tmp_path, "run.name=kws", "data.name=audio_folder",
        f"data.params={{path: {spoken_digits}, sample_rate: 16000}}",
        "data.validation_fraction=0.25", "data.per_replica_batch_size=16",
        "model={name: conv1d, params: {filters: [32, 32], dropout: 0.0}}", "train.epochs=2",
        "compression.pruning={enabled: true, final_sparsity: 0.5, epochs: 2, frequency: 2}",
        "compression.quantization={enabled: true, epochs: 1}", "export.tflite=int8"))
    art = summary["artifacts"]["tflite_int8"]
    assert art["verified"] and art["input"] == "float32 [16000]"
    # the features compute in float (the waveform's DFT, power, mel and log): said so
    assert art["label"] == f"int8 with {len(art['float_ops'])} float ops"
    assert any(op.startswith("LOG ") for op in art["float_ops"])
    assert not [op for op in art["float_ops"] if op.startswith(("CONV_2D", "FULLY_CONNECTED"))
                and "features" not in op]
    blob = (tmp_path / "kws" / "export" / "model.tflite").read_bytes()
    from ai_edge_litert.interpreter import Interpreter
    interp = Interpreter(model_content=blob)
    (inp,) = interp.get_input_details()
    assert inp["dtype"] == np.float32 and list(inp["shape"]) == [1, 16000]   # the raw waveform
    kinds = {d["op_name"] for d in interp._get_ops_details()}
    # the features in the file, as real ops (the DFT as matrix products: no RFFT2D or
    # COMPLEX_ABS, which the int8 ONNX model could not hold), then int8 convolutions
    assert {"LOG", "CONV_2D"} <= kinds and not {"RFFT2D", "COMPLEX_ABS"} & kinds
    int8 = {name: w for name, w in tflite_weights(blob).items() if w.dtype == np.int8 and w.ndim == 4}
    convs = [w for name, w in int8.items() if "conv_" in name]
    assert len(convs) == 2, list(int8)
    for w in convs:                        # Conv1D kernels, stored as int8 [out, 1, k, in]
        assert abs(np.mean(w == 0) - 0.5) <= 0.01, np.mean(w == 0)
    for name, value in summary["sparsity"].items():
        assert abs(value - 0.5) <= 0.01, (name, value)
