"""Each unit's optimisation, run by Lightning Fabric: device placement, seeding, backward and
CSV (and TensorBoard, when installed) logs, with early stopping on the reconstruction loss, one
progress bar over all units, and a revert of any unit whose loss got worse.

Fabric rather than a Trainer per unit: on the digits units a Trainer step cost 2.8-5.5 ms
against 1.6-1.9 ms for Fabric and 1.5 ms for a bare loop (2 CPU cores; see the issue 5 report)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger, Logger, TensorBoardLogger
from torch import fx
from tqdm.auto import tqdm

from finetune.config import EarlyStop, FastFinetune
from finetune.lift import LiftedModule

from .adaround import REG_WEIGHT, SoftRounding, beta
from .cache import CachedValue
from .qdrop import Batches, dropped_quantization
from .units import Unit

logger = logging.getLogger(__name__)

Roundings = list[tuple[SoftRounding, torch.Tensor]]  # AdaRound's soft rounding of each quantized weight, and the weight
LOG_EVERY = 10  # iterations between logged rows and progress-bar loss updates


@dataclass
class UnitResult:
    """What happened to one unit (a row of the report)."""

    name: str
    op_type: str
    loss_before: float
    loss_after: float
    status: str  # kept | reverted | skipped: <reason>
    iterations: int
    seconds: float
    rejected_loss: float | None = None  # the tuned loss of a reverted unit


class Patience:
    """Early stopping on the reconstruction loss: stop after `patience` iterations without an
    improvement of at least `min_delta`, counting only after `warmup` iterations."""

    def __init__(self, settings: EarlyStop) -> None:
        self.settings = settings
        self.best = math.inf
        self.wait = 0

    def stop(self, step: int, loss: float) -> bool:
        """Whether to stop after this step's loss."""
        if not self.settings.enabled or step < self.settings.warmup:
            return False
        if loss < self.best - self.settings.min_delta:
            self.best, self.wait = loss, 0
            return False
        self.wait += 1
        return self.wait >= self.settings.patience


