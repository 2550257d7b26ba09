"""`nsa-titan`: the command line. Bad input ends in one clear message and exit code 2, never a traceback."""

from __future__ import annotations

import math
import os
import shlex
import sys
import warnings

try:
    if __name__ == "__main__":  # first thing: the launcher is still this process's parent
        from nsa_titan.start_up import prepare_process

        prepare_process()
    from components.errors import UserError
    from components.problems import suggest
    from nsa_titan.command_options import (check_output, refuse_earlier_results, refuse_unknown_options, take_flag,
                                           take_option)
    from nsa_titan.checkout_hints import no_recipe, shipped_recipes
    from nsa_titan.config import RecipeError, resolve
    from nsa_titan.full_disk import full_disk_message, space_error
    from nsa_titan.start_up import (INTERRUPTED, StoppedWhileStarting, answer_stops_after_the_run,
                                    hear_stops_while_starting, stop_hearing_stops_while_starting,
                                    stopped_while_starting_message)
except BaseException as exc:  # a Ctrl-C, or a stop signal (start_up.StoppedWhileStarting), while importing
    if __name__ != "__main__":  # imported by a program (or the console script, which says so itself)
        raise
    from nsa_titan.start_up import StoppedWhileStarting, say_interrupted_while_starting

    if not isinstance(exc, (KeyboardInterrupt, StoppedWhileStarting)):
        raise
    sys.exit(say_interrupted_while_starting(exc if isinstance(exc, StoppedWhileStarting) else None))

COMMANDS = {
    "train": "train from a recipe: nsa-titan train RECIPE.toml [--section.field=VALUE ...]",
    "export": "consolidate a run's checkpoint: nsa-titan export RECIPE.toml [overrides] --output FILE, or "
              "--format hf --output DIR [--dtype bfloat16] for a Hugging Face transformers folder; "
              "--overwrite replaces an earlier export there",
    "sample": "generate text: nsa-titan sample EXPORTED_FILE|HF_DIR [--prompt TEXT] "
              "[--max-new-tokens N (default 200, or what max_seq_len leaves)] [--temperature T (0 = greedy; default "
              "0.8)] [--top-k K (the K likeliest tokens; default all)] [--seed S (default 0)]",
    "plot": "draw NSA selection and gates as PNGs: nsa-titan plot RECIPE.toml [overrides]|EXPORTED_FILE|HF_DIR "
            "--text TEXT|--text-file FILE [--layer N] --out DIR [--overwrite (replace an earlier plot's files in DIR)]",
    "eval": "loss by context position, a passkey probe and lm-eval tasks: nsa-titan eval "
            "RECIPE.toml [overrides]|EXPORTED_FILE|HF_DIR [data flags] --out DIR [--batches N] [--lengths 100,200] "
            "[--depths 0,0.5,1] [--trials N] [--tasks a,b [--task-dir DIR] [--limit N]] [--overwrite (replace an "
            "earlier eval's results in DIR)]",
    "inspect": "compile-graph inspection: nsa-titan inspect RECIPE.toml [overrides] [--seq-lens 64,96] "
               "[--fail-on-break]",
    "doctor": "preflight checks: nsa-titan doctor RECIPE.toml [overrides] [--world-size N]",
    "recipes": "the shipped recipes: nsa-titan recipes lists them; nsa-titan recipes copy [DIR] writes them, presets "
               "included, into DIR (default ./recipes) to train from and edit",
}

INPUT_ERROR = 2


def _usage() -> str:
    lines = ["usage: nsa-titan COMMAND [RECIPE.toml] [overrides...]", "", "commands:"]
    lines += [f"  {name:<8} {text}" for name, text in COMMANDS.items()]
    lines += ["", "`nsa-titan train --help` lists every recipe field; `nsa-titan COMMAND --help`, a command's usage;",
              "`nsa-titan --version`, the versions of this package, torch and Python."]
    return "\n".join(lines)


def _version() -> str:
    """What a bug report needs: this package's version and the torch and Python it runs on."""
    import platform

    import torch

    from nsa_titan import __version__

    return f"nsa-titan {__version__} (torch {torch.__version__}, Python {platform.python_version()})"


