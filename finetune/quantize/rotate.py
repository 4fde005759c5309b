"""The quantizer's rotation step (the config's rotation section): the float graph's residual stream
rotated by finetune.onnx.rotate before smoothing and planning, so the layers reading it quantize
inputs whose outlier channels are spread; the rotated float graph is the float reference that
fine-tuning tunes towards, as a smoothed one is."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import onnx

from finetune.config.smooth import Rotation
from finetune.onnx.rotate import RotationError, rotate_graph

logger = logging.getLogger(__name__)


def rotate_model(model: onnx.ModelProto, section: Rotation, folder: Path | None = None) -> dict[str, Any]:
    """Rotate the normalised float `model` (the quantizer's own copy, or finetune.onnx.io.set_aside's
    header of it with its data file in `folder`, whose rotated tensors are read from there) in place; its
    summary entry: the matrix, the stream's width and table, and how many layers read, write and
    fold a norm's gain, the layers rotated online and the nodes that rotate them (left float), and the
    value and output projections rotated per head. A stream that cannot be rotated exactly is a
    one-line ValueError before any weight changes."""
    try:
        plan = rotate_graph(model.graph, section.kind, section.seed, folder, section.online, section.heads)
    except RotationError as error:
        raise ValueError(str(error)) from None
    summary = {"kind": section.kind, "seed": section.seed, "width": plan.width, "table": plan.table,
               "stream_values": len(plan.stream), "layers_reading": len(plan.reading), "layers_writing": len(plan.writing),
               "gains_folded": len(plan.gains), "online": sorted(plan.online), "inserted_nodes": plan.inserted,
               "heads": [list(pair) for pair in plan.heads], "head_width": plan.head_width}
    logger.info("rotation (%s, seed %d): the residual stream of width %d from %s, %d layer(s) reading it, %d writing "
                "into it, %d norm gain(s) folded", section.kind, section.seed, plan.width, plan.table,
                summary["layers_reading"], summary["layers_writing"], summary["gains_folded"])
    return summary
