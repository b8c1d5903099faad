"""summary.json's headline accuracy: the deployed artifact's, its gap to the last stage
explained."""
from tftrain.report import deployed_accuracy


def _row(layer, local):
    return {"layer": layer, "local_sqnr_db": local, "sqnr_db": local - 5, "op": "CONV_2D"}


def test_the_headline_is_the_deployed_artifact_s_accuracy_beside_the_stage_s():
    artifacts = {"saved_model": {"accuracy": 0.9444}, "tflite_int8": {"accuracy": 0.9407}}
    headline = deployed_accuracy({"val_accuracy": 0.9444}, "qat", artifacts)
    assert headline == {"value": 0.9407, "artifact": "tflite_int8", "stage": "qat",
                        "stage_value": 0.9444, "gap_pt": 0.37,
                        "explanation": "its logits are up to 0 from the in-memory model's"}
    close = deployed_accuracy({"val_accuracy": 0.9444}, "train", {"saved_model": {"accuracy": 0.9444}})
    assert close["artifact"] == "saved_model" and "explanation" not in close
    assert deployed_accuracy({"val_accuracy": 0.9}, "train", {}) is None


def test_a_gap_of_an_int8_artifact_names_its_noisiest_layers():
    rows = [_row("conv_0", 60.0), _row("block_3", 14.2), _row("logits", 50.0)]
    artifacts = {"tflite_int8": {"accuracy": 0.8704, "layers": rows, "label": "int8",
                                 "worst_layers": ["block_3", "logits", "conv_0"]}}
    headline = deployed_accuracy({"val_accuracy": 0.8889}, "qat", artifacts)
    assert headline["gap_pt"] == 1.85
    assert headline["explanation"] == ("noise added most at block_3 (14.2 dB, CONV_2D), logits "
                                       "(50.0 dB, CONV_2D), conv_0 (60.0 dB, CONV_2D); int8")
