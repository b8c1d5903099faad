"""Config schema, overrides and error text (no TensorFlow needed)."""
import json

import pytest

from helpers import ROOT
from tftrain.config import (Config, ConfigError, Duration, apply_overrides, dump_config,
                            json_schema, load_config, validate)


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_and_design_names():
    cfg = load_config()
    assert cfg.distribute.strategy == "auto"
    assert cfg.precision.policy == "auto"
    assert cfg.data.per_replica_batch_size == 32
    assert cfg.train.accumulation_steps == 1
    assert cfg.export.saved_model is True


def test_overrides_parse_yaml_values():
    cfg = load_config(None, ["train.accumulation_steps=4", "model.params.filters=[8, 16]",
                             "distribute.devices=['/cpu:0', '/cpu:1']", "run.deterministic=true"])
    assert cfg.train.accumulation_steps == 4
    assert cfg.model.params == {"filters": [8, 16]}
    assert cfg.distribute.devices == ["/cpu:0", "/cpu:1"]
    assert cfg.run.deterministic is True


def test_int8_fallback_reads_yaml_off_and_needs_qat():
    assert load_config(None, ["export.int8_fallback=off"]).export.int8_fallback == "off"
    cfg = load_config(None, ["compression.quantization.enabled=true", "export.int8_fallback=auto"])
    assert cfg.export.int8_fallback == "auto" and cfg.export.tflite == "int8"
    assert load_config(None).export.int8_fallback is None          # unset: auto for QAT runs


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(Exception, match="frozen"):
        cfg.train.epochs = 3


@pytest.mark.parametrize("text,expected", [
    (3, Duration(value=3, unit="steps")),
    ("2 epochs", Duration(value=2, unit="epochs")),
    ("500 steps", Duration(value=500, unit="steps")),
    ("0.5 epoch", Duration(value=0.5, unit="epochs")),
    (0.25, Duration(value=0.25, unit="fraction")),
    ("40%", Duration(value=0.4, unit="fraction")),
])
def test_durations(text, expected):
    cfg = load_config(None, [f"train.checkpoint.every={text}"])
    assert cfg.train.checkpoint.every == expected


def test_duration_to_steps_is_the_one_conversion():
    assert Duration(value=2, unit="epochs").steps(23, 1000) == 46
    assert Duration(value=0.5, unit="epochs").steps(23, 1000) == 12
    assert Duration(value=7, unit="steps").steps(23, 1000) == 7
    assert Duration(value=0.25, unit="fraction").steps(23, 1000) == 250


def test_pruning_structure_is_normalised():
    cfg = load_config(None, ["compression.pruning.structure=' 2 : 4'"])
    assert cfg.compression.pruning.structure == "2:4" and cfg.compression.pruning.m_by_n == (2, 4)
    assert load_config(None, []).compression.pruning.m_by_n is None


def test_sizes_parse():
    cfg = load_config(None, ["distribute.device_memory=16GB", "distribute.gpu_memory_limit=512MiB"])
    assert cfg.distribute.device_memory == 16 * 10**9
    assert cfg.distribute.gpu_memory_limit == 512 * 2**20


