"""Fresh worker processes without paying the imports each time: fork after importing.

Each budget test measures one call in a process of its own (its first call, or after
chosen earlier work). Starting Python and importing torch, ggnchunk and the benchmark
problems takes about 2.9 s of a worker's run; this server imports exactly the modules
the worker imports first (:data:`PRELOAD`) and forks a child per request, which then
runs the worker module as ``python -m`` would. A child starts as that worker starts
after its imports: no computation has run in the server (no thread pool, no allocator
history beyond the imports'), and nothing it does reaches the next child.

One difference: the kernel does not copy a forked child's page table entries for code
(file-backed mappings without private pages), so a child pages in again, from the page
cache, the code its call runs (about 10 MiB more in first calls). That code counts in
its peak (``VmHWM``) and in its ``RssFile`` growth alike, and the tests subtract at most
the larger of that growth and the call's own set-up. Measured, four runs each, counted
peaks in children against fresh interpreters: ResNet-18's first call at 80 MiB
69.9-71.6 against 67.2-69.9 MiB; the MLP autoencoder's warm call at 32 MiB 11.4-14.2
against 6.5-13.5 MiB; segmentation after a one-pass call at 48 MiB 7.2-12.7 against
-0.4-12.8 MiB.

Protocol (one JSON line each way): ``{"module": ..., "argv": [...], "timeout": s}`` (or
``"code"`` in place of ``"module"``, as ``python -c``) in, ``{"returncode": ...,
"stdout": ..., "stderr": ...}`` out.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
# exactly what the budget worker imports before its model is built: nothing more (a
# module imported here would not count in a child's call where a fresh interpreter's
# call would pay it; torchvision imports torch._dynamo, 44 MiB, and is imported by the
# torchvision problems' builders, in the child, before the measured call)
PRELOAD = ("torch", "ggnchunk", "benchmarks.problems", "benchmarks.peak")


class Zygote:
    """The test side: starts the server once, runs a module in a fresh child per call."""

    def __init__(self, env: dict[str, str] | None = None):
        self._proc = subprocess.Popen(
            [sys.executable, "-W", "ignore", "-m", "tests.budget._zygote"],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, bufsize=1,
        )  # fmt: skip
        self._lock = threading.Lock()

    def run(
        self,
        module: str | None,
        *argv: str,
        timeout: float = 600,
        code: str | None = None,
    ) -> SimpleNamespace:
        """Run ``python -m module argv...`` in a fresh child; its exit code and output.

        Args:
            module: The module run as ``__main__``; ``None`` with ``code``.
            *argv: Its command-line arguments.
            timeout: Seconds before the child is killed (exit code ``-9``).
            code: Source run as ``python -c code argv...`` runs it, instead of a module.

        Returns:
            ``returncode``, ``stdout`` and ``stderr``, as ``subprocess.run`` gives them.
        """
        if (module is None) == (code is None):
            raise ValueError("give a module or code, not both")
        request = {"argv": list(argv), "timeout": timeout}
        request.update({"module": module} if code is None else {"code": code})
        with self._lock:
            if self._proc.poll() is not None:
                raise RuntimeError("the zygote server exited")
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("the zygote server exited")
        return SimpleNamespace(**json.loads(line))

    def close(self) -> None:
        """Stop the server (it exits when its input closes) and close its pipes."""
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc.stdout.close()


def _child(request: dict, out: int, err: int) -> None:
    """In the forked child: run the module with stdout and stderr in the given files."""
    code = 0
    try:
        os.dup2(out, 1)
        os.dup2(err, 2)
        if "code" in request:  # as python -c: argv[0] is "-c"
            sys.argv = ["-c", *request["argv"]]
            namespace = {"__name__": "__main__", "__builtins__": __builtins__}
            exec(compile(request["code"], "<string>", "exec"), namespace)
        else:
            sys.argv = [request["module"], *request["argv"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as done:  # sys.exit(...) as the interpreter would treat it
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except BaseException:  # reported to the test as a failed worker
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve(request: dict) -> dict:
    """Fork a child for ``request``, wait for it (killing it past its timeout)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            _child(request, out.fileno(), err.fileno())
        deadline = time.monotonic() + float(request.get("timeout", 600))
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.01)
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return {
            "returncode": code,
            "stdout": out.read().decode(errors="replace"),
            "stderr": err.read().decode(errors="replace"),
        }


def main() -> None:
    """The server: import, then serve one request per line of stdin until it closes."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    for line in sys.stdin:
        if line.strip():
            sys.stdout.write(json.dumps(_serve(json.loads(line))) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
