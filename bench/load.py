"""Many users at once: the app served on 127.0.0.1 and driven by N gradio_client users, each in its own session.

    flock /tmp/ghosted-heavy.lock .venv/bin/python bench/load.py --json bench/results/load.json

For N = 4, 16 and 32 users, every user submits `--runs` quick runs one after the other (tiny
settings on the embedded models: a mix of single runs, depth sweeps and runs on the user's own
text; about one single run in eight asks for Gemma-3, so the model cache holds two models). All
N users start at once, so with the app's queue of 16 the larger groups meet a full queue. Then
every completed run is asked again, alone, through a fresh session: its numbers (removed
blocks, perplexities, boundary errors, generations) must equal the concurrent ones exactly.

Reported per N: runs completed; runs refused and the message they got; p50/p95 of the wait in
the queue (submit to the first streamed update) and of the run (first update to the last);
the server's peak resident memory during that group; the most models the cache held against its
capacity; whether the numbers equal the sequential ones; and whether any user's marker (a word
in their prompt, their text and their upload's name) shows up in another user's outputs, files
or session history. Every wait is bounded (`--timeout` per run): a run that neither finishes nor
is refused in time counts as hung.

The server is a separate process (`--serve`, started by the driver) that writes its model
cache's high-water mark to a small JSON file; its memory is read from /proc by the driver.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TINY = dict(criterion="streamline", samples=2, seqlen=64, eval_corpora=["ptb"], eval_tokens=256,
            operators=["none", "ghost"], new_tokens=4, prompt="")


def address_of(user: int) -> dict[str, str]:
    """The header a Space's proxy would set for user `user`: each simulated user comes from an address of its own
    (the server caps runs per address: studio.admission)."""
    return {"x-forwarded-for": f"10.{user // 65536 % 256}.{user // 256 % 256}.{user % 256}"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------- the server process


def serve(port: int, stats: Path) -> None:
    """The app on 127.0.0.1:port; every 0.2 s, the cache's and the run registry's high-water marks into `stats`."""
    import app
    from studio.cache import MODELS
    from studio.layout import launch_options
    from studio.runs import RUNS

    peak = {"held": 0, "capacity": MODELS.capacity, "active": 0}

    def sample() -> None:
        while True:
            peak["held"] = max(peak["held"], MODELS.held())
            peak["active"] = max(peak["active"], RUNS.active())
            stats.with_suffix(".tmp").write_text(json.dumps(peak))
            os.replace(stats.with_suffix(".tmp"), stats)
            time.sleep(0.2)

    threading.Thread(target=sample, daemon=True).start()
    app.demo.launch(server_name="127.0.0.1", server_port=port, quiet=True, **launch_options())


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


# ---------------------------------------------------------------- one user


def request(user: int, number: int, folder: Path) -> tuple[str, dict, Path | None]:
    """(kind, /run keyword arguments, the uploaded file) of a user's run; the marker names user and run."""
    from gradio_client import handle_file

    marker = f"zq{user}x{number}q"
    kind = ("single", "sweep", "text")[(user + number) % 3]
    settings = TINY | {"model": "gemma3-270m" if kind == "single" and user % 8 == 7 else "smollm2-135m",
                       "depth": 3 + user % 3, "seed": user % 2}
    upload = None
    if kind == "single":
        settings |= {"prompt": f"The {marker} of the city"}
    elif kind == "sweep":
        settings |= {"mode": "sweep", "depths": "2:4:2"}
    else:
        from ghosted_core.data import corpora

        book = corpora.load_corpus("books", "evaluation").text
        start = 5000 * (user % 7)
        upload = folder / f"notes-{marker}.txt"
        upload.write_text(f"{marker} " + book[start:start + 6000])
        settings |= {"your_file": handle_file(str(upload)), "text_use": "evaluation"}
    return kind, settings, upload


def numbers(outputs: tuple) -> dict:
    """What must equal the sequential run: removed blocks, perplexities, boundary errors, generations."""
    from studio.outputs import OUTPUT_NAMES

    named = dict(zip(OUTPUT_NAMES, outputs))
    report = json.loads(Path(named["results_file"]).read_text())
    if "sweep" in report:
        return {"sweep": [{k: v for k, v in depth.items() if k != "timings"} for depth in report["sweep"]["results"]],
                "dense": report["sweep"]["dense"]}
    return {"removed": report["removed_layers"],
            "variants": {name: {k: entry.get(k) for k in ("ppl", "boundary_error", "generation")}
                         for name, entry in report["variants"].items()}}


