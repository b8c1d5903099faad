"""Transformer layers in their quantizable forms: same function, int8 matmuls in TFLite."""
import numpy as np
import pytest
import tensorflow as tf

from tftrain.compress import qat_transformer, quantization
from tftrain.config import QuantizationConfig
from tftrain.core.keras import keras
from tftrain.data import InputSpec
from tftrain.models import MODELS

SPEC = InputSpec((8,), "int32", 4, 50)
PARAMS = {"embed_dim": 16, "num_heads": 2, "num_layers": 2, "mlp_dim": 32}


def tokens(n, seed=0):
    """Token sequences labelled by their first token (mod 4): attention has to find it."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 50, (n, 8)).astype(np.int32)
    return x, x[:, 0] % 4


def compiled(model):
    model.compile(keras.optimizers.Adam(3e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"])
    return model


@pytest.fixture(scope="module")
def trained():
    """A float transformer trained to ~100% on the first-token task, and its QAT copy
    with calibrated ranges and one epoch of QAT."""
    keras.utils.set_random_seed(5)
    model = compiled(MODELS.get("transformer")(SPEC, **PARAMS))
    x, y = tokens(2048)
    model.fit(x, y, batch_size=64, epochs=6, verbose=0)
    qat = quantization.quantize_model(model, QuantizationConfig(), preserve_sparsity=False)
    quantization.calibrate_ranges(qat, [x[i:i + 128] for i in range(0, 512, 128)])
    compiled(qat).fit(x, y, batch_size=64, epochs=1, verbose=0)
    return model, qat


def test_quantizable_forms_compute_what_the_keras_layers_compute():
    """With every quantizer passing its input through, the QAT model (attention as
    QuantizableAttention with the query scale folded into its projection, Dense on a
    sequence as one einsum, layer norm as mean/variance/rsqrt) is the float model."""
    keras.utils.set_random_seed(1)
    model = MODELS.get("transformer")(SPEC, **PARAMS)
    x, _ = tokens(64, seed=1)
    qat = quantization.quantize_model(model, QuantizationConfig(), preserve_sparsity=False)
    kinds = {type(layer.layer).__name__ for layer in qat.layers if hasattr(layer, "layer")}
    assert {"QuantizableAttention", "SequenceDense", "PlainLayerNorm"} <= kinds
    assert "MultiHeadAttention" not in kinds and "LayerNormalization" not in kinds
    with quantization.quantizers_bypassed():
        got = qat(x, training=False).numpy()
    want = model(x, training=False).numpy()
    assert np.max(np.abs(got - want)) <= 1e-5 * max(1.0, float(np.max(np.abs(want))))


def test_calibration_sets_the_ranges_inside_attention():
    """The six ranges inside each attention (queries, keys, values, logits, weights,
    context) are among the QAT model's range variables and calibration sets them to what
    the float model computes there: the attention weights' range is [0, max weight]."""
    keras.utils.set_random_seed(2)
    model = MODELS.get("transformer")(SPEC, **PARAMS)
    x, _ = tokens(128, seed=2)
    qat = quantization.quantize_model(model, QuantizationConfig(), preserve_sparsity=False)
    attention = [layer.layer for layer in qat.layers
                 if isinstance(getattr(layer, "layer", None), qat_transformer.QuantizableAttention)]
    assert len(attention) == 2
    inside = {id(v) for a in attention for v in a.range_variables()}
    assert len(inside) == 2 * 2 * len(qat_transformer.INTERNAL)
    assert inside <= {id(v) for v in quantization.range_variables(qat)}
    quantization.calibrate_ranges(qat, [x])
    probs = model.get_layer("b0_attn")(model.get_layer("b0_ln1").output,
                                       model.get_layer("b0_ln1").output,
                                       return_attention_scores=True)[1]
    scores = keras.Model(model.inputs, probs)(x).numpy()
    ranges = attention[0]._ranges["weights"]
    assert float(ranges["min_var"].numpy()) == 0.0
    np.testing.assert_allclose(float(ranges["max_var"].numpy()), scores.max(), rtol=1e-5)


