"""Plugins that get a part's contract wrong: each mistake is one message naming the part, where it failed
and what its kind's builder is called with, with exit 2 and no traceback; a plugin may replace a built-in."""

from __future__ import annotations

import re
import sys

import pytest

from nsa_titan import cli, registry
from tests.registry_state import registry_restored
from tests.launch import DEBUG, TINY

PLUGIN = '''
from dataclasses import dataclass, field

import torch
from torch import nn

from nsa_titan.registry import register


@dataclass
class Args:
    hidden: int = field(default=8, metadata={"doc": "width"})


class Bigram(nn.Module):
    def __init__(self, args, vocab_size):
        super().__init__()
        self.embed, self.out = nn.Embedding(vocab_size, args.hidden), nn.Linear(args.hidden, vocab_size)

    def forward(self, tokens, **kwargs):
        return self.out(self.embed(tokens))


class NoInit(Bigram):
    pass


class Plain(Bigram):
    """Trains and exports; has no decoding path."""

    def init_weights(self):
        self.embed.reset_parameters()
        self.out.reset_parameters()


class Short(Plain):
    def forward(self, tokens, **kwargs):
        return super().forward(tokens)[:, :-1]


def broken(args, vocab_size):
    return {}["no such key"]


register("model", "no_init", NoInit, args=Args)
register("model", "one_argument", lambda args: Bigram(args, 258), args=Args)
register("model", "broken", broken, args=Args)
register("model", "short", Short, args=Args)
register("model", "plain", Plain, args=Args)
register("model", "flops_of_args", Plain, args=Args, flops_per_token=lambda args: 1.0)
register("model", "no_plan", Plain, args=Args, parallel_plan=lambda model: None)
register("optimizer", "no_betas", lambda model, lr: torch.optim.SGD(model.parameters(), lr=lr))
register("optimizer", "not_one", lambda model, **kw: object())
register("optimizer", "first_only", lambda model, lr, **kw: torch.optim.SGD(list(model.parameters())[:1], lr=lr))
class NoArgs:
    def __init__(self, args):
        pass


register("data_source", "no_args", NoArgs)
register("tokenizer", "no_args", NoArgs)
register("data_source", "a_list", lambda args: ["hello"] * 50, args=Args)


class FailsMidway:
    def check(self):
        pass

    def fingerprint(self):
        return "fails_midway"

    def documents(self, shard, num_shards, split, seed, epoch, cursor):
        yield "hi", 0  # shorter than a row: the next document is read
        raise KeyError("row 1 has no text")


register("data_source", "fails_midway", FailsMidway)


class ExitsMidway(FailsMidway):
    def documents(self, shard, num_shards, split, seed, epoch, cursor):
        yield "hi", 0
        exit(0)


register("data_source", "exits_midway", ExitsMidway)


class Picky:
    name, vocab_size, bos_id, eos_id = "picky", 258, 256, 257

    def encode(self, text):
        raise ValueError("cannot encode this")

    def decode(self, ids):
        return ""


register("tokenizer", "picky", Picky)
register("optimizer", "adamw", lambda model, **kw: torch.optim.SGD(model.parameters(), lr=kw["lr"]), replace=True)
register("lr_schedule", "rising", lambda progress: 1 + 4 * progress)
register("lr_schedule", "nan", lambda progress: float("nan"))
register("lr_schedule", "stable", lambda progress: 1.0)
register("lr_schedule", "half_way", lambda progress: 1 - progress if progress < 0.5 else 1 / 0)
register("lr_schedule", "straight", lambda progress: 1 - progress)
register("lr_schedule", "text", lambda progress: str(1 - progress))
register("lr_schedule", "tensor", lambda progress: torch.tensor(1 - progress))
register("lr_schedule", "boolean", lambda progress: progress < 1)
register("model", "exits", lambda args, vocab_size: exit(0), args=Args)
'''
BROKEN_LINE = PLUGIN.splitlines().index('    return {}["no such key"]') + 1
FAILING_LINE = PLUGIN.splitlines().index('        raise KeyError("row 1 has no text")') + 1
EXITS_LINE = PLUGIN.splitlines().index('register("model", "exits", lambda args, vocab_size: exit(0), args=Args)') + 1
PICKY_LINE = PLUGIN.splitlines().index('        raise ValueError("cannot encode this")') + 1
RECIPE = """
[model]
name = "no_init"
[training]
steps = 1
seq_len = 64
local_batch_size = 2
"""


