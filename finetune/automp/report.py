"""The mixed-precision report: per layer the rung chosen and the sensitivity at every rung, the
search trace, the uniform ladder points, the share of elements at each rung, the metric onnxruntime
measured, wall times; as JSON, a summary line, and a PNG (sensitivity per layer per rung; metric
against average bits with the uniform points and the chosen one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune.config.automp import GOALS, AutoMixedPrecision
from finetune.files import write_atomic, write_text_atomic

from .ladder import ROLES, Item, Rung
from .measure import ladder_key
from .metrics import Metric
from .search import Point, Search
from .switch import SwitchableModel

UNJUDGED = ("keep_top", "lower")  # goals that fix how many layers stay high, with no target to meet


def build_report(*, settings: AutoMixedPrecision, metric: Metric, target: float, float_value: float, items: list[Item],
                 rungs: dict[str, list[Rung]], search: Search, switch: SwitchableModel, assignment: tuple[int, ...],
                 uniform: list[Point], onnxruntime_metric: float, repairs: int, evaluation_source: str, samples: int,
                 finetune: dict | None, bits: tuple[float, float, float], seconds: dict[str, float]) -> dict[str, Any]:
    """The JSON-ready report of one search."""
    names = {key: [rung.name for rung in ladder] for key, ladder in rungs.items()}
    top = search.trace[0]
    goal = next(key for key in GOALS if getattr(settings, key) is not None)
    return {
        "metric": metric.name, "higher_is_better": metric.higher_is_better, "goal": goal, "target": target,
        "keep_top": settings.keep_top, "lower": settings.lower, "float_metric": float_value, "evaluation_data": evaluation_source,
        "samples": samples, "granularity": settings.granularity, "ladder": names,
        "layers": _layers(items, rungs, search, switch, assignment),
        "uniform": [_point(p, _uniform_name(p, items, rungs)) for p in [*uniform, top]],
        "trace": [_point(p) for p in search.trace],
        "evaluations": len(search.trace),
        "chosen": {
            "average_bits": bits[0], "weight_bits": bits[1], "activation_bits": bits[2],
            "holds": held(items, rungs, assignment), "fractions": _fractions(items, rungs, switch, assignment),
            "torch_metric": _torch_metric(search, assignment), "onnxruntime_metric": onnxruntime_metric,
            "repairs": repairs, "met": None if goal in UNJUDGED else metric.meets(onnxruntime_metric, target),
        },
        "finetune": None if finetune is None else {k: finetune[k] for k in ("algorithm", "kept", "reverted", "total_seconds")},
        "seconds": seconds,
    }


def _point(point: Point, name: str | None = None) -> dict[str, Any]:
    entry = {"phase": point.phase, "metric": point.metric, "relative_l2": point.l2, "average_bits": point.bits}
    return {"name": name, **entry} if name is not None else entry


def _uniform_name(point: Point, items: list[Item], rungs: dict[str, list[Rung]]) -> str:
    """The rung names a uniform assignment puts every item at."""
    return "/".join(dict.fromkeys(_rung_name(item, r, rungs) for item, r in zip(items, point.assignment, strict=True)))


def _rung_name(item: Item, rung: int, rungs: dict[str, list[Rung]]) -> str:
    return "+".join(_role_names(item, rung, rungs).values())


def _role_names(item: Item, rung: int, rungs: dict[str, list[Rung]]) -> dict[str, str]:
    """What an item holds at a rung, by what it covers: `layer` (one ladder), or its activation and
    weight (a split ladder), or its one role (granularity tensor)."""
    if item.ladder == "split":
        return {role: rungs[role][rung].name for role in ROLES}
    return {item.role: rungs[item.ladder][rung].name}


def held(items: list[Item], rungs: dict[str, list[Rung]], assignment: tuple[int, ...]) -> str:
    """What an assignment puts in the model, per role, against the top (costliest) rung: e.g.
    '5 of 5 activations lowered to int8; no weight lowered (5 of 5 at int8)'."""
    chosen: dict[str, list[str]] = {}
    top: dict[str, str] = {}
    for item, rung in zip(items, assignment, strict=True):
        top.update(_role_names(item, len(rungs[ladder_key(item)]) - 1, rungs))
        for role, name in _role_names(item, rung, rungs).items():
            chosen.setdefault(role, []).append(name)
    return "; ".join(_held_role(role, names, top[role]) for role, names in chosen.items())


def _held_role(role: str, names: list[str], top: str) -> str:
    lowered = [name for name in names if name != top]
    if not lowered:
        return f"no {role} lowered ({len(names)} of {len(names)} at {top})"
    kept = f", {len(names) - len(lowered)} at {top}" if len(lowered) < len(names) else ""
    return f"{len(lowered)} of {len(names)} {role}s lowered to {' / '.join(dict.fromkeys(lowered))}{kept}"


def _torch_metric(search: Search, assignment: tuple[int, ...]) -> float | None:
    measured = [p.metric for p in search.trace if p.assignment == assignment and p.phase != "repair"]
    return measured[-1] if measured else None


def _layers(items: list[Item], rungs: dict[str, list[Rung]], search: Search, switch: SwitchableModel,
            assignment: tuple[int, ...]) -> list[dict[str, Any]]:
    """Per searched item: op type, element counts, chosen rung, and metric / relative L2 / bits
    with it alone at each lower rung."""
    layers = []
    for i, item in enumerate(items):
        slots = switch.slots[item.node]
        sensitivity = {_rung_name(item, r, rungs): {"metric": p.metric, "relative_l2": p.l2}
                       for (j, r), p in sorted(search.sensitivity.items()) if j == i}
        layers.append({
            "node": item.node, "op_type": item.op_type, "role": item.role,
            "weight_elements": sum(s.elements for s in slots if s.role == "weight"),
            "activation_elements_per_sample": sum(s.elements for s in slots if s.role == "activation"),
            "rung": _rung_name(item, assignment[i], rungs), "fixed": i in search.fixed,
            "sensitivity": sensitivity,
        })
    return layers


def _fractions(items: list[Item], rungs: dict[str, list[Rung]], switch: SwitchableModel,
               assignment: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """Share of weight and of activation elements (of the searched layers) at each rung."""
    counts: dict[str, dict[str, float]] = {"weight": {}, "activation": {}}
    for i, item in enumerate(items):
        names = _role_names(item, assignment[i], rungs)
        for slot in switch.slots[item.node]:
            role = "activation" if slot.role == "activation" else "weight"
            if item.role in ("layer", role) and slot.role != "bias":
                name = names.get(role, names.get("layer"))
                counts[role][name] = counts[role].get(name, 0.0) + slot.elements
    return {role: {k: v / sum(c.values()) for k, v in sorted(c.items())} for role, c in counts.items() if c}


def summary_line(report: dict[str, Any]) -> str:
    """One line: what the model holds, shares of elements per format, average bits, the onnxruntime
    metric against the target, wall time."""
    chosen = report["chosen"]
    shares = "; ".join(f"{role} elements " + ", ".join(f"{name} {share:.0%}" for name, share in fractions.items())
                       for role, fractions in chosen["fractions"].items())
    goal = "" if report["goal"] in UNJUDGED else f" (target {report['target']:.6g})"
    return (f"auto mixed precision: {chosen['holds']}; {shares}; {chosen['average_bits']:.2f} average bits; "
            f"{report['metric']} in onnxruntime "
            f"{chosen['onnxruntime_metric']:.6g}{goal}; {report['evaluations']} evaluations, {report['seconds']['total']:.1f} s")


def write_report(report: dict[str, Any], output_dir: Path, name: str) -> tuple[Path, Path]:
    """Write `<name>.json` and `<name>.png` into `output_dir`; returns their paths."""
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = output_dir / f"{name}.json", output_dir / f"{name}.png"
    write_text_atomic(json_path, json.dumps(report, indent=1) + "\n")
    plot(report, png_path)
    return json_path, png_path


def plot(report: dict[str, Any], path: Path) -> None:
    """Left: relative L2 of the output with each layer alone at each lower rung. Right: the metric
    against average bits for every evaluation, the uniform ladder points and the chosen point."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    layers = report["layers"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(max(10.0, 0.25 * len(layers) + 6), 4.5), dpi=100)
    rung_names = list(dict.fromkeys(name for layer in layers for name in layer["sensitivity"]))
    for name in rung_names:
        values = [layer["sensitivity"].get(name, {}).get("relative_l2", float("nan")) for layer in layers]
        left.plot(range(len(layers)), values, marker="o", markersize=3, linewidth=1, label=name)
    left.set_yscale("log")
    left.set_xlabel("searched layer (graph order)")
    left.set_ylabel("relative L2 of the output, layer alone at the rung")
    left.set_title("sensitivity per layer per rung")
    left.legend(fontsize=8)
    trace = [p for p in report["trace"] if p["phase"] != "sensitivity"]
    right.scatter([p["average_bits"] for p in trace], [p["metric"] for p in trace], s=12, color="#999999", label="evaluations")
    uniform = sorted(report["uniform"], key=lambda p: p["average_bits"])
    right.plot([p["average_bits"] for p in uniform], [p["metric"] for p in uniform], marker="s", color="#c44e52",
               label="uniform rungs (torch)")
    chosen = report["chosen"]
    right.scatter([chosen["average_bits"]], [chosen["onnxruntime_metric"]], marker="*", s=160, color="#4c72b0", zorder=3,
                  label="chosen (onnxruntime)")
    if report["goal"] not in UNJUDGED:
        right.axhline(report["target"], color="#55a868", linestyle="--", linewidth=1, label="target")
    right.set_xlabel("average bits per element (searched layers)")
    right.set_ylabel(report["metric"])
    right.set_title("metric against average bits")
    right.legend(fontsize=8)
    figure.suptitle(chosen["holds"], fontsize=9)
    figure.tight_layout()
    write_atomic(path, lambda tmp: figure.savefig(tmp, format="png", metadata={"Software": None}))
    plt.close(figure)
