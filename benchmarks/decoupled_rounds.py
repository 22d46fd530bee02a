"""Read back a run of benchmarks/decoupled.py round by round: who took part in each round,
the held-out loss of every commit, and the run's last rounds replayed with and without
cohort shares.

    python benchmarks/decoupled_rounds.py WORKDIR [--arm decoupled-healthy-m8]
                                          [--steps 300] [--no-curve] [--no-replay]

WORKDIR is the directory decoupled.py prints (`workdir /tmp/gm-decoupled-...`); it keeps
every commit (`keep_versions`), so each one can be loaded and evaluated.

The replay applies the run's stored merged steps again from Θ⁰ with the run's own outer
step, each round's step multiplied by a factor: 1 reproduces the run; in the *last rounds*
(from the first commit that holds some learner's last step, `--steps`) the factor turns
the run's rule around: a run with cohort shares takes those rounds back to full steps
(1/share), a run without them takes them to their share (`rounds.cohort_share` of the
cohort `merging.cohort_of` finds in the records). It is open loop: the learners' later
deltas are the run's, so it says what those rounds' steps did to the final model, and
nothing about what the learners would have trained after a different commit (no delta
depends on the last rounds' commits, which is why only they are replayed).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import convergence as conv  # benchmarks/ is not a package
import decoupled

__all__ = ["main", "replay", "rows"]


def rows(records: list[Any], learners: list[str]) -> list[str]:
    """One line a round: fragment, rule, mean cosine, latency against the window, and
    each learner's steps@local_step (---- when it took no part)."""
    out = []
    for rec in records:
        by = {p.learner: p for p in rec.participants}
        cells = " ".join(f"{by[x].steps:>3}@{by[x].local_step:<3}" if x in by else "  ----   "
                         for x in learners)
        a = rec.arrival
        rule = rec.step.rule if rec.step is not None else "-"
        late = "" if a is None else f" lat {a.latency:5.2f}/{a.window:.1f}"
        missed = "" if a is None or not a.missed else f" missed {','.join(a.missed)}"
        out.append(f"r{rec.round:<3} f{rec.fragment} n{len(rec.participants)} {rule:8} "
                   f"cos {rec.mean_cosine or 0:.3f}{late} | {cells}{missed}")
    return out


async def replay(box: Path, steps: int) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The final parameters as the run's steps give them, and with its last rounds'
    rule turned around; and the first of those rounds."""
    from gradientmail.adapters.torch import to_torch
    from gradientmail.algorithms.registry import algorithm_from_json
    from gradientmail.algorithms.rounds import cohort_share
    from gradientmail.mailbox import LocalMailbox
    from gradientmail.run.protocol import Exchange
    from gradientmail.run.replica import Replica
    from gradientmail.syncer.merging import cohort_of
    from gradientmail.wire.tensor_bytes import TensorBytes

    ex = Exchange(LocalMailbox(box))
    manifest = await ex.read_manifest()
    assert manifest is not None, f"no run in {box}"
    alg = algorithm_from_json(dict(manifest.algorithm))
    records = await ex.rounds_after(-1)
    last = next((r.round for r in records if any(p.local_step >= steps for p in r.participants)),
                len(records))
    finals = []
    for turn in (False, True):
        replica = Replica(ex, manifest, alg)
        states = {f: await replica.at(f, None) for f in range(len(manifest.plan))}
        previous: dict[int, Any] = {}
        for rec in records:
            f = rec.fragment
            assert rec.step is not None, "replicated steps only"
            entries = await ex.store.fetch_tensors(rec.step.payload, None)
            assert entries is not None, f"round {rec.round}'s step is swept"
            factor = 1.0
            if turn and rec.round >= last:
                missed = () if rec.arrival is None else rec.arrival.missed
                cohort = {p.learner for p in rec.participants} | cohort_of(previous.get(f), missed)
                share = cohort_share([p.steps for p in rec.participants], alg.sync_every,
                                     len(cohort))
                factor = 1 / share if getattr(alg, "cohort_share", False) else share
            if factor != 1.0:
                entries = {n: TensorBytes.from_numpy(t.to_numpy() * factor)
                           for n, t in entries.items()}
            state = states[f]
            assert state is not None
            states[f] = alg.apply_step(state, entries, rec.step.format, rec.step.rule)
            previous[f] = rec
        finals.append({n: to_torch(t) for s in states.values() if s is not None
                       for n, t in s.theta.items()})
    return finals[0], finals[1], last


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--arm", default="decoupled-healthy-m8")
    ap.add_argument("--steps", type=int, default=decoupled.BASE.steps,
                    help="steps each learner trained (the run's last rounds hold the last)")
    ap.add_argument("--no-curve", action="store_true", help="no loss of every commit")
    ap.add_argument("--no-replay", action="store_true")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(2)
    wd, box = args.workdir, args.workdir / args.arm
    vocab, val = int(torch.load(wd / "vocab.pt")), torch.load(wd / "val.pt")
    records = conv.records_of(box)
    learners = sorted({p.learner for r in records for p in r.participants})
    print("\n".join(rows(records, learners)))

    def loss(state: dict[str, Any]) -> float:
        return conv.evaluate(conv.load_into(conv.build_model(decoupled.BASE, vocab), state), val)

    frags, seen, curve = max(r.fragment for r in records) + 1, 0, []
    for i, rec in enumerate([] if args.no_curve else records):
        seen += sum(p.tokens for p in rec.participants)
        curve.append(f"r{i} {seen // frags // 1000}k {loss(conv.committed_state(box, i)):.4f}")
    if curve:
        print("held-out loss per commit (tokens per learner, thousands):", "; ".join(curve))
    if not args.no_replay:
        run_, turned, last = asyncio.run(replay(box, args.steps))
        print(f"replay: as run {loss(run_):.4f}; rounds {last}+ turned around "
              f"{loss(turned):.4f}")


if __name__ == "__main__":
    main()
