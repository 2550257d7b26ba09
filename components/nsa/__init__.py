"""Native Sparse Attention: the op contract of NSA_SPEC.md and its exact PyTorch reference.

    nsa_attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, block_size, block_stride,
                  sel_block_size, num_selected, window_size, backend="reference",
                  cu_seqlens=None, cu_seqlens_q=None, max_seqlen=None) -> o [B, T, H, D]
        cu_seqlens: document starts [N + 1] of one packed row (B = 1); each document is computed on its
        own, and k_cmp / v_cmp hold the documents' compressed blocks one after another (spec section 4).
        cu_seqlens_q: each document's queries are its last ones (context parallelism). max_seqlen: a bound
        on the documents' lengths, a hint that changes no result (the Triton backend's layout).
    nsa_attention_at(..., *, q_start, ..., window_start=0)   the same for queries at q_start .. q_start + Tq - 1
        (decode); k_win / v_win may hold only the keys from window_start on (a cache keeps the window's last ones)
    select_blocks(q, k_cmp, *, ..., cu_seqlens=None) -> LongTensor [B, T, Hkv, n], ascending, -1 unused
    select_blocks_at(q, k_cmp, *, q_start, ...)

Query head h belongs to key/value group h // G (G = H / Hkv). The caller compresses (KVCompressor)
and rotates; the op applies no RoPE.
"""

from components.nsa.compression import (
    COMPRESS_MODES,
    KVCompressor,
    compressed_block_positions,
    num_compressed_blocks,
)
from components.nsa.hyperparams import check_hyperparameters, hyperparameter_problems, num_selection_blocks
from components.nsa.backends import BACKENDS, available_backends, get_backend, register_backend, unregister_backend
from components.nsa.op import (nsa_attention, nsa_attention_at, select_blocks, select_blocks_at,
                               select_blocks_of_last_queries)
from components.nsa.selection import overlap_tokens, overlap_weights

__all__ = [
    "BACKENDS",
    "available_backends",
    "get_backend",
    "register_backend",
    "unregister_backend",
    "COMPRESS_MODES",
    "KVCompressor",
    "check_hyperparameters",
    "compressed_block_positions",
    "hyperparameter_problems",
    "nsa_attention",
    "nsa_attention_at",
    "num_compressed_blocks",
    "num_selection_blocks",
    "overlap_tokens",
    "overlap_weights",
    "select_blocks",
    "select_blocks_at",
    "select_blocks_of_last_queries",
]
