"""lm-evaluation-harness on local task files: the registered nsa_titan model, the --format hf folder under
the harness's own `hf` model, and `nsa-titan eval --tasks` all give the same numbers. Offline, CPU, fp32."""

from __future__ import annotations

import glob
import json
import os
import shutil
import sysconfig

import pytest
import torch

from nsa_titan import cli
from tests.launch import DEBUG, TINY
from tests.test_hf_export import trained_logits

# Not "hf", as tests/test_hf_export.py names its folder: transformers copies a folder's remote code into a
# cache named by the folder, unlocked across processes, and the suite may run both files at once.
HF_FOLDER = "hf_for_lm_eval"

lm_eval = pytest.importorskip("lm_eval", reason="the lm_eval extra (pip install -e '.[lm_eval]')")

RUN = [DEBUG, *[a for a in TINY if "seq_len" not in a], "--training.seq_len=128", "--model.max_seq_len=256",
       "--training.steps=2", "--checkpoint.enable=true"]
TASKS = ["toy_choice", "toy_rolling", "toy_generate"]


def _task_files(folder) -> None:
    """Three tasks, one per request kind, over JSON lines written here."""
    sources = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))
    texts = [open(f, encoding="utf-8").read()[:700] for f in sources[:3]]  # longer than max_seq_len: windows
    rows = {
        "choice": [{"context": "def add(a, b):\n    return", "choices": [" a + b", " 12", "!!"], "answer": 0},
                   {"context": "import", "choices": [" os", " 4", "("], "answer": 0},
                   {"context": "for i in", "choices": [" range(3):", " ))", " pass"], "answer": 0}],
        "rolling": [{"text": t} for t in texts],
        "generate": [{"prompt": "class Foo", "answer": "(object):"}, {"prompt": "def ", "answer": "f(x):"}],
    }
    specs = {
        "choice": {"output_type": "multiple_choice", "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
                   "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]},
        "rolling": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                    "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"},
                                    {"metric": "bits_per_byte"}]},
        "generate": {"output_type": "generate_until", "doc_to_text": "{{prompt}}", "doc_to_target": "{{answer}}",
                     "generation_kwargs": {"until": ["\n"], "max_gen_toks": 12, "do_sample": False,
                                           "temperature": 0.0},
                     "metric_list": [{"metric": "exact_match"}]},
    }
    for name, docs in rows.items():
        data = os.path.join(folder, f"{name}.jsonl")
        with open(data, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(doc) + "\n" for doc in docs)
        task = {"task": f"toy_{name}", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": data}},
                "test_split": "test", **specs[name]}
        with open(os.path.join(folder, f"toy_{name}.yaml"), "w", encoding="utf-8") as fh:
            json.dump(task, fh)  # YAML reads JSON


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return _setup(tmp_path_factory.mktemp("lm_eval"), RUN)


def _setup(root, run):
    argv = [*run, f"--job.dump_folder={root}/run"]
    assert cli.main(["train", *argv]) == 0
    assert cli.main(["export", *argv, "--output", str(root / "model.pt")]) == 0
    assert cli.main(["export", *argv, "--format", "hf", "--output", str(root / HF_FOLDER)]) == 0
    tasks = root / "tasks"
    tasks.mkdir()
    _task_files(str(tasks))
    return argv, root


def _evaluate(model, model_args, root, **options) -> dict:
    from lm_eval.tasks import TaskManager

    options = {"bootstrap_iters": 0, **options}  # no standard errors unless asked: faster
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS,
                                  task_manager=TaskManager(include_path=str(root / "tasks")), log_samples=False,
                                  **options)
    return out["results"]


def _assert_same(a: dict, b: dict, tasks=TASKS, stderr: bool = False) -> None:
    assert sorted(a) == sorted(TASKS) and sorted(b) == sorted(TASKS)
    for task in tasks:
        metrics = {k: v for k, v in a[task].items() if "," in k and (stderr or "stderr" not in k)}
        assert metrics, a[task]
        for key, value in metrics.items():  # a standard error the harness cannot give is the text "N/A"
            expected = value if isinstance(value, str) else pytest.approx(value, rel=1e-5, abs=1e-6)
            assert b[task][key] == expected, (task, key)


def test_the_registered_model_and_the_hf_folder_agree(setup):
    from nsa_titan.evaluate.harness import lm_class

    _, root = setup
    lm_class()  # registers "nsa_titan" with the harness
    ours = _evaluate("nsa_titan", f"pretrained={root / 'model.pt'}", root)
    hf = _evaluate("hf", {"pretrained": str(root / HF_FOLDER), "trust_remote_code": True, "device": "cpu",
                          "dtype": "float32"}, root)
    _assert_same(ours, hf)
    assert 1 < ours["toy_rolling"]["byte_perplexity,none"] < 258  # a byte model, better than uniform
    # The registered model reads the folder too.
    _assert_same(ours, _evaluate("nsa_titan", f"pretrained={root / HF_FOLDER}", root))


@pytest.fixture(scope="module")
def bos_setup(tmp_path_factory):
    return _setup(tmp_path_factory.mktemp("lm_eval_bos"), [*RUN, "--data.add_bos=true"])


