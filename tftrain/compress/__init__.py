"""Model compression with tfmot: magnitude pruning driven by updates (`pruning`),
quantization-aware training, prune-preserving after pruning (`quantization`), and the
per-layer QAT configs tfmot lacks (`qat_configs`, on `qat_base`), and transformer layers
in forms QAT quantizes to int8 matmuls (`qat_transformer`).

May import: `tftrain.core`, `tftrain.optim`, `tftrain.config`, `tftrain.data`,
`tftrain.models`, `tftrain.runtime`, `tftrain.training`.
"""
