"""`--device cuda[:N]` on the ort backend, proved where no GPU is: the binding and buffer code
runs on the CPU provider (CUDA-graph bookkeeping included: per-shape bindings, graph ids,
bucketed windows), the provider list and its options are checked as data, and every error a
user meets is produced by this machine's CPU build of onnxruntime (a missing CUDA provider is
what it has), with the GPU probe and the provider list faked where a GPU would answer."""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from specdeploy.core.errors import InputError
from specdeploy.runtime import Session, SessionPool
from specdeploy.runtime.backends import BackendChoice, Device, DeviceError, devices
from specdeploy.runtime.backends import ort as ort_backend
from specdeploy.runtime.backends.ort import CPU, CUDA, TENSORRT, OrtEngine, Placement, check_placement
from specdeploy.runtime.decoding.drafters import ModelDrafter

from tiny import PROMPTS

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = "llama-model"


# -- the device and the backend choice --------------------------------------------------------
@pytest.mark.parametrize("text", ["gpu", "cuda:x", "cpu:1", "cuda:-1", ""])
def test_a_device_that_is_not_one_is_a_one_line_error(text):
    with pytest.raises(InputError, match="expected cpu, cuda or cuda:N"):
        Device.parse(text)


@pytest.mark.parametrize("backend,device,trt_ep,message", [
    ("trt", "cuda", False, "takes no --device"),
    ("ort", "cpu", True, "--trt-ep .* needs --backend ort --device cuda"),
    ("ort", None, True, "needs --backend ort --device cuda"),
    ("torch", "cuda", True, "needs --backend ort --device cuda"),
    ("onnx", None, False, "not available"),
])
def test_backend_choice_refuses_what_the_backend_does_not_take(backend, device, trt_ep, message):
    with pytest.raises(InputError, match=message):
        BackendChoice.of(backend, device, trt_ep)


def test_backend_choice_hands_each_backend_only_what_it_takes():
    assert BackendChoice.of("ort").engine_options() == {}
    assert BackendChoice.of("ort", "cuda:1", trt_ep=True).engine_options() == {"device": "cuda:1", "trt_ep": True}
    assert BackendChoice.of("torch", "cpu").engine_options() == {"device": "cpu"}


# -- the provider list, as data -----------------------------------------------------------------
def test_placement_defaults_and_provider_options(bundles):
    from specdeploy.runtime import load_bundle

    bundle = load_bundle(bundles(BUNDLE))
    spec = bundle.model("target")
    assert Placement.for_bundle(bundle).providers(spec, 128) == [(CPU, {})]

    cuda = Placement.for_bundle(bundle, "cuda:1")
    assert (cuda.capture, cuda.capture_max_t, cuda.provider) == (True, bundle.max_draft + 1, CUDA)
    assert cuda.providers(spec, 128) == [(CUDA, {"device_id": 1, "use_tf32": 0, "enable_cuda_graph": 1}), (CPU, {})]
    assert Placement.for_bundle(bundle, "cuda", capture=False).providers(spec, 128)[0] == (CUDA, {"device_id": 0, "use_tf32": 0})

    trt = Placement.for_bundle(bundle, "cuda", trt_ep=True)
    assert not trt.capture and trt.provider == TENSORRT
    assert trt.trt_cache == bundle.path.parent / f"{bundle.path.name}.ort-trt-cache"  # beside the bundle, not in it
    name, options = trt.providers(spec, 128)[0]
    assert name == TENSORRT and [p[0] for p in trt.providers(spec, 128)[1:]] == [CUDA, CPU]
    assert options["trt_engine_cache_path"] == str(trt.trt_cache) and options["trt_engine_cache_enable"] is True
    assert options["trt_fp16_enable"] is False  # an fp32 graph stays fp32
    assert trt.providers(spec.replace(dtype="fp16"), 128)[0][1]["trt_fp16_enable"] is True
    assert options["trt_profile_min_shapes"] == "input_ids:1x1,position_ids:1x1,attention_mask:1x1x1x1"
    assert options["trt_profile_max_shapes"] == "input_ids:1x128,position_ids:1x128,attention_mask:1x1x128x128"

    # what a failed session falls back to: TensorRT -> CUDA, captured -> uncaptured, then nothing
    assert trt.fallback().provider == CUDA and not trt.fallback().capture
    assert not cuda.fallback().capture and cuda.fallback().fallback() is None
    assert Placement(capture=True, capture_max_t=9).fallback() is None  # the CPU has nothing to fall back to


