"""Shared pieces of the lifting and export tests: small torch models, ONNX graph building,
exporting, running onnxruntime and comparing with the lifted module."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from finetune.lift.agreement import onnxruntime_values
from finetune.onnx import attach_custom_ops
from finetune.onnx.session import inference_session

# float32 results of Conv / MatMul / LayerNorm / Softmax depend on the summation order, which
# differs between torch (oneDNN) and onnxruntime (MLAS): a few ulp of the largest partial sums.
FLOAT_ATOL = 1e-5
FLOAT_RTOL = 1e-5


def onnx_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[np.ndarray | onnx.TensorProto] | dict[str, np.ndarray] = (),
    opset: int = 13,
    domains: Sequence[str] = (),
) -> onnx.ModelProto:
    """A model of the given nodes (onnxruntime checks it when it runs); `initializers` maps names to arrays."""
    if isinstance(initializers, dict):
        initializers = [numpy_helper.from_array(v, k) for k, v in initializers.items()]
    graph = helper.make_graph(list(nodes), "test", list(inputs), list(outputs), list(initializers))
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10 if opset >= 21 else 8)


def tensor(name: str, shape: Sequence[int | str | None] | None, elem_type: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    """A value info; None as shape means unknown."""
    return helper.make_tensor_value_info(name, elem_type, shape)


def run_ort(model: onnx.ModelProto, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Outputs of onnxruntime on CPU with graph optimisations off, so QDQ numerics stay simulated
    exactly (no fusion into integer kernels, DESIGN decision 5); custom ops get their bodies."""
    session = inference_session(attach_custom_ops(model))
    names = [i.name for i in session.get_inputs()]
    return session.run(None, dict(zip(names, inputs)))


def run_torch(module: nn.Module, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The module's outputs as a list of numpy arrays."""
    with torch.no_grad():
        result = module(*[torch.from_numpy(np.asarray(x)) for x in inputs])
    results = result if isinstance(result, tuple) else (result,)
    return [r.numpy() for r in results]


# ONNX ops whose output is a float sum (a product, a reduction, a normalisation, an interpolation, a
# recurrence): torch and onnxruntime each order their sums by the kernels the CPU's features pick
# (onnxruntime's MLAS on its own, whatever ATEN_CPU_CAPABILITY says), so through one of them the two
# agree within a bound the float32 numerics give, and bit for bit only by luck of this machine.
SUMMING_OPS = frozenset({
    "MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "LSTM", "GRU", "RNN", "Softmax", "LogSoftmax",
    "LayerNormalization", "InstanceNormalization", "GroupNormalization", "RMSNormalization", "MeanVarianceNormalization",
    "AveragePool", "GlobalAveragePool", "LpPool", "GlobalLpPool", "LpNormalization", "CumSum", "Resize", "GridSample",
    "Attention", "ReduceSum", "ReduceMean", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
    "ReduceProd",
})
# ONNX ops whose float result is an approximation (exp, tanh, erf, ... by a polynomial or a table), not the
# correctly rounded value: each library, and torch per CPU capability (SLEEF's AVX2 and AVX-512 variants),
# computes its own, so no exact comparison passes through them either.
APPROXIMATED_OPS = frozenset({
    "Exp", "Log", "Pow", "Tanh", "Sigmoid", "Erf", "Gelu", "Softplus", "Elu", "Selu", "Celu", "Mish", "HardSigmoid",
    "HardSwish", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "LRN",
})


def all_nodes(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, bool]]:
    """Every node of the model's graphs and subgraphs, each with whether it lies in a subgraph."""
    found, graphs = [], [(model.graph, False)]
    while graphs:
        graph, nested = graphs.pop()
        for node in graph.node:
            found.append((node, nested))
            graphs.extend((a.g, True) for a in node.attribute if a.type == onnx.AttributeProto.GRAPH)
            graphs.extend((g, True) for a in node.attribute if a.type == onnx.AttributeProto.GRAPHS for g in a.graphs)
    return found


def summing_nodes(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, bool]]:
    """Every node of SUMMING_OPS in the model's graphs and subgraphs, each with whether it lies in a subgraph."""
    return [(node, nested) for node, nested in all_nodes(model) if node.op_type in SUMMING_OPS]


def approximated_ops(model: onnx.ModelProto) -> list[str]:
    """The APPROXIMATED_OPS the model runs anywhere, each named once (custom ops' bodies are not read)."""
    return list(dict.fromkeys(node.op_type for node, _ in all_nodes(model) if node.op_type in APPROXIMATED_OPS))


