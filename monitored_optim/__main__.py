"""Command line: ``python -m monitored_optim report RUN_DIR [--plot FILE.png] [--params GLOB] [--heatmap FILE.png]
[--histograms FILE.png] [--last N]``.

Also installed as the console script ``monitored-optim``. Exit status: 0 on success, 1 when the run
cannot be read or rendered (one line on stderr, no traceback), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys

PROG = "monitored-optim"


def parser() -> argparse.ArgumentParser:
    """The argument parser: one subcommand, ``report``."""
    top = argparse.ArgumentParser(prog=PROG, description="Tools for runs logged by monitored_optim.")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    report = sub.add_parser(
        "report", help="print the per-layer table of a run and optionally plot it",
        description="Read a run written by the jsonl or tensorboard backend (metrics.jsonl preferred "
                    "when both exist) and print one row per parameter: latest and median update-to-data "
                    "ratio, grad-to-data ratio and update norm, with a mark for layers outside the "
                    "healthy band [-4, -2] or with health warnings.")
    report.add_argument("run_dir", metavar="RUN_DIR",
                        help="the run's logdir (holds metrics.jsonl or events.out.tfevents.* files); a later run kept "
                             "apart in it is read by its own path, RUN_DIR/run2")
    report.add_argument("--plot", metavar="FILE.png",
                        help="also save the update-to-data lines of a few parameters (--params) and the global "
                             "norms to this image")
    report.add_argument("--params", metavar="GLOB",
                        help="the parameters --plot and --histograms draw, a glob on their names (default: the "
                             "matrices with the highest and lowest median ratio)")
    report.add_argument("--heatmap", metavar="FILE.png",
                        help="also save every parameter's update-to-data ratio as a heatmap to this image")
    report.add_argument("--histograms", metavar="FILE.png",
                        help="also save the update histogram over the logged steps of a few parameters (--params) "
                             "to this image, from the run's histograms.jsonl (the histograms family)")
    report.add_argument("--last", metavar="N", type=_positive, default=20,
                        help="medians cover the last N logged steps (default 20)")
    return top


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = parser().parse_args(argv)
    from .report import ReportError, load_run, plot_heatmap, plot_histograms, plot_run, print_report, summarize

    try:
        run = load_run(args.run_dir)
        print_report(summarize(run, last=args.last))
        if args.plot is not None:
            print(f"plot written to {plot_run(run, args.plot, params=args.params)}")
        if args.heatmap is not None:
            print(f"heatmap written to {plot_heatmap(run, args.heatmap)}")
        if args.histograms is not None:
            print(f"histograms written to {plot_histograms(run, args.histograms, params=args.params)}")
    except ReportError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # output piped into `head` or similar: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


if __name__ == "__main__":
    sys.exit(main())
