"""AWQ-style activation-aware scaling before quantizing (the config's awq section; after Lin et al.,
"AWQ", 2023): weight input channels that meet large inputs are scaled up before rounding, so they
lose less to it, and the input is divided by the same scales (folded into its producer where exact).

For each group (an activation X and the MatMul / Gemm layers reading it), with m_j = mean |X_j| over
every calibration row, s(alpha) = m^alpha / sqrt(max m^alpha * min m^alpha), clamped to SCALE_RANGE
(1 where m_j is 0), and alpha is searched in {0, 1/grid, ..., (grid - 1)/grid} for the least summed
output error of the group's layers, each quantized in its own planned weight format:
sum over layers of || X diag(1/s) Q(diag(s) W) - X W ||^2 = trace(E^T G E), E = diag(1/s) Q(diag(s) W) - W,
G = X^T X. G is summed in float64 in the one calibration pass (as GPTQ's Hessian), so the search
never reruns the model (its products with E are float32). Memory: in^2 x 8 bytes per group while
the pass runs (2.6 MB for a width of 576, 19 MB for 1,536). alpha = 0 gives s = 1, plain rounding
to nearest, so the chosen alpha is never worse than it on the calibration loss. The search judges
weight rounding only: with quantized activations too, the input quantizer's error is not part of the loss."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from finetune.config import QuantConfig
from finetune.config.formats import NodeFormats
from finetune.notices import Notice
from finetune.onnx.smooth import SCALE_RANGE, Group, input_axis, weight_factor

from .calibrate import quantize_weight
from .plan import Use, plan
from .smooth import rescale_model


class GramStatistic:
    """G = X^T X (float64) and sum |X| per channel over every row of an activation whose channels
    lie last (non-finite values count as 0)."""

    def __init__(self) -> None:
        self.gram: np.ndarray | None = None
        self.absolute_sum: np.ndarray | None = None
        self.rows = 0

    def update(self, x: np.ndarray) -> None:
        """Add one batch's rows (the activation flattened to [rows, channels]) to G and the sums."""
        if x.size == 0:
            return
        rows = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
        rows = np.where(np.isfinite(rows), rows, 0.0)
        gram, absolute = rows.T @ rows, np.abs(rows).sum(axis=0)
        if self.gram is None:
            self.gram, self.absolute_sum = gram, absolute
        else:
            self.gram += gram
            self.absolute_sum += absolute
        self.rows += rows.shape[0]

    def channels(self) -> int | None:
        """The channels seen (None before any batch)."""
        return None if self.gram is None else self.gram.shape[0]

    def mean_magnitude(self) -> np.ndarray:
        """mean |X_j| per channel j."""
        return self.absolute_sum / self.rows


def activation_aware_scales(mean_magnitude: np.ndarray, alpha: float) -> np.ndarray:
    """s = m^alpha / sqrt(max m^alpha * min m^alpha) over the channels with a positive finite mean m,
    1 elsewhere, clamped to SCALE_RANGE; all ones at alpha 0."""
    usable = (mean_magnitude > 0) & np.isfinite(mean_magnitude)
    if not usable.any():
        return np.ones(mean_magnitude.shape)
    powered = np.where(usable, mean_magnitude, 1.0).astype(np.float64) ** alpha
    middle = np.sqrt(powered[usable].max() * powered[usable].min())
    return np.clip(np.where(usable, powered / middle, 1.0), *SCALE_RANGE)


def output_error(gram: np.ndarray, layer: onnx.NodeProto, weight: np.ndarray, scales: np.ndarray, use: Use | None) -> float:
    """trace(E^T G E) with E = diag(1/s) Q(diag(s) W) - W, W the layer's weight as the graph stores
    it (quantized so, in float32 as the rewrite writes it); 0 for a weight that stays float. The
    product G E is taken in `gram`'s precision (float32: twice as fast as float64, and its rounding,
    about 1e-6 of the loss, is far below the differences between alphas)."""
    if use is None:
        return 0.0
    factor = weight_factor(layer, scales, weight.shape)
    scaled = (weight * factor).astype(np.float32)
    error = (quantize_weight(use, scaled) / factor - weight).astype(gram.dtype)
    error = error if input_axis(layer) == 0 else error.T  # input channels first: [in, out]
    return float(np.sum((gram @ error) * error, dtype=np.float64))


OUTPUT_LAYER = ("it writes a model output (an LM head, judged by its largest logits, which the summed squared error "
                "does not follow): awq.output_layers: true scales it too")


class ActivationAware:
    """AWQ's search: the scales of the alpha with the least output error of the group's weights in
    their planned formats; every layer with a quantized weight is taken, its input float or not,
    but for one writing a model output unless `output_layers` (config.smooth.AWQ)."""

    section = "awq"

    def __init__(self, model: onnx.ModelProto, config: QuantConfig, notices: list[Notice]) -> None:
        self.grid, self.output_layers = config.awq.grid, config.awq.output_layers
        self.outputs = {output.name for output in model.graph.output}
        self.uses = {use.node: use for use in plan(model, config, notices) if use.role == "weight"}
        # (its notices join the run's, so the plan after the rewrite logs none of them a second time)
        self.searched: list[dict[str, Any]] = []

    def refusal(self, node: onnx.NodeProto, formats: NodeFormats) -> str | None:
        """A layer writing a model output is refused unless output_layers; any other is taken."""
        if not self.output_layers and self.outputs.intersection(node.output):
            return OUTPUT_LAYER
        return None

    def statistic(self, group: Group) -> GramStatistic:
        """G and the mean magnitudes of the group's input (its channels lie last: MatMul, Gemm)."""
        return GramStatistic()

    def scales(self, group: Group, statistic: GramStatistic, weights: list[np.ndarray]) -> np.ndarray:
        """The scales at the searched alpha; the search is recorded for the summary."""
        alphas = np.arange(self.grid) / self.grid
        magnitude, gram = statistic.mean_magnitude(), statistic.gram.astype(np.float32)
        losses = [sum(output_error(gram, layer, weight, activation_aware_scales(magnitude, alpha),
                                   self.uses.get(layer.name)) for layer, weight in zip(group.layers, weights))
                  for alpha in alphas]
        best = int(np.argmin(losses))  # the first of equal losses: alpha 0 (rounding to nearest) unless beaten
        self.searched.append({"input": group.value, "layers": [layer.name for layer in group.layers],
                              "alpha": float(alphas[best]), "rtn_loss": losses[0], "loss": losses[best]})
        return activation_aware_scales(magnitude, alphas[best])

    def summary(self) -> dict[str, Any]:
        """The grid, each group's search, and the loss over all groups relative to rounding to nearest."""
        before, after = (sum(group[key] for group in self.searched) for key in ("rtn_loss", "loss"))
        return {"grid": self.grid, "loss_over_rtn": after / before if before > 0 else None, "groups": self.searched}


def awq_model(model: onnx.ModelProto, config: QuantConfig, data: Any, providers: list[str] | None,
              notices: list[Notice]) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """A copy of the normalised float `model` (never modified) with AWQ's scales, and the summary's awq
    entry: the grid, per group the chosen alpha and the calibration loss at alpha 0 (rtn_loss) and at
    it, the loss over all groups relative to rounding to nearest, and per layer what was rewritten."""
    return rescale_model(model, config, data, providers, notices, ActivationAware(model, config, notices))