# -- every error, on this machine's CPU build ---------------------------------------------------
def test_cuda_without_onnxruntime_gpu_names_the_package(bundles, monkeypatch):
    assert CUDA not in onnxruntime.get_available_providers()  # this machine: the CPU build
    monkeypatch.setattr(devices, "cuda_devices", lambda: ["NVIDIA Test GPU"])  # a GPU, so the package is all that lacks
    with pytest.raises(DeviceError, match=r"^device cuda:0: it needs onnxruntime-gpu: the installed onnxruntime \S+ has "
                                          r"no CUDAExecutionProvider \(it has .*CPUExecutionProvider\): "
                                          r"pip uninstall -y onnxruntime && pip install onnxruntime-gpu$"):
        Session(bundles(BUNDLE), device="cuda")
    with pytest.raises(DeviceError, match="needs onnxruntime-gpu"):
        SessionPool(bundles(BUNDLE), workers=2, device="cuda:0")


def test_no_gpu_and_no_onnxruntime_gpu_are_named_in_one_line(bundles, monkeypatch):
    monkeypatch.setattr(devices, "cuda_devices", lambda: None)  # this machine: no NVIDIA driver either
    with pytest.raises(DeviceError, match=r"^device cuda:0: no NVIDIA driver on this machine .*; "
                                          r"and it needs onnxruntime-gpu: .*pip install onnxruntime-gpu$"):
        Session(bundles(BUNDLE), device="cuda")


def test_the_torch_backend_on_a_missing_gpu_is_one_line_too(monkeypatch):
    monkeypatch.setattr(devices, "cuda_devices", lambda: [])
    with pytest.raises(DeviceError, match="^device cuda:0: the NVIDIA driver sees no CUDA device"):
        BackendChoice.of("torch", "cuda")


@pytest.fixture
def gpu_build(monkeypatch):
    """onnxruntime-gpu as it lists its providers, and one GPU as the driver names it. Sessions
    are still created by the CPU build, which leaves the CUDA provider out: exactly a provider
    that failed to load."""
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: [TENSORRT, CUDA, CPU])
    monkeypatch.setattr(devices, "cuda_devices", lambda: ["NVIDIA Test GPU"])
    return monkeypatch


@pytest.mark.parametrize("found,device,message", [
    (None, "cuda", "no NVIDIA driver on this machine"),
    ([], "cuda", "the NVIDIA driver sees no CUDA device"),
    (["NVIDIA Test GPU"], "cuda:2", r"shows 1 CUDA device\(s\): cuda:0 NVIDIA Test GPU"),
])
def test_no_cuda_device_is_a_one_line_error(bundles, gpu_build, found, device, message):
    gpu_build.setattr(devices, "cuda_devices", lambda: found)
    with pytest.raises(DeviceError, match=message):
        Session(bundles(BUNDLE), device=device)


def test_a_provider_that_did_not_load_is_an_error_not_the_cpu(bundles, gpu_build):
    with pytest.raises(DeviceError, match=r"target.onnx: CUDAExecutionProvider did not load \(ONNX Runtime would run "
                                          r"this graph on CPUExecutionProvider\); .*onnxruntime-gpu\[cuda,cudnn\]"):
        Session(bundles(BUNDLE), device="cuda")


