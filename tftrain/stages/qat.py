"""Quantization-aware training: tfmot's 8-bit scheme (prune-preserving after pruning) on
a float32 copy of the model, in float32 whatever the run's policy: tfmot's fake-quant
ops take no bfloat16/float16 (tensorflow/model-optimization#367, #409). The float32 is
this stage's precision, not the run's: nothing global changes."""
from __future__ import annotations

from tftrain.stages.base import Built, Stage


class QAT(Stage):
    name = "qat"
    section = "compression.quantization"
    quantization_aware = True
    unroll = True      # the fake-quant ranges synchronise replicas in the forward pass

    def precision(self, ctx):
        return ctx.precision.with_policy("float32", distribute=self.cfg.distribute,
                                         strategy=ctx.parallel.strategy)

    def plan(self, net, ctx):
        from tftrain.compress import qat_audio, quantization

        quantization.unquantizable(net, self.cfg.compression.quantization)
        qat_audio.refuse_uncalibrated(net, self.cfg.compression.quantization)
        return net

    def build(self, net, ctx) -> Built:
        from tftrain.compress import quantization
        from tftrain.export import artifacts

        with self.precision(ctx).scope():
            quantized = quantization.quantize_configured(artifacts.inference_model(net), self.cfg)
        return Built(quantized)

    def begin(self, built: Built, batches) -> str:
        """Activation ranges from calibration batches (`quantization.calibrate_ranges`),
        not tfmot's [-6, 6]: what a short QAT stage would otherwise train and export."""
        from tftrain.compress import quantization

        n = self.cfg.compression.quantization.calibration_batches
        if n == 0:
            return "activation ranges start at tfmot's [-6, 6] (calibration_batches: 0)"
        used = quantization.calibrate_ranges(built.net, batches(None if n == "auto" else n))
        held = ", held through QAT" if self.cfg.compression.quantization.ranges == "fixed" else ""
        return f"activation ranges calibrated on {used} training batches{held}"

    def training(self):
        """With `ranges: fixed`, the activation ranges calibrated in `begin` held through
        the updates (the kernels' ranges still follow the weights)."""
        from tftrain.compress import quantization
        if self.cfg.compression.quantization.ranges == "fixed":
            return quantization.activation_ranges_held()
        return super().training()

    def recomputing(self):
        """A recomputed segment's activation quantizers use the ranges the first forward
        pass moved them to, and move them no further (its weight quantizers take the same
        weights' range again)."""
        from tftrain.compress import quantization
        return quantization.activation_ranges_held()

    def recalibrating(self):
        """Batch norm re-estimated with every quantizer held at its range: the statistics
        follow the QAT weights, the ranges stay as trained."""
        from tftrain.compress import quantization
        return quantization.ranges_held()

    def finalize(self, built: Built, result: dict, ctx):
        from tftrain.compress import quantization

        quantization.fit_empty_channels(built.net)     # exact, and the int8 file's biases fit
        # the zeros the quantized kernels hold after QAT (what the int8 artifacts get)
        result["sparsity"] = {name: float((kernel == 0).mean()) for name, kernel in
                              quantization.quantized_kernels(built.net).items()}
        return built.net

    def describe(self, ctx) -> str:
        return super().describe(ctx) + "; in float32 (tfmot's fake-quant ops take no " \
                                       "bfloat16/float16)"

