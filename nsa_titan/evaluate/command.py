"""`nsa-titan eval`: loss by context position on held-out data and a passkey probe, as JSON and plots.

    nsa-titan eval RECIPE.toml [overrides] --out DIR [options]   the run's newest checkpoint
    nsa-titan eval EXPORTED.pt|HF_DIR [data flags] --out DIR [options]   an exported model or hf folder
data flags: the recipe fields that choose the held-out text, over the recipe the export records (export_flags.py),
e.g. --data.text_files.paths=corpus/*.jsonl where the data is now (a relative path read from the current folder).
options: --batches N (global batches of held-out rows, default validation.steps), --lengths 100,200 (passkey prompt
lengths, default up to four, the longest max_seq_len less the answer), --depths 0,0.5,1 (default 0 to 1
by 0.25), --trials N (keys per cell, default 5; 0 skips the probe); --tasks a,b runs lm-evaluation-harness tasks too
(--task-dir DIR for your own task YAML files, --limit N documents per task). Writes eval.json, position_loss.png
and passkey.png (matplotlib; no passkey.png with --trials 0), and lm_eval.json with --tasks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex

from components.data import MIXTURE, holds_split, no_split_error
from components.errors import UserError, relative_paths_read_from
from nsa_titan import assemble, registry
from nsa_titan import held_out as held_out_set
from nsa_titan.command_options import (check_output, refuse_earlier_results, refuse_unknown_options, take_flag,
                                       take_option, write_results)
from nsa_titan.config import resolve
from nsa_titan.document_start import documents_of
from nsa_titan.evaluate.export_flags import empty_set_fix, held_out_note, more_held_out
from nsa_titan.evaluate.passkey import answer_tokens, passkey_accuracy, shortest_length, unwritable_keys
from nsa_titan.evaluate.plots import passkey_figure, position_loss_figure
from nsa_titan.evaluate.position_loss import loss_by_position
from nsa_titan.loss import IGNORE_INDEX
from nsa_titan.observe.plots import figure_writer, pyplot
from nsa_titan.observe.progress import progress

USAGE = ("`nsa-titan eval recipes/debug.toml --out outputs/debug/eval` (or an exported model file instead of the "
         "recipe, with data flags only)")
OPTIONS = "--out, --batches, --lengths, --depths, --trials, --tasks, --task-dir, --limit, --overwrite"
RESULT_FILES = ("eval.json", "position_loss.png", "passkey.png", "lm_eval.json")


def _numbers(argv: list[str], name: str, kind, default: str | None, one: bool = False, fix: str | None = None):
    """The comma-separated values of option `name` (None when absent); one: exactly one value; fix: what to do
    when the list cannot be read (default: e.g. the default)."""
    text = take_option(argv, name, default)
    if text is None:
        return None
    try:
        values = [kind(x) for x in text.split(",")]  # an empty entry ('0.5,,') is a mistake, not skipped
    except ValueError:
        if one:  # an option of one value: its example is one value too
            what = "a whole number" if kind is int else "a number"
            raise UserError(f"{name} = {text!r} is not {what}. Fix: e.g. {name}={default or 1}.") from None
        what = "whole numbers" if kind is int else "numbers"
        raise UserError(f"{name} = {text!r} is not a comma-separated list of {what}. Fix: "
                        f"{fix or f'e.g. {name}={default}'}.") from None
    if not values:
        raise UserError(f"{name} is empty. Fix: give at least one value.")
    if one and len(values) > 1:
        raise UserError(f"{name} = {text!r} gives {len(values)} values; it takes one. Fix: e.g. {name}={values[0]}.")
    return values


def _load(argv: list[str], before_model=None):
    """(model, tokenizer, recipe, what was loaded, the resolved recipe or None, an export's saved data settings
    without its data flags or None) from a recipe's checkpoint or an exported file (with its data flags);
    before_model(recipe, tokenizer) checks the options before the model is built."""
    from nsa_titan.evaluate.export_flags import refuse_other_flags
    from nsa_titan.export import load_checkpoint_model, load_exported_run
    from nsa_titan.rebuild import say_on_stderr
    from nsa_titan.run_folder import recipe_change_note, said_if_refused

    if argv and argv[0].endswith(".toml"):
        resolved = resolve(argv, world_size=None)
        note = recipe_change_note(resolved, "the recipe differs from the run's recipe.toml (eval reads the model, "
                                            "tokenizer and data fields)")
        with said_if_refused(note):
            model, tokenizer, step = load_checkpoint_model(resolved, say_on_stderr, before_model)
        if note:
            print(note)
        return (model, tokenizer, resolved.recipe, f"checkpoint step {step} of {resolved.recipe.job.dump_folder}",
                resolved, None)
    run = load_exported_run(argv[0], say=say_on_stderr, data_flags=argv[1:], before_model=before_model)
    refuse_other_flags(argv[1:])  # again: the export's plugins may have registered a tokenizer
    if run.missing_data is not None:  # eval reads the held-out set
        raise run.missing_data
    return run.model, run.tokenizer, run.recipe, f"{argv[0]} (step {run.meta['step']})", None, run.saved_data


def run_command(argv: list[str]) -> int:
    with relative_paths_read_from("the current folder"):  # eval is no run: its paths are read from where it starts
        return _evaluate(list(argv))


def _evaluate(argv: list[str]) -> int:
    depths_given = any(arg == "--depths" or arg.startswith("--depths=") for arg in argv)
    out = take_option(argv, "--out")
    if not out:
        raise UserError("eval needs --out DIR for its results. Fix: add --out DIR (e.g. --out eval) to the command.")
    check_output("--out", out, folder=True)
    overwrite = take_flag(argv, "--overwrite")
    batches = _numbers(argv, "--batches", int, None, one=True)
    # Which lengths fit is the model's and its tokenizer's to say, so the fix gives no numbers that may not.
    lengths = _numbers(argv, "--lengths", int, None, fix="give passkey prompt lengths in tokens that fit the model "
                       "(eval names its range when one does not), or leave --lengths out for up to four that do, the "
                       "longest what max_seq_len leaves the answer")
    depths = _numbers(argv, "--depths", float, "0,0.25,0.5,0.75,1")
    trials = _numbers(argv, "--trials", int, "5", one=True)[0]
    task_limit = _numbers(argv, "--limit", int, None, one=True)
    tasks = take_option(argv, "--tasks")
    task_dir = take_option(argv, "--task-dir")
    # What is left is the model: a recipe with its overrides, or an exported file alone.
    if argv and argv[0].endswith(".toml"):
        refuse_unknown_options(argv, "eval", OPTIONS + ", or recipe overrides --section.field=VALUE", overrides=True)
    else:
        from nsa_titan.config.overrides import parse_args
        from nsa_titan.evaluate.export_flags import refuse_other_flags

        refuse_unknown_options(argv, "eval", OPTIONS + ", or data flags --data.FIELD=VALUE", overrides=True)
        if not argv or argv[0].startswith("-") or parse_args(argv[1:], []).recipe is not None:
            raise UserError(f"eval takes one recipe (with overrides) or one exported model file (with data flags). "
                            f"Fix: {USAGE}.")
        refuse_other_flags(argv[1:])
    refuse_earlier_results(out, "eval", RESULT_FILES, overwrite)
    # not 0 <= nan: a nan depth is refused too; --limit 0 would mean "no limit" to the harness
    if any(not 0 <= d <= 1 for d in depths):
        raise UserError(f"--depths must lie in [0, 1], got {','.join(map(str, depths))}. Fix: e.g. --depths 0,0.5,1.")
    if trials < 0:
        raise UserError(f"--trials must be at least 0 (0 skips the passkey probe), got {trials}. Fix: e.g. --trials 1.")
    if trials == 0 and (lengths or depths_given):
        raise UserError("--lengths and --depths shape the passkey probe, which --trials 0 skips. Fix: drop them, "
                        "or give --trials 1 or more.")
    for name, given in (("--batches", batches), ("--limit", task_limit)):
        if given and given[0] < 1:
            raise UserError(f"{name} must be at least 1, got {given[0]}. Fix: e.g. {name} 1.")
    if task_dir and not os.path.isdir(task_dir):
        raise UserError(f"--task-dir {task_dir!r} is not a folder. Fix: give the folder holding your task YAML files.")
    if (task_dir or task_limit) and not tasks:
        raise UserError("--task-dir and --limit apply to lm-eval tasks. Fix: add --tasks NAME[,NAME...].")
    task_names = [t for t in (tasks or "").split(",") if t]
    manager = None
    if tasks:
        from nsa_titan.evaluate.harness import check_tasks_load, require_lm_eval, task_manager

        require_lm_eval()  # before the work, as are the task names and their data
        manager = task_manager(task_names, task_dir)
        check_tasks_load(task_names, manager)
    pyplot()  # fail before the work when matplotlib is missing
    def check_lengths(recipe, tokenizer) -> None:
        """The passkey lengths, the tokenizer's and the recipe's to check: refused before the weights are read. A
        model whose arguments name no max_seq_len cannot decode: check_decodes says so once it is built."""
        if hasattr(recipe.model.args, "max_seq_len"):
            _passkey_lengths(tokenizer, recipe, lengths)

    model, tokenizer, recipe, loaded, resolved, saved = _load(argv, check_lengths if trials else None)
    note = None if saved is None else held_out_note(saved, recipe.data)
    if note:  # said before the work, and kept in eval.json with the numbers
        from nsa_titan.rebuild import say_on_stderr

        say_on_stderr(f"note: {note}")
    if trials:
        _check_decodes(model)
        lengths = _passkey_lengths(tokenizer, recipe, lengths)

    documents = documents_of(registry.get("model", recipe.model.name), model)
    from nsa_titan.runtime import make_runtime

    runtime = make_runtime("cpu", "float32")
    # The run's held-out set (held_out.py): the rows its logged validation loss covers, or --batches of them.
    t = recipe.training
    rows = held_out_set.rows_per_batch(recipe) * (batches[0] if batches else recipe.validation.steps)
    held_out = None  # where the source holds out nothing
    try:
        source = assemble.build_source(recipe)
        if holds_split(source, "validation"):
            every_row = held_out_set.rank_rows(recipe, runtime, source, tokenizer, 0, 1, rows)
            held_out = list(held_out_set.held_out_batches(every_row, t.local_batch_size, t.seq_len, None))
    except UserError as exc:
        if argv[0].endswith(".toml"):
            raise
        # The data's own fix (the path, a data setting) names a recipe field, which eval of an export takes as a flag.
        example, why = _data_override_example(recipe.data, argv[0], out), str(exc).rstrip(".")
        if len(argv) > 1:
            raise UserError(f"the held-out data named by the recipe saved in {argv[0]!r} and the data flags given "
                            f"cannot be read here ({why}). Fix: give data flags that read it as it is here, e.g. "
                            f"{example}.") from None
        raise UserError(f"the held-out data named by the recipe saved in {argv[0]!r} cannot be read here ({why}). "
                        f"Fix: make the data readable where that recipe names it, or give the data settings that "
                        f"read it here as flags, e.g. {example}.") from None
    # An export's fixes are its data flags (export_flags.py); a recipe's, its fields.
    example = None if saved is None else _data_override_example(recipe.data, argv[0], out)
    if held_out is None:  # its way on is not training's: eval reads the set either way
        raise no_split_error(source, "validation", without=None,
                             instead=None if saved is None else more_held_out(saved, recipe.data, example))
    if not held_out:  # eval always reads the held-out set: the way out is the data its run validated on
        raise held_out_set.empty_set_error(
            recipe, rows, "evaluate with the data settings of the run's own recipe.toml (the set its validation loss "
            "was logged on)", empty_set_fix(saved, recipe.data, rows, example) if saved is not None
            else _own_data_empty_fix(resolved, recipe.data))
    _say_short_set(recipe, held_out, batches[0] if batches else None,
                   None if saved is None else more_held_out(saved, recipe.data, example))
    positions = loss_by_position(model, documents, held_out, recipe.training.seq_len, progress("held-out loss"),
                                 tokenizer.eos_id, tokenizer.bos_id if recipe.data.add_bos else None)

    from components.models import generate

    passkey = None
    if trials:
        passkey = passkey_accuracy(model, tokenizer, generate, lengths, depths, trials, recipe.job.seed,
                                   progress("passkey"), recipe.data.add_bos)

    harness = None
    if tasks:
        from nsa_titan.evaluate.harness import run_tasks

        harness = run_tasks(model, tokenizer, task_names, manager, task_limit[0] if task_limit else None,
                            recipe.job.seed, recipe.data.add_bos, documents)

    # What was read, so numbers over other data (a data flag, an override) are not taken for the run's own.
    results = {"model": loaded, "overrides": argv[1:], "data": _data_read(recipe.data, note),
               "position_loss": positions, "passkey": passkey}
    paths = {"results": os.path.join(out, "eval.json"), "position_loss": os.path.join(out, "position_loss.png")}
    if passkey is not None:
        paths["passkey"] = os.path.join(out, "passkey.png")
    if harness is not None:
        paths["lm_eval"] = os.path.join(out, "lm_eval.json")
    _write_results(out, paths, results, harness, loaded, overwrite)
    if passkey is None:
        probe = "no passkey probe (--trials 0)"
    else:
        mean_accuracy = sum(map(sum, passkey["accuracy"])) / (len(lengths) * len(depths))
        probe = (f"passkey accuracy {mean_accuracy:.0%} over {len(lengths)} lengths x {len(depths)} depths x "
                 f"{trials} keys")
    print(f"evaluated {loaded}: {context_bands(positions)}; {probe}: " + ", ".join(paths.values()))
    if harness is not None:  # the numbers asked for, not only the file that holds them
        print(f"lm-eval: {task_metrics(harness['results'])}")
    if resolved is not None:
        from nsa_titan.rebuild import HELD_OUT_READS, say_unread_flags

        # --batches says how many held-out batches instead of validation.steps
        say_unread_flags(resolved, "eval",
                         tuple(r for r in HELD_OUT_READS if not (batches and r == "validation.steps")))
    return 0


def task_metrics(results: dict) -> str:
    """The harness's results per task, its metrics without their standard errors: 'task: acc 0.667; ...'. A
    metric is keyed 'NAME,FILTER' (the filter shown unless it is the harness's 'none')."""
    tasks = []
    for task, metrics in sorted(results.items()):
        shown = []
        for key, value in metrics.items():
            name, comma, kind = key.partition(",")
            if comma and "_stderr" not in name and isinstance(value, (int, float)) and not isinstance(value, bool):
                shown.append(f"{name}{'' if kind == 'none' else f' ({kind})'} {value:.4g}")
        tasks.append(f"{task}: {', '.join(shown) or 'no metric'}")
    return "; ".join(tasks)


def _data_override_example(data, model: str, out: str) -> str:
    """An eval of the exported `model` with a data flag it takes: a mixture's data is in its members' tables."""
    model, out = shlex.quote(model), shlex.quote(out)
    if data.source == MIXTURE:
        return (f"`nsa-titan eval {model} --data.mixture.sources.NAME.FIELD=... --out {out}`, NAME the member "
                f"to change ({', '.join(data.source_args.sources)})")
    flag = "--data.source=..." if data.source_args is None else f"--data.{data.source}.FIELD=..."
    return f"`nsa-titan eval {model} {flag} --out {out}`"


def _say_short_set(recipe, held_out: list[dict], batches: int | None, more: str | None) -> None:
    """A held-out set its shards cannot fill gives the numbers of fewer rows than asked for: said, as training
    says it, so results of sets of other sizes are not compared unawares; more: the way to more held-out documents
    (training's by default)."""
    from nsa_titan.rebuild import say_on_stderr

    found = sum(int((batch["target"] != IGNORE_INDEX).sum()) for batch in held_out)
    asked = "--batches" if batches is not None else "validation.steps (eval's default --batches)"
    note = held_out_set.short_set_note(recipe, found, batches, asked, "--batches", more or held_out_set.MORE_HELD_OUT)
    if note:
        say_on_stderr(f"note: {note}")


def _check_decodes(model) -> None:
    """The passkey probe decodes: a model that cannot is refused before any work."""
    from components.models.generate import check_decodes

    try:
        check_decodes(model)
    except UserError as exc:  # the held-out loss needs no decoding: eval still runs without the probe
        raise UserError(f"{exc}. Or add --trials 0: eval then skips the passkey probe, the one part that "
                        f"decodes.") from None


def _passkey_lengths(tokenizer, recipe, lengths: list[int] | None) -> list[int]:
    """The passkey prompt lengths to probe (given, or up to four up to max_seq_len), checked before any work."""
    read = unwritable_keys(tokenizer)
    if read is not None:
        raise UserError(f"tokenizer {tokenizer.name!r} cannot write a passkey: it reads the digits ' 0123456789' as "
                        f"{read!r}, so every trial would fail whatever the model reads of its context. Fix: add "
                        f"--trials 0 to skip the passkey probe, or evaluate a model whose tokenizer has the digits.")
    max_seq_len = recipe.model.args.max_seq_len
    limit = max_seq_len - answer_tokens(tokenizer)
    shortest = shortest_length(tokenizer, recipe.data.add_bos)
    if shortest > limit:
        raise UserError(f"the passkey prompt needs {shortest} tokens, more than max_seq_len {max_seq_len} leaves. "
                        f"Fix: add --trials 0 to skip the passkey probe, or evaluate a model with a longer "
                        f"max_seq_len.")
    lengths = lengths or sorted({max(limit // k, shortest) for k in (8, 4, 2, 1)})
    if max(lengths) > limit or min(lengths) < shortest:
        raise UserError(f"--lengths must lie in {shortest}..{limit} (the needle and question take {shortest} tokens; "
                        f"the answer needs room within max_seq_len {max_seq_len}). Fix: e.g. "
                        f"--lengths {shortest},{limit}.")
    return lengths


def _own_data_empty_fix(resolved, data) -> str | None:
    """The fix of an empty held-out set read with the run's own data settings (no data field differs from its
    recipe.toml): not those settings, which are these; None where the data differs (the default fix names them)."""
    from nsa_titan.run_folder import recipe_changes

    changes = recipe_changes(resolved.recipe.job.dump_folder, resolved, limit=1_000_000)
    if any(change.startswith("data.") for change in changes):
        return None
    fewer = ", or a lower --data.min_document_tokens" if data.min_document_tokens else ""
    return (f"these are the run's own data settings, which hold out no document for these rows (a larger "
            f"validation_fraction would score documents the model trained on): give data flags that read text it did "
            f"not train on, e.g. another --data.source or other files in its table (--data.{data.source}.FIELD=...)"
            f"{fewer}")


def context_bands(positions: dict, share: float = 0.1) -> str:
    """The loss with the shortest and the longest contexts, each over a band of positions (the first and the
    last tenth of those seen), weighted by tokens: a single position at the far end may hold one token."""
    seen = list(zip(positions["positions"], positions["mean_loss"], positions["tokens"]))
    if not seen:
        return "no held-out token was scored"
    longest = seen[-1][0]
    width = max(1, round(share * longest))

    def band(rows) -> str:
        tokens = sum(n for _, _, n in rows)
        loss = sum(value * n for _, value, n in rows) / tokens
        return f"{loss:.3f} with {rows[0][0]}-{rows[-1][0]} tokens of context ({tokens:,} tokens)"

    near = [row for row in seen if row[0] <= width]
    far = [row for row in seen if row[0] > longest - width]
    return f"loss {band(near)}, {band(far)}"


def _data_read(data, note: str | None) -> dict:
    """The held-out data's source and its settings as eval read them: an export's own relative paths as read from
    where it was made, a flag's as given (read from the folder eval ran in); note: why the set holds documents the
    model trained on (export_flags.held_out_note), or None."""
    args = data.source_args
    return {"source": data.source, data.source: dataclasses.asdict(args) if dataclasses.is_dataclass(args) else args,
            # these choose which held-out documents and rows are read too
            "min_document_tokens": data.min_document_tokens, "logical_shards": data.logical_shards, "note": note}


def _write_results(out: str, paths: dict[str, str], results: dict, harness: dict | None, loaded: str,
                   overwrite: bool) -> None:
    def write_json(value: dict):
        def write(path: str) -> None:
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(value, fh, indent=1, default=str)
                fh.write("\n")
        return write

    writers = {paths["results"]: write_json(results),
               paths["position_loss"]: figure_writer(lambda: position_loss_figure(results["position_loss"], loaded))}
    if "passkey" in paths:
        writers[paths["passkey"]] = figure_writer(lambda: passkey_figure(results["passkey"], loaded))
    if harness is not None:
        writers[paths["lm_eval"]] = write_json({"model": loaded, **harness})
    write_results(out, "eval", RESULT_FILES, overwrite, writers)
