"""One stranger floods a public server while honest visitors use it: the app as on a CPU Space, over plain HTTP.

    flock /tmp/ghosted-heavy.lock .venv/bin/python bench/load_flood.py --json bench/results/load_flood.json

The server runs as `bench/load.py` starts it (local folders off, a queue of 16, one run at a time,
each client's address from X-Forwarded-For as a Space's proxy sets it) with a CPU Space's run
budget (GHOSTED_APP_RUN_BUDGET=900 s). While `--honest` visitors (each its own session and
address) run the page's defaults on SmolLM2 one after the other (`--honest_settings tiny`: the
load bench's tiny runs, for a quick check), one flooder, from one address, keeps sending until
they are done, each request from a made-up session id:
- invalid runs (`seed = -1`, a value the page never sends);
- maximal runs (the page's own maximums: 128 × 2048 calibration tokens, every operator, 16,384
  perplexity tokens on every corpus);
- valid runs of its own, as many as it can;
- simultaneous bursts of its own valid runs (threads behind a barrier): 40 from its address, each
  its own session, and 16 from one session;
- the routes Gradio serves that write files (`deep_link`, `process_recording`, `component_server`);
- 5 MB uploads, and one upload of 40 files.

Reported: every honest run's outcome and wait; the flooder's requests by kind and what each was
answered (HTTP status, or the run's end), and the most runs one burst got in; the server's peak
resident memory against its serving figure (`studio.serving`, from the runs' memory plans), and the
peak size of Gradio's upload folder.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from load import TINY, address_of, follow, percentile, rss, start_server  # noqa: E402

FLOODER = {"x-forwarded-for": "203.0.113.66"}
BURSTS = {"burst: 40 runs at once, one address": (40, False), "burst: 16 runs at once, one session": (16, True)}


def burst(url: str, bodies: list[dict]) -> collections.Counter:
    """Every body POSTed to /run at the same instant (threads behind a barrier); the answers by HTTP status."""
    import httpx

    barrier, answers = threading.Barrier(len(bodies)), collections.Counter()

    def send(body: dict) -> None:
        with httpx.Client(timeout=120, headers=FLOODER) as http:
            barrier.wait()
            answers[f"HTTP {http.post(f'{url}gradio_api/call/run', json=body).status_code}"] += 1

    threads = [threading.Thread(target=send, args=(body,)) for body in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def doors(http, url: str, video: bytes) -> dict[str, int]:
    """The routes Gradio serves that write files, tried once each: their HTTP status."""
    session = f"flood-{uuid.uuid4().hex}"
    http.post(f"{url}gradio_api/call/model_info", json={"data": ["smollm2-135m"], "session_hash": session})
    return {"deep_link (writes the session's state)": http.get(f"{url}gradio_api/deep_link",
                                                                params={"session_hash": session}).status_code,
            "process_recording (writes a 4 MB video)": http.post(
                f"{url}gradio_api/process_recording", files={"video": ("v.mp4", video, "video/mp4")}).status_code,
            "component_server (50 files)": http.post(
                f"{url}gradio_api/component_server",
                files=[("files", (f"f{k}.txt", b"x" * 1000)) for k in range(50)]).status_code}


def run_defaults(url: str) -> dict:
    """The /run endpoint's defaults, by parameter name (what the page sends untouched)."""
    from gradio_client import Client

    api = Client(url, verbose=False).view_api(return_format="dict", print_info=False)
    return {p["parameter_name"]: p.get("parameter_default") for p in api["named_endpoints"]["/run"]["parameters"]}


def honest_user(url: str, user: int, settings: dict, timeout: float, folder: Path) -> dict:
    """One honest visitor's run: its outcome, queue wait and run time."""
    from gradio_client import Client

    client = Client(url, verbose=False, download_files=str(folder / f"honest-{user}"), headers=address_of(user))
    record = {"user": user}
    try:
        record |= follow(client, settings, timeout)[0]
    except Exception as err:  # what the visitor was told
        record |= {"outcome": "refused or error", "message": str(err)[:300]}
    client.close()
    return record


