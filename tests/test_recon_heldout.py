"""The held-out guard (issue 33): calibration batches held out of training by seed, units judged on
them, and the tuned model's output error against float on them checked against the untuned model's,
whose weights come back when tuning made it worse."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from lightning.fabric import Fabric
from onnx import TensorProto, helper, numpy_helper

from finetune.config import FastFinetune
from finetune.lift import lift_model
from finetune.notices import Warnings
from finetune.quantize import quantize_model
from finetune.recon import ActivationCache, find_units, finetune_model
from finetune.recon.data.heldout import ModelGuard, held_out_batches, local_chunks
from finetune.recon.data.losses import SUM_SLICE, BestPoint, error_sums, evaluation_interval
from finetune.recon.data.shards import Rows
from finetune.recon.data.streams import cache_inputs
from finetune.recon.units import parameters_of

from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)


def mlp_model(seed: int = 0) -> onnx.ModelProto:
    """x[n, 16] -> MatMul 16x32 -> Relu -> MatMul 32x4: two weight layers."""
    rng = np.random.default_rng(seed)
    weights = [numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name)
               for name, shape in (("w1", (16, 32)), ("w2", (32, 4)))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="first"), helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="second")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def feeds(count: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((8, 16)).astype(np.float32)} for _ in range(count)]


@pytest.mark.parametrize(("batches", "share", "count"), [(10, 0.2, 2), (16, 0.2, 3), (4, 0.2, 0), (5, 0.2, 1), (10, 0.0, 0),
                                                         (10, 0.5, 5)])
def test_the_share_of_batches_held_out_is_rounded_down_and_drawn_by_seed(batches: int, share: float, count: int) -> None:
    held = held_out_batches(batches, share, seed=0)
    assert len(held) == count and held <= set(range(batches))
    assert held == held_out_batches(batches, share, seed=0)  # the same on every process and every rerun


def test_other_seeds_hold_out_other_batches() -> None:
    assert len({held_out_batches(100, 0.2, seed) for seed in range(5)}) == 5


def test_each_process_finds_its_share_of_the_held_out_batches() -> None:
    """Process `rank` of `world` holds batches rank, rank + world, ...: its chunk i is batch rank + world * i."""
    held = frozenset({1, 4, 6})
    assert local_chunks(held, 4, 0, 2) == {2, 3} and local_chunks(held, 4, 1, 2) == {0}
    assert local_chunks(held, 7, 0, 1) == held


def test_rows_of_held_out_batches_do_not_train_and_are_not_counted_as_left_out() -> None:
    """Batches 0..3 of 2, 2, 3, 2 rows (batch 2 shaped otherwise beyond the rows); batch 0 held out:
    the training rows are batch 1's and 3's, and the shape the others must share is batch 1's."""
    table = [(0, 2, 7), (1, 2, 5), (2, 3, 7), (3, 2, 5)]
    rows = Rows.from_table(table, 0, 1, frozenset({0}))
    assert rows.trainable.tolist() == [2, 3, 7, 8] and rows.held_out == 2 and rows.total == 9
    assert rows.total - rows.held_out - len(rows.trainable) == 3  # batch 2's rows, left out for their shape


def test_the_guard_writes_back_the_untuned_weights_when_tuning_made_the_held_out_error_worse() -> None:
    """The guard measures the untuned model on the held-out chunks when made; weights moved away from
    the float model after that make it worse there: the untuned ones come back, with a warning; weights
    left as they were are kept."""
    model = quantize_model(mlp_model(), "XINT8", feeds(4)).model
    module, fabric = lift_model(model), Fabric(accelerator="cpu", devices=1)
    units = find_units(module, ("MatMul",))
    names = [name for unit in units for name in parameters_of(unit)]
    with ActivationCache(2**24) as cache:
        inputs = cache_inputs(feeds(5), ["x"], cache)
        guard = ModelGuard(module, module, inputs, frozenset({1, 3}), names, fabric, 2)
        untuned = {name: module.get_parameter(name).detach().clone() for name in names}
        warnings = Warnings()
        kept = guard.check(warnings)
        assert not kept["restored_untuned_weights"] and kept["output_error_tuned"] == kept["output_error_untuned"] > 0
        assert not warnings
        with torch.no_grad():
            module.get_parameter(names[0]).mul_(1.5)
        restored = guard.check(warnings)
    assert restored["restored_untuned_weights"] and restored["output_error_tuned"] > restored["output_error_untuned"]
    assert all(torch.equal(module.get_parameter(name), value) for name, value in untuned.items())
    assert len(warnings) == 1 and "the untuned weights are written back" in warnings[0]["reason"]


