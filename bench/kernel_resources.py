"""Compile every NSA Triton kernel of one forward + backward for a GPU target and report its resources.

Every layout of the selected branch is compiled (tile_configs.selected_layout_for): the op's, and the
others' launchers on the same inputs (the masked layout's: the interval kernels with a selection).

    python -m bench.kernel_resources [--arch 90 80] [--head-dims 32 64 128 256] [--dtypes bf16 fp16 fp32]
                                     [--heads 12 --kv-heads 4] [--packed] [--tiles FILE] [--json FILE]

No GPU needed: Triton compiles for the named architecture (sm_90 = H100/H200, sm_80 = A100) with the
ptxas it ships, and nothing runs. Per kernel: warps and pipeline stages, shared memory against the architecture's
limit, registers and stack frame per thread (register spills and arrays kept in local memory), the tensor-core
instructions its products use (on sm_90, wgmma or the older warp-level mma of a dot too small for it), and its
asynchronous loads (those the software pipeliner prefetches ahead of their loop iteration; 0: none is). Exit
status 1 when a kernel does not compile or needs more shared memory than the architecture has:
such a kernel would fail at launch. --packed also compiles the kernels' packed-document variants
(cu_seqlens: a row of three documents). --tiles FILE compiles a launch shapes file's shapes in place of the
shipped ones (bench/launch_shapes.py): a candidate's registers and spills, before any GPU time is spent on it.
Run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback

import torch

from bench.arguments import positive_int
from bench.attention import DTYPES, add_nsa_args, cu_seqlens_of, nsa_hyper, nsa_inputs
from bench.environment import describe_environment, write_report
from bench.launch_shapes import add_tiles_arg, applied, config_of, finish_tiles_arg
from components.errors import UserError
from components.nsa.triton.launch import interpreting
from components.nsa.triton_limits import TRITON_MAX_HEAD_DIM
from components.nsa.triton import nsa_attention_triton
from components.nsa.triton.selected_attention_bwd import selected_attention_bwd
from components.nsa.triton.selected_attention_fwd import selected_attention_fwd
from components.nsa.triton.selected_attention_fwd_blocks import selected_attention_fwd_blocks
from components.nsa.triton.selected_attention_masked import selected_attention_bwd_masked, selected_attention_fwd_masked
from components.nsa.triton.tile_configs import masked_layout_fits
from components.nsa.triton.offline_compile import SHARED_LIMIT_BYTES, compile_only, target_for


def arch(text: str) -> int:
    """A compute capability this tool knows the shared-memory limit of (another one would be compiled for
    regardless: LLVM aborts on some, sm_55 say)."""
    value = positive_int(text)
    if value not in SHARED_LIMIT_BYTES:
        raise argparse.ArgumentTypeError(f"sm_{value} is not a target this tool knows; choose from "
                                         f"{', '.join(map(str, sorted(SHARED_LIMIT_BYTES)))}")
    return value


def head_dim(text: str) -> int:
    value = positive_int(text)
    if value > TRITON_MAX_HEAD_DIM:
        raise argparse.ArgumentTypeError(f"{value} is more than the Triton kernels' largest head dim, "
                                         f"{TRITON_MAX_HEAD_DIM}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=arch, nargs="+", default=[90],
                   help=f"CUDA compute capabilities, of {', '.join(map(str, sorted(SHARED_LIMIT_BYTES)))}")
    p.add_argument("--head-dims", type=head_dim, nargs="+", default=[64, 128],
                   help=f"up to {TRITON_MAX_HEAD_DIM}")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16"])
    p.add_argument("--heads", type=positive_int, default=12)
    p.add_argument("--kv-heads", type=positive_int, default=4)
    # Lengths and NSA sizes only shape the launch, not the kernels; odd ones exercise the masks.
    p.add_argument("--seq-len", type=positive_int, default=300)
    add_nsa_args(p)
    p.add_argument("--packed", action="store_true", help="also compile the packed-document (cu_seqlens) variants")
    p.add_argument("--json", help="also write the rows as JSON to this file, with the machine, versions and commit")
    add_tiles_arg(p)
    args = finish_tiles_arg(p, p.parse_args(argv))
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.packed and args.seq_len < 6:
        p.error(f"--packed splits --seq-len into three documents, the second a third of it less one: pass at "
                f"least 6, not {args.seq_len}")
    return args


def compile_one(args: argparse.Namespace, arch: int, head_dim: int, dtype: torch.dtype) -> list:
    """The kernels one forward + backward launches, compiled for sm_<arch>."""
    shape = argparse.Namespace(**vars(args), batch=1, head_dim=head_dim)
    rows = [(None, None)]
    if args.packed:  # three documents of odd lengths
        third = args.seq_len // 3
        lengths = [third + 1, third - 1, args.seq_len - 2 * third]
        rows.append((lengths, cu_seqlens_of(lengths, "cpu")))
    with compile_only(target_for(arch)) as kernels:
        for lengths, cu_seqlens in rows:
            inputs = nsa_inputs(shape, args.seq_len, dtype, device="cpu", lengths=lengths)
            o = nsa_attention_triton(*inputs, **nsa_hyper(args), cu_seqlens=cu_seqlens)
            o.float().sum().backward()
            compile_selected_layouts(args, inputs, cu_seqlens)
    return kernels


def compile_selected_layouts(args: argparse.Namespace, inputs: list, cu_seqlens) -> None:
    """The selected branch's forward and backward launchers in each layout (launch shapes do not
    depend on which blocks are chosen: every query takes block 0); the masked layout where it fits."""
    q, _, _, k, v, *_ = (x.detach() for x in inputs)
    sel = torch.zeros(1, q.shape[1], k.shape[2], args.num_selected, dtype=torch.int64)
    scale = q.shape[-1] ** -0.5
    lp = args.sel_block_size
    for layout, forward in (("query", selected_attention_fwd), ("block", selected_attention_fwd_blocks)):
        o, lse2 = forward(q, k, v, sel, lp, scale, cu_seqlens)
        selected_attention_bwd(o, q, k, v, o, lse2, sel, lp, scale, cu_seqlens, dq_layout=layout)
    if masked_layout_fits(lp):
        o, lse2 = selected_attention_fwd_masked(q, k, v, sel, lp, scale, cu_seqlens)
        selected_attention_bwd_masked(o, q, k, v, o, lse2, sel, lp, scale, cu_seqlens)


def main(argv=None) -> int:
    args = parse_args(argv)
    if interpreting():
        print("error: TRITON_INTERPRET is set: this tool compiles the kernels for a GPU target, which the "
              "interpreter does not. Fix: run it without TRITON_INTERPRET.", file=sys.stderr)
        return 2
    rows, failures = [], []
    print(f"{'target':7} {'dtype':5} {'D':>4}  {'kernel':32} {'warps':>5} {'stages':>6} {'shared KiB':>10} "
          f"{'limit':>6} {'regs':>4} {'stack B':>7} {'tensor cores':>12} {'async loads':>11}")
    for arch in args.arch:
        for name in args.dtypes:
            for head_dim in args.head_dims:
                try:
                    with applied(args.shapes):
                        kernels = compile_one(args, arch, head_dim, DTYPES[name])
                except UserError as exc:  # a configuration the op refuses (the same for every target): say so once
                    print(f"error: {exc}", file=sys.stderr)
                    return 2
                except Exception:  # a compile error: report it with the configuration, go on
                    failures.append(f"sm_{arch} {name} D={head_dim}: does not compile:\n{traceback.format_exc()}")
                    continue
                seen = set()
                for k in kernels:
                    key = (k.name, tuple(sorted(k.constants.items())))
                    if key in seen:  # the same specialization launched again (e.g. per branch)
                        continue
                    seen.add(key)
                    rows.append({"dtype": name, "head_dim": head_dim, **dataclasses.asdict(k),
                                 "shared_limit_bytes": k.shared_limit_bytes})
                    over = k.shared_bytes > k.shared_limit_bytes
                    if over:
                        failures.append(f"{k.target} {name} D={head_dim}: {k.name} needs {k.shared_bytes} B of "
                                        f"shared memory, the limit is {k.shared_limit_bytes} B")
                    print(f"{k.target:7} {name:5} {head_dim:>4}  {k.name:32} {k.num_warps:>5} {k.num_stages:>6} "
                          f"{k.shared_bytes / 1024:>10.1f} {k.shared_limit_bytes / 1024:>6.0f} "
                          f"{k.registers if k.registers is not None else '?':>4} "
                          f"{k.stack_bytes if k.stack_bytes is not None else '?':>7} {k.tensor_cores:>12} "
                          f"{k.async_loads:>11}"
                          + ("  OVER" if over else ""))
    if args.json:
        write_report({"benchmark": "kernel_resources", "environment": describe_environment(),
                      "arguments": {k: v for k, v in config_of(args).items() if k != "json"}, "rows": rows,
                      "failures": failures}, "kernel_resources", args.json)
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
