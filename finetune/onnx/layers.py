"""The weight layers every module agrees on (one table): which inputs of each layer op hold its
weights and its bias, the axes of a weight's output and input channels, and the axis of the channels
of the activations a layer reads and writes. Quantization plans per-channel scales and blocks by it,
SmoothQuant and equalisation scale channels by it, GPTQ lays weights out by it, bias correction
averages outputs along it and lifting makes trainable parameters of the inputs it names."""

from __future__ import annotations

from dataclasses import dataclass

RECURRENT_OPS = ("LSTM", "GRU")  # inputs X, W, R, B, sequence_lens, initial states (and LSTM's peepholes)


@dataclass(frozen=True)
class LayerOp:
    """A layer op's inputs holding weights (MatMul: either operand, the one that is constant) and the
    input holding its bias (None: it has none), and the axis of its activations' channels (None:
    recurrent layers, whose channels depend on their layout)."""

    weights: tuple[int, ...]
    bias: int | None
    channel_axis: int | None


LAYER_OPS: dict[str, LayerOp] = {
    "Conv": LayerOp((1,), 2, 1),  # X [N, C, *spatial], W [O, I/g, *kernel], B [O]
    "ConvTranspose": LayerOp((1,), 2, 1),  # W [I, O/g, *kernel]
    "Gemm": LayerOp((1,), 2, -1),  # A [M, K], B [K, N] (transB: [N, K]), C
    "MatMul": LayerOp((0, 1), None, -1),
    "LSTM": LayerOp((1, 2), 3, None),  # W [D, 4H, I], R [D, 4H, H], B [D, 8H]
    "GRU": LayerOp((1, 2), 3, None),
}
BIAS_INPUT = {op: layer.bias for op, layer in LAYER_OPS.items() if layer.bias is not None}
# Inputs that hold a layer's weight or bias: fine-tuning may change the initializer behind them.
PARAMETER_INPUTS = {op: (*layer.weights, *(() if layer.bias is None else (layer.bias,))) for op, layer in LAYER_OPS.items()}


def weight_axes(op_type: str, index: int = 1, trans_b: bool = False) -> tuple[int, int]:
    """(output-channel axis, input-channel axis) of weight input `index` of a layer op: Conv
    [O, I/g, *kernel] (0, 1); ConvTranspose [I, O/g, *kernel] (1, 0); Gemm's B [K, N] (1, 0), with
    transB [N, K] (0, 1); MatMul's second operand [..., K, N] (-1, -2), its first [..., M, K] (-2, -1);
    LSTM and GRU's W and R [D, gates * H, I or H] (1, 2)."""
    if op_type == "Conv":
        return 0, 1
    if op_type == "ConvTranspose":
        return 1, 0
    if op_type == "Gemm":
        return (0, 1) if trans_b else (1, 0)
    if op_type == "MatMul":
        return (-1, -2) if index == 1 else (-2, -1)
    if op_type in RECURRENT_OPS:
        return 1, 2
    raise KeyError(f"{op_type} is not a weight layer (one of {', '.join(LAYER_OPS)})")
