"""AMD Quark for ONNX option names and values as finetune knows them: for each level of a Quark
config (top level, extra_options, FastFinetune, AutoMixprecision, TensorQuantOverrides) the options
that are mapped, accepted without effect, or accepted only at finetune's value, and the tables of
Quark's enum-like values (quant types, calibration methods, quant formats).

Enum-like values may be enum members or strings such as "QInt8", "QuantType.QInt8",
"ExtendedQuantType.QBFloat16", "CalibrationMethod.MinMax", "PowerOfTwoMethod.MinMSE" or
"VitisQuantFormat.BFPFixNeuron" (any module prefix, case-insensitive). Options are either mapped,
accepted without effect (they steer logging, execution providers, memory or features that are off;
listed in the log), or accepted only at the value that matches what finetune does (otherwise an
error saying there is no equivalent). Anything else is an unknown option and an error.
"""

from __future__ import annotations

import difflib
import enum
import logging
from collections.abc import Mapping
from typing import Any

from finetune.onnx.equalize import MAX_SWEEPS, SETTLED

from .schema import ConfigError, join_path

log = logging.getLogger(__name__)

_OFF = (False, None)
_EMPTY = (None, [], (), {}, "")

_TYPE_MEMBERS: dict[str, tuple[str, str | None]] = {
    "QInt4": ("int", "int4"), "QUInt4": ("int", "uint4"), "QInt8": ("int", "int8"), "QUInt8": ("int", "uint8"),
    "QInt16": ("int", "int16"), "QUInt16": ("int", "uint16"), "QInt32": ("int", "int32"), "QUInt32": ("int", "uint32"),
    "QFloat16": ("float", "float16"), "QBFloat16": ("float", "bfloat16"), "QFLOAT8E4M3FN": ("float", "float8_e4m3fn"),
    "QBFP": ("bfp", None), "QMX": ("mx", None),
}
_TYPE_ENUMS = ("QuantType", "ExtendedQuantType", "VitisQuantType")
QUANT_TYPES = {f"{e}.{m}": v for e in _TYPE_ENUMS for m, v in _TYPE_MEMBERS.items()}

# Quark calibration method -> (our calibration, power-of-two scales); None: no equivalent here.
CALIBRATE_METHODS: dict[str, tuple[str, bool] | None] = {
    "CalibrationMethod.MinMax": ("minmax", False),
    "CalibrationMethod.Entropy": ("entropy", False),
    "CalibrationMethod.Percentile": ("percentile", False),
    "CalibrationMethod.Distribution": None,
    "PowerOfTwoMethod.NonOverflow": ("minmax", True),
    "PowerOfTwoMethod.MinMSE": ("pot_minmse", True),
    "LayerWiseMethod.LayerWisePercentile": None,
    "ExtendedCalibrationMethod.MinMSE": ("mse", False),
}

# Quark quant format -> the type it forces on activations and weights ("" for none); None: no equivalent.
QUANT_FORMATS: dict[str, str | None] = {
    "QuantFormat.QDQ": "", "ExtendedQuantFormat.QDQ": "", "VitisQuantFormat.QDQ": "",
    "VitisQuantFormat.BFPFixNeuron": "QBFP", "VitisQuantFormat.MXFixNeuron": "QMX",
    "QuantFormat.QOperator": None, "VitisQuantFormat.FixNeuron": None,
}

TOP_MAPPED = (
    "quant_format", "calibrate_method", "activation_type", "weight_type", "op_types_to_quantize",
    "extra_op_types_to_quantize", "nodes_to_exclude", "per_channel", "include_fast_ft", "include_auto_mp",
    "include_cle", "include_sq", "include_rotation", "specific_tensor_precision", "enable_npu_cnn", "enable_dpu", "extra_options",
    "optimize_model",
)
TOP_NO_EFFECT = (
    "execution_providers", "use_external_data_format", "debug_mode", "print_summary",
    "ignore_warnings", "log_severity_level",
)
TOP_ACCEPTED_ONLY: dict[str, tuple[Any, ...]] = {
    **dict.fromkeys(
        (
            "input_nodes", "output_nodes", "nodes_to_quantize", "subgraphs_to_exclude",
            "random_data_reader_input_shape",
        ),
        _EMPTY,
    ),
    **dict.fromkeys(
        (
            "reduce_range", "use_dynamic_quant", "enable_npu_transformer", "convert_fp16_to_fp32", "convert_nchw_to_nhwc",
            "crypto_mode",
        ),
        _OFF,
    ),
}

