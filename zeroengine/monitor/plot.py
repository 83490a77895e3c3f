"""Draw a run's metrics.csv (loss and lr, throughput, memory by kind) into one PNG.

    python -m zeroengine.monitor.plot RUN_DIR -o out.png      (or: ze_plot RUN_DIR -o out.png)

RUN_DIR is the monitor's ``<output_path>/<job_name>`` directory (or the CSV
itself). matplotlib is not a zeroengine dependency: it is imported only here,
and its absence is reported with the command that installs it.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys

from .csv_monitor import FILENAME

_MEMORY_TOTALS = ("memory/cpu", "memory/device")  # by place: the by-kind lines already add up to these


def csv_path(run: str) -> str:
    return os.path.join(run, FILENAME) if os.path.isdir(run) else run


def read_metrics(path: str) -> dict[str, list[float]]:
    """Columns of a monitor CSV as floats, one entry per step, ordered by step.

    A step written twice (a run resumed from an earlier checkpoint, or rerun
    into the same directory, appends) keeps its latest row.
    """
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = {}
        for row in reader:
            rows[int(row["step"])] = {k: float(v) if v not in ("", None) else math.nan for k, v in row.items()}
        columns = reader.fieldnames or []
    ordered = [rows[s] for s in sorted(rows)]
    return {name: [r[name] for r in ordered] for name in columns}


def plot(metrics: dict[str, list[float]], output: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    steps = metrics["step"]
    fig, (ax_loss, ax_rate, ax_mem) = plt.subplots(3, 1, figsize=(8, 10), sharex=True)
    ax_loss.plot(steps, metrics["train/loss"], color="tab:blue", label="loss")
    ax_loss.set_ylabel("loss")
    if "train/lr" in metrics:
        ax_lr = ax_loss.twinx()
        ax_lr.plot(steps, metrics["train/lr"], color="tab:orange", linestyle="--", label="lr")
        ax_lr.set_ylabel("lr")
    ax_rate.plot(steps, metrics["train/samples_per_sec"], color="tab:green")
    ax_rate.set_ylabel("samples / s")
    kinds = [n for n, v in metrics.items() if n.startswith("memory/") and n not in _MEMORY_TOTALS and any(v)]
    for i, name in enumerate(kinds):  # kinds often hold equal bytes: distinct dashes keep both lines visible
        ax_mem.plot(steps, [v / 2**20 for v in metrics[name]], label=name.split("/", 1)[1],
                    linestyle=("-", "--", ":", "-.")[i % 4])
    ax_mem.set_ylabel("rank 0 memory (MiB)")
    ax_mem.set_ylim(bottom=0)
    ax_mem.set_xlabel("optimizer step")
    if ax_mem.lines:
        ax_mem.legend(loc="best", fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ze_plot", description="Plot a zeroengine monitor CSV (loss, lr, "
                                     "throughput, memory by kind) to a PNG.")
    parser.add_argument("run", help="the monitor's <output_path>/<job_name> directory, or its metrics.csv")
    parser.add_argument("-o", "--output", default=None, help="PNG to write (default: RUN/metrics.png)")
    args = parser.parse_args(argv)
    path = csv_path(args.run)
    if not os.path.isfile(path):
        print(f"ze_plot: no {path} (enable monitor.csv in the config to write it)", file=sys.stderr)
        return 1
    metrics = read_metrics(path)
    if not metrics.get("step"):
        print(f"ze_plot: {path} has no rows yet", file=sys.stderr)
        return 1
    if "train/loss" not in metrics:
        print(f"ze_plot: {path} is not a zeroengine monitor CSV (no train/loss column)", file=sys.stderr)
        return 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("ze_plot: plotting needs matplotlib, which zeroengine does not install: pip install matplotlib",
              file=sys.stderr)
        return 2
    output = args.output or os.path.join(os.path.dirname(os.path.abspath(path)), "metrics.png")
    try:
        plot(metrics, output, title=os.path.basename(os.path.dirname(os.path.abspath(path))))
    except OSError as err:
        print(f"ze_plot: cannot write {output}: {err.strerror or err}", file=sys.stderr)
        return 1
    print(f"ze_plot: wrote {output} ({len(metrics['step'])} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
