"""`python -m gradientmail.app.demo_worker SPEC.json`: one learner of `gradientmail demo
--link`, started inside its network namespace with `ip netns exec` by
`gradientmail.app.demo_link.Site`.

It trains as the demo's `train` does and writes each report as a JSON line on its stdout;
everything else it would print goes to its stderr, so the parent reads nothing but
reports from the pipe.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the job of the spec file `argv[0]` (a `demo_link.job_spec`); exit status 0."""
    from gradientmail.app.demo_link import job_from_spec, take_from_file
    from gradientmail.app.demo_runs import train

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m gradientmail.app.demo_worker SPEC.json", file=sys.stderr)
        return 2
    job, budget = job_from_spec(json.loads(Path(args[0]).read_text()))
    reports = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a library's print lands in the log, not among the reports

    def report(item: tuple[Any, ...]) -> None:
        reports.write(json.dumps(item) + "\n")
        reports.flush()

    train(job, report, lambda: take_from_file(budget, job.config.budget))
    reports.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