# the scale alignments npu_cnn applies (finetune.config.npu): true with enable_npu_cnn, false without
NPU_ALIGN_OPTIONS = ("AlignConcat", "AlignPool", "AlignPad", "AlignSlice")
EXTRA_MAPPED = (
    "ActivationSymmetric", "WeightSymmetric", "CalibTensorRangeSymmetric", "Percentile", "WeightCalibrateMethod",
    "Int32Bias", "QuantizeBias", "BFPAttributes", "MXAttributes", "RefineBlockAxis", "MixedPrecisionTensor",
    "TensorQuantOverrides", "AutoMixprecision", "EnableDualQuantNodePairs", "FastFinetune", "SmoothAlpha", "OpTypesToQuantize",
    "ExtraOpTypesToQuantize", "QuantizeAllOpTypes", "WeightsOnly", "AddQDQPairToWeight", "BF16QDQToCast", "UseGPTQ",
    "GPTQParams", "BiasCorrection", "FoldBatchNorm", "UseMatMulNBits", "MatMulNBitsParams",
    *NPU_ALIGN_OPTIONS,
)
EXTRA_NO_EFFECT = (
    "ExecutionProviders", "DebugMode", "PrintSummary", "IgnoreWarnings", "TmpDir", "CalibWorkerNum",
    "CalibOptimizeMem", "CalibOptimizeDisk", "SaveTensorHistFig", "EvalMetrics", "EvalDataReader",
    "FillAllValueInfo", "RemoveInputInit", "UseQDQVitisCustomOps", "SkipPreprocess", "CopyBiasInit", "UseFP32Scale",
    "CalibMovingAverageConstant", "OpTypesToExcludeOutputQuantization", "NodesToExcludeOutputQuantization",
    "RMatrixDim", "UseRandomHad",
    "RConfigPath", "LWPMetric", "ActivationBitWidth", "PercentileCandidates",
)
# include_cle runs finetune's own equalisation (finetune.onnx.equalize), which has no knobs: its
# options are accepted at the values that describe it, and FINETUNE_DOES says what it does.
CLE_OPTIONS: dict[str, tuple[Any, ...]] = {
    "CLESteps": (-1, None), "CLETotalLayerDiffThreshold": (None,), "CLEScaleAppendBias": (False, None),
}
FINETUNE_DOES = {
    "CLESteps": f"finetune's equalisation sweeps until every scale is within {SETTLED:g} of 1 (at most "
    f"{MAX_SWEEPS} sweeps), which -1 (adaptive) stands for",
    "CLETotalLayerDiffThreshold": f"finetune's equalisation stops once every scale is within {SETTLED:g} of 1, "
    "not on a total weight change",
    "CLEScaleAppendBias": "finetune's equalisation scales by the weight ranges alone (false)",
}
EXTRA_ACCEPTED_ONLY: dict[str, tuple[Any, ...]] = {
    **CLE_OPTIONS,
    # finetune quantizes the inputs of every selected op whether or not its own input is quantized:
    # what true asks for; false (only ops whose input is quantized) has no equivalent
    "ForceQuantizeNoInputCheck": (True, None),
    "AdjustBiasScale": (True, None),
    "MinMSEMode": ("All", None),
    "MinMSEModePof2Scale": ("All", None),
    **dict.fromkeys(
        (
            "RandomDataReaderInputShape", "RandomDataReaderInputDataRange", "CalibDataSize",
            "QDQOpTypePerChannelSupportToAxis", "ConvertOpsetVersion", "RemoveQDQBetweenOps", "CopySharedInit",
            "CalibPassthroughOpTypes", "FixShapes", "PreprocessYAML", "SaveAndRestore", "UserCustomOpLibPath",
            "EncryptionAlgorithm", "NumBins", "MinMSEModeFloatScale", "SimplifyModelOptions",
        ),
        _EMPTY,
    ),
    **dict.fromkeys(
        (
            "UseRandomData", "CalibMovingAverage", "Int16Scale", "UseUnsignedReLU", "Int16Bias", "QuantizeFP16",
            "ActivationScaled", "WeightScaled", "SimplifyModel", "EnableSubgraph",
            "MatMulConstBOnly", "DedicatedQDQPair", "ConvertBNToConv", "ConvertReduceMeanToGlobalAvgPool",
            "SplitLargeKernelPool", "ConvertSplitToSlice", "FuseInstanceNorm", "FuseL2Norm", "FuseGelu",
            "FuseLayerNorm", "ConvertClipToRelu", "SimulateDPU", "ConvertLeakyReluToDPUVersion",
            "ConvertSigmoidToHardSigmoid", "ConvertHardSigmoidToDPUVersion", "ConvertAvgPoolToDPUVersion",
            "ConvertClipToDPUVersion", "ConvertReduceMeanToDPUVersion", "ConvertSoftmaxToDPUVersion",
            "NPULimitationCheck", "MaxLoopNum", "AdjustShiftCut", "AdjustShiftBias", "AdjustShiftRead",
            "AdjustShiftWrite", "AdjustHardSigmoid", "AdjustShiftSwish", "AlignTranspose", "AlignReshape",
            "ReplaceClip6Relu", "RemoveQDQConvClip", "RemoveQDQConvRelu", "RemoveQDQConvLeakyRelu",
            "RemoveQDQConvPRelu", "RemoveQDQConvGelu", "RemoveQDQMulAdd", "RemoveQDQInstanceNorm", "RemoveFusedQDQ", "BF16WithClip",
            "FoldRelu", "AlignEltwiseQuantType", "EnableVaimlBF16",
            "ConvertFP16ToFP32", "ConvertNCHWToNHWC", "CryptoMode",
        ),
        _OFF,
    ),
}

