"""`export.tflite_sparse`: XNNPack's sparse-inference rules checked on the model at plan
time, the sparse file computing the dense one's logits, and whether the path runs."""
import numpy as np
import pytest

from tftrain.config import load_config
from tftrain.core.keras import keras
from tftrain.export import sparse

PRUNED = load_config(None, ["compression.pruning={enabled: true, final_sparsity: 0.7}"])


def sparse_net(size=33, stride=2, first_kernel=3):
    """A network XNNPack can run sparse: 3x3 stride-2 conv over 3 channels padded 1 on
    each side (odd input), depthwise 3x3 and 1x1 convolutions, a global average pool."""
    inputs = keras.Input((size, size, 3))
    h = keras.layers.Conv2D(16, first_kernel, strides=stride, padding="same", name="stem")(inputs)
    h = keras.layers.ReLU(6.0, name="stem_relu")(keras.layers.BatchNormalization(name="stem_bn")(h))
    h = keras.layers.DepthwiseConv2D(3, padding="same", name="dw")(h)
    h = keras.layers.ReLU(name="dw_relu")(h)
    h = keras.layers.Conv2D(32, 1, name="pw")(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(h))


def test_the_rules_are_checked_and_the_first_broken_one_named():
    assert sparse.refusal(sparse_net(), PRUNED.compression.pruning) is None
    assert "at least 2/3" in sparse.refusal(sparse_net(), load_config(None, []).compression.pruning)
    even = sparse.refusal(sparse_net(size=32), PRUNED.compression.pruning)
    assert "start with a 3x3 stride-2 Conv2D" in even and "input 32x32" in even
    assert "stride (1, 1)" in sparse.refusal(sparse_net(stride=1), PRUNED.compression.pruning)
    inputs = keras.Input((33, 33, 3))
    h = keras.layers.Conv2D(8, 3, strides=2, padding="same")(inputs)
    h = keras.layers.Conv2D(8, 3, padding="same", name="full_3x3")(h)
    net = keras.Model(inputs, keras.layers.GlobalAveragePooling2D()(h))
    assert "full_3x3 (Conv2D) is none of them" in sparse.refusal(net, PRUNED.compression.pruning)


def test_a_resnet_run_asking_for_a_sparse_file_exits_2_naming_the_rule(tmp_path, capsys):
    from tftrain.run import main
    code = main(["configs/quickstart.yaml", "--run-dir", str(tmp_path / "runs"), "--set",
                 "export.tflite_sparse=true", "--set",
                 "compression.pruning={enabled: true, final_sparsity: 0.7}"])
    err = capsys.readouterr().err
    assert code == 2 and "export.tflite_sparse: XNNPack's sparse inference" in err
    assert "it starts with conv_0 (Conv2D (3, 3) stride (1, 1)" in err
    assert not (tmp_path / "runs").exists()


def test_the_sparse_file_stores_pruned_weights_sparse_and_computes_the_dense_logits(tmp_path):
    from tftrain.export.artifacts import save_saved_model, tflite_logits
    keras.utils.set_random_seed(0)
    net = sparse_net()
    kernel = net.get_layer("pw").kernel
    values = kernel.numpy()
    values[np.abs(values) < np.quantile(np.abs(values), 0.8)] = 0          # 80% zeros
    kernel.assign(values)
    blob = sparse.convert(save_saved_model(net, tmp_path / "sm"))
    x = np.random.default_rng(0).normal(size=(8, 33, 33, 3)).astype(np.float32)
    np.testing.assert_allclose(tflite_logits(blob, x)[0], net.predict(x, verbose=0), atol=1e-4)
    from tftrain.export.speed import xnnpack
    found = sparse.report(blob, xnnpack(blob))
    assert found["sparse_tensors"] >= 1
    runs, why = sparse.cpu_runs_sparse()
    assert found["sparse_path"] == runs and found["sparse_path_reason"] == why
    assert sparse.cpu_runs_sparse("flags : fpu sse sse2 avx avx2")[0] is False or \
        not __import__("platform").machine().startswith("x86")
    assert sparse.cpu_runs_sparse("flags : fpu sse sse2")[0] is True


@pytest.mark.slow
def test_a_pruned_run_writes_a_verified_sparse_file(tmp_path, monkeypatch):
    """End to end: a model built to XNNPack's rules, pruned to 70%, exports
    `model_sparse.tflite` beside nothing else; checked like every float artifact."""
    import json
    import sys
    import types

    from tftrain.run import main
    module = types.ModuleType("sparse_models")
    module.net = lambda spec: sparse_net(size=spec.shape[0])
    monkeypatch.setitem(sys.modules, "sparse_models", module)
    sets = ["data.params={image_size: 9, channels: 3}", "model={name: 'sparse_models:net', params: {}}",
            "train.epochs=1", "compression.pruning={enabled: true, final_sparsity: 0.7, epochs: 1}",
            "export.tflite=none", "export.saved_model=false", "export.tflite_sparse=true",
            "export.preflight=true"]
    assert main(["configs/quickstart.yaml", "--run-dir", str(tmp_path),
                 *[a for s in sets for a in ("--set", s)]]) == 0
    entry = json.loads((tmp_path / "quickstart" / "summary.json").read_text())["artifacts"]["tflite_sparse"]
    assert entry["verified"] and entry["sparse_tensors"] >= 1
    assert (tmp_path / "quickstart" / "export" / "model_sparse.tflite").stat().st_size == entry["size_bytes"]
    # timed beside the dense float file of the same model
    assert list(entry["float_latency_grid"]) == list(entry["latency_grid"])
    assert all(v > 0 for v in entry["float_latency_grid"].values())
