"""Links between sites, rehearsed on one machine: a network namespace per learner behind a
shaped veth pair, and the bucket (moto's S3 server) in the root namespace.

Learner r lives in namespace `Links.ns[r]`; a veth pair joins it to the root namespace,
10.X.r.2 on its side and 10.X.r.1 on the root's, and `Links.shape` puts a token bucket
(`tc ... tbf`) on both ends so that both directions run at the link's rate. A server
listening in the root namespace on `Links.host(0)` is reached from every namespace (the
root namespace owns the address; each namespace's default route leads there through its
own link), and by the root namespace itself without crossing any link.

Needs iproute2 (`ip`, `tc`) and root or CAP_NET_ADMIN; `requirements_error` says what is
missing and how to get it. moto is the `dev` extra's and is imported only by `s3_server`.
Names carry this process's pid; `Links.close()` removes everything it made.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from gradientmail.errors import ConfigError

__all__ = [
    "CREDENTIALS",
    "LINK_NAMES",
    "Links",
    "check_requirements",
    "parse_rate",
    "refusal",
    "requirements_error",
    "s3_server",
    "standalone_closer",
]

#: The rates the command line offers; `parse_rate` reads any `<number>{kbit,mbit,gbit}`.
LINK_NAMES = ("20mbit", "100mbit", "1gbit", "none")
#: What boto3 needs to talk to moto's server (any value works; real ones never leave).
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "gradientmail-local", "AWS_SECRET_ACCESS_KEY": "local",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_rate(text: str) -> float | None:
    """`20mbit` → 2e7 bits per second; `none` → None (unshaped). `ConfigError` otherwise."""
    t = text.strip().lower()
    if t == "none":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", t)
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"link rate {text!r}: use e.g. 20mbit, 100mbit, 1gbit or none")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")


def refusal() -> str | None:
    """Why this process may not make a namespace, a veth pair and a tbf qdisc (None: it
    may): tries all three under throwaway names and removes them."""
    tag = f"gmp{os.getpid() % 10**7}"
    ns, a, b = f"{tag}-probe", f"{tag}a", f"{tag}b"
    try:
        _ip("ip", "netns", "add", ns)
        _ip("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        _ip("tc", "qdisc", "add", "dev", a, "root", "tbf", "rate", "20mbit", "burst", "64kb",
            "latency", "2s")
        _ip("ip", "link", "set", b, "netns", ns)
    except (RuntimeError, OSError) as exc:
        return str(exc)
    finally:
        subprocess.run(["ip", "link", "del", a], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return None


def requirements_error(*, tools: list[str], refused: str | None,
                       moto: str | None) -> str | None:
    """What a run behind shaped links lacks, with the fix, in one message (None: nothing):
    `tools` the iproute2 commands not found, `refused` what `refusal()` said, `moto` why
    moto's server could not be imported."""
    needs = []
    if tools:
        needs.append(f"iproute2's {' and '.join(tools)} (not found; e.g. apt-get install "
                     "iproute2)")
    elif refused is not None:
        needs.append(f"root or CAP_NET_ADMIN to make network namespaces, veth pairs and "
                     f"tbf qdiscs ({refused}); run as root")
    if moto is not None:
        needs.append(f"moto's S3 server for the bucket ({moto}): pip install -e '.[dev]'")
    return "; and ".join(needs) if needs else None


def check_requirements() -> str | None:
    """`requirements_error` of this machine and process (probes, then removes, a namespace)."""
    tools = [t for t in ("ip", "tc") if shutil.which(t) is None]
    moto = None
    try:
        importlib.import_module("moto.server")
    except ImportError as exc:
        moto = str(exc)
    return requirements_error(tools=tools, refused=None if tools else refusal(), moto=moto)


