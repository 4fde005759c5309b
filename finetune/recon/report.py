"""The fine-tuning report: per-unit numbers as JSON, a PNG of each unit's reconstruction loss
before and after, and the few lines the command line prints."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from finetune.files import write_atomic, write_text_atomic

logger = logging.getLogger(__name__)


def write_report(report: dict[str, Any], output_dir: Path, name: str) -> tuple[Path, Path]:
    """Write `<name>.json` and `<name>.png` into `output_dir`; returns their paths."""
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = output_dir / f"{name}.json", output_dir / f"{name}.png"
    write_text_atomic(json_path, json.dumps(report, indent=1) + "\n")
    plot_losses(report["units"], png_path)
    return json_path, png_path


def plot_losses(units: list[dict[str, Any]], path: Path) -> None:
    """Bars of the training loss before and after per unit (log scale; reverted or skipped units
    hatched), and markers of the loss on the held-out batches where some were held out."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    positions = range(len(units))
    figure, axes = plt.subplots(figsize=(max(6.0, 0.35 * len(units) + 2), 4.5), dpi=100)
    axes.bar([p - 0.2 for p in positions], [u["loss_before"] for u in units], 0.4, label="before", color="#c44e52")
    after = axes.bar([p + 0.2 for p in positions], [u["loss_after"] for u in units], 0.4, label="after", color="#4c72b0")
    for bar, unit in zip(after, units):
        if unit["status"] != "kept":
            bar.set_hatch("//")
            bar.set_alpha(0.5)
    held = [(p, u) for p, u in zip(positions, units) if u.get("held_out_before") is not None]
    if held:  # the loss on the held-out batches, which decides keep or revert, as markers over the bars
        axes.scatter([p - 0.2 for p, _ in held], [u["held_out_before"] for _, u in held], marker="_", s=120, color="black",
                     label="held out, before", zorder=3)
        axes.scatter([p + 0.2 for p, _ in held], [u["held_out_after"] for _, u in held], marker="x", s=30, color="black",
                     label="held out, after", zorder=3)
    axes.set_yscale("log")
    axes.set_xticks(list(positions), [f"{i + 1}" for i in positions], fontsize=7)
    axes.set_xlabel("unit (graph order; bars: training batches; hatched: reverted or skipped)")
    axes.set_ylabel("reconstruction MSE")
    axes.set_title("reconstruction loss per unit, before and after tuning")
    axes.legend()
    figure.tight_layout()
    write_atomic(path, lambda tmp: figure.savefig(tmp, format="png", metadata={"Software": None}))
    plt.close(figure)


def format_report(report: dict[str, Any]) -> str:
    """The report as the few lines the CLI prints."""
    units = report["units"]
    before = sum(u["loss_before"] for u in units)
    after = sum(u["loss_after"] for u in units)
    per_iteration = report["seconds_per_unit_iteration"]
    timing = f"{per_iteration * 1e3:.2f} ms per unit-iteration, " if per_iteration else ""
    resumed = f", {report['resumed_units']} restored from the checkpoint" if report["resumed_units"] else ""
    warned = f"; {len(report['warnings'])} warning(s), listed in the report" if report["warnings"] else ""
    processes = f" x {report['processes']} processes" if report.get("processes", 1) > 1 else ""
    corrections = [u["bias_correction"] for u in units if u.get("bias_correction")]
    kept = sum(any(isinstance(c, dict) and c.get("status") == "kept" for c in entry.values()) for entry in corrections)
    corrected = f", bias correction kept in {kept} of {len(corrections)} unit(s)" if corrections else ""
    held = report.get("held_out")
    if held:
        undone = "; worse, so the untuned weights are kept" if held["restored_untuned_weights"] else ""
        warned = (f"; model output error on {held['batches']} held-out batch(es) {held['output_error_untuned']:.4g} -> "
                  f"{held['output_error_tuned']:.4g}{undone}{warned}")
    return (f"fast finetune ({report['algorithm']}, {report['device']}{processes}, float reference: {report['float_reference']}): "
            f"{len(units)} units, {report['kept']} kept, {report['reverted']} reverted{resumed}{corrected}; summed reconstruction loss "
            f"{before:.4g} -> {after:.4g}; {timing}{report['total_seconds']:.1f} s{warned}")
