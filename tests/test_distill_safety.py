"""`specdeploy distill`'s work folder (OUT.work/) is read as something another party may have
written: a pickle planted there runs no code, even where TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD makes
torch's own default unsafe, and a truncated, re-keyed or random file there (checkpoint, answers
or features shard, settings.json) is a one-line error that names it and says how to start over,
with nothing written to --out. A work folder this version wrote still resumes."""
import json
import random
import shutil

import pytest
import torch
from click.testing import CliRunner

from specdeploy.cli import main
from specdeploy.core.errors import ExportError

# Small enough that a run takes seconds: one shard of answers, a checkpoint at step 25.
MODEL = dict(layers=1, draft_vocab=64, tokens=100, steps=30, batch=2, max_new_tokens=8)
HEAD = dict(draft_vocab=64, tokens=100, steps=30, batch=2, max_new_tokens=8, evaluate_every=10)
UNSAFE = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


@pytest.fixture(scope="module", autouse=True)
def prompts_once():
    """prompt_batches parses the standard library for prompts on every run (seconds each): once
    per settings here, as every run of this module asks for the same."""
    from specdeploy.export import distill as module

    made = {}
    real = module.prompt_batches

    def cached(source, s):
        if s not in made:
            made[s] = real(source, s)
        return made[s]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "prompt_batches", cached)
        yield


@pytest.fixture(scope="module")
def source(models):
    from specdeploy.export.load import load_source

    return load_source(models["llama"])


def run(kind, source, out):
    if kind == "model":
        from specdeploy.export.distill import DistillSettings, distill

        return distill(source, out, DistillSettings(**MODEL), progress=False)
    from specdeploy.export.distill_eagle3 import HeadSettings, distill_head

    return distill_head(source, out, HeadSettings(**HEAD), progress=False)


@pytest.fixture(scope="module")
def interrupted(source, tmp_path_factory):
    """Per kind, the work folder of a run interrupted after its checkpoint at step 25: settings.json,
    answers-00000.pt, checkpoint.pt (and features-00000.pt for eagle3)."""
    from specdeploy.export.distill import DistillSettings, distill
    from specdeploy.export.distill_eagle3 import HeadSettings, distill_head

    root = tmp_path_factory.mktemp("interrupted")
    with pytest.raises(KeyboardInterrupt):
        distill(source, root / "model", DistillSettings(**MODEL), progress=False, stop_after=26)
    with pytest.raises(KeyboardInterrupt):
        distill_head(source, root / "eagle3", HeadSettings(**HEAD), progress=False, stop_after=26)
    return {kind: root / f"{kind}.work" for kind in ("model", "eagle3")}


@pytest.fixture
def work(interrupted, tmp_path):
    """work(kind) -> (out, its work folder): a copy of the interrupted run's, to tamper with."""
    def make(kind):
        out = tmp_path / kind
        shutil.copytree(interrupted[kind], tmp_path / f"{kind}.work")
        return out, tmp_path / f"{kind}.work"

    return make


def outcome(call):
    try:
        call()
    except Exception as e:  # the test inspects whatever came out, not only the error it expects
        return e
    return None


def assert_one_line_error(error, path, out, work):
    assert isinstance(error, ExportError), repr(error)
    message = str(error)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    assert f"delete {work} to start over" in message, message
    assert not out.exists()


