"""What a config cannot honour is refused when it is loaded, naming the key and what to do, never
carried to a late failure or silently dropped: calibrations the observers cannot serve, Quark
options whose values differ from what finetune does, and every refused Quark option at once."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml

from finetune.calibrate import make_observer
from finetune.cli import main
from finetune.config import ConfigError, from_quark, load_config
from finetune.formats import FloatSpec, IntSpec
from finetune.onnx.equalize import MAX_SWEEPS, SETTLED

from .test_calibrate import conv_matmul_model

CALIBRATIONS = ("minmax", "percentile", "mse", "pot_minmse", "entropy")
# (id, format mapping without calibration, the observer spec it stands for)
FORMATS = [
    ("int8", {"format": "int", "dtype": "int8"}, IntSpec("int8")),
    ("int8-channel", {"format": "int", "dtype": "int8", "granularity": "channel", "axis": 1}, IntSpec("int8", axis=1)),
    ("uint4", {"format": "int", "dtype": "uint4", "symmetric": False}, IntSpec("uint4", symmetric=False)),
    ("int16", {"format": "int", "dtype": "int16"}, IntSpec("int16")),
    ("uint32-channel", {"format": "int", "dtype": "uint32", "granularity": "channel", "axis": 1},
     IntSpec("uint32", axis=1)),
    ("int4-block", {"format": "int", "dtype": "int4", "granularity": "block", "axis": 1},
     IntSpec("int4", axis=1, block_size=32)),
    ("e4m3fn", {"format": "float", "dtype": "float8_e4m3fn"}, FloatSpec("float8_e4m3fn")),
    ("e5m2-channel", {"format": "float", "dtype": "float8_e5m2", "granularity": "channel", "axis": 1},
     FloatSpec("float8_e5m2", axis=1)),
]
# power-of-two scales (pot_minmse) are an integer key, refused for floats as such
COMBINATIONS = [
    pytest.param(calibration, choice, spec, id=f"{calibration}-{name}")
    for name, choice, spec in FORMATS
    for calibration in CALIBRATIONS
    if not (calibration == "pot_minmse" and choice["format"] == "float")
]


HEAVY_TAILED = np.random.default_rng(0).standard_t(2, size=(4096, 4)).astype(np.float32)


def _served(calibration: str, spec: IntSpec | FloatSpec) -> bool:
    """Whether the observer takes the spec and does what its name says: an entropy threshold that
    clips nothing, even on heavy-tailed data, is minmax under another name."""
    try:
        observer = make_observer(calibration, spec)
    except ValueError:
        return False
    if calibration != "entropy":
        return True
    minmax = make_observer("minmax", spec)
    for each in (observer, minmax):
        each.update(HEAVY_TAILED)
    return not np.allclose(observer.clip_range(), minmax.clip_range())


@pytest.mark.parametrize(("calibration", "choice", "spec"), COMBINATIONS)
def test_config_refuses_exactly_the_calibrations_the_observers_cannot_serve(
    calibration: str, choice: dict, spec: IntSpec | FloatSpec
) -> None:
    power_of_two = {"power_of_two": True} if calibration == "pot_minmse" else {}
    mapping = {"activation": {**choice, **power_of_two, "calibration": calibration}}
    if _served(calibration, spec):
        assert load_config(mapping).activation.calibration == calibration
        return
    with pytest.raises(ConfigError, match=rf"^activation\.calibration: {calibration} cannot calibrate"):
        load_config(mapping)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"calibrate_method": "CalibrationMethod.Entropy", "activation_type": "QFLOAT8E4M3FN"},
            "calibrate_method: entropy cannot calibrate float8_e4m3fn",
        ),
        (
            {"weight_type": "QFLOAT8E4M3FN", "extra_options": {"WeightCalibrateMethod": "Entropy"}},
            "extra_options.WeightCalibrateMethod: entropy cannot calibrate float8_e4m3fn",
        ),
    ],
)
def test_quark_calibration_refusals_name_the_quark_option(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{message}"):
        load_config(options, config_format="quark")


# --- Quark's equalisation options: accepted only at what finetune's equalisation does ---------------


def test_quark_cle_options_at_finetunes_behaviour_are_accepted() -> None:
    described = {"CLESteps": -1, "CLEScaleAppendBias": False}
    config = from_quark({"include_cle": True, "extra_options": described})
    assert config == from_quark({"include_cle": True}) and config.cross_layer_equalization


@pytest.mark.parametrize(
    ("option", "value", "ours"),
    [
        ("CLESteps", 1, f"sweeps until every scale is within {SETTLED:g} of 1 (at most {MAX_SWEEPS} sweeps)"),
        ("CLESteps", 3, "which -1 (adaptive) stands for"),
        ("CLETotalLayerDiffThreshold", 2e-7, f"stops once every scale is within {SETTLED:g} of 1"),
        ("CLEScaleAppendBias", True, "weight ranges alone"),
    ],
)
def test_quark_cle_options_that_differ_from_finetunes_equalisation_are_refused(option: str, value: object, ours: str) -> None:
    with pytest.raises(ConfigError) as caught:
        from_quark({"include_cle": True, "extra_options": {option: value}})
    message = str(caught.value)
    assert message.startswith(f"extra_options.{option}: {value!r} has no equivalent in finetune")
    assert ours in message and "\n" not in message


# --- blocks of an include_* switch that is off: no effect, as in Quark, and said at WARNING ---------


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ({"AutoMixprecision": {"TargetQuantType": "QBFP"}}, "extra_options.AutoMixprecision given but include_auto_mp is false"),
        ({"AutoMixprecision": {"DualQuantNodes": True}}, "extra_options.AutoMixprecision given but include_auto_mp is false"),
        ({"FastFinetune": {"NumIterations": 5}}, "extra_options.FastFinetune given but include_fast_ft is false"),
        ({"CLESteps": -1, "CLEScaleAppendBias": False},
         "extra_options.CLESteps, extra_options.CLEScaleAppendBias given but include_cle is false"),
    ],
)
def test_a_block_whose_switch_is_off_stays_off_with_a_warning(
    extra: dict, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="finetune.config"):
        config = from_quark({"extra_options": extra})
    assert config == from_quark({})  # nothing of the block applies, DualQuantNodes included
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(said) and "as in Quark" in warnings[0]


# --- every refusal of a Quark config lists all its problems at once --------------------------------

MANY_PROBLEMS = {
    "calib_method": "MinMax",
    "calibrate_method": "CalibrationMethod.Distribution",
    "extra_options": {
        "ActivationSymetric": True,
        "SimplifyModel": True,
        "CLESteps": 2,
        "BFPAttributes": {"bitwidth": 16},
        "TensorQuantOverrides": {"w": [{"quant_type": "QInt8", "scale": 0.5}]},
        "FastFinetune": {"SelectiveUpdate": True},
    },
    "activation_type": "QBFP",
    "include_fast_ft": True,
}
MANY_PROBLEM_PATHS = [
    "calib_method: unknown Quark option",
    "calibrate_method: CalibrationMethod.Distribution has no equivalent",
    "extra_options.ActivationSymetric: unknown Quark option (did you mean ActivationSymmetric?)",
    "extra_options.SimplifyModel: True has no equivalent",
    "extra_options.CLESteps: 2 has no equivalent",
    "extra_options.BFPAttributes.bitwidth: unknown Quark option (did you mean bit_width?)",
    "extra_options.TensorQuantOverrides['w'][0].scale: 0.5 has no equivalent",
    "extra_options.FastFinetune.SelectiveUpdate: True has no equivalent",
]


def test_every_problem_of_a_quark_config_is_named_in_one_error() -> None:
    with pytest.raises(ConfigError) as caught:
        from_quark(MANY_PROBLEMS)
    message = str(caught.value)
    assert message.startswith(f"{len(MANY_PROBLEM_PATHS)} problems in this Quark config: ") and "\n" not in message
    for problem in MANY_PROBLEM_PATHS:
        assert message.count(problem) == 1, problem


def test_the_cli_names_every_problem_of_a_quark_config_on_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config, model = tmp_path / "quark.yaml", tmp_path / "model.onnx"
    config.write_text(yaml.safe_dump(MANY_PROBLEMS))
    onnx.save(conv_matmul_model(), model)
    with caplog.at_level(logging.ERROR):
        code = main(["quantize", str(model), "--config", str(config), "--random-data", "2", "-o", str(tmp_path / "q.onnx")])
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert code == 2 and len(errors) == 1 and all(problem in errors[0] for problem in MANY_PROBLEM_PATHS)


# --- Quark options that nothing reads, or that say two things -----------------------------------


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"extra_options": {"Percentile": 99.9}}, "extra_options.Percentile given but no format here reads it"),
        ({"activation_type": "ExtendedQuantType.QBFP", "weight_type": "ExtendedQuantType.QBFP",
          "extra_options": {"ActivationSymmetric": True, "WeightCalibrateMethod": "CalibrationMethod.MinMax"}},
         "extra_options.ActivationSymmetric given but no format here reads it"),
        ({"quant_format": "VitisQuantFormat.BFPFixNeuron", "activation_type": "QuantType.QInt8"},
         "activation_type: QuantType.QInt8 has no effect: quant_format VitisQuantFormat.BFPFixNeuron forces QBFP"),
    ],
)
def test_quark_options_without_effect_are_named_at_warning(options: dict, said: str, caplog: pytest.LogCaptureFixture) -> None:
    """A calibration option no translated format reads (Percentile without the percentile method,
    symmetry for block formats), or a type a forcing quant_format overrides: no effect, as in
    Quark, and said (they were dropped without a word)."""
    with caplog.at_level(logging.WARNING):
        from_quark(options)
    assert said in caplog.text


def test_quark_op_types_given_twice_must_agree() -> None:
    with pytest.raises(ConfigError, match=r"extra_options.OpTypesToQuantize: \['Conv'\] differs from op_types_to_quantize "
                                          r"\['MatMul'\]: give one"):
        from_quark({"op_types_to_quantize": ["MatMul"], "extra_options": {"OpTypesToQuantize": ["Conv"]}})
    assert from_quark({"op_types_to_quantize": ["Conv"], "extra_options": {"OpTypesToQuantize": ["Conv"]}}).op_types == ("Conv",)