def say_error_line(line: str) -> None:
    """`line` to stderr in one write: print's two (the text, then its newline) let another rank's line,
    on the pipe they share, land between them."""
    stream = sys.stderr or sys.__stderr__
    if stream is not None:
        stream.write(line + "\n")
        stream.flush()


def _fail(message: str) -> int:
    say_error_line(message)
    return INPUT_ERROR


def train(argv: list[str]) -> int:
    from nsa_titan.config.help import help_text
    from nsa_titan.runtime import launch_world

    if "--help" in argv or "-h" in argv:
        from nsa_titan.config.resolve import import_plugins_of_command_line

        failed = import_plugins_of_command_line(argv)  # so that their parts' fields are listed too
        print(help_text(), end="")
        for problem in failed:
            print(f"note: {problem.render()} Its parts are not listed.", file=sys.stderr)
        return 0
    rank, _, world_size = launch_world()
    hear_stops_while_starting()  # (prepare_process did, where this process started as `train`)
    try:
        return _train(argv, rank, world_size)
    finally:
        stop_hearing_stops_while_starting()


def _train(argv: list[str], rank: int, world_size: int) -> int:
    from nsa_titan.runtime import check_launched

    if "--print-config" not in argv:  # which reads WORLD_SIZE alone, as the size of a launch to check for
        check_launched(world_size)
    resolved = resolve(argv, world_size=world_size, actions=("print_config",), training=True)
    # Before the notes, which are about the defaults, not a recipe of the user's; --print-config too, which printed
    # the built-in defaults as a recipe (naming the debug recipe's folder) that train then refused.
    if resolved.path is None:
        return _fail(f"error: {no_recipe('train')}")
    if "print_config" in resolved.command_line.actions:
        # Every line of a note a comment (a plugin's may hold several): the output stays a recipe TOML reads.
        notes = "".join("# note: " + note.replace("\n", "\n#   ") + "\n" for note in resolved.notes)
        print(f"# resolved recipe, hash {resolved.hash}\n{notes}{resolved.toml}", end="")
        return 0
    if rank == 0:
        for line in resolved.start_lines():
            print(line, flush=True)

    from nsa_titan.runtime import make_runtime
    from nsa_titan.trainer import Trainer

    from nsa_titan.parallel.distributed import PEER_LOST_EXIT_CODE, barrier, destroy_process_group, lost_a_peer
    from nsa_titan.training_faults import TrainingFault

    recipe = resolved.recipe
    runtime = make_runtime(recipe.training.device, recipe.training.dtype)
    try:
        trainer = Trainer(resolved, runtime)
        try:
            trainer.run()
        finally:
            trainer.close()  # puts back the handlers the trainer found: the start-up's
            stop_hearing_stops_while_starting()  # a stop now is no longer one before the first step
        answer_stops_after_the_run()  # everything is written: a late stop ends the process with 0, saying so
        # A finished run: no rank tears the process group down while another still uses it, and gloo's
        # threads get the time to free the last collectives' tensors (one still freeing when the
        # interpreter shuts down aborts the process).
        barrier()
    except TrainingFault as fault:
        if not fault.every_rank and runtime.world_size > 1:  # only this rank failed
            _end_this_rank(str(fault), fault.exit_code)
        if runtime.local_rank == 0:  # every rank raised the same: said once per node, not once per rank
            say_error_line(f"error: {fault}")
        barrier()  # every rank stopped here together
        return fault.exit_code
    except UserError as exc:
        if runtime.world_size > 1:  # bad input met by this rank (say, its shards hold no documents)
            _end_this_rank(f"rank {runtime.rank}: {exc}", INPUT_ERROR)
        raise
    except Exception as exc:
        full = space_error(exc)
        if full is not None and runtime.world_size > 1:
            _end_this_rank(f"rank {runtime.rank}: {full_disk_message('train', full)}", INPUT_ERROR)
        symptom = lost_a_peer(exc) if runtime.world_size > 1 else None
        if symptom:  # another rank ended (its own message says why); this one's wait says nothing more
            _end_this_rank(f"rank {runtime.rank}: lost contact with another rank ({symptom}); the rank that failed "
                           "first says why.", PEER_LOST_EXIT_CODE)
        raise
    finally:
        destroy_process_group()
    return 0


