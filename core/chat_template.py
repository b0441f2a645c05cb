"""A bundle's chat template, rendered where no template can stall or exhaust the process that
serves: in a worker process with a wall-time and an address-space limit.

A chat template is code shipped inside the bundle. Inside the worker it runs in jinja2's
immutable sandbox with bounds of its own (every line checks a clock; strings, lists, format
widths and ranges are bounded before they are built), which turn most runaway templates into
a precise one-line error. What those checks cannot see (a C-level loop that holds the
interpreter, such as `sum` over a huge list, or memory a filter allocates at once) the worker's
limits stop: the caller waits at most TEMPLATE_SECONDS plus a margin, then kills the worker,
and the worker's address space is capped (RLIMIT_AS), so an allocation past it fails there.
The serving process keeps its event loop, its GIL and its memory either way.

One worker per process serves every tokenizer (renders are sub-millisecond); it starts on
first use and again after it was killed. Where no worker can be started, rendering falls back
to the in-process bounds, with a warning.
"""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import sys
import threading
import time

from specdeploy.core.errors import BundleError, InputError

log = logging.getLogger("specdeploy.runtime")

# Bounds on rendering a chat template (a bundle's template is code: a tampered one must not
# hang the CLI or the server's event loop, nor allocate without limit).
TEMPLATE_SECONDS = 1.0  # wall time for one render; the SmolLM2 template renders in well under 1 ms
TEMPLATE_MAX_RANGE = 10_000  # jinja2's sandbox allows range() up to 100 000 items
TEMPLATE_BASE_CHARS = 1 << 20  # any string the template builds, or its output, is at most this
# plus twice the characters of the messages it was given


class _TemplateLimit(Exception):
    """A render went past a bound; turned into a one-line InputError."""


class _Budget(threading.local):
    deadline: float | None = None
    chars: int = TEMPLATE_BASE_CHARS


_budget = _Budget()
_PERCENT_FIELD = re.compile(r"%[#0\- +]*(\d*)(?:\.(\d*))?")
_BRACE_FIELD = re.compile(r"\{[^{}]*\}")


def _check_len(n: int) -> None:
    if n > _budget.chars:
        raise _TemplateLimit(f"it built a string or list of {n} items (the bound is {_budget.chars})")


def _check_format(fmt, args) -> None:
    """A %- or {}-format whose field widths could allocate past the bound."""
    if isinstance(fmt, str):
        fields = [m.group(0) for m in _PERCENT_FIELD.finditer(fmt)] + _BRACE_FIELD.findall(fmt)
        for digits in (d for f in fields for d in re.findall(r"\d+", f)):
            if len(digits) > 12 or int(digits) > _budget.chars:
                raise _TemplateLimit(f"a format field width {digits[:20]} is past the bound ({_budget.chars})")
    if not (isinstance(fmt, str) and ("*" in fmt or re.search(r"\{[^{}]*\{", fmt))):
        return  # widths come only from the format string itself
    for a in args if isinstance(args, (tuple, list)) else (args,):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > _budget.chars:
            raise _TemplateLimit(f"a format argument {a} is past the bound ({_budget.chars})")


def _check_call(obj, args, kwargs) -> None:
    """String methods that can allocate far more than their input, checked before they run."""
    obj = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format / format_map
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return
    if name in ("center", "ljust", "rjust", "zfill", "expandtabs"):
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, int):
                _check_len(a if name != "expandtabs" else a * max(1, owner.count("\t")) + len(owner))
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = owner.count(args[0]) if args[0] else len(owner) + 1
        _check_len(len(owner) + count * max(0, len(args[1]) - len(args[0])))
    elif name in ("format", "format_map"):
        _check_format(owner, list(args) + list(kwargs.values()))


def _check_binop(op: str, left, right) -> None:
    seq = (str, bytes, list, tuple)
    if op == "*":
        if isinstance(left, seq) and isinstance(right, int):
            _check_len(len(left) * right)
        elif isinstance(right, seq) and isinstance(left, int):
            _check_len(len(right) * left)
        elif isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > 4096:
            raise _TemplateLimit("it multiplied integers past 4096 bits")
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right * left.bit_length() > 4096:
            raise _TemplateLimit("it raised an integer to a power past 4096 bits")
    elif op == "+":
        if isinstance(left, seq) and isinstance(right, seq):
            _check_len(len(left) + len(right))
    elif op == "%" and isinstance(left, str):
        _check_format(left, right)