def test_tensorrt_missing_falls_back_to_cuda_with_a_message(bundles, gpu_build, caplog):
    gpu_build.setattr(onnxruntime, "get_available_providers", lambda: [CUDA, CPU])
    with caplog.at_level(logging.WARNING, logger="specdeploy.runtime"), pytest.raises(DeviceError, match="CUDAExecutionProvider did not load"):
        Session(bundles(BUNDLE), device="cuda", trt_ep=True)
    assert "target.onnx: this onnxruntime-gpu has no TensorrtExecutionProvider; running on CUDAExecutionProvider instead" in caplog.text


def test_a_session_that_cannot_capture_falls_back_to_uncaptured_passes(bundles, gpu_build, caplog):
    real = onnxruntime.InferenceSession

    def refuse_graphs(path, so, providers, **kwargs):
        if any(options.get("enable_cuda_graph") for _, options in providers):
            raise RuntimeError("This session cannot use the graph capture feature as requested by the user")
        return real(path, so, providers=providers, **kwargs)

    gpu_build.setattr(onnxruntime, "InferenceSession", refuse_graphs)
    with caplog.at_level(logging.WARNING, logger="specdeploy.runtime"), pytest.raises(DeviceError, match="did not load"):
        Session(bundles(BUNDLE), device="cuda")
    assert ("target.onnx: CUDAExecutionProvider on cuda:0, CUDA graphs failed (This session cannot use the graph capture "
            "feature as requested by the user); running on CUDAExecutionProvider on cuda:0 instead") in caplog.text


def test_a_session_the_provider_cannot_create_is_a_one_line_error(bundles, gpu_build):
    def refuse(*args, **kwargs):
        raise RuntimeError("CUDA failure 35: CUDA driver version is insufficient for CUDA runtime version\nmore lines")

    gpu_build.setattr(onnxruntime, "InferenceSession", refuse)
    with pytest.raises(DeviceError, match=r"target.onnx: ONNX Runtime could not create a session on CUDAExecutionProvider "
                                          r"on cuda:0 \(CUDA failure 35: CUDA driver version is insufficient[^\n]*\)$"):
        Session(bundles(BUNDLE), device="cuda")


def test_a_dtype_the_provider_cannot_run(bundles):
    from specdeploy.runtime import load_bundle

    bundle = load_bundle(bundles(BUNDLE))
    spec = bundle.model("draft").replace(dtype="int4")
    trt = Placement.for_bundle(bundle, "cuda", trt_ep=True)
    with pytest.raises(InputError, match=r"draft.onnx \(draft\) is a int4 graph; TensorrtExecutionProvider takes fp32, "
                                         r"fp16 bundles .* drop --trt-ep, or export with --for tensorrt"):
        check_placement(trt, spec, bundle.file(spec.graph))
    # the same int4 graph exported --for tensorrt (DequantizeLinear + MatMul) passes the dtype check:
    # what stops it here is the missing GPU, the next check
    standard = spec.replace(quantization={"dequantize_linear": {"int4": 7, "int8": 1}})
    with pytest.raises(DeviceError, match="^device cuda:0: "):
        check_placement(trt, standard, bundle.file(spec.graph))
    assert set(ort_backend.PROVIDER_DTYPES[CUDA]) == {"fp32", "fp16", "int8", "int4"}