def _end_this_rank(message: str, code: int) -> None:
    """One rank of several stops alone: the others may wait in a collective that will never complete, and
    tearing the process group down (NCCL) would wait with them. Say why and end here; the launcher stops
    the rest."""
    say_error_line(f"error: {message}")
    sys.stdout.flush()
    os._exit(code)


def export(argv: list[str]) -> int:
    from nsa_titan.export import export_checkpoint
    from nsa_titan.hf_folder import export_hf

    output = take_option(argv, "--output")
    form = take_option(argv, "--format", "pt")
    dtype = take_option(argv, "--dtype")
    overwrite = take_flag(argv, "--overwrite")
    # What is left is the recipe and its overrides.
    refuse_unknown_options(argv, "export", "--output, --format, --dtype, --overwrite, or recipe overrides "
                                           "--section.field=VALUE", overrides=True)
    writers = {"pt": export_checkpoint, "hf": export_hf}
    if form not in writers:
        return _fail(f"error: --format {form!r} is not one of pt (one torch file for nsa-titan) or hf (a Hugging "
                     f"Face transformers folder). Fix: --format=pt or --format=hf.")
    if dtype is not None and form != "hf":
        return _fail("error: --dtype applies to --format hf (the pt file keeps the training weights as they are). "
                     "Fix: add --format hf, or drop --dtype.")
    if not output:  # the fix keeps the command as given (an example of another recipe would export another run)
        example = "--output DIR (e.g. --output model_hf)" if form == "hf" else "--output FILE (e.g. --output model.pt)"
        return _fail(f"error: export needs --output. Fix: add {example} to the command.")
    from nsa_titan.config.overrides import parse_args
    from nsa_titan.hf_folder import is_hf_folder

    exported = parse_args(list(argv), []).recipe  # the recipe's place ('--section.field VALUE' takes a word)
    if exported is not None and ((exported.endswith(".pt") and os.path.isfile(exported)) or is_hf_folder(exported)):
        return _fail(f"error: export reads a run's checkpoint through the run's recipe; {exported!r} is an exported "
                     f"model, not a recipe. Fix: `nsa-titan export RECIPE.toml --format {form} --output {output}` with "
                     f"the recipe of the run it came from (its recipe.toml in the run's folder).")
    resolved = resolve(argv, world_size=None)
    if resolved.path is None:  # the bare defaults name no run: their checkpoint folder is a guess
        return _fail(f"error: export needs the recipe of the run whose checkpoint it exports. Fix: e.g. "
                     f"`nsa-titan export recipes/debug.toml {'--format hf ' if form == 'hf' else ''}--output "
                     f"{output}`.")
    from nsa_titan.rebuild import HELD_OUT_READS, say_unread_flags
    from nsa_titan.run_folder import recipe_change_note, said_if_refused

    # e.g. a model field given here that the run did not train with: the export records it
    note = recipe_change_note(resolved, "the export's recipe differs from the run's recipe.toml")
    with said_if_refused(note):
        path, step = writers[form](resolved, output, *(() if dtype is None else (dtype,)), overwrite=overwrite)
    print(f"exported step {step} to {path}")
    # The export records the recipe whole: eval of the file reads its held-out data settings.
    say_unread_flags(resolved, "export", HELD_OUT_READS, effect="nothing that reads the export (its recipe records "
                                                                "them)")
    if note:
        print(note)
    return 0


DEFAULT_NEW_TOKENS = 200


