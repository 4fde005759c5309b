"""Recurrent-layer converters: LSTM and GRU (opsets 7, 14, 22) as plain torch ops stepping through
time, with W, R and B as inputs so each weight can be a trainable parameter behind its fake-quant
module. ONNX gate orders (LSTM i, o, f, c; GRU z, r, h), every direction, `layout` 0 and 1,
per-batch `sequence_lens` (outputs past a sequence's end are zero, final states are those of its
last valid step, a reverse pass starts at that step), peepholes, `clip`, `input_forget` and the
activations without parameters are lifted as onnxruntime computes them; nn.LSTM's fused kernels
are not used, as they order gates and sums differently."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OnnxMapping, OperationConverterResult
from torch import nn

from ..registry import register
from .common import converted, used_outputs

Activation = Callable[[torch.Tensor], torch.Tensor]
States = tuple[torch.Tensor, ...]

# ONNX RNN activations that take no alpha/beta, by lower-case name (onnxruntime ignores the case).
ACTIVATIONS: dict[str, Activation] = {
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": torch.relu, "softsign": F.softsign, "softplus": F.softplus,
}
DIRECTIONS = ("forward", "reverse", "bidirectional")
INITIAL_H = 5  # input index of initial_h, for both LSTM and GRU
INITIAL_C = 6  # LSTM's initial_c
# Ops whose output holds only values of their first input: zeros in, zeros out.
ZERO_PRESERVING = frozenset({"Expand", "Slice", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Tile", "Gather"})


class Recurrent(nn.Module):
    """What LSTM and GRU share: layout, directions, sequence lengths and the scan over time; a
    subclass gives the number of states and the cell (one time step of one direction)."""

    activation_count: int  # activations per direction
    state_count: int  # hidden state, and the cell state of an LSTM

    def __init__(self, direction: str, layout: int, activations: Sequence[str], clip: float | None,
                 returns: tuple[int, ...]):
        super().__init__()
        self.direction, self.layout, self.clip, self.returns = direction, layout, clip, returns
        self.activation_names = tuple(activations)

    def _run(self, x: torch.Tensor, w: torch.Tensor, r: torch.Tensor, b: torch.Tensor | None,
             sequence_lens: torch.Tensor | None, initial: Sequence[torch.Tensor | None],
             extra: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Y, and the final state(s), of every direction; `extra` is per-direction data of the cell."""
        if self.layout:
            x = x.transpose(0, 1)
            initial = [None if s is None else s.transpose(0, 1) for s in initial]
        steps, batch, hidden = x.shape[0], x.shape[1], r.shape[-1]
        valid = None
        if sequence_lens is not None:
            lengths = sequence_lens.to(device=x.device, dtype=torch.long)
            valid = torch.arange(steps, device=x.device).unsqueeze(1) < lengths.unsqueeze(0)  # [T, B]
        ys, finals = [], []
        for d in range(w.shape[0]):
            states = tuple(x.new_zeros(batch, hidden) if s is None else s[d] for s in initial)
            order = self._order(d, steps, sequence_lens, x.device)
            bias = None if b is None else b[d]
            y, last = self._scan(_reorder(x, order), w[d], r[d], bias, states, valid, d, None if extra is None else extra[d])
            ys.append(_reorder(y, order))
            finals.append(last)
        y = torch.stack(ys, 1)  # [T, D, B, H]
        states = [torch.stack([f[k] for f in finals]) for k in range(self.state_count)]  # each [D, B, H]
        if self.layout:
            y, states = y.permute(2, 0, 1, 3), [s.transpose(0, 1) for s in states]
        results = tuple((y, *states)[i] for i in self.returns)
        return results[0] if len(results) == 1 else results

    def _order(self, d: int, steps: int, sequence_lens: torch.Tensor | None,
               device: torch.device) -> torch.Tensor | str | None:
        """The time index each step of direction `d` reads per batch entry ([T, B]; None: in
        order, "flip": all backwards). A reverse pass reads each sequence backwards from its last
        valid step, padding left in place; the same order puts its outputs back."""
        if not (self.direction == "reverse" or (self.direction == "bidirectional" and d == 1)):
            return None
        if sequence_lens is None:
            return "flip"
        lengths = sequence_lens.to(device=device, dtype=torch.long).unsqueeze(0)
        t = torch.arange(steps, device=device).unsqueeze(1)
        return torch.where(t < lengths, lengths - 1 - t, t)

    def _scan(self, x: torch.Tensor, w: torch.Tensor, r: torch.Tensor, b: torch.Tensor | None, states: States,
              valid: torch.Tensor | None, d: int, extra: torch.Tensor | None) -> tuple[torch.Tensor, States]:
        """Outputs [T, B, H] and final states of one direction over time; past a sequence's end the
        state is held and the output is zero. The input products of all steps are one matmul."""
        activations = self._activations(d)
        inputs = torch.matmul(x, w.transpose(0, 1))
        outputs = []
        for t in range(x.shape[0]):
            new = self._cell(inputs[t], r, b, states, activations, extra)
            if valid is not None:
                keep = valid[t].unsqueeze(1)
                new = tuple(torch.where(keep, n, s) for n, s in zip(new, states))
                outputs.append(torch.where(keep, new[0], torch.zeros_like(new[0])))
            else:
                outputs.append(new[0])
            states = new
        return torch.stack(outputs), states

    def _activations(self, d: int) -> list[Activation]:
        """The activation functions of direction `d` (the defaults unless the node names others)."""
        names = self.activation_names[d * self.activation_count : (d + 1) * self.activation_count]
        return [ACTIVATIONS[name.lower()] for name in names]

    def _gate(self, pre: torch.Tensor, activation: Activation) -> torch.Tensor:
        """A gate's activation of its clipped pre-activation."""
        return activation(pre if self.clip is None else pre.clamp(-self.clip, self.clip))

    def _cell(self, xw: torch.Tensor, r: torch.Tensor, b: torch.Tensor | None, states: States,
              activations: list[Activation], extra: torch.Tensor | None) -> States:
        raise NotImplementedError


