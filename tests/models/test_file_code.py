"""Model files that carry code: refused before any of it runs unless trusted, with the
same verdicts as modelscan on every kind of file."""
import json
import os

import pytest
import tensorflow as tf

from helpers import QUICKSTART, cli
from tftrain.config import ConfigError
from tftrain.core.keras import keras, keras3
from tftrain.models import file_code

MARKER = "TFTRAIN_TEST_MARKER"


def lambda_model(lambdas: int = 1):
    """A tf_keras model whose Lambda layers, when they run, write the file
    $TFTRAIN_TEST_MARKER names (the bytecode needs nothing but builtins: it runs where the
    file is loaded)."""
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Flatten()(inputs)
    for i in range(lambdas):
        x = keras.layers.Lambda(
            lambda t: (__import__("pathlib").Path(__import__("os").environ[
                "TFTRAIN_TEST_MARKER"]).write_text("the Lambda's bytecode ran") and t)
            if "TFTRAIN_TEST_MARKER" in __import__("os").environ else t, name=f"marker_{i}")(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))


def writes_a_file(directory):
    """A SavedModel whose serving function writes a file (a WriteFile op in its graph)."""
    class Writer(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 8, 8, 1], tf.float32)])
        def serve(self, inputs):
            tf.io.write_file(str(directory / "written"),
                             tf.strings.as_string(tf.reduce_sum(inputs)))
            return {"logits": tf.zeros([tf.shape(inputs)[0], 10])}
    module = Writer()
    tf.saved_model.save(module, str(directory), signatures={"serving_default": module.serve})
    return directory


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every kind of file the scanner agreement covers: (name, path, carries code)."""
    root = tmp_path_factory.mktemp("model_files")
    os.environ.pop(MARKER, None)
    made = []
    model = lambda_model()
    model.save(root / "lambda.h5")
    model.save(root / "lambda_saved_model")
    k3 = keras3()
    inputs = k3.Input((8, 8, 1))
    x = k3.layers.Lambda(lambda t: t * 2.0, name="doubles")(k3.layers.Flatten()(inputs))
    k3.Model(inputs, k3.layers.Dense(10)(x)).save(root / "lambda_keras3.keras")
    writes_a_file(root / "write_file_saved_model")
    made += [("Lambda, tf_keras .h5", root / "lambda.h5", True),
             ("Lambda, tf_keras SavedModel", root / "lambda_saved_model", True),
             ("Lambda, Keras 3 .keras", root / "lambda_keras3.keras", True),
             ("WriteFile op, SavedModel", root / "write_file_saved_model", True)]
    clean = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None,
                                           classes=10)
    clean.save(root / "mobilenet_v2.h5")
    clean.save(root / "mobilenet_v2.keras")
    clean.save(root / "mobilenet_v2_saved_model")
    k3.applications.MobileNetV3Small(input_shape=(32, 32, 3), weights=None, classes=10,
                                     include_preprocessing=False).save(root / "mobilenet_v3.keras")
    made += [("MobileNetV2, tf_keras .h5", root / "mobilenet_v2.h5", False),
             ("MobileNetV2, tf_keras .keras", root / "mobilenet_v2.keras", False),
             ("MobileNetV2, tf_keras SavedModel", root / "mobilenet_v2_saved_model", False),
             ("MobileNetV3Small, Keras 3 .keras", root / "mobilenet_v3.keras", False)]
    return made


def modelscan_flags(path) -> bool:
    """Whether modelscan (the outside scanner) reports an issue in the file."""
    from modelscan.modelscan import ModelScan
    result = ModelScan().scan(str(path))
    return bool(result["issues"])


@pytest.mark.slow
def test_tftrain_refuses_exactly_the_files_modelscan_flags(files, quickstart_run):
    own = quickstart_run[0] / "export" / "saved_model"
    table = []
    for name, path, carries in [*files, ("tftrain's own SavedModel export", own, False)]:
        ours = bool(file_code.findings(path))
        theirs = modelscan_flags(path)
        table.append((name, theirs, ours))
        assert ours == theirs == carries, (name, ours, theirs)
    assert sum(t[2] for t in table) == 4 and len(table) == 9


def test_what_is_found_is_named(files):
    paths = {name: path for name, path, _ in files}
    assert [str(f) for f in file_code.findings(paths["Lambda, tf_keras .h5"])] == [
        "layer marker_0 (Lambda: Python bytecode run while loading)"]
    assert [str(f) for f in file_code.findings(paths["Lambda, tf_keras SavedModel"])] == [
        "layer marker_0 (Lambda: Python bytecode run while loading)"]
    assert [str(f) for f in file_code.findings(paths["Lambda, Keras 3 .keras"])] == [
        "layer doubles (Lambda: Python bytecode run while loading)"]
    found = file_code.findings(paths["WriteFile op, SavedModel"])
    assert found and all(f.where.startswith("op WriteFile in function ") for f in found)


def test_a_refusal_names_at_most_ten_lines_within_120_columns(tmp_path):
    from tftrain.core import console
    lambda_model(lambdas=14).save(tmp_path / "many.h5")
    with pytest.raises(ConfigError) as err:
        file_code.check(str(tmp_path / "many.h5"), "model.name", trusted=False)
    printed = console.problem("tftrain: config error: ", err.value.problems[0]).splitlines()
    assert len(err.value.problems) == 1 and len(printed) <= 10, printed
    assert all(len(line) <= 120 for line in printed), printed
    assert printed[0].startswith("tftrain: config error: model.name: ")
    assert sum(line.startswith("tftrain: config error") for line in printed) == 1
    text = " ".join(line.strip() for line in printed)
    assert ("Lambda: Python bytecode run while loading: layer marker_0, layer marker_1, layer "
            "marker_2, layer marker_3, layer marker_4, layer marker_5 and 8 more") in text
    assert printed[-1].strip() == ("if you trust the file, set model.trust_code: true (its "
                                   "code then runs)")
    assert file_code.check(str(tmp_path / "many.h5"), "model.name", trusted=True)[0] == \
        "layer marker_0 (Lambda: Python bytecode run while loading)"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lambda.h5", "lambda_saved_model"])
def test_a_lambda_file_is_refused_before_its_code_runs_and_runs_when_trusted(files, tmp_path, kind):
    """The CLI on a tf_keras file whose Lambda writes a file when it runs: exit 2, the file
    not written, nothing written in the run directory; trusted: exit 0, the Lambda ran,
    the console and summary.json say so."""
    path = next(p for _, p, _ in files if p.name == kind)
    marker = tmp_path / "marker"
    env = {**os.environ, MARKER: str(marker)}
    args = [QUICKSTART, "--run-dir", tmp_path / "runs", "--smoke",
            f"--set=model={{name: 'file:{path}', params: {{}}}}", "--set=train.epochs=0",
            "--set=export.tflite=none"]
    refused = cli(*args, env=env)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "Lambda: Python bytecode run while loading: layer marker_0" in refused.stderr
    assert not marker.exists() and not (tmp_path / "runs").exists()
    trusted = cli(*args, "--set=model.trust_code=true", env=env)
    assert trusted.returncode == 0, trusted.stderr[-3000:]
    assert marker.read_text() == "the Lambda's bytecode ran"
    said = " ".join(trusted.stdout.split())
    assert said.count("ran while loading it (model.trust_code: true)") == 1, said[:3000]
    summary = json.loads(next((tmp_path / "runs").glob("*/summary.json")).read_text())
    assert summary["model_source"]["trusted_code"] == [
        "layer marker_0 (Lambda: Python bytecode run while loading)"]


def test_a_teacher_that_writes_files_is_refused(files):
    from tftrain.data import InputSpec
    from tftrain.stages.distill import load_teacher
    path = next(p for _, p, _ in files if p.name == "write_file_saved_model")
    with pytest.raises(ConfigError, match="compression.distillation.teacher: .* carries code"):
        load_teacher(str(path), InputSpec((8, 8, 1), "float32", 10))
    teacher = load_teacher(str(path), InputSpec((8, 8, 1), "float32", 10), trust_code=True)
    assert teacher(tf.zeros([2, 8, 8, 1])).shape == (2, 10)
    assert (path / "written").exists()           # trusted: its graph's op ran


def test_a_file_loaded_trusted_is_refused_untrusted_in_the_same_process(tmp_path):
    """A model file is read once a process (`files.builder`): a file with code, built
    trusted, is still refused when built again untrusted (not handed a copy)."""
    from tftrain.data import InputSpec
    from tftrain.models import files
    path = tmp_path / "lambda.h5"
    lambda_model().save(path)
    spec = InputSpec((8, 8, 1), "float32", 10)
    assert files.builder(str(path), trust_code=True)(spec) is not None
    with pytest.raises(ConfigError, match="Lambda"):
        files.builder(str(path), trust_code=False)(spec)
