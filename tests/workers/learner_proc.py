"""A learner in its own OS process, for multi-process tests.

    python tests/workers/learner_proc.py MAILBOX ID --steps N --out OUT.json [options]

Trains the toy model with plain SGD, steps the learner after every optimizer step, closes,
and writes the final parameters and the events it saw to OUT.json. With --pause-at K it
writes OUT.json.ready at step K and waits there until killed (for crash tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path

from gradientmail.learner.options import LearnerOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from toy import inner_step, make_model

from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import WeightedMean
from gradientmail.events import Event, RoundRecorded
from gradientmail.learner.runtime import Learner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mailbox")
    ap.add_argument("learner_id")
    ap.add_argument("--worker", type=int, default=0)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sync-every", type=int, default=3)
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--standard", type=int, default=0, help="standard DiLoCo with this quorum")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--tokens", type=int, default=5, help="tokens per step")
    ap.add_argument("--checkpoint-every", type=int, default=20)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--pause-at", type=int, default=-1)
    ap.add_argument("--start-step", type=int, default=0)
    ap.add_argument("--wait-for", type=int, default=0, help="wait for this many live learners")
    ap.add_argument("--until-merged", action="store_true",
                    help="after --steps, go on training until a commit has merged this "
                    "learner's contribution (at most 120 s more)")
    args = ap.parse_args()

    if args.standard:
        alg = DiLoCo(
            sync_every=args.sync_every,
            fragments=1,
            in_flight=1,
            overlap_steps=0,
            merge=WeightedMean(),
            quorum_size=args.standard,
            checkpoint_every=args.checkpoint_every,
        )
    else:
        alg = DiLoCo(
            sync_every=args.sync_every, fragments=args.fragments, in_flight=min(2, args.fragments)
        )
    seen: list[dict[str, object]] = []
    merged = threading.Event()

    def on_event(e: Event) -> None:
        if isinstance(e, RoundRecorded) and args.learner_id in e.participants:
            merged.set()
        seen.append(
            {
                "type": type(e).__name__,
                **{
                    f.name: getattr(e, f.name)
                    for f in dataclasses.fields(e)
                    if isinstance(getattr(e, f.name), int | float | str | None)
                },
            }
        )

    model = make_model()
    learner = Learner(
        TorchAdapter(model),
        alg,
        args.mailbox,
        args.learner_id,
        on_event=on_event,
        options=LearnerOptions(poll_interval=0.01, lease_every=2.0, lease_timeout=6.0),
    )
    learner.start()
    if args.wait_for:
        learner.wait_for_learners(args.wait_for, timeout=120)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step in range(args.start_step, args.start_step + args.steps):
        if step == args.pause_at:
            Path(args.out + ".ready").write_text(str(os.getpid()))
            while True:
                time.sleep(1)
        inner_step(model, opt, args.worker, step)
        learner.step(args.tokens)
        if args.sleep:
            time.sleep(args.sleep)
    # However slowly a loaded machine runs this process, it trains on until it has taken
    # part in a round (the test's claim), not for a number of steps that may end first.
    step, deadline = args.start_step + args.steps, time.monotonic() + 120
    while args.until_merged and not merged.is_set() and time.monotonic() < deadline:
        inner_step(model, opt, args.worker, step)
        learner.step(args.tokens)
        step += 1
        time.sleep(max(args.sleep, 0.01))
    learner.close()
    params = {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}
    Path(args.out).write_text(
        json.dumps(
            {
                "params": params,
                "rounds_seen": learner.rounds_seen,
                "events": seen,
            }
        )
    )


if __name__ == "__main__":
    main()