def flood(url: str, values: list, names: list[str], stop: threading.Event, folder: Path, own: dict) -> dict:
    """Requests of each kind until `stop` (its own valid runs: `own`, the honest visitors' settings); answers
    counted per kind ("HTTP 400", …)."""
    import httpx

    from ghosted_core.data import corpora
    from ghosted_core.recovery.operators import OPERATORS

    def data(**changes) -> list:
        merged = dict(zip(names, values)) | changes
        return [merged[n] for n in names]

    maximal = data(samples=128, seqlen=2048, operators=list(OPERATORS), eval_corpora=corpora.corpus_names(),
                   eval_tokens=16384)
    kinds = {"invalid run (seed -1)": data(seed=-1), "maximal run (the page's maximums)": maximal,
             "valid run of its own": data(**own)}
    answers: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    most: dict[str, int] = dict.fromkeys(BURSTS, 0)  # the most runs one burst got in
    big = folder / "flood.txt"
    big.write_bytes(b"flood " * (5 * 2**20 // 6 - 100))
    with httpx.Client(timeout=120, headers=FLOODER) as http:
        answer = http.post(f"{url}gradio_api/upload", files=[("files", (f"f{k}.txt", b"x" * 2**20)) for k in range(40)])
        answers["40 files in one upload"][f"HTTP {answer.status_code}"] += 1
        while not stop.is_set():
            for kind, body in kinds.items():
                posted = http.post(f"{url}gradio_api/call/run",
                                   json={"data": body, "session_hash": f"flood-{uuid.uuid4().hex}"})
                answers[kind][f"HTTP {posted.status_code}"] += 1
            for kind, (count, one_session) in BURSTS.items():
                session = f"flood-{uuid.uuid4().hex}"
                got = burst(url, [{"data": kinds["valid run of its own"],
                                   "session_hash": session if one_session else f"flood-{uuid.uuid4().hex}"}
                                  for _ in range(count)])
                answers[kind] += got
                most[kind] = max(most[kind], got["HTTP 200"])
            for kind, status in doors(http, url, b"\0" * 4 * 2**20).items():
                answers[kind][f"HTTP {status}"] += 1
            upload = http.post(f"{url}gradio_api/upload", files={"files": (f"{uuid.uuid4().hex}.txt",
                                                                           big.read_bytes())})
            answers["5 MB upload"][f"HTTP {upload.status_code}"] += 1
            stop.wait(0.5)
    return {kind: dict(counter) for kind, counter in answers.items()} | {
        "most runs one burst got in": most}


def folder_size(path: Path) -> int:
    from studio.disk import folder_bytes

    return folder_bytes(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--honest", type=int, default=8, help="honest visitors, each with one run")
    parser.add_argument("--honest_settings", choices=("defaults", "tiny"), default="defaults")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds an honest run may take before it hangs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="ghosted-flood-"))
    uploads = folder / "gradio"  # this server's own upload folder, measured
    server, url, _stats = start_server(folder, ("smollm2-135m",), {"GHOSTED_APP_RUN_BUDGET": "900",
                                                                    "GRADIO_TEMP_DIR": str(uploads)})
    try:
        defaults = run_defaults(url)
        names = list(defaults)
        honest = defaults if args.honest_settings == "defaults" else defaults | TINY | {"model": "smollm2-135m",
                                                                                      "depth": 3}
        honest = {k: v for k, v in honest.items() if v is not None}
        from studio.serving import serving_plan

        plan = serving_plan([defaults | honest, defaults])  # the honest runs and the flooder's own valid ones
        peak = {"rss": rss(server.pid), "uploads": folder_size(uploads)}
        at_start = peak["rss"]  # the process, its model loaded, before any run
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.5):
                peak["rss"] = max(peak["rss"], rss(server.pid))
                peak["uploads"] = max(peak["uploads"], folder_size(uploads))

        threading.Thread(target=sample, daemon=True).start()
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.honest + 1) as pool:
            flooder = pool.submit(flood, url, [defaults[n] for n in names], names, stop, folder, honest)
            time.sleep(2)  # the flood first
            users = [pool.submit(honest_user, url, user, honest, args.timeout, folder) for user in range(args.honest)]
            records = [u.result() for u in users]
            stop.set()
            answers = flooder.result()
        elapsed = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(timeout=60)
    completed = [r for r in records if r["outcome"] == "complete"]
    waits = [r["wait"] for r in completed]
    print(f"honest visitors: {len(completed)} of {len(records)} runs complete ({args.honest_settings} settings); "
          f"queue wait p50 {percentile(waits, 0.5) or 0:.1f} s, p95 {percentile(waits, 0.95) or 0:.1f} s")
    for record in records:
        if record["outcome"] != "complete":
            print(f"  visitor {record['user']}: {record['outcome']} {record.get('message', '')}")
    most = answers.pop("most runs one burst got in")
    print("| the flooder sent | answered |\n|---|---|")
    for kind, counter in answers.items():
        print(f"| {kind} | " + ", ".join(f"{n} × {answer}" for answer, n in sorted(counter.items())) + " |")
    print("most runs one burst got in: " + "; ".join(f"{kind}: {n}" for kind, n in most.items()))
    print("serving figure (studio.serving): " + " + ".join(f"{part} {b / 2**30:.2f}" for part, b in plan.items()
                                                         if part != "total") + f" = {plan['total'] / 2**30:.2f} GiB; "
          f"measured: the process with its model {at_start / 2**30:.2f} GiB at start, peak RSS "
          f"{peak['rss'] / 2**30:.2f} GiB ({peak['rss'] / plan['total']:.2f} of the figure)")
    print(f"server peak RSS {peak['rss'] / 2**30:.2f} GiB; Gradio's upload folder at most "
          f"{peak['uploads'] / 2**20:.0f} MiB; {elapsed:.0f} s in all, load average {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"honest": records, "flood": answers, "most_per_burst": most,
                                               "peak_rss": peak["rss"], "rss_at_start": at_start,
                                               "serving_plan": plan,
                                               "peak_uploads": peak["uploads"], "seconds": elapsed,
                                               "settings": args.honest_settings, "cores": os.cpu_count()}, indent=2))
    return 0 if len(completed) == len(records) and peak["rss"] <= plan["total"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
