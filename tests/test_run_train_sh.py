"""run_train.sh: every nsa-titan command reaches the CLI through it (a command it does not know would be
read as a recipe and end in a confusing recipe error)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from nsa_titan.cli import COMMANDS
from tests.conftest import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "run_train.sh")


def test_the_script_passes_every_command_through():
    text = open(SCRIPT, encoding="utf-8").read()
    passed = re.search(r"^\s*([a-z|]+)\) command=\$1; shift ;;$", text, re.M).group(1).split("|")
    assert sorted(passed) == sorted(COMMANDS)


def test_a_command_runs_through_the_script():
    done = subprocess.run([SCRIPT, "eval", "--help"], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "nsa-titan eval" in done.stdout + done.stderr


@pytest.mark.parametrize("variables, message", [
    ({"NGPU": "0"}, "NGPU=0 must be at least 1"),
    ({"NGPU": "abc"}, "NGPU=abc is not a whole number"),
    ({"NGPU": "-2"}, "NGPU=-2 is not a whole number"),
    ({"NNODES": "x"}, "NNODES=x is not a whole number"),
    ({"RDZV_ENDPOINT": "node0:29500"}, "RDZV_ENDPOINT is set but NNODES is 1, so this launch would train alone"),
])
def test_bad_launch_variables_are_named_before_anything_starts(variables, message):
    done = subprocess.run([SCRIPT, "recipes/debug.toml"], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                          env={**os.environ, **variables})
    assert done.returncode == 2 and done.stderr.startswith("error: ") and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_a_multi_node_launch_without_a_rendezvous_is_named():
    done = subprocess.run([SCRIPT, "recipes/debug.toml"], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                          env={**os.environ, "NNODES": "2", "RDZV_ENDPOINT": ""})
    assert done.returncode == 2 and "error: NNODES=2 needs RDZV_ENDPOINT" in done.stderr, done.stderr
    assert "Fix: set RDZV_ENDPOINT=host:port" in done.stderr


@pytest.mark.parametrize("endpoint, message", [
    ("nohostport", "RDZV_ENDPOINT=nohostport is not host:port (a port from 1 to 65535)"),
    ("127.0.0.1:notaport", "RDZV_ENDPOINT=127.0.0.1:notaport is not host:port"),
    ("nosuchhost.invalid:29500",
     "RDZV_ENDPOINT=nosuchhost.invalid:29500: the host 'nosuchhost.invalid' is not known here"),
])
def test_a_rendezvous_endpoint_that_cannot_be_met_is_named_before_the_launch(endpoint, message):
    """torchrun took 'nohostport' as port 29400 and waited minutes in C++ warnings; 'notaport' was its traceback."""
    done = subprocess.run([SCRIPT, "recipes/debug.toml"], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                          env={**os.environ, "NNODES": "2", "NODE_RANK": "1", "RDZV_ENDPOINT": endpoint})
    assert done.returncode == 2 and f"error: {message}" in done.stderr, done.stderr
    assert "note: NODE_RANK is not used: the c10d rendezvous numbers the nodes itself, by host name" in done.stderr
    assert "Traceback" not in done.stderr and "waiting at" not in done.stderr


def test_a_stop_while_the_nodes_meet_ends_the_launch_at_once():
    """No rank runs yet, so there is nothing to stop after a step or to save: a scheduler's one SIGTERM waited
    for the rendezvous to give up (10 minutes)."""
    import signal
    import time

    from tests.launch import rendezvous_endpoint, rendezvous_id

    with rendezvous_endpoint() as endpoint:
        proc = subprocess.Popen([SCRIPT, "recipes/debug.toml", "--training.device=cpu"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, start_new_session=True,
                                env={**os.environ, "NNODES": "2", "RDZV_ENDPOINT": endpoint,
                                     "RDZV_ID": rendezvous_id(), "OMP_NUM_THREADS": "1"})
        try:
            said = ""
            while "waiting at" not in said:
                line = proc.stderr.readline()
                assert line, "the launch ended before it waited"
                said += line
            time.sleep(3)  # torchrun is in its rendezvous now
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, said + err
    assert "error: stopped before any rank started; nothing ran." in err, err
    assert "Traceback" not in err


def _children(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return fh.read().split()
    except OSError:
        return []


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_stop_while_the_launch_sets_up_says_so(tmp_path, name):
    """A scheduler's SIGTERM during the set-up and recipe check (seconds of imports) ended the launch with 143 and
    not a word: it waits for the step under way, then says that nothing ran. A terminal's Ctrl-C (SIGINT to the
    whole process group, the set-up's Python too) ended it with 130 and not a word."""
    import signal
    import time

    sig = getattr(signal, name)
    dump = tmp_path / "run"
    # A terminal's shell starts the script with Ctrl-C's default action; one started in the background by a script
    # (as a test runner may be) inherits SIGINT ignored, which bash cannot trap (the README says so).
    proc = subprocess.Popen([SCRIPT, "recipes/debug.toml", "--training.device=cpu", f"--job.dump_folder={dump}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                            start_new_session=True, env={**os.environ, "NGPU": "2", "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # In the set-up, its traps set: once the script has started a child (the first is at the line after them;
        # a fixed wait signalled a script a loaded machine had not yet brought that far).
        deadline = time.time() + 60
        while not _children(proc.pid) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.01)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # as a terminal sends it
        else:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + sig, err
    assert err == "error: stopped before any rank started; nothing ran.\n"
    assert out == "" and not dump.exists()


def test_a_device_the_node_cannot_give_every_rank_is_one_line_before_any_starts(tmp_path):
    """--training.device=cuda on a node without CUDA, or more processes than GPUs, was the same error printed by
    every rank (and the launcher's line after them): the launch checks the node once before it starts them."""
    import torch

    ngpu = torch.cuda.device_count() + 1
    done = subprocess.run([SCRIPT, "recipes/debug.toml", "--training.device=cuda", f"--job.dump_folder={tmp_path}/r"],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                          env={**os.environ, "NGPU": str(ngpu), "OMP_NUM_THREADS": "1"})
    message = ("training.device = 'cuda' but no CUDA device is visible" if ngpu == 1 else
               f"{ngpu} processes on this node but {ngpu - 1} GPU(s) visible: local rank {ngpu - 1} would have no GPU")
    assert done.returncode == 2 and done.stderr.startswith(f"error: {message}"), done.stderr
    assert done.stderr.count("\n") == 1 and done.stdout == "" and not (tmp_path / "r").exists()


@pytest.mark.parametrize("where", ["run", "run/inner"])
def test_a_dump_folder_a_file_holds_is_one_line_before_any_rank_starts(tmp_path, where):
    """--job.dump_folder at a file's path (or below one) was rank 0's message, rank 1's 'lost contact' and the
    launcher's line: the launch checks the path once before it starts the ranks, with the run's own words."""
    (tmp_path / "run").write_text("a file\n")
    done = subprocess.run([SCRIPT, "recipes/debug.toml", f"--job.dump_folder={tmp_path / where}"],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                          env={**os.environ, "NGPU": "2", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"error: cannot create job.dump_folder '{tmp_path / where}': '{tmp_path / 'run'}' is a "
                           f"file, not a folder. Fix: choose another folder with --job.dump_folder=PATH, or move that "
                           f"file away.\n"), done.stderr
    assert done.stdout == "" and (tmp_path / "run").read_text() == "a file\n"


@pytest.mark.parametrize("choice, gpus, processes, uses, message", [
    ("cuda", 0, 1, None, "training.device = 'cuda' but no CUDA device is visible"),
    ("auto", 0, 4, False, None),
    ("cpu", 2, 4, False, None),
    ("auto", 2, 2, True, None),
    ("auto", 2, 3, None, "3 processes on this node but 2 GPU(s) visible: local rank 2 would have no GPU"),
    ("cuda", 1, 2, None, "2 processes on this node but 1 GPU(s) visible"),
])
def test_the_device_each_process_gets(monkeypatch, choice, gpus, processes, uses, message):
    import torch

    from components.errors import UserError
    from nsa_titan.runtime import uses_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if message is None:
        assert uses_cuda(choice, processes) is uses
    else:
        with pytest.raises(UserError, match=re.escape(message)):
            uses_cuda(choice, processes)


def test_print_config_checks_the_recipe_for_the_launchs_world_size():
    """NGPU x NNODES processes, as the launch would start: a context-parallel degree they cannot hold is
    refused, naming that setting."""
    argv = [SCRIPT, "recipes/debug.toml", "--parallelism.context_parallel_degree=2", "--print-config"]
    one = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                         env={**os.environ, "NGPU": "1"})
    assert one.returncode == 2 and "the world size 1 is not divisible" in one.stderr, one.stderr
    two = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                         env={**os.environ, "NGPU": "2"})
    assert two.returncode == 0, two.stderr
    assert "context_parallel_degree = 2" in two.stdout


