import os
import shutil
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A Session with a draft graph makes the process's ONNX Runtime thread pool shared by default, and
# ONNX Runtime then refuses sessions that ask for threads of their own: this process runs such
# sessions (plain InferenceSessions), so its Sessions keep pools of their own.
# tests/test_thread_pool.py proves the default in child processes.
os.environ.setdefault("SPECDEPLOY_THREAD_POOL", "own")
sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402

MAX_SEQ = 128
PREFILL_CHUNK = 16  # smaller than the longer prompts, so prefill runs in several chunks


@pytest.fixture(scope="session")
def shared(tmp_path_factory, worker_id):
    """A folder every worker of the run shares (pytest-xdist's workers are processes of their own):
    what one builds there, the others reuse (`once`)."""
    if worker_id == "master":  # one process
        return tmp_path_factory.mktemp("shared")
    root = tmp_path_factory.getbasetemp().parent / "shared"
    root.mkdir(exist_ok=True)
    return root


def once(root: Path, name: str, build) -> Path:
    """root/name as `build(folder)` makes it, built once per run: the first worker to ask builds it
    under a lock, the others wait for it and reuse it."""
    from filelock import FileLock

    folder, done = root / name, root / f".{name}.done"
    with FileLock(str(root / f".{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that failed half way
            build(folder)
            done.touch()
    return folder


MODELS = [  # name, architecture, seed, layers, config overrides
    ("llama", "llama", 0, 3, {}),
    ("llama_draft", "llama", 1, 1, {}),
    ("qwen2", "qwen2", 2, 3, {}),
    ("mistral", "mistral", 3, 3, {"sliding_window": 40}),
    ("mistral_draft", "mistral", 4, 1, {"sliding_window": 40}),
]


@pytest.fixture(scope="session")
def models(shared):
    """Tiny random source models, as Hugging Face folders, sharing one tokenizer."""
    def build(root):
        for name, arch, seed, layers, extra in MODELS:
            tiny.make_model(root / name, arch, seed=seed, layers=layers, **extra)

    root = once(shared, "models", build)
    return {name: root / name for name, *_ in MODELS}


BUNDLES = {
    # name: (target, draft)
    "llama-model": ("llama", "llama_draft"),
    "llama-self": ("llama", "self:layers=1"),
    "llama-ngram": ("llama", "ngram"),
    "llama-suffix": ("llama", "suffix"),
    "llama-same": ("llama", "llama"),  # the target as its own draft: every draft token accepted
    "qwen2-self": ("qwen2", "self:layers=1"),
    "mistral-model": ("mistral", "mistral_draft"),
    "llama-self-int8": ("llama", "self:dtype=int8"),  # the target itself, quantized, as its draft
    "llama-self-int4": ("llama", "self:layers=1,dtype=int4"),
    "llama-int8-ngram": ("llama", "ngram", {"dtype": "int8"}),  # an int graph: its K/V read as bound
}


@pytest.fixture(scope="session")
def bundles(models, shared):
    """Exported lazily, once per run: a test asks for one bundle by name."""
    from specdeploy.export import build_bundle

    built = {}
    root = shared / "bundles"
    root.mkdir(exist_ok=True)

    def get(name):
        if name not in built:
            target, draft, *options = BUNDLES[name]
            draft = str(models[draft]) if draft in models else draft
            built[name] = once(root, name, lambda out: build_bundle(
                models[target], draft, out, max_seq=MAX_SEQ, max_draft=8, prefill_chunk=PREFILL_CHUNK,
                cache=shared / "graphs", **(options[0] if options else {})))  # one target graph for every draft
            # kind (test_graph_cache.py)
        return built[name]

    return get


@pytest.fixture
def copy_of(bundles, tmp_path):
    """A copy of an exported bundle, to tamper with: copy_of(name) -> its folder."""
    def make(name="llama-self"):
        dst = tmp_path / name
        shutil.copytree(bundles(name), dst)
        return dst

    return make


# Fixtures that build source models or export bundles: a test that reaches any of them (directly
# or through another fixture) belongs to the whole suite, not to `make test-fast`.
EXPORTING_FIXTURES = {"models", "bundles", "smollm2", "small_vocab", "small_tree", "heads", "eagle_bundles", "small_head",
                      "small_assistant", "tool_bundle", "llama_bundle", "mistral_bundle"}


def pytest_collection_modifyitems(items):
    for item in items:
        if EXPORTING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.bundle)


@pytest.fixture(scope="session")
def small_vocab(tmp_path_factory):
    """Bundles of a tiny target with a vocabulary of 16 (a model draft, n-gram, its int8 self),
    each as a session and a prompt whose draft is fair: the distribution tests' (test_sampling.py,
    test_penalties.py)."""
    from specdeploy.export import build_bundle
    from specdeploy.runtime import Session

    root = tmp_path_factory.mktemp("small")
    # initializer_range 0.5: peaked but not degenerate next-token distributions
    tiny.make_model(root / "t", "llama", seed=11, layers=2, vocab_size=tiny.VOCAB, initializer_range=0.5)
    tiny.make_model(root / "d", "llama", seed=12, layers=1, vocab_size=tiny.VOCAB, initializer_range=0.5)
    out = {}
    for name, draft in (("model", str(root / "d")), ("ngram", "ngram"), ("self-int8", "self:dtype=int8")):
        build_bundle(root / "t", draft, root / name, max_seq=32, max_draft=4, prefill_chunk=8, cache=root / "graphs")
        session = Session(root / name)
        session.eos_token_ids = []  # every sample has two tokens: the pairs are the whole outcome
        out[name] = session, tiny.prompt_with_a_fair_draft(session)
    return out
