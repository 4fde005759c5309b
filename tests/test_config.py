"""Quantization config: presets give the formats FORMATS.md defines, presets merge with overrides,
errors name the key path and what is allowed, YAML round trips, and Quark-style configs map on."""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path

import pytest

from finetune.config import (
    AUTO,
    DEFAULT_OP_TYPES,
    GPTQ,
    AdaQuant,
    PRESET_DIR,
    ConfigError,
    FastFinetune,
    FormatChoice,
    Override,
    QuantConfig,
    available_presets,
    from_quark,
    load_config,
    save_config,
    to_dict,
)
from finetune.formats import (
    BF16,
    BFP16,
    MX4,
    MX6,
    MX9,
    MXFP4,
    MXFP6_E2M3,
    MXFP6_E3M2,
    MXFP8_E4M3,
    MXFP8_E5M2,
    MXINT8,
    IntSpec,
)

CONV_WEIGHT = {"rank": 4, "output_axis": 0, "input_axis": 1}

# --- presets ----------------------------------------------------------------------------------------

BLOCK_PRESETS = {
    "BFP16": BFP16,
    "MX9": MX9,
    "MX6": MX6,
    "MX4": MX4,
    "MXINT8": MXINT8,
    "MXFP8_E4M3": MXFP8_E4M3,
    "MXFP8_E5M2": MXFP8_E5M2,
    "MXFP6_E3M2": MXFP6_E3M2,
    "MXFP6_E2M3": MXFP6_E2M3,
    "MXFP4": MXFP4,
}


def test_every_preset_file_loads_and_the_required_ones_exist() -> None:
    required = {
        "XINT8",
        "A8W8",
        "A16W8",
        "BF16",
        *BLOCK_PRESETS,
        "INT4_PER_CHANNEL",
        "UINT4_PER_CHANNEL",
        "INT4_BLOCK32",
        "UINT4_BLOCK32",
    }
    assert required <= set(available_presets())
    for name in available_presets():
        assert isinstance(load_config(name), QuantConfig)


def test_top_level_presets_dir_is_the_package_presets() -> None:
    top = Path(__file__).parent.parent / "presets"
    assert top.resolve() == PRESET_DIR.resolve()


@pytest.mark.parametrize("name", ["XINT8", "xint8", "XInt8"])
def test_xint8_is_int8_symmetric_per_tensor_power_of_two_minmse(name: str) -> None:
    config = load_config(name)
    for choice in (config.activation, config.weight):
        assert choice.spec(**CONV_WEIGHT) == IntSpec("int8", symmetric=True, axis=None, power_of_two=True)
        assert choice.calibration == "pot_minmse"
    assert config.bias == "auto" and config.op_types == DEFAULT_OP_TYPES and config.fast_finetune is None


@pytest.mark.parametrize(("name", "activation_dtype"), [("A8W8", "int8"), ("A16W8", "int16")])
def test_a8w8_a16w8_float_scales_minmax_weights_per_output_channel(name: str, activation_dtype: str) -> None:
    config = load_config(name)
    assert config.activation.spec(rank=4) == IntSpec(activation_dtype, symmetric=True)
    assert config.weight.spec(**CONV_WEIGHT) == IntSpec("int8", symmetric=True, axis=0)
    assert config.weight.spec(rank=2, output_axis=1, input_axis=0) == IntSpec("int8", symmetric=True, axis=1)
    assert {config.activation.calibration, config.weight.calibration} == {"minmax"}


def test_bf16_is_bfloat16_without_calibration() -> None:
    config = load_config("BF16")
    assert config.activation.spec() == BF16 == config.weight.spec(**CONV_WEIGHT)
    assert config.activation.calibration is None and config.weight.calibration is None


@pytest.mark.parametrize("name", sorted(BLOCK_PRESETS))
def test_block_presets_on_channel_axis_for_activations_and_input_channels_for_weights(name: str) -> None:
    config = load_config(name)
    expected = BLOCK_PRESETS[name]
    assert config.activation.spec(rank=4) == dataclasses.replace(expected, axis=1)
    assert config.weight.axis == AUTO
    assert config.weight.spec(**CONV_WEIGHT) == dataclasses.replace(expected, axis=1)
    assert config.weight.spec(rank=2, output_axis=1, input_axis=0) == dataclasses.replace(expected, axis=0)
    assert config.weight.spec(rank=1, input_axis=0) == dataclasses.replace(expected, axis=0)
    if name.startswith("MX") and name not in ("MX9", "MX6", "MX4"):
        assert expected.block_size == 32


