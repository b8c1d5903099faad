"""The base of tftrain's callbacks with batch hooks: Keras hands them each training call's
logs as tensors, so no callback of a run makes Keras copy every call's logs to the host
(a wait for the call's last step, which plain `fit` at `verbose: 0` does not make).
`Callback.__init__` sets the flag off on the instance, hiding a class attribute of that
name: it is set after it (`internals.take_tensor_logs`). A subclass that reads a log
value converts it itself (`float(logs["loss"])`)."""
from __future__ import annotations

from tftrain.core import internals
from tftrain.core.keras import keras


class DeviceLogsCallback(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        internals.take_tensor_logs(self)
