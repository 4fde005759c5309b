"""The quantization config: `schema` (the generic validator), `formats` (per-tensor and per-node
format choices), `finetune` (fine-tuning settings), `quant` (QuantConfig), `io` (YAML, presets,
saving) and `quark` / `quark_options` (AMD Quark option names). The public names are re-exported
here, so `from finetune.config import QuantConfig, load_config` is the usual import."""

from .finetune import DEFAULT_LR, DEVICE_HELP, DEVICE_PATTERN, GPTQ, STEP_GROUP, AdaQuant, EarlyStop, FastFinetune, default_lr
from .formats import AUTO, DEFAULT_OP_TYPES, FormatChoice, Override, format_family
from .io import PRESET_DIR, available_presets, from_quark, load_config, save_config, to_dict
from .quant import QuantConfig
from .schema import ConfigError
from .smooth import AWQ, SmoothQuant

__all__ = [
    "AUTO", "AWQ", "DEFAULT_LR", "DEFAULT_OP_TYPES", "DEVICE_HELP", "DEVICE_PATTERN", "GPTQ", "PRESET_DIR", "STEP_GROUP", "AdaQuant",
    "ConfigError", "EarlyStop", "FastFinetune", "FormatChoice", "Override", "QuantConfig", "SmoothQuant", "available_presets",
    "default_lr", "format_family", "from_quark", "load_config", "save_config", "to_dict",
]
