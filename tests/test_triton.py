"""`specdeploy triton-repo`: the repository, its static check, and the real Triton server
(from the nvidia-pytriton wheel, on loopback) streaming the same tokens as `specdeploy generate`."""
from __future__ import annotations

import json
import re
import threading
import urllib.request

import numpy as np
import pytest
from click.testing import CliRunner

import tritonserver
from tritonserver import DTYPES, NUMPY, Answer, generate, one
from specdeploy.cli import main
from specdeploy.runtime import Session
from specdeploy.runtime.serving import triton, triton_io

pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2",
                          reason="tritonclient is not installed (pip install 'specdeploy[triton]')")

INSTANCES, MAX_QUEUE = 2, 3
BUNDLE = "llama-model"  # a model draft: every request drafts, verifies and accepts



def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def read_config(path):
    from google.protobuf import text_format

    return text_format.Parse(path.read_text(), pb2.ModelConfig())


# -- the repository and its check: no server ----------------------------------------------

def test_repository_layout_and_config(bundles, tmp_path):
    result = cli("triton-repo", bundles(BUNDLE), tmp_path / "repo", "--name", "spec", "--instances", 3,
                 "--max-queue", 5, "--threads", 1)
    assert result.exit_code == 0, result.output
    model = tmp_path / "repo" / "spec"
    config = read_config(model / "config.pbtxt")
    assert (config.name, config.backend, config.max_batch_size) == ("spec", "python", 0)
    assert config.model_transaction_policy.decoupled
    assert [(g.count, pb2.ModelInstanceGroup.Kind.Name(g.kind)) for g in config.instance_group] == [(3, "KIND_CPU")]
    # batches of up to 8 by default (the bundle's max_batch): Triton's queue also holds the 8 a batch takes
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 5 + 8
    assert {t.name for t in config.input} == {t.name for t in triton_io.INPUTS}
    assert [t.name for t in config.input if not t.optional] == ["text_input"]
    assert {k: v.string_value for k, v in config.parameters.items()} == {"bundle": "bundle", "backend": "ort",
                                                                       "threads": "1", "batch": "8"}
    assert "3 instance(s), batches of up to 8" in result.output
    assert (model / "1" / "model.py").read_text() == triton.template()
    assert Session(model / "1" / "bundle").bundle.max_seq == 128  # the copy loads, checksums verified
    check = cli("triton-repo", "--check", tmp_path / "repo")
    assert check.exit_code == 0, check.output
    assert "ok: spec: " in check.stdout and "3 instance(s), batches of up to 8, queue 13" in check.stdout
    one_at_a_time = cli("triton-repo", bundles(BUNDLE), tmp_path / "repo", "--name", "spec", "--instances", 3,
                        "--max-queue", 5, "--batch", 0, "--replace")
    config = read_config(model / "config.pbtxt")
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 5
    assert config.parameters["batch"].string_value == "" and "batches" not in one_at_a_time.output


def test_gpu_backends_and_a_referenced_bundle(bundles, tmp_path):
    bundle = bundles(BUNDLE)
    assert cli("triton-repo", bundle, tmp_path, "--backend", "trt", "--reference").exit_code == 0
    config = read_config(tmp_path / bundle.name / "config.pbtxt")
    assert pb2.ModelInstanceGroup.Kind.Name(config.instance_group[0].kind) == "KIND_GPU"
    assert config.parameters["bundle"].string_value == str(bundle.resolve())
    assert config.parameters["backend"].string_value == "trt"
    assert not (tmp_path / bundle.name / "1" / "bundle").exists()
    assert cli("triton-repo", "--check", tmp_path).exit_code == 0


EDITS = [  # (a hand edit of config.pbtxt, what --check says about it)
    (("instance_group", "instance_grup"), r"config\.pbtxt:\d+:\d+ : .*no field named \"instance_grup\""),
    (("KIND_CPU", "KIND_CPUU"), r"config\.pbtxt:\d+:\d+ : .*has no value named KIND_CPUU"),
    (("decoupled: true", "decoupled: false"), r"model_transaction_policy must be \{ decoupled: true \}"),
    (('"temperature"', '"temprature"'), r'input "temprature" is not one model.py reads'),
    (('"top_p" data_type: TYPE_FP64', '"top_p" data_type: TYPE_FP32'), r'input "top_p" is TYPE_FP32 \[1\]; '
                                                                       r"model.py expects TYPE_FP64 \[1\]"),
    (('string_value: "bundle"', 'string_value: "nowhere"'), r"nowhere.* (missing|no such|not)"),
    (('string_value: "ort"', 'string_value: "onnx"'), r"parameter 'backend' 'onnx': choose from ort, torch, trt"),
    (("max_batch_size: 0", "max_batch_size: 4"), r"max_batch_size 4: model.py reads unbatched inputs"),
]


