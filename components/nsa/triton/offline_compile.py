"""Compile the NSA kernels for a GPU that is not here: the build check a CPU-only machine can do.

Triton's interpreter runs a kernel's Python, so it cannot see what only the compiler checks:
types that change across loop iterations, tl.dot shape rules, shared memory that a tile needs
beyond a GPU's limit, register spills. This module runs the real launchers on CPU tensors with
every kernel launch replaced by an ahead-of-time compile for a named target (Triton ships ptxas),
and reports each compiled kernel's resources. Nothing is launched and the outputs hold no values.

    with compile_only(target) as kernels:
        nsa_attention_triton(...).sum().backward()
    for k in kernels: print(k.name, k.shared_bytes, k.registers, k.stack_bytes)

Run it in a process where TRITON_INTERPRET is unset: under the interpreter there is nothing to
compile. `python -m bench.kernel_resources` prints the table for the usual shapes.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime import jit

from components.nsa.triton import launch

# Largest dynamic shared memory one block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin).
SHARED_LIMIT_BYTES = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    target: str
    constants: dict
    num_warps: int
    num_stages: int
    shared_bytes: int
    registers: int | None
    # Per-thread stack frame: ptxas puts register spills and arrays it cannot keep in registers there,
    # in local memory (slow). None without cuobjdump.
    stack_bytes: int | None
    # The matrix instructions its dots became (tensor_cores): on sm_90 "wgmma" is Hopper's warpgroup MMA,
    # "mma" the older warp-level one, which a dot of fewer than 64 rows per warpgroup falls back to.
    tensor_cores: str
    # Loads the software pipeliner turned into asynchronous copies (cp.async or TMA), prefetched stages ahead of
    # the loop iteration that uses them. 0: every load waits for memory where it stands (a branch in a loop's
    # body, or a loop nested inside the loop that loads, keeps the pipeliner out).
    async_loads: int

    @property
    def shared_limit_bytes(self) -> int:
        return SHARED_LIMIT_BYTES[int(self.target.split("_")[1])]


def target_for(arch: int) -> GPUTarget:
    return GPUTarget("cuda", arch, 32)


def tensor_cores(ptx: str) -> str:
    """"wgmma", "mma" or "none": the tensor-core instructions a kernel's PTX uses (both: "wgmma+mma")."""
    kinds = [name for name, pattern in (("wgmma", r"\bwgmma\.mma_async\b"), ("mma", r"\bmma\.sync\b"))
             if re.search(pattern, ptx)]
    return "+".join(kinds) or "none"


def async_loads(ttgir: str) -> int:
    """The asynchronous copies (cp.async, TMA) in a kernel's TTGIR: the loads the pipeliner prefetches."""
    return len(re.findall(r"\b(?:ttg\.async_copy_global_to_local|ttng\.async_tma_copy_global_to_local)\b", ttgir))


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, stack-frame bytes) per thread, from cuobjdump's resource report of the cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        report = subprocess.run([tool, "--dump-resource-usage", fh.name], capture_output=True, text=True).stdout
    registers = re.search(r"REG:(\d+)", report)
    stack = re.search(r"STACK:(\d+)", report)
    return (int(registers.group(1)) if registers else None, int(stack.group(1)) if stack else None)


@contextlib.contextmanager
def compile_only(target: GPUTarget):
    """Within the block, launching any Triton kernel compiles it for `target` instead."""
    if launch.interpreting():
        raise RuntimeError("offline compilation needs TRITON_INTERPRET unset")
    backend = make_backend(target)
    compiled: list[CompiledKernel] = []
    original_run, original_cpu_tensors_allowed = jit.JITFunction.run, launch.cpu_tensors_allowed

    def compile_instead(self, *args, grid, warmup, **kwargs):
        binder = jit.create_function_from_signature(self.signature, self.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args, specialization, options)
        kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=target,
                                options=options.__dict__)
        registers, stack_bytes = _resource_usage(kernel.asm["cubin"])
        names = [p.name for p in self.params]
        constants = {names[path[0]]: value for path, value in constexprs.items() if len(path) == 1}
        compiled.append(CompiledKernel(self.fn.__name__, f"sm_{target.arch}", constants, options.num_warps,
                                       options.num_stages, kernel.metadata.shared, registers, stack_bytes,
                                       tensor_cores(kernel.asm["ptx"]), async_loads(kernel.asm["ttgir"])))
        return None

    jit.JITFunction.run = compile_instead
    launch.cpu_tensors_allowed = lambda: True
    try:
        yield compiled
    finally:
        jit.JITFunction.run = original_run
        launch.cpu_tensors_allowed = original_cpu_tensors_allowed
