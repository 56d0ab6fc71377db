"""Real peak memory under a budget, measured the way users meet it.

Each case runs in a fresh process (``tests/budget/_budget_worker.py``, in a child
forked after the imports by ``tests/budget/_zygote.py``) in the default environment
(every ``MALLOC_*`` variable removed), in three scenarios: the first call in
the process, after a small warm-up call, and after an earlier one-pass call (a
notebook's previous cell, which leaves freed memory for the allocator to reuse). The peak
is the kernel's own high-water mark above the resident set size just before the call, less
the call's one-time set-up (the libraries' code it paged in, and what it set up before
its baseline: :func:`_counted`); it must stay within the budget + 10%, and the result
must equal an unbudgeted call.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.budget._zygote import Zygote

ROOT = Path(__file__).resolve().parents[2]
CASES = [
    ("tutorial_conv_ae", 64), ("tutorial_conv_ae", 200),  # one pass: about +1,550 MiB
    ("mlp_ae", 32), ("mlp_ae", 64),  # one pass: about +120 MiB
    # windowed grouped convolutions' oneDNN workspace (outside torch's allocator):
    # a first call peaked at 33.8 MiB before their steps counted it, 21 MiB after
    ("conv_ae_28_outpad", 30),
    # no maps, so no workspace margin in the bound: 94% of the budget used
    ("classifier_1000", 73),
    # per-pixel cross-entropy's windowed columns were made dense first (uncounted)
    ("segmentation", 48),
]  # fmt: skip


_SERVER: list[Zygote] = []  # started by the first test that needs it
_REFERENCES: list[Path] = []  # the unbudgeted diagonals, one file per problem


@pytest.fixture(scope="module", autouse=True)
def _stop_the_server():
    yield
    while _SERVER:
        _SERVER.pop().close()
    while _REFERENCES:
        shutil.rmtree(_REFERENCES.pop(), ignore_errors=True)


def _server() -> Zygote:
    """The forking server (started once); no allocator variables, as users run."""
    if not _SERVER:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        _SERVER.append(Zygote(env))
    return _SERVER[0]


def _run(problem: str, budget_mib: int, scenario: str, *more: str) -> dict | list:
    """The worker's record, from a fresh process (forked after the imports).

    Cases of one problem share its reference diagonal (computed by the first of them).
    """
    if not _REFERENCES:
        _REFERENCES.append(Path(tempfile.mkdtemp(prefix="ggnchunk-references-")))
    stored = f"--reference={_REFERENCES[0] / problem}.pt"
    done = _server().run(
        "tests.budget._budget_worker", problem, f"{budget_mib}MiB", scenario, *more, stored
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _counted(record: dict) -> float:
    """A call's peak less its one-time set-up, which is not the budget's.

    The libraries' code it paged in (shared, read-only) and what it set up before its
    baseline (``GGNReport.setup_bytes``: the matrix products' buffer pool, torch.func's
    machinery).
    """
    return record["peak_mib"] - max(record["code_mib"], record.get("setup_mib", 0.0))


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("scenario", ["first", "warm", "after_large"])
@pytest.mark.parametrize(("problem", "budget_mib"), CASES)
def test_peak_memory_stays_within_the_budget(problem, budget_mib, scenario):
    record = _run(problem, budget_mib, scenario)
    # the code of the libraries a first call pages in (its one-time set-up, paid before
    # its baseline; shared and read-only) is not the call's memory: all else counts
    assert _counted(record) <= 1.1 * budget_mib, record
    assert record["passes"] > 1, record  # the budget forced chunking
    assert record["error"] < 1e-5, record


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_the_benchmarks_warm_segmentation_call_stays_within_the_budget():
    """After a first call whose memory went back to the OS, as the benchmark measures.

    Its windowed chunk of 1,279 columns read 64 MiB of 48.5 while cross-entropy's
    columns were made dense before they were windowed; 22 MiB once they were not.
    """
    record = _run("segmentation", 48, "trimmed")
    assert _counted(record) <= 1.1 * 48, record
    assert record["error"] < 1e-5, record


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("scenario", ["first", "trimmed"])
def test_auto_mode_stays_within_the_budget(scenario):
    """``chunk_size="auto"`` within a budget, on windowed passes sized without margin.

    The benchmark's warm auto call on this problem read 30.1 and 32.5 MiB of 30 MiB in
    two of three runs (17.9 in the third) after the windowed bound dropped its alignment
    margin where no blocks meet on unions; this worker measured 17-26 MiB.
    """
    record = _run("conv_ae_28_outpad", 30, scenario, "auto")
    assert _counted(record) <= 1.1 * 30, record
    assert record["passes"] > 1, record
    assert record["error"] < 1e-5, record


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("scenario", ["first", "after_large"])
@pytest.mark.parametrize("budget_mib", [60, 125])
def test_native_3d_convolutions_stay_within_the_budget(budget_mib, scenario):
    """Float64 3-d convolutions: ``slow_conv3d`` unfolds all ``V * N`` maps at once.

    A helper's hunt: torchvision's ``mc3_18`` went above budgets its bound accepted
    (141 MiB at 130 MiB); on this stack a first call at 60 MiB peaked at 95.6 MiB
    (two-column passes), the bound counting 6 MiB per column for about 45. Now 60 MiB
    is refused before any pass, and 125 MiB (just above the smallest budget the bound
    accepts) runs one column per pass within it.
    """
    record = _run("conv3d_stack", budget_mib, scenario)
    if "refused" in record:  # the bound's honest answer: more than the budget
        assert budget_mib < 117, record
        assert "needs up to" in record["refused"], record
        return
    assert _counted(record) <= 1.1 * budget_mib, record
    assert record["passes"] > 1, record
    assert record["error"] < 1e-5, record


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize(
    ("problem", "budget_mib", "scenario"),
    [("frozen_wide_convs", 24, s) for s in ("set_up", "warm", "after_large")]
    # the benchmark's warm call (after a first call's memory went back to the OS): its
    # frozen stages' bound counts the patches' form once where it runs for one column
    # only, and a first call's cut above the planning target no longer caps it
    + [("resnet18_frozen", 24, s) for s in ("warm", "trimmed")],
)
def test_frozen_layers_backprop_stays_within_the_budget(problem, budget_mib, scenario):
    """Frozen convolutions backpropagate only, but their patches' gradients count.

    Two frozen 512-channel convolutions between a trainable stem and head: their
    bound counted a trainable layer's products (more than the backprop needs), and
    without them nothing for the patches' gradients of the direct backprop (a warm
    call at 24 MiB peaked at 31.7-32.3 MiB in a review's probe). The first call's
    one-time set-up (oneDNN's, about 29 MiB of data beside the code for these layers)
    is paid before its baseline (``set_up``).
    """
    record = _run(problem, budget_mib, scenario)
    assert _counted(record) <= 1.1 * budget_mib, record
    assert record["passes"] > 1, record
    assert record["error"] < 1e-5, record


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("scenario", ["set_up", "warm", "after_large"])
@pytest.mark.parametrize(
    ("problem", "budget_mib"),
    [("unet", 24), ("time_unet_32", 64), ("attention_sr", 32), ("depth_head_f64", 256)],
)
def test_windowed_passes_with_groupnorm_fields_stay_within_the_budget(
    problem, budget_mib, scenario
):
    """U-Nets with GroupNorm: windowed passes carry fields (issue 19).

    ``time_unet_32``'s glue (a time embedding added to the maps, ``F.silu``,
    ``F.interpolate``, attention) is crossed on the boxes. ``attention_sr``'s attention
    written out (``softmax(q kᵀ) v``) keeps its ``[L, L]`` scores per column inside the
    glue, 40x the vectors at the glue's ends: it peaked at 45.7-51.7 MiB (``set_up``)
    before the bound counted the largest node's gradients and the glue's products were
    folded. ``depth_head_f64`` (GLPN's depth head in float64, windows ended at its
    output's glue) backpropagates its convolutions with torch's native kernels, which
    unfold every kernel offset of all the chunk's maps: 394 MiB at 256 MiB before the
    convolutions' bound counted them. The first call is measured with its one-time
    set-up paid before the measure (``set_up``): a call pays it before its own baseline
    (torch.func's, about 35 MiB of data, not only code), where this measure would count
    it.
    """
    record = _run(problem, budget_mib, scenario)
    assert _counted(record) <= 1.1 * budget_mib, record
    assert record["passes"] > 1, record
    assert record["error"] < 1e-5, record


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_a_first_call_with_glue_plans_as_a_warm_call():
    """torch.func's set-up, which the forward pass's checks pay, is outside the plan.

    A time-conditioned U-Net at 64 MiB: its first call counted the set-up as in use
    after the forward pass (41.8 MiB against 1.2 MiB in a second call) and planned 770
    passes of 4 columns where the second planned 111 of 28.
    """
    first, second = _run("time_unet_32", 64, "twice")
    assert first["passes"] <= 1.25 * second["passes"] + 1, (first, second)
    assert _counted(second) <= 1.1 * 64, (first, second)


FIRST_CALL_CASES = [("tutorial_conv_ae", 12), ("tutorial_conv_ae", 64), ("mlp_ae", 32)]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize(("problem", "budget_mib"), FIRST_CALL_CASES)
def test_the_first_call_plans_as_a_warm_call(problem, budget_mib):
    """The first call in a fresh process plans as the second one does (issue 21).

    It planned up to 43x the passes of a second call (one-time set-up counted against
    the budget), or refused 12 MiB.
    The one-time set-up is paid before the call's baseline; what it pages in of the
    libraries' code (shared, read-only, ``RssFile``) is not the call's memory, all else
    is counted.
    """
    first, second = _run(problem, budget_mib, "twice")
    assert first["passes"] <= 1.25 * second["passes"] + 1, (first, second)
    for call in (first, second):
        assert _counted(call) <= 1.1 * budget_mib, (first, second)


_SET_UP = """
import json, torch, ggnchunk
from torch import nn
from benchmarks import problems
from benchmarks.peak import status_bytes
torch.set_num_threads(1)


class Residual(nn.Module):  # glue: the sweeps backpropagate it with torch.func
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + x


model, loss, x, y = problems.build("mlp_ae")
out = []
for kwargs in ({"num_chunks": 4}, {"max_memory": "64MiB"}, {"max_memory": "64MiB"}):
    code = status_bytes("RssFile")
    _, report = ggnchunk.diag_ggn(model, loss, x, y, return_report=True, **kwargs)
    code = status_bytes("RssFile") - code
    out.append([report.setup_seconds, report.setup_bytes, code])
glue, z = Residual(), torch.rand(4, 8)
for _ in range(2):
    _, report = ggnchunk.diag_ggn(glue, nn.MSELoss(), z, z, max_memory="64MiB",
                                  return_report=True)
    out.append([report.setup_seconds, report.setup_bytes, 0])
print(json.dumps(out))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_the_report_shows_the_one_time_set_up_of_the_first_budgeted_call():
    """Paid once per process by the first call that measures memory, outside its budget.

    On Linux the CPU's budget leaves the libraries' code out, so no kernel warm-up runs
    (it cost a 40 ms problem's first call 50 ms): the report counts the code the first
    call paged in as set-up; ``torch.func``'s set-up (glue) is still paid before the
    baseline.
    """
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _SET_UP],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    unbudgeted, first, second, glue_first, glue_second = json.loads(
        done.stdout.strip().splitlines()[-1]
    )
    assert unbudgeted[:2] == [0.0, 0]  # no budget: nothing is set up
    assert first[0] == 0.0  # no warm-up: the code it paged in is not counted
    # the code the call paged in (RssFile), as pages mapped from files (statm's shared,
    # which also holds shared memory: never less)
    assert first[1] >= first[2], first
    # once per process: no set-up runs again, and the code a later call pages in is at
    # most a block or two of the kernel's fault-around (16 pages mapped per fault),
    # which depends on what ran before it (measured: 0 or 64 KiB, as the sweep's
    # Python code changed)
    assert second[0] == 0.0 and second[1] <= 2 * _FAULT_AROUND, second
    assert glue_first[0] > 0 and glue_first[1] > 0  # torch.func, before the baseline
    assert glue_second[0] == 0.0 and glue_second[1] <= 2 * _FAULT_AROUND, glue_second


_FAULT_AROUND = 16 * 4096


_MAPPED = """
import json, mmap, os, sys, torch
from ggnchunk._memory import HostMemory
host = HostMemory(torch.device("cpu"))
if host.counts_code:
    print(json.dumps(None)); sys.exit()
path = sys.argv[1]
with open(path, "wb") as handle:
    handle.write(os.urandom(64 * 2**20))
before, code = host.current(), host.code()
handle = open(path, "rb")
m = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
total = sum(m[i] for i in range(0, len(m), 4096))  # touch every page
mapped, after_mapping = host.code() - code, host.current() - before
data = torch.ones(64 * 2**20 // 4)  # 64 MiB of data
with_data = host.current() - before
print(json.dumps([mapped, after_mapping, with_data]))
"""


def test_the_cpu_budget_leaves_out_pages_mapped_from_files(tmp_path):
    """A file's pages read into memory (as a library's code is) do not count; data does.

    In a fresh process: the suite's own allocations would move the measurement.
    """
    done = subprocess.run(
        [sys.executable, "-c", _MAPPED, str(tmp_path / "pages")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    if measured is None:
        pytest.skip("needs Linux /proc/self/statm")
    mapped, after_mapping, with_data = measured
    assert mapped >= 48 * 2**20, measured  # resident, as the file's pages
    assert abs(after_mapping) < 16 * 2**20, measured  # but not counted
    assert with_data > 48 * 2**20, measured


_RESIZED = """
import json, torch, ggnchunk
from torch import nn
torch.set_num_threads(1)
torch.manual_seed(0)


class Resized(nn.Module):  # a skip and a bilinear resize in the glue
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, 2, 1)
        self.d = nn.Conv2d(16, 4, 3, padding=1)

    def forward(self, x):
        h = torch.relu(self.a(x))
        g = nn.functional.interpolate(torch.tanh(self.b(h)), scale_factor=2,
                                      mode="bilinear", align_corners=False)
        return self.d(torch.cat([h, g], 1))


model = Resized().double()
x, y = torch.randn(1, 3, 32, 32).double(), torch.randn(1, 4, 32, 32).double()
passes = []
for _ in range(2):
    _, report = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, max_memory="64MiB",
                                  return_report=True)
    passes.append(report.num_passes)
print(json.dumps(passes))
"""


@pytest.mark.slow
def test_a_first_call_with_a_bilinear_resize_plans_as_a_second_call():
    """Sizing the resize on the ``meta`` device imported ``torch._dynamo`` (44 MiB).

    A first call counted it as in use after its forward pass and ran 4,096 one-column
    passes (18 s) where the second call ran 29 (0.6 s).
    """
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _RESIZED],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = json.loads(done.stdout.strip().splitlines()[-1])
    assert first <= 1.25 * second + 1, (first, second)


_KRON = """
import json, torch, ggnchunk
from torch import nn
from benchmarks.peak import high_water_mark_mib, status_bytes
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3072, 8), nn.Tanh(), nn.Linear(8, 3)).double()
x, y = torch.randn(4, 3072).double(), torch.randint(0, 3, (4,))
out = []
for kwargs in ({}, {"batch_chunk_size": 2}):
    code = status_bytes("RssFile")
    peak, _ = high_water_mark_mib(lambda: ggnchunk.kron_ggn(
        model, nn.CrossEntropyLoss(), x, y, max_memory="100MiB", **kwargs))
    out.append(peak - (status_bytes("RssFile") - code) / 2**20)
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_kron_factors_stay_within_the_budget():
    """A 72 MiB input factor within a 100 MiB budget, with and without sub-batches.

    It was divided by the batch size out of place after the passes: a second copy above
    the budget (144 MiB), without a warning.
    """
    done = _server().run(None, code=_KRON)
    assert done.returncode == 0, done.stderr[-3000:]
    for peak in json.loads(done.stdout.strip().splitlines()[-1]):
        assert peak <= 110, peak


_POOL = """
import gc, json, random, sys, torch
from ggnchunk._memory import HostMemory
from ggnchunk._warmup import ensure_matmul_pool
threads, dtype, warm = int(sys.argv[1]), getattr(torch, sys.argv[2]), sys.argv[3] == "1"
torch.set_num_threads(threads)
host = HostMemory(torch.device("cpu"))
if host.counts_code:
    print(json.dumps(None)); sys.exit()
zeros = torch.zeros(2**24, dtype=dtype)  # every factor is a view of it
before = host.settled()
if warm:
    ensure_matmul_pool(dtype, torch.device("cpu"), 2**20, 2**30)  # a budget it fills
after_set_up = host.settled()
rng = random.Random(0)
sizes = [1, 3, 8, 17, 64, 100, 256, 513, 1024, 2048, 4096, 8192]
# those that grew the pool most in a sweep of 600 products, and random ones
shapes = [(64, 1024, 8192), (8192, 1024, 64), (4096, 100, 513), (64, 1024, 513),
          (256, 64, 513), (2048, 8, 64), (8, 3, 2048)]
shapes += [tuple(rng.choice(sizes) for _ in range(3)) for _ in range(60)]
for m, k, n in shapes:
    if m * k * n > 2**27 and (m, k, n) not in shapes[:7]:
        continue
    for layout in range(4):  # each factor as is or transposed
        a = zeros[: k * m].view(k, m).t() if layout & 1 else zeros[: m * k].view(m, k)
        b = zeros[: n * k].view(n, k).t() if layout & 2 else zeros[: k * n].view(k, n)
        torch.mm(a, b)
b = zeros[: 16 * 300 * 64].view(16, 300, 64)
torch.bmm(b.transpose(1, 2), b)
del a, b
gc.collect()
print(json.dumps([after_set_up - before, host.settled() - after_set_up]))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "threads"), [("float32", 1), ("float32", 2), ("float64", 1)]
)
def test_matrix_products_after_the_set_up_keep_nothing_more(dtype, threads):
    """The products' buffer pool is grown before a budgeted call's baseline (issue 21).

    MKL keeps a pool of packing buffers per thread that grows with the largest products
    a process ran and is never given back. Grown inside a first call, it counted as in
    use after the forward pass: the partly frozen ResNet-18 at 22.3 MiB planned 51
    passes where a second call planned 25. After :func:`ensure_matmul_pool`, products
    of the shapes that grew it most and of random ones, in four layouts, leave nothing
    more resident. Without it (the
    control) they leave several MiB where the library keeps such a pool; the case is
    skipped where it does not.
    """
    runs = []
    for warm in ("0", "1"):
        done = _server().run(None, str(threads), dtype, warm, code=_POOL)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    if runs[0] is None:
        pytest.skip("needs Linux /proc/self/statm")
    (_, cold), (set_up, warm) = runs
    if cold < 2**20:
        pytest.skip(f"this BLAS keeps no pool that grows ({cold} bytes)")
    assert set_up > 2**20, runs  # the set-up grew it
    assert warm < 2**19, runs  # and the products found it large enough