def test_a_run_reports_held_out_losses_per_unit_and_the_models_check() -> None:
    """Ten batches, 0.2 held out: every unit has a loss on the held-out batches before and after,
    kept units lower there, and the report holds the model's check on them."""
    model = quantize_model(mlp_model(), "XINT8", feeds(10)).model
    _, report = finetune_model(model, feeds(10), FastFinetune(algorithm="adaquant", iterations=40, batch_size=8))
    held = report["held_out"]
    assert held["batches"] == 2 and held["output_error_untuned"] > 0
    for unit in report["units"]:
        assert unit["held_out_before"] > 0 and unit["held_out_after"] > 0
        assert unit["held_out_after"] <= unit["held_out_before"] if unit["status"] == "kept" else unit["rejected_loss"] is not None
    assert held["restored_untuned_weights"] == (held["output_error_tuned"] > held["output_error_untuned"])


def test_no_share_trains_on_every_batch_and_checks_nothing_held_out() -> None:
    model = quantize_model(mlp_model(), "XINT8", feeds(10)).model
    _, report = finetune_model(model, feeds(10), FastFinetune(algorithm="adaquant", iterations=10, validation_share=0))
    assert report["held_out"] is None and not report["warnings"]
    assert all(unit["held_out_before"] is None and unit["best_iteration"] is None for unit in report["units"])


def test_the_best_point_puts_back_the_tensors_of_its_lowest_evaluation_bit_for_bit() -> None:
    """Evaluations at steps 10..40 measure 3, 1, 2, 1 and the end (45) 5: the unit ends with the tensor
    as it was at step 20 (a tie keeps the earlier point), bit for bit."""
    tensor = torch.zeros(3)
    losses = iter([3.0, 1.0, 2.0, 1.0, 5.0])
    point = BestPoint(lambda: next(losses), [tensor], every=10)
    seen = {}
    for step in (10, 20, 30, 40):
        tensor.add_(torch.tensor([0.1, 1e-8, -3.0]))
        seen[step] = tensor.clone()
        assert point.due(step) and not point.due(step + 5)
        point.evaluate(step)
    tensor.add_(1.0)
    assert point.settle(45) == 20 and torch.equal(tensor, seen[20])


def test_a_unit_ending_at_its_best_evaluation_keeps_the_tensors_it_ends_with() -> None:
    tensor = torch.ones(2)
    losses = iter([2.0, 1.0])
    point = BestPoint(lambda: next(losses), [tensor], every=10)
    point.evaluate(10)
    tensor.mul_(3)
    assert point.settle(17) == 17 and torch.equal(tensor, torch.full((2,), 3.0))  # the end measured, and best


@pytest.mark.parametrize(("held_rows", "batch_size", "every"), [(16, 8, 10), (64, 16, 20), (512, 16, 100), (0, 16, 10)])
def test_held_out_evaluations_come_every_so_many_steps_by_row_counts(held_rows: int, batch_size: int, every: int) -> None:
    assert evaluation_interval(held_rows, batch_size) == every


class HeldOutRecorder:
    """The (step, loss) of every held-out evaluation of each unit."""

    def __init__(self) -> None:
        self.evaluations: list[list[tuple[int, float]]] = []

    def on_unit_start(self) -> None:
        self.evaluations.append([])

    def on_held_out(self, step: int, loss: float) -> None:
        self.evaluations[-1].append((step, loss))


