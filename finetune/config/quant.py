"""QuantConfig, the whole quantization config: which tensors get which format, which nodes are
quantized and whether the model is fine-tuned afterwards, as a frozen dataclass built in Python or
loaded by `finetune.config.io`, with errors that name the full key path and the allowed values.

Schema (YAML keys are the dataclass field names; `preset:` is the one extra key, resolved by io):

    preset: MX9            # start from a preset (name or path), then deep-merge the rest over it
    activation: {...}      # FormatChoice of op inputs, or null to leave them float
    weight: {...}          # FormatChoice of weights
    bias: auto             # auto | float | int32
    op_types: [Conv, ConvTranspose, Gemm, MatMul, LSTM, GRU]   # or `all`
    op_type_overrides: {Add: {activation: {...}}}   # Override per op type (layer-wise)
    node_overrides: {"/layer1/conv": {weight: {...}}}  # Override per node
    tensor_overrides: {"input.1": {...}}            # FormatChoice (or null) per tensor
    exclude_nodes: ["/head/.*"]                     # exact names or full-match regular expressions
    dual_quant: false
    fold_batch_norm: true  # fold each BatchNormalization into the Conv/Gemm before it (onnx.batchnorm)
    cross_layer_equalization: false  # rescale Conv pairs to equal channel ranges before quantizing
    rotation: null         # or {kind: hadamard, seed: 0}: QuaRot-style rotation of a decoder's residual stream (config.smooth)
    smooth_quant: null     # or {alpha: 0.5}: SmoothQuant of MatMul/Gemm/Conv inputs before quantizing (config.smooth)
    awq: null              # or {grid: 20}: AWQ-style activation-aware scaling of MatMul/Gemm inputs (config.smooth); not with smooth_quant
    weight_storage: float  # float | compact | matmul_nbits (compact, then 4-bit MatMul weights as MatMulNBits)
    bf16_as_cast: false    # write bfloat16 QDQ pairs as Cast(to bfloat16) -> Cast(to float) in the final model
    npu_cnn: false         # Vitis AI / Ryzen AI NPU constraints for CNNs: shared scales around Concat, pooling, Pad, Slice (config.npu)
    fast_finetune: null    # or a FastFinetune mapping
    auto_mixed_precision: null  # or an AutoMixedPrecision mapping (per-layer precision search)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .automp import AutoMixedPrecision
from .finetune import FastFinetune
from .formats import ALL, DEFAULT_OP_TYPES, Bias, FormatChoice, NodeFormats, Override, resolve_bias
from .npu import NPU_CNN_OP_TYPES, check_npu_cnn
from .schema import ConfigError, Section, join_path
from .smooth import AWQ, Rotation, SmoothQuant

PER_LAUNCH_STRATEGIES = ("ddp_spawn", "ddp_fork", "ddp_notebook")  # Fabric starts their processes at each launch


@dataclass(frozen=True)
class QuantConfig(Section):
    """Everything the quantizer needs to know. Precedence: tensor_overrides > node_overrides >
    op_type_overrides > activation/weight/bias; exclude_nodes wins over all. Op types and nodes
    named in overrides, and with npu_cnn the op types its alignments concern, are quantized even
    when `op_types` does not list them."""

    activation: FormatChoice | None = None
    weight: FormatChoice | None = None
    bias: Bias = "auto"
    op_types: tuple[str, ...] | Literal["all"] = DEFAULT_OP_TYPES
    op_type_overrides: dict[str, Override] = field(default_factory=dict)
    node_overrides: dict[str, Override] = field(default_factory=dict)
    tensor_overrides: dict[str, FormatChoice | None] = field(default_factory=dict)
    exclude_nodes: tuple[str, ...] = ()
    dual_quant: bool = False
    fold_batch_norm: bool = True
    cross_layer_equalization: bool = False
    rotation: Rotation | None = None
    smooth_quant: SmoothQuant | None = None
    awq: AWQ | None = None
    weight_storage: Literal["float", "compact", "matmul_nbits"] = "float"
    bf16_as_cast: bool = False  # the final model's bfloat16 quantize-dequantize pairs as Cast pairs
    npu_cnn: bool = False  # NPU CNN constraints (finetune.config.npu), AMD Quark's enable_npu_cnn
    fast_finetune: FastFinetune | None = None
    auto_mixed_precision: AutoMixedPrecision | None = None

    @classmethod
    def allowed_keys(cls, data: Mapping[str, Any]) -> tuple[str, ...]:
        return top_level_keys()

    def _check(self) -> None:
        for i, pattern in enumerate(self.exclude_nodes):
            try:
                re.compile(pattern)
            except re.error as error:
                raise ConfigError(f"exclude_nodes[{i}]", f"not a valid regular expression ({error})") from None
        self._check_bias("bias", self.bias, self.activation, self.weight)
        if self.awq is not None and self.smooth_quant is not None:
            raise ConfigError("awq", "smooth_quant is set too, and both rescale the same layers' input channels: pick one "
                              "(remove awq or smooth_quant)")
        if self.auto_mixed_precision is not None and self.fast_finetune is not None and self.fast_finetune.processes > 1:
            self._check_split_search(self.fast_finetune)
        for kind in ("op_type_overrides", "node_overrides"):
            for name, override in getattr(self, kind).items():
                path = f"{kind}[{name!r}]"
                if kind == "node_overrides" and self.excludes(name):
                    raise ConfigError(path, "this node is also matched by exclude_nodes")
                activation, weight, bias = override.apply(self.activation, self.weight, self.bias)
                self._check_bias(join_path(path, "bias"), bias, activation, weight)
        if self.npu_cnn:
            check_npu_cnn(self.format_choices(), self.dual_quant, self.auto_mixed_precision is not None)

    def format_choices(self) -> Iterator[tuple[str, Any]]:
        """Every format choice in the config with its key path (a FormatChoice, None or INHERIT)."""
        for role in ("activation", "weight"):
            yield role, getattr(self, role)
        for kind in ("op_type_overrides", "node_overrides"):
            for name, override in getattr(self, kind).items():
                for role in ("activation", "weight"):
                    yield f"{kind}[{name!r}].{role}", getattr(override, role)
        for name, choice in self.tensor_overrides.items():
            yield f"tensor_overrides[{name!r}]", choice

    @staticmethod
    def _check_split_search(section: FastFinetune) -> None:
        """A mixed-precision search over several processes launches them for its sensitivity and again
        for each tuning, and goes on in this command's process between launches: it takes one machine
        and a strategy that starts the processes at each launch."""
        if section.nodes > 1:
            raise ConfigError("fast_finetune.nodes", "auto_mixed_precision splits its work over the devices of one "
                              "machine: use nodes: 1")
        if not section.strategy.startswith(PER_LAUNCH_STRATEGIES):
            raise ConfigError("fast_finetune.strategy", f"{section.strategy!r} runs the whole command again per process, "
                              "which a mixed-precision search (launching processes several times) cannot follow: use "
                              "ddp_spawn or ddp_fork with auto_mixed_precision")

    @staticmethod
    def _check_bias(path: str, bias: str, activation: FormatChoice | None, weight: FormatChoice | None) -> None:
        try:
            resolve_bias(bias, activation, weight)
        except ValueError as error:
            raise ConfigError(path, str(error)) from None

    def excludes(self, node_name: str) -> bool:
        """Whether exclude_nodes names this node, exactly or as a full-match regular expression."""
        return any(node_name == p or re.fullmatch(p, node_name) for p in self.exclude_nodes)

    def selects(self, node_name: str, op_type: str) -> bool:
        """Whether the node is quantized: not excluded, and its op type listed or overridden."""
        listed = self.op_types == ALL or op_type in self.op_types
        named = op_type in self.op_type_overrides or node_name in self.node_overrides
        named = named or (self.npu_cnn and op_type in NPU_CNN_OP_TYPES)
        return (listed or named) and not self.excludes(node_name)

    def node_formats(self, node_name: str, op_type: str) -> NodeFormats | None:
        """Formats of a node's inputs, weights and bias after its op-type and node overrides
        (tensor_overrides still apply per tensor); None when the node is not quantized."""
        if not self.selects(node_name, op_type):
            return None
        choices = (self.activation, self.weight, self.bias)
        for override in (self.op_type_overrides.get(op_type), self.node_overrides.get(node_name)):
            if override is not None:
                choices = override.apply(*choices)
        activation, weight, bias = choices
        return NodeFormats(activation, weight, resolve_bias(bias, activation, weight))


def top_level_keys() -> tuple[str, ...]:
    """Keys a finetune config mapping may hold at its top level."""
    return ("preset", *(f.name for f in dataclasses.fields(QuantConfig)))