def sample(argv: list[str]) -> int:
    import torch

    from components.data import decode_text, document_prefix_id, encode_text
    from nsa_titan import registry
    from nsa_titan.document_start import documents_of, generate_document, leading_eos_apart
    from nsa_titan.export import load_exported_run, recipe_is_not_an_export
    from nsa_titan.rebuild import say_on_stderr

    prompt = take_option(argv, "--prompt", "")
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    if argv and argv[0].endswith(".toml"):  # a recipe's training flags come with it: they are not sample's options
        from nsa_titan.config.overrides import parse_args

        flags = [flag for flag, key, _ in parse_args(list(argv), []).overrides if "." in key]
        raise recipe_is_not_an_export(argv[0], [word for flag in flags for word in flag.split(" ", 1)])
    numbers = {}
    # (option, type, default, lowest, highest, example): nan or inf would reach the sampler, --top-k 0 would
    # silently mean "no top-k" (leave it out for that), a seed past 64 bits overflows torch's generator.
    for name, kind, default, low, high, example in (
            ("--max-new-tokens", int, str(DEFAULT_NEW_TOKENS), 1, None, "200"),
            ("--temperature", float, "0.8", 0, None, "0.8"),
            ("--top-k", int, None, 1, None, "40"), ("--seed", int, "0", 0, 2**64 - 1, "0")):
        text = numbers[name] = take_option(argv, name, default)
        if text is None:
            continue
        what = "a whole number" if kind is int else "a finite number"
        try:
            value = numbers[name] = kind(text)
        except ValueError:
            return _fail(f"error: {name} = {text!r} is not {what}. Fix: e.g. {name}={example}.")
        if not ((kind is int or math.isfinite(value)) and low <= value and (high is None or value <= high)):
            bounds = f">= {low}" if high is None else f"in {low}..{high}"
            return _fail(f"error: {name} = {text!r} must be {what} {bounds}. Fix: e.g. {name}={example}.")
    refuse_unknown_options(argv, "sample", "--prompt, --max-new-tokens, --temperature, --top-k, --seed")
    unused = sorted(given & {"--top-k", "--seed"})
    if numbers["--temperature"] == 0 and unused:  # greedy decoding draws nothing
        return _fail(f"error: {' and '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect with "
                     f"--temperature 0 (greedy decoding picks the likeliest token). Fix: drop "
                     f"{'it' if len(unused) == 1 else 'them'}, or sample with a temperature above 0.")
    if len(argv) != 1:
        return _fail("error: sample takes one exported model file or hf folder. Fix: `nsa-titan sample "
                     "outputs/debug/model.pt --prompt 'def '`.")
    run = load_exported_run(argv[0], say=say_on_stderr)
    model, recipe, tokenizer = run.model, run.recipe, run.tokenizer
    vocab = run.meta["vocab_size"]
    if numbers["--top-k"] is not None and numbers["--top-k"] > vocab:  # it would restrict nothing, in silence
        return _fail(f"error: --top-k {numbers['--top-k']} is more than the model's vocabulary of {vocab} tokens. "
                     f"Fix: give at most {vocab}, or leave --top-k out to draw from every token.")
    # A document as training saw it: BOS first when data.add_bos is set, else it follows the previous
    # document's end of text (so an empty prompt starts there, not at a BOS the model never saw).
    text_ids = encode_text(tokenizer, prompt, "--prompt") if prompt else []
    if prompt and not text_ids:  # it would sample from an empty prompt, as if none were given
        return _fail(f"error: tokenizer {tokenizer.name!r} reads no token from --prompt {prompt!r}: it drops what its "
                     f"vocabulary lacks. Fix: write the prompt in text the tokenizer knows, or leave --prompt out to "
                     f"start a document from nothing.")
    read = decode_text(tokenizer, text_ids) if prompt else ""
    if read != prompt:  # what the model is given is not what was asked
        say_on_stderr(f"note: tokenizer {tokenizer.name!r} reads --prompt as {read!r}: the model continues that")
    start = [document_prefix_id(tokenizer, recipe.data.add_bos)] if recipe.data.add_bos or not text_ids else []
    ids = start + text_ids
    new_tokens = numbers["--max-new-tokens"]
    limit = getattr(getattr(model, "args", None), "max_seq_len", None)
    if "--max-new-tokens" not in given and isinstance(limit, int) and 0 < limit - len(ids) < new_tokens:
        # The default asks for more than a short-context model holds: as many as it does (asked for, refused).
        new_tokens = limit - len(ids)
        say_on_stderr(f"note: {new_tokens} new tokens, as many as max_seq_len {limit} leaves after the prompt "
                      f"(--max-new-tokens defaults to {DEFAULT_NEW_TOKENS})")
    if "--max-new-tokens" not in given and isinstance(limit, int) and len(ids) >= limit:
        # The default shrinks to what is left, so the prompt alone is what must shrink (not to fit 200 more).
        bos = " after the BOS it starts with" if recipe.data.add_bos else ""
        return _fail(f"error: --prompt is {len(text_ids)} tokens{bos}, and the model's max_seq_len {limit} leaves "
                     f"no room for a new one. Fix: shorten the prompt to at most {limit - 1 - len(start)} tokens.")
    generator = torch.Generator().manual_seed(numbers["--seed"])
    apart = leading_eos_apart(documents_of(registry.get("model", run.meta["model_name"]), model), recipe.data.add_bos)
    new = generate_document(model, ids, new_tokens, tokenizer.eos_id, apart, temperature=numbers["--temperature"],
                            top_k=numbers["--top-k"], generator=generator, stop_id=tokenizer.eos_id)
    ended = tokenizer.eos_id in new  # the document ends there: what follows would be another one
    print(decode_text(tokenizer, text_ids + (new[:new.index(tokenizer.eos_id)] if ended else new))
          + ("\n[end of text]" if ended else ""))
    return 0