@pytest.mark.parametrize("algorithm", ["adaquant", "adaround"])
def test_each_unit_ends_at_its_lowest_held_out_evaluation(algorithm: str) -> None:
    """Two of ten batches held out (16 rows): evaluated every 10 steps and at the end; each unit ends
    at the evaluation with the lowest held-out loss (the earliest of equal ones), and its held-out
    loss after tuning is that evaluation's, bit for bit (AdaRound evaluates its roundings hard, as
    the unit ends); the report names the step of kept units. A unit whose best is still
    worse than before tuning is reverted, its best loss the rejected one."""
    model = quantize_model(mlp_model(), "XINT8", feeds(10)).model
    recorder = HeldOutRecorder()
    lr = {"adaquant": 0.002, "adaround": 0.1}[algorithm]  # a unit of each run ends before its last step (measured)
    config = FastFinetune(algorithm=algorithm, iterations=60, batch_size=8, lr=lr, early_stop={"enabled": False})
    _, report = finetune_model(model, feeds(10), config, callbacks=[recorder])
    assert len(recorder.evaluations) == len(report["units"]) == 2
    for unit, evaluations in zip(report["units"], recorder.evaluations):
        assert [step for step, _ in evaluations] == [10, 20, 30, 40, 50, 60]
        best_step, best_loss = min(evaluations, key=lambda evaluation: evaluation[1])
        if unit["status"] == "kept":
            assert unit["best_iteration"] == best_step
            assert unit["held_out_after"] == best_loss
        else:  # back to the untuned weights: no tuned point
            assert unit["best_iteration"] is None and unit["rejected_loss"] == best_loss
    assert any(unit["status"] == "kept" and unit["best_iteration"] < 60 for unit in report["units"])


def test_early_stopping_counts_held_out_evaluations_without_improvement() -> None:
    """patience 20 with an evaluation every 10 steps: a unit is told to stop after 2 evaluations in a
    row that did not improve on its best held-out loss, then runs its 20-step tail."""
    model = quantize_model(mlp_model(), "XINT8", feeds(10)).model
    recorder = HeldOutRecorder()
    config = FastFinetune(algorithm="adaquant", iterations=400, batch_size=8, lr=0.05, early_stop={"patience": 20})
    _, report = finetune_model(model, feeds(10), config, callbacks=[recorder])
    for unit, evaluations in zip(report["units"], recorder.evaluations):
        best, wait, stop = float("inf"), 0, 400
        for step, loss in evaluations:
            best, wait = (loss, 0) if loss < best else (best, wait + 1)
            if wait == 2:
                stop = step
                break
        assert unit["iterations"] == min(400, stop + 20)
    assert any(unit["iterations"] < 400 for unit in report["units"])


def test_error_sums_bound_their_float64_copies_and_add_the_same_squares() -> None:
    """A unit's error sums come a slice at a time (an LM head's logits would need four float64 copies of
    themselves at once): up to one slice bit for bit the one-pass float64 sums, above it the same
    squares added in slices, so within float64 rounding; a half-precision output's difference is taken
    in float32, not rounded to half (2048 - 0.5 is 2048 in half)."""
    generator = torch.Generator().manual_seed(0)
    for size in (SUM_SLICE, 3 * SUM_SLICE + 17):
        output, target = (torch.randn(size, generator=generator) for _ in range(2))
        sums = error_sums(output.view(-1, 1), target.view(1, -1))
        direct = torch.stack([(output - target).double().square().sum(), target.double().square().sum()])
        assert sums[2] == size
        if size == SUM_SLICE:
            assert torch.equal(sums[:2], direct)
        else:
            assert torch.allclose(sums[:2], direct, rtol=size * 2.0**-53, atol=0)  # any order of n positive float64 terms
    half = torch.tensor([2048.0, 0.5], dtype=torch.float16)
    assert error_sums(half[:1], half[1:])[0] == 2047.5**2