class Tuner:
    """Tunes units one after another with one Fabric and one progress bar over all of them."""

    def __init__(self, config: FastFinetune, device: torch.device, units: int, log_dir: Path | None) -> None:
        self.config = config
        accelerator = "cpu" if device.type == "cpu" else "cuda"
        devices = 1 if device.type == "cpu" else [device.index or 0]
        self.fabric = Fabric(accelerator=accelerator, devices=devices, precision="32-true", loggers=_loggers(log_dir))
        self.units = units
        self.step = 0
        self.progress = tqdm(total=units * config.iterations, unit="it", dynamic_ncols=True, mininterval=0.5)

    def close(self) -> None:
        """Flush the logs and close the progress bar."""
        for run_logger in self.fabric.loggers:
            run_logger.finalize("success")
        self.progress.close()

    def tune(self, k: int, unit: Unit, module: LiftedModule, train: fx.GraphModule,
             inputs: CachedValue, float_inputs: CachedValue, targets: CachedValue,
             starts: dict[str, torch.Tensor] | None = None) -> UnitResult:
        """Optimise unit k's weights (from `starts`, by parameter name, where given) to reproduce its
        float targets; keep them only if the loss over all cached samples went down."""
        begin = time.perf_counter()
        self.progress.set_description(f"unit {k + 1}/{self.units} {unit.name}")
        names = [name for layer in unit.layers for name in (layer.weight, layer.bias) if name]
        original = {name: module.get_parameter(name).detach().clone() for name in names}
        before, power = evaluate(train, inputs, targets, self.fabric.device)
        skip = self._skip_reason(unit)
        if skip:
            return self._finish(k, unit, before, before, f"skipped: {skip}", 0, begin)
        for name, start in (starts or {}).items():
            if name in original:
                module.get_parameter(name).data.copy_(start)
        iterations = self._optimise(k, unit, module, train, inputs, float_inputs, targets, power)
        after, _ = evaluate(train, inputs, targets, self.fabric.device)
        if after > before:
            for name, value in original.items():
                module.get_parameter(name).data.copy_(value)
            return self._finish(k, unit, before, before, "reverted", iterations, begin, after)
        return self._finish(k, unit, before, after, "kept", iterations, begin)

    def _skip_reason(self, unit: Unit) -> str | None:
        """Why AdaRound cannot tune a unit (no weight quantizer), else None."""
        if self.config.algorithm == "adaround" and all(layer.weight_quantizer is None for layer in unit.layers):
            return "no weight of it is quantized (nothing to round)"
        return None

    def _optimise(self, k: int, unit: Unit, module: LiftedModule, train: fx.GraphModule, inputs: CachedValue,
                  float_inputs: CachedValue, targets: CachedValue, power: float) -> int:
        """The optimisation loop; returns the iterations run. AdaQuant's learning rate decays along
        a cosine, so the weights settle across the quantizer's steps (on the digits transformer at
        MX4 that recovered 93 % of the quantization loss, against 40 % at a constant rate)."""
        config = self.config
        roundings, trainable, frozen = self._trainables(unit, module)
        model = self.fabric.setup_module(train)
        optimizer = self.fabric.setup_optimizers(torch.optim.Adam(trainable, lr=config.lr))
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, config.iterations) if not roundings else None
        batches = Batches(inputs, float_inputs, targets, config, k)
        patience = Patience(config.early_stop)
        try:
            with contextlib.ExitStack() as installed:
                for rounding, _ in roundings:
                    installed.enter_context(rounding)
                if unit.op_type == "block":
                    installed.enter_context(dropped_quantization(train, config, k))
                for step in range(config.iterations):
                    loss = self._step(model, optimizer, batches.next(self.fabric.device), power, roundings, step)
                    if schedule is not None:
                        schedule.step()
                    self._record(k, step, loss)
                    if patience.stop(step, loss):
                        logger.info("unit %d/%d %s: early stop after %d iterations", k + 1, self.units, unit.name, step + 1)
                        break
            for rounding, weight in roundings:
                weight.data.copy_(rounding.hardened(weight))
        finally:
            for parameter in frozen:
                parameter.requires_grad_(True)
        self.progress.update(config.iterations - step - 1)
        return step + 1

    def _trainables(self, unit: Unit, module: LiftedModule) -> tuple[Roundings, list[torch.Tensor], list[torch.Tensor]]:
        """(AdaRound's soft roundings with their weights, the tensors to train, the unit's parameters frozen meanwhile):
        AdaRound trains V of each quantized weight only; AdaQuant the weights, and the biases with
        update_bias."""
        weights = [module.get_parameter(layer.weight) for layer in unit.layers]
        biases = [module.get_parameter(layer.bias) for layer in unit.layers if layer.bias]
        roundings = []
        if self.config.algorithm == "adaround":
            roundings = [(SoftRounding(module.get_submodule(layer.weight_quantizer), weight).to(weight.device), weight)
                         for layer, weight in zip(unit.layers, weights) if layer.weight_quantizer]
            trainable = [rounding.v for rounding, _ in roundings]
        else:
            trainable = weights + (biases if self.config.update_bias else [])
        frozen = [p for p in weights + biases if all(p is not t for t in trainable)]
        for parameter in frozen:
            parameter.requires_grad_(False)
        return roundings, trainable, frozen

    def _step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
              power: float, roundings: Roundings, step: int) -> float:
        """One Adam step on MSE relative to the target power (plus AdaRound's regulariser, averaged
        over every rounded weight element of the unit)."""
        x, target = batch
        optimizer.zero_grad(set_to_none=True)
        mse = F.mse_loss(model(x)[0], target)
        objective = mse / power
        exponent = beta(step, self.config.iterations) if roundings else None
        if exponent is not None:
            elements = sum(r.v.numel() for r, _ in roundings)
            objective = objective + REG_WEIGHT * sum(r.regularizer(exponent) * (r.v.numel() / elements) for r, _ in roundings)
        self.fabric.backward(objective, model=model)
        optimizer.step()
        return mse.detach().item()

    def _record(self, k: int, step: int, loss: float) -> None:
        """Log every LOG_EVERY steps and advance the progress bar."""
        self.step += 1
        self.progress.update(1)
        if step % LOG_EVERY == 0:
            self.fabric.log_dict({"unit": k, "loss": loss}, step=self.step)
            self.progress.set_postfix(loss=f"{loss:.4g}", refresh=False)

    def _finish(self, k: int, unit: Unit, before: float, after: float, status: str, iterations: int, begin: float,
                tried: float | None = None) -> UnitResult:
        """The unit's result, logged (and its losses in the CSV log)."""
        seconds = time.perf_counter() - begin
        self.fabric.log_dict({"unit": k, "loss_before": before, "loss_after": after}, step=self.step)
        worse = f" (tuned {tried:.4g} was worse)" if tried is not None else ""
        logger.info("unit %d/%d %s: loss %.4g -> %.4g, %s%s, %d iterations, %.2f s",
                    k + 1, self.units, unit.name, before, after, status, worse, iterations, seconds)
        if not iterations:
            self.progress.update(self.config.iterations)
        return UnitResult(unit.name, unit.op_type, before, after, status, iterations, seconds, tried)


def evaluate(train: fx.GraphModule, inputs: CachedValue, targets: CachedValue, device: torch.device) -> tuple[float, float]:
    """(MSE of the unit's output against its float target, mean square of the target) over every
    cached sample, computed in float64 sums so the result does not depend on chunking."""
    squared_error = power = 0.0
    count = 0
    with torch.no_grad():
        for chunk in range(len(inputs.chunks)):
            output = train(inputs.tensor(chunk, device))[0]
            target = targets.tensor(chunk, device)
            squared_error += float((output - target).double().square().sum())
            power += float(target.double().square().sum())
            count += target.numel()
    return squared_error / count, max(power / count, 1e-30)


def _loggers(log_dir: Path | None) -> list[Logger]:
    """CSV logs in `log_dir` (and TensorBoard's when it is installed); none without a directory."""
    if log_dir is None:
        return []
    loggers: list[Logger] = [CSVLogger(log_dir, name="", version="")]
    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        loggers.append(TensorBoardLogger(log_dir, name="tensorboard", version=""))
    return loggers

