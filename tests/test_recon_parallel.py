"""Data-parallel fine-tuning (fast_finetune.devices): each process holds a share of the calibration
batches, yet draws the rows and QDrop bytes the one-process run draws and adds every sum from the
same pieces in the same order (a step's gradient in fast_finetune.gradient_pieces pieces, one per
process by default, a loss per calibration batch); two gloo processes at the defaults tune to the
bytes of one process with gradient_pieces 2 (weights, losses, statuses, stop steps)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from finetune.config import ConfigError, EarlyStop, FastFinetune, load_config
from finetune.quantize import quantize_model
from finetune.recon import ActivationCache, finetune_model
from finetune.recon.data.batches import Batches, Draw
from finetune.recon.data.rows import UnitInputs
from finetune.recon.data.shards import Rows, chunk_table
from finetune.recon.data.streams import cache_inputs
from finetune.recon.methods.qdrop import PieceMasks
from finetune.zoo import digits_split, export_onnx

from .lift_helpers import ENCODER_INPUT, randomized, transformer_encoder
from .recon_helpers import export_digits_cnn, one_thread  # noqa: F401  (one_thread: autouse fixture)

INT8 = {"format": "int", "dtype": "int8", "symmetric": True, "granularity": "tensor", "calibration": "minmax"}
W4A8 = {"activation": INT8, "weight": {**INT8, "dtype": "int4"}}


def test_the_processes_draw_the_one_process_batch_and_bytes_between_them() -> None:
    """Every process draws the same global batch and keeps the rows it holds; together they hold
    exactly the one-process batch, with the same QDrop mixing, step after step (batches of 3 unequal
    sizes over 2 processes, so shares differ in size and some steps give a process no row), cut
    into the same pieces (calibration batch c in piece c mod 2, numbered alike), which a step adds in order."""
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((n, 4)).astype(np.float32) for n in (5, 3, 4)]
    config = Draw(batch_size=3, seed=7, drop_ratio=0.5, pieces=2)
    one = _process_batches(batches, config, 0, 1)
    shares = [_process_batches(batches, config, rank, 2) for rank in range(2)]
    empty_steps = 0
    for _ in range(40):
        (x,), numbers = one.next()
        parts = [share.next() for share in shares]
        empty_steps += any(len(part[0][0]) == 0 for part in parts)
        together, their_numbers = torch.cat([p[0][0] for p in parts]), torch.cat([p[1] for p in parts])
        assert torch.equal(together[torch.argsort(their_numbers[:, 0])], x[torch.argsort(numbers[:, 0])])
        assert 0 < (x < 50).sum() < x.numel()  # mixed: some quantized, some float values
        pieces = {piece.slot: x[piece.rows] for piece in one.pieces}
        shared = {piece.slot: part[0][0][piece.rows] for share, part in zip(shares, parts) for piece in share.pieces if piece.slot >= 0}
        assert pieces.keys() == shared.keys() <= set(range(2)) and one.slots == shares[0].slots == shares[1].slots == 2
        assert all(torch.equal(shared[slot], piece) for slot, piece in pieces.items())
    assert empty_steps > 0


def test_a_piece_split_over_processes_is_a_slot_of_its_own_and_warned() -> None:
    """Where the processes do not divide the pieces (3 pieces, 2 processes), a piece's rows lie in both,
    so each process's part is a slot of its own (piece * world + rank): every row of the batch is in
    exactly one slot, and the run says its steps are not one process's."""
    rng = np.random.default_rng(2)
    batches = [rng.standard_normal((n, 4)).astype(np.float32) for n in (2, 3, 2, 4, 3)]
    shares = [_process_batches(batches, Draw(batch_size=8, seed=3, drop_ratio=1, pieces=3), rank, 2) for rank in range(2)]
    for _ in range(10):
        parts = [share.next() for share in shares]
        slots = [piece.slot for share in shares for piece in share.pieces]
        assert all(share.slots == 6 for share in shares) and len(slots) == len(set(slots))
        assert all(piece.slot == piece.share * 2 + rank for rank, share in enumerate(shares) for piece in share.pieces)
        assert sum(piece.rows.stop - piece.rows.start for share in shares for piece in share.pieces) == 8
        assert [len(part[1]) for part in parts] == [sum(p.rows.stop - p.rows.start for p in share.pieces) for share in shares]


def _process_batches(batches: list[np.ndarray], config: Draw, rank: int, world: int) -> Batches:
    """Process `rank`'s training batches over its share: the batches as quantized inputs, the
    batches + 100 as float inputs and, as targets, each row's global number (to line rows up)."""
    offsets = np.cumsum([0, *(len(b) for b in batches)])
    numbers = [np.tile(np.arange(offsets[i], offsets[i + 1], dtype=np.float32)[:, None], (1, 4)) for i in range(len(batches))]
    inputs, floats, targets = (cache_inputs([{"x": b} for b in values], ["x"], ActivationCache(2**30), rank, world)[0]
                               for values in (batches, [b + 100 for b in batches], numbers))
    tables = [chunk_table(*(cache_inputs([{"x": b} for b in values], ["x"], ActivationCache(2**30), r, world)[0]
                            for values in (batches, numbers)), r, world) for r in range(world)]
    return Batches(UnitInputs((inputs,), (True,)), floats, targets, config, 0, Rows.from_table(sorted(sum(tables, [])), rank, world))


