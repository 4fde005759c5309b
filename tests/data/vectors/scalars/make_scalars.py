"""Remake the scalar reference vectors: what AMD Quark's own compiled kernels (its custom-op library
registered in onnxruntime) return for rank-0 and one-element inputs of BFPQuantizeDequantize and
MXQuantizeDequantize, for every block format. Quark is never a dependency of finetune: run this in
an environment of its own, black box (one-node models in, outputs out):

    python3 -m venv /tmp/quark && /tmp/quark/bin/pip install amd-quark==0.13 onnxruntime onnx torch
    /tmp/quark/bin/python tests/data/vectors/scalars/make_scalars.py

It writes `scalars.npz` (float32 `x`, and `y.<name>` per configuration) and `scalars.json` (the
configurations, shapes, how the vectors were made, versions) beside itself; tests/vectors.py loads
them as vector sets like those of tests/data/vectors/public."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DOMAIN = "com.amd.quark"
OPSET = 17
IR_VERSION = 8  # as Quark writes its models
SHAPES = ((), (1,), (1, 1), (1, 1, 1, 1))
VALUES = {  # one value per input: ordinary, on and off each grid, the float32 edges, NaN and Inf
    "third": 1 / 3,
    "pi_ish": 1.2345678,
    "neg_7_77": -7.77,
    "100_3": 100.3,
    "448_7": 448.7,
    "6_5": 6.5,
    "zero": 0.0,
    "neg_zero": -0.0,
    "subnormal": 1e-40,
    "neg_subnormal": -3e-39,
    "flt_min": 2.0**-126,
    "flt_max": float(np.finfo(np.float32).max),
    "neg_1e30": -1e30,
    "tiny_5e-30": 5e-30,
    "bf16_tie": 1.0 + 2.0**-8,
    "nan": float("nan"),
    "pos_inf": float("inf"),
    "neg_inf": float("-inf"),
}
BFP_DEFAULTS = {
    "bfp_method": "to_bfp", "axis": 1, "bit_width": 16, "block_size": 8, "rounding_mode": 0,
    "sub_block_size": 2, "sub_block_shift_bits": 1, "convert_to_bfloat_before_bfp": 0,
}
MX_DEFAULTS = {"element_dtype": "int8", "axis": 1, "block_size": 32, "rounding_mode": 0}
BFP = "BFPQuantizeDequantize"
MX = "MXQuantizeDequantize"


def _configurations() -> dict[str, tuple[str, dict]]:
    """Name -> (op type, every attribute set explicitly): each block format at axis 1 (out of range
    for rank 0 and rank 1), Quark's default configs at axis 0, as it writes them for a scalar, and
    axes out of range for most of the shapes."""
    configs: dict[str, tuple[str, dict]] = {}
    for width, rounding, bfloat in ((16, 0, 0), (16, 1, 0), (16, 2, 0), (12, 2, 0), (16, 2, 1), (12, 0, 1)):
        name = f"scalar_bfp_tobfp_bw{width}_ax1_rm{rounding}" + ("_bfloat" if bfloat else "")
        configs[name] = (BFP, {**BFP_DEFAULTS, "bit_width": width, "rounding_mode": rounding,
                               "convert_to_bfloat_before_bfp": bfloat})
    for label, width in (("mx9", 16), ("mx6", 13), ("mx4", 11)):
        for rounding in (0, 2):
            configs[f"scalar_bfpprime_{label}_bw{width}_ax1_rm{rounding}"] = (BFP, _prime(width, rounding, 1))
    configs["scalar_bfpprime_mx4_bw11_ax1_rm2_bfloat"] = (BFP, {**_prime(11, 2, 1), "convert_to_bfloat_before_bfp": 1})
    for element in ("fp8_e5m2", "fp8_e4m3", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1", "int8"):
        configs[f"scalar_mx_{element}_ax1_rm2"] = (MX, {**MX_DEFAULTS, "element_dtype": element, "rounding_mode": 2})
    configs["scalar_mx_int8_ax1_rm0"] = (MX, {**MX_DEFAULTS, "element_dtype": "int8", "rounding_mode": 0})
    configs["scalar_bfp_tobfp_bw16_ax0_rm2"] = (BFP, {**BFP_DEFAULTS, "axis": 0, "rounding_mode": 2})
    configs["scalar_bfpprime_mx4_bw11_ax0_rm2"] = (BFP, _prime(11, 2, 0))
    configs["scalar_mx_fp4_e2m1_ax0_rm2"] = (MX, {**MX_DEFAULTS, "element_dtype": "fp4_e2m1", "axis": 0, "rounding_mode": 2})
    configs["scalar_mx_int8_ax0_rm2"] = (MX, {**MX_DEFAULTS, "axis": 0, "rounding_mode": 2})
    configs["scalar_bfpprime_mx6_bw13_ax3_rm2"] = (BFP, _prime(13, 2, 3))
    configs["scalar_mx_fp8_e4m3_axm3_rm2"] = (MX, {**MX_DEFAULTS, "element_dtype": "fp8_e4m3", "axis": -3, "rounding_mode": 2})
    return configs


def _prime(width: int, rounding: int, axis: int) -> dict:
    """to_bfp_prime attributes of MX9/MX6/MX4 (block 16, sub-block 2, shift 1)."""
    return {**BFP_DEFAULTS, "bfp_method": "to_bfp_prime", "bit_width": width, "block_size": 16,
            "rounding_mode": rounding, "axis": axis}


def _model(op_type: str, attributes: dict, shape: tuple[int, ...]) -> bytes:
    """x -> one Quark node -> y, with x's static shape declared, as Quark's models declare it."""
    from onnx import TensorProto, helper

    node = helper.make_node(op_type, ["x"], ["y"], name="qdq", domain=DOMAIN, **attributes)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = IR_VERSION
    return model.SerializeToString()


def _run(op_type: str, attributes: dict, x: np.ndarray) -> np.ndarray:
    """Quark's kernel on x, one session per input (its kernel caches work for the first rank it sees)."""
    import onnxruntime as ort
    from quark.onnx import get_library_path

    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(_model(op_type, attributes, x.shape), options, providers=["CPUExecutionProvider"])
    y = session.run(None, {"x": x.copy()})[0]
    if y.shape != x.shape or y.dtype != np.float32:
        raise RuntimeError(f"{op_type} {attributes}: {x.shape} in, {y.shape} {y.dtype} out")
    return y


