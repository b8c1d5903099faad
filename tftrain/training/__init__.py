"""What one stage's training loop is made of: the train step with gradient accumulation
(`train_step`), the XLA decision (`xla`), checkpoints and resumable callbacks
(`callbacks`), epoch logs and throughput (`epoch_logs`), the wait on input (`input_wait`), preemption signals
(`preemption`), profiling (`profiling`), MLflow tracking (`tracking`) and the run
directory (`rundir`).

May import: `tftrain.core`, `tftrain.optim`, `tftrain.config`, `tftrain.data`,
`tftrain.models`, `tftrain.runtime`.
"""
