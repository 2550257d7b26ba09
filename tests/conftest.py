"""Shared test set-up.

Triton kernels run under the interpreter where torch sees no GPU; the variable must be set before
anything imports triton, so it is set here, first.
"""

import os

import torch  # importing torch imports no triton

if not torch.cuda.is_available():  # CPU-only torch, or a machine whose GPU this process cannot use
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers share the machine's cores (run_tests.sh starts one per core): a second torch thread in
    # each would only make them fight. The processes the tests launch pick their own thread counts.
    torch.set_num_threads(1)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The files that take a minute or more (one process, a 2-core machine), slowest first. They run first, so
# that with several workers (run_tests.sh) no worker is left at the end with one of them while the others
# idle; run_tests.sh turns off xdist's own order (most tests first), which put the few-but-slow files last.
SLOWEST_FILES_FIRST = ("test_distributed.py", "test_checkpoint.py", "test_compile_training.py",
                       "test_context_parallel.py", "test_run_train_sh.py", "test_observe_training.py",
                       "test_lm_eval.py", "test_nsa_triton_gpu_build.py", "test_inspect.py", "test_nsa_opcheck.py",
                       "test_nsa_query_offsets.py", "test_nsa_packed.py")


def pytest_addoption(parser):
    parser.addoption("--nsa-tiles", metavar="FILE",
                     help="launch the NSA Triton kernels with this launch shapes file's shapes (bench.tile_choice "
                          "writes it) instead of the shipped ones, to hold a candidate shape to the tests")


def pytest_configure(config):
    path = config.getoption("--nsa-tiles")
    if not path:
        return
    from contextlib import ExitStack

    from bench.launch_shapes import ShapesFileError, applied, read_shapes

    try:
        shapes = read_shapes(path)
    except ShapesFileError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.nsa_launch_shapes = shapes
    config.nsa_launch_stack = ExitStack()
    config.nsa_launch_stack.enter_context(applied(shapes))


def pytest_unconfigure(config):
    stack = getattr(config, "nsa_launch_stack", None)
    if stack is not None:
        stack.close()


def pytest_report_header(config):
    shapes = getattr(config, "nsa_launch_shapes", None)
    if shapes is not None:
        from bench.launch_shapes import describe

        return f"NSA launch shapes from {config.getoption('--nsa-tiles')}: {describe(shapes)}"
    return None


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order is kept


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    yield


_HANDLED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1")


@pytest.fixture(autouse=True)
def _signal_handlers_left_as_found():
    """A trainer run in this process (cli.main) installs SIGINT/SIGTERM/SIGUSR1 handlers; one left behind,
    by a start that failed say, would swallow the Ctrl-C or the CI time limit meant for the suite."""
    import signal

    before = {name: signal.getsignal(getattr(signal, name)) for name in _HANDLED}
    yield
    after = {name: signal.getsignal(getattr(signal, name)) for name in _HANDLED}
    left = [name for name in _HANDLED if after[name] is not before[name]]
    for name in left:
        signal.signal(getattr(signal, name), before[name])
    assert not left, f"the test left its own handler for {', '.join(left)}"


def _runs_in_checkout() -> dict[str, int]:
    folder = os.path.join(REPO_ROOT, "outputs")
    try:
        return {entry.name: entry.stat().st_mtime_ns for entry in os.scandir(folder)}
    except FileNotFoundError:
        return {}


@pytest.fixture(autouse=True)
def _no_run_written_into_the_checkout():
    """A run started without job.dump_folder lands in ./outputs/<name> of the folder it starts in: for a test,
    the checkout, where it would mix with (or overwrite) the user's own runs. Every test runs in tmp_path."""
    before = _runs_in_checkout()
    yield
    after = _runs_in_checkout()
    written = sorted(name for name, mtime in after.items() if before.get(name) != mtime)
    assert not written, f"the test wrote into {os.path.join(REPO_ROOT, 'outputs')}: {', '.join(written)}"


@pytest.fixture(params=["shipped", "gather"])
def selected_layouts(request, monkeypatch):
    """Runs a Triton test twice: with the shipped layout rule (short rows take the selected branch's masked layout,
    tile_configs.masked_layout_pays) and with the masked layout off, so the gather layouts (block- or query-major
    by group size) meet the same checks on the same short rows. Each run asserts that it took its layouts: a test
    whose rows grew past the masked layout's would otherwise stop covering it in silence."""
    from tests.test_nsa_triton_block_major import spy_on_layouts

    if request.param == "gather":
        from components.nsa.triton import tile_configs

        monkeypatch.setattr(tile_configs, "MASKED_LAYOUT_MAX_ROW", 0)
    calls = spy_on_layouts(monkeypatch)
    yield request.param
    if request.param == "shipped":
        assert "masked" in calls, f"the shipped rule never took the masked layout: {calls}"
    else:
        assert calls and "masked" not in calls, f"the masked layout ran with it off, or no layout did: {calls}"


@pytest.fixture(scope="module")
def one_thread():
    """Tiny ops on a shared 2-core machine: a second thread only adds synchronisation (and, when the
    machine is busy, waits for a descheduled thread); nothing computed changes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def hide_package(monkeypatch):
    """hide_package("wandb"): importing that package (or a submodule) raises ImportError, as where it is
    not installed."""
    import builtins

    real_import = builtins.__import__

    def hide(package: str) -> None:
        def guarded(name, *args, **kwargs):
            if name.split(".")[0] == package:
                raise ImportError(f"No module named {name!r}")
            return real_import(name, *args, **kwargs)

        monkeypatch.setattr(builtins, "__import__", guarded)

    return hide
