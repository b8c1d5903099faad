"""Post-training int8 calibration with every tensor's own range.

LiteRT's calibrator runs the float model under its memory plan, in which an elementwise
op whose operand has the result's shape and no other reader writes its result over that
operand (in place); the calibrator then records the operand's range as the result's. A
squeeze-excite gate in [0, 1] multiplied into features of its own shape (the 1 x 1 maps
of a MobileNetV3's last blocks at 32 x 32) was held on the product's range, [-0.27, 68]
in a smoke-trained Keras 3 MobileNetV3Small: four 8-bit steps for the whole gate, and the
per-layer check refused the file. The same held `x / 6` of a hard-swish traced
`(x / 6) * relu6(x + 3)` on the product's range.

Inside `own_ranges()`, each range the converter's calibration records is measured again
on the same examples with every tensor kept (no memory reuse, no delegate), so a tensor
keeps its own range; ranges the memory plan did not touch come out the same (min and max
over the examples, as the calibrator's), and the converter's own quantization follows.
"""
from __future__ import annotations

import contextlib

import numpy as np

from tftrain.core import internals


@contextlib.contextmanager
def own_ranges():
    """Inside: TFLite conversions calibrate every tensor on its own values."""
    calibrator = internals.calibrator_class()
    original = calibrator.calibrate

    def calibrate(self, dataset_gen):
        return remeasured(original(self, dataset_gen), dataset_gen)

    calibrator.calibrate = calibrate
    try:
        yield
    finally:
        calibrator.calibrate = original


def remeasured(calibrated: bytes, dataset_gen) -> bytes:
    """`calibrated` (a float flatbuffer with the calibrator's min and max per tensor) with
    each min and max measured on `dataset_gen`'s examples with every tensor kept."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType
    from tensorflow.lite.tools import flatbuffer_utils

    model = flatbuffer_utils.convert_bytearray_to_object(bytearray(calibrated))
    tensors = model.subgraphs[0].tensors
    stated = [i for i, t in enumerate(tensors)
              if t.quantization is not None and t.quantization.min is not None
              and len(t.quantization.min) == 1]
    interp = Interpreter(model_content=bytes(calibrated), experimental_preserve_all_tensors=True,
                         experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
    inputs = interp.get_input_details()
    low, high = {i: np.inf for i in stated}, {i: -np.inf for i in stated}
    shapes, readable = None, None
    for example in dataset_gen():
        example = list(example.values()) if isinstance(example, dict) else list(example)
        if shapes != [np.shape(v) for v in example]:
            shapes = [np.shape(v) for v in example]
            for detail, shape in zip(inputs, shapes):
                interp.resize_tensor_input(detail["index"], list(shape))
            interp.allocate_tensors()
        for detail, value in zip(inputs, example):
            interp.set_tensor(detail["index"], np.asarray(value, dtype=detail["dtype"]))
        interp.invoke()
        if readable is None:         # a tensor without data keeps its calibrated range
            readable = [i for i in stated if _has_data(interp, i)]
        for i in readable:
            value = interp.get_tensor(i)
            low[i], high[i] = min(low[i], float(value.min())), max(high[i], float(value.max()))
    for i in readable or []:
        if np.isfinite(low[i]):
            tensors[i].quantization.min = np.array([low[i]], np.float32)
            tensors[i].quantization.max = np.array([high[i]], np.float32)
    return bytes(flatbuffer_utils.convert_object_to_bytearray(model))


def _has_data(interp, index: int) -> bool:
    try:
        interp.get_tensor(index)
        return True
    except ValueError:
        return False