def everything_shown(outputs: tuple) -> str:
    """The run's outputs as text, with the files it handed over (results.json, history CSV) read in."""
    parts = [json.dumps(outputs, default=str)]
    for value in outputs:
        if isinstance(value, str) and value.endswith((".json", ".csv")) and Path(value).is_file():
            parts.append(Path(value).read_text())
    return "\n".join(parts)


def history_rows(outputs: tuple) -> int:
    from studio.outputs import OUTPUT_NAMES

    return len(outputs[OUTPUT_NAMES.index("history_table")]["data"])


def follow(client, settings: dict, timeout: float) -> tuple[dict, tuple | None]:
    """Submit one /run and follow it: ({outcome, wait (submit to first update), run (first to last update)}, the
    final outputs), or ({"outcome": "hung"}, None) past `timeout` seconds. A refusal raises, as gradio_client does."""
    submitted = time.perf_counter()
    job = client.submit(api_name="/run", **settings)
    first = None
    while not job.done() and time.perf_counter() - submitted < timeout:
        if first is None and job.outputs():
            first = time.perf_counter()
        time.sleep(0.05)
    if not job.done():
        job.cancel()
        return {"outcome": "hung"}, None
    outputs = job.result(timeout=10)
    end = time.perf_counter()
    first = first or end
    return {"outcome": "complete" if "Run complete" in outputs[0] else "failed", "wait": first - submitted,
            "run": end - first}, outputs


def one_user(url: str, user: int, runs: int, timeout: float, folder: Path) -> list[dict]:
    """A user's runs, one after the other, in one session; a record per run."""
    from gradio_client import Client

    client = Client(url, verbose=False, download_files=str(folder / f"user-{user}"), headers=address_of(user))
    records = []
    for number in range(runs):
        kind, settings, upload = request(user, number, folder)
        record = {"user": user, "number": number, "kind": kind, "settings": {k: v for k, v in settings.items()
                                                                             if k != "your_file"},
                  "upload": upload.name if upload else None}
        try:
            outcome, outputs = follow(client, settings, timeout)
            record |= outcome
            if outputs is not None:
                record |= {"numbers": numbers(outputs), "shown": everything_shown(outputs),
                           "history_rows": history_rows(outputs)}
        except Exception as err:  # a refusal (queue full) or an error message: keep what the user was told
            record |= {"outcome": "refused" if "queue" in str(err).lower() else "error", "message": str(err)[:300]}
        records.append(record)
    client.close()
    return records


# ---------------------------------------------------------------- the driver


