"""The ``kvpage`` command: one sub-command per job."""

from __future__ import annotations

import argparse
import logging
import sys

from kvpage import __version__
from kvpage.entrypoints import generate, plan, serve, simulate, trace


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpage", description="LLM serving on a paged KV cache")
    parser.add_argument("--version", action="version", version=f"kvpage {__version__}")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    generate.add_parser(sub)
    plan.add_parser(sub)
    serve.add_parser(sub)
    simulate.add_parser(sub)
    trace.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, KeyError, RuntimeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"kvpage {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. piped into `head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
