"""The `gradientmail` command: `status`, `log`, `plot`, `verify`, `sync`, `export`, `sweep`,
`demo`.

    gradientmail status URL [--json]
    gradientmail log URL [--json | --csv] [--from R]
    gradientmail plot URL OUT.png [--from R]
    gradientmail verify URL [--from R] [--json]
    gradientmail sync URL [--poll-interval S] [--closer-id ID] [--keep N]
    gradientmail export URL OUT.safetensors
    gradientmail export URL --hf DIR (--config RECIPE.yaml | --n-head N)
    gradientmail sweep URL [--keep N]
    gradientmail demo [--learners N] [--steps S] [--slow F] [--outlier-factor K] ...
    gradientmail demo --link 20mbit [...]       # as root: learners behind shaped links

URL is a mailbox URL (`s3://bucket/prefix`, `file:///dir`, or a plain path). For S3,
`--endpoint-url` names a MinIO/R2/moto endpoint; without it boto3 reads `AWS_ENDPOINT_URL`
and the rest of the usual AWS environment itself. `GRADIENTMAIL_RUN_KEY` holds the key of
an authenticated run (read by `gradientmail.wire.auth.env_run_key`, as everywhere).

Each subcommand is a function `cmd_<name>(args) -> int` registered in `build_parser`;
`main(argv)` parses, runs it, and turns a `GradientmailError` into one line on stderr,
`gradientmail: error: <message>`, with exit status 1 (usage errors exit 2, as argparse
does). The work itself is in small async functions (`read_status`, `newest_model`) that
tests and other tools can call on an `Exchange`; `export` reads the model as every user
does, with `gradientmail.read_committed`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from gradientmail import __version__
from gradientmail.app.record_traffic import record_traffic
from gradientmail.errors import ConfigError, GradientmailError
from gradientmail.learner.options import LearnerOptions
from gradientmail.mailbox.base import Mailbox
from gradientmail.mailbox.url import open_mailbox
from gradientmail.run.lease import CLOSERS
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import require_manifest
from gradientmail.traffic import S3_STANDARD, Prices
from gradientmail.wire.auth import env_run_key
from gradientmail.wire.record_json import check_learner_id

__all__ = [
    "TRAFFIC_ROUNDS",
    "build_parser",
    "demo_config",
    "format_status",
    "main",
    "read_status",
]

_PROG = "gradientmail"
#: The newest round records `status` reads for its traffic figures (GETs in flight at once).
TRAFFIC_ROUNDS = 32
T = TypeVar("T")


# -- shared ------------------------------------------------------------------------------


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The mailbox options of the command line."""
    return {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}


def _open(args: argparse.Namespace, *, read_only: bool = False) -> Mailbox:
    return open_mailbox(args.url, read_only=read_only, **_options(args))


def _with_mailbox(args: argparse.Namespace, work: Callable[[Exchange], Awaitable[T]], *,
                  read_only: bool = True) -> T:
    """Open the mailbox (read-only unless told otherwise: a command that only reads leaves
    a mistyped path as it found it, uncreated), run `work(exchange)` on a fresh event
    loop, close the mailbox."""

    async def go() -> T:
        mailbox = _open(args, read_only=read_only)
        try:
            return await work(Exchange(mailbox, run_key=env_run_key()))
        finally:
            await mailbox.close()

    return asyncio.run(go())


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.3g} s"


# -- status ------------------------------------------------------------------------------