def float_sum_bound(expected: Sequence[np.ndarray], terms: int, ulps: float = 4.0) -> float:
    """The absolute difference two float32 sums of `terms` terms may show: a few ulps of the outputs'
    magnitude per term (each term's rounding can land on either side in the other order)."""
    magnitude = max(1.0, *(float(np.abs(e).max()) for e in expected if e.size))
    return ulps * terms * float(np.finfo(np.float32).eps) * magnitude


# A float32 sum is exact, so the same in any order and on any CPU, where every term is a multiple of one
# power of two g and the terms' magnitudes add up to at most 2**24 g: every partial sum is then an integer
# multiple of g that float32 holds exactly. Quantized models with power-of-two scales (XINT8) sum so.
EXACT_INTEGERS = 2.0**24


def grid_step(values: np.ndarray) -> float:
    """The largest power of two every value is a multiple of (infinite for all zeros, 0 where one is
    not finite): the lowest set bit of the float32 mantissas, scaled by their exponents."""
    flat = np.asarray(values, np.float64).ravel()
    if not np.isfinite(flat).all():
        return 0.0
    mantissa, exponent = np.frexp(flat[flat != 0])
    if not mantissa.size:
        return float("inf")
    integers = np.abs(np.ldexp(mantissa, 53)).astype(np.uint64)  # exact: float64 mantissas have 53 bits
    trailing = np.log2((integers & (~integers + np.uint64(1))).astype(np.float64))
    return float(np.ldexp(1.0, int(np.min(exponent - 53 + trailing))))


def _sum_terms(node: onnx.NodeProto, values: dict[str, np.ndarray]) -> tuple[list[np.ndarray], np.ndarray | None, int] | str:
    """How a summing node adds: (the factors of each term, the added bias or None, the terms a sum adds up
    to), or why that is not read here."""
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    inputs = [values[name] for name in node.input if name]
    x = inputs[0]
    if node.op_type in ("Conv", "ConvTranspose"):  # a weight [out, in/group, kernel...], transposed [in, out/group, ...]
        w = inputs[1]
        return [x, w], (inputs[2] if len(inputs) > 2 else None), int(np.prod(w.shape[2:])) * w.shape[node.op_type == "Conv"]
    if node.op_type == "Gemm" and attributes.get("alpha", 1.0) == attributes.get("beta", 1.0) == 1.0:
        return [x, inputs[1]], (inputs[2] if len(inputs) > 2 else None), x.shape[0 if attributes.get("transA") else 1]
    if node.op_type == "MatMul":
        return [x, inputs[1]], None, x.shape[-1]
    count = x.size // max(1, values[node.output[0]].size)
    power_of_two = count & (count - 1) == 0  # a mean divides by the count: exactly when a power of two
    if node.op_type == "ReduceSum" or (node.op_type in ("GlobalAveragePool", "ReduceMean") and power_of_two):
        return [x], None, count
    return f"{node.op_type} is not read as an exact sum here"


def inexact_nodes(model: onnx.ModelProto, inputs: Sequence[np.ndarray]) -> list[str]:
    """The nodes whose float32 results on these inputs depend on the library and the CPU, each with why:
    approximations (APPROXIMATED_OPS), and sums that may round, whose bits follow the order the kernels
    add in (see EXACT_INTEGERS)."""
    found = [f"{node.name or node.op_type} ({node.op_type}) in a subgraph: its sums are not read here"
             for node, nested in summing_nodes(model) if nested]
    found += [f"{op}: an approximation each library computes its own way" for op in approximated_ops(model)]
    nodes = [node for node, nested in summing_nodes(model) if not nested]
    if not nodes:
        return found
    initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    feed = dict(zip([i.name for i in model.graph.input if i.name not in initializers], inputs))
    names = [name for n in nodes for name in [*n.input, n.output[0]] if name and name not in initializers and name not in feed]
    values = {**initializers, **feed, **onnxruntime_values(model, feed, names)}
    for node in nodes:
        terms = _sum_terms(node, values)
        if isinstance(terms, str):
            found.append(f"{node.name or node.output[0]}: {terms}")
            continue
        factors, bias, count = terms
        step = min(float(np.prod([grid_step(f) for f in factors])), np.inf if bias is None else grid_step(bias))
        largest = count * float(np.prod([np.abs(f).max(initial=0.0) for f in factors]))
        largest += 0.0 if bias is None else float(np.abs(bias).max(initial=0.0))
        if not (step > 0 and largest <= EXACT_INTEGERS * step):
            found.append(f"{node.name or node.output[0]} ({node.op_type}): terms on a grid of {step:g} adding up to {largest:g}")
    return found


