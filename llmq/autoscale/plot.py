"""A replay's picture: arrivals, the queue and what runs, and the workers, against time, one panel
each, written as a PNG (matplotlib's Agg backend: no display needed)."""
from __future__ import annotations

from datetime import datetime
from pathlib import Path

from llmq.autoscale.replay import ReplayResult


def plot_replay(result: ReplayResult, path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    samples = result.samples
    minutes = [s.t / 60 for s in samples]
    figure, (arrivals, load, workers) = plt.subplots(3, 1, sharex=True, figsize=(10, 7.5),
                                                     gridspec_kw={"height_ratios": [1, 1.2, 1]})
    per_minute: dict[int, int] = {}  # a tick's arrivals are too few to read; a minute's are not
    for s in samples:
        per_minute[int((s.t - 1e-9) // 60)] = per_minute.get(int((s.t - 1e-9) // 60), 0) + s.arrivals
    arrivals.bar(list(per_minute), list(per_minute.values()), width=1.0, align="edge", color="tab:gray")
    arrivals.set_ylabel("arrivals / min")
    load.fill_between(minutes, [s.queued for s in samples], step="pre", color="tab:red", alpha=0.4, label="queued")
    load.plot(minutes, [s.in_flight for s in samples], color="tab:blue", linewidth=1.2, label="in flight")
    load.set_ylabel("requests")
    load.legend(loc="upper left")
    workers.step(minutes, [s.desired for s in samples], where="pre", color="tab:orange", label="desired (started)")
    workers.step(minutes, [s.ready for s in samples], where="pre", color="tab:green", label="ready")
    if any(s.warm for s in samples):
        workers.fill_between(minutes, [s.warm for s in samples], step="pre", color="tab:purple", alpha=0.15,
                             label="kept warm (profile)")
    workers.set_ylabel("workers")
    workers.set_ylim(bottom=0)
    workers.legend(loc="upper left")
    if result.start is not None:
        workers.xaxis.set_major_formatter(FuncFormatter(
            lambda m, _: datetime.fromtimestamp(result.start + m * 60).strftime("%a %H:%M")))
        workers.set_xlabel("local time")
    else:
        workers.set_xlabel("minutes")
    figure.suptitle(title or "autoscaler replay")
    figure.text(0.01, 0.005, result.summary(), fontsize=7.5, color="dimgray")
    figure.tight_layout(rect=(0, 0.02, 1, 1))
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