class Planted:
    """Pickled as a call of open(marker, "w"): loading it with pickle's full powers creates the marker."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_the_variable_makes_torchs_default_unsafe_and_an_explicit_weights_only_still_holds(tmp_path, monkeypatch):
    """The premise of the tests below, on the torch installed here (torch/serialization.py: the
    variable overrides only a call that leaves weights_only unset)."""
    import pickle

    monkeypatch.setenv(UNSAFE, "1")
    forged = tmp_path / "forged.pt"
    torch.save({"x": Planted(tmp_path / "marker")}, forged)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(forged, map_location="cpu", weights_only=True)
    assert not (tmp_path / "marker").exists()
    with pytest.warns(UserWarning, match=UNSAFE):
        torch.load(forged, map_location="cpu")["x"].close()
    assert (tmp_path / "marker").exists()


@pytest.mark.parametrize("kind, name", [
    ("model", "checkpoint.pt"), ("model", "answers-00000.pt"),
    ("eagle3", "checkpoint.pt"), ("eagle3", "answers-00000.pt"), ("eagle3", "features-00000.pt"),
])
def test_a_pickle_planted_in_the_work_folder_runs_no_code(source, work, tmp_path, monkeypatch, kind, name):
    monkeypatch.setenv(UNSAFE, "1")
    out, folder = work(kind)
    marker = tmp_path / "marker"
    torch.save({"x": Planted(marker)}, folder / name)
    error = outcome(lambda: run(kind, source, out))
    assert not marker.exists(), f"the planted pickle ran ({error!r})"
    assert_one_line_error(error, folder / name, out, folder)


def _tweak(key, change):
    """A copy of a torch file's contents with one part changed: still a valid torch file."""
    def apply(state):
        change(state[key] if key else state)
        return state

    return apply


def _renamed(old, new):
    def apply(state):
        state[new] = state.pop(old)
        return state

    return apply


def _first_tensor(change):
    def apply(weights):
        name = next(k for k in weights if k != "vocab")
        weights[name] = change(weights[name])

    return apply


def _records(change):
    def apply(records):
        change(records[0])
        return records

    return apply


REKEYED = {
    # (kind, file): {case: the valid contents -> forged ones}
    ("model", "checkpoint.pt"): {
        "a list": lambda state: [state],
        "a key renamed": _renamed("student", "model"),
        "step a string": _tweak(None, lambda s: s.update(step="25")),
        "fewer losses than steps": _tweak("losses", list.pop),
        "a weight of another shape": _tweak("student", _first_tensor(lambda t: t[:1])),
        "a weight missing": _tweak("student", lambda w: w.pop(next(iter(w)))),
        "a weight of another dtype": _tweak("student", _first_tensor(lambda t: t.half())),
        "another draft vocabulary": _tweak("student", lambda w: w.update(vocab=w["vocab"].flip(0))),
        "an optimizer moment of another shape": _tweak("opt", lambda o: o["state"][0].update(exp_avg=torch.zeros(3))),
        "an optimizer setting a string": _tweak("opt", lambda o: o["param_groups"][0].update(lr="fast")),
        "optimizer state for a parameter that is not there": _tweak("opt", lambda o: o["state"].update({999: {}})),
        "a scheduler field a string": _tweak("sched", lambda s: s.update(last_epoch="x")),
        "a sampler state of floats": _tweak(None, lambda s: s.update(sampler=s["sampler"].float())),
        "a sampler state of random bytes": _tweak(None, lambda s: s.update(sampler=torch.randint(
            0, 256, s["sampler"].shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))),
    },
    ("model", "answers-00000.pt"): {
        "a dict": lambda records: {"records": records},
        "a key missing": _records(lambda r: r.pop("top_ids")),
        "start a string": _records(lambda r: r.update(start="3")),
        "start past the ids": _records(lambda r: r.update(start=10_000)),
        "ids of floats": _records(lambda r: r.update(ids=r["ids"].float())),
        "a token outside the vocabulary": _records(lambda r: r["top_ids"].__setitem__((0, 0), 10**6)),
        "top log-probs of another shape": _records(lambda r: r.update(top_logprobs=r["top_logprobs"][:, :1])),
    },
    ("eagle3", "answers-00000.pt"): {
        "a key missing": _records(lambda r: r.pop("ids")),
    },
    ("eagle3", "features-00000.pt"): {
        "a dict": lambda aux: {"aux": aux},
        "an entry a string": lambda aux: ["states"] + aux[1:],
        "states of another dtype": lambda aux: [aux[0].float()] + aux[1:],
        "states of another width": lambda aux: [aux[0][:, :5]] + aux[1:],
    },
    ("eagle3", "checkpoint.pt"): {
        "a key renamed": _renamed("head", "student"),
        "a weight missing": _tweak("head", lambda w: w.pop("fc.weight")),
        "another draft vocabulary map": _tweak("head", lambda w: w.update(d2t=w["d2t"] + 1)),
        "a curve point without agreement": _tweak("curve", lambda c: c[0].pop("agreement")),
        "losses of strings": _tweak(None, lambda s: s.update(losses=[str(x) for x in s["losses"]])),
    },
}
CASES = [(kind, name, case, forge) for (kind, name), cases in REKEYED.items() for case, forge in cases.items()]