@pytest.mark.parametrize("edit,expected", EDITS, ids=[e[0][1] for e in EDITS])
def test_check_says_what_is_wrong_with_a_hand_edited_config(bundles, tmp_path, edit, expected):
    assert cli("triton-repo", bundles(BUNDLE), tmp_path, "--name", "m").exit_code == 0
    config = tmp_path / "m" / "config.pbtxt"
    text = config.read_text()
    assert edit[0] in text
    config.write_text(text.replace(edit[0], edit[1], 1))
    result = cli("triton-repo", "--check", tmp_path)
    assert result.exit_code == 1
    assert re.search(expected, result.stdout), result.stdout
    assert str(config) in result.stdout
    assert result.stderr.strip().splitlines() == [f"error: {len(result.stdout.splitlines())} problem(s) in {tmp_path}"]


def test_mistakes_are_one_line_errors(bundles, tmp_path):
    bundle = bundles(BUNDLE)
    for args, message in [
        ((bundle, tmp_path, "--instances", 0), "--instances 0 is outside [1, 256]"),
        ((bundle, tmp_path, "--max-queue", 0), "--max-queue 0 must be >= 1 (Triton reads 0 as an unbounded queue)"),
        ((bundle, tmp_path, "--name", "a/b"), "--name 'a/b': a model name is one folder name"),
        ((tmp_path / "absent", tmp_path), "absent"),
        (("--check", tmp_path / "absent"), "no such folder"),
        (("--check", tmp_path), "no model folder with a config.pbtxt"),
        ((bundle,), "give BUNDLE and OUT (or --check REPOSITORY)"),
    ]:
        result = cli("triton-repo", *args)
        assert result.exit_code == 1, (args, result.output)
        assert result.stderr.startswith("error: ") and message in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert cli("triton-repo", bundle, tmp_path, "--name", "m").exit_code == 0
    again = cli("triton-repo", bundle, tmp_path, "--name", "m")
    assert again.exit_code == 1 and "already exists" in again.stderr


def test_request_checks_name_the_input():
    limits = triton_io.Limits(max_seq=128, max_draft=8, max_chars=8192)

    def parse(**fields):
        inputs = {"text_input": np.array([b"Hi"], dtype=np.object_)}
        for k, v in fields.items():
            inputs[k] = np.array(v if isinstance(v, list) else [v], dtype=NUMPY[DTYPES[k]])
        return triton_io.parse_request(inputs.get, limits)

    req = parse()  # the defaults of `specdeploy serve`
    assert (req.prompt, req.chat, req.stream, req.max_tokens) == ("Hi", False, False, None)
    assert req.options == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": [], "draft_len": "auto"}
    req = parse(chat=True, stream=True, max_tokens=9, temperature=0.5, top_k=4, top_p=0.9, seed=2**64 - 1,
                stop=[b"\n", "é".encode()], draft_len=0)
    assert (req.chat, req.stream, req.max_tokens) == (True, True, 9)
    assert req.options == {"temperature": 0.5, "top_p": 0.9, "top_k": 4, "seed": 2**64 - 1, "stop": ["\n", "é"],
                           "draft_len": 0}
    for fields, message in [
        ({"text_input": b"\xff"}, "'text_input' is not valid UTF-8"),
        ({"text_input": b"x" * 8193}, "'text_input' has 8193 characters; at most 8192"),
        ({"max_tokens": 0}, "'max_tokens' 0 is outside [1, 128]"),
        ({"temperature": float("nan")}, "'temperature' nan is outside [0, 2]"),
        ({"top_p": 1.5}, "'top_p' 1.5 is outside (0, 1]"),
        ({"top_k": -1}, "'top_k' -1 must be >= 0"),
        ({"stop": [b"a", b""]}, "'stop' must be at most 4 non-empty strings"),
        ({"draft_len": 9}, "'draft_len' 9 is outside [0, 8] (the bundle's max draft)"),
        ({"max_tokens": [1, 2]}, "'max_tokens' must hold one value, got 2"),
    ]:
        with pytest.raises(triton.InputError, match=re.escape(message)):
            if "text_input" in fields:
                triton_io.parse_request({"text_input": np.array([fields["text_input"]], dtype=np.object_)}.get, limits)
            else:
                parse(**fields)