def test_a_piece_draws_its_in_block_qdrop_bytes_whatever_else_its_step_holds() -> None:
    """Inside a block each piece of a step draws its QDrop bytes from a generator seeded by the step
    and the piece's number: the same in one process, where other pieces come before it, as in
    whichever of two processes holds it, call after call."""
    rng = np.random.default_rng(1)
    batches = [rng.standard_normal((n, 4)).astype(np.float32) for n in (5, 3, 4)]
    config = Draw(batch_size=6, seed=7, drop_ratio=0.5, pieces=2)
    runs = [[_process_batches(batches, config, 0, 1)], [_process_batches(batches, config, rank, 2) for rank in range(2)]]
    masks = [[PieceMasks(128, torch.device("cpu"), [7, 0, 1], share) for share in run] for run in runs]
    for _ in range(10):
        drawn = []
        for run, run_masks in zip(runs, masks):
            pieces = {}
            for share, share_masks in zip(run, run_masks):
                share.next()
                for piece in share.pieces:
                    share.piece = piece
                    pieces[piece.share] = [share_masks.draw((piece.rows.stop - piece.rows.start, 16, 8)) for _ in range(2)]
            drawn.append(pieces)
        assert drawn[0].keys() == drawn[1].keys() and len(drawn[0]) > 1
        assert all(torch.equal(a, b) for batch in drawn[0] for a, b in zip(drawn[0][batch], drawn[1][batch]))
        assert all(not torch.equal(*drawn[0][batch]) for batch in drawn[0])  # a fresh draw per call


def test_fewer_batches_than_processes_is_refused() -> None:
    with ActivationCache(2**30) as cache, pytest.raises(ValueError, match="2 batch.*fewer than the 3 processes"):
        cache_inputs([{"x": np.zeros((4, 2), np.float32)}] * 2, ["x"], cache, 2, 3)


def test_devices_settings_are_checked_when_the_config_loads() -> None:
    with pytest.raises(ConfigError, match="strategy"):
        FastFinetune(devices=2, strategy="fsdp")
    search = {"preset": "MX9", "auto_mixed_precision": {"ladder": ["MX6", "MX9"], "target": 0.9}}
    with pytest.raises(ConfigError, match="fast_finetune.strategy: 'ddp' runs the whole command again"):
        load_config({**search, "fast_finetune": {"devices": 2}})
    with pytest.raises(ConfigError, match="fast_finetune.nodes"):
        load_config({**search, "fast_finetune": {"devices": 2, "nodes": 2, "strategy": "ddp_spawn"}})
    assert load_config({**search, "fast_finetune": {"devices": 2, "strategy": "ddp_spawn"}}).fast_finetune.processes == 2


