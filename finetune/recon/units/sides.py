"""Side inputs of a unit: computed values it reads besides its main input (the one QDrop mixes and
whose rows are the training rows), such as an LSTM's initial states, an If's condition or a Loop's
trip count, each with the axis holding its rows where the op defines one; and the outputs of a unit
whose node returns several (an If's probability and the state it hands to the next call, an LSTM's Y
and final states), each measured (see recon.data.rows for how both are trained on)."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass

from torch import fx, nn

# The inputs of an LSTM or GRU after its bias (torch argument names of the lifted module), and the
# axis of each holding the batch in layout 0 and in layout 1; None: it has no batch (peepholes).
RECURRENT_SIDES = {"sequence_lens": (0, 0), "initial_h": (1, 0), "initial_c": (1, 0), "p": (None, None)}


@dataclass(frozen=True)
class SideInput:
    """A computed value a unit reads besides its main input, by fx name, with the axis holding its
    rows where the op defines it (None: found from the values when tuning)."""

    name: str
    axis: int | None = None


def recurrent_sides(node: fx.Node, first_side: int, layout: int, constant: set[fx.Node]) -> tuple[list[SideInput], list[str]]:
    """The computed inputs of an LSTM or GRU node from argument `first_side` on (positional or by
    keyword) as side inputs with their batch axes, and the names of those without a batch axis."""
    named = {**dict(zip(RECURRENT_SIDES, node.args[first_side:])), **node.kwargs}
    sides, unbatched = [], []
    for name, value in named.items():
        if isinstance(value, fx.Node) and value not in constant:
            axis = RECURRENT_SIDES.get(name, (None, None))[layout]
            if axis is None:
                unbatched.append(value.name)
            else:
                sides.append(SideInput(value.name, axis))
    return sides, unbatched


def batch_axis_by_readers(module: nn.Module, value: fx.Node, readers: Iterable[fx.Node]) -> int | None:
    """The axis of `value` holding the batch as a lifted op reading it defines it (a module's
    `batch_axes`, argument name -> axis: an attention's key/value cache and row lengths), or None."""
    for node in readers:
        if node.op != "call_module":
            continue
        reader = module.get_submodule(node.target)
        axes = getattr(reader, "batch_axes", None)
        if not axes:
            continue
        named = {**dict(zip(inspect.signature(reader.forward).parameters, node.args)), **node.kwargs}
        found = {axes[name] for name, arg in named.items() if arg is value and name in axes}
        if len(found) == 1:
            return found.pop()
    return None


def measured_outputs(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node], tuple[int, ...]]:
    """(the getitems taking apart the outputs of a node with several, the values a unit ending at
    the node is measured on, which of its outputs those are): each output read, in the node's
    order, or the node itself (and no numbers)."""
    items = [user for user in node.users if user.op == "call_function" and len(user.args) == 2 and user.args[0] is node]
    items.sort(key=lambda item: item.args[1])
    return (items, items, tuple(item.args[1] for item in items)) if items else ([], [node], ())
