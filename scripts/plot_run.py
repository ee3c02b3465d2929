#!/usr/bin/python3
"""Plots a Lightkeeper run as a PNG: the loss against the outer step (the run, and a reference
run if given), and below it how many groups were in the quorum at each step, with the run's
membership changes marked. Uses matplotlib (Debian's python3-matplotlib, scripts/install-deps.sh).

Inputs: the trainers' --log JSON lines (one per committed outer step and trainer) and an events
file of lines "STEP LABEL" (a mark at one step) or "FIRST-LAST LABEL" (a span of steps, such as a
group's absence). Each event gets its own colour and is named in the legend beside the plot,
never as text over the curves, so labels cannot overlap however close the events are.

usage: plot_run.py OUT.png EVENTS_FILE_OR_- LOG.jsonl [LOG.jsonl ...] [--reference REF.jsonl ...]
       [--reference-label TEXT]
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")  # no display: render to a file
import matplotlib.pyplot as plt  # noqa: E402

# Event colours: distinct from the run (blue) and the reference (grey).
EVENT_COLOURS = ["#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
                 "#bcbd22"]


def read_steps(paths):
    """Per committed step: the mean training loss, the mean eval_loss (None without one) and the
    largest replica_world_size any trainer logged for it."""
    by_step = {}
    for p in paths:
        with open(p, errors="replace") as f:
            for ln in f:
                try:
                    d = json.loads(ln)
                except ValueError:
                    continue
                if "step" not in d or "loss" not in d:
                    continue
                s = by_step.setdefault(d["step"], {"loss": [], "eval": [], "world": 0})
                s["loss"].append(d["loss"])
                if "eval_loss" in d:
                    s["eval"].append(d["eval_loss"])
                s["world"] = max(s["world"], d.get("replica_world_size", 0))
    out = []
    for step in sorted(by_step):
        s = by_step[step]
        ev = sum(s["eval"]) / len(s["eval"]) if s["eval"] else None
        out.append((step, sum(s["loss"]) / len(s["loss"]), ev, s["world"]))
    return out


def read_events(path):
    """(first, last, label) per line of "STEP LABEL" or "FIRST-LAST LABEL"."""
    events = []
    if path == "-":
        return events
    with open(path, errors="replace") as f:
        for ln in f:
            parts = ln.split(None, 1)
            if not parts:
                continue
            where, label = parts[0], parts[1].strip() if len(parts) > 1 else ""
            first, _, last = where.partition("-")
            events.append((float(first), float(last or first), label))
    return events


def parse_args(argv):
    if len(argv) < 4:
        sys.exit(__doc__)
    out, events_path, rest = argv[1], argv[2], argv[3:]
    ref_label = "reference"
    if "--reference-label" in rest:
        i = rest.index("--reference-label")
        if i + 1 >= len(rest):
            sys.exit("plot_run.py: --reference-label needs a text")
        ref_label = rest[i + 1]
        rest = rest[:i] + rest[i + 2:]
    ref_paths = []
    if "--reference" in rest:
        i = rest.index("--reference")
        ref_paths, rest = rest[i + 1:], rest[:i]
    return out, events_path, rest, ref_paths, ref_label


def main(argv):
    out, events_path, run_paths, ref_paths, ref_label = parse_args(argv)
    run, ref = read_steps(run_paths), read_steps(ref_paths)
    if not run and not ref:
        sys.exit("plot_run.py: no loss lines in the logs")
    events = read_events(events_path)
    # Eval loss (of the global weights on fixed batches) where every series has it: it is the
    # figure the summary compares; the training loss depends on which groups ran a step.
    use_eval = all(e is not None for series in (run, ref) for _, _, e, _ in series)
    what = "eval loss of the global weights" if use_eval else "training loss (mean of trainers)"

    fig, (ax_loss, ax_world) = plt.subplots(
        2, 1, sharex=True, figsize=(11, 6.5), gridspec_kw={"height_ratios": [3, 1]})
    # The reference is drawn last, dashed, so that it shows where the two runs are the same.
    for series, label, style in ((run, "this run", dict(color="#1f77b4", lw=2.0)),
                                 (ref, ref_label, dict(color="0.35", lw=1.4, ls="--"))):
        if not series:
            continue
        steps = [s for s, _, _, _ in series]
        ax_loss.plot(steps, [e if use_eval else v for _, v, e, _ in series], label=label, **style)
        ax_world.step(steps, [w for _, _, _, w in series], where="mid", label=label, **style)
    handles = []
    for i, (first, last, label) in enumerate(events):
        colour = EVENT_COLOURS[i % len(EVENT_COLOURS)]
        for ax in (ax_loss, ax_world):
            if last > first:
                h = ax.axvspan(first, last, color=colour, alpha=0.15, lw=0)
            else:
                h = ax.axvline(first, color=colour, lw=1.4, ls=":")
        h.set_label(label)
        handles.append(h)
    ax_loss.set_ylabel(what)
    ax_loss.set_title("loss against outer step, with the run's membership changes")
    ax_loss.grid(alpha=0.3)
    ax_world.set_ylabel("groups in quorum")
    ax_world.set_xlabel("committed outer step")
    ax_world.grid(alpha=0.3)
    ax_world.yaxis.get_major_locator().set_params(integer=True)
    # One legend right of the axes, the curves then one entry per event: no label is drawn
    # over the plot, so none can cover another however close the events are.
    curves, names = ax_loss.get_legend_handles_labels()
    ax_loss.legend(curves + handles, names + [h.get_label() for h in handles], loc="upper left",
                   bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=100, bbox_inches="tight")


if __name__ == "__main__":
    main(sys.argv)