def test_the_script_trains_one_process(tmp_path):
    """What a user runs first: ./run_train.sh RECIPE [overrides], one process, to the end."""
    from tests.launch import TINY, env, losses

    done = subprocess.run([SCRIPT, "recipes/debug.toml", *TINY, "--training.steps=3", f"--job.dump_folder={tmp_path}"],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT, env={**env(), "NGPU": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(losses(tmp_path)) == [1, 2, 3] and "step 3/3" in done.stdout + done.stderr


@pytest.mark.parametrize("word, message", [
    ("evaluate", "unknown command 'evaluate' (did you mean 'eval'?)"),
    ("./my.tom", "recipe file './my.tom' not found"),  # a mistyped recipe path is not called a command
    ("recipes/debug", "recipe file 'recipes/debug' not found"),
])
def test_a_word_that_is_neither_a_command_nor_a_recipe_is_named(word, message):
    done = subprocess.run([SCRIPT, word], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("argv, name", [
    (["--training.steps=5", "recipes/debug_dense.toml"], "debug_dense"),  # flags before the recipe
    (["--training.steps", "5", "recipes/debug_dense.toml"], "debug_dense"),  # a flag's value is not a recipe
    (["recipes/debug_dense.toml", "--training.steps=5"], "debug_dense"),
    (["{tmp}/my_recipe", "--training.steps=5"], "my_recipe"),  # a recipe file named otherwise
    (["--training.steps", "5"], "debug"),  # no recipe: the debug one
    (["--job.description", "{tmp}/my_recipe", "--training.steps=5"], "debug"),  # a flag's value that is a file
], ids=["flag first", "flag and value first", "recipe first", "no .toml suffix", "no recipe", "a file as a value"])
def test_the_debug_recipe_is_the_default_only_without_a_recipe(argv, name, tmp_path):
    (tmp_path / "my_recipe").write_text(f'extends = ["{REPO_ROOT}/recipes/debug_dense.toml"]\n[job]\n'
                                        f'name = "my_recipe"\n')
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    done = subprocess.run([SCRIPT, *argv, "--print-config"], capture_output=True, text=True, timeout=600,
                          cwd=REPO_ROOT, env={**os.environ, "NGPU": "1"})
    assert done.returncode == 0, done.stderr
    assert f'\nname = "{name}"\n' in done.stdout and "\nsteps = 5\n" in done.stdout


@pytest.mark.parametrize("recipe", [["recipes/debug.toml"], []], ids=["recipe named", "no recipe"])
def test_a_pattern_the_shell_expanded_after_a_flag_is_one_problem_with_the_quoting_fix(tmp_path, recipe):
    """'--data.text_files.paths corpus/*.txt' unquoted reaches the program as one word per file: the files after
    the first were taken for recipes (one refusal each, or a data file read as TOML)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    files = [str(corpus / f"{name}.txt") for name in "abcd"]
    for path in files:
        open(path, "w").write("x = 1\n")
    done = subprocess.run([SCRIPT, *recipe, "--data.source=text_files", "--data.text_files.paths", *files,
                           "--print-config"], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                          env={**os.environ, "NGPU": "1"})
    assert done.returncode == 2, done.stderr
    assert "the recipe has 1 problem:" in done.stderr, done.stderr
    assert (f"is followed by 3 more word(s) that are neither flags nor a recipe ('{files[1]}', '{files[2]}', "
            f"'{files[3]}'): the shell expanded a pattern into one word per file. Fix: quote the pattern so that the "
            f"shell passes it on, e.g. '--data.text_files.paths={corpus}/*.txt', or name the folder.") in done.stderr
