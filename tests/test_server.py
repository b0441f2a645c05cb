"""The HTTP server over real loopback HTTP: OpenAI-compatible endpoints, SSE streaming,
metrics, bad input, the bounded queue, and a bounded concurrent load test."""
import json
import resource
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specdeploy.runtime import Session
from specdeploy.runtime.serving.pool import Overloaded, SessionPool
from loopback import Server, sse_text
from tiny import PROMPTS


@pytest.fixture(scope="module")
def server(bundles):
    pool = SessionPool(bundles("llama-model"), workers=2, max_queue=16)
    with Server(pool) as s:
        yield s


@pytest.fixture(scope="module")
def reference(bundles):
    """Greedy text per prompt from a plain Session: what every server answer must equal."""
    session = Session(bundles("llama-model"))
    return {p: session.generate(p, max_new_tokens=24, speculate=False).text for p in PROMPTS}


def test_health_and_models(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "tiny"


def test_completion_equals_session_output(server, reference):
    body = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion"
    assert out["choices"][0]["text"] == reference[PROMPTS[0]]
    assert out["usage"]["completion_tokens"] == out["specdeploy"]["new_tokens"]


def test_a_repeated_chat_prompt_reports_its_cached_tokens(server):
    # Two sessions serve in turn: by the third request one of them holds the prompt already.
    body = {"messages": [{"role": "user", "content": PROMPTS[3]}], "max_tokens": 16, "temperature": 0}
    outs = [httpx.post(server.url + "/v1/chat/completions", json=body).json() for _ in range(3)]
    assert len({o["choices"][0]["message"]["content"] for o in outs}) == 1
    prompt = outs[0]["usage"]["prompt_tokens"]
    cached = [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs]
    assert cached[2] == prompt - 1


def test_streaming_completion_and_chat(server, reference):
    body = {"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert sse_text(r) == reference[PROMPTS[1]]
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 20, "temperature": 0}
    whole = httpx.post(server.url + "/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**chat, "stream": True}) as r:
        assert sse_text(r, chat=True) == whole


def test_openai_client_works_unchanged(server, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    out = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=0)
    assert out.choices[0].text == reference[PROMPTS[2]]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0
    )
    streamed = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == chat.choices[0].message.content
    assert chat.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "body, fragment",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (json.dumps({"prompt": "hi", "max_tokens": "ten"}).encode(), "'max_tokens' must be an integer"),
        (json.dumps({"prompt": "hi", "max_tokens": True}).encode(), "'max_tokens' must be an integer"),
        (json.dumps({"prompt": "hi", "temperature": "hot"}).encode(), "'temperature' must be a number"),
        (json.dumps({"prompt": "hi", "stream": "yes"}).encode(), "'stream' must be a boolean"),
        (json.dumps({"prompt": "hi", "stop": [1]}).encode(), "'stop' must be"),
        (json.dumps({"prompt": 5}).encode(), "'prompt' must be a string"),
        (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), "'max_tokens' 0 is outside [1, 128]"),
        (json.dumps({"prompt": "hi", "max_tokens": 5000}).encode(), "'max_tokens' 5000 is outside [1, 128]"),
        (json.dumps({"prompt": "hi", "top_p": 0}).encode(), "'top_p' 0.0 is outside (0, 1]"),
        (json.dumps({"prompt": [1] * 200}).encode(), "longer than the bundle's max sequence of 128"),
        (json.dumps({"prompt": [1, 999]}).encode(), "token id 999 at prompt position 1 is outside the vocabulary"),
        (json.dumps({"prompt": "hi " * 20, "max_tokens": 100}).encode(), "exceeds the bundle's max sequence"),
        (json.dumps({"prompt": "hi", "n": 2}).encode(), "'n' > 1 needs the batch"),
        (json.dumps({"prompt": "hi", "n": 0}).encode(), "'n' 0 is outside [1, 8]"),
    ],
)
def test_bad_requests_get_a_clear_4xx_and_the_server_keeps_serving(server, body, fragment):
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_bad_chat_messages(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user"}]})
    assert r.status_code == 400 and "messages[0]" in r.json()["error"]["message"]


def test_metrics_in_prometheus_format(server):
    httpx.post(server.url + "/v1/completions", json={"prompt": "The", "max_tokens": 8})
    text = httpx.get(server.url + "/metrics").text
    for name in ("specdeploy_requests_total", "specdeploy_generated_tokens_total", "specdeploy_acceptance_rate",
                 "specdeploy_draft_length_bucket", "specdeploy_request_seconds_bucket", "specdeploy_queue_waiting"):
        assert name in text, name


def test_full_queue_answers_503_at_once(bundles):
    pool = SessionPool(bundles("llama-model"), workers=1, max_queue=1)
    with Server(pool) as s:
        held = pool.acquire()  # the only session is busy
        waiting = ThreadPoolExecutor(1).submit(
            httpx.post, s.url + "/v1/completions", json={"prompt": "The", "max_tokens": 4}, timeout=30
        )
        deadline = time.time() + 10
        while pool.waiting < 1:
            assert time.time() < deadline
            time.sleep(0.02)
        t0 = time.time()
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "The", "max_tokens": 4})
        assert r.status_code == 503 and "queue limit 1" in r.json()["error"]["message"]
        assert time.time() - t0 < 2  # refused at once, not queued
        pool.release(held)
        assert waiting.result().status_code == 200  # the queued request was served, not lost


def test_cancel_frees_the_session(bundles):
    pool = SessionPool(bundles("llama-model"), workers=1, max_queue=0)
    gen = pool.stream(PROMPTS[0], max_new_tokens=60, draft_len=2)
    for i, _ in enumerate(gen):
        if i == 1:
            gen.cancel()
    assert gen.stats.finish_reason == "cancelled"
    assert gen.stats.new_tokens < 60
    pool.generate(PROMPTS[1], max_new_tokens=4)  # the session is free again
    gen = pool.stream(PROMPTS[0], max_new_tokens=10)
    with pytest.raises(Overloaded):
        pool.stream(PROMPTS[1], max_new_tokens=4)
    gen.close()
    pool.generate(PROMPTS[1], max_new_tokens=4)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_load_concurrent_streaming_clients(server, reference):
    """8 concurrent streaming clients x 3 rounds over 20 prompts: every answer is its own
    prompt's text (none lost or mixed), and memory stays flat across rounds."""
    prompts = PROMPTS[:20]

    def client(i):
        prompt = prompts[i % len(prompts)]
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            return prompt, sse_text(r)

    rss = []
    started = time.perf_counter()
    for round_ in range(3):
        with ThreadPoolExecutor(8) as ex:
            results = list(ex.map(client, range(24)))
        assert len(results) == 24
        for prompt, text in results:
            assert text == reference[prompt], prompt
        rss.append(_rss_mib())
    elapsed = time.perf_counter() - started
    assert elapsed < 120
    assert rss[-1] - rss[0] < 50, f"memory grew across rounds: {rss}"
    print(f"\nload: 72 streamed requests in {elapsed:.1f}s, RSS by round {[round(r) for r in rss]} MiB")
