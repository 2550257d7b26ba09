"""Triton kernels for NSA (backend "triton"): same semantics as the reference, built for Hopper GPUs.

    nsa_attention_triton(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, block_size,
                         block_stride, sel_block_size, num_selected, window_size,
                         cu_seqlens=None) -> o [B, T, H, D]
    select_blocks_triton(q, k_cmp, *, block_size, block_stride, sel_block_size, num_selected,
                         cu_seqlens=None) -> LongTensor [B, T, Hkv, n], ascending, -1 for unused slots

Files: interval_attention.py (compressed and window branches), selection_kernel.py (top-n blocks from the
compressed log-sum-exp, with bitonic_sort.py), selected_attention_fwd.py / selected_attention_fwd_blocks.py
(query- and block-major, tile_configs.selected_layout) and selected_attention_bwd.py,
selected_attention_masked.py with selection_mask.py (the selected branch as causal flash attention hiding
unselected blocks, for short rows), selection_lists.py (each key block's queries), gating.py (the gated sum of
the branches, forward and backward), softmax_delta.py (the backward's row correction), packing.py (tile tables
for packed documents), ops.py (torch.library custom ops for torch.compile), api.py (the entry points: checked,
and the backend table's on inputs the op has checked), launch.py (shared launch helpers), tile_configs.py
(every launch shape).
"""

from components.nsa.triton.api import attention_on_checked_inputs, nsa_attention_triton, select_blocks_triton

__all__ = ["attention_on_checked_inputs", "nsa_attention_triton", "select_blocks_triton"]
