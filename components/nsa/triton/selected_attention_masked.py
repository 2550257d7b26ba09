"""The selected branch in the masked layout (selection_mask.py): causal flash attention over each
document's keys, every key block hidden from the queries whose group did not select it."""

from __future__ import annotations

import torch

from components.nsa.triton.interval_attention import interval_attention_bwd, interval_attention_fwd
from components.nsa.triton.selection_mask import Chosen

CAUSAL = dict(key_stride=1, key_offset=0, window=0)  # every earlier key of the document; 0: no window


def selected_attention_fwd_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sel_idx: torch.Tensor,
                                  sel_block_size: int, sm_scale: float, cu_seqlens: torch.Tensor | None = None,
                                  cu_seqlens_q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse2) as selected_attention_fwd's."""
    return interval_attention_fwd(q, k, v, sm_scale=sm_scale, cu_seqlens=cu_seqlens, cu_seqlens_q=cu_seqlens_q,
                                  chosen=Chosen.of(sel_idx, sel_block_size, k.shape[1]), **CAUSAL)


def selected_attention_bwd_masked(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  o: torch.Tensor, lse2: torch.Tensor, sel_idx: torch.Tensor, sel_block_size: int,
                                  sm_scale: float, cu_seqlens: torch.Tensor | None = None,
                                  cu_seqlens_q: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) as selected_attention_bwd's."""
    chosen = Chosen.of(sel_idx, sel_block_size, k.shape[1])
    return interval_attention_bwd(do, q, k, v, o, lse2, sm_scale=sm_scale, cu_seqlens=cu_seqlens,
                                  cu_seqlens_q=cu_seqlens_q, chosen=chosen, **CAUSAL)