@pytest.fixture
def plugin(tmp_path):
    """(recipe, plugin file) written for this test; the registry as it was afterwards."""
    path = tmp_path / "contract_plugin.py"
    path.write_text(PLUGIN)
    recipe = tmp_path / "bigram.toml"
    recipe.write_text(RECIPE)
    with registry_restored():
        yield str(recipe), str(path)


def _refused(capsys, argv: list[str], *fragments: str) -> str:
    code = cli.main(["train", *argv])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("error:") == 1, err
    for fragment in fragments:
        assert fragment in err, err
    return err


@pytest.mark.parametrize("flags, fragments", [
    (["--model.name=no_init"], ["model 'no_init' (a plugin's) built a NoInit without init_weights. Fix: model "
                                "builders are called as build(args, vocab_size) -> a torch.nn.Module with "
                                "init_weights()"]),
    (["--model.name=one_argument"], ["model 'one_argument' (a plugin's) failed to build: TypeError:",
                                     "(in the call: its parameters)"]),
    (["--model.name=broken"], ["model 'broken' (a plugin's) failed to build: KeyError: 'no such key' (",
                               f"contract_plugin.py, line {BROKEN_LINE})"]),
    (["--model.name=short"], ["the model returned logits of shape [2, 63, 258] for targets of shape [2, 64]"]),
    # A hook called with other arguments than it declares, or returning another record: tracebacks from the engine.
    (["--model.name=flops_of_args"],
     ["model 'flops_of_args' (a plugin's): its flops_per_token hook failed: TypeError: <lambda>() takes 1 positional "
      "argument but 3 were given (in the call: its parameters). Fix: components/model_hooks.py says how each hook"]),
    # A builder that ends the process: the command ended, status 0, nothing said.
    (["--model.name=exits"], ["model 'exits' (a plugin's) failed to build: called sys.exit(0) (",
                              f"contract_plugin.py, line {EXITS_LINE})"]),
    (["--model.name=no_plan"], ["model 'no_plan' (a plugin's): its parallel_plan hook returned a NoneType, not the "
                                "ParallelPlan the engine reads. Fix: components/model_hooks.py"]),
    (["--model.name=short", "--optimizer.name=no_betas"],
     ["optimizer 'no_betas' (a plugin's) failed to build: TypeError:", "Fix: optimizer builders registered "
      "without args= are called as build(model, lr=, betas=, eps=, weight_decay=) -> a torch.optim.Optimizer"]),
    # Was a traceback of the LR scheduler; then a run that never updated the parameters left out, exit 0.
    (["--model.name=plain", "--optimizer.name=not_one"],
     ["optimizer 'not_one' (a plugin's) built 'object', not a torch.optim.Optimizer. Fix: optimizer builders "
      "registered without args= are called as build(model, lr="]),
    (["--model.name=plain", "--optimizer.name=first_only"],
     ["optimizer 'first_only' (a plugin's) holds 1 of the model's 3 parameters that require grad: out.weight, "
      "out.bias are in none of its param groups, so training would never update them. Fix: give it "
      "model.parameters()"]),
    # Built with no arguments, it was told it is called as build(args).
    (["--model.name=short", "--data.source=no_args"],
     ["data_source 'no_args' (a plugin's) failed to build: TypeError: NoArgs.__init__() missing 1 required "
      "positional argument: 'args' (in the call: its parameters). Fix: data_source builders registered without "
      "args= are called as build() -> a source with check(), fingerprint() and documents("]),
    (["--model.name=short", "--data.tokenizer=no_args"],
     ["Fix: tokenizer builders registered without args= are called as build() -> a tokenizer with name,"]),
    (["--model.name=short", "--data.source=a_list"],
     ["Fix: data_source builders registered with args= are called as build(args) -> a source with"]),
    (["--model.name=short", "--data.source=a_list"],
     ["data_source 'a_list' (a plugin's) built a list without check, fingerprint, documents"]),
    # An error raised while it reads: a traceback from the loader.
    (["--model.name=plain", "--data.source=fails_midway"],
     ["the data source (FailsMidway) failed reading logical shard 0 (train split, epoch 0): KeyError: 'row 1 has no "
      "text' (", f"contract_plugin.py, line {FAILING_LINE}). Fix: mend the data it reads, or the source there"]),
    (["--model.name=plain", "--data.source=exits_midway"],
     ["the data source (ExitsMidway) failed reading logical shard 0 (train split, epoch 0): called sys.exit(0) ("]),
    (["--model.name=plain", "--data.tokenizer=picky"],
     ["the tokenizer (Picky) failed encoding a document: ValueError: cannot encode this (",
      f"contract_plugin.py, line {PICKY_LINE}). Fix: mend the tokenizer there, or the data it cannot encode"]),
    # A schedule is tried over its range when the recipe is checked: a factor beyond the peak or not finite would train.
    (["--model.name=plain", "--lr_scheduler.decay_type=rising"],
     ["lr_scheduler.decay_type = 'rising': names a plugin's shape that gives 1.04 at progress 0.01, where the "
      "contract asks for a factor in [0, 1]. Fix: lr_schedule shapes are called as shape(progress)"]),
    (["--model.name=plain", "--lr_scheduler.decay_type=nan"],
     ["names a plugin's shape that gives nan at progress 0, where the contract asks for 1."]),
    (["--model.name=plain", "--lr_scheduler.decay_type=stable"],
     ["names a plugin's shape that gives 1.0 at progress 1, where the contract asks for 0."]),
    (["--model.name=plain", "--lr_scheduler.decay_type=half_way"],
     ["names a plugin's shape that fails at progress 0.5: ZeroDivisionError: division by zero. Fix:"]),
    # float() read these as factors, and the run failed at its first decaying step.
    (["--model.name=plain", "--lr_scheduler.decay_type=text"],
     ["names a plugin's shape that gives '1.0' (str) at progress 0, where the contract asks for a real number"]),
    (["--model.name=plain", "--lr_scheduler.decay_type=tensor"],
     ["names a plugin's shape that gives tensor(1.) (Tensor) at progress 0, where the contract asks for a real"]),
    (["--model.name=plain", "--lr_scheduler.decay_type=boolean"],
     ["names a plugin's shape that gives True (bool) at progress 0, where the contract asks for a real number"]),
])
def test_a_part_that_breaks_its_contract_is_one_message(plugin, tmp_path, capsys, flags, fragments):
    recipe, path = plugin
    _refused(capsys, [recipe, f"--job.plugins={path}", "--training.device=cpu", "--data.logical_shards=4", *flags,
                      f"--job.dump_folder={tmp_path / 'run'}"], *fragments)


