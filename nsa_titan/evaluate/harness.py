"""lm-evaluation-harness on nsa_titan models.

Two ways, which give the same numbers (tests/test_lm_eval.py checks that; with data.add_bos, the harness's
`hf` model puts its prefix BOS before the BOS the tokenizer adds in loglikelihood_rolling, so rolling
tasks differ there, the nsa_titan model starting each window as training started a document):
- `nsa-titan eval ... --tasks NAMES [--task-dir DIR] [--limit N]` runs the harness on the loaded model
  through the LM class below (registered with the harness as "nsa_titan"; from Python,
  `lm_eval.simple_evaluate(model="nsa_titan", model_args="pretrained=PATH")` once this module is
  imported, PATH an exported .pt file or a --format hf folder);
- `lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True` on an `export --format hf` folder.

The LM scores each request's context + continuation in one forward (left-truncated to
max_seq_len), rows of a batch right-padded (causal attention: padding after a row's tokens changes
none of its logits), and decodes greedily with the KV cache. An empty context and a first rolling window start
from the end of text, read as training read a document after one (nsa_titan/document_start.py).
"""

from __future__ import annotations

import os
import re
import shlex
from importlib import metadata

import torch
import torch.nn.functional as F

from components.errors import UserError, first_line
from components.install_hint import install_extra

MODEL_NAME = "nsa_titan"
_REGISTERED: dict = {}


def require_lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(f"--tasks runs lm-evaluation-harness, which is not installed. Fix: {install_extra('lm_eval')} "
                        "(or pip install lm_eval).") from None


def lm_class():
    """The harness LM class for nsa_titan models, registered as "nsa_titan" on first use."""
    if "class" in _REGISTERED:
        return _REGISTERED["class"]
    require_lm_eval()
    import lm_eval.models  # noqa: F401 (the harness's own models: registering ours alone would hide them)
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class NSATitanLM(TemplateLM):
        def __init__(self, pretrained: str | None = None, model=None, tokenizer=None, batch_size: int | str = 8,
                     max_length: int | None = None, add_bos: bool = False, documents=None, **unused):
            """model, tokenizer, add_bos and documents (document_start.documents_of) are given together, or read
            from `pretrained`; a model given without documents attends across them (one sequence per row)."""
            from nsa_titan.document_start import leading_eos_apart

            super().__init__()
            if model is None:
                model, tokenizer, add_bos, documents = _load(pretrained)
            self.model, self.tokenizer_ = model.eval(), tokenizer
            # Documents as training saw them: BOS first with data.add_bos, else after an end of text, which
            # under document masking the document does not see.
            self.add_bos, self.documents = add_bos, documents
            self.apart = documents is not None and leading_eos_apart(documents, add_bos)
            self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
            self.max_length = int(max_length or model.args.max_seq_len)
            self._device = next(model.parameters()).device

        @property
        def eot_token_id(self) -> int:
            return self.tokenizer_.eos_id

        @property
        def prefix_token_id(self) -> int:
            """What a document follows: its BOS with data.add_bos, else the previous document's end of text."""
            from components.data import document_prefix_id

            return document_prefix_id(self.tokenizer_, self.add_bos)

        def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
            """As the exported Hugging Face tokenizer encodes: the BOS training put first, unless told not to."""
            from components.data import encode_text

            bos = [self.tokenizer_.bos_id] if self.add_bos and add_special_tokens is not False else []
            return bos + encode_text(self.tokenizer_, string, "a task's text")

        def tok_decode(self, tokens) -> str:
            from components.data import decode_text

            return decode_text(self.tokenizer_, tokens)

        @torch.no_grad()
        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            from nsa_titan.document_start import opening_documents

            rows = [(context + continuation)[-(self.max_length + 1):] for _, context, continuation in requests]
            order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))  # similar lengths share a batch
            results: list = [None] * len(rows)
            for b in range(0, len(order), self.batch_size):
                chunk = order[b:b + self.batch_size]
                width = max(len(rows[i]) - 1 for i in chunk)
                inputs = torch.zeros(len(chunk), width, dtype=torch.long)
                for r, i in enumerate(chunk):
                    inputs[r, :len(rows[i]) - 1] = torch.tensor(rows[i][:-1])
                documents = opening_documents(self.documents, inputs, self.eot_token_id) if self.apart else None
                logprobs = F.log_softmax(self.model(inputs.to(self._device), documents).float(), dim=-1).cpu()
                for r, i in enumerate(chunk):
                    n, end = len(requests[i][2]), len(rows[i]) - 1
                    if n == 0:  # a continuation of no tokens: certain, and greedy
                        results[i] = (0.0, True)
                        continue
                    target = torch.tensor(rows[i][-n:])
                    picked = logprobs[r, end - n:end]
                    results[i] = (float(picked.gather(-1, target[:, None]).sum()),
                                  bool(torch.equal(picked.argmax(-1), target)))
            return results

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            totals = []
            for (text,) in (request.args for request in requests):
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    self.tok_encode(text, add_special_tokens=False), self.prefix_token_id, self.max_length, 1)]
                scored = self._loglikelihood_tokens([(None, context, target) for context, target in windows])
                totals.append(sum(logprob for logprob, _ in scored))
            return totals

        @torch.no_grad()
        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            from nsa_titan.document_start import generate_document

            outputs = []
            for context, kwargs in (request.args for request in requests):
                kwargs = dict(kwargs or {})
                until = kwargs.get("until") or []
                until = ([until] if isinstance(until, str) else list(until)) + [self.tok_decode([self.eot_token_id])]
                # at least one prompt token: the context is cut from the left to what the new tokens leave
                new_tokens = min(int(kwargs.get("max_gen_toks", 256)), self.max_length - 1)
                if kwargs.get("do_sample") or kwargs.get("temperature", 0) not in (0, 0.0):
                    raise UserError("the nsa_titan harness model decodes greedily; the task asks for sampling. Fix: "
                                    "run the task with do_sample false and temperature 0.")
                prompt = self.tok_encode(context)[-(self.max_length - new_tokens):] or [self.prefix_token_id]
                tokens = generate_document(self.model, prompt, new_tokens, self.eot_token_id, self.apart, temperature=0)
                text = self.tok_decode(tokens)
                for stop in until:
                    text = text.split(stop)[0]
                outputs.append(text)
            return outputs

    register_model(MODEL_NAME)(NSATitanLM)
    _REGISTERED["class"] = NSATitanLM
    return NSATitanLM