# FastFinetune key -> fast_finetune key (dotted: a key of a section); EarlyStop and InferDevice are handled on their own.
FAST_FT_KEYS = {
    "OptimAlgorithm": "algorithm", "NumIterations": "iterations", "LearningRate": "lr", "BatchSize": "batch_size",
    "DataSize": "data_size", "FixedSeed": "seed", "OptimDevice": "device", "TargetOpType": "op_types",
    "UpdateBias": "adaquant.update_bias", "OutputQDQ": "include_output_quant", "DropRatio": "drop_ratio",
}
FAST_FT_MAPPED = (*FAST_FT_KEYS, "EarlyStop", "InferDevice")
FAST_FT_NO_EFFECT = ("LogPeriod", "MemOptLevel")
FAST_FT_ACCEPTED_ONLY = {"NumBatches": (1, None), "LRAdjust": _EMPTY, "SelectiveUpdate": _OFF}
QUARK_FAST_FT_BATCH_SIZE = 1

# GPTQParams key -> fast_finetune.gptq key; Bits, PerChannel and WeightSymmetric describe Quark's own
# integer grid and are checked against the weight format, which is the grid GPTQ rounds to here.
GPTQ_KEYS = {"PercDamp": "perc_damp", "BlockSize": "block_size", "ActOrder": "act_order"}
GPTQ_GRID = ("Bits", "PerChannel", "WeightSymmetric")
GPTQ_ACCEPTED_ONLY = {"GroupSize": (-1, None), "MSE": _OFF}
QUARK_GPTQ_OP_TYPES = ("MatMul",)  # Quark's GPTQ rounds the weights of MatMul nodes only
QUARK_BLOCK_AXIS = 1