@pytest.fixture(scope="module")
def unmasked(tmp_path_factory):
    """A run whose model attends across the documents of a row (model.document_masking off): its exported file."""
    root = tmp_path_factory.mktemp("lm_eval_unmasked")
    argv = [*RUN, "--model.document_masking=false", f"--job.dump_folder={root}/run"]
    assert cli.main(["train", *argv]) == 0
    assert cli.main(["export", *argv, "--output", str(root / "model.pt")]) == 0
    return argv, root


def test_a_model_trained_with_bos_is_evaluated_with_it_both_ways(bos_setup):
    """data.add_bos: every document began with BOS in training, and the folder's tokenizer adds it; the
    registered model puts it first too (and before an empty context), so both ways agree on choices and
    generation. Rolling windows are left out: lm-eval's hf model puts its prefix BOS before the tokenizer's
    own there."""
    from nsa_titan.evaluate.harness import lm_class

    _, root = bos_setup
    lm = lm_class()(pretrained=str(root / "model.pt"))
    assert lm.tok_encode("import os")[0] == 256 and lm.prefix_token_id == 256  # the byte tokenizer's BOS
    ours = _evaluate("nsa_titan", f"pretrained={root / 'model.pt'}", root)
    hf = _evaluate("hf", {"pretrained": str(root / HF_FOLDER), "trust_remote_code": True, "device": "cpu",
                          "dtype": "float32"}, root)
    _assert_same(ours, hf, ["toy_choice", "toy_generate"])


@pytest.mark.parametrize("which", ["setup", "unmasked", "bos_setup"])
def test_an_empty_context_is_scored_and_continued_as_training_read_the_document(request, monkeypatch, which):
    """An empty context and a text's first rolling window start from what a document follows: without data.add_bos
    the end of text, which a model trained with document masking read apart from the document after it (setup;
    they ran together, one position late, ~0.2 nats off over this text); a model without it attends across
    (unmasked); with data.add_bos the document's own BOS, which it sees (bos_setup)."""
    import sys
    from types import SimpleNamespace

    from nsa_titan.evaluate.harness import lm_class

    _, root = request.getfixturevalue(which)
    path = str(root / "model.pt")
    lm = lm_class()(pretrained=path)
    text = "def f(x):\n    return x * 2\n\n\nclass Point:\n    pass\n"
    tokens = [lm.prefix_token_id] + lm.tok_encode(text, add_special_tokens=False)
    expected = torch.log_softmax(trained_logits(path, tokens).double(), dim=-1)[:-1]
    expected = float(expected.gather(-1, torch.tensor(tokens[1:])[:, None]).sum())
    ((scored, _),) = lm.loglikelihood([SimpleNamespace(args=("", text))])
    (rolling,) = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])
    assert scored == pytest.approx(expected, rel=1e-6) and rolling == pytest.approx(expected, rel=1e-6)
    # Generation from an empty context draws from the logits training gives the document drawn.
    drawn = []

    def greedy(logits, **kw):
        drawn.append(logits[0].clone())
        return logits.argmax(dim=-1)

    monkeypatch.setattr(sys.modules["components.models.generate"], "sample_next", greedy)
    lm.generate_until([SimpleNamespace(args=("", {"until": [], "max_gen_toks": 24}))])
    tokens = [lm.prefix_token_id] + [int(logits.argmax()) for logits in drawn]
    assert len(drawn) > 1 and lm.eot_token_id not in tokens[1:-1]
    torch.testing.assert_close(torch.stack(drawn), trained_logits(path, tokens)[:-1], rtol=1e-5, atol=1e-5)


def test_a_model_given_without_documents_reads_each_row_as_one_sequence(setup):
    """The harness model built from a model and tokenizer alone (documents left out) scores a context's text
    after the end of text as one sequence, as the model's plain forward does."""
    from types import SimpleNamespace

    from nsa_titan.evaluate.harness import lm_class
    from nsa_titan.export import load_exported_run

    _, root = setup
    run = load_exported_run(str(root / "model.pt"))
    lm = lm_class()(model=run.model, tokenizer=run.tokenizer)
    text = "def f(x):\n    return x * 2\n"
    tokens = [lm.prefix_token_id] + lm.tok_encode(text, add_special_tokens=False)
    with torch.no_grad():
        expected = torch.log_softmax(run.model(torch.tensor([tokens]))[0].double(), dim=-1)[:-1]
    expected = float(expected.gather(-1, torch.tensor(tokens[1:])[:, None]).sum())
    ((scored, _),) = lm.loglikelihood([SimpleNamespace(args=("", text))])
    assert scored == pytest.approx(expected, rel=1e-6)


