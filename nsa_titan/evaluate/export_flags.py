"""The recipe flags `nsa-titan eval EXPORTED` takes: the data fields that only choose which held-out text it reads
(where the data is now, an export being read on another machine, say). Every other field is the export's: its weights
were trained with its model, tokenizer and way of starting a document, so a flag changing one of them would measure
the model on input it was never trained to read. A flag over the run's own data that holds out documents the model
trained on (a larger validation_fraction, say) is taken, and said (held_out_note)."""

from __future__ import annotations

import dataclasses
import os

from components.data import MIXTURE
from components.errors import UserError
from nsa_titan import registry
from nsa_titan.config.errors import RecipeError
from nsa_titan.config.overrides import parse_args

TAKEN = None  # the flag is taken
TOKEN_IDS = "would read the text as other token ids than the model was trained on"
NOT_DATA = "is not a data field: the model, and every setting outside [data], are as the export records them"

# Every field of [data] (config/schema.py, DataConfig) but the parts' argument tables: TAKEN, or why its flag is
# refused. The chosen source's table, [data.<source>] (a mixture's members included), is taken whole; a tokenizer's,
# [data.<tokenizer>], is refused whole.
DATA_FIELDS = {
    "source": TAKEN,  # which documents
    "logical_shards": TAKEN,  # which rows: the set takes an equal share of each logical shard's held-out stream
    "min_document_tokens": TAKEN,  # which documents are kept
    "num_workers": TAKEN,  # how the same rows are read here (the set is the same at every worker count)
    "prefetch_factor": TAKEN,
    "pin_memory": "does nothing here: eval reads on the CPU",
    "tokenizer": TOKEN_IDS,
    "add_bos": "would start each document otherwise than the model was trained to read it",
}

FLAGS_TAKEN = ("--data.source, --data.SOURCE.FIELD (e.g. --data.text_files.paths=corpus/*.jsonl where the data is "
               "now; a mixture's members: --data.mixture.sources.NAME.FIELD), "
               + ", ".join(f"--data.{name}" for name, why in DATA_FIELDS.items() if why is TAKEN and name != "source"))


def why_refused(key: str) -> str | None:
    """Why eval of an export refuses a flag for the recipe field `key` (dotted), or None when it takes it (or when
    `key` is no field, which the recipe's reader then names as for a recipe)."""
    section, _, rest = key.partition(".")
    if key == "validation.steps":  # the size of the set, which eval takes as its own option
        return "is not a data field: eval's --batches N sets how many held-out batches it reads"
    if section != "data":
        return NOT_DATA
    name = rest.split(".")[0]
    if name in registry.available("tokenizer"):
        return f"sets an argument of the tokenizer, so it {TOKEN_IDS}"
    if name in registry.available("data_source") or "." in rest:
        return TAKEN
    return DATA_FIELDS.get(name, TAKEN)


def refuse_other_flags(flags: list[str]) -> None:
    """Refuse, in one message, the flags among `flags` (command-line words) that eval of an export does not take; a
    word that is no override is named as a recipe's reader names it. Run again once an export's plugins are
    imported: a plugin's tokenizer is known from then."""
    problems: list = []
    given = parse_args(list(flags), problems)
    if problems:
        raise RecipeError(problems)
    refused = [f"{flag} {why}" for flag, key, _ in given.overrides for why in [why_refused(key)] if why is not TAKEN]
    if refused:
        raise UserError(f"eval of an exported model takes recipe flags only for the text it reads: "
                        f"{'; '.join(refused)}. Fix: drop {'it' if len(refused) == 1 else 'them'} (to evaluate with "
                        f"other settings, evaluate the run's checkpoint through its recipe); the flags it takes are "
                        f"{FLAGS_TAKEN}.")


