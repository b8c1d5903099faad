"""`python -m tftrain.search RUN_DIR [--target KEY=VALUE]... [--set KEY=VALUE]... [--dry-run]`."""
from __future__ import annotations

import argparse
import sys
import traceback

EPILOG = """examples:
  python -m tftrain.search runs/image_transfer --target max_latency_ratio=0.5
  python -m tftrain.search runs/text --target max_bytes=250KB --target max_accuracy_drop=0.01
  python -m tftrain.search runs/quickstart --target max_bytes=40KB --dry-run

exit codes: 0 a candidate meets the target (search/chosen/ holds it); 3 none does (the
closest is exported to search/chosen/, the front written); 2 bad arguments, config or run
directory; 1 a runtime failure; 42 stopped by SIGTERM/SIGINT (rerun to resume)."""


def main(argv=None) -> int:
    from tftrain.core import console, exit_codes
    from tftrain.core.config_types import ConfigError

    parser = argparse.ArgumentParser(
        prog="python -m tftrain.search", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compress a completed run's dense model to a deployment budget: the "
                    "most accurate, smallest, fastest file within it, found by fine-tuning "
                    "candidates from the run's checkpoints.")
    parser.add_argument("run_dir", help="a completed run's directory (runs/<run.name>)")
    parser.add_argument("--target", action="append", default=[], metavar="KEY=VALUE",
                        help="a compression.target setting, e.g. max_bytes=300KB, "
                             "max_latency_ms=1.0, max_latency_ratio=0.5, max_accuracy_drop=0.01")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any other config key, for every candidate")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the candidates and the time estimate, run nothing")
    args = parser.parse_args(argv)
    import signal

    def stop(signum, frame):        # SIGTERM as SIGINT: the running candidate stops safely
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    from tftrain.search import search
    try:
        record = search(args.run_dir, args.target, args.set, dry_run=args.dry_run)
    except ConfigError as err:
        for problem in err.problems:
            print(console.problem("tftrain: config error: ", problem), file=sys.stderr)
        return exit_codes.CONFIG
    except KeyboardInterrupt:
        print("tftrain: search interrupted; rerun the same command to resume", file=sys.stderr)
        return exit_codes.PREEMPTED
    except Exception as err:
        traceback.print_exc()
        print(f"tftrain: error: {type(err).__name__}: {err}", file=sys.stderr)
        return exit_codes.RUNTIME
    if args.dry_run or record.get("met"):
        return exit_codes.OK
    print("tftrain: target missed: no candidate meets it; the closest is in "
          f"{record.get('chosen_file')}", file=sys.stderr)
    return exit_codes.TARGET_MISSED


if __name__ == "__main__":
    sys.exit(main())