AUTO_MP_MAPPED = (
    "TargetOpType", "TargetQuantType", "ActTargetQuantType", "WeightTargetQuantType", "BiasTargetQuantType",
    "DualQuantNodes", "OutputIndex", "L2Target", "Top1AccTarget", "EvaluateFunction", "NumTarget", "TargetTensors",
    "TargetIndices", "ExcludeIndices", "AutoMixUseFastFT",
)
AUTO_MP_NO_EFFECT = ("DataSize", "NoInputQDQShared")
AUTO_MP_ACCEPTED_ONLY: dict[str, tuple[Any, ...]] = {}

TENSOR_OVERRIDE_KEYS = ("quant_type", "axis", "symmetric")
TENSOR_OVERRIDE_ACCEPTED_ONLY = dict.fromkeys(("scale", "zero_point", "rmin", "rmax", "reduce_range"), (None,))

# Every option name a Quark config may hold at its top level (finding one marks a Quark config).
TOP_KEYS = (*TOP_MAPPED, *TOP_NO_EFFECT, *TOP_ACCEPTED_ONLY, "global_quant_config", "global_config")


def option_problems(
    options: Mapping[str, Any],
    mapped: tuple[str, ...],
    no_effect: tuple[str, ...],
    accepted_only: Mapping[str, tuple[Any, ...]],
    path: str,
) -> list[ConfigError]:
    """Every unknown option, and every option without an equivalent that does not hold the value
    matching what finetune does (all of them, so one run lists all); those without effect are logged."""
    known = (*mapped, *no_effect, *accepted_only)
    problems = []
    for key, value in options.items():
        where = join_path(path, str(key))
        if key not in known:
            problems.append(ConfigError(where, f"unknown Quark option{_suggestion(str(key), known)}"))
        elif key in accepted_only and value not in accepted_only[key]:
            accepted = " or ".join(map(repr, accepted_only[key]))
            ours = f"; {FINETUNE_DOES[key]}" if key in FINETUNE_DOES else ""
            problems.append(ConfigError(where, f"{value!r} has no equivalent in finetune (accepted: {accepted}){ours}"))
        elif key in no_effect:
            log.info("Quark option %s accepted without effect in finetune", where)
    return problems


def _suggestion(key: str, known: tuple[str, ...]) -> str:
    """A likely intended option name, or the whole list when it is short."""
    close = [k for k in known if k.lower() == key.lower()] or difflib.get_close_matches(key, known, n=1)
    if close:
        return f" (did you mean {close[0]}?)"
    return f"; known: {', '.join(known)}" if len(known) <= 20 else ""


def enum_value(value: Any, table: Mapping[str, Any], path: str) -> Any:
    """Look an enum-like Quark value (enum member or string, any module prefix, any case) up in
    `table`, whose keys are "Enum.Member"; a None entry means there is no equivalent here."""
    text = f"{type(value).__name__}.{value.name}" if isinstance(value, enum.Enum) else value
    if not isinstance(text, str):
        raise ConfigError(path, f"expected one of {_listing(table)}; got {value!r}")
    *prefix, member = text.lower().split(".")
    hits = [k for k in table if _names(k, prefix, member)]
    if not hits:
        raise ConfigError(path, f"expected one of {_listing(table)}; got {value!r}")
    if len({repr(table[k]) for k in hits}) > 1:
        raise ConfigError(path, f"{value!r} is ambiguous; write one of {', '.join(hits)}")
    if table[hits[0]] is None:
        raise ConfigError(path, f"{hits[0]} has no equivalent in finetune")
    return table[hits[0]]


def _names(key: str, prefix: list[str], member: str) -> bool:
    """Whether the table key "Enum.Member" is `member` (of the enum that ends `prefix`, if any)."""
    enum_name, key_member = key.lower().split(".")
    return key_member == member and (not prefix or prefix[-1] == enum_name)


def _listing(table: Mapping[str, Any]) -> str:
    members = dict.fromkeys(k.split(".")[1] for k in table)
    enums = dict.fromkeys(k.split(".")[0] for k in table)
    return f"{', '.join(members)} (of {', '.join(enums)})"
