"""A specdeploy bundle as a Triton Python-backend model: lossless speculative decoding, streamed.

`specdeploy triton-repo` writes this file as the model's model.py; config.pbtxt's parameters
name the bundle, the backend and the threads, and its metric_tags the bundle's digest: a
bundle edited since the repository was written is refused when the model loads. Triton starts one process per instance; each
loads the bundle once (a Session: its engines and KV buffers, on the CPU one thread pool for
both: see share_cpu_threads) and runs one request at a time,
while Triton queues the others; or, with the parameter `batch` N, continuous batching: up to N
requests in one pass per round (a BatchSession), each request served by a thread of its own
while `execute` returns at once, the rest waiting in the instance's queue (max_queue_size). The model is decoupled: with `stream` true it sends one
response per round (the text that round completed and its token ids), otherwise one
response with the whole answer; the last response carries `finish_reason` and `stats`.

It runs inside Triton's Python backend only (`triton_python_backend_utils` is the backend's);
the Python that runs it needs specdeploy's lean runtime installed (numpy, onnxruntime,
tokenizers, jinja2), never torch unless the torch backend is chosen.
"""
import json
import threading
from pathlib import Path

import triton_python_backend_utils as pb_utils

from specdeploy.core.errors import InputError, SpecdeployError
from specdeploy.runtime import share_cpu_threads
from specdeploy.runtime.serving import triton_io
from specdeploy.runtime.decoding.batch import BatchSession
from specdeploy.runtime.decoding.session import Session

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        settings = triton_io.ModelSettings.from_model_config(
            config, Path(args["model_repository"]) / args["model_version"])
        if args["model_instance_kind"] == "GPU":
            triton_io.select_gpu(int(args["model_instance_device_id"]))  # before any CUDA work in this process
        if settings.backend == "ort":  # a process of its own: its target and draft take turns on one pool
            share_cpu_threads(settings.threads)
        self.batched = settings.batch is not None
        try:
            if self.batched:
                queue = config.get("dynamic_batching", {}).get("default_queue_policy", {}).get("max_queue_size", 8)
                # Triton's queue holds the requests the batch has not taken yet (triton.py write_repository)
                waiting = max(0, int(queue) - settings.batch)
                self.session = BatchSession(settings.bundle, batch=settings.batch, max_queue=waiting,
                                            threads=settings.threads, backend=settings.backend, digest=settings.digest)
            else:
                self.session = Session(settings.bundle, threads=settings.threads, backend=settings.backend,
                                       digest=settings.digest)
        except SpecdeployError as e:  # the reason in one line: the model stays unloaded
            raise pb_utils.TritonModelException(str(e).splitlines()[0]) from None
        self.limits = self.session.limits
        pb_utils.Logger.log_info(f"{args['model_instance_name']}: {settings.bundle} loaded ({settings.backend})")

    def execute(self, requests):
        """Decoupled: every response goes through the request's sender; nothing is returned."""
        for request in requests:
            if self.batched:  # the batch runs it: a thread waits on its rounds, execute takes the next
                threading.Thread(target=self._serve, args=(request, request.get_response_sender()), daemon=True).start()
            else:
                self._serve(request, request.get_response_sender())
        return None

    def _serve(self, request, sender):
        try:
            req = triton_io.parse_request(lambda name: _input(request, name), self.limits)
            gen = self.session.start(triton_io.encode(self.session, req))
        except SpecdeployError as e:
            kind = pb_utils.TritonError.INVALID_ARG if isinstance(e, InputError) else pb_utils.TritonError.INTERNAL
            sender.send(_error(str(e), kind), flags=FINAL)
            return
        except Exception as e:
            pb_utils.Logger.log_error(f"unexpected error while reading a request: {type(e).__name__}: {e}")
            sender.send(_error(f"internal error ({type(e).__name__})", pb_utils.TritonError.INTERNAL), flags=FINAL)
            return
        texts, token_ids = [], []
        try:
            for piece in gen:
                if request.is_cancelled():  # the client left: free the session after this round
                    gen.close()
                    sender.send(_error("the request was cancelled", pb_utils.TritonError.CANCELLED), flags=FINAL)
                    return
                if not req.stream:
                    texts.append(piece.text)
                    token_ids += piece.token_ids
                elif piece.text or piece.token_ids:
                    sender.send(_response(triton_io.piece_outputs(piece.text, piece.token_ids)))
            sender.send(_response(triton_io.final_outputs("".join(texts), token_ids, gen.stats)), flags=FINAL)
        except Exception as e:  # the engine failed, or the response could not be sent
            gen.close()  # the session is free for the next request either way
            if isinstance(e, InputError):
                code, message = pb_utils.TritonError.INVALID_ARG, str(e)
            else:
                pb_utils.Logger.log_error(f"unexpected error while generating: {type(e).__name__}: {e}")
                code = pb_utils.TritonError.INTERNAL
                message = str(e) if isinstance(e, SpecdeployError) else f"internal error ({type(e).__name__})"
            try:
                sender.send(_error(message, code), flags=FINAL)
            except Exception as again:  # the request is gone (its client left)
                pb_utils.Logger.log_warn(f"could not send the error: {type(again).__name__}: {again}")

    def finalize(self):
        if self.batched:
            self.session.close()
        self.session = None


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _response(outputs):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in outputs.items()])


def _error(message, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError((message.splitlines() or [""])[0], code))