def start_server(folder: Path, warm_models: tuple[str, ...], env: dict | None = None) -> tuple[subprocess.Popen,
                                                                                                str, Path]:
    """(the server process, its URL, its stats file): the app as on a Space (local folders off, each client its
    own address from X-Forwarded-For), once it answers, with `warm_models` loaded and the corpora read."""
    from gradio_client import Client
    import httpx

    port, stats = free_port(), folder / "stats.json"
    env = os.environ | {"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1",
                        "GHOSTED_APP_TRUST_FORWARDED": "1"} | (env or {})
    env.pop("GHOSTED_APP_LOCAL_MODELS", None)  # as on a Space
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), str(stats)], env=env,
                              stdout=open(folder / "server.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 300
    while True:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.time() > deadline:
            server.terminate()
            raise SystemExit(f"the server did not start; see {folder / 'server.log'}")
        time.sleep(1)
    warm = Client(url, verbose=False, download_files=str(folder / "warm"), headers=address_of(65535))
    for model in warm_models:  # load each and read the corpora once, outside the figures
        warm.predict(api_name="/run", **TINY | {"model": model, "depth": 3})
    warm.close()
    return server, url, stats



def percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def group(url: str, server: subprocess.Popen, users: int, runs: int, timeout: float, folder: Path) -> list[dict]:
    """All `users` at once; the server's resident memory sampled meanwhile."""
    peak = [rss(server.pid)]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak.append(rss(server.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with ThreadPoolExecutor(max_workers=users) as pool:
        futures = [pool.submit(one_user, url, user, runs, timeout, folder) for user in range(users)]
        records = [r for f in futures for r in f.result(timeout=runs * timeout + 120)]
    done.set()
    sampler.join()
    for record in records:
        record["peak_rss"] = max(peak)
    return records


def sequential(url: str, records: list[dict], folder: Path) -> None:
    """Every completed run asked again, alone, in a fresh session: `equal` says whether its numbers match."""
    from gradio_client import Client

    for record in records:
        if record["outcome"] != "complete":
            continue
        _kind, settings, _upload = request(record["user"], record["number"], folder)
        client = Client(url, verbose=False, download_files=str(folder / "sequential"))
        record["equal"] = numbers(client.predict(api_name="/run", **settings)) == record["numbers"]
        client.close()


def leaks(records: list[dict]) -> list[str]:
    """Markers of one user found in another user's outputs, files or history; and histories holding others' runs."""
    found = []
    for record in records:
        if record["outcome"] != "complete":
            continue
        for other in records:
            if other["user"] != record["user"] and f"zq{other['user']}x{other['number']}q" in record["shown"]:
                found.append(f"user {other['user']}'s marker in user {record['user']}'s run {record['number']}")
        own = sum(1 for r in records if r["user"] == record["user"] and r["number"] <= record["number"]
                  and r["outcome"] == "complete")
        if record["history_rows"] < own or record["history_rows"] > 50 * own:
            found.append(f"user {record['user']}'s history has {record['history_rows']} rows after {own} runs")
    return found


def summary(users: int, records: list[dict], stats: dict) -> dict:
    complete = [r for r in records if r["outcome"] == "complete"]
    refused = [r for r in records if r["outcome"] == "refused"]
    return {"users": users, "runs": len(records), "completed": len(complete), "refused": len(refused),
            "refused_messages": sorted({r["message"] for r in refused}),
            "errors": [r.get("message", r["outcome"]) for r in records if r["outcome"] in ("error", "failed", "hung")],
            "wait_p50": percentile([r["wait"] for r in complete], 0.5),
            "wait_p95": percentile([r["wait"] for r in complete], 0.95),
            "run_p50": percentile([r["run"] for r in complete], 0.5),
            "run_p95": percentile([r["run"] for r in complete], 0.95),
            "peak_rss_gib": max(r["peak_rss"] for r in records) / 2**30,
            "cache_held_max": stats["held"], "cache_capacity": stats["capacity"],
            "equal_sequential": all(r.get("equal") for r in complete) and bool(complete),
            "unequal": [f"user {r['user']} run {r['number']} ({r['kind']})" for r in complete if not r.get("equal")],
            "leaks": leaks(records), "kinds": {k: sum(1 for r in complete if r["kind"] == k)
                                               for k in ("single", "sweep", "text")}}


def table(rows: list[dict]) -> str:
    def s(value):
        return "–" if value is None else f"{value:.1f}"

    lines = ["| N | runs | completed | refused (message) | errors | queue wait p50 / p95 (s) | run p50 / p95 (s) | "
             "peak RSS | cache held / capacity | numbers equal sequential | leaks |", "|" + "---|" * 11]
    for r in rows:
        message = f" ({'; '.join(r['refused_messages'])})" if r["refused"] else ""
        lines.append(f"| {r['users']} | {r['runs']} | {r['completed']} | {r['refused']}{message} | {len(r['errors'])} | "
                     f"{s(r['wait_p50'])} / {s(r['wait_p95'])} | {s(r['run_p50'])} / {s(r['run_p95'])} | "
                     f"{r['peak_rss_gib']:.2f} GiB | {r['cache_held_max']} / {r['cache_capacity']} | "
                     f"{'yes' if r['equal_sequential'] else 'no'} | {len(r['leaks']) or 'none'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", default="4,16,32", help="comma list of group sizes")
    parser.add_argument("--runs", type=int, default=2, help="runs per user, one after the other")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a run may take before it counts as hung")
    parser.add_argument("--json", default=None, help="also write the summary (and every run's record) here")
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "STATS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(int(args.serve[0]), Path(args.serve[1]))
        return 0

    folder = Path(tempfile.mkdtemp(prefix="ghosted-load-"))
    server, url, stats = start_server(folder, ("smollm2-135m", "gemma3-270m"))
    try:
        started = time.perf_counter()
        rows, records = [], {}
        for users in (int(n) for n in args.users.split(",")):
            group_records = group(url, server, users, args.runs, args.timeout, folder)
            sequential(url, group_records, folder)
            rows.append(summary(users, group_records, json.loads(stats.read_text())))
            records[users] = [{k: v for k, v in r.items() if k not in ("shown", "numbers")} for r in group_records]
            print(table(rows[-1:]).splitlines()[-1], flush=True)
        elapsed = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(table(rows))
    print(f"{elapsed:.0f} s in all, load average {os.getloadavg()[0]:.1f} at the end; cores: {os.cpu_count()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "seconds": elapsed, "cores": os.cpu_count(),
                                               "runs_per_user": args.runs, "records": records}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
