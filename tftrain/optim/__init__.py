"""Optimization: optimizers by name (`optimizers`), learning-rate schedules and their
config sections (`schedules`, `configs`), learning rates as Keras schedules of updates
(`rates`), and weight averaging with batch-norm re-estimation (`averaging`).

May import: `tftrain.core`. `configs` and `schedules` import no TensorFlow (the config
schema reads them).
"""
