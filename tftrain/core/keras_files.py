"""Which Keras wrote a model file (`writer_of`), read from its metadata without loading
it: what `models.files` reads the file with, and what the dry run says the run hands back
(a model that came in as Keras 3 goes out as one). No TensorFlow."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

from tftrain.core.config_types import ConfigError


def writer_of(path: Path) -> tuple[str, str]:
    """(the Keras that wrote the file, its form), read from the file's metadata."""
    if path.is_dir():
        if not (path / "saved_model.pb").exists():
            raise ConfigError(f"model.name: {path} is a directory without saved_model.pb; give "
                              "a .keras or .h5 file or a SavedModel directory")
        if not (path / "keras_metadata.pb").exists():
            raise ConfigError(
                f"model.name: {path} is a SavedModel without a Keras model in it (written by "
                "tf.saved_model.save or Keras 3's model.export(), which keep only the serving "
                "function); save the model with model.save('model.keras') and give that file")
        return "tf_keras", "SavedModel"
    if path.suffix == ".keras":
        try:
            with zipfile.ZipFile(path) as z:
                version = json.loads(z.read("metadata.json")).get("keras_version", "")
        except (zipfile.BadZipFile, KeyError, ValueError) as err:
            raise ConfigError(f"model.name: {path} is not a readable .keras file ({err})") from None
        return ("keras3" if version.startswith("3.") else "tf_keras"), ".keras"
    if path.suffix in (".h5", ".hdf5"):
        import h5py
        try:
            with h5py.File(path, "r") as f:
                version = f.attrs.get("keras_version", "")
        except OSError as err:
            raise ConfigError(f"model.name: {path} is not a readable HDF5 file ({err})") from None
        version = version.decode() if isinstance(version, bytes) else str(version)
        return ("keras3" if version.startswith("3.") else "tf_keras"), ".h5"
    raise ConfigError(f"model.name: {path}: expected a .keras or .h5 file or a SavedModel "
                      "directory written by Keras")