@pytest.mark.parametrize("override,pattern", [
    ("train.acumulation_steps=4", r"train\.acumulation_steps: unknown key; did you mean accumulation_steps\?"),
    ("trian.epochs=3", r"trian: unknown key; did you mean train\?"),
    ("train.epochs=many", r"train\.epochs: .*valid integer.*'many'"),
    ("train.epochs=-1", r"train\.epochs: .*greater than or equal to 0"),
    ("data.validation_fraction=1.5", r"data\.validation_fraction: .*less than 1"),
    ("precision.policy=fp16", r"precision\.policy: .*'mixed_float16'.*got 'fp16'"),
    ("distribute.strategy=horovod", r"distribute\.strategy: "),
    ("train.schedule.gamma=0.5", r"train\.schedule\.gamma: not used by schedule 'constant'"),
    ("train.checkpoint.every=3 weeks", r"train\.checkpoint\.every: expected an integer"),
    ("distribute.device_memory=lots", r"distribute\.device_memory: expected bytes"),
    ("compression.pruning.structure=2:4", r"compression\.pruning\.structure: write M:N in quotes"),
    ("compression.pruning.structure='4:2'", r"compression\.pruning\.structure: expected 'unstructured', 'channels' or 'M:N'"),
    ("compression.pruning.end=1.5", r"compression\.pruning\.end: a float is a fraction"),
    ("compression.pruning.layers=['conv(']", r"compression\.pruning\.layers: .*not a valid regular"),
    ("compression.pruning={structure: '2:4', block: [1, 4]}", r"compression\.pruning\.block: M:N structure and block"),
    ("compression.pruning.final_sparsity=1.0", r"compression\.pruning\.final_sparsity: .*less than 1"),
    ("compression.quantization.skip_unsuported=true", r"did you mean skip_unsupported\?"),
    ("export.int8_fallback=auto", r"export\.int8_fallback: auto falls back layers of a "
                                  r"quantization-aware trained model"),
    ("export.int8_fallback=sometimes", r"export\.int8_fallback: .*'off' or 'auto'"),
])
def test_errors_name_the_key(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override])


def test_every_problem_is_reported_one_line_each():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.epochs=-1", "data.per_replica_batch_size=-1", "x.y=1"])
    assert len(info.value.problems) == 3
    assert all("\n" not in p for p in info.value.problems)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"missing\.yaml: config file not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"line 3 \(key .run.\): malformed YAML: expected .,. or .\]."):
        load_config(write(tmp_path, "train:\n  epochs: [1\nrun: {}\n"))
    with pytest.raises(ConfigError, match=r"line 2 \(key 'name'\): tag not allowed"):
        load_config(write(tmp_path, "model:\n  name: !!python/object/apply:os.system ['echo hi']\n"))
    with pytest.raises(ConfigError, match=r"top level must be a mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_duplicate_keys_are_refused(tmp_path):
    path = write(tmp_path, "train:\n  epochs: 3\n  optimizer: {name: sgd}\n  epochs: 5\n")
    with pytest.raises(ConfigError, match=r"line 4: key 'epochs' is given twice in the same "
                                          r"mapping \(first at line 2\); keep one of them"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"key 'run' is given twice"):
        load_config(write(tmp_path, "run: {seed: 1}\nrun: {seed: 2}\n"))
    # the same key in different mappings is fine
    assert load_config(write(tmp_path, "run: {seed: 1}\ntrain: {optimizer: {name: sgd}}\n")).run.seed == 1


def test_binary_and_non_utf8_files_are_config_errors(tmp_path):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin\.yaml: not a UTF-8 text file \(byte 16 is 0xe9\)"):
        load_config(latin)
    blob = tmp_path / "model.bin"
    blob.write_bytes(b"run: {}\n\x00\x01\x02")
    with pytest.raises(ConfigError, match=r"model\.bin: binary file \(it contains NUL bytes\)"):
        load_config(blob)


@pytest.mark.parametrize("overrides", [["train.optimizer.learning_rate=.inf"],
                                       ["train.optimizer.learning_rate=.nan"],
                                       ["train.schedule.name=step", "train.schedule.gamma=.inf"]])
def test_infinities_and_nans_are_refused(overrides):
    with pytest.raises(ConfigError, match=rf"{overrides[-1].split('=')[0]}: .*finite number"):
        load_config(None, overrides)


def test_milestones_must_increase():
    with pytest.raises(ConfigError, match=r"train\.schedule\.milestones: \[20, 10\] must be "
                                          r"increasing"):
        load_config(None, ["train.schedule={name: multistep, milestones: [20, 10]}"])
    with pytest.raises(ConfigError, match=r"milestones: \[5, 5\] must be increasing"):
        load_config(None, ["train.schedule={name: multistep, milestones: [5, 5]}"])
    ok = load_config(None, ["train.schedule={name: multistep, milestones: [10, '3 epochs']}"])
    assert len(ok.train.schedule.milestones) == 2   # mixed units: checked once resolved (optim)


@pytest.mark.parametrize("override,key", [
    ("train.early_stopping={monitor: val_acc}", "train.early_stopping.monitor"),
    ("train.schedule={name: plateau, monitor: vall_loss}", "train.schedule.monitor"),
])
def test_monitor_must_name_a_logged_metric(override, key):
    with pytest.raises(ConfigError, match=rf"{key}: '.*' is not a logged metric; use one of "
                                          r"loss, accuracy, val_loss, val_accuracy"):
        load_config(None, [override])
    assert load_config(None, ["train.metrics=[acc]", "train.early_stopping={monitor: val_acc}"])


def test_file_name_in_messages(tmp_path):
    path = write(tmp_path, "train:\n  epochz: 3\n")
    with pytest.raises(ConfigError, match=rf"{path}: train\.epochz: unknown key; did you mean epochs\?"):
        load_config(path)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match=r"--set 'train\.epochs': expected KEY=VALUE"):
        apply_overrides({}, ["train.epochs"])


