"""Dense attention over packed documents on a CUDA GPU: compiled blocks take FlexAttention with the
document block mask; their logits and every gradient equal the eager explicit-mask model's."""

import pytest
import torch

from components.models import build_transformer
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
    for i, block in enumerate(compiled.layers):
        compiled.layers[i] = torch.compile(block)
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
