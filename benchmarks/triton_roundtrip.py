"""A bundle through Triton Inference Server against the runtime in this process.

    python benchmarks/triton_roundtrip.py BUNDLE [--instances 1,2] [--prompts FILE] [--limit N]
        [--max-tokens N] [--threads N]

Runs the Triton server of the nvidia-pytriton wheel on loopback (the launcher the tests use,
tests/tritonserver.py) over a repository `specdeploy triton-repo --reference` writes. For
each instance count N: the server's start time (to every model ready), each instance's
memory (RSS of its Python backend process, after loading and after the runs), then every
prompt (chat template, greedy) run by a Session here and streamed over gRPC, alternating,
each answer checked token for token against the Session's: the time to the first token and
the decoding rate (tokens after the first round over the time from it to the last), the
Triton side measured by the client; then N clients streaming at once (each the prompts in
turn), the aggregate tokens/s; then the stop (seconds, processes left). The Session (all
cores) and the server get a warm-up generation each.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))

import tritonserver  # noqa: E402
from specdeploy.runtime import Session  # noqa: E402
from specdeploy.runtime.serving import triton  # noqa: E402
from specdeploy.runtime.tools.bench import read_prompts  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def request(prompt: str, max_tokens: int) -> dict:
    return dict(text_input=prompt, chat=True, stream=True, max_tokens=max_tokens, temperature=0.0)


def decode_rate(a) -> float:
    """Client-side decode-only tok/s: the tokens after the first response, over the time from it to the last."""
    span = a.last_seconds - a.first_seconds
    return (len(a.token_ids) - a.first_tokens) / span if span > 0 else 0.0


def through_triton(bundle: str, session: Session, prompts: list[str], instances: int, max_tokens: int,
                   threads: int | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        triton.write_repository(bundle, repo, "spec", instances=instances, max_queue=64, threads=threads,
                                reference=True)
        server = tritonserver.TritonServer(repo, Path(tmp))
        started = server.start()
        try:
            loaded = {pid: rss_mib(pid) for pid in server.stubs}
            url = server.grpc_url
            tritonserver.generate(url, "spec", [request(prompts[0], 8)] * instances)  # warm-up, one per instance
            rows, same = [], 0
            for p in prompts:  # alternating: the runtime here, then the same prompt through Triton
                r = session.generate(p, chat=True, max_new_tokens=max_tokens, temperature=0.0)
                a = tritonserver.one(url, "spec", **request(p, max_tokens))
                assert a.error is None, a.error
                same += a.token_ids == r.token_ids
                rows.append((a.first_seconds, decode_rate(a), r.stats.first_token_seconds,
                             r.stats.decode_tokens_per_second))
            total, lock = [0], threading.Lock()

            def client(i):
                for p in prompts[i:] + prompts[:i]:
                    a = tritonserver.one(url, "spec", **request(p, max_tokens))
                    assert a.error is None, a.error
                    with lock:
                        total[0] += len(a.token_ids)

            clients = [threading.Thread(target=client, args=(i,)) for i in range(instances)]
            t0 = time.perf_counter()
            for c in clients:
                c.start()
            for c in clients:
                c.join()
            wall = time.perf_counter() - t0
            after = {pid: rss_mib(pid) for pid in server.stubs}
        finally:
            stop_seconds, status, left = server.stop()
    median = [statistics.median(col) for col in zip(*rows)]
    print(f"\n{instances} instance(s), threads {threads or 'all'}: server ready in {started:.1f} s; "
          f"stopped in {stop_seconds:.1f} s (status {status}, {len(left)} process(es) left)")
    print(f"  memory per instance (RSS): {', '.join(f'{v:.0f}' for v in loaded.values())} MiB loaded, "
          f"{', '.join(f'{v:.0f}' for v in after.values())} MiB after the runs")
    print(f"  one stream at a time, {len(prompts)} prompts: {same}/{len(prompts)} token-identical to the runtime; "
          f"median first token {median[0] * 1000:.1f} ms (runtime {median[2] * 1000:.1f} ms), "
          f"decoding {median[1]:.1f} tok/s (runtime {median[3]:.1f})")
    print(f"  {instances} concurrent streams: {total[0]} tokens in {wall:.1f} s = {total[0] / wall:.1f} tok/s in all")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--instances", default="1,2")
    ap.add_argument("--prompts", default=str(HERE / "prompts_varied.txt"))
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, help="per instance (default: all cores over the instance count)")
    args = ap.parse_args()
    reason = tritonserver.unavailable()
    if reason:
        sys.exit(f"error: {reason}")
    prompts = read_prompts(Path(args.prompts))[: args.limit]
    cores = os.cpu_count() or 1
    session = Session(args.bundle)
    session.generate(prompts[0], chat=True, max_new_tokens=8, temperature=0.0)  # warm-up
    for n in [int(x) for x in args.instances.split(",")]:
        through_triton(args.bundle, session, prompts, n, args.max_tokens, args.threads or max(1, cores // n))


if __name__ == "__main__":
    main()
