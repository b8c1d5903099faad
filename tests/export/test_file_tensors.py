"""What a converted file holds, by Keras layer: each tensor's layer from its name."""
from tftrain.export import file_tensors


def test_a_fused_tensor_belongs_to_the_last_layer_its_name_mentions():
    order = {"inputs": 0, "quant_conv_0": 1, "quant_relu_0": 2, "quant_logits": 3}
    name = "cnn/quant_relu_0/Relu;cnn/quant_conv_0/BiasAdd;cnn/quant_conv_0/Conv2D"
    assert file_tensors.layer_of_tensor(name, order) == "quant_relu_0"
    assert file_tensors.layer_of_tensor("StatefulPartitionedCall:0", order) is None


def test_a_fused_tensor_covers_every_layer_its_name_mentions():
    order = {"inputs": 0, "quant_conv_0": 1, "quant_bn_0": 2, "quant_relu_0": 3}
    name = ("cnn/quant_relu_0/Relu;cnn/quant_bn_0/FusedBatchNormV3;cnn/quant_conv_0/BiasAdd;"
            "cnn/quant_conv_0/Conv2D")
    assert file_tensors.layers_of_tensor(name, order) == {"quant_conv_0", "quant_bn_0",
                                                          "quant_relu_0"}
    assert file_tensors.layers_of_tensor("StatefulPartitionedCall:0", order) == set()


def test_an_8_bit_tensors_grid_holds_its_step_and_range():
    import numpy as np
    found = file_tensors.grid(np.int8, np.array([0.5]), np.array([-128]))
    assert found["step"] == 0.5 and found["low"] == 0.0 and found["high"] == 127.5
    assert "step" not in file_tensors.grid(np.float32, np.array([]), np.array([]))
