"""Where and how a run executes: devices and the `tf.distribute` strategy (`strategy`),
the cluster it belongs to (`cluster`: TF_CONFIG, SLURM), the precision policy and
all-reduce wire (`precision`), model parallelism and placement (`parallelism`,
`placement`) and the memory planner that chooses between them (`planner`).

May import: `tftrain.core`, `tftrain.optim`, `tftrain.config`, `tftrain.data`,
`tftrain.models`.
"""
