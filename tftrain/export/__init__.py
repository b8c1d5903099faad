"""Deployment artifacts: SavedModel and TFLite files, converted and verified against the
trained model (`artifacts`), ONNX (`onnx_export`), the int8 SavedModel
(`int8_saved_model`), each int8 artifact compared with its model layer by layer
(`fidelity`), the int8 fallback within an accuracy budget (`fallback`), and the
preflight that converts them from the untrained model before training (`preflight`).

May import: `tftrain.core`, `tftrain.optim`, `tftrain.config`, `tftrain.data`,
`tftrain.models`, `tftrain.runtime`, `tftrain.training`, `tftrain.compress`.
"""