def held_out_note(saved, data) -> str | None:
    """Why the held-out set read with the data flags holds documents the model trained on, or None: a flag's
    validation_fraction above the run's, or validation_split '' where the run held out a named split (the fields
    whose metadata says "held_out"), over the run's own data (the same source with the same "path" fields). A
    lower share is a part of the run's held-out set; a named split, another corpus or another synthetic seed (its
    held-out documents come from their own seed stream) hold no training document. `saved`, `data`: the saved
    recipe's data settings and those read now, their relative paths as read here."""
    found = []
    for table, old, args, held in _own_data(saved, data):
        if any(kind == "split" and getattr(args, name) for name, kind in held.items()):
            continue  # a named split: not the one trained on (the source's own check refuses that)
        named = [(name, getattr(old, name)) for name, kind in held.items() if kind == "split" and getattr(old, name)]
        if named:  # the run held out a split, and trained on every document of the one now shared out
            found += [f"{table}.{name} = '' holds out a share of the split the run trained on whole (it held out split "
                      f"{then!r})" for name, then in named]
        else:
            found += [f"{table}.{name} = {getattr(args, name)} holds out documents the run trained on (it held out "
                      f"{getattr(old, name)})" for name, kind in held.items()
                      if kind == "share" and getattr(args, name) > getattr(old, name)]
    if not found:
        return None
    return (f"{'; '.join(found)}, so the held-out loss read is partly over documents the model trained on (a share "
            f"no larger than the run's, or other data, holds none)")


def _own_data(saved, data):
    """(table, the saved arguments, those read now, {field: its "held_out" kind}) of each source read now that is
    the run's own: the same source in the same table, with the same "path" fields."""
    was = _tables(saved)
    for table, (source, args) in _tables(data).items():
        if table in was and was[table][0] == source and dataclasses.is_dataclass(args) and \
                _corpus(was[table][1]) == _corpus(args):
            yield table, was[table][1], args, {fld.name: fld.metadata["held_out"] for fld in dataclasses.fields(args)
                                               if "held_out" in fld.metadata}


def _tables(data) -> dict:
    """{table: (source, its arguments)} of each source the data reads (a mixture's members)."""
    if data.source == MIXTURE:
        return {f"data.mixture.sources.{name}": (entry.source, entry.args)
                for name, entry in data.source_args.sources.items()}
    return {f"data.{data.source}": (data.source, data.source_args)}


def _corpus(args) -> dict:
    """The source's "path" fields, each path as read from here: equal for the same files named alike."""
    def here(text):
        return os.path.abspath(os.path.expanduser(text)) if isinstance(text, str) and text else text

    return {fld.name: [here(t) for t in value] if isinstance(value, list) else here(value)
            for fld in dataclasses.fields(args) if "path" in fld.metadata for value in [getattr(args, fld.name)]}


def empty_set_fix(saved, data, rows: int, example: str) -> str:
    """The fix, in the flags eval of an export takes, of a held-out set whose logical shards hold no document: the
    flag that raised data.min_document_tokens above the run's where one did, else the settings that read more of
    the same held-out documents, or more_held_out's."""
    from nsa_titan.held_out import shards_read

    run = saved.min_document_tokens
    if data.min_document_tokens > run:
        kept = f"of at least {run} tokens" if run else "of every length"
        return (f"drop --data.min_document_tokens={data.min_document_tokens} (the recipe saved with the model keeps "
                f"documents {kept}), or give a lower value")
    ways = [f"lower --data.min_document_tokens (now {data.min_document_tokens})"] if data.min_document_tokens else []
    if len(shards_read(rows, data.logical_shards)) < data.logical_shards:  # the set reads only some of the shards
        ways.append(f"give fewer --data.logical_shards (now {data.logical_shards}; each then holds more documents)")
    return ", or ".join(ways + [more_held_out(saved, data, example)])


def more_held_out(saved, data, example: str) -> str:
    """The way to more held-out documents, in the flags eval of an export takes (`example`: an eval with a flag of
    the source's): drop a flag that lowered a share below the run's (a part of its held-out set); over the run's own
    data, other data, not a larger share (it would hold out documents the model trained on); over other data, a
    larger share or another split of it. A source whose fields say nothing of what they hold out (synthetic's held-out
    documents are drawn apart from its training ones) is as other data."""
    own = [(table, old, args, held) for table, old, args, held in _own_data(saved, data) if held]
    lowered = [f"--data.{table[len('data.'):]}.{name}={getattr(args, name)} (the run held out {getattr(old, name)})"
               for table, old, args, held in own for name, kind in held.items() if kind == "share"
               and getattr(args, name) < getattr(old, name)
               and not any(k == "split" and getattr(args, n) for n, k in held.items())]  # a named split: no share
    if lowered:
        return f"drop {', '.join(lowered)}, or give a share up to the run's"
    if own:
        return f"read other held-out data, e.g. {example}"
    return f"hold out more documents of the data read, e.g. {example}"