def test_a_generation_longer_than_the_context_is_cut_to_fit(setup, monkeypatch):
    """max_gen_toks at or past max_seq_len (the harness's default 256 on a 256-token model): the new tokens
    leave one prompt token, the prompt's last, instead of failing the request."""
    from types import SimpleNamespace

    import components.models
    from nsa_titan.evaluate.harness import lm_class

    _, root = setup
    lm = lm_class()(pretrained=str(root / "model.pt"))
    calls = []
    real = components.models.generate
    monkeypatch.setattr(components.models, "generate", lambda model, prompt, new, **kw: calls.append(
        (prompt[0].tolist(), new)) or real(model, prompt, new, **kw))
    context = "def f(x):\n    return x\n" * 4
    (text,) = lm.generate_until([SimpleNamespace(args=(context, {"until": [], "max_gen_toks": 300}))])
    ((prompt, new),) = calls
    assert (len(prompt), new) == (1, 255) and prompt == lm.tok_encode(context)[-1:] and isinstance(text, str)


def test_eval_runs_tasks_beside_its_own_probes(setup, tmp_path, capsys):
    from nsa_titan.evaluate.command import task_metrics
    from nsa_titan.evaluate.harness import lm_class

    argv, root = setup
    out = tmp_path / "eval"
    assert cli.main(["eval", *argv, "--out", str(out), "--batches", "1", "--trials", "1", "--depths", "0",
                     "--tasks", ",".join(TASKS), "--task-dir", str(root / "tasks")]) == 0
    written = json.load(open(out / "lm_eval.json"))
    # the console gives the tasks' numbers too (it named only lm_eval.json)
    said = capsys.readouterr().out.splitlines()[-1]
    assert said == f"lm-eval: {task_metrics(written['results'])}", said
    choice = written["results"]["toy_choice"]["acc,none"]
    assert f"toy_choice: acc {choice:.4g}" in said and "stderr" not in said, said
    assert sorted(os.listdir(out)) == ["eval.json", "lm_eval.json", "passkey.png", "position_loss.png"]
    lm_class()
    # As the lm_eval command line gives them, standard errors included (its default bootstrap_iters).
    defaults = _evaluate("nsa_titan", f"pretrained={root / 'model.pt'}", root, bootstrap_iters=100000)
    _assert_same(written["results"], defaults, stderr=True)
    assert isinstance(written["results"]["toy_choice"]["acc_stderr,none"], float)


@pytest.mark.parametrize("release, listing", [("0.4.5", "lm_eval --tasks list"), ("0.4.9.2", "lm_eval --tasks list"),
                                              ("0.4.10", "lm_eval ls tasks"), ("0.5.0.dev1", "lm_eval ls tasks")])
def test_an_unknown_tasks_fix_lists_tasks_as_the_installed_harness_does(monkeypatch, release, listing):
    """The fix named `lm_eval ls tasks` under every lm_eval the lm_eval extra allows (>= 0.4.5), though the `ls`
    subcommand came with 0.4.10; before it tasks are listed with `--tasks list`, which 0.4.10 dropped."""
    from importlib import metadata

    from nsa_titan.evaluate.harness import task_listing

    monkeypatch.setattr(metadata, "version", lambda name: {"lm_eval": release}[name])
    assert task_listing(None) == listing
    assert task_listing("my tasks") == f"{listing} --include_path 'my tasks'"


@pytest.mark.parametrize("extra, message", [
    (["--tasks", "no_such_task"], "lm-eval knows no task 'no_such_task'"),
    (["--tasks", "toy_choice,toy_lost"], "lm-eval cannot load the task(s) toy_choice, toy_lost"),
    (["--task-dir", "/nonexistent"], "--task-dir '/nonexistent' is not a folder"),
    (["--limit", "3"], "--task-dir and --limit apply to lm-eval tasks"),
    # a task file that is not YAML, which the harness skips without a word: it said only 'knows no task'
    (["--tasks", "toy_broken"], "lm-eval knows no task 'toy_broken', built in or in TASKS: the harness skipped the "
                                "task files there that are not YAML, TASKS/toy_broken.yaml (mapping values are not "
                                "allowed here"),
])
def test_bad_task_options(setup, tmp_path, capsys, monkeypatch, extra, message):
    """Refused before the model is loaded (and hours of held-out loss and passkey run)."""
    from nsa_titan.evaluate import command

    def too_late(argv):
        raise AssertionError("the model was loaded before the task options were checked")

    monkeypatch.setattr(command, "_load", too_late)
    argv, root = setup
    if "toy_choice,toy_lost" in extra:  # a task whose data file is gone
        task_dir = tmp_path / "tasks"
        shutil.copytree(root / "tasks", task_dir)
        spec = json.load(open(task_dir / "toy_choice.yaml"))
        spec["task"], spec["dataset_kwargs"]["data_files"]["test"] = "toy_lost", str(tmp_path / "gone.jsonl")
        json.dump(spec, open(task_dir / "toy_lost.yaml", "w"))
        extra = [*extra, "--task-dir", str(task_dir)]
    if "toy_broken" in extra:
        task_dir = tmp_path / "tasks"
        shutil.copytree(root / "tasks", task_dir)
        (task_dir / "toy_broken.yaml").write_text("task: toy_broken\ndataset_path: json\n  output_type: [\n")
        extra = [*extra, "--task-dir", str(task_dir)]
        message = message.replace("TASKS", str(task_dir))
    assert cli.main(["eval", *argv, "--out", str(tmp_path / "out"), "--batches", "1", "--trials", "1",
                     "--depths", "0", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
