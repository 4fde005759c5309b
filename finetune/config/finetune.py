"""The fine-tuning settings of a config: FastFinetune (AdaRound / AdaQuant / GPTQ reconstruction
after quantization) with its EarlyStop rule and its AdaQuant and GPTQ sections, default learning
rates, the steps read together and the device-string syntax, which the fine-tuning stage resolves
to a torch device."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import InitVar, dataclass, field
from typing import Any, Literal

from .formats import DEFAULT_OP_TYPES
from .schema import ConfigError, Section, from_mapping

# The default learning rate per algorithm and family of the tuned weight's format (the `format` of
# FormatChoice: int, float, bfp, mx), measured on the digits CNN and transformer with
# scripts/sweep_lr.py (docs/fine-tuning.md, "Learning rate"). AdaRound rounds INT weights only; a
# weight left unquantized takes the float rate. GPTQ takes no learning rate.
# AdaQuant's held-out output error was lowest at: W4A8 (int) 3e-4, FP8 (float) 1e-5, MX4 (bfp) 1e-3,
# MXFP4 (mx) 3e-4, where 1e-3 came within 1.5 % and is kept (the digits transformer's MXFP4 run used it).
DEFAULT_LR: dict[str, dict[str, float]] = {
    "adaround": {"int": 0.1},
    "adaquant": {"int": 3e-4, "float": 1e-5, "bfp": 1e-3, "mx": 1e-3},
}
MAX_LR = 10.0  # Adam's first step moves each weight by about lr; from 3.4e37 its step overflows float32 (a crash)
# The device-string syntax, for the config check and for resolving it to a torch device: "cpu", or
# a `kind` (cuda, or hip on ROCm builds of torch) with an optional device `index`.
DEVICE_PATTERN = r"cpu|(?P<kind>cuda|hip)(?::(?P<index>\d+))?"
DEVICE_HELP = "cpu, cuda, cuda:N, hip or hip:N"
# Steps whose losses are read, shown and judged together: an accelerator's losses reach the host this
# many at a time (one synchronisation), the metric log and the progress bar show every this-many-th
# step's loss, early stopping without held-out batches averages this many training losses (one batch's
# loss is noisy), and held-out evaluations come every multiple of it (each reads the host).
STEP_GROUP = 10

logger = logging.getLogger(__name__)


def default_lr(algorithm: str, family: str | None) -> float:
    """The default learning rate of `algorithm` for a weight of format family `family` (None: unquantized)."""
    return DEFAULT_LR[algorithm][family or "float"]


@dataclass(frozen=True)
class EarlyStop(Section):
    """End a unit's optimisation once its loss has not improved by `min_delta` for `patience`
    iterations, counting only after `warmup` iterations; the schedule's rest then runs in a tail:
    AdaQuant's learning-rate decay over `patience` iterations, AdaRound's annealing (when stopped
    in its warm-up) over four times the warm-up run (defaults: on, 100, 0.0, 0). Where calibration
    batches are held out (fast_finetune.validation_share) the loss is the unit's on them, measured
    every few steps (a multiple of STEP_GROUP, so the measurements cost about a tenth of the tuning),
    and `patience` iterations are that many steps' worth of measurements (rounded up); otherwise it
    is the mean training loss of the last STEP_GROUP steps."""

    enabled: bool = True
    patience: int = field(default=100, metadata={"min": 1})
    min_delta: float = field(default=0.0, metadata={"min": 0})
    warmup: int = field(default=0, metadata={"min": 0})


@dataclass(frozen=True)
class GPTQ(Section):
    """GPTQ's settings, named as AMD Quark's GPTQConfig names them (its GPTQParams PercDamp,
    BlockSize and ActOrder translate to them): `perc_damp` of the Hessian's mean
    diagonal added to its diagonal (default 0.01), `block_size` columns per lazy batch update (128:
    changes the arithmetic's order only), and `act_order`: round the columns of largest input power
    first (default off)."""

    perc_damp: float = field(default=0.01, metadata={"above": 0, "max": 1})
    block_size: int = field(default=128, metadata={"min": 1})
    act_order: bool = False


@dataclass(frozen=True)
class AdaQuant(Section):
    """What AdaQuant trains beside the weights (algorithm adaquant only): `update_bias` trains the
    biases too; `learn_scales: weights` learns the scale (and an asymmetric zero point) of each tuned
    INT weight, LSQ-style, at `scale_lr`, `activations` those of the INT activation quantizers inside
    each unit, `all` both (see recon.methods.scales); `learn_equalization` learns a per-channel scale
    between two layers of a unit that only ReLU, max pooling and activation quantizers separate,
    folded into both (see recon.methods.equalization). All off by default, `scale_lr` 1e-3."""

    update_bias: bool = False
    learn_scales: Literal[False, "weights", "activations", "all"] = False
    scale_lr: float = field(default=1e-3, metadata={"above": 0, "max": MAX_LR})
    learn_equalization: bool = False


# The top-level fast_finetune keys that moved into the adaquant section: still read, with a warning.
MOVED_TO_ADAQUANT = ("update_bias", "learn_scales", "scale_lr", "learn_equalization")


@dataclass(frozen=True)
class FastFinetune(Section):
    """AdaRound / AdaQuant / GPTQ reconstruction after quantization (run by the fine-tuning stage).

    `gptq` chooses each unit's weights in one pass, with no learning rate or iterations (settings:
    the `gptq` section); `gptq_init: true` starts AdaRound or AdaQuant from GPTQ's weights.
    Defaults: adaround, 1000 iterations, lr null (each unit takes the default rate of its
    algorithm and weight format family, a table measured per family: DEFAULT_LR; AdaQuant's rate
    decays along a cosine; `auto` picks a factor on that table by a short seeded search on the
    first tuned unit, judged by its held-out loss, and applies it to every unit), batches of 16 samples, all calibration data (data_size null), early stopping on,
    seed 0, cpu, the default op types, output quantizers left out
    (a layer's activation is always in its unit), drop_ratio 0.5 (share of unit inputs taken from
    the quantized rather than the float model), 2 GiB of cached activations in memory and, on an
    accelerator, up to 4 GiB of a unit's training rows copied to it (beyond that, batches are
    gathered on the host and copied each step), layer-wise
    units (`block`: the layers of one exporter scope tuned together, as in BRECQ), deterministic
    algorithms only (`warn`: an op without a deterministic kernel runs anyway, with a warning),
    float32 matrix products in full float32 (`allow_tf32: true` lets CUDA use TF32), and one
    device (`devices: N` runs each unit's optimisation data-parallel over N processes per machine
    on `nodes` machines, each holding a share of the calibration batches, launched by the Lightning
    Fabric `strategy`; an auto_mixed_precision search splits its sensitivity over them too), and
    quantize-dequantize kernels compiled by torch.compile where a compiler is at hand (`compile:
    auto`; `true` requires one, `false` stays eager; the bits are the same either way), and on the
    CPU torch's intra-op threads chosen per unit (`threads: auto`: one thread for a step too small
    to gain from more, else the CPUs of this process that other jobs leave free; a number pins it,
    as OMP_NUM_THREADS does; see recon.threads). A step's gradient is computed in `gradient_pieces`
    pieces added in a fixed order (`auto`: one per process, which costs nothing), so a run on N
    processes takes the steps of a one-process run with `gradient_pieces: N` bit for bit, on any CPU
    (see recon.data.shards).
    `validation_share` (default 0.2) of the calibration batches, drawn with the seed, are held out
    of training: each unit's loss there is measured every few steps, early stopping reads it, and
    the unit ends at its lowest measurement (its weights, or AdaRound's rounding variables, as they
    were then); units are kept or reverted on their loss there, and the tuned model's output error
    against the float model there is checked against the untuned model's, whose weights are written
    back when tuning made it worse (0: every batch trains, early stopping reads the training loss,
    each unit ends at its last step, and the checks read the training rows).
    The `adaquant` section says what AdaQuant trains beside the weights (AdaQuant, above).
    `bias_correction` adds to each layer's bias the mean, per output channel over the training rows,
    of its float output minus its quantized output, before tuning and again after it, each kept only
    where the unit's held-out loss does not rise (see recon.methods.bias; `auto`: on for the correction alone,
    AdaRound and GPTQ, off for AdaQuant, as measured in docs/fine-tuning.md). It lives here, not at
    the top level, because it needs what this stage alone has: the float targets and quantized inputs
    of each unit and the held-out batches that judge it; `iterations: 0` runs the correction alone
    (AMD Quark's `BiasCorrection`, which runs without fast finetune, maps to that)."""

    algorithm: Literal["adaround", "adaquant", "gptq"] = "adaround"
    iterations: int = field(default=1000, metadata={"min": 0})
    lr: float | Literal["auto"] | None = field(default=None, metadata={"above": 0, "max": MAX_LR})
    batch_size: int = field(default=16, metadata={"min": 1})
    data_size: int | None = field(default=None, metadata={"min": 1})
    early_stop: EarlyStop = field(default_factory=EarlyStop)
    seed: int = 0
    validation_share: float = field(default=0.2, metadata={"min": 0, "max": 0.5})
    device: str = field(default="cpu", metadata={"pattern": DEVICE_PATTERN, "pattern_help": DEVICE_HELP})
    op_types: tuple[str, ...] = DEFAULT_OP_TYPES
    include_output_quant: bool = False
    drop_ratio: float = field(default=0.5, metadata={"min": 0, "max": 1})
    cache_budget_bytes: int = field(default=2**31, metadata={"min": 1})
    device_cache_bytes: int = field(default=2**32, metadata={"min": 0})
    unit: Literal["layer", "block"] = "layer"
    deterministic: Literal[True, "warn"] = True
    allow_tf32: bool = False
    devices: int = field(default=1, metadata={"min": 1})
    nodes: int = field(default=1, metadata={"min": 1})
    strategy: str = "ddp"
    gptq: GPTQ = field(default_factory=GPTQ)
    gptq_init: bool = False
    compile: Literal["auto", True, False] = "auto"
    threads: int | Literal["auto"] = field(default="auto", metadata={"min": 1})
    gradient_pieces: int | Literal["auto"] = field(default="auto", metadata={"min": 1})
    bias_correction: Literal["auto", True, False] = "auto"
    adaquant: AdaQuant = field(default_factory=AdaQuant)
    update_bias: InitVar[Any] = None  # MOVED_TO_ADAQUANT: read into the adaquant section, with a warning
    learn_scales: InitVar[Any] = None
    scale_lr: InitVar[Any] = None
    learn_equalization: InitVar[Any] = None

    def __post_init__(self, *moved: Any) -> None:
        """Keys given at the top level that now live in the adaquant section move there (a warning
        names the new key), then every field is checked."""
        given = {key: value for key, value in zip(MOVED_TO_ADAQUANT, moved) if value is not None}
        if given:
            _warn_moved(given)
            section = self.adaquant if isinstance(self.adaquant, AdaQuant) else from_mapping(AdaQuant, self.adaquant, "adaquant")
            object.__setattr__(self, "adaquant", dataclasses.replace(section, **given))
        super().__post_init__()

    @property
    def processes(self) -> int:
        """The processes of the run: one unless it is data-parallel."""
        return self.devices * self.nodes

    @property
    def pieces(self) -> int:
        """The pieces a step's gradient is computed in: one per process unless set."""
        return self.processes if self.gradient_pieces == "auto" else self.gradient_pieces

    def _check(self) -> None:
        if self.iterations == 0 and self.algorithm != "gptq" and self.bias_correction is False:
            raise ConfigError("iterations", "0 runs bias correction alone, which bias_correction: false turns off: "
                              "nothing would change")
        if self.algorithm == "gptq":
            if self.lr is not None:
                raise ConfigError("lr", "algorithm gptq takes no learning rate (it rounds each unit's weights in one pass)")
            if self.gptq_init:
                raise ConfigError("gptq_init", "starts adaround or adaquant from GPTQ's weights; algorithm gptq is GPTQ alone")
        changed = [f.name for f in dataclasses.fields(AdaQuant) if getattr(self.adaquant, f.name) != f.default]
        if changed and self.algorithm != "adaquant":
            raise ConfigError(f"adaquant.{changed[0]}", f"applies to algorithm adaquant only (what AdaQuant trains beside the "
                              f"weights; {self.algorithm} does not train them)")
        if self.include_output_quant and self.unit == "block":
            raise ConfigError("include_output_quant", "applies to unit: layer only (a block ends where one value is live; "
                              "the quantizers reading it belong to the next block)")
        if self.processes > 1 and not self.strategy.startswith("ddp"):
            raise ConfigError("strategy", f"{self.strategy!r} does not shard the calibration data; data-parallel tuning "
                              "takes a Lightning Fabric DDP strategy: ddp (launches this command again per process), "
                              "ddp_spawn, ddp_fork or ddp_notebook")


def _warn_moved(given: dict[str, Any]) -> None:
    """One deprecation warning naming each moved key's new place."""
    moved = ", ".join(f"fast_finetune.{key} is now fast_finetune.adaquant.{key}" for key in given)
    message = f"{moved} (the old key is still read; write the new one)"
    logger.warning("%s", message)
    warnings.warn(message, FutureWarning, stacklevel=4)
