"""The selected branch as FlexAttention over a block mask: is it faster than the op's own kernels?

    python -m bench.selected_flex [--preset 125m|paper] [--batch 32] [--seq-lens 2048] [--kv-block 128] [--tiles FILE]

The op's selected branch gathers each query's n selected blocks, or for short rows runs as causal flash
attention hiding the unselected blocks (tile_configs.selected_layout_for's layouts). FlexAttention can run it
as dense flash attention that also skips what no query of a tile selected: a block mask whose KV blocks per
query tile are the union of the tile's queries' selections (per KV head group, which shares a selection), and
a mask_mod that keeps, per query, the causal keys of its own selected blocks. That does more products than the
gather (the union over a tile against each query's n blocks) in a kernel that runs near the GPU's peak. For
each length: the op's selected branch forward and forward + backward (ops.selected_attention, its chosen
layout), FlexAttention compiled (inductor) forward and forward + backward, the block mask's build from a
selection (once per forward in a model), the union's size (KV blocks a query tile visits against n), and the
largest difference between the two outputs and their input gradients (the same function: only rounding may
differ), also relative to the op's largest value. In a model the mask is built in every forward: the report's
ratio counts it with FlexAttention's time. FlexAttention runs with its default kernel settings (not
autotuned). The selection is the op's own (ops.select_blocks) over random inputs, whose selections spread
wider than a trained model's. Results go to bench/results/selected_flex-<gpu>-<time>.json. --tiles FILE
launches the op's kernels with a launch shapes file's shapes in place of the shipped ones (bench.tile_choice).
Needs CUDA; --allow-cpu runs it at tiny sizes, FlexAttention eager and the Triton kernels under the
interpreter, as a smoke test (times mean nothing there).
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench import environment
from bench.arguments import positive_int
from bench.attention import DTYPES, add_shape_args, finish_shape_args, nsa_inputs
from bench.attention_stages import kernel_device, timer
from bench.environment import describe_environment, write_report
from bench.launch_shapes import add_tiles_arg, applied, config_of, finish_tiles_arg


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(p)
    p.add_argument("--seq-lens", type=positive_int, nargs="+", default=[2048])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--q-block", type=positive_int, default=128, help="the block mask's query tile")
    p.add_argument("--kv-block", type=positive_int, default=128,
                   help="the block mask's KV block: a multiple of --sel-block-size")
    p.add_argument("--allow-cpu", action="store_true", help="smoke test under TRITON_INTERPRET=1 (not a benchmark)")
    p.add_argument("--out", help="output JSON path (default bench/results/selected_flex-<gpu>-<time>.json)")
    add_tiles_arg(p)
    args = finish_tiles_arg(p, finish_shape_args(p, p.parse_args(argv)))
    if args.kv_block % args.sel_block_size:
        p.error(f"--kv-block {args.kv_block} must be a multiple of --sel-block-size {args.sel_block_size}")
    return args


def selected_mask(selection: torch.Tensor, T: int, sel_block_size: int) -> torch.Tensor:
    """bool [B, Hkv, T, Ts]: query t's group selected block j (selection [B, T, Hkv, n], -1 unused)."""
    B, _, Hkv, _ = selection.shape
    blocks = -(-T // sel_block_size)
    mask = torch.zeros(B, Hkv, T, blocks + 1, dtype=torch.bool, device=selection.device)
    # Unused slots (-1) land in the extra last column, dropped after.
    mask.scatter_(3, torch.where(selection >= 0, selection, blocks).permute(0, 2, 1, 3), True)
    return mask[..., :blocks]


def block_mask_of(selected: torch.Tensor, heads: int, T: int, sel_block_size: int, q_block: int, kv_block: int):
    """The FlexAttention BlockMask of a selection: per query tile the KV blocks any of its queries selected,
    each query keeping the causal keys of its own selected blocks."""
    from torch.nn.attention.flex_attention import BlockMask

    B, Hkv, _, blocks = selected.shape
    q_tiles, kv_tiles, per_kv = -(-T // q_block), -(-T // kv_block), kv_block // sel_block_size
    padded = torch.zeros(B, Hkv, q_tiles * q_block, kv_tiles * per_kv, dtype=torch.bool, device=selected.device)
    padded[:, :, :T, :blocks] = selected
    union = padded.view(B, Hkv, q_tiles, q_block, kv_tiles, per_kv).any(dim=5).any(dim=3)
    union = union.repeat_interleave(heads // Hkv, dim=1)  # [B, H, q_tiles, kv_tiles]
    kv_num_blocks = union.sum(-1, dtype=torch.int32)
    kv_indices = torch.argsort((~union).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    group = heads // Hkv

    def keep(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & selected[b, h // group, q_idx, kv_idx // sel_block_size]

    mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=(q_block, kv_block), mask_mod=keep,
                                    seq_lengths=(T, T))
    return mask, kv_num_blocks


def measure_length(args, T: int, dtype: torch.dtype, device: str) -> dict:
    from torch.nn.attention.flex_attention import flex_attention

    from components.nsa.triton import ops

    l, d, lp, n = args.block_size, args.block_stride, args.sel_block_size, args.num_selected
    scale = args.head_dim ** -0.5
    q, k_cmp, v_cmp, k_sel, v_sel, *_ = nsa_inputs(args, T, dtype, device)
    _, lse_cmp = ops.interval_attention(q.detach(), k_cmp.detach(), v_cmp.detach(), d, l - 1, 0, scale)
    selection = ops.select_blocks(q.detach(), k_cmp.detach(), lse_cmp, l, d, lp, n, scale)

    def build():
        return block_mask_of(selected_mask(selection, T, lp), args.heads, T, lp, args.q_block, args.kv_block)

    block_mask, kv_num_blocks = build()
    # Static shapes: each length compiles its own kernels rather than one dynamic-shape build for all.
    flex = torch.compile(flex_attention, dynamic=False) if device == "cuda" else flex_attention

    backward = device == "cuda"  # FlexAttention has no backward on the CPU: the smoke test compares outputs only
    flex_inputs = [x if backward else x.detach() for x in (q, k_sel, v_sel)]

    def flex_selected():
        fq, fk, fv = (x.transpose(1, 2) for x in flex_inputs)
        return flex(fq, fk, fv, block_mask=block_mask, scale=scale, enable_gqa=True).transpose(1, 2)

    def op_selected():
        return ops.selected_attention(q, k_sel, v_sel, selection, lp, scale)[0]

    grad = torch.randn_like(q)
    inputs = [q, k_sel, v_sel]
    results = {}
    for name, fn in (("op", op_selected), ("flex", flex_selected)):
        out = fn()
        grads = torch.autograd.grad(out, inputs, grad) if backward else ()
        results[name] = [out.detach().float(), *(g.float() for g in grads)]
    differences = [(a - b).abs().max().item() for a, b in zip(results["op"], results["flex"], strict=True)]
    scales = [a.abs().max().item() for a in results["op"]]

    measure = timer(device, args.rep_ms)

    def forward_backward(fn):
        return lambda: torch.autograd.grad(fn(), inputs, grad)

    with torch.no_grad():
        op_fwd, flex_fwd, build_ms = measure(op_selected), measure(flex_selected), measure(build)
    return {"seq_len": T, "batch": args.batch, "op_fwd_ms": op_fwd, "op_fwd_bwd_ms": measure(forward_backward(op_selected)),
            "flex_fwd_ms": flex_fwd, "flex_fwd_bwd_ms": measure(forward_backward(flex_selected)) if backward else None,
            "mask_build_ms": build_ms, "q_block": args.q_block, "kv_block": args.kv_block,
            "kv_blocks_per_q_tile": kv_num_blocks.float().mean().item(),
            "selected_blocks_as_kv_blocks": n * lp / args.kv_block,
            "max_abs_difference": dict(zip(("o", "dq", "dk", "dv"), differences)),
            "max_relative_difference": dict(zip(("o", "dq", "dk", "dv"),
                                                (d / max(m, 1e-30) for d, m in zip(differences, scales))))}


def main(argv=None) -> int:
    args = parse_args(argv)
    device = kernel_device("bench.selected_flex", args.allow_cpu)
    if device is None:
        return 2
    with applied(args.shapes):
        return measure(args, device)


def measure(args, device: str) -> int:
    dtype = DTYPES[args.dtype] if device == "cuda" else torch.float32
    report = {"benchmark": "selected_flex", "environment": describe_environment(),
              "config": {**config_of(args), "dtype": str(dtype).replace("torch.", "")}, "results": []}
    path = args.out or environment.results_path("selected_flex")
    for T in args.seq_lens:
        row = measure_length(args, T, dtype, device)
        report["results"].append(row)
        print(f"T={T:6d} x {row['batch']}: op {row['op_fwd_ms']:.3f} / {row['op_fwd_bwd_ms']:.3f} ms, flex "
              f"{row['flex_fwd_ms']:.3f} / {row['flex_fwd_bwd_ms'] or float('nan'):.3f} ms (fwd / fwd+bwd), mask build "
              f"{row['mask_build_ms']:.3f} ms; {row['kv_blocks_per_q_tile']:.1f} KV blocks a query tile against "
              f"{row['selected_blocks_as_kv_blocks']:.1f} selected; max |op - flex| {row['max_abs_difference']}",
              flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
        write_report(report, "selected_flex", path, quiet=True)  # after every length: a run cut short keeps it
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