@pytest.mark.parametrize(
    ("name", "dtype", "symmetric", "axis", "block_size"),
    [
        ("INT4_PER_CHANNEL", "int4", True, 0, None),
        ("UINT4_PER_CHANNEL", "uint4", False, 0, None),
        ("INT4_BLOCK32", "int4", True, 1, 32),
        ("UINT4_BLOCK32", "uint4", False, 1, 32),
    ],
)
def test_int4_weight_only_presets(name: str, dtype: str, symmetric: bool, axis: int, block_size: int | None) -> None:
    config = load_config(name)
    assert config.activation is None
    assert config.weight.spec(**CONV_WEIGHT) == IntSpec(dtype, symmetric=symmetric, axis=axis, block_size=block_size)
    assert config.node_formats("/fc", "MatMul").bias is None


def test_fast_finetune_preset_extends_its_base() -> None:
    config = load_config("MX4_ADAQUANT")
    assert dataclasses.replace(config, fast_finetune=None) == load_config("MX4")
    assert config.fast_finetune == FastFinetune(algorithm="adaquant", iterations=1000, lr=None, batch_size=16)


def test_preset_by_path_equals_preset_by_name() -> None:
    assert load_config(PRESET_DIR / "MX6.yaml") == load_config(str(PRESET_DIR / "MX6.yaml")) == load_config("mx6")


# --- merging presets with overrides --------------------------------------------------------------


def test_override_of_one_key_keeps_the_presets_other_keys() -> None:
    config = load_config({"preset": "MX9", "activation": {"rounding_mode": 2}})
    assert config.activation.spec(rank=4) == dataclasses.replace(MX9, axis=1, rounding_mode=2)
    assert config.weight == load_config("MX9").weight


def test_null_disables_and_a_new_format_replaces_instead_of_merging() -> None:
    assert load_config({"preset": "A8W8", "activation": None}).activation is None
    config = load_config({"preset": "BFP16", "activation": {"format": "int", "dtype": "int16"}})
    assert config.activation.spec() == IntSpec("int16")
    assert config.weight.format == "bfp"