# -- the real server ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(bundles, tmp_path_factory):
    reason = tritonserver.unavailable()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("triton")
    bundle = bundles(BUNDLE)
    # one request at a time per instance (batch 0): the queue bound below counts requests, not lanes
    triton.write_repository(bundle, root / "repo", "spec", instances=INSTANCES, max_queue=MAX_QUEUE, threads=1,
                            batch=0)
    server = tritonserver.TritonServer(root / "repo", root)
    server.started_in = server.start()
    yield server, bundle
    server.stop()


def generate_json(bundle, prompt, chat=False, **options) -> dict:
    args = ["generate", bundle, "--prompt", prompt, "--json"] + (["--chat"] if chat else [])
    for k, v in options.items():
        args += [f"--{k.replace('_', '-')}", v]
    result = cli(*args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_streams_the_tokens_specdeploy_generate_gives(served):
    server, bundle = served
    for prompt, chat, options in [
        ("The quick brown fox", False, dict(temperature=0.0, max_new_tokens=40)),
        ("hello", True, dict(temperature=0.0, max_new_tokens=30)),
        ("Speculative decoding", False, dict(temperature=0.8, top_k=50, top_p=0.95, seed=7, draft_len=3,
                                             max_new_tokens=40)),
    ]:
        expected = generate_json(bundle, prompt, chat, **options)
        fields = {k: v for k, v in options.items() if k != "max_new_tokens"}
        answer = one(server.grpc_url, "spec", text_input=prompt, chat=chat, stream=True,
                     max_tokens=options["max_new_tokens"], **fields)
        assert answer.error is None, answer.error
        assert answer.token_ids == expected["token_ids"], prompt
        assert answer.text == expected["text"]
        assert answer.responses > 2  # streamed: a response per round, then the last with the statistics
        assert answer.finish_reason == expected["stats"]["finish_reason"]
        assert answer.stats["new_tokens"] == len(answer.token_ids)
        for key in ("prompt_tokens", "target_passes", "drafted", "accepted", "acceptance_rate", "mean_accepted"):
            assert key in answer.stats
        if options["temperature"] == 0.0:  # greedy: the same draft-length-free tokens, and drafts were tried
            assert answer.stats["drafted"] > 0
    whole = one(server.grpc_url, "spec", text_input="The quick brown fox", max_tokens=40, temperature=0.0)
    assert whole.responses == 1 and whole.token_ids == generate_json(
        bundle, "The quick brown fox", temperature=0.0, max_new_tokens=40)["token_ids"]
    # Triton's HTTP generate endpoint maps JSON fields to the same inputs
    body = json.dumps({"text_input": "The quick brown fox", "max_tokens": 40, "temperature": 0.0}).encode()
    request = urllib.request.Request(server.http_url + "/v2/models/spec/generate", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        reply = json.loads(r.read())
    assert reply["text_output"] == whole.text and reply["token_ids"] == whole.token_ids


def test_concurrent_streams_get_their_own_answers(served):
    server, bundle = served
    prompts = ["The quick brown fox", "def add(a, b):", "Zürich and Köln", "who, what, where"]
    session = Session(bundle)
    expected = [session.generate(p, max_new_tokens=48, temperature=0.9, seed=i, draft_len=2).token_ids
                for i, p in enumerate(prompts)]
    answers: list[Answer | None] = [None] * len(prompts)

    def client(i):  # a client of its own each, all at once: 2 instances busy, 2 waiting
        answers[i] = one(server.grpc_url, "spec", text_input=prompts[i], stream=True, max_tokens=48,
                         temperature=0.9, seed=i, draft_len=2)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for i, answer in enumerate(answers):
        assert answer is not None and answer.error is None, answer
        assert answer.token_ids == expected[i], prompts[i]
        assert answer.stats["new_tokens"] == len(expected[i])


@pytest.fixture(scope="module")
def served_batched(bundles, tmp_path_factory):
    """One instance running continuous batching of up to 4 requests."""
    reason = tritonserver.unavailable()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("triton_batched")
    bundle = bundles("llama-ngram")  # a model-free draft: the batch drafts for every lane
    triton.write_repository(bundle, root / "repo", "spec", instances=1, max_queue=MAX_QUEUE, threads=1, batch=4)
    assert 'key: "batch" value: { string_value: "4" }' in (root / "repo" / "spec" / "config.pbtxt").read_text()
    server = tritonserver.TritonServer(root / "repo", root)
    server.start()
    yield server, bundle
    server.stop()


def test_a_batched_instance_answers_concurrent_streams_each_as_alone(served_batched):
    server, bundle = served_batched
    prompts = ["The quick brown fox", "def add(a, b):", "Zürich and Köln", "who, what, where", "Speculative decoding"]
    session = Session(bundle, prompt_cache=False)
    options = [dict(temperature=0.9, seed=i, draft_len=2) if i % 2 else dict(temperature=0.0) for i in range(len(prompts))]
    # structured output and penalties reach the batch's lanes as a Session's arguments
    options[2] |= dict(structure=json.dumps({"regex": "[a-z]{2,8}( [a-z]{2,8}){1,6}"}), presence_penalty=0.5)
    options[3] |= dict(structure=json.dumps({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}),
                       repetition_penalty=1.3, min_p=0.05)
    expected = [session.generate(p, max_new_tokens=40 + 4 * i, **options[i]).token_ids for i, p in enumerate(prompts)]
    assert expected[2] != session.generate(prompts[2], max_new_tokens=48, temperature=0.0).token_ids
    answers: list[Answer | None] = [None] * len(prompts)

    def client(i):
        answers[i] = one(server.grpc_url, "spec", text_input=prompts[i], stream=True, max_tokens=40 + 4 * i, **options[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for i, answer in enumerate(answers):
        assert answer is not None and answer.error is None, answer
        assert answer.token_ids == expected[i], prompts[i]
        assert answer.responses > 2 and answer.stats["new_tokens"] == len(expected[i])


def test_the_queue_is_bounded(served):
    server, _ = served
    burst = INSTANCES + MAX_QUEUE + 4
    answers = generate(server.grpc_url, "spec", [
        dict(text_input="a", stream=True, max_tokens=110, temperature=0.0, draft_len=0) for _ in range(burst)])
    refused = [a for a in answers if a.error is not None]
    assert refused, "every request of the burst was taken"
    assert all("Exceeds maximum queue size" in a.error for a in refused), [a.error for a in refused]
    # max_queue_size counts the requests no instance has taken yet; in a burst an idle instance may
    # not have taken its first one when the queue fills, so at least MAX_QUEUE + 1 get in
    assert MAX_QUEUE + 1 <= burst - len(refused) <= MAX_QUEUE + INSTANCES
    served_ok = [a for a in answers if a.error is None]
    assert all(a.token_ids == served_ok[0].token_ids and len(a.token_ids) == 110 for a in served_ok)


def test_bad_requests_get_an_error_and_the_server_keeps_serving(served):
    server, _ = served
    long_text = " ".join(["brown fox jumps"] * 60)
    cases = [
        (dict(temperature=5.0), "'temperature' 5.0 is outside [0, 2]"),
        (dict(max_tokens=0), "'max_tokens' 0 is outside [1, 128]"),
        (dict(draft_len=99), "'draft_len' 99 is outside [0, 8]"),
        (dict(stop=["a", "b", "c", "d", "e"]), "'stop' must be at most 4 non-empty strings"),
        (dict(text_input=long_text), "is longer than the bundle's max sequence of 128"),
        (dict(max_tokens=127, text_input="The quick brown fox"), "'max_tokens': prompt of"),
        (dict(text_input=(7, "INT32")), "data-type is 'INT32', but model 'spec' expects 'BYTES'"),  # Triton's own
        (dict(temprature=0.5), "unexpected inference input 'temprature'"),
    ]
    for fields, message in cases:  # one at a time: the model's own errors do not say which request they answer
        answer = one(server.grpc_url, "spec", **{"text_input": "hi", **fields})
        assert answer.error is not None and message in answer.error, (fields, answer.error)
    assert "missing required input(s) ['text_input']" in one(server.grpc_url, "spec").error  # no input at all
    assert one(server.grpc_url, "spec", stream=True).error == "'text_input' is missing"  # Triton counts inputs only
    after = one(server.grpc_url, "spec", text_input="The quick", stream=True, max_tokens=12, temperature=0.0)
    assert after.error is None and len(after.token_ids) == 12


def test_stops_cleanly_leaving_no_process(served):
    server, _ = served
    stubs = set(server.stubs)
    assert len(stubs) == INSTANCES  # one Python backend stub per instance
    seconds, status, left = server.stop()
    assert status == 0 and not left, (status, left, server.log_tail())
    assert seconds < server.exit_timeout
    assert not server.ready()
