"""The forking server the budget tests' fresh processes come from (``_zygote.py``)."""

from __future__ import annotations

import json
import os

import pytest

from tests.budget._zygote import Zygote

PROBE = "tests.budget._zygote_probe"


@pytest.fixture(scope="module")
def server():
    zygote = Zygote()
    yield zygote
    zygote.close()


def _record(done) -> dict:
    return json.loads(done.stdout.strip().splitlines()[0])


def test_each_run_is_a_fresh_child_with_its_arguments(server):
    first = server.run(PROBE, "ok", "a b")
    second = server.run(PROBE, "ok")
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    one, two = _record(first), _record(second)
    assert one["argv"] == ["ok", "a b"] and two["argv"] == ["ok"]
    assert one["pid"] != two["pid"] and one["ppid"] == two["ppid"] != os.getpid()
    assert not one["marked"] and not two["marked"]  # nothing of a child reaches the next


@pytest.mark.parametrize(("argv", "code", "text"), [
    (("exit", "3"), 3, ""), (("exit", "0"), 0, ""),
    (("raise",), 1, "ValueError: probe failed on purpose"),
])  # fmt: skip
def test_exit_codes_and_errors_come_back_as_from_a_process(server, argv, code, text):
    done = server.run(PROBE, *argv)
    assert done.returncode == code, done.stderr
    assert text in done.stderr
    assert _record(done)["argv"] == list(argv)  # its output up to the end is kept


def test_a_child_past_its_timeout_is_killed_and_the_server_goes_on(server):
    done = server.run(PROBE, "sleep", "60", timeout=1)
    assert done.returncode == -9
    assert server.run(PROBE, "ok").returncode == 0


def test_code_runs_as_python_c_does(server):
    done = server.run(
        None, "x", code="import json, sys; print(json.dumps(sys.argv)); sys.exit(2)"
    )
    assert done.returncode == 2 and json.loads(done.stdout) == ["-c", "x"]
    with pytest.raises(ValueError, match="not both"):
        server.run(PROBE, code="pass")


def test_a_child_has_imported_only_what_the_budget_worker_imports_first(server):
    """A module the server imported would not count in a child's measured call.

    A fresh worker pays torchvision (and the ``torch._dynamo`` it imports, 44 MiB)
    only for the problems that build from it, before its call; nothing else heavy.
    """
    check = (
        "import json, sys; "
        "print(json.dumps([m in sys.modules for m in ('torchvision', 'torch._dynamo')]))"
    )
    done = server.run(None, code=check)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [False, False]
