"""Shape arithmetic on the host: a Shape whose result only flows through integer arithmetic into
shape inputs runs on the CPU with the constants it reads, so a model on a GPU reads no device value
for its shapes. The meta device stands in for a GPU here: reading one of its values raises, and so
does mixing it with CPU tensors outside a host region."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from finetune.lift import lift_model
from finetune.lift.host_shapes import HostShape, host_shapes

from .lift_helpers import assert_same, onnx_model, random_input, tensor

CONSTANTS = {"zero": np.array([0], np.int64), "minus_one": np.array([-1], np.int64), "axes": np.array([0], np.int64)}


def _flatten_model(extra_reader: str | None = None) -> tuple:
    """y = Reshape(x, Concat(Unsqueeze(Gather(Shape(x), 0)), -1)): x flattened to (batch, -1), the
    target computed from x's shape as exporters write it; `extra_reader` also sends the batch size
    to an op that is not a shape input (an Add to x, or the graph output)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], name="shape"),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], name="gather", axis=0),
        helper.make_node("Concat", ["batch", "minus_one"], ["target"], name="concat", axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape"),
    ]
    outputs = [tensor("y", None)]
    if extra_reader == "add":
        nodes += [helper.make_node("Cast", ["batch"], ["batch_float"], name="cast", to=TensorProto.FLOAT),
                  helper.make_node("Add", ["y", "batch_float"], ["z"], name="add")]
        outputs = [tensor("z", None)]
    if extra_reader == "output":
        outputs.append(tensor("batch", None, TensorProto.INT64))
    model = onnx_model(nodes, [tensor("x", ["batch", 3, 4])], outputs,
                       {"zero": np.array([0], np.int64), "minus_one": np.array([-1], np.int64)})
    return model, [random_input((2, 3, 4))]


def test_a_shape_feeding_only_a_reshape_target_runs_on_the_host() -> None:
    """The region from Shape to the Reshape target is found with its constants; the lifted model
    equals onnxruntime, and runs on the meta device (its shapes computed on the CPU)."""
    model, inputs = _flatten_model()
    found = host_shapes(model.graph)
    assert found.nodes == {"shape", "gather", "concat"} and found.constants == {"zero", "minus_one"}
    lifted = lift_model(model)
    assert [type(m) for m in lifted.modules()].count(HostShape) == 1
    assert_same(model, lifted, inputs)
    lifted.to("meta")
    assert lifted(torch.empty(5, 3, 4, device="meta")).shape == (5, 12)


@pytest.mark.parametrize("reader", ["add", "output"])
def test_a_shape_whose_values_reach_other_ops_stays_on_the_device(reader: str) -> None:
    """A batch size that is also added to activations, or returned, keeps its whole region on the
    device (reading it there is what the model asks for); the model still equals onnxruntime."""
    model, inputs = _flatten_model(reader)
    assert host_shapes(model.graph).nodes == frozenset()
    lifted = lift_model(model)
    assert HostShape not in [type(m) for m in lifted.modules()]
    assert_same(model, lifted, inputs)


def test_an_integer_constant_also_read_on_the_device_is_held_on_both() -> None:
    """The Gather index is also read by a device op elsewhere (a value of the model, not only of its
    shape arithmetic, as exporters share a Slice's 0 and 1): the region still runs on the host with its
    own CPU copy, and the device op reads the initializer where the model moved (meta here: no read)."""
    model, inputs = _flatten_model()
    model.graph.node.append(helper.make_node("Cast", ["zero"], ["zero_float"], name="cast", to=TensorProto.FLOAT))
    model.graph.node.append(helper.make_node("Add", ["y", "zero_float"], ["z"], name="add"))
    model.graph.output[0].CopyFrom(tensor("z", None))
    assert {"shape", "gather"} <= host_shapes(model.graph).nodes
    lifted = lift_model(model)
    assert_same(model, lifted, inputs)
    assert lifted.to("meta")(torch.empty(inputs[0].shape, device="meta")).device.type == "meta"
