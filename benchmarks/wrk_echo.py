"""Echo throughput measured with `wrk`, a C load generator, against TorchServe 0.12 in one run.

    .venv/bin/python -m benchmarks.wrk_echo --rounds 3 --duration 10
    .venv/bin/python -m benchmarks.wrk_echo --no-torchserve --baseline REV   # before/after
    .venv/bin/python -m benchmarks.wrk_echo --no-torchserve --tls     # the cost of TLS

One echo handler (examples/echo/echo_handler.py: each request answered with its 100-byte
body), batch_size 8, max_batch_delay 5 ms, one worker, served by: batchserve with its
defaults (adaptive policy, access log on), batchserve with TorchServe's fixed policy, and
TorchServe 0.12 with quiet logging (benchmarks/torchserve.py: no access, model or metrics
log). All run at once on free loopback ports; the rounds interleave them (A B C, A B C, ...),
so that a noisy neighbour hits every server alike, and each server's median round is
reported, with the ratio to TorchServe's. ``wrk -t1 -c16`` keeps 16 connections busy with
one client thread, which leaves the servers as much of the machine as a client can. The lone
client (``-c1``) gives the latency of a request that never waits for a batch. Finally the
project's own asyncio load generator (benchmarks/loadgen.py) runs once per server with 16
clients, for comparison with wrk's numbers (see benchmarks/RESULTS.md for why they differ).

``--variant 'LABEL:key=value;key2=value2'`` (repeatable) adds batchserve with those
config.properties keys (a key written ``$NAME=value`` is an environment variable of its
instead), and prints each variant's ratio to the plain server: the cost of a feature that is
off by default (``--variant 'timing:server_timing=always'``). ``{otlp}`` in a value is the
URL of an OTLP/HTTP receiver this process runs for the run (it reads and drops what it is
sent): ``--variant 'traces:otel_traces=true;otel_exporter_otlp_endpoint={otlp}'``.

``--tls`` adds batchserve with its inference address over HTTPS (a self-signed EC P-256
certificate made for the run; wrk keeps its connections, so this is the cost of TLS records,
not of handshakes), and prints its ratio to plain HTTP. (The load generator speaks plain HTTP
only: it is not run against it.)
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import io
import random
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import torchserve
from benchmarks.echo import build_echo
from benchmarks.servers import Batchserve

ROOT = Path(__file__).resolve().parent.parent
HANDLER = ROOT / "examples" / "echo" / "echo_handler.py"
BATCH_SIZE = 8
MAX_BATCH_DELAY_MS = 5
LUA = """wrk.method = "POST"
wrk.body = string.rep("x", 100)
wrk.headers["Content-Type"] = "application/octet-stream"
"""


@dataclass
class WrkRun:
    rate: float
    p50_ms: float
    p99_ms: float
    errors: int
    requests: int = 0  # answers wrk counted over the whole run


@dataclass
class Target:
    name: str
    url: str
    runs: list[WrkRun] = field(default_factory=list)
    lone: WrkRun | None = None
    loadgen_rate: float | None = None

    def median(self, attribute: str) -> float:
        return statistics.median(getattr(run, attribute) for run in self.runs)


_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}


def _ms(text: str) -> float:
    """A wrk latency ("812.00us", "1.93ms", "1.01s") in milliseconds."""
    found = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if found is None:
        raise ValueError(f"not a wrk latency: {text!r}")
    return float(found.group(1)) * _UNITS_MS[found.group(2)]


def wrk(url: str, connections: int, duration_s: float, script: Path, threads: int = 1) -> WrkRun:
    """One wrk run (whole seconds: wrk reads no fractions) with its latency distribution."""
    output = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration_s:g}s", "--latency", "-s",
         str(script), url], check=True, capture_output=True, text=True,
        timeout=duration_s + 60).stdout
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1))  # type: ignore[union-attr]
    p50 = re.search(r"\s50%\s+([\d.]+\w+)", output)
    p99 = re.search(r"\s99%\s+([\d.]+\w+)", output)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    socket_errors = re.search(r"Socket errors: .*", output)
    if socket_errors:
        print(f"  wrk: {socket_errors.group()}", file=sys.stderr)
    requests = re.search(r"(\d+) requests in ", output)
    return WrkRun(rate, _ms(p50.group(1)) if p50 else float("nan"),
                  _ms(p99.group(1)) if p99 else float("nan"),
                  int(errors.group(1)) if errors else 0,
                  int(requests.group(1)) if requests else 0)


def loadgen(url: str, duration_s: float) -> float:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.loadgen", url, "--clients", "16",
         "--duration", f"{duration_s:g}", "--no-progress"],
        check=False, capture_output=True, text=True, timeout=duration_s + 120, cwd=ROOT)
    found = re.search(r"([\d.]+) ok/s", done.stdout)
    if done.returncode or not found:
        raise SystemExit(f"the load generator failed:\n{done.stdout}{done.stderr}")
    return float(found.group(1))


def _self_signed(work: Path) -> str:
    """A certificate and key for 127.0.0.1 (PEM files in ``work``), as config.properties
    lines."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    (work / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (work / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return (f"inference_address=https://127.0.0.1:0\ncertificate_file={work / 'cert.pem'}\n"
            f"private_key_file={work / 'key.pem'}\n")


