"""AMD Quark for ONNX configs translated into finetune's config mapping (which `io` validates into
a QuantConfig), so users can bring the configs they already have: the option names of Quark's
`QuantizationConfig` and its `extra_options`, as Quark's public documentation gives them, in a
dict or a YAML/JSON file. Which options exist and what their values mean is in `quark_options`.

Absent options take Quark's documented defaults where those change the numbers (symmetry,
calibration, fast-finetune batch size) and finetune's defaults otherwise (weight storage, op types).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from . import quark_automp, quark_finetune, quark_nbits
from .formats import ALL, AUTO, DEFAULT_OP_TYPES, family_keys
from .quark_options import (
    CALIBRATE_METHODS,
    CLE_OPTIONS,
    EXTRA_ACCEPTED_ONLY,
    EXTRA_MAPPED,
    EXTRA_NO_EFFECT,
    NPU_ALIGN_OPTIONS,
    QUANT_FORMATS,
    QUANT_TYPES,
    QUARK_BLOCK_AXIS,
    TENSOR_OVERRIDE_ACCEPTED_ONLY,
    TENSOR_OVERRIDE_KEYS,
    TOP_ACCEPTED_ONLY,
    TOP_MAPPED,
    TOP_NO_EFFECT,
    enum_value,
    option_problems,
)
from .schema import ConfigError
from .smooth import DEFAULT_ALPHA

log = logging.getLogger(__name__)
T = TypeVar("T")


def translate(options: Mapping[str, Any]) -> tuple[dict[str, Any], Callable[[ConfigError], ConfigError]]:
    """The finetune config mapping equivalent to a Quark `QuantizationConfig` given by its option
    names (or a `Config` mapping with only `global_quant_config`), and the function that restates
    an error found while validating that mapping at the Quark option its key came from. Every
    option that cannot be translated is named in one ConfigError, so one run lists them all."""
    translation = _Translation(_unwrap(options))
    mapping = translation.mapping()
    translation.refuse_problems()
    return mapping, translation.explain


def _unwrap(options: Any) -> Mapping[str, Any]:
    if not isinstance(options, Mapping):
        raise ConfigError("", f"expected a mapping of Quark options, got {options!r}")
    if "global_config" in options:
        raise ConfigError("global_config", "Quark's QConfig API is not supported; give QuantizationConfig option names")
    if "global_quant_config" not in options:
        return options
    if len(options) > 1:
        others = ", ".join(k for k in options if k != "global_quant_config")
        raise ConfigError(others, "only global_quant_config of a Quark Config has an equivalent here")
    return _mapping(options["global_quant_config"], "global_quant_config")


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(path, f"expected a mapping, got {value!r}")
    return value


class _Translation:
    """One Quark config turned into a finetune config mapping; remembers which Quark option each
    finetune key came from, so that errors found later name the option the user wrote, and collects
    every option it cannot translate (a part that fails takes a fallback so the rest is still read)."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = options
        self.origins: dict[str, str] = {}
        self.problems: list[ConfigError] = []
        self.check(options, TOP_MAPPED, TOP_NO_EFFECT, TOP_ACCEPTED_ONLY, "")
        self.extra = self.attempt(_mapping, {}, options.get("extra_options"), "extra_options")
        self.check(self.extra, EXTRA_MAPPED, EXTRA_NO_EFFECT, EXTRA_ACCEPTED_ONLY, "extra_options")
        method = options.get("calibrate_method", "CalibrationMethod.MinMax")
        self.calibration = self.attempt(enum_value, ("minmax", False), method, CALIBRATE_METHODS, "calibrate_method")
        quant_format = options.get("quant_format", "QuantFormat.QDQ")
        forced = self.attempt(enum_value, "", quant_format, QUANT_FORMATS, "quant_format")
        self.activation_type = forced or options.get("activation_type", "QuantType.QInt8")
        self.weight_type = forced or options.get("weight_type", "QuantType.QInt8")
        for key in ("activation_type", "weight_type") if forced else ():
            if key in options and not str(options[key]).endswith(forced):
                log.warning("%s: %s has no effect: quant_format %s forces %s, as in Quark", key, options[key], quant_format, forced)
        self.used: set[str] = set()  # the extra options below that some translated format read

    def check(self, options: Mapping[str, Any], mapped: tuple[str, ...], no_effect: tuple[str, ...],
              accepted_only: Mapping[str, tuple[Any, ...]], path: str) -> None:
        """Collect the unknown options and those without an equivalent at one level of the config."""
        self.problems += option_problems(options, mapped, no_effect, accepted_only, path)

    def attempt(self, compute: Callable[..., T], fallback: T, *args: Any) -> T:
        """compute(*args), or `fallback` with its ConfigError collected."""
        try:
            return compute(*args)
        except ConfigError as error:
            self.problems.append(error)
            return fallback

    def refuse_problems(self) -> None:
        """Raise the collected problems as one ConfigError (each named once), if there are any."""
        messages = list(dict.fromkeys(str(problem) for problem in self.problems))
        if len(messages) == 1:
            raise self.problems[0]
        if messages:
            raise ConfigError("", f"{len(messages)} problems in this Quark config: {'; '.join(messages)}")

    def mapping(self) -> dict[str, Any]:
        """The finetune config mapping (validated afterwards by from_mapping); calibration options
        no translated format reads have no effect, as in Quark, and are named at WARNING."""
        nbits = self.attempt(quark_nbits.params, None, self)
        if nbits is not None:
            activation, weight = None, quark_nbits.weight(nbits, self)
        else:
            activation = self.attempt(self.choice, None, self.activation_type, "activation", "activation", "activation_type")
            weight = self.attempt(self.choice, None, self.weight_type, "weight", "weight", "weight_type")
        gptq = (nbits or {}).get("Algorithm") == "GPTQ" or self.attempt(quark_finetune.uses_gptq, False, self)
        if gptq and activation is not None:
            log.warning("extra_options.UseGPTQ: activations stay float, as in Quark (its GPTQ quantizes weights only)")
        if self.attempt(self.flag, False, "WeightsOnly", False) or gptq:
            activation = None
        for key in sorted({"Percentile", "WeightCalibrateMethod", "ActivationSymmetric", "WeightSymmetric"} & set(self.extra) - self.used):
            log.warning("extra_options.%s given but no format here reads it (calibrate_method, or the types): no effect, "
                        "as in Quark", key)
        auto_mp = self.attempt(quark_automp.translate, ({}, None), self)
        return {
            "activation": activation,
            "weight": weight,
            "bias": self.attempt(self.bias, "auto", weight),
            "op_types": self.attempt(self.op_types, DEFAULT_OP_TYPES) if nbits is None else ["MatMul"],
            "op_type_overrides": auto_mp[0],
            "auto_mixed_precision": auto_mp[1],
            "tensor_overrides": {
                **(self.tensor_overrides("MixedPrecisionTensor", self.precision_tensors) if self.attempt(
                    self.switched_on, False, "specific_tensor_precision", "extra_options.MixedPrecisionTensor",
                    "MixedPrecisionTensor" in self.extra) else {}),
                **self.tensor_overrides("TensorQuantOverrides", self.tensor_quant_override),
            },
            "exclude_nodes": self.exclude_nodes(),
            "dual_quant": self.attempt(self.dual_quant, False),
            "fold_batch_norm": self.attempt(self.fold_batch_norm, True),
            "cross_layer_equalization": self.attempt(self.cross_layer_equalization, False),
            "rotation": self.attempt(self.rotation, None),
            "smooth_quant": self.attempt(self.smooth_quant, None),
            "weight_storage": self.attempt(self.weight_storage, "float") if nbits is None else "matmul_nbits",
            "bf16_as_cast": self.attempt(self.flag, False, "BF16QDQToCast", False),
            "npu_cnn": self.attempt(self.npu_cnn, False),
            "fast_finetune": self.attempt(quark_finetune.translate, None, self, weight, gptq),
        }

    def exclude_nodes(self) -> Any:
        """nodes_to_exclude: exact names or regular expressions, as exclude_nodes takes them."""
        self.origins["exclude_nodes"] = "nodes_to_exclude"
        return self.options.get("nodes_to_exclude") or []

    def explain(self, error: ConfigError) -> ConfigError:
        """The error restated at the Quark option its finetune key came from."""
        for ours in sorted(self.origins, key=len, reverse=True):
            if error.path == ours or error.path.startswith((f"{ours}.", f"{ours}[")):
                return ConfigError(self.origins[ours], f"{error.problem} (as finetune's {error.path})")
        return error

    def flag(self, name: str, default: bool) -> bool:
        """A boolean option, from extra_options when it is one of theirs, else from the top level."""
        source, path = (self.extra, f"extra_options.{name}") if name[0].isupper() else (self.options, name)
        value = source.get(name, default)
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}")
        return value

    def _origin(self, ours: str, theirs: str, value: Any) -> Any:
        self.origins[ours] = theirs
        return value

    def choice(self, quant_type: Any, role: str, at: str | None, path: str) -> dict[str, Any]:
        """The format mapping for a Quark quant type used as activation, weight or named tensor;
        `at` is where it lands in the finetune mapping (None: not recorded)."""
        fmt, dtype = enum_value(quant_type, QUANT_TYPES, path)
        if at is not None:
            self.origins[at] = path
        if fmt in ("bfp", "mx"):
            choice = self._block_choice(fmt, role, at)
        else:
            choice = {"format": fmt, "dtype": dtype}
            if fmt == "int" or dtype.startswith("float8"):
                choice.update(self._calibration(fmt, role, at, path))
            if fmt == "int":
                choice["symmetric"] = self._symmetric(role, at)
        if role == "weight" and self.flag("per_channel", False):
            if fmt in ("bfp", "mx") or not (fmt == "int" or dtype.startswith("float8")):
                raise ConfigError("per_channel", f"applies to integer and float8 weights only, not {quant_type}")
            choice["granularity"] = "channel"
            if at is not None:
                self.origins[f"{at}.granularity"] = "per_channel"
        return choice

    def _calibration(self, fmt: str, role: str, at: str | None, path: str) -> dict[str, Any]:
        """Activations calibrate with calibrate_method; weights with WeightCalibrateMethod, else
        min/max with float scales (as Quark and onnxruntime do) or the power-of-two method."""
        method, power_of_two = self.calibration
        source = "calibrate_method"
        if role == "weight" and "WeightCalibrateMethod" in self.extra:
            source = "extra_options.WeightCalibrateMethod"
            self.used.add("WeightCalibrateMethod")
            method, power_of_two = enum_value(self.extra["WeightCalibrateMethod"], CALIBRATE_METHODS, source)
        elif role == "weight" and not power_of_two:
            method = "minmax"
        if power_of_two and fmt != "int":
            raise ConfigError(source, f"power-of-two scales apply to integer types only; {path} is a float type")
        out: dict[str, Any] = {"calibration": method}
        if fmt == "int":
            out["power_of_two"] = power_of_two
        if method == "percentile" and "Percentile" in self.extra:
            out["percentile"] = self.extra["Percentile"]
            self.used.add("Percentile")
        if at is not None:
            self.origins.update({f"{at}.calibration": source, f"{at}.percentile": "extra_options.Percentile"})
        return out

    def _symmetric(self, role: str, at: str | None) -> Any:
        """WeightSymmetric (default true) for weights; ActivationSymmetric otherwise, defaulting to
        true with power-of-two methods or CalibTensorRangeSymmetric, else false."""
        key = "WeightSymmetric" if role == "weight" else "ActivationSymmetric"
        default = True if role == "weight" else (self.calibration[1] or self.flag("CalibTensorRangeSymmetric", False))
        if at is not None:
            self.origins[f"{at}.symmetric"] = f"extra_options.{key}"
        self.used.add(key)
        return self.extra.get(key, default)

    def _block_choice(self, fmt: str, role: str, at: str | None) -> dict[str, Any]:
        """BFP / MX from BFPAttributes / MXAttributes; weights and named tensors put their blocks
        on the op's input-channel axis (auto), activations keep the given axis (Quark's default
        1; auto with RefineBlockAxis)."""
        name = "BFPAttributes" if fmt == "bfp" else "MXAttributes"
        path = f"extra_options.{name}"
        attributes = dict(_mapping(self.extra.get(name), path))
        keys = tuple(k for k in family_keys(fmt) if k != "format")
        kernel = {"use_compiler_version_cpu_kernel": (0, None)} if fmt == "bfp" else {}
        self.check(attributes, keys, (), kernel, path)
        attributes.pop("use_compiler_version_cpu_kernel", None)
        if role != "activation" or self.flag("RefineBlockAxis", False):
            attributes["axis"] = AUTO
        attributes.setdefault("axis", QUARK_BLOCK_AXIS)
        if at is not None:
            self.origins.update({f"{at}.{key}": f"{path}.{key}" for key in attributes})
        return {"format": fmt, **attributes}

    def bias(self, weight: dict[str, Any] | None) -> str:
        """auto (int32 for INT layers, the weight's float format otherwise), or float when Quark
        leaves biases unquantized; Int32Bias false on INT weights has no equivalent."""
        if not self.flag("QuantizeBias", True):
            return "float"
        if self.flag("Int32Bias", True) or weight is None or weight["format"] != "int":
            return "auto"
        raise ConfigError(
            "extra_options.Int32Bias",
            "false quantizes the bias like an integer weight, which has no equivalent here "
            "(a bias is int32, float, or in its weight's float format)",
        )

    def op_types(self) -> Any:
        """op_types_to_quantize / OpTypesToQuantize (empty: finetune's default op types) plus the
        extra op types; QuantizeAllOpTypes gives all."""
        if self.flag("QuantizeAllOpTypes", False):
            return ALL
        top, extra = self.options.get("op_types_to_quantize"), self.extra.get("OpTypesToQuantize")
        if top and extra and list(top) != list(extra):
            raise ConfigError("extra_options.OpTypesToQuantize", f"{extra} differs from op_types_to_quantize {top}: give one")
        listed = top or extra or DEFAULT_OP_TYPES
        extra = [
            *(self.options.get("extra_op_types_to_quantize") or []),
            *(self.extra.get("ExtraOpTypesToQuantize") or []),
        ]
        self.origins["op_types"] = "op_types_to_quantize"
        return [*listed, *(t for t in extra if t not in listed)]

    def tensor_overrides(self, option: str, entry: Callable[[Any, Any, str], dict[str, Any]]) -> dict[str, Any]:
        """The tensor_overrides that the mapping extra_options.`option` gives, each of its entries
        translated by `entry` (key, value, path); a bad entry is collected and the others still read."""
        path = f"extra_options.{option}"
        out: dict[str, Any] = {}
        for key, value in self.attempt(_mapping, {}, self.extra.get(option), path).items():
            out.update(self.attempt(entry, {}, key, value, f"{path}[{str(key)!r}]"))
        return out

    def precision_tensors(self, quant_type: Any, names: Any, where: str) -> dict[str, Any]:
        """A MixedPrecisionTensor entry {quant type: [tensor names]}."""
        if not isinstance(names, (list, tuple)):
            raise ConfigError(where, f"expected a list of tensor names, got {names!r}")
        return {name: self.choice(quant_type, "tensor", f"tensor_overrides[{name!r}]", where) for name in names}

    def tensor_quant_override(self, name: str, entries: Any, where: str) -> dict[str, Any]:
        """A TensorQuantOverrides entry {tensor: [{quant_type, axis, symmetric}]}; explicit scales,
        ranges and per-channel lists have no equivalent."""
        if not isinstance(entries, (list, tuple)) or len(entries) != 1 or not isinstance(entries[0], Mapping):
            problem = "expected a list holding one mapping (per-channel override lists have no equivalent here)"
            raise ConfigError(where, problem)
        entry = entries[0]
        self.check(entry, TENSOR_OVERRIDE_KEYS, (), TENSOR_OVERRIDE_ACCEPTED_ONLY, f"{where}[0]")
        if "quant_type" not in entry:
            raise ConfigError(f"{where}[0].quant_type", "required here (the config cannot know the tensor's role)")
        at = f"tensor_overrides[{name!r}]"
        choice = self.choice(entry["quant_type"], "tensor", at, f"{where}[0].quant_type")
        for key in ("symmetric", "axis"):
            if key in entry:
                choice[key] = self._origin(f"{at}.{key}", f"{where}[0].{key}", entry[key])
        if "axis" in entry and choice["format"] in ("int", "float"):
            choice["granularity"] = "channel"
        return {name: choice}

    def dual_quant(self) -> Any:
        """EnableDualQuantNodePairs, or AutoMixprecision's DualQuantNodes with include_auto_mp (Quark
        reads that block only then)."""
        if "EnableDualQuantNodePairs" in self.extra:
            return self.flag("EnableDualQuantNodePairs", False)
        if not self.flag("include_auto_mp", False):
            return False
        block = _mapping(self.extra.get("AutoMixprecision"), "extra_options.AutoMixprecision")
        self.origins["dual_quant"] = "extra_options.AutoMixprecision.DualQuantNodes"
        return block.get("DualQuantNodes", False)

    def fold_batch_norm(self) -> bool:
        """Quark folds batch norms into the layers before them when extra_options.FoldBatchNorm says so,
        which defaults to optimize_model (itself on by default)."""
        optimize = self.flag("optimize_model", True)
        self.origins["fold_batch_norm"] = "extra_options.FoldBatchNorm" if "FoldBatchNorm" in self.extra else "optimize_model"
        return self.flag("FoldBatchNorm", optimize)

    def cross_layer_equalization(self) -> bool:
        """include_cle runs finetune's equalisation; the CLE options only describe it (CLE_OPTIONS)."""
        given = ", ".join(f"extra_options.{key}" for key in CLE_OPTIONS if key in self.extra)
        return self.switched_on("include_cle", given, bool(given))

    def smooth_quant(self) -> dict[str, Any] | None:
        """include_sq runs finetune's SmoothQuant with alpha from extra_options.SmoothAlpha (Quark's
        default 0.5 when absent)."""
        if not self.switched_on("include_sq", "extra_options.SmoothAlpha", "SmoothAlpha" in self.extra):
            return None
        self.origins["smooth_quant"] = "include_sq"
        self.origins["smooth_quant.alpha"] = "extra_options.SmoothAlpha"
        return {"alpha": self.extra.get("SmoothAlpha", DEFAULT_ALPHA)}

    def rotation(self) -> dict[str, Any] | None:
        """include_rotation runs finetune's rotation of the residual stream (a randomised Hadamard
        matrix, seed 0)."""
        if not self.flag("include_rotation", False):
            return None
        self.origins["rotation"] = "include_rotation"
        return {}

    def switched_on(self, flag: str, path: str, given: bool) -> bool:
        """Whether the include_* `flag` is on; options given for it while it is off have no effect,
        as in Quark, which is said at WARNING (not silently dropped)."""
        on = self.flag(flag, False)
        if given and not on:
            log.warning("%s given but %s is false: no effect, as in Quark", path, flag)
        return on

    def npu_cnn(self) -> bool:
        """enable_npu_cnn (or its former name enable_dpu) is finetune's npu_cnn, which needs a
        power-of-two calibrate_method; the Align* options npu_cnn applies hold true with it and false
        without. Quark's int8 bias under enable_npu_cnn stays int32 here, said at WARNING."""
        on = self.flag("enable_npu_cnn", False) or self.flag("enable_dpu", False)
        self.origins["npu_cnn"] = "enable_npu_cnn" if "enable_npu_cnn" in self.options else "enable_dpu"
        for option in NPU_ALIGN_OPTIONS:
            if self.flag(option, on) != on:
                problem = ("false has no equivalent: finetune's npu_cnn always aligns these scales" if on
                           else "true takes effect only with enable_npu_cnn here (its NPU limitation check)")
                raise ConfigError(f"extra_options.{option}", problem)
        if not on:
            return False
        if not self.calibration[1]:
            raise ConfigError("calibrate_method", "enable_npu_cnn needs power-of-two scales: PowerOfTwoMethod.MinMSE "
                                                  "or PowerOfTwoMethod.NonOverflow")
        if "Int32Bias" not in self.extra:
            log.warning("enable_npu_cnn: Quark quantizes biases like weights by default (Int32Bias false); finetune "
                        "keeps int32 biases, whose scale s_input * s_weight is a power of two too")
        return True

    def weight_storage(self) -> str:
        """AddQDQPairToWeight true keeps float weights (our default), false stores them compactly."""
        return "float" if self.flag("AddQDQPairToWeight", True) else "compact"
