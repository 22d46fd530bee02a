"""A chaos learner: the toy model in its own OS process, with fault options.

    python tests/chaos/learner_worker.py MAILBOX_DIR ID --steps N --out OUT.json [options]

Trains `harness.ToyAdapter` for N steps (`learner.step()` after each, its duration
measured), closes, and writes OUT.json: rounds seen, local step, each parameter's SHA-256,
every event (with a monotonic timestamp) and the longest `step()` calls.

Faults:
  --kill OP:PATTERN:NTH[:after]   SIGKILL this process on the Nth matching mailbox call
  --kill-closing                  count --kill calls only once close() has begun
  --bad-delta N                   the Nth delta this learner computes holds NaN and Inf
  --fsize BYTES@K                 at step K, limit files this process writes to BYTES
                                  (RLIMIT_FSIZE: writes fail with EFBIG, as on a full disk)
  --fsize-restore K               lift the limit again at step K, or later, once a publish
                                  has failed under it (however slow a loaded machine makes
                                  the communication thread)
  --ready-at K                    write OUT.json.ready at step K (the test's cue) and go on
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path

from gradientmail.learner.options import LearnerOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from chaos.harness import KillSwitch, ToyAdapter, event_dict, train_step
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.events import Event
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import LocalMailbox, Mailbox

STALL = 0.05  # step() calls longer than this are listed in the result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mailbox")
    ap.add_argument("learner_id")
    ap.add_argument("--out", required=True)
    ap.add_argument("--worker", type=int, default=0)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--start-step", type=int, default=0)
    ap.add_argument("--sleep", type=float, default=0.005)
    ap.add_argument("--sync-every", type=int, default=4)
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--in-flight", type=int, default=2)
    ap.add_argument("--overlap", type=int, default=-1, help="overlap_steps; -1 for None")
    ap.add_argument("--quorum", type=int, default=1)
    ap.add_argument("--poll", type=float, default=0.01)
    ap.add_argument("--lease-every", type=float, default=0.5)
    ap.add_argument("--lease-timeout", type=float, default=1.5)
    ap.add_argument("--keep", type=int, default=10**6)
    ap.add_argument("--wait-for", type=int, default=0, help="wait for this many live learners")
    ap.add_argument("--kill", action="append", default=[])
    ap.add_argument("--kill-closing", action="store_true")
    ap.add_argument("--bad-delta", type=int, default=-1)
    ap.add_argument("--fsize", default="")
    ap.add_argument("--fsize-restore", type=int, default=-1)
    ap.add_argument("--ready-at", type=int, default=-1)
    args = ap.parse_args()

    alg = DiLoCo(
        sync_every=args.sync_every,
        fragments=args.fragments,
        in_flight=args.in_flight,
        overlap_steps=None if args.overlap < 0 else args.overlap,
        quorum_size=args.quorum,
    )
    events: list[dict[str, object]] = []
    lock = threading.Lock()

    def on_event(e: Event) -> None:
        with lock:
            events.append(event_dict(e))

    mailbox: Mailbox = LocalMailbox(args.mailbox)
    switch = None
    if args.kill:
        switch = KillSwitch(mailbox, args.kill, armed=not args.kill_closing)
        mailbox = switch
    fsize_limit, fsize_at = (-1, -1)
    if args.fsize:
        limit, at = args.fsize.split("@")
        fsize_limit, fsize_at = int(limit), int(at)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death

    adapter = ToyAdapter(seed=args.worker, bad_delta=args.bad_delta)
    learner = Learner(
        adapter,
        alg,
        mailbox,
        args.learner_id,
        on_event=on_event,
        options=LearnerOptions(
            poll_interval=args.poll,
            lease_every=args.lease_every,
            lease_timeout=args.lease_timeout,
            keep_versions=args.keep,
        ),
    )
    learner.start()
    deadline = time.monotonic() + 60
    while len(learner.live_learners) < args.wait_for and time.monotonic() < deadline:
        time.sleep(0.01)
    step_max, step_max_at = 0.0, -1
    stalls: list[list[float]] = []
    limited = False

    def publish_failed() -> bool:
        with lock:
            return any(e["type"] == "PublishFailed" for e in events)

    for step in range(args.start_step, args.start_step + args.steps):
        if step == args.ready_at:
            Path(args.out + ".ready").write_text(str(os.getpid()))
        if step == fsize_at:
            limited = args.fsize_restore >= 0
            resource.setrlimit(resource.RLIMIT_FSIZE,
                               (fsize_limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        if limited and step >= args.fsize_restore and publish_failed():
            limited = False
            hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
            resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        train_step(adapter, args.worker, step)
        t0 = time.monotonic()
        learner.step(16)
        took = time.monotonic() - t0
        if took > step_max:
            step_max, step_max_at = took, step
        if took > STALL:
            stalls.append([step, t0, took])
        if args.sleep:
            time.sleep(args.sleep)
    if switch is not None and args.kill_closing:
        switch.armed = True
    learner.close()
    with lock:
        seen = list(events)
    Path(args.out).write_text(json.dumps({
        "learner": args.learner_id,
        "rounds_seen": learner.rounds_seen,
        "local_step": learner.local_step,
        "params": adapter.digests(),
        "events": seen,
        "step_max": step_max,
        "step_max_at": step_max_at,
        "stalls": stalls,
    }))


if __name__ == "__main__":
    main()