def echo_setup(prefix: str) -> tuple[Path, Path, Path]:
    """A fresh work folder, wrk's POST script in it and a model store holding the echo model:
    (folder, script, store)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    script = work / "post.lua"
    script.write_text(LUA)
    store = work / "store"
    store.mkdir()
    build_echo(store)
    return work, script, store


def _source_at(revision: str, work: Path) -> Path:
    """The project's source as of ``revision`` (git archive), unpacked under ``work``."""
    tree = work / "baseline"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def _print_ratio(targets: list[Target], label: str, title: str) -> None:
    """Per policy, the server ``label``'s throughput over plain batchserve's, with both p99s
    and lone-client p50s."""
    for policy in ("adaptive", "fixed"):
        plain, other = (next(t for t in targets if t.name == f"{name} {policy}")
                        for name in ("batchserve", label))
        print(f"\n{policy}: {title} = "
              f"{other.median('rate') / plain.median('rate'):.2f}x (wrk req/s), p99 "
              f"{other.median('p99_ms'):.2f} vs {plain.median('p99_ms'):.2f} ms, lone p50 "
              f"{other.lone.p50_ms if other.lone else 0:.2f} vs "
              f"{plain.lone.p50_ms if plain.lone else 0:.2f} ms")


class _OtlpSink:
    """An OTLP/HTTP receiver that reads every export and answers it with an empty (valid)
    ExportTraceServiceResponse, on a daemon thread of this process."""

    def __init__(self) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _variant(text: str) -> tuple[str, str, dict[str, str]]:
    """``LABEL:key=value;$ENV=value`` as (label, config.properties lines, environment)."""
    label, sep, rest = text.partition(":")
    if not sep or not label.strip():
        raise SystemExit(f"--variant {text!r}: expected LABEL:key=value;...")
    properties, env = [], {}
    for item in filter(None, (part.strip() for part in rest.split(";"))):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--variant {text!r}: {item!r} is not key=value")
        if key.startswith("$"):
            env[key[1:]] = value
        else:
            properties.append(f"{key}={value}\n")
    return label.strip(), "".join(properties), env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shuffle", action="store_true",
                        help="run the servers in a new (seeded) order each round")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per wrk round")
    parser.add_argument("--no-torchserve", action="store_true")
    parser.add_argument("--baseline", metavar="REV",
                        help="also serve batchserve as of git revision REV (its source, this "
                             "venv's packages), for a before/after ratio in the same run")
    parser.add_argument("--tls", action="store_true",
                        help="also serve batchserve over HTTPS, for the cost of TLS")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL:K=V;K=V",
                        help="also serve batchserve with these config.properties keys "
                             "($NAME=value: an environment variable); repeatable")
    args = parser.parse_args()
    sink = _OtlpSink() if any("{otlp}" in text for text in args.variant) else None
    variants = [_variant(text.replace("{otlp}", sink.url if sink else "")) for text in
                args.variant]
    if shutil.which("wrk") is None:
        raise SystemExit("needs wrk: apt-get install -y wrk")
    work, script, store = echo_setup("bench-wrk-")
    started = time.time()
    with contextlib.ExitStack() as stack:
        servers = [("batchserve", stack.enter_context(Batchserve(store)))]
        if args.baseline:
            servers.append((f"batchserve@{args.baseline}", stack.enter_context(
                Batchserve(store, env={"PYTHONPATH": str(_source_at(args.baseline, work))}))))
        if args.tls:
            servers.append(("batchserve TLS", stack.enter_context(
                Batchserve(store, extra_properties=_self_signed(work)))))
        for label, properties, env in variants:
            servers.append((f"batchserve {label}", stack.enter_context(
                Batchserve(store, extra_properties=properties, env=env))))
        targets = []
        for label, server in servers:
            for policy in ("adaptive", "fixed"):
                name = f"echo_{policy}"
                server.register("echo.mar", model_name=name, batch_size=BATCH_SIZE,
                                max_batch_delay=MAX_BATCH_DELAY_MS, initial_workers=1,
                                batch_policy=policy)
                targets.append(Target(f"{label} {policy}",
                                      f"{server.inference}/predictions/{name}"))
        if not args.no_torchserve:
            bin_dir = torchserve.ensure_venv()
            ts_store = work / "ts-store"
            ts_store.mkdir()
            mar = torchserve.archive(bin_dir, ts_store, "echo", HANDLER)
            theirs = stack.enter_context(torchserve.TorchServe(ts_store, quiet=True))
            theirs.register(mar, batch_size=BATCH_SIZE, max_batch_delay=MAX_BATCH_DELAY_MS,
                            initial_workers=1)
            targets.append(Target("TorchServe 0.12 quiet", f"{theirs.inference}/predictions/echo"))
        for target in targets:  # warm-up: connections, JIT, the policies' estimates
            wrk(target.url, 16, 3, script)
        order = random.Random(0)
        for round_number in range(args.rounds):
            # --shuffle: each round in another order, so that no server always runs right
            # after the same one (whose leftovers, a flush or an export, it would pay for).
            for target in (order.sample(targets, len(targets)) if args.shuffle else targets):
                run = wrk(target.url, 16, args.duration, script)
                target.runs.append(run)
                print(f"round {round_number + 1}: {target.name}: {run.rate:,.0f} req/s, "
                      f"p50 {run.p50_ms:.2f} ms, p99 {run.p99_ms:.2f} ms, "
                      f"non-2xx {run.errors}", file=sys.stderr, flush=True)
        for target in targets:
            target.lone = wrk(target.url, 1, min(args.duration, 5), script)
            if target.url.startswith("http://"):
                target.loadgen_rate = loadgen(target.url, min(args.duration, 8))
    baseline = targets[-1] if not args.no_torchserve else None
    print(f"\nwrk -t1 -c16, {args.rounds} interleaved rounds"
          f"{' (each in a shuffled order)' if args.shuffle else ''} of {args.duration:g} s "
          f"(median round); batch_size {BATCH_SIZE}, max_batch_delay {MAX_BATCH_DELAY_MS} ms, "
          f"one worker; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}\n")
    print("| server | wrk req/s | vs TorchServe | p50 ms | p99 ms | lone client p50 ms | "
          "loadgen req/s (16 clients) |\n|---|---|---|---|---|---|---|")
    for target in targets:
        ratio = (f"{target.median('rate') / baseline.median('rate'):.2f}x" if baseline else "-")
        assert target.lone is not None
        print(f"| {target.name} | {target.median('rate'):,.0f} | {ratio} | "
              f"{target.median('p50_ms'):.2f} | {target.median('p99_ms'):.2f} | "
              f"{target.lone.p50_ms:.2f} | "
              f"{'-' if target.loadgen_rate is None else f'{target.loadgen_rate:,.0f}'} |")
    if args.baseline:
        for policy in ("adaptive", "fixed"):
            now, before = (next(t for t in targets if t.name == f"{label} {policy}")
                           for label in ("batchserve", f"batchserve@{args.baseline}"))
            print(f"\n{policy}: this tree / {args.baseline} = "
                  f"{now.median('rate') / before.median('rate'):.2f}x (wrk req/s), lone p50 "
                  f"{now.lone.p50_ms if now.lone else 0:.2f} vs "
                  f"{before.lone.p50_ms if before.lone else 0:.2f} ms")
    if args.tls:
        _print_ratio(targets, "batchserve TLS", "TLS / plain HTTP")
    for label, _, _ in variants:
        _print_ratio(targets, f"batchserve {label}", f"{label} / plain")
    print("\nrounds (req/s): " + "; ".join(
        f"{t.name}: {', '.join(f'{r.rate:,.0f}' for r in t.runs)}" for t in targets))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