def test_dump_round_trips(tmp_path):
    cfg = load_config(None, ["train.schedule.name=cosine", "train.schedule.warmup_steps=2 epochs",
                             "compression.pruning={block: [1, 4], end: 1.0, begin: '10%'}"])
    again = load_config(write(tmp_path, dump_config(cfg)))
    assert again == cfg


def test_json_schema_lists_sections():
    schema = json_schema()
    assert set(schema["properties"]) == set(Config.model_fields)
    json.dumps(schema)


def test_plateau_rejects_warmup():
    with pytest.raises(ConfigError, match=r"train\.schedule\.warmup_steps: warmup is not available"):
        validate({"train": {"schedule": {"name": "plateau", "warmup_steps": 10}}})


def test_every_shipped_config_validates():
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert len(configs) >= 8
    for path in configs:
        load_config(path)


SHORTHANDS = ["train: {checkpoint: {every: 2 epochs}}",
              "train: {checkpoint: {every: 40%}}",
              "compression: {pruning: {begin: '1 epochs', end: 0.5}}",
              "train: {schedule: {name: multistep, milestones: ['2 epochs', 5]}}",
              "train: {schedule: {name: cosine, warmup_steps: 1 epochs}}",
              "data: {cache_budget: 1GB}",
              "distribute: {device_memory: 16GB, gpu_memory_limit: 512MiB, pack_bytes: 4MiB}"]


@pytest.mark.parametrize("text", SHORTHANDS)
def test_the_json_schema_accepts_every_documented_shorthand(text):
    import jsonschema

    from tftrain.config.loading import parse_yaml
    data = parse_yaml(text)
    validate(data)                                           # tftrain reads it ...
    jsonschema.Draft202012Validator(json_schema()).validate(data)    # ... and editors agree


def test_the_json_schema_still_refuses_what_tftrain_refuses():
    import jsonschema

    from tftrain.config.loading import parse_yaml
    checker = jsonschema.Draft202012Validator(json_schema())
    for text in ["train: {checkpoint: {every: two epochs}}", "data: {cache_budget: lots}",
                 "train: {checkpoint: {every: -3}}", "train: {epochs: many}"]:
        assert list(checker.iter_errors(parse_yaml(text))), text
        with pytest.raises(ConfigError):
            validate(parse_yaml(text))


def test_every_shipped_config_passes_the_json_schema():
    import jsonschema

    from tftrain.config.loading import parse_yaml
    checker = jsonschema.Draft202012Validator(json_schema())
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        assert not list(checker.iter_errors(parse_yaml(path.read_text()))), path