def test_a_plugin_replaces_a_built_in_part(plugin, tmp_path, capsys):
    """Built-in parts are registered before the plugin's, so replace=True replaces AdamW (SGD has no state)."""
    import torch

    from nsa_titan import assemble

    recipe, path = plugin
    from nsa_titan.config import resolve

    resolved = resolve([recipe, f"--job.plugins={path}", "--model.name=short"])
    model = assemble.build_model_on_meta(resolved.recipe, 258)
    assert type(assemble.build_optimizer(resolved.recipe, model.to_empty(device="cpu"))) is torch.optim.SGD


def test_a_plugin_that_fails_while_imported_is_named_at_its_line(tmp_path, capsys):
    """Not 'give an importable module name': the module was found, and its own line raised."""
    path = tmp_path / "clashing.py"
    path.write_text("from nsa_titan.registry import register\n\nregister('optimizer', 'adamw', print)\n")
    err = _refused(capsys, ["--job.plugins=" + str(path), *TINY, f"--job.dump_folder={tmp_path / 'run'}"],
                   f"raised ValueError while it was imported ({path}, line 3): optimizer 'adamw' is already "
                   "registered; pass replace=True to override it. Fix: mend the plugin there")
    assert "importable module name" not in err


@pytest.mark.parametrize("script, line, code", [
    ("import sys\n\nsys.exit(0)\n", 3, 0),
    # A script's command line read as it is imported: argparse says the run's flags are not its own, then exits.
    ("import argparse\n\nparser = argparse.ArgumentParser()\nparser.parse_args()\n", 4, 2),
])
def test_a_script_that_exits_while_imported_as_a_plugin_is_one_message(tmp_path, capsys, monkeypatch, script, line,
                                                                        code):
    """The command ended in silence with the script's status (0: as if it had trained)."""
    path = tmp_path / "script.py"
    path.write_text(script)
    argv = ["train", "--job.plugins=" + str(path), *TINY, f"--job.dump_folder={tmp_path / 'run'}"]
    monkeypatch.setattr(sys, "argv", ["nsa-titan", *argv])  # what the script's argparse reads
    assert cli.main(argv) == 2
    err = capsys.readouterr().err  # argparse's own usage and error line come first
    assert "Traceback" not in err and err.count("error: the recipe has 1 problem") == 1, err
    assert (f"job.plugins = '{path}': called sys.exit({code}) while it was imported ({path}, line {line}). Fix: a "
            "plugin is imported to register parts, not run: put the script's own work under `if __name__ == ") in err
    assert not (tmp_path / "run").exists()