def test_resume_is_refused_with_several_devices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="resume is not available with devices > 1"):
        finetune_model(tmp_path / "missing.onnx", [], FastFinetune(devices=2, strategy="ddp_spawn"), output_dir=tmp_path,
                       resume=True)


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The digits CNN at INT4 weights / INT8 activations, and 150 calibration samples in 5 batches
    (3 for the first process, 2 for the second)."""
    x_train, _, x_test, _ = digits_split()
    path = export_digits_cnn(tmp_path_factory.mktemp("digits") / "digits.onnx", x_test[:1])
    calibration = [{"x": x_train[i: i + 30].numpy()} for i in range(0, 150, 30)]
    return {"model": quantize_model(path, W4A8, calibration).model, "calibration": calibration, "x": x_test.numpy()}


def _weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


SETTINGS = {"iterations": 30, "seed": 1, "batch_size": 16}


@pytest.fixture(scope="module")
def spawned(digits: dict) -> dict[str, tuple[onnx.ModelProto, dict]]:
    """Per algorithm, the model and report of two spawned CPU processes (gloo)."""
    return {algorithm: finetune_model(digits["model"], digits["calibration"],
                                      FastFinetune(algorithm=algorithm, **SETTINGS, devices=2, strategy="ddp_spawn"))
            for algorithm in ("adaquant", "adaround")}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["adaquant", "adaround"])
def test_two_gloo_processes_tune_like_one(digits: dict, spawned: dict, algorithm: str) -> None:
    """Two CPU processes (gloo) at the defaults, with the global batch of one: the bytes of one process
    with gradient_pieces 2 (weights, losses, keep/revert decisions, the held-out guard)."""
    one, one_report = finetune_model(digits["model"], digits["calibration"], FastFinetune(algorithm=algorithm, **SETTINGS,
                                                                                          gradient_pieces=2))
    two, two_report = spawned[algorithm]
    assert two_report["processes"] == 2 and one_report["processes"] == 1
    assert [u["status"] for u in two_report["units"]] == [u["status"] for u in one_report["units"]]
    assert sum(u["status"] == "kept" for u in one_report["units"]) >= 3
    assert one_report["held_out"]["batches"] == two_report["held_out"]["batches"] > 0  # each process holds out its share
    _assert_same_tuning(one, one_report, two, two_report)


@pytest.mark.slow
def test_the_command_line_runs_two_processes_to_the_bytes_of_spawned_ones(digits: dict, spawned: dict,
                                                                          tmp_path: Path) -> None:
    """`finetune tune --devices 2` (strategy ddp: Fabric runs the command again as the second
    process) writes one model and prints one report, byte-identical to another two-process run's."""
    quantized, data = tmp_path / "q.onnx", tmp_path / "data"
    onnx.save(digits["model"], quantized)
    data.mkdir()
    for i, batch in enumerate(digits["calibration"]):
        np.save(data / f"{i:02d}.npy", batch["x"])
    out = tmp_path / "tuned.onnx"
    command = [sys.executable, "-m", "finetune.cli", "tune", str(quantized), "--data", str(data), "--finetune", "adaquant",
               "--iterations", "30", "--seed", "1", "--batch-size", "16", "--devices", "2", "-o", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("fast finetune (adaquant, cpu x 2 processes") == 1  # one report, by the first process
    assert onnx.load(out).SerializeToString() == spawned["adaquant"][0].SerializeToString()


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A two-layer transformer encoder with random weights at XINT8, and 32 calibration samples in 4 batches."""
    path = export_onnx(randomized(transformer_encoder()), torch.randn(*ENCODER_INPUT), tmp_path_factory.mktemp("enc") / "e.onnx")
    calibration = [{"x": np.random.default_rng(i).standard_normal((8, *ENCODER_INPUT[1:]), np.float32)} for i in range(4)]
    return {"model": quantize_model(path, "XINT8", calibration).model, "calibration": calibration}


@pytest.mark.parametrize("share", [0.2, 0.25])
def test_two_gloo_processes_tune_blocks_like_one_with_early_stopping(encoder: dict, share: float) -> None:
    """Over blocks, with QDrop inside them and early stopping on (patience shortened to 10 so a unit
    stops within 80 steps), two processes at the defaults draw the QDrop bytes of one process with
    gradient_pieces 2 in every piece, whatever the block's layout, and add its pieces of every sum,
    so they stop at the same steps, keep alike and tune to its bytes. With a share of 0.2 none of the
    4 batches is held out and the training loss decides; with 0.25 one is, and its loss, measured
    every 10 steps (QDrop drawing nothing then) and summed over the processes, decides, and each
    unit ends at its best measurement in both runs."""
    settings = {"algorithm": "adaquant", "unit": "block", "iterations": 80, "early_stop": EarlyStop(patience=10),
                "validation_share": share}
    one, one_report = finetune_model(encoder["model"], encoder["calibration"], FastFinetune(**settings, gradient_pieces=2))
    two, two_report = finetune_model(encoder["model"], encoder["calibration"],
                                     FastFinetune(**settings, devices=2, strategy="ddp_spawn"))
    assert any(u["iterations"] < 80 for u in one_report["units"]) and two_report["warnings"] == one_report["warnings"]
    assert (one_report["held_out"] is not None) == (share == 0.25)
    _assert_same_tuning(one, one_report, two, two_report)


def _assert_same_tuning(one: onnx.ModelProto, one_report: dict, two: onnx.ModelProto, two_report: dict) -> None:
    """Two processes tune to one process's bytes: every unit's losses, status, steps and best point,
    the held-out guard and every weight. Each step's gradient (in gradient_pieces pieces, 2 by
    default), and each loss (per calibration batch), is a float64 sum of pieces added in order
    whatever the number of processes
    (shards.sum_in_order), so it holds on any CPU, whatever order its kernels sum a piece in (checked
    here under ATEN_CPU_CAPABILITY=avx2 and =default too: see docs/devices.md)."""
    fields = ("name", "status", "iterations", "best_iteration", "loss_before", "loss_after", "held_out_before",
              "held_out_after", "rejected_loss")
    assert [[u.get(f) for f in fields] for u in two_report["units"]] == [[u.get(f) for f in fields] for u in one_report["units"]]
    assert two_report["held_out"] == one_report["held_out"]
    ones, twos = _weights(one), _weights(two)
    assert ones.keys() == twos.keys()
    for name, value in ones.items():
        assert twos[name].tobytes() == value.tobytes(), name
