"""Callbacks of the fine-tuning run: a user's callback passed to finetune_model hears every moment in
order and can stop a unit; the built-in early stopping ends each unit where its rule says; the
checkpoint lets a stopped run resume to the bytes of an uninterrupted one, and only its own run."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch

from finetune.config import FastFinetune
from finetune.lift import LiftedModule
from finetune.recon import Unit, finetune_model

from .recon_helpers import one_thread, quantized  # noqa: F401  (fixtures)
from .test_recon_contracts import stops_on_training_losses


class Recorder:
    """A user's callback: the moments it hears, each unit's step losses and the weights the model
    holds when a unit ends; it stops unit `stop_unit` after `stop_after` steps, at once or, with a
    `tail`, after that many more steps that finish its schedule."""

    def __init__(self, stop_unit: int | None = None, stop_after: int = 0, tail: int | None = None) -> None:
        self.stop_unit, self.stop_after, self.tail = stop_unit, stop_after, tail
        self.moments: list[tuple[Any, ...]] = []
        self.losses: list[list[float]] = []
        self.kept_weights: list[tuple[LiftedModule, str, torch.Tensor]] = []

    def on_run_start(self, units: list[Unit]) -> None:
        self.moments.append(("run_start", [u.name for u in units]))

    def on_unit_start(self, index: int, unit: Unit) -> None:
        self.moments.append(("unit_start", index, unit.name))
        self.losses.append([])

    def on_step_end(self, tuner: Any, index: int, step: int, loss: float) -> None:
        self.losses[index].append(loss)
        if index == self.stop_unit and step + 1 == self.stop_after:
            if self.tail is None:
                tuner.should_stop = True
            else:
                tuner.finish_schedule(self.tail)

    def on_unit_end(self, index: int, unit: Unit, result: Any, module: LiftedModule) -> None:
        self.moments.append(("unit_end", index, unit.name, dataclasses.asdict(result)))
        weight = unit.layers[0].weight
        self.kept_weights.append((module, weight, module.get_parameter(weight).detach().clone()))

    def on_run_end(self, results: list[Any]) -> None:
        self.moments.append(("run_end", len(results)))


def test_a_user_callback_hears_every_unit_in_order_and_can_stop_one(quantized: tuple) -> None:
    """Run start, then start and end of each unit with its report row, then run end; the model the
    unit end sees already holds the weights the run keeps; setting should_stop ends that unit."""
    model, feeds = quantized
    recorder = Recorder(stop_unit=1, stop_after=3)
    _, report = finetune_model(model, feeds, FastFinetune(algorithm="adaquant", iterations=12), callbacks=[recorder])
    names = [u["name"] for u in report["units"]]
    assert recorder.moments[0] == ("run_start", names) and recorder.moments[-1] == ("run_end", len(names))
    assert recorder.moments[1:-1] == [moment for k, (name, row) in enumerate(zip(names, report["units"]))
                                      for moment in [("unit_start", k, name), ("unit_end", k, name, row)]]
    assert [u["iterations"] for u in report["units"]] == [12, 3] + [12] * (len(names) - 2)
    assert [len(losses) for losses in recorder.losses] == [u["iterations"] for u in report["units"]]
    assert all(torch.equal(module.get_parameter(weight).cpu(), kept.cpu()) for module, weight, kept in recorder.kept_weights)


@pytest.mark.parametrize(("algorithm", "tuned"), [("adaquant", 8), ("adaround", 15)])
def test_finishing_the_schedule_runs_a_tail_of_steps_then_ends_the_unit(quantized: tuple, algorithm: str, tuned: int) -> None:
    """A unit told after step 3 to finish its schedule in 5 steps runs 8; AdaRound, still warming up
    then, anneals over 4 x 3 steps instead, so 15; the budget's end comes first when it is nearer (a
    unit stopped at 3 of 6 runs 6)."""
    model, feeds = quantized
    for iterations, expected in [(40, tuned), (6, 6)]:
        recorder = Recorder(stop_unit=1, stop_after=3, tail=5)
        config = FastFinetune(algorithm=algorithm, iterations=iterations, early_stop={"enabled": False})
        _, report = finetune_model(model, feeds, config, callbacks=[recorder])
        assert [u["iterations"] for u in report["units"]][:3] == [iterations, expected, iterations]
        assert len(recorder.losses[1]) == expected


def stop_step_by_rule(losses: list[float], patience: int, warmup: int) -> int:
    """The step after which early stopping (the built-in callback itself, fed these step losses: its
    rule is tested on literal losses in test_recon_contracts) asks a unit to finish; len(losses) if never."""
    stops = stops_on_training_losses(losses, patience=patience, min_delta=0.0, warmup=warmup)
    return stops[0][0] + 1 if stops else len(losses)


def stop_by_rule(losses: list[float], patience: int, warmup: int, iterations: int) -> int:
    """The iterations a unit runs: up to its stop, then `patience` more that finish the schedule, within the budget."""
    return min(iterations, stop_step_by_rule(losses, patience, warmup) + patience)


def test_early_stopping_ends_each_unit_where_its_rule_says(quantized: tuple) -> None:
    model, feeds = quantized
    recorder = Recorder()
    config = FastFinetune(algorithm="adaquant", iterations=300, early_stop={"enabled": True, "patience": 5, "warmup": 10})
    _, report = finetune_model(model, feeds, config, callbacks=[recorder])
    iterations = [u["iterations"] for u in report["units"]]
    assert iterations == [len(losses) for losses in recorder.losses]
    assert iterations == [stop_by_rule(losses, patience=5, warmup=10, iterations=300) for losses in recorder.losses]
    assert all(20 <= n < 300 for n in iterations)



def test_losses_read_in_groups_reach_the_callbacks_step_by_step(quantized: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a GPU, where the host reads the losses once per group of steps: the callbacks hear the
    same losses as when every step is read, and an early stop takes effect at the end of the group
    in which the rule stops (the run is the per-step run up to there), its tail following."""
    model, feeds = quantized
    config = FastFinetune(algorithm="adaquant", iterations=300, early_stop={"enabled": True, "patience": 5, "warmup": 10})
    every_step = Recorder()
    finetune_model(model, feeds, config, callbacks=[every_step])
    monkeypatch.setattr("finetune.recon.optimisation.steps_per_read", lambda device: 7)
    grouped = Recorder()
    _, report = finetune_model(model, feeds, config, callbacks=[grouped])
    for losses, row in zip(grouped.losses, report["units"]):
        stop = stop_step_by_rule(losses, patience=5, warmup=10)
        assert row["iterations"] == len(losses) == min(300, -(-stop // 7) * 7 + 5)
    first_stop = stop_step_by_rule(every_step.losses[0], patience=5, warmup=10)
    assert grouped.losses[0][:first_stop] == every_step.losses[0][:first_stop]  # later units start from other weights

# --- the checkpoint and resuming --------------------------------------------------------------------


class Stopped(Exception):
    """A run stopped part-way (as a kill or Ctrl-C would stop it)."""


class StopAfter:
    """A user's callback that stops the run when unit `index` ends (after the checkpoint is saved)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def on_unit_end(self, index: int) -> None:
        if index == self.index:
            raise Stopped


class UnitStarts:
    """A user's callback that notes the index of each unit it hears start."""

    def __init__(self) -> None:
        self.indices: list[int] = []

    def on_unit_start(self, index: int) -> None:
        self.indices.append(index)


def stopped_run(model: onnx.ModelProto, feeds: list, config: FastFinetune, folder: Path, after: int = 1) -> Path:
    """Run until unit `after` ends, stop there, and return the checkpoint it leaves behind."""
    with pytest.raises(Stopped):
        finetune_model(model, feeds, config, output_dir=folder, name="run", callbacks=[StopAfter(after)])
    return folder / "run.ckpt"


@pytest.mark.parametrize("lr", [None, "auto"])
def test_a_stopped_run_resumes_from_its_checkpoint_to_the_same_bytes(quantized: tuple, tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture, lr: str | None) -> None:
    """Stopped after two units, then resumed: the finished units are restored, not tuned again (the
    log and the report count them; callbacks hear only the others), and the model, the report rows
    and the metric log are those of an uninterrupted run. The checkpoint follows the umask and is
    gone once the run completes. With lr: auto the resumed run keeps the factor the first run chose
    on its first unit rather than searching again on the third."""
    model, feeds = quantized
    config = FastFinetune(algorithm="adaquant", iterations=12, seed=5, lr=lr)
    whole, whole_report = finetune_model(model, feeds, config, output_dir=tmp_path / "whole", name="run")
    checkpoint = stopped_run(model, feeds, config, tmp_path / "cut")
    umask = os.umask(0)
    os.umask(umask)
    assert sorted(p.name for p in checkpoint.iterdir()) == ["progress.pt", "unit-00000.pt", "unit-00001.pt"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask for p in checkpoint.iterdir())
    starts = UnitStarts()
    with caplog.at_level(logging.INFO):
        resumed, report = finetune_model(model, feeds, config, output_dir=tmp_path / "cut", name="run", callbacks=[starts],
                                         resume=True)
    assert resumed.SerializeToString() == whole.SerializeToString()
    units = len(report["units"])
    assert report["resumed_units"] == 2 and f"resuming from {checkpoint}: 2 of {units} units finished earlier" in caplog.text
    assert starts.indices == list(range(2, units))
    assert [{**u, "seconds": 0} for u in report["units"]] == [{**u, "seconds": 0} for u in whole_report["units"]]
    assert report["lr_search"] == whole_report["lr_search"] and (lr is None) == (report["lr_search"] is None)
    logs = [folder / "run.logs" / "metrics.csv" for folder in (tmp_path / "whole", tmp_path / "cut")]
    assert logs[0].read_text() == logs[1].read_text()
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["run.json", "run.logs", "run.png"]


def test_a_fresh_run_replaces_an_earlier_checkpoint_at_its_first_unit(quantized: tuple, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Without resume, an earlier run's checkpoint (two units) is replaced, with a warning, when the new
    run's first unit ends: none of the earlier units' files are left to be read as this run's."""
    model, feeds = quantized
    checkpoint = stopped_run(model, feeds, FastFinetune(algorithm="adaquant", iterations=4, seed=5), tmp_path)
    with caplog.at_level(logging.WARNING):
        assert stopped_run(model, feeds, FastFinetune(algorithm="adaquant", iterations=4, seed=6), tmp_path, after=0) == checkpoint
    assert "holds an earlier run's checkpoint: this run starts afresh and replaces it" in caplog.text
    assert sorted(p.name for p in checkpoint.iterdir()) == ["progress.pt", "unit-00000.pt"]
    progress = torch.load(checkpoint / "progress.pt", weights_only=True)
    assert len(progress["results"]) == 1 and progress["fingerprint"]["config"]["seed"] == 6

def test_a_checkpoint_of_another_run_is_refused(quantized: tuple, tmp_path: Path) -> None:
    """Another seed, other data, another model, a file that is no checkpoint, or no output folder to
    keep a checkpoint in: each refused with what differs and what to do."""
    model, feeds = quantized
    config = FastFinetune(algorithm="adaquant", iterations=4, seed=5)
    checkpoint = stopped_run(model, feeds, config, tmp_path)

    def resume(config: FastFinetune = config, feeds: list = feeds, model: onnx.ModelProto = model) -> None:
        finetune_model(model, feeds, config, output_dir=tmp_path, name="run", resume=True)

    with pytest.raises(ValueError, match=rf"^the checkpoint {checkpoint} is another run's \(config.seed 5 there, 6 now\): "
                                         "resume with that run's model, data and settings, or run without --resume"):
        resume(FastFinetune(algorithm="adaquant", iterations=4, seed=6))
    with pytest.raises(ValueError, match=r"another run's \(data '\w+' there, '\w+' now; samples 12 there, 8 now\)"):
        resume(feeds=feeds[:2])
    other = onnx.ModelProto()
    other.CopyFrom(model)
    other.doc_string = "another model"
    with pytest.raises(ValueError, match=r"another run's \(model '\w+' there, '\w+' now\)"):
        resume(model=other)
    with pytest.raises(ValueError, match="resume needs output_dir"):
        finetune_model(model, feeds, config, resume=True)
    (checkpoint / "unit-00000.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=rf"^cannot read the checkpoint {checkpoint} \(UnpicklingError in unit-00000.pt\): "
                                         "it is damaged"):
        resume()
    (checkpoint / "progress.pt").unlink()
    with pytest.raises(ValueError, match=r"\(FileNotFoundError in progress.pt\): it is damaged or not a fine-tuning checkpoint"):
        resume()
    shutil.rmtree(checkpoint)
    checkpoint.write_bytes(b"an earlier version's checkpoint")
    with pytest.raises(ValueError, match=rf"^{checkpoint} is not a fine-tuning checkpoint \(a checkpoint is a folder\)"):
        resume()


def test_a_run_whose_model_cannot_be_written_keeps_its_checkpoint_and_writes_no_report(
        quantized: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model is written before the report and the checkpoint is removed only after both: a run
    that fails (or is killed) while writing its model leaves no report without a model, and resumes."""
    model, feeds = quantized
    config = FastFinetune(algorithm="adaquant", iterations=4, seed=5)
    output = tmp_path / "tuned.onnx"

    def full_disk(*_: Any, **__: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("finetune.recon.api.save_model_atomic", full_disk)
    with pytest.raises(OSError, match="No space left"):
        finetune_model(model, feeds, config, output_dir=tmp_path, name="run", model_path=output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.ckpt", "run.logs"]
    monkeypatch.undo()
    tuned, report = finetune_model(model, feeds, config, output_dir=tmp_path, name="run", model_path=output, resume=True)
    assert report["resumed_units"] == len(report["units"])
    assert output.read_bytes() == tuned.SerializeToString()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "run.logs", "run.png", "tuned.onnx"]
