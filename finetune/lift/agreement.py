"""Whether a lifted module computes what onnxruntime computes for its model, asked on one sample
before any calibration or tuning: tuning trains the module, so a module that computes something
else would be tuned towards values the model never gives, without a word.

torch and onnxruntime add float sums in different orders (onnxruntime picks its kernels by CPU
feature), so outputs are compared within what float sums give, never exactly. A last-bit difference
before a quantizer can move a value by a whole quantization step, and the model carries it on: the
outputs may then differ past that bound although every node computes what its ONNX node computes.
So where the outputs disagree, each node is run again on onnxruntime's own values of its inputs and
compared with onnxruntime's value of its outputs: a quantizer exactly, any other node within the
bound taken of the largest magnitude of its inputs and outputs (onnxruntime's LayerNormalization
subtracts squares, and its Sigmoid is a polynomial accurate to a few units in the last place of 1:
their rounding scales with the inputs, not the output); the first node that still disagrees is named. Where none does, the difference is rounding
carried through the model, and the module is kept."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import fx, nn

from finetune.calibrate.data import model_inputs
from finetune.formats.compiled import compiled_kernels
from finetune.host_memory import release_freed_host_memory
from finetune.onnx import attach_custom_ops
from finetune.onnx.io import load_model, put_back
from finetune.onnx.normalize import normalize_model
from finetune.onnx.session import copy_for_session, session_folder, session_of_copy

from .builder import ONNX_NODE, LiftError
from .fake_quant import FakeQuantize

logger = logging.getLogger(__name__)

# Float32 arithmetic in another order, or another library's approximation of a function: a difference
# of this much of the largest magnitude in play (some 80 units in the last place). Other float types
# scale it by their own epsilon.
FLOAT32_BOUND = 1e-5

# The types, as onnxruntime names them, of the values it hands to numpy (not bfloat16, float8 or 4-bit
# tensors, nor sequences): only values of these are compared.
NUMPY_TYPES = frozenset(f"tensor({name})" for name in (
    "float", "double", "float16", "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
))

Feed = Mapping[str, Any] | Sequence[Any]


class LiftMismatch(LiftError):
    """The lifted module computes something else than onnxruntime for a node of the model."""


def check_lifted(model: str | Path | onnx.ModelProto, module: nn.Module, feed: Feed, folder: Path | None = None) -> None:
    """Refuse (LiftMismatch, one line naming the first node whose output differs) a module lifted
    from a model with quantizers whose outputs disagree with onnxruntime's on the first sample of
    `feed` (by input name, or in graph order) past float rounding. A float model is not
    checked. The module runs as it is, on its device, with eager kernels (compiled ones give the
    same bits, and one sample's shapes would be compiled for nothing). A model set aside
    (onnx.io.set_aside) has its tensors read by onnxruntime from `folder`."""
    if not any(isinstance(m, FakeQuantize) for m in module.modules()):
        return
    with compiled_kernels(False):  # a proto is only read here: no copy of its weights
        _check(model if isinstance(model, onnx.ModelProto) else load_model(model), module, feed, folder)


def _check(model: onnx.ModelProto, module: nn.Module, feed: Feed, folder: Path | None) -> None:
    """Compare the outputs; only where they disagree, look for a node that computes otherwise (the
    outputs alone cannot tell a converter's error from a rounding flip carried through the model)."""
    feed = first_sample(model, feed)
    try:
        expected = onnxruntime_values(model, feed, folder=folder)
    except Exception as error:  # onnxruntime raises its own types; tuning a model it cannot run stays allowed
        logger.warning("the lifted module was not compared with onnxruntime, which cannot run the model: %s", " ".join(str(error).split()))
        return
    release_freed_host_memory()  # the session's, before the module runs (a tuning run's glibc keeps up to 1 GiB free)
    actual = dict(zip([output.name for output in model.graph.output], _module_outputs(module, list(feed.values()))))
    if all(agrees(actual.get(name), value, exact=False) for name, value in expected.items()):
        return
    found = first_disagreeing_node(model if folder is None else put_back(load_model(model), folder), module, feed)
    if found is None:
        logger.info("the lifted module's outputs differ from onnxruntime's past float rounding, but every node agrees "
                    "on onnxruntime's own inputs: a last-bit difference crossed a quantizer's rounding boundary")
        return
    raise LiftMismatch(found)


def first_sample(model: onnx.ModelProto, feed: Feed) -> dict[str, np.ndarray]:
    """The feed as arrays by input name, cut to its first row where every input's batch is dynamic
    (one sample is enough, and keeps every exposed value of a large model small)."""
    infos = model_inputs(model)
    values = [feed[info.name] for info in infos] if isinstance(feed, Mapping) else list(feed)
    arrays = [v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for v in values]
    if all(info.dynamic_batch for info in infos) and all(a.ndim and len(a) for a in arrays):
        arrays = [a[:1] for a in arrays]
    return {info.name: a for info, a in zip(infos, arrays)}


def agrees(actual: Any, expected: np.ndarray, exact: bool, scale: float = 0.0) -> bool:
    """Whether a module's value equals onnxruntime's: the same shape, NaN and infinities in the same
    places, and the finite values equal (`exact`, or not a float type) or within `bound`."""
    actual = _array(actual) if isinstance(actual, torch.Tensor) else actual
    if actual is None or actual.shape != expected.shape:
        return False
    if not np.issubdtype(expected.dtype, np.floating):
        return bool(np.array_equal(actual, expected))
    difference = largest_difference(actual, expected)
    return difference == 0.0 or (not exact and difference <= bound(expected, scale))


def largest_difference(actual: np.ndarray, expected: np.ndarray) -> float:
    """The largest difference of two float values of one shape: infinite where NaN or an infinity
    of one is not in the other at the same place."""
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    finite = np.isfinite(e)
    if not np.array_equal(np.isnan(a), np.isnan(e)) or not np.array_equal(a[np.isinf(e)], e[np.isinf(e)]):
        return float("inf")
    return float(np.abs(a[finite] - e[finite]).max(initial=0.0))


def bound(expected: np.ndarray, scale: float = 0.0) -> float:
    """The largest difference float rounding explains in a value like `expected` computed from values
    as large as `scale`: FLOAT32_BOUND of the larger of the two magnitudes, scaled to the type's epsilon."""
    epsilon = float(np.finfo(expected.dtype).eps) / float(np.finfo(np.float32).eps)
    return FLOAT32_BOUND * epsilon * max(magnitude(expected), scale)


def magnitude(value: Any) -> float:
    """The largest finite magnitude of a float tensor or array (0 for anything else)."""
    array = _array(value) if isinstance(value, torch.Tensor) else value
    if not isinstance(array, np.ndarray) or not np.issubdtype(array.dtype, np.floating):
        return 0.0
    return float(np.abs(array[np.isfinite(array)].astype(np.float64)).max(initial=0.0))


def first_disagreeing_node(model: onnx.ModelProto, module: nn.Module, feed: dict[str, np.ndarray]) -> str | None:
    """The one-line message naming the first node of the module (in graph order) whose outputs
    disagree with onnxruntime's when it is given onnxruntime's values of its inputs; None where
    every node agrees. `model` is the one the module was lifted from (normalised here as the lifter
    normalises it, so its node names are the module's)."""
    normalized, _ = normalize_model(model)
    computed = [output for node in module.graph.nodes if ONNX_NODE in node.meta for output in node.meta[ONNX_NODE][1] if output]
    values = {**feed, **onnxruntime_values(normalized, feed, computed)}
    op_types = {node.name: node.op_type for node in normalized.graph.node}
    device = _device(module)
    try:
        with torch.no_grad():
            _Substituting(module, values, op_types).run(*[_tensor(values[name], device) for name in feed])
    except _Disagreement as found:
        return str(found)
    return None


class _Disagreement(Exception):
    """A node's output differs from onnxruntime's on onnxruntime's inputs (the message says how)."""


class _Substituting(fx.Interpreter):
    """Runs the module's graph node by node; after each node lifted from an ONNX node, compares its
    outputs with onnxruntime's and passes onnxruntime's values on, so every node computes from
    onnxruntime's values of its inputs and a difference is the node's own."""

    def __init__(self, module: nn.Module, values: dict[str, Any], op_types: dict[str, str]) -> None:
        super().__init__(module)
        self.values, self.op_types = values, op_types
        self.extra_traceback = False  # the message stays one line

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.op != "call_module" or ONNX_NODE not in n.meta:
            return result
        name, outputs = n.meta[ONNX_NODE]
        exact = isinstance(self.module.get_submodule(n.target), FakeQuantize)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        scale = max((magnitude(value) for value in [*args, *kwargs.values()]), default=0.0)
        several = isinstance(result, tuple | list)
        results = list(result) if several else [result]
        for i, (output, value) in enumerate(zip(outputs, results)):
            expected = self.values.get(output)
            if not isinstance(expected, np.ndarray) or not isinstance(value, torch.Tensor):
                continue
            if not agrees(value, expected, exact, scale):
                raise _Disagreement(_message(name, self.op_types.get(name, "?"), output, _array(value), expected, exact, scale))
            results[i] = _tensor(expected, value.device).to(value.dtype)
        return type(result)(results) if several else results[0]


def _message(name: str, op_type: str, output: str, actual: np.ndarray, expected: np.ndarray, exact: bool, scale: float) -> str:
    """What differs at a node, and what to do, on one line."""
    if actual.shape != expected.shape:
        how = f"has shape {list(actual.shape)} where onnxruntime gives {list(expected.shape)}"
    elif not np.issubdtype(expected.dtype, np.floating):
        how = f"differs in {int(np.sum(actual != expected))} of {expected.size} values"
    else:
        allowed = "none (a quantizer on the same input gives the same bits)" if exact else f"{bound(expected, scale):.3g} (float rounding)"
        how = f"differs by up to {largest_difference(actual, expected):.3g} where {allowed} is allowed"
    return (f"the lifted module computes node {name!r} ({op_type}) other than onnxruntime: given onnxruntime's inputs, "
            f"its output {output!r} {how}; tuning would train towards values the model does not give, so it stops "
            "here: please report this with the model")


def onnxruntime_values(model: onnx.ModelProto, feed: dict[str, np.ndarray], names: Sequence[str] = (),
                       folder: Path | None = None) -> dict[str, np.ndarray]:
    """onnxruntime's values of the model's outputs and of the named values of its main graph (made
    outputs), by name, where numpy can hold them (onnxruntime says which after its own type inference).
    A model set aside reads its tensors from `folder` (onnx.session.session_folder)."""
    with session_folder(folder) as where:  # past BY_FILE_BYTES the copy refers to a data file there
        exposed = copy_for_session(model, where)
        declared = {output.name for output in exposed.graph.output}
        exposed.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in dict.fromkeys(names)
                                    if name not in declared)
        session = session_of_copy(attach_custom_ops(exposed, in_place=True), where)
    wanted = [output.name for output in session.get_outputs() if output.type in NUMPY_TYPES]
    return dict(zip(wanted, session.run(wanted, feed)))


def _module_outputs(module: nn.Module, arrays: list[np.ndarray]) -> list[np.ndarray | None]:
    """The module's outputs on the arrays, as numpy arrays (None for what is not a tensor)."""
    device = _device(module)
    with torch.no_grad():
        result = module(*[_tensor(a, device) for a in arrays])
    return [_array(r) for r in (result if isinstance(result, tuple) else (result,))]


def _device(module: nn.Module) -> torch.device:
    """Where the module's tensors are (the CPU for a module without any)."""
    tensor = next(iter([*module.parameters(), *module.buffers()]), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A copy of an array as a tensor on `device`."""
    return torch.from_numpy(np.array(array)).to(device)


def _array(value: Any) -> np.ndarray | None:
    """A tensor as a numpy array, float32 for a float type numpy lacks (bfloat16, float8); None for
    anything else."""
    if not isinstance(value, torch.Tensor):
        return None
    tensor = value.detach().cpu()
    if tensor.is_floating_point() and tensor.dtype not in (torch.float16, torch.float32, torch.float64):
        tensor = tensor.float()
    return tensor.numpy()