def _free_octet() -> int:
    """A second octet X such that no address of this machine is in 10.X.0.0/16 (the
    run's learners get 10.X.r.1 / 10.X.r.2), starting from one derived from the pid."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    taken = {int(m) for m in re.findall(r"inet 10\.(\d+)\.", used)}
    start = 100 + os.getpid() % 150
    for k in range(150):
        x = 100 + (start - 100 + k) % 150
        if x not in taken:
            return x
    raise RuntimeError("no free 10.X.0.0/16 for the run's links")


class Links:
    """A namespace per learner, joined to the root namespace by a veth pair: learner r is
    10.X.r.2 in namespace `ns[r]`, the root side 10.X.r.1 (`host[r]`); `shape` sets both
    ends' tbf. `open(forward=True)` also turns IP forwarding on (a byte between two
    learners then crosses both their links); `close()` removes everything it made and
    restores forwarding unless another run's namespaces are still there."""

    def __init__(self, learners: int) -> None:
        tag = f"gm{os.getpid() % 10**7}"
        self.tag = tag
        self.ns = [f"{tag}-ns{r}" for r in range(learners)]
        self.root_dev = [f"{tag}r{r}" for r in range(learners)]
        self.ns_dev = [f"{tag}n{r}" for r in range(learners)]
        self.octet = 0
        self.made: list[tuple[str, str]] = []  # ("ns" | "dev", name), in order
        self.forward_was: str | None = None

    def host(self, r: int) -> str:
        return f"10.{self.octet}.{r}.1"

    def addr(self, r: int) -> str:
        return f"10.{self.octet}.{r}.2"

    def open(self, forward: bool = True) -> None:
        self.octet = _free_octet()
        if forward:
            fwd = Path("/proc/sys/net/ipv4/ip_forward")
            self.forward_was = fwd.read_text().strip()
            fwd.write_text("1")
        for r, ns in enumerate(self.ns):
            _ip("ip", "netns", "add", ns)
            self.made.append(("ns", ns))
            _ip("ip", "link", "add", self.root_dev[r], "type", "veth", "peer", "name",
                self.ns_dev[r])
            self.made.append(("dev", self.root_dev[r]))
            _ip("ip", "link", "set", self.ns_dev[r], "netns", ns)
            _ip("ip", "addr", "add", f"{self.host(r)}/24", "dev", self.root_dev[r])
            _ip("ip", "link", "set", self.root_dev[r], "up")
            _ip("ip", "addr", "add", f"{self.addr(r)}/24", "dev", self.ns_dev[r], ns=ns)
            _ip("ip", "link", "set", self.ns_dev[r], "up", ns=ns)
            _ip("ip", "link", "set", "lo", "up", ns=ns)
            _ip("ip", "route", "add", "default", "via", self.host(r), ns=ns)

    def shape(self, rates: list[float | None]) -> None:
        """Both ends of learner r's veth at rates[r] bits/s (None: unshaped)."""
        for r, rate in enumerate(rates):
            for dev, ns in ((self.root_dev[r], None), (self.ns_dev[r], self.ns[r])):
                cmd = ["tc", "qdisc", "del", "dev", dev, "root"]
                subprocess.run((["ip", "netns", "exec", ns] if ns else []) + cmd,
                               capture_output=True)
                if rate is not None:
                    # The bucket must hold at least a tick's worth of bytes (rate / HZ) or
                    # tbf cannot reach the rate; 64 kB is enough up to ~100 Mbit/s.
                    burst = max(64 * 1024, int(rate / 8 / 100))
                    _ip("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                        f"{int(rate)}bit", "burst", str(burst), "latency", "2s", ns=ns)

    def counters(self) -> list[int]:
        """Bytes through each learner's link so far: rx + tx of its root-side veth."""
        return [up + down for up, down in self.split_counters()]

    def split_counters(self) -> list[tuple[int, int]]:
        """(up, down) per learner: what the root side received from it and sent to it."""
        out = []
        for dev in self.root_dev:
            stats = Path("/sys/class/net") / dev / "statistics"
            out.append((int((stats / "rx_bytes").read_text()),
                        int((stats / "tx_bytes").read_text())))
        return out

    def close(self) -> None:
        for kind, name in reversed(self.made):
            if kind == "dev":
                subprocess.run(["ip", "link", "del", name], capture_output=True)
            else:
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.made.clear()
        if self.forward_was is not None:
            # Another run's namespaces still here may need forwarding on: leave it to the
            # last one out (a concurrent rehearsal's DDP lost its peer that way).
            ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            if not re.search(r"\bgm\d+-ns\d+", ns):
                Path("/proc/sys/net/ipv4/ip_forward").write_text(self.forward_was)
            self.forward_was = None

    def leftovers(self) -> list[str]:
        """Namespaces and links of this run still present (none after `close()`)."""
        ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        mine = re.compile(rf"{self.tag}(?:-ns|r|n)\d+")
        return sorted(set(mine.findall(ns + links)))


@contextlib.contextmanager
def s3_server(bucket: str, host: str = "0.0.0.0") -> Iterator[int]:
    """moto's S3 server in this process, listening on `host` (the default: every address
    of the root namespace), with `bucket` made; yields its port. Needs the `dev` extra."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address=host, port=0, verbose=False)
    server.start()
    try:
        port = int(server.get_host_and_port()[1])
        local = "127.0.0.1" if host == "0.0.0.0" else host
        boto3.client(
            "s3", endpoint_url=f"http://{local}:{port}",
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        ).create_bucket(Bucket=bucket)
        yield port
    finally:
        server.stop()


@contextlib.contextmanager
def standalone_closer(url: str, endpoint: str, poll: float, out: Path,
                      closer_id: str = "sync-next-to-bucket") -> Iterator[None]:
    """`gradientmail sync URL` as a process of this namespace (next to the bucket), its
    output in `out`; entered once its lease is in the bucket (so learners that join next
    see it from their first look, and leave it the rounds from the first one);
    interrupted (SIGINT, then killed after 30 s) on leaving."""
    env = dict(os.environ, **CREDENTIALS)
    with out.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gradientmail.app.cli", "sync", url, "--endpoint-url",
             endpoint, "--poll-interval", str(poll), "--closer-id", closer_id],
            stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _await_lease(url, endpoint, closer_id, proc, out)
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


#: Seconds a standalone closer may take to start and beat its lease.
CLOSER_START_TIMEOUT = 60.0


def _await_lease(url: str, endpoint: str, closer_id: str, proc: subprocess.Popen[bytes],
                 out: Path) -> None:
    """Wait until `closer_id` holds a lease among `url`'s standalone closers; RuntimeError
    (with its output) when the process ends first or CLOSER_START_TIMEOUT passes."""
    from gradientmail.mailbox.url import open_mailbox
    from gradientmail.run.lease import CLOSERS
    from gradientmail.run.protocol import Exchange

    async def look() -> None:
        box = open_mailbox(url, read_only=True, endpoint_url=endpoint)
        try:
            ex = Exchange(box)
            deadline = time.monotonic() + CLOSER_START_TIMEOUT
            while closer_id not in await ex.leases(CLOSERS):
                if proc.poll() is not None or time.monotonic() > deadline:
                    why = (f"exited with status {proc.returncode}" if proc.poll() is not None
                           else f"held no lease after {CLOSER_START_TIMEOUT:.0f} s")
                    raise RuntimeError(f"the standalone closer {closer_id} {why}:\n"
                                       + out.read_text()[-2000:])
                await asyncio.sleep(0.1)
        finally:
            await box.close()

    asyncio.run(look())
