"""The quantization config: its schema, formats, fine-tuning settings, YAML presets and AMD Quark
option names (being split out of `quant`, which still holds all of it)."""

from .finetune import DEFAULT_LR, DEVICE_HELP, DEVICE_PATTERN, EarlyStop, FastFinetune
from .formats import ALL, AUTO, DEFAULT_OP_TYPES, FormatChoice, Override, family_keys
from .io import PRESET_DIR, available_presets, deep_merge, from_quark, load_config, save_config, to_dict
from .quant import QuantConfig, top_level_keys
from .schema import ConfigError, from_mapping, join_path

__all__ = [
    "ALL", "AUTO", "DEFAULT_LR", "DEFAULT_OP_TYPES", "DEVICE_HELP", "DEVICE_PATTERN", "PRESET_DIR", "ConfigError",
    "EarlyStop", "FastFinetune", "FormatChoice", "Override", "QuantConfig", "available_presets", "deep_merge",
    "family_keys", "from_mapping", "from_quark", "join_path", "load_config", "save_config", "to_dict", "top_level_keys",
]