def _load(path: str | None):
    from nsa_titan import registry
    from nsa_titan.document_start import documents_of
    from nsa_titan.export import load_exported_run
    from nsa_titan.rebuild import say_on_stderr

    if not path:
        raise UserError("the nsa_titan harness model needs pretrained=PATH (an exported .pt file or a --format hf "
                        "folder). Fix: model_args='pretrained=outputs/debug/model.pt'.")
    run = load_exported_run(path, say=say_on_stderr)
    documents = documents_of(registry.get("model", run.meta["model_name"]), run.model)
    return run.model, run.tokenizer, run.recipe.data.add_bos, documents


def task_manager(tasks: list[str], task_dir: str | None):
    """The harness's task index (with task_dir's YAML files), once every task in `tasks` is known to it: an
    unknown name is refused before the model is loaded or anything evaluated."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=task_dir) if task_dir else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f", built in or in {task_dir}" if task_dir else ""
        broken = _unreadable_task_files(task_dir) if task_dir else []
        if broken:  # the harness skips a task file it cannot read without a word: the task in it is missing
            raise UserError(f"lm-eval knows no task {', '.join(map(repr, unknown))}{where}: the harness skipped the "
                            f"task files there that are not YAML, {'; '.join(broken)}. Fix: mend them.")
        raise UserError(f"lm-eval knows no task {', '.join(map(repr, unknown))}{where}. Fix: name tasks from "
                        f"`{task_listing(task_dir)}`, or give --task-dir with your task YAML files.")
    return manager


def task_listing(task_dir: str | None) -> str:
    """The installed harness's command that lists its tasks (task_dir's too): lm_eval 0.4.10 replaced
    `--tasks list` with the `ls` subcommand."""
    release = tuple(int(n) for n in re.findall(r"\d+", metadata.version("lm_eval"))[:3])
    listing = "lm_eval ls tasks" if release >= (0, 4, 10) else "lm_eval --tasks list"
    return listing + (f" --include_path {shlex.quote(task_dir)}" if task_dir else "")


def _unreadable_task_files(task_dir: str) -> list[str]:
    """'FILE (why)' for each .yaml file under task_dir that does not parse as YAML (the harness's own tags, such
    as !function, are read as anything)."""
    import yaml

    class Tolerant(yaml.SafeLoader):
        pass

    Tolerant.add_multi_constructor("", lambda loader, tag, node: None)
    found = []
    for root, _, files in sorted(os.walk(task_dir)):
        for name in sorted(files):
            if not name.endswith((".yaml", ".yml")):
                continue
            path = os.path.join(root, name)
            try:
                with open(path, encoding="utf-8") as fh:
                    yaml.load(fh, Loader=Tolerant)  # noqa: S506 (a safe loader that tolerates unknown tags)
            except (yaml.YAMLError, UnicodeDecodeError, OSError) as exc:
                found.append(f"{path} ({' '.join(str(exc).split())})")
    return found


def check_tasks_load(tasks: list[str], manager) -> None:
    """Load every task of `tasks` (its documents too) once before the model runs: a dataset that cannot be
    read (offline, a wrong path in a task file) is one message now, not a traceback after the held-out loss
    and passkey ran. The harness loads them again when it runs them, from the datasets cache."""
    def load(names):  # newer releases have TaskManager.load and deprecate get_task_dict; older ones lack it
        if hasattr(manager, "load"):
            return manager.load(names)
        from lm_eval.tasks import get_task_dict

        return get_task_dict(names, manager)

    try:
        load(tasks)
    except Exception as exc:  # the harness and datasets raise many kinds (ConnectionError, FileNotFoundError, ...)
        reason = first_line(exc)
        raise UserError(f"lm-eval cannot load the task(s) {', '.join(tasks)} ({type(exc).__name__}: {reason}); "
                        f"nothing was evaluated. Fix: make each task's dataset readable here (on a machine without "
                        f"network, from the datasets cache with HF_DATASETS_OFFLINE=1), or the dataset paths of "
                        f"its task file in --task-dir.") from None


def run_tasks(model, tokenizer, tasks: list[str], manager, limit: int | None, seed: int, add_bos: bool,
              documents) -> dict:
    """simple_evaluate on the model over `tasks` of `manager` (task_manager's); returns the harness's
    results (per task, its metrics). add_bos: the run's data.add_bos; documents: document_start.documents_of."""
    lm = lm_class()(model=model, tokenizer=tokenizer, add_bos=add_bos, documents=documents)
    from lm_eval import simple_evaluate

    seed %= 2**32  # NumPy's seeds stop below 2**32; the recipe's seed may be any 64-bit number
    out = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, random_seed=seed,
                          numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                          log_samples=False)  # the harness's own bootstrap_iters: its standard errors too
    return {"results": out["results"], "versions": out.get("versions", {}), "n-shot": out.get("n-shot", {})}