def test_generate_on_cuda_here_prints_one_line_naming_what_is_missing(bundles):
    cli = "from specdeploy.cli import run; run()"  # the installed `specdeploy` command's entry point
    out = subprocess.run([sys.executable, "-c", cli, "generate", str(bundles(BUNDLE)), "--prompt", "hi", "--device", "cuda"],
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: device cuda:0: "), out.stderr
    assert "it needs onnxruntime-gpu" in lines[0] and "pip install onnxruntime-gpu" in lines[0]


def test_server_and_bench_pass_the_device_on(bundles):
    from specdeploy.runtime.tools.bench import bench
    from specdeploy.runtime.serving.server import serve

    with pytest.raises(DeviceError, match="needs onnxruntime-gpu"):
        serve(str(bundles(BUNDLE)), device="cuda")  # refused before uvicorn starts
    with pytest.raises(DeviceError, match="needs onnxruntime-gpu"):
        bench(bundles(BUNDLE), device="cuda")
    report = bench(bundles(BUNDLE), draft_lens="2", prompts=[PROMPTS[0]], max_new_tokens=4, repeats=1, warmup=False,
                   device="cpu")
    assert report["placement"] == "ort on cpu" and report["device"].endswith("CPU (ort on cpu)")


# -- the shared path on the CPU provider ------------------------------------------------------
def _engines(bundle, capture):
    return {role: OrtEngine.from_bundle(bundle, bundle.model(role), device="cpu", capture=capture)
            for role in ("target", "draft")}


def test_a_single_step_reads_zeros_over_its_window_after_a_padded_one():
    """A single step over the exact window leaves the mask room as it is (a row of zeros): after
    a padded window wrote -inf past its step, the next exact step must still read zeros over
    its whole window, and its integers must be the ones the general path writes."""
    from specdeploy.core.graph_io import fill_mask
    from specdeploy.runtime.backends.devices import Device
    from specdeploy.runtime.backends.ort import _Stage

    stage = _Stage(1, 128, 16, Device("cpu"))
    mask = stage.host_views["attention_mask"]
    stage.stage(np.array([3]), 5, 64, None)  # a padded window (a captured pass)
    assert (mask[:6] == 0).all() and np.isneginf(mask[6:64]).all()
    stage.stage(np.array([4]), 20, 21, None)  # exact: the single-step path
    np.testing.assert_array_equal(mask[:21], fill_mask(np.empty((1, 21), np.float32), 20)[0])
    assert [stage.host_views[n][0] for n in ("input_ids", "position_ids", "write_indices")] == [4, 20, 20]
    stage.stage(np.array([7]), 2, 3, 2)  # a sliding window takes the general path: slot 0 is out of it
    assert np.isneginf(mask[0]) and (mask[1:3] == 0).all()
    stage.stage(np.array([9]), 30, 31, None)
    assert (mask[:31] == 0).all()


def test_captured_bookkeeping_gives_the_same_logits(bundles):
    """Passes with per-shape bindings, graph ids and bucketed windows (what CUDA graphs need)
    against the plain CPU engine: the padded window's masked slots add exact zeros."""
    from specdeploy.runtime import load_bundle

    bundle = load_bundle(bundles(BUNDLE))
    captured, plain = _engines(bundle, True)["target"], _engines(bundle, False)["target"]
    assert not captured.windowed  # a float graph slices its window out of the buffers
    ids = np.random.default_rng(0).integers(0, plain.vocab_size, size=bundle.max_seq)
    passes = [(0, 16), (16, 16), (32, 30), (62, 1), (63, 1), (64, 9), (65, 4), (69, 1), (70, 9), (118, 9)]
    for start, t in passes:
        got = captured.forward(ids[start : start + t], start).copy()
        np.testing.assert_array_equal(got, plain.forward(ids[start : start + t], start))
    assert captured.graph_shapes == [(1, 64), (9, 128), (4, 128), (1, 128)]  # T <= 9, windows bucketed, in id order
    assert [captured._graphs[k][1].get_run_config_entry("gpu_graph_id") for k in captured.graph_shapes] == ["1", "2", "3", "4"]
    assert (captured.captured_runs, captured.uncaptured_runs) == (7, 3)  # T = 16 and 30 run uncaptured
    assert captured._uncaptured.get_run_config_entry("gpu_graph_id") == "-1"
    assert plain._uncaptured is None and plain.graph_shapes == []
    binding = captured._graphs[(1, 128)][0]
    captured.forward(ids[100:101], 100)
    assert captured._graphs[(1, 128)][0] is binding and len(captured.graph_shapes) == 4  # bound once, replayed


def test_a_graph_reading_its_kv_as_bound_is_captured_at_max_seq(bundles):
    """An int graph for the CPU reads its K/V as bound, laid out at a capacity the host moves
    (numpy): captured passes replay fixed addresses and shapes, so there it binds them at max_seq,
    every window max_seq (masked past each pass), the same logits as the CPU engine's capacities."""
    from specdeploy.runtime import load_bundle

    bundle = load_bundle(bundles("llama-int8-ngram"))
    captured, plain = (OrtEngine.from_bundle(bundle, bundle.model("target"), device="cpu", capture=capture)
                       for capture in (True, False))
    assert captured.windowed and plain.windowed
    ids = np.random.default_rng(0).integers(0, plain.vocab_size, size=bundle.max_seq)
    for start, t in [(0, 16), (16, 16), (32, 30), (62, 1), (63, 1), (64, 9), (65, 4), (118, 9)]:
        np.testing.assert_array_equal(captured.forward(ids[start : start + t], start).copy(),
                                      plain.forward(ids[start : start + t], start))
    assert captured.graph_shapes == [(1, bundle.max_seq), (9, bundle.max_seq), (4, bundle.max_seq)]
    assert captured.capacity == bundle.max_seq and plain.capacity == bundle.max_seq  # 127 of 128 slots: no smaller


def test_speculation_is_lossless_on_the_captured_bookkeeping(bundles):
    """The loop over engines that bind per pass shape, as on CUDA: speculative == plain, the KV
    buffers never move, a fork gets a session of its own (a captured graph is one thread's)."""
    session = Session(bundles(BUNDLE), prompt_cache=False)
    engines = _engines(session.bundle, True)
    session.target = engines["target"]
    session.drafter = ModelDrafter(engines["draft"], session.drafter.cost_ratio)
    addresses = {role: e.kv_addresses() for role, e in engines.items()}
    for prompt in PROMPTS[:4]:
        plain = session.generate(prompt, max_new_tokens=24, speculate=False)
        for k in (1, 3, 8):
            assert session.generate(prompt, max_new_tokens=24, draft_len=k).token_ids == plain.token_ids, (prompt, k)
    assert {role: e.kv_addresses() for role, e in engines.items()} == addresses
    assert all(t <= session.bundle.max_draft + 1 for t, _ in engines["target"].graph_shapes)
    twin = engines["target"].fork()
    assert twin.session is not engines["target"].session and twin.graph_shapes == []
    assert set(twin.kv_addresses()).isdisjoint(addresses["target"])
    shared = _engines(session.bundle, False)["target"]
    assert shared.fork().session is shared.session  # uncaptured: one InferenceSession, many threads


def test_kv_buffers_are_ort_values_the_host_can_view_on_the_cpu(bundles):
    from specdeploy.runtime import load_bundle

    engine = _engines(load_bundle(bundles(BUNDLE)), False)["target"]
    assert engine.device == "cpu" and engine.providers == [CPU]
    assert engine.kv_addresses() == [a.ctypes.data for a in engine.kv_arrays]  # views, not copies
    assert all(not a.any() for a in engine.kv_arrays)  # zero-filled at allocation
    engine.placement = Placement(Device("cuda"))
    with pytest.raises(AttributeError, match="live on"):
        engine.kv_arrays


def test_check_script_rehearses_end_to_end_on_the_cpu(bundles, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "proofs.ort_gpu_check", str(bundles(BUNDLE)), "--device", "cpu",
         "--limit", "2", "--lens", "1,4", "--max-new-tokens", "16", "--repeats", "3", "--context", "64",
         "--json", str(tmp_path / "report.json")],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["failures"] == [] and report["rehearsal"]
    assert {row["compared"] for row in report["checks"]["parity"]} >= {"captured vs uncaptured"}
    assert all(row["equal"] == 2 for row in report["checks"]["lossless"].values())
    assert report["checks"]["kv_addresses_unchanged"] and report["checks"]["repeat_captures_nothing"]
    assert {row["T"] for row in report["latency"]} == {1, 5}
    assert set(report["decoding"]) == {"plain", "k=1", "k=4"}
    assert "| model | T | uncaptured | captured |" in out.stdout
