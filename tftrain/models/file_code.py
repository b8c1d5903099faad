"""What a model file would run: found by reading the file as data, before anything in it
is deserialized, and refused unless the run trusts it (`model.trust_code`).

A model file can carry code. tf_keras stores a `Lambda` layer's function as Python
bytecode in `.h5`, `.keras` and SavedModel files and runs it while it loads the layer
(the class of CVE-2024-3660); Keras 3 refuses that in `.keras` files unless its
`safe_mode` is off. A SavedModel's
graphs can hold ops that reach outside the model, which run whenever the model computes:
file reads and writes, Python calls, file listing. tftrain reads the configs (HDF5
attributes, the `.keras` archive's config.json, a SavedModel's `keras_metadata.pb`) and the
graphs' ops (`saved_model.pb`, every function included) without loading a layer, lists
what it found (`findings`), and `check` refuses the file with the list and the one key
that trusts it. With `model.trust_code: true` the file loads as before (Keras 3 without
safe mode), the run says once that the file's code ran, and summary.json records it.
"""
from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import h5py
from tensorflow.core.protobuf import saved_model_pb2

from tftrain.config import ConfigError
from tftrain.core.keras import saved_metadata_pb2

# SavedModel ops that reach outside the model (modelscan flags ReadFile and WriteFile);
# the checkpoint ops (SaveV2, RestoreV2) every SavedModel holds for its own variables are
# not among them: the loader runs them on the SavedModel's own directory
OUTSIDE_OPS = {
    "ReadFile": "reads a file", "WriteFile": "writes a file",
    "MatchingFiles": "lists files", "ImmutableConst": "maps a file into memory",
    "PyFunc": "calls Python", "PyFuncStateless": "calls Python", "EagerPyFunc": "calls Python",
    "TFRecordDataset": "reads files", "TFRecordDatasetV2": "reads files",
    "TextLineDataset": "reads files", "FixedLengthRecordDataset": "reads files",
    "FixedLengthRecordDatasetV2": "reads files", "SaveDatasetV2": "writes files",
    "DatasetToTFRecord": "writes files", "PrintV2": "writes to a stream",
}
MOST_LINES = 10            # a refusal's lines, at most


@dataclass(frozen=True)
class Finding:
    """Something in a model file that would run: where (a layer, a graph's function)
    and what."""
    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where} ({self.what})"


def findings(path: Path) -> list[Finding]:
    """What the model file at `path` would run on loading or computing (empty: nothing).
    Reads the file as data only."""
    if path.is_dir():
        return _saved_model(path)
    if path.suffix == ".keras":
        with zipfile.ZipFile(path) as z:
            return _in_config(json.loads(z.read("config.json")))
    if path.suffix in (".h5", ".hdf5"):
        with h5py.File(path, "r") as f:
            config = f.attrs.get("model_config")
        if config is None:
            return []
        return _in_config(json.loads(config.decode() if isinstance(config, bytes) else config))
    return []


def check(path: str, key: str, trusted: bool) -> list[str]:
    """Refuse the file at `path` unless `trusted`: one problem whose lines (at most
    `MOST_LINES` as printed, 120 columns) name the file, each kind of code found with the
    layers or functions holding it, and the key that trusts it. Returns what was found
    (what a trusted run records)."""
    found = findings(Path(path))
    if not found or trusted:
        return [str(f) for f in found]
    kinds: dict[str, list[str]] = {}
    for f in found:
        kinds.setdefault(f.what, []).append(f.where)
    lines = [f"{key}: {path} carries code that would run when it is loaded or computes; "
             "none of it ran:"]
    for what, wheres in list(kinds.items())[:MOST_LINES - 4]:
        named = ", ".join(wheres[:6]) + (f" and {len(wheres) - 6} more" if len(wheres) > 6 else "")
        lines.append(f"{what}: {named}")
    if len(kinds) > MOST_LINES - 4:
        lines.append(f"and {len(kinds) - (MOST_LINES - 4)} more kinds")
    lines.append("if you trust the file, set model.trust_code: true (its code then runs)")
    raise ConfigError("\n".join(lines))


def _in_config(config) -> list[Finding]:
    """Lambda layers (bytecode) and Python lambdas (Keras 3's `__lambda__`) in a Keras
    config, nested models included. A class registered by code already imported (tftrain's
    own layers, yours) is not the file's code: the file can only name it (and Keras 3
    imports no module a file names outside Keras' own packages)."""
    found: list[Finding] = []

    def walk(entry, layer: str):
        if isinstance(entry, list):
            for item in entry:
                walk(item, layer)
            return
        if not isinstance(entry, dict):
            return
        cls = entry.get("class_name")
        inner = entry.get("config")
        name = inner.get("name", layer) if isinstance(inner, dict) else layer
        if cls == "Lambda":
            what = ("Python bytecode run while loading"
                    if isinstance(inner, dict) and inner.get("function_type", "lambda") == "lambda"
                    else "a Python function looked up while loading")
            found.append(Finding(f"layer {name}", f"Lambda: {what}"))
            return                          # (its function's own entry: the same finding)
        if cls == "__lambda__":
            found.append(Finding(f"layer {layer}", "a Python lambda (bytecode) in its config"))
        for value in entry.values():
            walk(value, name)
    walk(config, "?")
    return found


def _saved_model(path: Path) -> list[Finding]:
    """A SavedModel's Keras layers (keras_metadata.pb) and its graphs' ops that reach
    outside the model (saved_model.pb: every meta graph and function)."""
    found: list[Finding] = []
    metadata = path / "keras_metadata.pb"
    if metadata.exists():
        saved = saved_metadata_pb2.SavedMetadata()
        saved.ParseFromString(metadata.read_bytes())
        for node in saved.nodes:
            try:
                entry = json.loads(node.metadata)
            except ValueError:
                continue
            if entry.get("class_name") == "Lambda":
                found.append(Finding(f"layer {entry.get('name', node.node_path)}",
                                     "Lambda: Python bytecode run while loading"))
    model = saved_model_pb2.SavedModel()
    model.ParseFromString((path / "saved_model.pb").read_bytes())
    seen = set()
    for graph in model.meta_graphs:
        nodes = [("the graph", n) for n in graph.graph_def.node]
        nodes += [(f"function {f.signature.name}", n)
                  for f in graph.graph_def.library.function for n in f.node_def]
        for where, node in nodes:
            if node.op in OUTSIDE_OPS and (node.op, where) not in seen:
                seen.add((node.op, where))
                found.append(Finding(f"op {node.op} in {where}", OUTSIDE_OPS[node.op]))
    return found