def test_small_floats_in_overrides_and_files_are_numbers(tmp_path):
    """`1e-05` (how json.dumps and a sweep write it) is a float, not the string YAML 1.1
    makes of it: free-form params would otherwise pass it on as text."""
    cfg = load_config(write(tmp_path, "train:\n  optimizer: {name: adam, params: {epsilon: 1e-07}}\n"),
                      ["model={name: 'nowhere.models:build', params: {dropout: 5e-1, "
                       "weight: 1E-05, count: 3}}",
                       "train.optimizer.learning_rate=3e-4"])
    assert cfg.train.optimizer.params == {"epsilon": 1e-07}
    assert cfg.model.params == {"dropout": 0.5, "weight": 1e-05, "count": 3}
    assert isinstance(cfg.model.params["count"], int) and cfg.train.optimizer.learning_rate == 3e-4
    from tftrain.sweep import overrides
    again = load_config(None, overrides({"model.name": "nowhere.models:build",
                                         "model.params.weight": 1e-05}))
    assert again.model.params == {"weight": 1e-05}


def test_an_alias_bomb_is_refused_in_under_a_second(tmp_path):
    import time
    lines = ["a: &a [x, x]"] + [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]"
                                for i in range(7)]
    path = write(tmp_path, "\n".join(lines) + "\n")
    assert len(path.read_bytes()) < 500
    began = time.perf_counter()
    with pytest.raises(ConfigError, match=r"c\.yaml: its aliases \(\*name\) expand to more than "
                                          r"10,000 values"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"--set model\.params: its aliases"):
        load_config(None, ["model.params={a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], b: &b [*a, *a, *a, "
                           "*a, *a, *a, *a, *a, *a, *a], c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b],"
                           " d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c], e: [*d, *d]}"])
    assert time.perf_counter() - began < 5.0     # expanded, it would take minutes
    # a few ordinary aliases still load
    cfg = load_config(write(tmp_path, "model: {name: cnn, params: {filters: &f [8, 16]}}\n"
                                      "compression: {distillation: {student: {name: cnn, params: "
                                      "{filters: *f}}}}\n", "ok.yaml"))
    assert cfg.compression.distillation.student.params == {"filters": [8, 16]}


@pytest.mark.parametrize("name", [".", ".."])
def test_a_run_name_of_dots_is_refused(name):
    with pytest.raises(ConfigError, match=r"run\.name: must name a directory inside run\.dir, "
                                          r"not '\.' or '\.\.'"):
        load_config(None, [f"run.name={name}"])
    assert load_config(None, ["run.name=v1.2..final"]).run.name == "v1.2..final"


def test_a_weight_average_with_restored_best_weights_is_refused():
    """Both choose the weights training ends with: the average would silently overwrite the
    best epoch's weights early stopping restored."""
    with pytest.raises(ConfigError, match=r"train\.ema: the weight average replaces the final "
                                          r"weights, so train\.early_stopping\.restore_best_weights "
                                          r"would be undone"):
        load_config(None, ["train.ema={decay: 0.99}",
                           "train.early_stopping={monitor: val_loss, restore_best_weights: true}"])
    load_config(None, ["train.ema={decay: 0.99}", "train.early_stopping={monitor: val_loss}"])


def test_a_bad_set_value_is_blamed_on_set_and_a_bad_file_value_on_the_file(tmp_path):
    path = write(tmp_path, "train:\n  epochs: many\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["train.accumulation_steps=abc", "model={name: cnn, params: {}}"])
    assert err.value.problems == [
        f"{path}: train.epochs: Input should be a valid integer, unable to parse string as an "
        "integer (got 'many')",
        "--set: train.accumulation_steps: Input should be a valid integer, unable to parse "
        "string as an integer (got 'abc')"]


def test_every_property_of_the_json_schema_is_described():
    """Every property anywhere in `--schema`, the shared definitions included (a
    duration's resolved `value` and `unit` were not), carries a description."""
    from tftrain.config import json_schema

    def undescribed(node, path=""):
        if isinstance(node, dict):
            for key, value in (node.get("properties") or {}).items():
                if not (isinstance(value, dict) and value.get("description")):
                    yield f"{path}/properties/{key}"
            for key, value in node.items():
                yield from undescribed(value, f"{path}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                yield from undescribed(value, f"{path}/{i}")
    schema = json_schema()
    assert "Duration" in schema["$defs"] and list(undescribed(schema)) == []