def test_yaml_file_with_relative_preset_chain(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text("preset: A8W8\nweight: {dtype: int4}\nexclude_nodes: ['/head/.*']\n")
    (tmp_path / "mine.yaml").write_text("preset: base.yaml\nbias: float\nfast_finetune: {lr: 1e-3}\n")
    config = load_config(tmp_path / "mine.yaml")
    assert config.weight.spec(**CONV_WEIGHT) == IntSpec("int4", axis=0)
    assert config.activation == load_config("A8W8").activation
    assert config.bias == "float" and config.fast_finetune.lr == 1e-3
    assert config.excludes("/head/fc") and not config.excludes("/body/head/fc")


def test_preset_cycle_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("preset: b.yaml\n")
    (tmp_path / "b.yaml").write_text("preset: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")


# --- errors name the key path and the allowed values ---------------------------------------------


@pytest.mark.parametrize(
    ("mapping", "fragments"),
    [
        ({"activaton": {}}, ["activaton: unknown key", "activation", "did you mean activation"]),
        ({"activation": {"format": "int", "blocksize": 4}}, ["activation.blocksize: unknown key", "block_size"]),
        (
            {"fast_finetune": {"early_stop": {"patience": 3, "foo": 1}}},
            ["fast_finetune.early_stop.foo: unknown key", "patience"],
        ),
        ({"activation": {"format": "int", "dtype": "int9"}}, ["activation.dtype", "int4", "uint32", "'int9'"]),
        ({"weight": {"format": "float", "dtype": "fp8"}}, ["weight.dtype", "bfloat16", "float8_e4m3fn"]),
        (
            {"activation": {"format": "int", "calibration": "kl"}},
            ["activation.calibration", "minmax", "percentile", "mse", "pot_minmse", "entropy"],
        ),
        ({"activation": {"format": "mx", "element_dtype": "fp3"}}, ["activation.element_dtype", "fp4_e2m1", "int8"]),
        ({"activation": {"format": "bfp", "bit_width": 40}}, ["activation.bit_width", "10.."]),
        (
            {"activation": {"format": "bfp", "calibration": "minmax"}},
            ["activation.calibration", "not a key of format bfp"],
        ),
        (
            {"activation": {"format": "float", "calibration": "minmax"}},
            ["activation.calibration", "bfloat16 takes no calibration"],
        ),
        ({"activation": {"format": "int", "calibration": "pot_minmse"}}, ["activation.calibration", "power_of_two"]),
        ({"activation": {"format": "int", "percentile": 99.9}}, ["activation.percentile", "calibration: percentile"]),
        ({"activation": {"format": "int", "block_size": 8}}, ["activation.block_size", "granularity block"]),
        ({"activation": {"format": "xint"}}, ["activation.format", "int, float, bfp, mx"]),
        ({"activation": {"dtype": "int8"}}, ["activation.format: required"]),
        ({"activation": {"format": "int", "symmetric": "yes"}}, ["activation.symmetric", "true or false"]),
        ({"activation": {"format": "int", "granularity": "row"}}, ["activation.granularity", "tensor, channel, block"]),
        ({"bias": "int16"}, ["bias", "auto, float, int32"]),
        ({"bias": "int32", "activation": {"format": "float"}}, ["bias", "INT activations and weights"]),
        ({"weight_storage": "packed"}, ["weight_storage", "float, compact"]),
        ({"op_types": "everything"}, ["op_types", "a list or all"]),
        ({"exclude_nodes": ["/a/(b"]}, ["exclude_nodes[0]", "regular expression"]),
        (
            {"node_overrides": {"/x": {"weight": {"format": "int", "dtype": "int3"}}}},
            ["node_overrides['/x'].weight.dtype", "int4"],
        ),
        ({"tensor_overrides": {"in.1": {"format": "int", "dtype": 8}}}, ["tensor_overrides['in.1'].dtype"]),
        ({"op_type_overrides": {"Add": {}}}, ["op_type_overrides['Add']", "sets nothing"]),
        ({"fast_finetune": {"algorithm": "sgd"}}, ["fast_finetune.algorithm", "adaround, adaquant"]),
        ({"fast_finetune": {"iterations": -1}}, ["fast_finetune.iterations", ">= 0"]),
        ({"fast_finetune": {"iterations": 10.5}}, ["fast_finetune.iterations", "an integer"]),
        ({"fast_finetune": {"lr": 0}}, ["fast_finetune.lr", "> 0"]),
        ({"fast_finetune": {"drop_ratio": 1.5}}, ["fast_finetune.drop_ratio", "<= 1"]),
        ({"fast_finetune": {"data_size": 0}}, ["fast_finetune.data_size", ">= 1"]),
        ({"fast_finetune": {"unit": "model"}}, ["fast_finetune.unit", "layer, block"]),
        ({"fast_finetune": {"adaquant": {"update_bias": True}}}, ["fast_finetune.adaquant.update_bias", "adaquant only"]),
        ({"fast_finetune": {"adaquant": {"learn_scale": "all"}}}, ["fast_finetune.adaquant.learn_scale", "learn_scales"]),
        ({"fast_finetune": {"early_stop": {"min_delta": -1}}}, ["fast_finetune.early_stop.min_delta", ">= 0"]),
        ({"fast_finetune": {"device": "gpu0"}}, ["fast_finetune.device", "cpu, cuda, cuda:N, hip or hip:N"]),
        ({"fast_finetune": {"device": "cuda:x"}}, ["fast_finetune.device", "'cuda:x'"]),
        ({"preset": "MX5"}, ["preset", "MX9", "XINT8"]),
    ],
)
def test_errors_name_the_key_path_and_the_allowed_values(mapping: dict, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(mapping)
    assert isinstance(caught.value, ValueError)
    for fragment in fragments:
        assert fragment in str(caught.value)


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:3", "hip:1"])
def test_device_syntax_accepted(device: str) -> None:
    assert load_config({"fast_finetune": {"device": device}}).fast_finetune.device == device


def test_python_built_configs_are_validated_and_normalised() -> None:
    config = QuantConfig(
        activation=FormatChoice("int"), weight=FormatChoice("int", granularity="channel"), op_types=["Conv"]
    )
    assert config.op_types == ("Conv",)
    assert config == load_config(
        {"activation": {"format": "int"}, "weight": {"format": "int", "granularity": "channel"}, "op_types": ["Conv"]}
    )
    with pytest.raises(ConfigError, match="fast_finetune.seed"):
        load_config({"fast_finetune": {"seed": "x"}})
    with pytest.raises(ConfigError, match=r"lr: must be > 0"):
        FastFinetune(lr=-1.0)
    with pytest.raises(ConfigError, match=r"lr: must be <= 10.0, got 1e\+38"):  # Adam's step overflowed: a crash
        load_config({"fast_finetune": {"lr": 1e38}})


# --- resolution helpers the quantizer uses ---------------------------------------------------------


def test_node_formats_precedence_bias_and_exclusion() -> None:
    config = load_config(
        {
            "preset": "A8W8",
            "op_types": ["Conv"],
            "op_type_overrides": {"Gemm": {"activation": {"format": "int", "dtype": "int16"}}},
            "node_overrides": {"/fc": {"weight": {"format": "float", "dtype": "bfloat16"}, "activation": None}},
            "exclude_nodes": ["/stem/.*", "/exact"],
        }
    )
    conv = config.node_formats("/conv", "Conv")
    assert conv.bias == "int32" and conv.weight.per_channel
    gemm = config.node_formats("/gemm", "Gemm")
    assert gemm.activation.dtype == "int16" and gemm.bias == "int32"
    fc = config.node_formats("/fc", "Gemm")
    assert fc.activation is None and fc.weight.dtype == "bfloat16" and fc.bias is None  # only an INT bias is quantized
    assert config.node_formats("/relu", "Relu") is None
    assert config.node_formats("/stem/conv", "Conv") is None and config.node_formats("/exact", "Conv") is None


def test_node_override_on_an_excluded_node_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"node_overrides\['/head/fc'\].*exclude_nodes"):
        load_config(
            {"preset": "A8W8", "exclude_nodes": ["/head/.*"], "node_overrides": {"/head/fc": {"bias": "float"}}}
        )


def test_spec_axes() -> None:
    choice = FormatChoice("int", granularity="channel", axis=-1)
    assert choice.spec(rank=3) == IntSpec("int8", axis=2)
    with pytest.raises(ValueError, match="out of range"):
        choice.spec(rank=0)
    assert FormatChoice("int", granularity="block").spec(rank=2, output_axis=1, input_axis=0) == IntSpec(
        "int8", axis=0, block_size=32
    )
    assert FormatChoice("bfp").spec() == dataclasses.replace(BFP16, axis=1)


# --- YAML round trip ----------------------------------------------------------------------------


COMPLEX = {
    "preset": "XINT8",
    "activation": {
        "format": "int",
        "dtype": "uint8",
        "symmetric": False,
        "calibration": "percentile",
        "percentile": 99.99,
        "power_of_two": False,
    },
    "weight": {"format": "float", "dtype": "float8_e4m3fn", "granularity": "channel", "calibration": "mse"},
    "bias": "float",
    "op_types": "all",
    "op_type_overrides": {
        "Add": {"activation": {"format": "float", "dtype": "bfloat16"}},
        "Conv": {"activation": None, "bias": "float"},
    },
    "node_overrides": {"/layer1/conv": {"weight": {"format": "mx", "element_dtype": "fp4_e2m1", "axis": 0}}},
    "tensor_overrides": {"input.1": {"format": "int", "dtype": "int16"}, "logits": None},
    "exclude_nodes": ["/head/.*"],
    "dual_quant": True,
    "cross_layer_equalization": True,
    "weight_storage": "compact",
    "fast_finetune": {
        "algorithm": "adaquant",
        "data_size": 64,
        "early_stop": {"enabled": True, "patience": 5},
        "device": "cuda:1",
        "adaquant": {"update_bias": True, "learn_scales": "weights"},
        "op_types": ["Conv"],
        "unit": "block",
        "cache_budget_bytes": 1000,
    },
}


@pytest.mark.parametrize("source", [*available_presets(), "complex"])
def test_yaml_round_trip(source: str, tmp_path: Path) -> None:
    config = load_config(COMPLEX if source == "complex" else source)
    save_config(config, tmp_path / "saved.yaml")
    again = load_config(tmp_path / "saved.yaml")
    assert again == config
    assert to_dict(again) == to_dict(config)


def test_yaml_reads_exponent_floats_without_a_dot(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("fast_finetune:\n  lr: 1e-5\n")
    assert load_config(tmp_path / "c.yaml").fast_finetune.lr == 1e-5


# --- Quark-style configs ------------------------------------------------------------------------


class QuantType(enum.Enum):
    """Stand-in for onnxruntime's QuantType, to pass enum members rather than strings."""

    QInt8 = 0
    QUInt8 = 1


def test_quark_a8w8_minmax_per_channel() -> None:
    options = {
        "calibrate_method": "CalibrationMethod.MinMax",
        "quant_format": "QuantFormat.QDQ",
        "activation_type": QuantType.QInt8,
        "weight_type": "quark.onnx.QuantType.QInt8",
        "per_channel": True,
        "extra_options": {"ActivationSymmetric": True},
    }
    assert from_quark(options) == load_config("A8W8")


def test_quark_default_activations_are_asymmetric_and_float_scales() -> None:
    config = from_quark(
        {
            "activation_type": "QUInt8",
            "calibrate_method": "CalibrationMethod.Percentile",
            "extra_options": {"Percentile": 99.9},
        }
    )
    assert config.activation.spec() == IntSpec("uint8", symmetric=False)
    assert (config.activation.calibration, config.activation.percentile) == ("percentile", 99.9)
    assert config.weight.calibration == "minmax" and config.weight.symmetric


def test_quark_xint8_power_of_two_minmse() -> None:
    options = {
        "calibrate_method": "PowerOfTwoMethod.MinMSE",
        "activation_type": "QInt8",
        "weight_type": "QuantType.QInt8",
    }
    assert from_quark(options) == load_config("XINT8")
    nonoverflow = from_quark({**options, "calibrate_method": "quark.onnx.PowerOfTwoMethod.NonOverflow"})
    assert nonoverflow.activation.calibration == "minmax" and nonoverflow.activation.power_of_two


@pytest.mark.parametrize("quant_format", ["VitisQuantFormat.BFPFixNeuron", "ExtendedQuantFormat.QDQ"])
def test_quark_bfp16_via_bfp_attributes(quant_format: str) -> None:
    options = {
        "quant_format": quant_format,
        "activation_type": "ExtendedQuantType.QBFP",
        "weight_type": "ExtendedQuantType.QBFP",
        "extra_options": {
            "BFPAttributes": {"bfp_method": "to_bfp", "axis": 1, "bit_width": 16, "block_size": 8, "rounding_mode": 0}
        },
    }
    # Quark blocks activations along axis 1 unless RefineBlockAxis; our presets pick the op's reduction axis.
    assert from_quark(options) == load_config({"preset": "BFP16", "activation": {"axis": 1}})
    mx6 = {
        **options,
        "extra_options": {"BFPAttributes": {"bfp_method": "to_bfp_prime", "bit_width": 13, "block_size": 16}},
    }
    assert from_quark(mx6) == load_config({"preset": "MX6", "activation": {"axis": 1}})
    refined = {**mx6, "extra_options": {**mx6["extra_options"], "RefineBlockAxis": True}}
    assert from_quark(refined) == load_config("MX6")


@pytest.mark.parametrize(
    ("element", "preset", "rounding"), [("fp4_e2m1", "MXFP4", 0), ("int8", "MXINT8", 2), ("fp8_e5m2", "MXFP8_E5M2", 0)]
)
def test_quark_mx_via_mx_attributes(element: str, preset: str, rounding: int) -> None:
    options = {
        "calibrate_method": "CalibrationMethod.MinMax",
        "quant_format": "ExtendedQuantFormat.QDQ",
        "activation_type": "ExtendedQuantType.QMX",
        "weight_type": "ExtendedQuantType.QMX",
        "extra_options": {
            "MXAttributes": {"element_dtype": element, "axis": 1, "block_size": 32, "rounding_mode": rounding}
        },
    }
    assert from_quark(options) == load_config({"preset": preset, "activation": {"axis": 1}})


def test_quark_bf16_and_element_wise_mixing() -> None:
    bf16 = {
        "quant_format": "ExtendedQuantFormat.QDQ",
        "activation_type": "ExtendedQuantType.QBFloat16",
        "weight_type": "VitisQuantType.QBFloat16",
    }
    assert from_quark(bf16) == load_config("BF16")
    mixed = from_quark({**bf16, "activation_type": "QBFP", "extra_options": {"QuantizeAllOpTypes": True}})
    assert mixed.activation.format == "bfp" and mixed.weight.dtype == "bfloat16" and mixed.op_types == "all"


def test_quark_mixed_precision_tensor() -> None:
    options = {
        "calibrate_method": "PowerOfTwoMethod.MinMSE",
        "activation_type": "QInt8",
        "weight_type": "QInt8",
        "specific_tensor_precision": True,
        "extra_options": {
            "MixedPrecisionTensor": {
                "VitisQuantType.QInt16": ["/stem/Relu_output_0"],
                "ExtendedQuantType.QBFloat16": ["onnx::Conv_664"],
            }
        },
    }
    config = from_quark(options)
    assert config.tensor_overrides["/stem/Relu_output_0"].spec() == IntSpec("int16", power_of_two=True)
    assert config.tensor_overrides["/stem/Relu_output_0"].calibration == "pot_minmse"
    assert config.tensor_overrides["onnx::Conv_664"].spec() == BF16


def test_quark_tensor_quant_overrides() -> None:
    options = {
        "extra_options": {
            "TensorQuantOverrides": {"w": [{"quant_type": "QuantType.QInt8", "axis": 1}], "x": [{"quant_type": "QBFP"}]}
        }
    }
    config = from_quark(options)
    assert config.tensor_overrides["w"].spec() == IntSpec("int8", symmetric=False, axis=1)
    assert config.tensor_overrides["x"].axis == AUTO
    with pytest.raises(ConfigError, match=r"TensorQuantOverrides\['w'\]\[0\]\.scale.*no equivalent"):
        from_quark({"extra_options": {"TensorQuantOverrides": {"w": [{"quant_type": "QInt8", "scale": 0.5}]}}})


def test_quark_fast_finetune_block() -> None:
    fast = {
        "OptimAlgorithm": "adaquant",
        "NumIterations": 500,
        "LearningRate": 1e-6,
        "OptimDevice": "cuda:0",
        "InferDevice": "cuda:0",
        "FixedSeed": 1705472343,
        "BatchSize": 2,
        "DataSize": 100,
        "EarlyStop": True,
        "DropRatio": 0.25,
        "UpdateBias": True,
        "OutputQDQ": True,
        "TargetOpType": ["Conv", "Gemm"],
        "NumBatches": 1,
        "LogPeriod": 50,
    }
    config = from_quark({"include_fast_ft": True, "extra_options": {"FastFinetune": fast}})
    assert config.fast_finetune == FastFinetune(
        algorithm="adaquant",
        iterations=500,
        lr=1e-6,
        device="cuda:0",
        seed=1705472343,
        batch_size=2,
        data_size=100,
        early_stop={"enabled": True},
        drop_ratio=0.25,
        adaquant={"update_bias": True},
        include_output_quant=True,
        op_types=("Conv", "Gemm"),
    )
    assert from_quark({"include_fast_ft": True}).fast_finetune == FastFinetune(batch_size=1)
    assert from_quark({"include_fast_ft": False, "extra_options": {"FastFinetune": fast}}).fast_finetune is None


def test_quark_use_gptq_is_gptq_on_matmul_weights_with_float_activations(caplog: pytest.LogCaptureFixture) -> None:
    params = {"PercDamp": 0.05, "BlockSize": 32, "ActOrder": True, "Bits": 8, "PerChannel": False,
              "WeightSymmetric": True, "GroupSize": -1, "MSE": False}
    config = from_quark({"extra_options": {"UseGPTQ": True, "GPTQParams": params}})
    assert config.activation is None and config.weight.dtype == "int8"
    assert config.fast_finetune == FastFinetune(algorithm="gptq", op_types=("MatMul",),
                                                gptq=GPTQ(perc_damp=0.05, block_size=32, act_order=True))
    assert "activations stay float, as in Quark" in caplog.text
    tuned = from_quark({"include_fast_ft": True, "extra_options": {"UseGPTQ": True, "FastFinetune": {"OptimAlgorithm": "adaquant"}}})
    assert tuned.fast_finetune == FastFinetune(algorithm="adaquant", batch_size=1, gptq_init=True)
    assert from_quark({"extra_options": {"GPTQParams": params}}).fast_finetune is None
    assert "GPTQParams given but UseGPTQ is false" in caplog.text


@pytest.mark.parametrize(("params", "message"), [
    ({"Bits": 4}, r"GPTQParams\.Bits: 4 differs from the weight format's 8"),
    ({"PerChannel": True}, r"GPTQParams\.PerChannel: True differs from the weight format's False"),
    ({"GroupSize": 128}, r"GPTQParams\.GroupSize: 128 has no equivalent"),
    ({"MSE": True}, r"GPTQParams\.MSE: True has no equivalent"),
    ({"PercDamp": 0}, r"GPTQParams\.PercDamp.*perc_damp"),
])
def test_quark_gptq_params_that_do_not_describe_the_weight_format_are_refused(params: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_quark({"extra_options": {"UseGPTQ": True, "GPTQParams": params}})


def test_quark_include_cle_turns_on_cross_layer_equalization() -> None:
    assert from_quark({"include_cle": True}).cross_layer_equalization
    assert not from_quark({"include_cle": False}).cross_layer_equalization
    assert not from_quark({}).cross_layer_equalization
    with pytest.raises(ConfigError, match=r"include_cle.*true or false"):
        from_quark({"include_cle": "yes"})


def test_quark_layer_wise_auto_mixprecision_and_dual_quant() -> None:
    options = {
        "quant_format": "ExtendedQuantFormat.QDQ",
        "activation_type": "ExtendedQuantType.QBFloat16",
        "weight_type": "ExtendedQuantType.QBFloat16",
        "include_auto_mp": True,
        "extra_options": {
            "QuantizeAllOpTypes": True,
            "Int32Bias": False,
            "BFPAttributes": {"bit_width": 16, "block_size": 8},
            "AutoMixprecision": {
                "TargetOpType": ["Conv", "Gemm"],
                "TargetQuantType": "ExtendedQuantType.QBFP",
                "DualQuantNodes": True,
            },
        },
    }
    config = from_quark(options)
    assert config.dual_quant and config.op_types == "all" and set(config.op_type_overrides) == {"Conv", "Gemm"}
    conv = config.node_formats("/conv", "Conv")
    assert conv.activation.spec(rank=4) == dataclasses.replace(BFP16, axis=1) and conv.weight.format == "bfp"
    assert config.node_formats("/reshape", "Reshape").activation.dtype == "bfloat16"
    assert config.auto_mixed_precision is None  # no accuracy goal: the target types, no search
    searched = from_quark({**options, "extra_options": {"AutoMixprecision": {"TargetQuantType": "QBFP", "Top1AccTarget": 0.01}}})
    section = searched.auto_mixed_precision
    assert not searched.op_type_overrides and (section.metric, section.max_drop) == ("top1_accuracy", 0.01)
    assert [c.format for c in section.ladder.activation] == ["bfp", "float"]  # [the target type, activation_type]


A16W8 = {"activation_type": "QInt16", "weight_type": "QInt8", "include_auto_mp": True}


def _auto_mp(**block: object) -> dict:
    """Quark's documented auto mixed precision (activations QInt16, weights QInt8, target QInt8) with `block` over it."""
    return {**A16W8, "extra_options": {"AutoMixprecision": {"ActTargetQuantType": "QInt8", "WeightTargetQuantType": "QInt8",
                                                            **block}}}


def test_quark_num_target_and_target_indices_name_the_layers_that_take_the_target_types() -> None:
    """NumTarget layers take the target types: the least sensitive lowered when those are the cheaper
    rung; the most sensitive kept high when they are the costlier, as TargetIndices are."""
    lowered = from_quark(_auto_mp(NumTarget=2)).auto_mixed_precision
    assert (lowered.lower, lowered.keep_top) == (2, None)
    costlier = {**A16W8, "activation_type": "QInt8"}
    blocks = {"NumTarget": 2}, {"L2Target": 0.1, "TargetIndices": [3]}
    raised, held = (from_quark({**costlier, "extra_options": {"AutoMixprecision": {"ActTargetQuantType": "QInt16", **block}}})
                    .auto_mixed_precision for block in blocks)
    assert (raised.lower, raised.keep_top) == (None, 2) and held.keep_high == (3,)


@pytest.mark.parametrize(("block", "message"), [
    ({"L2Target": 0.1, "TargetIndices": [3]}, "TargetIndices: puts nodes at the target types, the cheaper rung here"),
    ({"L2Target": 0.1, "WeightTargetQuantType": "QInt16"}, "cheaper in one of activation and weight and costlier in the other"),
])
def test_quark_auto_mp_without_an_order_to_search_is_refused_in_one_line(block: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        from_quark(_auto_mp(**block))
    assert "\n" not in str(caught.value)


def test_load_config_detects_quark_files_and_mappings(tmp_path: Path) -> None:
    options = {"calibrate_method": "PowerOfTwoMethod.MinMSE", "activation_type": "QInt8", "weight_type": "QInt8"}
    (tmp_path / "quark.json").write_text(json.dumps({"global_quant_config": options}))
    assert load_config(tmp_path / "quark.json") == load_config(options) == load_config("XINT8")
    assert load_config({}, config_format="quark") == from_quark({})
    (tmp_path / "on_quark.yaml").write_text(f"preset: {tmp_path / 'quark.json'}\nweight_storage: compact\n")
    assert load_config(tmp_path / "on_quark.yaml") == dataclasses.replace(
        load_config("XINT8"), weight_storage="compact"
    )


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        ({"quant_format": "QDQ", "calib_method": "MinMax"}, ["calib_method", "unknown Quark option"]),
        (
            {"extra_options": {"ActivationSymetric": True}},
            ["extra_options.ActivationSymetric", "did you mean ActivationSymmetric"],
        ),
        (
            {"include_fast_ft": True, "extra_options": {"FastFinetune": {"NumIteration": 5}}},
            ["FastFinetune.NumIteration", "NumIterations"],
        ),
        (
            {"activation_type": "QBFP", "extra_options": {"BFPAttributes": {"bitwidth": 16}}},
            ["BFPAttributes.bitwidth", "bit_width"],
        ),
        ({"activation_type": "QInt9"}, ["activation_type", "QInt8", "QBFloat16"]),
        ({"calibrate_method": "CalibrationMethod.Distribution"}, ["calibrate_method", "no equivalent"]),
        ({"calibrate_method": "MinMSE"}, ["ambiguous", "PowerOfTwoMethod.MinMSE"]),
        ({"quant_format": "QuantFormat.QOperator"}, ["quant_format", "no equivalent"]),
        ({"include_sq": True, "extra_options": {"SmoothAlpha": 2}}, ["extra_options.SmoothAlpha", "<= 1"]),
        ({"extra_options": {"SimplifyModel": True}}, ["extra_options.SimplifyModel", "no equivalent"]),
        ({"extra_options": {"Int32Bias": False}}, ["extra_options.Int32Bias", "no equivalent"]),
        (
            {"include_fast_ft": True, "extra_options": {"FastFinetune": {"LearningRate": -1}}},
            ["FastFinetune.LearningRate", "> 0"],
        ),
        (
            {"include_fast_ft": True, "extra_options": {"FastFinetune": {"OptimDevice": "gpu"}}},
            ["FastFinetune.OptimDevice", "cuda:N"],
        ),
        (
            {"include_fast_ft": True, "extra_options": {"FastFinetune": {"SelectiveUpdate": True}}},
            ["SelectiveUpdate", "no equivalent"],
        ),
        (
            {"activation_type": "QBFP", "extra_options": {"BFPAttributes": {"bit_width": 40}}},
            ["BFPAttributes.bit_width", "10.."],
        ),
        ({"weight_type": "QBFloat16", "per_channel": True}, ["per_channel", "integer and float8"]),
        ({"quant_format": "QDQ", "activation": {"format": "int"}}, ["mixes finetune keys"]),
    ],
)
def test_quark_errors_name_the_option(options: dict, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(options)
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_override_dataclass_keeps_unset_keys() -> None:
    override = Override(weight=None)
    assert override.apply("a", "w", "auto") == ("a", None, "auto")
    assert to_dict(override) == {"weight": None}


def test_adaquant_keys_at_the_top_level_are_still_read_with_a_warning_naming_their_new_place() -> None:
    """update_bias, learn_scales, scale_lr and learn_equalization moved into fast_finetune.adaquant: the old
    keys still load (a mapping, a YAML file or a keyword), each named with its new key, and are saved there."""
    with pytest.warns(FutureWarning, match=r"fast_finetune.update_bias is now fast_finetune.adaquant.update_bias, "
                                           r"fast_finetune.scale_lr is now fast_finetune.adaquant.scale_lr"):
        config = load_config({"fast_finetune": {"algorithm": "adaquant", "update_bias": True, "scale_lr": 0.01}})
    assert config.fast_finetune.adaquant == AdaQuant(update_bias=True, scale_lr=0.01)
    assert "update_bias" not in to_dict(config.fast_finetune) and to_dict(config.fast_finetune)["adaquant"]["update_bias"]
    with pytest.warns(FutureWarning, match="learn_scales is now fast_finetune.adaquant.learn_scales"):
        assert FastFinetune(algorithm="adaquant", learn_scales="all").adaquant.learn_scales == "all"
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="adaquant.learn_equalization: applies to algorithm "
                                                                        "adaquant only"):
        load_config({"fast_finetune": {"learn_equalization": True}})
