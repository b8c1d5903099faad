"""Where and how a run executes: devices and the `tf.distribute` strategy (`strategy`),
the cluster it belongs to (`cluster`: TF_CONFIG, a Kubernetes JobSet pod (`jobset`), SLURM),
all-reduce wire (`precision`), model parallelism and placement (`parallelism`,
`placement`), the memory planner that chooses between them (`planner`), and the
Kubernetes manifest of a multi-worker run (`kubernetes`).

May import: `tftrain.core`, `tftrain.optim`, `tftrain.config`, `tftrain.data`,
`tftrain.models`.
"""