@pytest.mark.parametrize("kind, name, case, forge", CASES, ids=[f"{k}-{n}-{c}" for k, n, c, _ in CASES])
def test_a_rekeyed_work_file_is_a_one_line_error(source, work, kind, name, case, forge):
    out, folder = work(kind)
    path = folder / name
    torch.save(forge(torch.load(path, map_location="cpu", weights_only=True)), path)
    assert_one_line_error(outcome(lambda: run(kind, source, out)), path, out, folder)


def _truncated(data):
    return data[: len(data) // 2]


BROKEN = {"truncated": _truncated, "empty": lambda data: b"",
          "random bytes": lambda data: random.Random(0).randbytes(4096)}
FILES = [("model", "checkpoint.pt"), ("model", "answers-00000.pt"), ("eagle3", "checkpoint.pt"),
         ("eagle3", "features-00000.pt")]


@pytest.mark.parametrize("kind, name", FILES)
@pytest.mark.parametrize("broken", BROKEN)
def test_a_broken_work_file_is_a_one_line_error(source, work, kind, name, broken):
    out, folder = work(kind)
    path = folder / name
    path.write_bytes(BROKEN[broken](path.read_bytes()))
    assert_one_line_error(outcome(lambda: run(kind, source, out)), path, out, folder)


SETTINGS = {
    "truncated": lambda text: text[: len(text) // 2].encode(),
    "not text": lambda text: b"\x8b\xff\x00" + text.encode(),
    "a list": lambda text: json.dumps([json.loads(text)]).encode(),
    "a number": lambda text: b"42\n",
    "nested past the parser's depth": lambda text: b"[" * 100_000 + b"]" * 100_000,
}


@pytest.mark.parametrize("kind", ["model", "eagle3"])
@pytest.mark.parametrize("broken", SETTINGS)
def test_a_malformed_settings_file_is_a_one_line_error(source, work, kind, broken):
    out, folder = work(kind)
    path = folder / "settings.json"
    path.write_bytes(SETTINGS[broken](path.read_text()))
    assert_one_line_error(outcome(lambda: run(kind, source, out)), path, out, folder)


@pytest.mark.parametrize("name", ["checkpoint.pt", "answers-00000.pt"])
def test_the_command_prints_the_error_in_one_line_and_exits_1(models, work, monkeypatch, name):
    """Through `specdeploy distill`, a pickle planted under the variable: the log lines, then one
    error line; no traceback, no warning, no --out."""
    monkeypatch.setenv(UNSAFE, "1")
    out, folder = work("model")
    marker = folder.parent / "marker"
    torch.save({"x": Planted(marker)}, folder / name)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in MODEL.items()]
    result = CliRunner().invoke(main, ["distill", "--target", str(models["llama"]), "--out", str(out), *flags,
                                       "--no-progress"])
    assert not marker.exists()
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    lines = result.output.splitlines()
    assert lines[-1].startswith(f"error: {folder / name}: ") and result.output.endswith("\n"), result.output
    assert not any("Traceback" in line or "Warning" in line for line in lines), result.output
    assert not out.exists()


@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_a_work_folder_this_version_wrote_still_resumes(source, work, monkeypatch, kind):
    """Every file of a real interrupted run passes the checks, under the variable too
    (tests/test_distill.py and tests/test_eagle3.py show a resumed run ends with the same weights)."""
    monkeypatch.setenv(UNSAFE, "1")
    out, folder = work(kind)
    record = run(kind, source, out)
    assert record["settings"]["steps"] == 30 and (out / "distill.json").is_file() and not folder.exists()