def plot(argv: list[str]) -> int:
    from nsa_titan.observe.plots import PLOT_FILES, plot_exported

    text, text_file = take_option(argv, "--text"), take_option(argv, "--text-file")
    layer_text, out = take_option(argv, "--layer", "0"), take_option(argv, "--out")
    overwrite = take_flag(argv, "--overwrite")
    options = "--text, --text-file, --layer, --out, --overwrite"
    usage = ("`nsa-titan plot outputs/debug/model.pt --text 'def f(x):' --out plots/` or, from the run's newest "
             "checkpoint, `nsa-titan plot recipes/debug.toml [overrides] --text ... --out plots/`")
    from_recipe = bool(argv) and argv[0].endswith(".toml")
    # recipe overrides are --section.field words, which resolve checks
    refuse_unknown_options(argv, "plot", options + (", or recipe overrides --section.field=VALUE" if from_recipe
                                                    else " (recipe overrides go with a recipe)"),
                           overrides=from_recipe)
    if not argv or (len(argv) != 1 and not from_recipe):
        return _fail(f"error: plot takes one exported model file, hf folder or recipe. Fix: {usage}.")
    if (text is None) == (text_file is None):
        return _fail(f"error: plot needs exactly one of --text TEXT or --text-file FILE. Fix: {usage}.")
    if not out:
        return _fail("error: plot needs --out DIR for the pictures. Fix: add --out DIR (e.g. --out plots) to the "
                     "command.")
    check_output("--out", out, folder=True)
    refuse_earlier_results(out, "plot", PLOT_FILES, overwrite)
    try:
        layer = int(layer_text)
    except ValueError:
        return _fail(f"error: --layer = {layer_text!r} is not a layer number. Fix: e.g. --layer 0.")
    if text_file is not None:
        try:
            with open(text_file, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            return _fail(f"error: cannot read --text-file {text_file!r} ({exc.strerror}). Fix: give a readable file.")
        except UnicodeDecodeError as exc:  # as training refuses such a file: no silently replaced characters
            # iconv without -f reads the locale's encoding, UTF-8 most often: the encoding to convert from is named
            converted = shlex.quote(text_file + ".utf8")
            return _fail(f"error: --text-file {text_file!r} is not UTF-8 text (byte {exc.start}: {exc.reason}). Fix: "
                         f"convert it to UTF-8 from the encoding it is in, e.g. for Latin-1 text `iconv -f latin1 -t "
                         f"utf-8 {shlex.quote(text_file)} > {converted}`, and give {converted}.")
    if from_recipe:
        from nsa_titan.export import load_checkpoint_model
        from nsa_titan.rebuild import say_on_stderr, say_unread_flags
        from nsa_titan.observe.plots import plot_model
        from nsa_titan.run_folder import recipe_change_note, said_if_refused

        resolved = resolve(argv, world_size=None)
        change = recipe_change_note(resolved, "the recipe differs from the run's recipe.toml (plot reads the model "
                                              "and tokenizer fields)")
        with said_if_refused(change):
            model, tokenizer, step = load_checkpoint_model(resolved, say_on_stderr)
        if change:
            print(change)
        paths, note = plot_model(model, resolved.recipe.model, tokenizer, text, layer, out, overwrite,
                                 resolved.recipe.data.add_bos)
        note += f", checkpoint step {step}"
        say_unread_flags(resolved, "plot")
    else:
        paths, note = plot_exported(argv[0], text, layer, out, overwrite)
    print(f"plotted {note}: " + ", ".join(paths.values()))
    return 0


def _quiet_known_warnings() -> None:
    """Warnings about the libraries' own internals that a user can do nothing about."""
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    # Said by every rank of a CPU (gloo) run when weights are initialised sharded; the run seeds its own RNG.
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support on cpu")


def inspect(argv: list[str]) -> int:
    from nsa_titan.inspect import run_command

    return run_command(argv)


def evaluate(argv: list[str]) -> int:
    from nsa_titan.evaluate import run_command

    return run_command(argv)


def doctor(argv: list[str]) -> int:
    from nsa_titan.doctor import run_command

    return run_command(argv)


def recipes(argv: list[str]) -> int:
    from nsa_titan.shipped_recipes import DEFAULT_DESTINATION, copy_to, listing

    refuse_unknown_options(argv, "recipes", "--help")
    if not argv:
        print(listing())
        return 0
    if argv[0] != "copy" or len(argv) > 2:
        return _fail(f"error: recipes takes no arguments (a list) or `copy [DIR]`, not {shlex.join(argv)!r}. Fix: "
                     f"`nsa-titan recipes` or `nsa-titan recipes copy {DEFAULT_DESTINATION}`.")
    destination = argv[1] if len(argv) == 2 else DEFAULT_DESTINATION
    written = copy_to(destination)
    print(f"copied {len(written)} recipe files into {destination}{os.sep}; train with e.g. `nsa-titan train "
          f"{os.path.join(destination, 'debug.toml')}`")
    return 0


def main(argv: list[str] | None = None) -> int:
    _quiet_known_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else INPUT_ERROR
    if argv == ["--version"]:
        print(_version())
        return 0
    command, rest = argv[0], argv[1:]
    handlers = {"train": train, "export": export, "sample": sample, "plot": plot, "eval": evaluate,
                "inspect": inspect, "doctor": doctor, "recipes": recipes}
    if command not in handlers:
        if os.path.isfile(command):
            return _fail(f"error: {command!r} is a file, not a command. Fix: `nsa-titan train {command}` trains "
                         f"from a recipe; the commands are {', '.join(handlers)}.")
        if any(ch in command for ch in "./" + os.sep):  # no command has these: a recipe path that is not there
            return _fail(f"error: recipe file {command!r} not found. Fix: check the path ({shipped_recipes()}).")
        return _fail(f"error: unknown command {command!r}{suggest(command, list(handlers))}. Fix: use one of "
                     f"{', '.join(handlers)} (`nsa-titan --help` describes them).")
    if command not in ("train", "inspect", "doctor") and ("--help" in rest or "-h" in rest):
        # sample and recipes read no recipe; the others also take a recipe with its overrides
        print(COMMANDS[command] + ("" if command in ("sample", "recipes") else
                                   "\n(with a recipe, its fields and overrides: nsa-titan train --help)"))
        if command == "eval":
            from nsa_titan.evaluate.export_flags import FLAGS_TAKEN

            print(f"(with an exported model, data flags choose its held-out text over the recipe it records, a "
                  f"relative path read from the current folder: {FLAGS_TAKEN})")
        return 0
    try:
        return handlers[command](rest)
    except RecipeError as exc:
        return _fail(exc.render())
    except UserError as exc:
        return _fail(f"error: {exc}")
    except Exception as exc:
        full = space_error(exc)
        if full is None:
            raise
        return _fail(f"error: {full_disk_message(command, full)}")
    except StoppedWhileStarting as stop:
        say_error_line(stopped_while_starting_message(stop.signum, command))
        return 128 + stop.signum
    except KeyboardInterrupt:  # Ctrl-C before training set its own handler, or a second one during it
        after = (" at once: nothing was saved since the last complete checkpoint: a rerun resumes from it, or starts "
                 "afresh where there is none") if command == "train" else ""
        _fail(f"error: {command} interrupted{after}.")
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
