"""Run under torch.distributed.run by tests/test_context_parallel.py: a tiny fp64 transformer's logits
and every parameter gradient under context parallelism equal one process's forward of the whole rows.

argv: checks, each ATTENTION:MASKING (nsa | dense, 0 | 1) or saved:ATTENTION, run in order in one process
group (one launch instead of one per check: starting the ranks costs more than the checks).
ATTENTION:MASKING prints "ATTENTION MASKING rank R: ok" per rank on success; NSA also checks the attention
telemetry and maps of the split rows against the whole rows'.
saved:ATTENTION prints what one block saves for backward per local token (bytes, fp32), rows of one
document (the most keys each chunk's queries see), for doctor's memory estimate."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from components.models.args import TransformerArgs
from components.models.transformer import build_transformer
from components.sequence_shard import SequenceShard
from tests.saved_tensors import saved_bytes

B, T, VOCAB = 2, 64, 50


def check_split_rows(attention: str, masking: bool) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    args = TransformerArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=T, attention=attention,
                           document_masking=masking)
    if attention == "nsa":  # blocks small enough that every branch and both chunks matter at T = 64
        nsa = args.nsa
        nsa.block_size, nsa.block_stride, nsa.sel_block_size, nsa.num_selected, nsa.window_size = 8, 4, 8, 3, 8
    model = build_transformer(args, VOCAB).double()
    tokens = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    # Documents of 1 token, shorter than a block, crossing chunk and rank boundaries.
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[0, [5, 6, 30]] = True
    starts[1, [17, 40, 41, 50]] = True

    whole = model(tokens, documents=starts if masking else None)
    expected = torch.autograd.grad((whole ** 2).mean(), list(model.parameters()))

    shard = SequenceShard(dist.group.WORLD, rank, size, T)
    context = model.context_shard(starts, B, shard, torch.device("cpu"))
    mine = model(shard.split(tokens), context=context)
    torch.testing.assert_close(mine, shard.split(whole), rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad((mine ** 2).sum() / whole.numel(), list(model.parameters()))
    for (name, _), got, want in zip(model.named_parameters(), grads, expected):
        dist.all_reduce(got)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=name)
    if attention == "nsa":
        check_telemetry(model, tokens, starts if masking else None, shard, context)
        check_attention_maps(model, tokens, starts if masking else None, shard, context)
    sys.stdout.write(f"{attention} {int(masking)} rank {rank}: ok\n")  # one write: ranks share the pipe


def check_telemetry(model, tokens, starts, shard: SequenceShard, context) -> None:
    """Attention telemetry of the split rows (each rank its share, combined) equals the whole rows'. The
    gates are pushed off 0.5 first, so that a rank's share alone would give other numbers. The statistics
    are fp32 (gate_stats), hence fp32 tolerances."""
    from components.models.telemetry import collect_nsa_telemetry

    with torch.no_grad():
        for layer in model.layers:
            for weight in layer.attention.gate.parameters():
                weight.mul_(40)
    whole = collect_nsa_telemetry(model, tokens, starts)
    split = collect_nsa_telemetry(model, shard.split(tokens), context=context)
    assert whole.keys() == split.keys()
    for key in whole:
        torch.testing.assert_close(split[key], whole[key], rtol=1e-6, atol=1e-7, msg=lambda m: f"{key}: {m}")


def check_attention_maps(model, tokens, starts, shard: SequenceShard, context) -> None:
    """The maps the split rows give (gathered from the group) equal the whole rows' (each row's first
    document, where documents are masked apart)."""
    from components.models.telemetry import attention_maps

    split = attention_maps(model, shard.split(tokens), context=context)
    for row in range(B):
        later = [] if starts is None else starts[row, 1:].nonzero()
        end = int(later[0]) + 1 if len(later) else T
        whole = attention_maps(model, tokens[row:row + 1, :end])
        assert whole.keys() == split.keys()
        for i, expected in whole.items():
            torch.testing.assert_close(split[i].gates[row:row + 1, :end], expected.gates, rtol=1e-12, atol=1e-12)
            assert torch.equal(split[i].selected[row:row + 1, :end], expected.selected), (row, i)


def print_saved_bytes(attention: str) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    seq = 1024
    args = TransformerArgs(dim=128, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=seq, attention=attention)
    model = build_transformer(args, VOCAB)
    shard = SequenceShard(dist.group.WORLD, rank, size, seq)
    context = model.context_shard(None, 1, shard, torch.device("cpu"))
    x = torch.randn(1, shard.local_len, args.dim, requires_grad=True)
    saved = saved_bytes(model, lambda: model.layers[0](x, model.rope.cos, model.rope.sin, context=context))
    if rank == 0:
        sys.stdout.write(f"{attention} saved_bytes_per_local_token {saved / shard.local_len}\n")


def main(checks: list[str]) -> None:
    dist.init_process_group("gloo")
    for check in checks:
        first, second = check.split(":")
        if first == "saved":
            print_saved_bytes(second)
        else:
            check_split_rows(first, second == "1")
        dist.barrier()  # each check's collectives end on every rank before the next begins
    dist.destroy_process_group()  # after the last barrier: no rank tears gloo down while another talks to it


if __name__ == "__main__":
    main(sys.argv[1:])