def _versions() -> dict[str, str]:
    """The versions that produced the vectors."""
    import onnx
    import onnxruntime
    import quark

    return {"amd-quark": quark.__version__, "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__,
            "numpy": np.__version__, "python": sys.version.split()[0]}


def _outputs(op_type: str, attributes: dict, x: np.ndarray) -> np.ndarray:
    """Quark's y for every shape (rows) and value (columns), each fed alone as x[j] filling the shape."""
    return np.stack([[_run(op_type, attributes, np.full(shape, v, np.float32)).reshape(()) for v in x] for shape in SHAPES])


def main() -> None:
    """Write scalars.npz (x, and y.<name> for every configuration) and scalars.json."""
    x = np.array(list(VALUES.values()), np.float32)
    configs = _configurations()
    arrays = {"x": x}
    for name, (op_type, attributes) in configs.items():
        arrays[f"y.{name}"] = _outputs(op_type, attributes, x)
        print("ran", name)
    np.savez_compressed(HERE / "scalars.npz", **arrays)
    (HERE / "scalars.json").write_text(json.dumps(_description(configs), indent=1) + "\n")


def _description(configs: dict[str, tuple[str, dict]]) -> dict:
    """scalars.json: what the arrays hold, how they were made, and with what."""
    return {
        "description": "AMD Quark's BFPQuantizeDequantize / MXQuantizeDequantize on one-element inputs: "
                       "y.<name>[i, j] is its output for x[j] given alone in shapes[i]",
        "made_by": "tests/data/vectors/scalars/make_scalars.py, AMD Quark's custom-op library "
                   "(quark.onnx.get_library_path) registered in onnxruntime; Quark's code is not used otherwise",
        "versions": _versions(),
        "model": {"nodes": "x -> one node of domain com.amd.quark (version 1) -> y", "opset": OPSET,
                  "ir_version": IR_VERSION, "shapes": "x and y declared with the static shape fed",
                  "execution_provider": "CPUExecutionProvider", "graph_optimization_level": "ORT_DISABLE_ALL",
                  "session": "one InferenceSession per input"},
        "shapes": [list(shape) for shape in SHAPES],
        "values": list(VALUES),
        "configurations": [{"name": name, "op_type": op_type, "domain": DOMAIN, "attributes": attributes}
                           for name, (op_type, attributes) in configs.items()],
        "compare": "by value: NaN == NaN (any payload), +0 == -0; everything else bit-exact float32",
    }


if __name__ == "__main__":
    main()
