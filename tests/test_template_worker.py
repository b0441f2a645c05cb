"""Chat templates render in a worker process with a time and a memory limit: a template that
holds the interpreter in one C call, or allocates gigabytes in one filter, stops within the
bound as a one-line error while the calling process keeps running threads and its memory,
and the next render works."""
import json
import resource
import threading
import time

import pytest

import tiny
from specdeploy.core.chat_template import TEMPLATE_SECONDS, KILL_MARGIN, render_here
from specdeploy.core.errors import BundleError, InputError
from specdeploy.core.manifest import TokenizerEntry
from specdeploy.runtime.decoding.tokenizer import Tokenizer

END = tiny.SPECIALS.index("<|im_end|>") if "<|im_end|>" in tiny.SPECIALS else 0


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    tiny.make_tokenizer(folder)
    return folder / "tokenizer.json"


def tokenizer(path, template):
    return Tokenizer(path, TokenizerEntry("tokenizer.json", [END], "<|im_start|>", "<|im_end|>", template))


HELLO = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("template, fragment", [
    ("{{ ([[1]] * 300000) | sum(start=[]) }}", f"ran past {TEMPLATE_SECONDS:g} s"),
    ("{{ (['a' * 1000000] * 2000) | join }}", "MB"),
], ids=["c-level-loop", "one-huge-join"])
def test_what_the_in_process_bounds_cannot_see_the_worker_stops(tok_path, template, fragment):
    tok = tokenizer(tok_path, template)
    ticks = []
    stop = threading.Event()

    def tick():  # runs only while the render does not hold this process's interpreter
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ticker = threading.Thread(target=tick, daemon=True)
    start = time.monotonic()
    ticker.start()
    with pytest.raises(InputError, match=r"^chat template: stopped rendering, .*" + fragment):
        tok.apply_chat_template(HELLO)
    seconds = time.monotonic() - start
    stop.set()
    ticker.join()
    assert seconds < TEMPLATE_SECONDS + KILL_MARGIN + 2.0
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert ticks and all(g < 0.5 for g in gaps), gaps  # the caller's threads kept running throughout
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # kB: nothing grew here
    ordinary = tokenizer(tok_path, tiny.CHAT_TEMPLATE)  # the worker is back for the next render
    assert ordinary.apply_chat_template(HELLO) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_the_worker_renders_what_the_process_would(tok_path):
    context = dict(messages=HELLO, add_generation_prompt=True, bos_token="", eos_token="")
    assert tokenizer(tok_path, tiny.CHAT_TEMPLATE).apply_chat_template(HELLO) == render_here(tiny.CHAT_TEMPLATE, context, 5)


def test_a_template_that_is_not_jinja_names_the_bundle(tok_path):
    with pytest.raises(BundleError, match=r"^chat template: not a valid Jinja template"):
        tokenizer(tok_path, "{% for %}").apply_chat_template(HELLO)


def test_a_tokenizer_file_that_is_not_a_tokenizer_is_one_line(tmp_path, tok_path):
    for name, text in [("notjson.json", "hello"), ("wrong.json", json.dumps({"model": {"type": "Nothing"}}))]:
        (tmp_path / name).write_text(text)
        with pytest.raises(BundleError, match=rf"{name}: the tokenizer failed"):
            Tokenizer(tmp_path / name, TokenizerEntry(name, [0]))


def test_a_tokenizer_whose_rules_make_the_library_panic_is_one_line(tmp_path, tok_path, capfd):
    spec = json.loads(tok_path.read_text())
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "X", "type_id": 0}}],
                              "pair": [], "special_tokens": {}}  # a token it never defines: the library panics
    (tmp_path / "t.json").write_text(json.dumps(spec))
    with pytest.raises(BundleError, match=r"t.json: the tokenizer failed \(PanicException: no entry found for key\)"):
        Tokenizer(tmp_path / "t.json", TokenizerEntry("t.json", [0]))
    assert "panicked" not in capfd.readouterr().err