async def read_status(ex: Exchange, url: str,
                      prices: Prices = S3_STANDARD) -> dict[str, Any]:
    """What `gradientmail status --json` prints: a JSON-ready summary of the run.

    Reads the manifest, the newest `TRAFFIC_ROUNDS` round records (and each fragment's
    newest), the leases and the open round's contributions and claims; downloads no
    payload. `live_learners` are the learners holding a lease: one look cannot tell a
    lease left by a crashed learner from a live one (learners release theirs on close;
    the syncer judges them over time); `standalone_closers` likewise the `gradientmail
    sync` processes holding a lease under `closers/`. `traffic` is what those records tell
    of the bytes and writes per round and per learner-hour
    (`gradientmail.app.record_traffic`), or None before the first commit.
    """
    manifest = await require_manifest(ex, url)
    plan = manifest.plan
    newest = await ex.newest_round()
    latest = await ex.latest_commit_per_fragment(len(plan), newest)
    last = max(latest.values(), key=lambda rec: rec.round, default=None)
    leases = await ex.leases()
    closers = await ex.leases(CLOSERS)
    open_round = newest + 1
    window = await asyncio.gather(*(ex.read_round(r) for r in
                                    range(max(newest - TRAFFIC_ROUNDS + 1, 0), newest + 1)))
    traffic = record_traffic([rec for rec in window if rec is not None], len(leases),
                             prices=prices)
    fragments = []
    for p, names in enumerate(plan):
        rec = latest.get(p)
        fragments.append({
            "fragment": p,
            "version": rec.version if rec is not None else 0,
            "round": rec.round if rec is not None else None,
            "tensors": len(names),
            "theta_bytes": (manifest.init_size(p) if rec is None
                            else rec.theta.size if rec.theta is not None else None),
            "outer_bytes": rec.outer.size if rec is not None and rec.outer is not None
            else None,
            "step_bytes": rec.step.payload.size
            if rec is not None and rec.step is not None else None,
            "update_bytes": rec.update.payload.size
            if rec is not None and rec.update is not None else None,
        })
    algorithm = dict(manifest.algorithm)
    try:
        from gradientmail.algorithms.registry import algorithm_from_json

        open_fragment: int | None = algorithm_from_json(algorithm).schedule_for(
            len(plan)).fragment_of(open_round)
    except GradientmailError:
        open_fragment = None
    estimates = last.estimates.to_json() if last is not None else {
        "step": None, "quorum": None, "sync": None}
    return {
        "url": url,
        "creator": manifest.creator,
        "algorithm": algorithm,
        "tensors": len(manifest.schema),
        "parameters": sum(p.numel for p in manifest.schema.params),
        "model_bytes": manifest.schema.total_nbytes,
        "rounds_committed": newest + 1,
        "fragments": fragments,
        "live_learners": sorted(leases),
        "leases": dict(sorted(leases.items())),
        "standalone_closers": sorted(closers),
        "estimates": estimates,
        "last_round": None if last is None else {
            "round": last.round,
            "fragment": last.fragment,
            "version": last.version,
            "closer": last.closer,
            "participants": [p.learner for p in last.participants],
            "tokens": sum(p.tokens for p in last.participants),
            "dropped": [{"learner": d.learner, "reason": d.reason} for d in last.dropped],
            "mean_cosine": last.mean_cosine,
        },
        "traffic": None if traffic is None else traffic.to_json(),
        "open_round": {
            "round": open_round,
            "fragment": open_fragment,
            "contributions": sorted(await ex.publishers(open_round)),
            "claims": await ex.round_claims(open_round),
        },
    }