@pytest.mark.slow
def test_a_qat_transformer_converts_with_every_matmul_int8(tmp_path, trained):
    """The TFLite file of a QAT transformer runs every projection, feed-forward and
    attention matmul (FULLY_CONNECTED, BATCH_MATMUL), the softmax and the GELU in int8;
    its only float ops are the layer norms', no shape is computed from a tensor; and it
    predicts what the QAT model predicts."""
    from ai_edge_litert.interpreter import Interpreter

    from tftrain.export.artifacts import write_saved_model, convert_tflite, tflite_logits

    model, qat = trained
    source = write_saved_model(keras.Model(qat.inputs, qat.outputs), tmp_path / "saved")
    blob = convert_tflite(source, "int8", None, qat=True)
    interp = Interpreter(model_content=blob)
    tensors = {t["index"]: t for t in interp.get_tensor_details()}
    ops = [(op["op_name"], [tensors[i]["dtype"] for i in op["inputs"] if i >= 0],
            tensors[op["outputs"][0]]) for op in interp._get_ops_details()]
    counts = {}
    for name, inputs, out in ops:
        if name in ("FULLY_CONNECTED", "BATCH_MATMUL", "SOFTMAX", "GELU"):
            assert out["dtype"] == np.int8 and inputs[0] == np.int8, (name, out["name"])
            if name == "FULLY_CONNECTED":
                assert inputs[1] == np.int8, out["name"]            # its weights
            counts[name] = counts.get(name, 0) + 1
        elif out["dtype"] == np.float32 and name != "DEQUANTIZE":
            assert "_ln" in out["name"], (name, out["name"])        # layer norms only
    # shapes are constants (a shape computed from the tensor is ops XNNPack leaves)
    assert [(n, o["name"]) for n, _, o in ops if n in ("SHAPE", "CONCATENATION")] == []
    # per block: 4 projections + 2 feed-forward; then the logits; 2 matmuls per attention
    assert counts == {"FULLY_CONNECTED": 2 * 6 + 1, "BATCH_MATMUL": 2 * 2, "SOFTMAX": 2,
                      "GELU": 2}
    x, y = tokens(512, seed=9)
    lite = tflite_logits(blob, x)[0]
    want = qat.predict(x, verbose=0)
    assert np.mean(want.argmax(1) == y) >= 0.95
    assert np.mean(lite.argmax(1) == want.argmax(1)) >= 0.99
    float_accuracy = np.mean(model.predict(x, verbose=0).argmax(1) == y)
    assert np.mean(lite.argmax(1) == y) >= float_accuracy - 0.01


@pytest.mark.slow
def test_prune_preserving_qat_keeps_attention_kernels_zeros():
    """Zeros in the attention projections stay zero through prune-preserving QAT (the
    quantizable form's kernels take the original's mask by position)."""
    keras.utils.set_random_seed(4)
    model = MODELS.get("transformer")(SPEC, **PARAMS)
    attention = model.get_layer("b0_attn")
    masks = []
    for weight in attention.weights:
        if "kernel" in weight.name:
            value = weight.numpy()
            value[np.abs(value) < np.quantile(np.abs(value), 0.5)] = 0.0
            weight.assign(value)
            masks.append(value == 0)
    qat = compiled(quantization.quantize_model(model, QuantizationConfig(), preserve_sparsity=True))
    x, y = tokens(256, seed=4)
    qat.fit(x, y, batch_size=64, epochs=1, verbose=0)
    wrapper = next(layer for layer in qat.layers if getattr(layer, "layer", None) is not None
                   and layer.layer.name == "b0_attn")
    kernels = [(tf.convert_to_tensor(w) * tf.cast(v["sparsity_mask"], w.dtype)).numpy()
               for w, _, v in wrapper._weight_vars]
    assert len(kernels) == 4
    for mask, kernel in zip(masks, kernels):
        assert np.all(kernel.reshape(mask.shape)[mask] == 0)
        assert np.mean(kernel != 0) > 0.45