def _trace_template(frame, event, arg):
    """sys.settrace hook for the rendering thread: every line of template code checks the clock."""
    if _budget.deadline is not None and time.monotonic() > _budget.deadline:
        raise _TemplateLimit(f"it ran past {TEMPLATE_SECONDS:g} s")
    return _trace_template if frame.f_code.co_filename == "<template>" else None


def _sandbox():
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class _Generator(CodeGenerator):
        def visit_Concat(self, node, frame):  # `a ~ b`: its result is checked too
            self.write("environment.checked_len(")
            super().visit_Concat(node, frame)
            self.write(")")

    class ChatSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = _Generator
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
            _check_call(__obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        @staticmethod
        def checked_len(s):
            _check_len(len(s))
            return s

    env = ChatSandbox(trim_blocks=True, lstrip_blocks=True)

    def capped_range(*args):
        rng = range(*args)
        if len(rng) > TEMPLATE_MAX_RANGE:
            raise SecurityError(f"range() of {len(rng)} items is past the bound ({TEMPLATE_MAX_RANGE})")
        return rng

    def raise_exception(message):
        raise InputError(f"chat template: {message}")

    env.globals.pop("lipsum", None)
    env.globals["range"] = capped_range
    env.globals["raise_exception"] = raise_exception
    base = env.filters
    for name in ("center", "indent"):
        def wide(s, *args, _f=base[name], **kwargs):
            width = args[0] if args else kwargs.get("width", 0)
            size = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
            _check_len(size * (1 + str(s).count("\n")) + len(str(s)))
            return _f(s, *args, **kwargs)

        env.filters[name] = wide

    def replace(eval_ctx, s, old, new, count=None, _f=base["replace"]):
        if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
            n = s.count(old) if old else len(s) + 1
            _check_len(len(s) + n * max(0, len(new) - len(old)))
        return _f(eval_ctx, s, old, new, count)

    replace.jinja_pass_arg = base["replace"].jinja_pass_arg
    env.filters["replace"] = replace

    def format_(value, *args, _f=base["format"], **kwargs):
        _check_format(value, list(args) + list(kwargs.values()))
        return _f(value, *args, **kwargs)

    env.filters["format"] = format_

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # as transformers' apply_chat_template defines it (jinja2's own escapes <, > and &)
        if isinstance(indent, int) and indent > 64:
            raise SecurityError(f"tojson indent {indent} is past the bound (64)")
        text = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        _check_len(len(text))
        return text

    env.filters["tojson"] = tojson
    return env


def _render(template, context: dict, input_chars: int) -> str:
    """Render with a wall-time bound and a bound on every string built and on the output."""
    from jinja2 import TemplateError

    _budget.chars = TEMPLATE_BASE_CHARS + 2 * input_chars
    _budget.deadline = time.monotonic() + TEMPLATE_SECONDS
    previous = sys.gettrace()
    sys.settrace(_trace_template)
    try:
        out, n = [], 0
        for piece in template.generate(**context):
            n += len(piece)
            if n > _budget.chars:
                raise _TemplateLimit(f"its output passed {_budget.chars} characters")
            out.append(piece)
        return "".join(out)
    except _TemplateLimit as e:
        raise InputError(f"chat template: stopped rendering, {e}; the bundle's template may be tampered with") from None
    except MemoryError:
        raise InputError(f"chat template: stopped rendering, it needed more than the {TEMPLATE_MEMORY >> 20} MB a "
                         "render may take; the bundle's template may be tampered with") from None
    except (TemplateError, RecursionError, OverflowError, ValueError, TypeError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise InputError(f"chat template: cannot render ({type(e).__name__}: {first[:200]})") from None
    finally:
        sys.settrace(previous)
        _budget.deadline = None


TEMPLATE_MEMORY = 512 << 20  # bytes of address space the worker may add to what it holds once started
KILL_MARGIN = 1.0  # seconds past TEMPLATE_SECONDS before the caller stops waiting and kills the worker
_CACHE = 16  # compiled templates a worker keeps


def compile_template(source: str):
    from jinja2 import TemplateError

    try:
        return _sandbox().from_string(source)
    except TemplateError as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise BundleError(f"chat template: not a valid Jinja template ({first[:200]})") from None


def render_here(source: str, context: dict, input_chars: int, cache: dict | None = None) -> str:
    """The render itself, with the in-process bounds only (what the worker runs)."""
    cache = {} if cache is None else cache
    template = cache.get(source)
    if template is None:
        template = compile_template(source)
        if len(cache) >= _CACHE:
            cache.pop(next(iter(cache)))
        cache[source] = template
    return _render(template, context, input_chars)


def _limit_memory() -> None:
    try:
        import resource
    except ImportError:  # not a POSIX system: the time bound still holds
        return
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (size + TEMPLATE_MEMORY, size + TEMPLATE_MEMORY))


def _worker(conn) -> None:
    """The worker's loop: (source, context, input chars) in, (kind, text) out."""
    _sandbox()  # jinja2 imported and set up before the limit: the limit is for the templates

    try:
        _limit_memory()
    except (OSError, ValueError):
        pass
    cache: dict = {}
    conn.send(("ready", ""))
    while True:
        try:
            source, context, chars = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", render_here(source, context, chars, cache))
        except InputError as e:
            reply = ("input", str(e))
        except BundleError as e:
            reply = ("bundle", str(e))
        except MemoryError:  # past the limit outside the render's own handler (compiling, replying)
            cache.clear()
            reply = ("input", f"chat template: stopped rendering, it needed more than the {TEMPLATE_MEMORY >> 20} MB "
                              "a render may take; the bundle's template may be tampered with")
        conn.send(reply)


class _Renderer:
    """The process's one template worker, behind a lock (a render is a round trip on a pipe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._process = None
        self._conn = None
        self._unavailable = False

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")  # never fork a process that runs threads
        parent, child = context.Pipe()
        process = context.Process(target=_worker, args=(child,), daemon=True, name="specdeploy-chat-template")
        process.start()
        child.close()
        if not parent.poll(20) or parent.recv()[0] != "ready":
            process.kill()
            raise OSError("the chat template worker did not start")
        self._process, self._conn = process, parent

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None

    def render(self, source: str, context: dict, input_chars: int) -> str:
        with self._lock:
            if self._unavailable:
                return render_here(source, context, input_chars)
            if self._process is None or not self._process.is_alive():
                try:
                    self._stop()
                    self._start()
                except (OSError, RuntimeError) as e:  # no processes here (a sandbox, a frozen app)
                    self._unavailable = True
                    log.warning(f"chat templates render in this process, without a memory limit: {e}")
                    return render_here(source, context, input_chars)
            self._conn.send((source, context, input_chars))
            if not self._conn.poll(TEMPLATE_SECONDS + KILL_MARGIN):
                self._stop()
                raise InputError(f"chat template: stopped rendering, it ran past {TEMPLATE_SECONDS:g} s; "
                                 "the bundle's template may be tampered with")
            try:
                kind, text = self._conn.recv()
            except (EOFError, OSError):
                self._stop()
                raise InputError(f"chat template: stopped rendering, its worker died (a limit of "
                                 f"{TEMPLATE_MEMORY >> 20} MB); the bundle's template may be tampered with") from None
        if kind == "ok":
            return text
        raise (BundleError if kind == "bundle" else InputError)(text)


_renderer = _Renderer()


def render(source: str, context: dict, input_chars: int) -> str:
    """`source` rendered with `context` (messages, add_generation_prompt, bos/eos tokens) in
    the worker; `input_chars`: the characters of the messages (the output bound grows with
    them). A template past a bound is a one-line InputError; one that is not valid Jinja, a
    BundleError."""
    return _renderer.render(source, context, input_chars)
