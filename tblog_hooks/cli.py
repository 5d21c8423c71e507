"""The ``tblog-hooks`` command line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tblog-hooks", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small model with the logger attached and write runs/")
    demo.add_argument("--logdir", default="runs", help="where to write the TensorBoard run (default: runs)")
    demo.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    demo.add_argument("--every", type=int, default=10, help="log every N optimizer steps (default: 10)")
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from .demo import pick_device, run_demo

        run_dir = run_demo(args.logdir, args.steps, args.every, pick_device(args.device))
        print(f"wrote {run_dir}\nopen it with:  tensorboard --logdir {args.logdir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