def test_a_missing_plugin_file_names_the_directory_it_was_looked_for_in(tmp_path, monkeypatch, capsys):
    """Relative to where the run starts, as data paths are, not to the recipe's folder: the message said only
    'no file parts.py'."""
    monkeypatch.chdir(tmp_path)
    _refused(capsys, ["--job.plugins=parts.py", *TINY, f"--job.dump_folder={tmp_path / 'run'}"],
             f"job.plugins = 'parts.py': could not be imported (ModuleNotFoundError: no file parts.py (relative to "
             f"the directory the run starts in, {tmp_path})). Fix: give an importable module name")


@pytest.mark.parametrize("kind, args, message", [
    ("model", type("NotADataclass", (), {}), "model 'x': args must be a dataclass type"),
    ("lr_schedule", None, "lr_schedule 'x': a lr_schedule takes no args"),
])
def test_register_refuses_arguments_nothing_would_read(kind, args, message):
    import dataclasses

    args = args or dataclasses.make_dataclass("Some", [("a", int, dataclasses.field(default=1))])
    with pytest.raises(ValueError, match=message):
        registry.register(kind, "x", lambda *a: None, args=args)
    assert "x" not in registry.available(kind)


@pytest.mark.parametrize("kind, hooks, message", [
    # was Part's "__init__() got an unexpected keyword argument 'parallel_plans'"
    ("model", {"parallel_plans": print}, "model 'x': 'parallel_plans' is not a model hook (did you mean "
                                         "'parallel_plan'?); the hooks are flops_per_token, telemetry,"),
    # was kept, and never called
    ("lr_schedule", {"describe": print}, "lr_schedule 'x': hooks (describe) are for models; nothing calls them"),
])
def test_register_refuses_hooks_nothing_would_call(kind, hooks, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        registry.register(kind, "x", lambda *a: None, **hooks)
    assert "x" not in registry.available(kind)


def test_sample_and_eval_of_a_model_that_cannot_decode_say_so(plugin, tmp_path, capsys):
    """Training and export of a model without the transformer's decoding path work; sample and eval (its
    passkey probe) decode, so they refuse it in one message instead of failing inside generation."""
    recipe, path = plugin
    run = [recipe, f"--job.plugins={path}", "--model.name=plain", "--training.device=cpu", "--data.logical_shards=4",
           "--checkpoint.enable=true", f"--job.dump_folder={tmp_path / 'run'}"]
    assert cli.main(["train", *run]) == 0
    exported = str(tmp_path / "plain.pt")
    assert cli.main(["export", *run, "--output", exported]) == 0
    capsys.readouterr()
    for argv in (["sample", exported, "--max-new-tokens", "4"], ["eval", *run, "--out", str(tmp_path / "eval")]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "Plain cannot generate text: decoding needs the model's new_kv_cache, " \
               "forward_step, args.max_seq_len" in err, err
        # eval's way round it: the probe is the one part that decodes
        assert ("Or add --trials 0" in err) == (argv[0] == "eval"), err
    assert cli.main(["eval", exported, "--out", str(tmp_path / "eval"), "--trials", "0", "--batches", "1"]) == 0


def test_switching_the_model_leaves_the_other_models_arguments_named_as_its(plugin, tmp_path, capsys):
    """debug.toml's [model] holds the transformer's arguments; --model.name=plain (a plugin's) makes them
    another model's arguments, said so, not 'is not a recipe field'."""
    _, path = plugin

    err = _refused(capsys, [DEBUG, f"--job.plugins={path}", "--model.name=plain", "--print-config"],
                   "model.dim: is an argument of 'transformer', but model.name = 'plain' (from flag "
                   "'--model.name=plain'). Fix: remove it from", "or choose 'transformer' again")
    assert "is not a recipe field" not in err


def test_a_plugin_schedule_that_keeps_its_contract_trains_as_the_built_in_one(plugin, tmp_path, capsys):
    import json

    recipe, path = plugin
    lrs = {}
    for shape in ("straight", "linear"):
        folder = tmp_path / shape
        assert cli.main(["train", recipe, f"--job.plugins={path}", "--model.name=plain", "--training.device=cpu",
                         "--data.logical_shards=4", "--training.steps=4", "--lr_scheduler.warmup_steps=1",
                         f"--lr_scheduler.decay_type={shape}", "--metrics.log_freq=1",
                         f"--job.dump_folder={folder}"]) == 0
        with open(folder / "metrics.jsonl", encoding="utf-8") as fh:
            lrs[shape] = [record["lr"] for record in map(json.loads, fh) if "lr" in record]
    assert len(lrs["linear"]) == 4 and lrs["straight"] == lrs["linear"]


class _Widget:
    pass


@pytest.mark.parametrize("declared, default, message", [
    ("typing.Optional[int]", None, "argument Args.maybe has type Optional[int], which no recipe field can hold"),
    ("dict[str, int]", {}, "argument Args.maybe has type dict[str, int], which no recipe field can hold"),
    ("tuple[int, int]", (1, 2), "argument Args.maybe has type tuple[int, int], which no recipe field can hold"),
    ("_Widget", _Widget(), "argument Args.maybe has type _Widget, which no recipe field can hold"),
    ("int", None, "argument Args.maybe (int) has the default None, which a recipe cannot hold"),
    ("str", _Widget(), "argument Args.maybe (str) has the default <"),
    ("float", float("nan"), "argument Args.maybe (float) has the default nan"),
    ("list[int]", (1, 2), "argument Args.maybe (list[int]) has the default (1, 2)"),
])
def test_register_refuses_a_field_the_recipe_cannot_hold(declared, default, message):
    """Accepted, such a field failed every command later: --help and --print-config with a traceback from the
    TOML writer (a None default), or a recipe value with 'report this field's declaration as a bug'."""
    import dataclasses
    import typing

    tp = eval(declared, {"typing": typing, "_Widget": _Widget})
    made = dataclasses.field(default_factory=lambda: default, metadata={"doc": "maybe"})
    args = dataclasses.make_dataclass("Args", [("maybe", tp, made)])
    with pytest.raises(ValueError) as refused:
        registry.register("optimizer", "holds_nothing", lambda model, **kw: None, args=args)
    assert f"optimizer 'holds_nothing': {message}" in str(refused.value)
    if "has type" in message:  # the types a field may have, said
        assert "bool, int, float, str, list[bool | int | float | str]" in str(refused.value)
    assert "holds_nothing" not in registry.available("optimizer")


def test_a_plugin_with_a_field_the_recipe_cannot_hold_is_one_message_at_its_import(tmp_path, capsys):
    path = tmp_path / "optional_plugin.py"
    path.write_text("from dataclasses import dataclass, field\nfrom typing import Optional\n\n"
                    "from nsa_titan.registry import register\n\n\n@dataclass\nclass Args:\n"
                    "    maybe: Optional[int] = field(default=None, metadata={'doc': 'maybe'})\n\n\n"
                    "register('optimizer', 'optional', lambda model, **kw: None, args=Args)\n")
    _refused(capsys, ["--job.plugins=" + str(path), *TINY, "--print-config"],
             f"raised ValueError while it was imported ({path}, line 12): optimizer 'optional': argument "
             "Args.maybe has type Optional[int], which no recipe field can hold")
    assert cli.main(["train", "--job.plugins=" + str(path), "--help"]) == 0  # was a traceback of the TOML writer
    assert "Traceback" not in capsys.readouterr().err


CHECKS_PLUGIN = '''
from dataclasses import dataclass, field

import torch

from components.problems import problem
from nsa_titan.registry import register


def sgd(model, lr, args, **kw):
    return torch.optim.SGD(model.parameters(), lr=lr)


def args_saying(check=None, notes=None):
    @dataclass
    class Args:
        k: int = field(default=1, metadata={"doc": "k"})

    if check is not None:
        Args.check = lambda self: check()
    if notes is not None:
        Args.notes = lambda self: notes()
    return Args


register("optimizer", "texts", sgd, args=args_saying(check=lambda: ["k is bad"]))
register("optimizer", "true", sgd, args=args_saying(check=lambda: True))
register("optimizer", "raises", sgd, args=args_saying(check=lambda: 1 / 0))
register("optimizer", "one_problem", sgd, args=args_saying(check=lambda: problem("k", 1, "is one", "make it two")))
register("optimizer", "one_note", sgd, args=args_saying(notes=lambda: "k is notable"))
register("optimizer", "yielded", sgd, args=args_saying(notes=lambda: (f"k is note {i}" for i in (1, 2))))
register("optimizer", "numbers", sgd, args=args_saying(notes=lambda: [3]))
register("optimizer", "two_lines", sgd, args=args_saying(notes=lambda: ["k is notable\\nover two lines"]))
'''


@pytest.fixture
def checks_plugin(tmp_path):
    """CHECKS_PLUGIN's file; the registry as it was afterwards."""
    path = tmp_path / "checks_plugin.py"
    path.write_text(CHECKS_PLUGIN)
    with registry_restored():
        yield str(path)


@pytest.mark.parametrize("name, fragment", [
    ("texts", "optimizer 'texts' (a plugin's): optimizer.texts: Args.check() gave 'k is bad' (str), not a Problem. "
              "Fix: Args.check() must return a list of Problems (components.problems.problem(field, value, why, "
              "fix)), empty when none."),
    ("true", "optimizer 'true' (a plugin's): optimizer.true: Args.check() gave True (bool). Fix: Args.check() "
             "must return a list of Problems"),
    ("raises", "optimizer 'raises' (a plugin's): optimizer.raises: Args.check() raised ZeroDivisionError: division "
               "by zero. Fix:"),
    ("numbers", "optimizer 'numbers' (a plugin's): optimizer.numbers: Args.notes() gave 3 (int), not a text. Fix: "
                "Args.notes() must return a list of texts, one per note (one text is one note)."),
    # A lone Problem is a list of one: the recipe's own problem, not the contract's.
    ("one_problem", "optimizer.one_problem.k = 1: is one. Fix: make it two."),
])
def test_a_check_or_notes_that_breaks_its_contract_is_one_message_naming_the_part(checks_plugin, capsys, name,
                                                                                  fragment):
    """Was an AttributeError traceback ('str' object has no attribute 'under') for a check() giving texts."""
    _refused(capsys, [f"--job.plugins={checks_plugin}", *TINY, f"--optimizer.name={name}", "--print-config"], fragment)


def test_notes_written_with_yield_are_each_a_note(checks_plugin, capsys):
    """A generator is a list's items, as it was before the contract was checked."""
    argv = [DEBUG, f"--job.plugins={checks_plugin}", *TINY, "--optimizer.name=yielded", "--print-config"]
    assert cli.main(["train", *argv]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "# note: optimizer.yielded.k is note 1\n" in out and "# note: optimizer.yielded.k is note 2\n" in out, out


def test_one_text_from_notes_is_one_note(checks_plugin, capsys):
    """Was one note per character."""
    argv = [DEBUG, f"--job.plugins={checks_plugin}", *TINY, "--optimizer.name=one_note", "--print-config"]
    assert cli.main(["train", *argv]) == 0
    out = capsys.readouterr().out
    assert "# note: optimizer.one_note.k is notable\n" in out and "# note: optimizer.one_note.k\n" not in out, out


def test_a_note_of_two_lines_leaves_the_printed_recipe_readable(checks_plugin, capsys):
    """Its second line was no comment: the launcher's read of --print-config's recipe was a TOML traceback."""
    from nsa_titan.config.toml_io import tomllib

    argv = [DEBUG, f"--job.plugins={checks_plugin}", *TINY, "--optimizer.name=two_lines", "--print-config"]
    assert cli.main(["train", *argv]) == 0
    out = capsys.readouterr().out
    assert "# note: optimizer.two_lines.k is notable\n#   over two lines\n" in out, out
    assert tomllib.loads(out)["optimizer"]["name"] == "two_lines"


@pytest.mark.parametrize("module", ["json", "sys"])
def test_a_plugin_file_named_as_an_installed_module_is_refused_before_it_replaces_it(tmp_path, capsys, module):
    """A plugin datasets.py was imported as module 'datasets', in place of the library, which then failed far away
    ("module 'datasets' has no attribute 'config'")."""
    import sys

    path = tmp_path / f"{module}.py"
    path.write_text("from nsa_titan.registry import register\n\n"
                    "register('lr_schedule', 'shadowing', lambda p: 1 - p)\n")
    before = sys.modules[module]
    _refused(capsys, [f"--job.plugins={path}", *TINY, "--print-config"],
             f"job.plugins = '{path}': would be imported as module '{module}', which names ",
             f" already, and would replace it for every later import of '{module}'. Fix: rename the file "
             f"(e.g. {module}_plugin.py).")
    assert sys.modules[module] is before and "shadowing" not in registry.available("lr_schedule")


def test_a_plugin_file_named_as_a_plain_folder_is_imported(tmp_path, capsys, monkeypatch):
    """A folder without __init__.py (a corpus's data/) is importable as a namespace package, which a module file
    of its name comes before: a plugin data.py was refused as replacing 'a built-in module'."""
    (tmp_path / "data").mkdir()
    (tmp_path / "plugins").mkdir()
    path = tmp_path / "plugins" / "data.py"
    path.write_text("from nsa_titan.registry import register\n\nregister('lr_schedule', 'from_data', lambda p: 1 - p)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with registry_restored():
        code = cli.main(["train", DEBUG, f"--job.plugins={path}", *TINY, "--lr_scheduler.decay_type=from_data",
                         "--print-config"])
        assert code == 0, capsys.readouterr().err
