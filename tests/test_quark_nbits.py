"""AMD Quark's UseMatMulNBits / MatMulNBitsParams translated: weight-only 4-bit groups along K on
MatMul weights, written as onnxruntime's MatMulNBits; what finetune cannot honour is refused by name."""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
import pytest

from finetune.config import ConfigError, FastFinetune, from_quark, load_config
from finetune.config.finetune import GPTQ
from finetune.pipeline import quantize_and_finetune
from finetune.zoo_decoder import decoder_feeds, export_decoder

from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)

NBITS = "extra_options.MatMulNBitsParams"


def _int4_blocks(block_size: int, dtype: str = "int4") -> dict:
    """finetune's own spelling of 4-bit MatMulNBits weights in groups of `block_size`."""
    base = "INT4_BLOCK32" if dtype == "int4" else "UINT4_BLOCK32"
    return {"preset": base, "weight": {"block_size": block_size}, "op_types": ["MatMul"], "weight_storage": "matmul_nbits"}


def test_quarks_defaults_are_symmetric_int4_in_groups_of_128_as_matmul_nbits() -> None:
    assert from_quark({"extra_options": {"UseMatMulNBits": True}}) == load_config(_int4_blocks(128))
    # Quark's MATMUL_NBITS preset spells the same with AccuracyLevel 1 (float32 accumulation, as 0 does)
    preset = {"UseMatMulNBits": True, "MatMulNBitsParams": {"GroupSize": 128, "Symmetric": True, "Bits": 4, "AccuracyLevel": 1}}
    assert from_quark({"extra_options": preset}) == load_config(_int4_blocks(128))


def test_asymmetric_groups_are_uint4_with_zero_points() -> None:
    options = {"UseMatMulNBits": True, "MatMulNBitsParams": {"GroupSize": 32, "Symmetric": False}}
    assert from_quark({"extra_options": options}) == load_config(_int4_blocks(32, "uint4"))


def test_the_gptq_algorithm_runs_gptq_with_gptq_params_on_the_same_grid() -> None:
    options = {"UseMatMulNBits": True, "MatMulNBitsParams": {"GroupSize": 64, "Algorithm": "GPTQ"},
               "GPTQParams": {"PercDamp": 0.05, "BlockSize": 32, "ActOrder": True}}
    config = from_quark({"extra_options": options})
    assert config.weight == load_config(_int4_blocks(64)).weight and config.activation is None
    assert config.fast_finetune == FastFinetune(algorithm="gptq", op_types=("MatMul",),
                                                gptq=GPTQ(perc_damp=0.05, block_size=32, act_order=True))


def test_activation_and_weight_types_have_no_effect_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = from_quark({"activation_type": "QUInt8", "weight_type": "QInt8", "extra_options": {"UseMatMulNBits": True}})
    assert config == load_config(_int4_blocks(128))
    assert "activation_type: QUInt8 has no effect with UseMatMulNBits" in caplog.text
    assert "weight_type: QInt8 has no effect with UseMatMulNBits" in caplog.text


def test_params_without_use_matmul_nbits_have_no_effect_as_in_quark(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = from_quark({"extra_options": {"MatMulNBitsParams": {"GroupSize": 32}}})
    assert config.weight_storage == "float" and config.weight.dtype == "int8"
    assert "MatMulNBitsParams given but UseMatMulNBits is false" in caplog.text


@pytest.mark.parametrize(("params", "message"), [
    ({"Bits": 8}, rf"{NBITS}\.Bits: 8: finetune writes 4-bit MatMulNBits only"),
    ({"GroupSize": 48}, rf"{NBITS}\.GroupSize: must be a power of two of at least 16"),
    ({"GroupSize": 8}, rf"{NBITS}\.GroupSize: must be a power of two of at least 16"),
    ({"AccuracyLevel": 4}, rf"{NBITS}\.AccuracyLevel: 4 has no equivalent"),
    ({"Algorithm": "HQQ"}, rf"{NBITS}\.Algorithm: 'HQQ' has no equivalent here"),
    ({"Symmetric": "yes"}, rf"{NBITS}\.Symmetric: expected true or false"),
    ({"Groupsize": 32}, rf"{NBITS}\.Groupsize: unknown Quark option \(did you mean GroupSize\?\)"),
])
def test_what_finetune_cannot_honour_is_refused_by_name(params: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_quark({"extra_options": {"UseMatMulNBits": True, "MatMulNBitsParams": params}})


def test_a_quark_matmul_nbits_config_writes_matmul_nbits_nodes(tmp_path: Path) -> None:
    """The tiny decoder under Quark's MATMUL_NBITS options (groups of 16: its widths are 64) gives
    the model finetune's own spelling of those options gives, MatMulNBits on every MatMul weight."""
    path = export_decoder(tmp_path / "decoder.onnx", cache=False, dynamo=False)
    feeds = decoder_feeds(False, 2)
    quark = {"extra_options": {"UseMatMulNBits": True, "MatMulNBitsParams": {"GroupSize": 16, "AccuracyLevel": 1}}}
    written = quantize_and_finetune(path, quark, feeds, model_path=tmp_path / "quark.onnx").model
    ours = quantize_and_finetune(path, _int4_blocks(16), feeds).model
    assert written.graph == ours.graph
    stored = onnx.load(tmp_path / "quark.onnx")
    assert sum(node.op_type == "MatMulNBits" for node in stored.graph.node) == 15  # 7 per block, and the LM head
    assert {a.i for node in stored.graph.node if node.op_type == "MatMulNBits" for a in node.attribute
            if a.name == "block_size"} == {16}