def assert_same(
    model: onnx.ModelProto, module: nn.Module, inputs: Sequence[np.ndarray], atol: float = 0.0, rtol: float = 0.0,
) -> float:
    """Compare every output of onnxruntime and the module (exactly by default, NaN equal to NaN);
    returns the largest absolute difference. An exact comparison through an op that sums floats is
    refused unless every such sum is exact on these inputs, and one through an approximated function
    always (inexact_nodes): it would hold on one CPU and fail on another, so give the bound the numerics
    give (e.g. float_sum_bound)."""
    inexact = inexact_nodes(model, inputs) if atol == 0 and rtol == 0 else []
    assert not inexact, ("an exact comparison of torch and onnxruntime through float sums each library orders its own "
                         f"way ({'; '.join(inexact)}): compare within the bound the numerics give (float_sum_bound)")
    expected, actual = run_ort(model, inputs), run_torch(module, inputs)
    assert len(expected) == len(actual)
    worst = 0.0
    for e, a in zip(expected, actual):
        assert e.shape == a.shape and e.dtype == a.dtype, (e.shape, a.shape, e.dtype, a.dtype)
        np.testing.assert_allclose(a, e, atol=atol, rtol=rtol, equal_nan=True)
        finite = np.isfinite(e.astype(np.float64)) & np.isfinite(a.astype(np.float64))
        if finite.any():
            worst = max(worst, float(np.max(np.abs(a[finite].astype(np.float64) - e[finite].astype(np.float64)))))
    return worst


def assert_weights_are_parameters(model: onnx.ModelProto, module: nn.Module) -> None:
    """Every initializer read as a Conv/ConvTranspose/Gemm weight or bias, or by a MatMul, is a
    trainable parameter, and every parameter is mapped back to an initializer."""
    initializers = {t.name for t in model.graph.initializer}
    inputs = {"Conv": slice(1, 3), "ConvTranspose": slice(1, 3), "Gemm": slice(1, 3), "MatMul": slice(0, 2)}
    weights = {
        name for node in model.graph.node if node.op_type in inputs
        for name in node.input[inputs[node.op_type]] if name in initializers
    }
    assert weights <= {source.initializer for source in module.finetune_params.values()}
    assert set(module.finetune_params) == {name for name, _ in module.named_parameters()}


class Block(nn.Module):
    """A residual block: conv-BN-ReLU-conv-BN, plus the input, ReLU."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ResidualCNN(nn.Module):
    """A small CNN with residual blocks and BatchNorm."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
        self.blocks = nn.Sequential(Block(8), Block(8))
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1)
        return self.head(torch.flatten(pooled, 1))


def transformer_encoder() -> nn.Module:
    """A two-layer TransformerEncoder with GELU (batch first, no dropout)."""
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, activation="gelu", batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def randomized(module: nn.Module, seed: int = 0) -> nn.Module:
    """The module in eval mode with distinct random weights and BatchNorm statistics everywhere, so
    exporters cannot merge equal tensors (copied layers, default BN) into one initializer."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=generator) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=generator) + 0.5)
    return module.eval()


CNN_INPUT = (2, 3, 32, 32)
ENCODER_INPUT = (2, 5, 16)


def export_legacy(module: nn.Module, shape: Sequence[int], opset: int, path: Path) -> onnx.ModelProto:
    """TorchScript export with a dynamic batch; constant folding off so BatchNormalization stays."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module, (torch.randn(*shape),), str(path), opset_version=opset, dynamo=False, do_constant_folding=False,
            input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
        )
    return onnx.load(str(path))


def export_dynamo(module: nn.Module, shape: Sequence[int], opset: int, path: Path) -> onnx.ModelProto:
    """torch.export-based export with a dynamic batch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, (torch.randn(*shape),), dynamo=True, opset_version=opset,
            dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},), verbose=False,
        )
    program.save(str(path))
    return onnx.load(str(path))


def model_opset(model: onnx.ModelProto) -> int:
    """The default-domain opset of a model."""
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def random_input(shape: Sequence[int], seed: int = 1) -> np.ndarray:
    """Standard normal float32 data of a shape."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
