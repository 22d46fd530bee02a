"""A chaos closer: a standalone Syncer in its own OS process, with a kill switch.

    python tests/chaos/closer_worker.py MAILBOX_DIR CLOSER_ID --rounds N --out OUT.json
        [--poll S] [--keep K] [--kill OP:PATTERN:NTH[:after]] [--go FILE]

Polls until round N−1 has a record, then writes OUT.json: the rounds it closed and every
event. With --go it first writes OUT.json.ready and waits for FILE, so that several
closers start racing at the same moment. The syncer lists the leases itself; a run written
by hand holds none, so every round closes on the contributions first seen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chaos.harness import KillSwitch, event_dict
from gradientmail.errors import GradientmailError
from gradientmail.events import Event, PollFailed
from gradientmail.mailbox import LocalMailbox, Mailbox
from gradientmail.run.protocol import Exchange
from gradientmail.syncer.runtime import CloserSettings, Syncer


async def close_rounds(args: argparse.Namespace, events: list[dict[str, object]]) -> int:
    def on_event(e: Event) -> None:
        events.append(event_dict(e))

    mailbox: Mailbox = LocalMailbox(args.mailbox)
    if args.kill:
        mailbox = KillSwitch(mailbox, args.kill)
    syncer = Syncer.open(mailbox, closer_id=args.closer_id, on_event=on_event,
                         settings=CloserSettings(poll_interval=args.poll,
                                                 keep_versions=args.keep))
    watch = Exchange(LocalMailbox(args.mailbox))
    while await watch.read_round(args.rounds - 1) is None:
        try:
            await syncer.poll()
        except (GradientmailError, OSError) as exc:
            on_event(PollFailed(args.closer_id, repr(exc)))
        await asyncio.sleep(args.poll)
    return syncer.rounds_closed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mailbox")
    ap.add_argument("closer_id")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--poll", type=float, default=0.05)
    ap.add_argument("--keep", type=int, default=10**6)
    ap.add_argument("--kill", action="append", default=[])
    ap.add_argument("--go", default="")
    args = ap.parse_args()
    if args.go:
        Path(args.out + ".ready").write_text("ready")
        deadline = time.monotonic() + 60
        while not Path(args.go).exists() and time.monotonic() < deadline:
            time.sleep(0.005)
    events: list[dict[str, object]] = []
    closed = asyncio.run(close_rounds(args, events))
    Path(args.out).write_text(json.dumps({"closer": args.closer_id, "rounds_closed": closed,
                                          "events": events}))


if __name__ == "__main__":
    main()
