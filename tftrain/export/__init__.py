"""Deployment artifacts: every kind of export one object in `kinds.KINDS` (SavedModel,
int8 SavedModel, TFLite in each precision, sparse TFLite, ONNX float and int8, the
Keras 3 file), made from one `context.ExportContext` by `exports.export_all` and
checked against the trained model (`verification`); the conversions (`artifacts`,
`onnx_export`, `int8_saved_model`), each reduced-precision file compared with its model
layer by layer (`fidelity`), the int8 fallback within an accuracy budget (`fallback`),
and the preflight that converts them from the untrained model before training
(`preflight`).

May import: `tftrain.core`, `tftrain.optim`, `tftrain.config`, `tftrain.data`,
`tftrain.models`, `tftrain.runtime`, `tftrain.training`, `tftrain.compress`.
"""
