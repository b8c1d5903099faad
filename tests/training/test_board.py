"""TensorBoard's hyperparameters and export figures: read back with TensorBoard's own
event reader and HParams plugin data."""
from __future__ import annotations

import tensorflow as tf
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tftrain.config import dump_config, load_config
from tftrain.training import board


def _events(path):
    return EventAccumulator(str(path), size_guidance={"tensors": 0}).Reload()


def _scalar(events, tag):
    return [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]


def test_the_config_is_one_hparams_session_with_the_final_metrics(tmp_path):
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    cfg = load_config(None, ["train.optimizer.learning_rate=0.003", "train.epochs=4"])
    board.write_hparams(tmp_path, yaml.safe_load(dump_config(cfg)),
                        {"val_accuracy": 0.93, "note": "text"}, "run-7")
    events = _events(tmp_path)
    assert _scalar(events, "final/val_accuracy") == [(0, 0.9300000071525574)]
    assert "final/note" not in events.Tags()["tensors"]      # numbers only
    content = events.PluginTagToContent(metadata.PLUGIN_NAME)
    start = plugin_data_pb2.HParamsPluginData.FromString(
        content[metadata.SESSION_START_INFO_TAG]).session_start_info
    values = {k: v for k, v in start.hparams.items()}
    assert values["train.optimizer.learning_rate"].number_value == 0.003
    assert values["train.epochs"].number_value == 4
    assert values["model.name"].string_value == cfg.model.name
    assert start.group_name == "run-7"
    assert len(values) == len(board.flat(yaml.safe_load(dump_config(cfg))))


def test_flat_names_every_leaf_and_writes_what_hparams_cannot_take_as_text():
    assert board.flat({"a": {"b": 1, "c": [1, 2], "d": None, "e": {}}, "f": True}) == \
        {"a.b": 1, "a.c": "[1, 2]", "a.d": "None", "a.e": "{}", "f": True}


def test_the_export_figures_and_each_int8_artifact_s_layers(tmp_path):
    rows = [{"layer": "a", "op": "CONV_2D", "sqnr_db": 40.0, "local_sqnr_db": 45.0,
             "max_abs_diff": 0.1},
            {"layer": "b", "op": "FULLY_CONNECTED", "sqnr_db": 30.0, "local_sqnr_db": 35.0,
             "max_abs_diff": 0.2}]
    board.write_export(tmp_path, {
        "tflite_int8": {"layers": rows, "size_bytes": 2048, "gzip_bytes": 1024,
                        "accuracy": 0.5, "latency_grid": {"batch1_threads1": 0.25}},
        "saved_model": {"size_bytes": 4096, "gzip_bytes": 3072, "accuracy": None}})
    events = _events(tmp_path)
    assert _scalar(events, "tflite_int8/sqnr_db") == [(0, 40.0), (1, 30.0)]
    assert _scalar(events, "tflite_int8/local_sqnr_db") == [(0, 45.0), (1, 35.0)]
    assert "tflite_int8/layers" in events.Tags()["tensors"]
    assert _scalar(events, "tflite_int8/size_kib") == [(0, 2.0)]
    assert _scalar(events, "tflite_int8/accuracy") == [(0, 0.5)]
    assert _scalar(events, "tflite_int8/latency/batch1_threads1") == [(0, 0.25)]
    assert _scalar(events, "saved_model/gzip_kib") == [(0, 3.0)]
    tags = events.Tags()["tensors"]
    assert "saved_model/accuracy" not in tags and "saved_model/layers" not in tags