def format_status(status: dict[str, Any]) -> str:
    """The readable form of `read_status`'s summary."""
    alg = status["algorithm"]
    if alg.get("type") == "diloco":
        algorithm = (f"DiLoCo H={alg.get('sync_every')} P={alg.get('fragments')} "
                     f"tau={alg.get('in_flight')} quorum={alg.get('quorum_size')} "
                     f"outer lr={alg.get('outer_lr')} momentum={alg.get('outer_momentum')}")
    else:
        algorithm = str(alg.get("type"))
    last, opened, est = status["last_round"], status["open_round"], status["estimates"]
    lines = [
        f"run         {status['url']} (created by {status['creator']})",
        f"algorithm   {algorithm}",
        f"model       {status['tensors']} tensors, {status['parameters']:,} parameters, "
        f"{_size(status['model_bytes'])}",
        f"rounds      {status['rounds_committed']} committed",
    ]
    if last is not None:
        cosine = "-" if last["mean_cosine"] is None else f"{last['mean_cosine']:.3f}"
        lines.append(
            f"last round  {last['round']}: fragment {last['fragment']} v{last['version']}, "
            f"closed by {last['closer']}, {len(last['participants'])} participants "
            f"({last['tokens']:,} tokens), {len(last['dropped'])} dropped, mean cosine {cosine}"
        )
    frag = "" if opened["fragment"] is None else f" (fragment {opened['fragment']})"
    who = ", ".join(opened["contributions"]) or "none yet"
    claims = ", ".join(str(c) for c in opened["claims"]) or "none"
    lines.append(f"open round  {opened['round']}{frag}: contributions {who}; claims {claims}")
    learners = status["live_learners"]
    lines.append(f"learners    {len(learners)} holding a lease"
                 + (f": {', '.join(learners)}" if learners else ""))
    closers = status["standalone_closers"]
    lines.append(f"closers     {len(closers)} standalone holding a lease"
                 + (f": {', '.join(closers)} (the learners leave it the rounds)" if closers
                    else " (the learners close the rounds)"))
    lines.append(f"estimates   step {_seconds(est['step'])}, quorum {_seconds(est['quorum'])},"
                 f" sync {_seconds(est['sync'])}")
    lines.extend(_traffic_lines(status["traffic"]))
    lines.append("")
    rows = [("fragment", "version", "round", "tensors", "theta", "outer", "update", "step")]
    for f in status["fragments"]:
        rows.append((str(f["fragment"]), str(f["version"]),
                     "init" if f["round"] is None else str(f["round"]), str(f["tensors"]),
                     _size(f["theta_bytes"]), _size(f["outer_bytes"]), _size(f["update_bytes"]),
                     _size(f["step_bytes"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                     .rstrip())
    return "\n".join(lines)


def _traffic_lines(traffic: dict[str, Any] | None) -> list[str]:
    if traffic is None:
        return []
    per, hourly = traffic["per_round"], traffic["per_learner_hour"]
    contributions = per["contribution_bytes"]
    lines = [
        f"traffic     rounds {traffic['first_round']}-{traffic['last_round']}, per round: "
        f"{per['uploads']:.1f} contributions up ("
        f"{'-' if contributions is None else _size(round(contributions))}), commit "
        f"{_size(round(per['commit_bytes']))} up, {_size(round(per['follow_bytes']))} down "
        f"per learner, {per['puts']:.1f} PUTs"
    ]
    if hourly is not None:
        lines.append(
            f"            per learner-hour ({traffic['learners']} learners, "
            f"{traffic['rounds_per_hour']:.1f} rounds/h): {_size(round(hourly['bytes_up']))} "
            f"up, {_size(round(hourly['bytes_down']))} down, at least "
            f"${hourly['usd']:.5f} (writes, record GETs and egress; polls not seen here)"
        )
    return lines


def cmd_status(args: argparse.Namespace) -> int:
    prices = Prices(args.put_per_1000, args.get_per_1000, args.egress_per_gb)
    status = _with_mailbox(args, lambda ex: read_status(ex, args.url, prices))
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        print(format_status(status))
    return 0


# -- log, plot ---------------------------------------------------------------------------


def _history(args: argparse.Namespace) -> list[Any]:
    from gradientmail.app.history import read_history

    async def work(ex: Exchange) -> list[Any]:
        await require_manifest(ex, args.url)
        return await read_history(ex, args.first)

    return _with_mailbox(args, work)


def cmd_log(args: argparse.Namespace) -> int:
    from gradientmail.app.history import format_csv, format_json, format_table, history_rows

    rows = history_rows(_history(args))
    if args.json:
        print(format_json(rows))
    elif args.csv:
        sys.stdout.write(format_csv(rows))
    elif rows:
        print(format_table(rows))
    else:
        print(f"no round of {args.url} is committed yet")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from gradientmail.app.history import plot_history

    records = _history(args)
    try:
        plot_history(records, args.out, title=f"gradientmail run {args.url}")
    except OSError as exc:
        raise ConfigError(f"cannot write {args.out!r}: {exc.strerror or exc}") from exc
    learners = {p.learner for rec in records for p in rec.participants}
    print(f"wrote {args.out}: {len(records)} rounds, {len(learners)} learners")
    return 0


# -- export ------------------------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> int:
    from gradientmail.run.committed import read_committed

    if (args.out is None) == (args.hf is None):
        raise ConfigError(
            "export writes one safetensors file (OUT.safetensors) or, with --hf DIR, a "
            f"Hugging Face model directory; got {'both' if args.out else 'neither'}: "
            "give one of them"
        )
    if args.hf is None and (args.config is not None or args.n_head is not None):
        raise ConfigError("--config and --n-head describe the model of --hf DIR; add --hf "
                          "DIR (and drop OUT.safetensors)")
    if args.hf is not None:
        return _export_hf(args)
    committed = read_committed(args.url, run_key=env_run_key(), **_options(args))
    try:
        from gradientmail.app.export import write_safetensors

        size = write_safetensors(args.out, dict(committed.tensors), committed.metadata)
    except OSError as exc:
        raise ConfigError(f"cannot write {args.out!r}: {exc.strerror or exc}") from exc
    print(f"wrote {args.out}: {len(committed.tensors)} tensors, {_size(size)}, round "
          f"{committed.round} (fragment versions {list(committed.versions)})")
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from gradientmail.app.export import (
        gpt2_config,
        gpt2_shapes,
        hf_tensors,
        read_config_file,
        write_hf,
    )
    from gradientmail.run.committed import read_committed

    source = None if args.config is None else read_config_file(args.config)
    # The configuration is settled from the manifest before the model is downloaded.
    manifest = _with_mailbox(args, lambda ex: require_manifest(ex, args.url))
    shapes = {p.name: tuple(p.shape) for p in manifest.schema.params}
    prefix, _ = gpt2_shapes(shapes)
    config = gpt2_config(shapes, n_head=args.n_head, source=source,
                         source_name=f"--config {args.config!r}")
    committed = read_committed(args.url, run_key=env_run_key(), **_options(args))
    tensors, tied = hf_tensors(committed.tensors, prefix)
    config["tie_word_embeddings"] = tied
    _, size = write_hf(args.hf, tensors, config, committed.metadata)
    print(f"wrote {args.hf}: config.json (GPT-2, {config['n_layer']} layers, "
          f"{config['n_embd']} wide, {config['n_head']} heads, vocabulary "
          f"{config['vocab_size']}) and model.safetensors ({len(tensors)} tensors, "
          f"{_size(size)}), round {committed.round} (fragment versions "
          f"{list(committed.versions)}); load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({args.hf!r})")
    return 0


# -- sweep -------------------------------------------------------------------------------


def cmd_sweep(args: argparse.Namespace) -> int:
    async def work(ex: Exchange) -> list[str]:
        await require_manifest(ex, args.url)
        return await ex.sweep(args.keep)

    # Look for the run read-only first: a mistyped path is reported, not created.
    _with_mailbox(args, lambda ex: require_manifest(ex, args.url))
    doomed = _with_mailbox(args, work, read_only=False)
    print(f"swept {len(doomed)} keys from {args.url} (kept the newest {args.keep} "
          "versions of each fragment, its newest checkpoint and the steps since)")
    return 0


# -- verify ------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit status 0 when every round checked held (swept and held rounds, whose merges
    cannot be re-derived, are no failures unless their chain breaks), 1 when one did not
    (or the run cannot be read)."""
    from gradientmail.app.verify import verify_run
    from gradientmail.app.verify_report import format_report

    report = _with_mailbox(args, lambda ex: verify_run(ex, args.url, start=args.from_round))
    if args.json:
        print(json.dumps(report.to_json(), indent=2, sort_keys=True))
    else:
        print(format_report(report))
    return 0 if report.ok else 1


# -- sync --------------------------------------------------------------------------------


def _default_closer_id() -> str:
    from gradientmail.learner.runtime import default_learner_id

    return ("sync-" + default_learner_id())[:64]


async def _sync(args: argparse.Namespace, closer: str) -> tuple[int, str]:
    from gradientmail.syncer.runtime import CloserSettings, Syncer

    mailbox = _open(args)
    syncer = Syncer.open(mailbox, run_key=env_run_key(), closer_id=closer,
                         settings=CloserSettings(poll_interval=args.poll_interval,
                                                 keep_versions=args.keep,
                                                 lease_timeout=args.lease_timeout))
    stop = asyncio.Event()
    caught: list[str] = []
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        caught.append(sig.name)
        stop.set()

    signals = [signal.SIGINT, signal.SIGTERM]
    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        if await syncer.exchange.read_manifest() is None:
            print(f"{_PROG} sync: no run in {args.url} yet; waiting for its first learner",
                  file=sys.stderr, flush=True)
        print(f"{_PROG} sync: closing rounds of {args.url} as {closer!r} "
              "(Ctrl-C or SIGTERM to stop)", file=sys.stderr, flush=True)
        await syncer.run(stop)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await mailbox.close()
    return syncer.rounds_closed, caught[0] if caught else "stop"


def cmd_sync(args: argparse.Namespace) -> int:
    if not args.poll_interval > 0:
        raise ConfigError(f"--poll-interval {args.poll_interval} must be > 0 seconds")
    closer = check_learner_id(args.closer_id or _default_closer_id())
    if not args.quiet:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
    closed, why = asyncio.run(_sync(args, closer))
    print(f"{_PROG} sync: stopped by {why} after closing {closed} "
          f"round{'' if closed == 1 else 's'} of {args.url} as {closer!r}", flush=True)
    return 0


# -- demo --------------------------------------------------------------------------------


def demo_config(args: argparse.Namespace) -> Any:
    """The `DemoConfig` that `gradientmail demo ARGS` runs."""
    from gradientmail.app.demo_runs import LINK_DEFAULTS, DemoConfig

    options: dict[str, Any] = {
        k: v for k, v in (("learners", args.learners), ("steps", args.steps),
                          ("slow", args.slow)) if v is not None
    }
    if args.outlier_factor is not None:
        options["diloco"] = (("outlier_factor", args.outlier_factor),)
    if args.link is not None:
        options = {**LINK_DEFAULTS, **options, "link": args.link}
    return DemoConfig(mailbox=args.mailbox, data=args.data, **options)


def cmd_demo(args: argparse.Namespace) -> int:
    from gradientmail.app.demo import run_demo

    run_demo(demo_config(args), as_json=args.json)
    return 0


# -- parser ------------------------------------------------------------------------------


def _positive_int(text: str, low: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
    return value


def _round(text: str) -> int:
    return _positive_int(text, 0)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; each subcommand sets `func` to its `cmd_<name>`."""
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Train one model on many machines that share nothing but a bucket.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    mailbox = argparse.ArgumentParser(add_help=False)
    mailbox.add_argument("url", metavar="URL",
                         help="the run's mailbox: s3://bucket/prefix, file:///dir or a path")
    mailbox.add_argument("--endpoint-url", default=None, metavar="URL",
                         help="S3 endpoint (MinIO, R2, moto); default: AWS_ENDPOINT_URL")

    p = sub.add_parser("status", parents=[mailbox], help="rounds, versions, learners, bytes",
                       description="Summarize a run: rounds committed, each fragment's "
                       "version and payload sizes, learners holding a lease, estimates.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    d = S3_STANDARD
    p.add_argument("--put-per-1000", type=float, default=d.put_per_1000, metavar="USD",
                   help=f"dollars per 1,000 PUT/LIST requests (default {d.put_per_1000})")
    p.add_argument("--get-per-1000", type=float, default=d.get_per_1000, metavar="USD",
                   help=f"dollars per 1,000 GET requests (default {d.get_per_1000})")
    p.add_argument("--egress-per-gb", type=float, default=d.egress_per_gb, metavar="USD",
                   help=f"dollars per GB read out of the store (default {d.egress_per_gb}; "
                   "0 for EC2 in the bucket's region, R2)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("log", parents=[mailbox], help="one row per committed round",
                       description="The run's history from its round records: per round "
                       "its fragment, version, closer, participants, dropped contributions "
                       "and why, tokens, mean cosine, mean training loss, bytes in "
                       "(contributions merged) and out (what the closer wrote), and seconds "
                       "from the first contribution to the commit.")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="print a JSON array of rows")
    form.add_argument("--csv", action="store_true", help="print CSV with a header row")
    p.add_argument("--from", dest="first", type=int, default=0, metavar="R",
                   help="start at round R (default 0)")
    p.set_defaults(func=cmd_log)

    p = sub.add_parser("plot", parents=[mailbox], help="the run's history as a PNG",
                       description="Draw training loss per learner and the committed rounds "
                       "over wall-clock time, bytes per round and live learners (needs "
                       "matplotlib: pip install 'gradientmail[plot]').")
    p.add_argument("out", metavar="OUT.png", help="the file to write")
    p.add_argument("--from", dest="first", type=int, default=0, metavar="R",
                   help="start at round R (default 0)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("sync", parents=[mailbox], help="close rounds until interrupted",
                       description="Run a standalone syncer on this machine (numpy only) "
                       "until SIGINT or SIGTERM; several may run at once.")
    # The closer's settings are the learners' of the same names, with their defaults.
    o = LearnerOptions()
    p.add_argument("--poll-interval", type=float, default=o.poll_interval, metavar="S",
                   help=f"seconds between polls (default {o.poll_interval:g})")
    p.add_argument("--closer-id", default=None, metavar="ID",
                   help="name in the records (default sync-<host>-<pid>)")
    p.add_argument("--keep", type=_positive_int, default=o.keep_versions, metavar="N",
                   help="theta/outer versions kept per fragment by the sweep "
                   f"(default {o.keep_versions})")
    p.add_argument("--lease-timeout", type=float, default=o.lease_timeout, metavar="S",
                   help="seconds after which a learner whose lease did not change is "
                   f"counted out (default {o.lease_timeout:g})")
    p.add_argument("--quiet", action="store_true", help="do not log events")
    p.set_defaults(func=cmd_sync)

    p = sub.add_parser("export", parents=[mailbox], help="the newest model as safetensors",
                       description="Write the newest committed parameters of every "
                       "fragment (Θ⁰ where none was committed) as one safetensors file, "
                       "loadable with safetensors.torch.load_file + load_state_dict "
                       "(strict=False for a model with tied weights or buffers); or, with "
                       "--hf DIR, a GPT-2 run (the recipes') as a Hugging Face model "
                       "directory.")
    p.add_argument("out", metavar="OUT.safetensors", nargs="?", default=None,
                   help="the file to write (or give --hf DIR)")
    p.add_argument("--hf", default=None, metavar="DIR",
                   help="write DIR/config.json and DIR/model.safetensors, which "
                   "transformers.AutoModelForCausalLM.from_pretrained(DIR) loads as a "
                   "GPT2LMHeadModel (the recipes' `model.` prefix removed, the output layer "
                   "tied to the token embedding). The config's vocabulary, positions, width "
                   "and layers come from the run's parameter shapes; the number of heads, "
                   "which no shape shows, from --config or --n-head")
    p.add_argument("--config", default=None, metavar="PATH",
                   help="with --hf: the recipe YAML the run trained with (its model.n_head, "
                   "model.eos_token_id, model.dropout; every size it states is checked "
                   "against the run) or a GPT-2 config.json")
    p.add_argument("--n-head", type=_positive_int, default=None, metavar="N",
                   help="with --hf: the number of attention heads (instead of --config)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("sweep", parents=[mailbox], help="delete what closed rounds left",
                       description="Delete the contributions and claims of closed rounds "
                       "and all but the newest N theta/outer versions of each fragment.")
    p.add_argument("--keep", type=_positive_int, default=LearnerOptions().keep_versions,
                   metavar="N", help="versions kept per fragment (default "
                   f"{LearnerOptions().keep_versions})")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("verify", parents=[mailbox], help="re-derive the commits and compare",
                       description="Re-derive every commit whose inputs are still stored "
                       "(a run keeps them with DiLoCo's keep_rounds) from its recorded "
                       "contributions, the state before it and the run's algorithm, and "
                       "compare the bytes with what was committed. A commit whose "
                       "contributions are swept (the default) or were never uploaded is "
                       "checked as readers check it: its payloads' digests, and the chain of "
                       "steps from the newest checkpoint to the theta it records; the report "
                       "says which rounds were not re-derived and which could not be checked "
                       "at all. With GRADIENTMAIL_RUN_KEY, every record's seal is checked "
                       "too. Exit status 0 when all held.")
    p.add_argument("--from", dest="from_round", type=_round, default=0, metavar="R",
                   help="the first round to verify (default 0)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("demo", help="several learners train a small GPT-2 (the main job)",
                       description="N learner processes, one of them slower, train a small "
                       "GPT-2 through a local directory mailbox, twice on the same token "
                       "budget: as standard DiLoCo (a barrier each round) and as Decoupled "
                       "DiLoCo (no barrier); prints each run's held-out loss and the "
                       "wall-clock time it took to reach standard DiLoCo's. With --link, "
                       "every learner runs in its own network namespace behind a link "
                       "of that rate to an S3 bucket (moto's server, in the root namespace) "
                       "and the runs are standard DiLoCo closed by a learner, standard "
                       "DiLoCo closed by `gradientmail sync` next to the bucket, and "
                       "Decoupled DiLoCo; it needs root (or CAP_NET_ADMIN), iproute2 and "
                       "the dev extra's moto.")
    p.add_argument("--learners", type=_positive_int, default=None, metavar="N",
                   help="learner processes (default 4)")
    p.add_argument("--steps", type=_positive_int, default=None, metavar="S",
                   help="optimizer steps per learner of standard DiLoCo; each run trains "
                   "N x S steps in all (default 160; 128 with --link)")
    p.add_argument("--slow", type=float, default=None, metavar="F",
                   help="the last learner's steps take F times as long (default 2; 1: all "
                   "alike)")
    p.add_argument("--mailbox", default=None, metavar="DIR",
                   help="an empty directory for the run (default: a new temporary one)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="your own text: .txt/.jsonl/.parquet files or a directory of them "
                   "(default: the standard library's .py files)")
    p.add_argument("--outlier-factor", type=float, default=None, metavar="K",
                   help="drop contributions whose delta norm exceeds K times the round's "
                   "median (DiLoCo's outlier_factor; default: keep every contribution)")
    p.add_argument("--link", default=None, metavar="RATE",
                   help="put every learner behind a link of RATE both ways (20mbit, "
                   "100mbit, 1gbit or none: unshaped); with it --slow defaults to 1 and "
                   "--steps to 128")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); returns the exit status."""
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except GradientmailError as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"{_PROG}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{_PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`gradientmail status --json | head`): stop quietly, and
        # keep Python's exit-time flush of stdout from raising again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