_POOL_CALL = """
import json, sys, torch, ggnchunk
from torch import nn
from ggnchunk import _warmup
torch.set_num_threads(1)
torch.manual_seed(0)
width = int(sys.argv[2])  # 1,024: 1.07M parameters
model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 16))
x, y = torch.randn(8, width), torch.randn(8, 16)
ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, max_memory=sys.argv[1])
print(json.dumps(any(key[0] == "matmul pool" for key in _warmup._WARMED)))
"""


@pytest.mark.parametrize(
    ("budget", "width", "grown"),
    [("16MiB", 1024, True), ("1GiB", 1024, False), ("16MiB", 256, False)],
)
def test_the_products_pool_is_grown_for_large_models_under_tight_budgets(
    budget, width, grown
):
    """A first call grows it where it is over 5% of the budget and the model is large.

    Elsewhere it costs a first call 20-60 ms for nothing: a small model's products
    hardly grow the pool, a large budget does not notice it.
    """
    done = _server().run(None, budget, str(width), code=_POOL_CALL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) is grown


@pytest.mark.slow
@pytest.mark.parametrize(
    "problem", ["wide_conv_head", "conv3d_stack", "resnet18_layer4", "deeplab"]
)
def test_budgets_just_above_the_smallest_accepted_hold(problem):
    """No chunk goes above a budget the bound accepts (in this process; warnings fail).

    The smallest budget the bound accepts is read from its refusal; at 1.02x, 1.1x and
    1.3x of it every chunk's measured peak must stay within the budget
    (``MemoryBudgetWarning`` is an error here). A helper's hunt: float64 3-d
    convolutions' native input gradient and a large weight's squares (a weight-sized
    total and each step's sum) were not counted: chunks peaked at 39 MiB under budgets
    of 29-37 MiB that the bound had accepted. A frozen ResNet-18 with a trainable
    ``layer4`` (a second helper's hunt, on a model the tests did not have): each layer's
    weight-sized Gram-form value freed into a hole that the next vectors split, so the
    heap grew by a weight per layer (9 MiB) and one-column passes peaked 20-27% above
    budgets at 1.05x; its Gram form is now added into the accumulator. Torchvision's
    DeepLabV3 (a third hunt): its ASPP's atrous convolutions padded their 4x4 inputs to
    up to 76x76 maps to read their patches, 42 MiB the bound did not count (the first
    pass below the cut peaked at 65 MiB within 55.5 MiB); the taps are now gathered.
    """
    import re

    import ggnchunk
    from benchmarks import problems

    model, loss_func, x, y = problems.build(problem)
    with pytest.raises(ggnchunk.MemoryBudgetError) as refused:
        ggnchunk.diag_ggn(model, loss_func, x, y, max_memory="1MiB")
    smallest = float(re.search(r"needs up to ([\d.]+) MiB", str(refused.value)).group(1))
    reference = ggnchunk.diag_ggn(model, loss_func, x, y)
    for factor in (1.02, 1.1, 1.3):
        budget = f"{smallest * factor:.1f}MiB"
        diag, report = ggnchunk.diag_ggn(
            model, loss_func, x, y, max_memory=budget, return_report=True
        )
        assert report.num_passes > 1, report
        for name, value in diag.items():
            assert torch.allclose(value, reference[name], rtol=1e-10, atol=0), name
