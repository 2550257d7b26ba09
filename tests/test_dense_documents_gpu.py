"""Dense attention over packed documents on a CUDA GPU: compiled blocks take FlexAttention with the
document block mask; their logits and every gradient equal the eager explicit-mask model's."""

import pytest
import torch

from components.models import build_transformer, hooks
from components.models.args import TransformerArgs
from tests.test_models_packed import starts_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FlexAttention's backward)"),
]


def test_compiled_flex_attention_trains_like_the_explicit_mask():
    torch.manual_seed(0)
    T = 1024
    args = TransformerArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=T,
                           attention="dense", document_masking=True)
    eager = build_transformer(args, 512).cuda()
    compiled = build_transformer(args, 512).cuda()
    compiled.load_state_dict(eager.state_dict())
    for block in compiled.layers:
        block.compile()  # as the trainer compiles, and then tells the model (the `compiled` hook)
    hooks.compiled(compiled, "inductor")
    tokens = torch.randint(0, 512, (2, T), device="cuda")
    # Documents of 1 to 700 tokens, ending on and off the 128-token blocks.
    starts = starts_of([[1, 127, 200, 696], [700, 324]], T)
    documents = compiled.document_layout(starts, torch.device("cuda"))
    assert documents.block_mask is not None and not documents.one_per_row
    losses = []
    for model in (eager, compiled):
        logits = model(tokens, documents)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        losses.append((logits.detach(), loss.item()))
    torch.testing.assert_close(losses[1][0], losses[0][0], rtol=2e-4, atol=2e-4)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-5, msg=name)


def test_compiled_flex_attention_of_a_context_parallel_ranks_queries():
    """One rank's two chunks of queries against the whole rows' keys (context parallelism's dense path):
    FlexAttention's output and q/k/v gradients equal the explicit mask's."""
    from components.models.dense_attention import DenseAttention
    from components.models.dense_documents import FLEX_BLOCK, DenseDocuments, document_block_mask
    from components.nsa.documents import cu_seqlens_of_rows
    from components.sequence_shard import SequenceShard

    torch.manual_seed(0)
    T, size, rank = 2048, 4, 1
    starts = starts_of([[1, 300, 1000, 747], [2048]], T)
    cu = cu_seqlens_of_rows(starts)
    ids = torch.arange(cu.numel() - 1).repeat_interleave(cu.diff()).view(2, T)
    local = SequenceShard(None, rank, size, T).positions()
    query_ids, query_rows = ids[:, local], local.expand(2, -1)
    mask = document_block_mask(ids, FLEX_BLOCK, torch.device("cuda"), query_ids, query_rows)
    docs = DenseDocuments(torch.zeros(0, device="cuda"), ids.cuda(), False, mask, query_ids.cuda(), query_rows.cuda())
    layer = DenseAttention(TransformerArgs(dim=256, n_heads=4, n_kv_heads=2, attention="dense")).cuda()
    q = torch.randn(2, local.numel(), 4, 64, device="cuda", requires_grad=True)
    k, v = (torch.randn(2, T, 2, 64, device="cuda", requires_grad=True) for _ in range(2))
    results = []
    for attend in (layer._attend, torch.compile(layer._attend)):
        out = attend(q, k, v, docs)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.shape[-1], device="cuda")).sum(), (q, k, v))
        results.append((out, *grads))
    for name, eager, compiled in zip(("o", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(compiled, eager, rtol=2e-4, atol=2e-4, msg=name)
