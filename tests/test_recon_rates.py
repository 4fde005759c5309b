"""Learning rates (issue 33): the default rate of each unit comes from one table per algorithm and
weight format family, and `lr: auto` scales it by a factor a seeded search on the first unit picks."""

from __future__ import annotations

import pytest

from finetune.cli import build_parser
from finetune.config import DEFAULT_LR, ConfigError, FastFinetune, load_config
from finetune.lift import lift_model
from finetune.quantize import quantize_model
from finetune.recon import find_units, finetune_model
from finetune.recon.methods import ALGORITHMS
from finetune.recon.rates import AUTO_FACTORS, unit_lr

from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)
from .test_recon_heldout import feeds, mlp_model

INT8 = {"format": "int", "dtype": "int8", "symmetric": True, "granularity": "tensor", "calibration": "minmax"}


@pytest.mark.parametrize(("config", "algorithm", "family"), [
    ("XINT8", "adaround", "int"), ("XINT8", "adaquant", "int"), ("BF16", "adaquant", "float"), ("MX4", "adaquant", "bfp"),
    ("MXFP4", "adaquant", "mx"), ({"activation": INT8, "weight": None}, "adaquant", "float"),  # unquantized weights: float's
])
def test_each_unit_takes_the_default_rate_of_its_weight_format(config: str | dict, algorithm: str, family: str) -> None:
    module = lift_model(quantize_model(mlp_model(), load_config(config), feeds(4)).model)
    units = find_units(module, ("MatMul",))
    method = ALGORITHMS[algorithm](FastFinetune(algorithm=algorithm))
    assert [unit_lr(None, method, unit, module) for unit in units] == [DEFAULT_LR[algorithm][family]] * 2
    assert unit_lr(None, method, units[0], module, factor=0.3) == 0.3 * DEFAULT_LR[algorithm][family]
    assert unit_lr(0.5, method, units[0], module, factor=0.3) == 0.5  # a number is taken as it is


def test_lr_auto_loads_and_other_words_are_refused() -> None:
    assert load_config({"fast_finetune": {"algorithm": "adaquant", "lr": "auto"}}).fast_finetune.lr == "auto"
    with pytest.raises(ConfigError, match="fast_finetune.lr"):
        load_config({"fast_finetune": {"lr": "fast"}})


def test_lr_auto_picks_the_factor_of_the_lowest_held_out_loss_on_the_first_unit_and_repeats_itself() -> None:
    """Each factor tunes the first unit for the run's 30 iterations (fewer than AUTO_STEPS) from the
    same start; the lowest held-out loss picks the factor every unit's default rate is multiplied by,
    and a second run searches, chooses and tunes to the same bytes."""
    model = quantize_model(mlp_model(), "MX4", feeds(10)).model
    config = FastFinetune(algorithm="adaquant", iterations=30, batch_size=8, lr="auto")
    runs = [finetune_model(model, feeds(10), config) for _ in range(2)]
    (tuned, report), (again, second) = runs
    search = report["lr_search"]
    assert search == second["lr_search"] and tuned.SerializeToString() == again.SerializeToString()
    assert search["unit"] == report["units"][0]["name"] and search["steps"] == 30
    assert list(search["losses"]) == [f"{factor:g}" for factor in AUTO_FACTORS]
    assert search["factor"] == float(min(search["losses"], key=search["losses"].get))
    assert [unit["lr"] for unit in report["units"]] == [search["factor"] * DEFAULT_LR["adaquant"]["bfp"]] * 2


def test_a_run_at_the_default_rate_searches_nothing() -> None:
    model = quantize_model(mlp_model(), "MX4", feeds(10)).model
    _, report = finetune_model(model, feeds(10), FastFinetune(algorithm="adaquant", iterations=10, batch_size=8))
    assert report["lr_search"] is None and [unit["lr"] for unit in report["units"]] == [DEFAULT_LR["adaquant"]["bfp"]] * 2


def test_the_command_line_takes_a_rate_or_auto() -> None:
    parser, command = build_parser(), ["tune", "q.onnx", "--data", "calib", "-o", "t.onnx", "--lr"]
    assert parser.parse_args([*command, "auto"]).lr == "auto"
    assert parser.parse_args([*command, "3e-4"]).lr == 3e-4
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "fast"])
