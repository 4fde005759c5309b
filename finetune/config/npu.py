"""What `npu_cnn: true` asks of a config (AMD Quark's `enable_npu_cnn`, the Vitis AI / Ryzen AI NPU
constraints for CNNs): the op types it quantizes besides `op_types`, which ops share a scale, and
the check that every format in the config is one the NPU reads (integer, per tensor, symmetric,
power-of-two scales, one format per tensor). The alignments themselves run in
`finetune.quantize.npu`, after calibration."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .schema import INHERIT, ConfigError

CONCAT_OPS = ("Concat",)
# ops whose output keeps its input's scale: pooling (as Vitis's AlignPool, plus GlobalMaxPool, which
# moves data like MaxPool) and Pad and Slice (AlignPad, AlignSlice)
SAME_SCALE_OPS = ("MaxPool", "GlobalMaxPool", "AveragePool", "GlobalAveragePool", "Pad", "Slice")
# element-wise ops whose constant operand takes the activation's format (as Quark's AlignEltwiseQuantType)
ELTWISE_OPS = ("Add", "Sub", "Mul", "Div", "Min", "Max")
# quantized under npu_cnn whatever op_types says: the NPU runs them on integers, and the alignments concern them
NPU_CNN_OP_TYPES = (*CONCAT_OPS, *SAME_SCALE_OPS, *ELTWISE_OPS)
# Vitis / Quark NPU constraints finetune does not apply (named at WARNING on every npu_cnn run)
NOT_APPLIED = (
    "AdjustShiftCut", "AdjustShiftBias", "AdjustShiftRead", "AdjustShiftWrite", "AdjustHardSigmoid", "AdjustShiftSwish",
    "SimulateDPU (DPU versions of LeakyRelu, Sigmoid, AveragePool, ReduceMean)", "ConvertBNToConv",
    "ConvertReduceMeanToGlobalAvgPool", "SplitLargeKernelPool", "ConvertSplitToSlice", "ConvertClipToRelu",
)


def check_npu_cnn(choices: Iterable[tuple[str, Any]], dual_quant: bool, mixed_precision: bool) -> None:
    """Refuse, naming the key, what npu_cnn cannot honour: a format choice (key path, FormatChoice,
    None or INHERIT) other than per-tensor symmetric integers with power-of-two scales, dual quant (two
    formats on one tensor) and the mixed precision search (it picks formats the NPU does not read)."""
    for path, choice in choices:
        key, problem = _npu_problem(choice)
        if problem:
            raise ConfigError(f"{path}.{key}", f"npu_cnn needs {problem}")
    if dual_quant:
        raise ConfigError("dual_quant", "npu_cnn reads one format per tensor; set dual_quant to false")
    if mixed_precision:
        raise ConfigError("auto_mixed_precision", "npu_cnn takes one integer format; drop the section or npu_cnn")


def _npu_problem(choice: Any) -> tuple[str, str]:
    """The key and what keeps a format from the NPU, or ("", "") (unset, and tensors left float)."""
    if choice is None or choice is INHERIT:
        return "", ""
    if choice.format != "int":
        return "format", f"integer formats, not {choice.format} (format: int)"
    if choice.granularity != "tensor":
        return "granularity", f"one scale per tensor, not per {choice.granularity} (granularity: tensor)"
    if not choice.symmetric:
        return "symmetric", "symmetric integers (symmetric: true)"
    if not choice.power_of_two:
        return "power_of_two", "power-of-two scales (power_of_two: true)"
    return "", ""