class LSTM(Recurrent):
    """ONNX LSTM with X, W, R, B, sequence_lens, initial_h, initial_c and P as inputs; returns
    those of Y, Y_h and Y_c that `returns` lists (one as a tensor, several as a tuple)."""

    activation_count, state_count = 3, 2

    def __init__(self, direction: str, layout: int, activations: Sequence[str], clip: float | None,
                 returns: tuple[int, ...], input_forget: bool):
        super().__init__(direction, layout, activations, clip, returns)
        self.input_forget = input_forget

    def forward(self, x: torch.Tensor, w: torch.Tensor, r: torch.Tensor, b: torch.Tensor | None = None,
                sequence_lens: torch.Tensor | None = None, initial_h: torch.Tensor | None = None,
                initial_c: torch.Tensor | None = None, p: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        return self._run(x, w, r, _summed_bias(b), sequence_lens, (initial_h, initial_c), p)

    def _cell(self, xw: torch.Tensor, r: torch.Tensor, b: torch.Tensor | None, states: States,
              activations: list[Activation], p: torch.Tensor | None) -> States:
        """One step: gates i, o, f, c from (x W + h R) + (Wb + Rb), peepholes on i, f (previous
        cell) and o (new cell)."""
        h, c = states
        f, g, act_h = activations
        pre = xw + torch.matmul(h, r.transpose(0, 1))
        if b is not None:
            pre = pre + b
        pre_i, pre_o, pre_f, pre_c = pre.chunk(4, -1)
        if p is not None:
            p_i, p_o, p_f = p.chunk(3, -1)
            pre_i, pre_f = pre_i + p_i * c, pre_f + p_f * c
        i = self._gate(pre_i, f)
        forget = 1 - i if self.input_forget else self._gate(pre_f, f)
        c = forget * c + i * self._gate(pre_c, g)
        o = self._gate(pre_o if p is None else pre_o + p_o * c, f)
        return o * act_h(c), c


class GRU(Recurrent):
    """ONNX GRU with X, W, R, B, sequence_lens and initial_h as inputs; returns those of Y and Y_h
    that `returns` lists (one as a tensor, both as a tuple)."""

    activation_count, state_count = 2, 1

    def __init__(self, direction: str, layout: int, activations: Sequence[str], clip: float | None,
                 returns: tuple[int, ...], linear_before_reset: bool):
        super().__init__(direction, layout, activations, clip, returns)
        self.linear_before_reset = linear_before_reset

    def forward(self, x: torch.Tensor, w: torch.Tensor, r: torch.Tensor, b: torch.Tensor | None = None,
                sequence_lens: torch.Tensor | None = None,
                initial_h: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        return self._run(x, w, r, b, sequence_lens, (initial_h,), None)

    def _cell(self, xw: torch.Tensor, r: torch.Tensor, b: torch.Tensor | None, states: States,
              activations: list[Activation], extra: torch.Tensor | None) -> States:
        """One step: z and r from (x W + h R) + (Wb + Rb); the candidate h from x Wh + Wbh and
        either (r h) Rh + Rbh or, with linear_before_reset, r (h Rh + Rbh)."""
        (h,), (f, g) = states, activations
        hidden = h.shape[-1]
        w_b, r_b = (None, None) if b is None else b.chunk(2, -1)
        x_zr, x_h = xw[..., : 2 * hidden], xw[..., 2 * hidden :]
        pre_zr = x_zr + torch.matmul(h, r[: 2 * hidden].transpose(0, 1))
        if b is not None:
            pre_zr = pre_zr + (w_b[: 2 * hidden] + r_b[: 2 * hidden])
        z, reset = self._gate(pre_zr, f).chunk(2, -1)
        r_h = r[2 * hidden :].transpose(0, 1)
        if self.linear_before_reset:
            recurrent = torch.matmul(h, r_h) if b is None else torch.matmul(h, r_h) + r_b[2 * hidden :]
            pre_h = x_h + reset * recurrent
            pre_h = pre_h if b is None else pre_h + w_b[2 * hidden :]
        else:
            pre_h = x_h + torch.matmul(reset * h, r_h)
            pre_h = pre_h if b is None else pre_h + (w_b[2 * hidden :] + r_b[2 * hidden :])
        candidate = self._gate(pre_h, g)
        return ((1 - z) * candidate + z * h,)


def _reorder(x: torch.Tensor, order: torch.Tensor | str | None) -> torch.Tensor:
    """`x` ([T, B, ...]) with its time steps in `order` (see Recurrent._order)."""
    if order is None:
        return x
    if isinstance(order, str):
        return x.flip(0)
    return x.gather(0, order.view(*order.shape, 1).expand_as(x))


def _summed_bias(b: torch.Tensor | None) -> torch.Tensor | None:
    """Wb + Rb of each direction ([D, 8H] -> [D, 4H]), added once per step as onnxruntime does."""
    if b is None:
        return None
    w_b, r_b = b.chunk(2, -1)
    return w_b + r_b


def _settings(node: OnnxNode, graph: OnnxGraph, activation_count: int, defaults: Sequence[str]) -> dict:
    """The attributes both ops share, checked; refusals name the attribute (the builder adds the node)."""
    a = node.attributes
    for name in ("activation_alpha", "activation_beta"):
        if name in a:
            raise NotImplementedError(f"attribute {name} is not lifted (only activations without parameters are: "
                                      f"{', '.join(sorted(ACTIVATIONS))})")
    direction = a.get("direction", "forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    if direction not in DIRECTIONS:
        raise NotImplementedError(f"attribute direction={direction!r} is not one of {', '.join(DIRECTIONS)}")
    directions = 2 if direction == "bidirectional" else 1
    names = [n.decode() if isinstance(n, bytes) else n for n in a.get("activations", list(defaults) * directions)]
    unknown = [n for n in names if n.lower() not in ACTIVATIONS]
    if unknown or len(names) != activation_count * directions:
        raise NotImplementedError(f"attribute activations={names} is not lifted: give {activation_count * directions} of "
                                  f"{', '.join(sorted(ACTIVATIONS))} (case-insensitive)")
    clip = a.get("clip")
    return {"direction": direction, "layout": int(a.get("layout", 0)), "activations": names,
            "clip": None if clip is None else float(clip), "returns": used_outputs(node, graph)}


def _zero_initial_states(node: OnnxNode, graph: OnnxGraph, indices: Sequence[int]) -> tuple[str, ...]:
    """The node's inputs, with an initial state that is zero by construction (exporters make one
    from the batch size: ConstantOfShape, or zeros Expanded and Sliced) treated as omitted: zero is
    the default, and a reconstruction unit then reads its one input alone."""
    inputs = list(node.input_values)
    for index in indices:
        if index < len(inputs) and inputs[index] and _is_zeros(inputs[index], graph):
            inputs[index] = ""
    return tuple(inputs)


def _is_zeros(value: str, graph: OnnxGraph) -> bool:
    """Whether a value is all zeros whatever the inputs: a zero initializer, a ConstantOfShape
    filled with zero, or zeros only moved, copied or selected (ZERO_PRESERVING ops)."""
    if value in graph.initializers:
        return not graph.initializers[value].to_torch().any()
    try:
        producer, _ = graph.value_as_node_output(value)
    except KeyError:
        return False
    if producer.operation_type == "ConstantOfShape":
        fill = producer.attributes.get("value")
        return fill is None or not fill.to_torch().any()
    if producer.operation_type == "Concat":
        return all(_is_zeros(name, graph) for name in producer.input_values)
    return producer.operation_type in ZERO_PRESERVING and _is_zeros(producer.input_values[0], graph)


def _mapping(inputs: tuple[str, ...], node: OnnxNode, returns: tuple[int, ...]) -> OnnxMapping:
    """All inputs (omitted ones as "") and the outputs the module returns."""
    return OnnxMapping(inputs=inputs, outputs=tuple(node.output_values[i] for i in returns))


@register("LSTM", (7, 14, 22))
def _lstm(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """LSTM with W, R, B (and P) as inputs."""
    settings = _settings(node, graph, LSTM.activation_count, ("Sigmoid", "Tanh", "Tanh"))
    module = LSTM(**settings, input_forget=bool(node.attributes.get("input_forget", 0)))
    return converted(module, _mapping(_zero_initial_states(node, graph, (INITIAL_H, INITIAL_C)), node, module.returns))


@register("GRU", (7, 14, 22))
def _gru(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """GRU with W, R and B as inputs."""
    settings = _settings(node, graph, GRU.activation_count, ("Sigmoid", "Tanh"))
    module = GRU(**settings, linear_before_reset=bool(node.attributes.get("linear_before_reset", 0)))
    return converted(module, _mapping(_zero_initial_states(node, graph, (INITIAL_H,)), node, module.returns))
