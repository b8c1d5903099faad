"""A frozen-backbone phase before training (`train.freeze: {layers, epochs}`): the
chosen layers (by default every layer but the output layer: the new head trains alone)
are frozen, batch norm among them runs in inference mode (Keras' rule for frozen
batch norm), then training fine-tunes the whole model with its own optimizer and
schedule. Frozen layers keep their weights exactly."""
from __future__ import annotations

from tftrain.stages.base import Built, Stage


class Freeze(Stage):
    name = "frozen"
    section = "train.freeze"

    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.train.freeze is not None

    @property
    def learning_rate(self):
        return self.cfg.train.freeze.learning_rate or self.cfg.train.optimizer.learning_rate

    def plan(self, net, ctx):
        """Builds the model (training then fine-tunes this one) and checks the rules."""
        from tftrain.compress import pruning
        from tftrain.stages.train import build_network

        self.net = build_network(self.cfg, ctx)
        self.frozen = pruning.select_layers(self.net, self.cfg.train.freeze.layers,
                                                "train.freeze.layers", _has_weights)
        from tftrain.config import ConfigError
        weighted = [layer.name for layer in self.net.layers if layer.weights]
        if not self.cfg.train.freeze.layers:
            # the output layer is the last one with weights (a float32 cast of the
            # outputs under a mixed policy comes after it)
            self.frozen = [n for n in self.frozen if n != weighted[-1]]
        if not self.frozen:
            raise ConfigError("train.freeze.layers: no layer with weights to freeze")
        if set(weighted) <= set(self.frozen):
            raise ConfigError("train.freeze.layers: the rules freeze every layer with weights, "
                              "so the frozen phase would train nothing; leave the head out")
        return self.net

    def build(self, net, ctx) -> Built:
        for name in self.frozen:
            self.net.get_layer(name).trainable = False
        return Built(self.net)

    def finalize(self, built: Built, result: dict, ctx):
        for name in self.frozen:
            self.net.get_layer(name).trainable = True
        return self.net

    def describe(self, ctx) -> str:
        return super().describe(ctx) + f"; {len(self.frozen)} layers frozen"


def _has_weights(layer):
    return None if layer.weights else "it has no weights"
