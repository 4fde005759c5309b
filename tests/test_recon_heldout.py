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
from finetune.quantize import quantize_model
from finetune.recon import ActivationCache, find_units, finetune_model
from finetune.recon.heldout import ModelGuard, held_out_batches, local_chunks
from finetune.recon.parallel import Rows
from finetune.recon.report import Warnings
from finetune.recon.stream import cache_inputs
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
    assert all(unit["held_out_before"] is None for unit in report["units"])
