"""Run a model over calibration data in onnxruntime and stream the observed tensors into observers.

The session runs at ORT_DISABLE_ALL (finetune.onnx.session; DESIGN.md decision 5): even ORT_ENABLE_BASIC folds
BatchNormalization into Conv weights and fuses Conv+Add/Mul, which rounds differently and removes
intermediate tensors, while calibration must see each tensor exactly as the float graph computes it
op by op, as the QDQ model and the lifted torch model will.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import onnx
import onnxruntime as ort
from onnx import numpy_helper
from tqdm.auto import tqdm  # installed with lightning, a dependency of finetune

from finetune.onnx.graphs import all_graphs, all_nodes, element_types
from finetune.onnx.io import load_model
from finetune.onnx.session import copy_for_session, session_of_copy

from .data import Feed
from .expose import expose_inner_values
from .observers import Observer

logger = logging.getLogger(__name__)

LOG_EVERY = 50  # batches between progress log lines


def collect_statistics(
    model: onnx.ModelProto | str | os.PathLike,
    data: Iterable[Feed],
    observers: Mapping[str, Observer],
    providers: Sequence[str] | None = None,
    progress: bool = True,
    log_every: int = LOG_EVERY,
) -> Mapping[str, Observer]:
    """Update each observer with its tensor over every batch of `data` and return the observers.
    Initializers are observed once, graph inputs from the feeds, everything else by exposing it
    as an output of a copy of the model (the given model is never modified). Memory: one batch of
    activations per observed tensor, one weight at a time, and a copy of the model only when a
    session runs (past the threshold, a copy of its graph: see copy_for_session)."""
    model = load_model(model) if not isinstance(model, onnx.ModelProto) else model
    constants, fed, computed = _split_sources(model, list(observers))
    for name, tensor in constants.items():
        observers[name].update(numpy_helper.to_array(tensor))
    if not fed and not computed:
        return observers
    with tempfile.TemporaryDirectory(prefix="finetune-calibrate-") as folder:  # the session has read it when made
        augmented = copy_for_session(model, Path(folder))
        typed = {name: elem_type for name, elem_type in element_types(augmented.graph).items() if elem_type}
        carried = expose_inner_values(augmented.graph, set(computed), typed)
        _expose(augmented, [carried.get(name, name) for name in computed])
        session = session_of_copy(augmented, Path(folder), providers)
    del augmented
    batches = _stream(session, data, observers, fed, computed, carried, progress, log_every)
    if batches == 0:
        raise ValueError("the calibration data gave no batches")
    return observers


def _split_sources(model: onnx.ModelProto, names: list[str]) -> tuple[dict[str, onnx.TensorProto], list[str], list[str]]:
    """Observed names split into initializers, graph inputs and tensors computed by nodes
    (subgraphs' included); a name that is none of these is an error."""
    initializers = {tensor.name: tensor for graph in all_graphs(model.graph) for tensor in graph.initializer}
    inputs = {value.name for value in model.graph.input} - set(initializers)
    produced = {output for node in all_nodes(model.graph) for output in node.output if output}
    produced |= {value.name for graph in all_graphs(model.graph) if graph is not model.graph for value in graph.input}  # body inputs
    unknown = [name for name in names if name not in initializers and name not in inputs and name not in produced]
    if unknown:
        raise ValueError(f"observed tensors {unknown} are not inputs, initializers or node outputs of the model")
    constants = {name: initializers[name] for name in names if name in initializers}
    fed = [name for name in names if name in inputs]
    computed = [name for name in names if name in produced and name not in initializers]
    return constants, fed, computed


def _expose(model: onnx.ModelProto, names: list[str]) -> None:
    """Add the named tensors as graph outputs, typed where the model records their type."""
    known = {value.name: value for value in model.graph.value_info}
    present = {value.name for value in model.graph.output}
    for name in names:
        if name not in present:
            model.graph.output.append(known.get(name, onnx.ValueInfoProto(name=name)))


def _stream(
    session: ort.InferenceSession,
    data: Iterable[Feed],
    observers: Mapping[str, Observer],
    fed: list[str],
    computed: list[str],
    carried: Mapping[str, str],
    progress: bool,
    log_every: int,
) -> int:
    """Run every batch and update the observers (a subgraph's value comes out under the name
    that carries it; an If branch not taken gives it empty, which observers skip); returns the
    number of batches."""
    batches = 0
    for feed in tqdm(data, desc="calibration", unit="batch", disable=not progress):
        outputs = session.run([carried.get(name, name) for name in computed], feed) if computed else []
        for name, value in zip(computed, outputs):
            observers[name].update(value)
        for name in fed:
            observers[name].update(feed[name])
        del outputs  # release this batch's activations before the next run
        batches += 1
        if batches % log_every == 0:
            logger.info("calibration: %d batches through %d observed tensors", batches, len(observers))
    logger.info("calibration done: %d batches, %d observed tensors", batches, len(observers))
    return batches
