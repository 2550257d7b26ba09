"""The recipe flags `nsa-titan eval EXPORTED` takes: the data fields that only choose which held-out text it reads
(where the data is now, an export being read on another machine, say). Every other field is the export's: its weights
were trained with its model, tokenizer and way of starting a document, so a flag changing one of them would measure
the model on input it was never trained to read."""

from __future__ import annotations

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
