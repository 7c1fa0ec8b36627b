"""The ``dmuon`` command: ``dmuon bench`` and ``dmuon plan``."""

from __future__ import annotations

import sys

USAGE = """usage: dmuon {bench,plan} [options]

  bench   time FSDP2+AdamW, FSDP2+torch.optim.Muon, gather-then-compute and dmuon side by side
  plan    print the ownership plan for a model or a shape list, without training

Run `dmuon bench --help` or `dmuon plan --help` for options."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "bench":
        from dmuon.bench.cli import main as bench_main

        return bench_main(rest)
    if command == "plan":
        from dmuon.bench.plan_cli import main as plan_main

        return plan_main(rest)
    print(f"dmuon: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
