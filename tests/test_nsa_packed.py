"""Packed documents at the op level (NSA_SPEC.md section 4): with cu_seqlens, a packed row computes
exactly what each document computes alone: outputs, selections and all eight input gradients, in
every backend. Triton runs under its interpreter without a GPU (tests/conftest.py), on tiny rows."""

from __future__ import annotations

import pytest
import torch

from components.nsa import nsa_attention, num_compressed_blocks, select_blocks
from components.nsa.reference_op import reference_attention
from components.nsa.triton.launch import interpreting
from tests.test_nsa_bruteforce import HYPER_NAMES, make_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

HP = dict(zip(HYPER_NAMES, (8, 4, 16, 3, 20), strict=True))  # l, d, l', n, w
SEL_HP = {k: v for k, v in HP.items() if k != "window_size"}
ORDER = ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")
# A document of one token, one shorter than l, than l', than w, one over several selection blocks.
LENGTHS = (1, 5, 12, 19, 70, 3)
H, HKV, D = 4, 2, 8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
triton_only = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreting()),
    reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)",
)


def _documents(lengths, dtype=torch.float64, device="cpu", heads=(H, HKV)):
    docs = [make_inputs(1, n, *heads, D, HP, dtype=dtype, seed=i) for i, n in enumerate(lengths)]
    return [{name: x.to(device).requires_grad_() for name, x in doc.items()} for doc in docs]


def _packed(docs):
    """The documents' tensors concatenated along dim 1 (new leaves), and their cu_seqlens."""
    packed = {name: torch.cat([d[name].detach() for d in docs], dim=1).requires_grad_() for name in ORDER}
    lengths = [d["q"].shape[1] for d in docs]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=packed["q"].device)
    return packed, cu_seqlens


def _grad_out(docs):
    T = sum(d["q"].shape[1] for d in docs)
    q = docs[0]["q"]
    return torch.randn(1, T, H, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(q)


def _output_and_grads(tensors, grad_o, backend, cu_seqlens=None):
    """[o, then the gradients of the eight inputs in ORDER]."""
    out = nsa_attention(**tensors, **HP, backend=backend, cu_seqlens=cu_seqlens)
    return [out.detach(), *torch.autograd.grad(out, [tensors[k] for k in ORDER], grad_o)]


def _separately(docs, grad_o, backend):
    """_output_and_grads of each document on its own, concatenated along dim 1 like a packed row."""
    parts, start = [], 0
    for doc in docs:
        n = doc["q"].shape[1]
        parts.append(_output_and_grads(doc, grad_o[:, start:start + n], backend))
        start += n
    return [torch.cat(column, dim=1) for column in zip(*parts)]


def _selections(select, docs, packed, cu_seqlens):
    """(selection of the packed row, the documents' own selections concatenated)."""
    alone = torch.cat([select(d["q"].detach(), d["k_cmp"].detach(), **SEL_HP) for d in docs], dim=1)
    return select(packed["q"].detach(), packed["k_cmp"].detach(), **SEL_HP, cu_seqlens=cu_seqlens), alone


def test_packed_equals_separate_outputs_selections_and_gradients():
    docs = _documents(LENGTHS)
    packed, cu_seqlens = _packed(docs)
    assert packed["k_cmp"].shape[1] == sum(num_compressed_blocks(n, 8, 4) for n in LENGTHS)
    grad_o = _grad_out(docs)
    together = _output_and_grads(packed, grad_o, "reference", cu_seqlens)
    alone = _separately(docs, grad_o, "reference")
    torch.testing.assert_close(together[0], alone[0], rtol=0, atol=0)
    for name, mine, theirs in zip(ORDER, together[1:], alone[1:]):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12, msg=name)
    packed_selection, separate_selections = _selections(select_blocks, docs, packed, cu_seqlens)
    assert torch.equal(packed_selection, separate_selections)


@triton_only
def test_triton_packed_equals_separate_and_the_reference(selected_layouts):
    """The Triton backend on the packed row: its run on each document alone (the same tiles, so equal
    but for fp32 rounding), and the reference's packed row (fp32 tolerance); selections equal."""
    from components.nsa.triton import select_blocks_triton

    docs = _documents(LENGTHS, dtype=torch.float32, device=DEVICE)
    packed, cu_seqlens = _packed(docs)
    grad_o = _grad_out(docs)
    together = _output_and_grads(packed, grad_o, "triton", cu_seqlens)
    alone = _separately(docs, grad_o, "triton")
    reference = _output_and_grads(packed, grad_o, "reference", cu_seqlens)
    for name, mine, separate, ref in zip(("o",) + ORDER, together, alone, reference):
        torch.testing.assert_close(mine, separate, rtol=1e-6, atol=1e-6, msg=f"{name}: packed vs separate")
        torch.testing.assert_close(mine, ref, rtol=5e-5, atol=5e-5, msg=f"{name}: Triton vs reference")
    packed_selection, separate_selections = _selections(select_blocks_triton, docs, packed, cu_seqlens)
    assert torch.equal(packed_selection, separate_selections)
    assert torch.equal(packed_selection, select_blocks(packed["q"].detach(), packed["k_cmp"].detach(), **SEL_HP,
                                                       cu_seqlens=cu_seqlens))


@triton_only
def test_triton_packed_fp16_matches_the_reference():
    """fp16 inputs: the reference runs in fp32 on the same rounded values (relative RMS error)."""
    docs = _documents([9, 1, 22], dtype=torch.float16, device=DEVICE)
    packed, cu_seqlens = _packed(docs)
    grad_o = _grad_out(docs)
    mine = _output_and_grads(packed, grad_o, "triton", cu_seqlens)
    assert mine[0].dtype == torch.float16
    as_fp32 = {name: x.detach().float().requires_grad_() for name, x in packed.items()}
    reference = _output_and_grads(as_fp32, grad_o.float(), "reference", cu_seqlens)
    for name, a, b in zip(("o",) + ORDER, mine, reference):
        a, b = a.double(), b.double()
        err = ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()
        assert err < 2e-3, f"{name}: relative RMS error {err:.2e}"


def test_one_document_is_the_unpacked_op():
    (doc,) = _documents([37])
    packed, cu_seqlens = _packed([doc])
    torch.testing.assert_close(nsa_attention(**packed, **HP, cu_seqlens=cu_seqlens), nsa_attention(**doc, **HP),
                               rtol=0, atol=0)


def test_no_key_crosses_a_document_boundary():
    """Changing every token of the first document changes no output of the second, nor its gradients."""
    docs = _documents([40, 33])
    packed, cu_seqlens = _packed(docs)
    out = nsa_attention(**packed, **HP, cu_seqlens=cu_seqlens)
    changed = {k: v.detach().clone() for k, v in packed.items()}
    for name in ORDER:
        dim_1 = slice(0, 40) if name not in ("k_cmp", "v_cmp") else slice(0, num_compressed_blocks(40, 8, 4))
        changed[name][:, dim_1] = torch.randn_like(changed[name][:, dim_1])
    out2 = nsa_attention(**changed, **HP, cu_seqlens=cu_seqlens)
    torch.testing.assert_close(out2[:, 40:], out[:, 40:], rtol=0, atol=0)
    grads = torch.autograd.grad(out[:, 40:].sum(), [packed[k] for k in ORDER])
    for name, g in zip(ORDER, grads):
        first = num_compressed_blocks(40, 8, 4) if name in ("k_cmp", "v_cmp") else 40
        assert torch.count_nonzero(g[:, :first]) == 0, name


def test_opcheck_with_cu_seqlens():
    docs = _documents([9, 1, 22], dtype=torch.float32)
    packed, cu_seqlens = _packed(docs)
    args = tuple(packed[n] for n in ORDER) + tuple(HP[n] for n in HYPER_NAMES) + (cu_seqlens,)
    torch.library.opcheck(reference_attention, args)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=triton_only)])
def test_compiled_op_does_not_recompile_when_boundaries_move(backend):
    device = DEVICE if backend == "triton" else "cpu"
    docs = _documents([20, 30, 14], dtype=torch.float32, device=device)
    packed, _ = _packed(docs)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, cu: nsa_attention(**x, **HP, cu_seqlens=cu, backend=backend), fullgraph=True,
                             backend="inductor")
    frames = []
    # The first two rows differ in their boundaries but not in their number of compressed blocks (12).
    for i, cu in enumerate(([0, 20, 50, 64], [0, 24, 50, 64], [0, 10, 52, 64])):
        cu = torch.tensor(cu, device=device)
        # k_cmp / v_cmp hold the documents' blocks: rebuild them for these boundaries.
        x = dict(packed)
        tc = sum(num_compressed_blocks(b - a, 8, 4) for a, b in zip(cu.tolist(), cu.tolist()[1:]))
        gen = torch.Generator().manual_seed(tc)
        for name in ("k_cmp", "v_cmp"):
            x[name] = torch.randn(1, tc, HKV, D, generator=gen).to(device).requires_grad_()
        # Against the reference in eager mode: the compiled Triton op also computes the spec's function.
        out, expected = compiled(x, cu), nsa_attention(**x, **HP, cu_seqlens=cu)
        torch.testing.assert_close(out, expected, rtol=5e-5, atol=5e-5)
        frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        if i == 0:  # the compiled backward gets the boundaries too
            leaves = [x[name] for name in ORDER]
            grad_o = torch.randn_like(out)
            for name, mine, ref in zip(ORDER, torch.autograd.grad(out, leaves, grad_o),
                                       torch.autograd.grad(expected, leaves, grad_o)):
                torch.testing.assert_close(mine, ref, rtol=5e-5, atol=5e-5, msg=name)
    # Moved boundaries are data, not a new graph; a new number of compressed blocks changes k_cmp's
    # size, which makes that size symbolic once (the model's own compression keeps it inside the graph).
    assert frames[0] == frames[1], frames
    assert frames[2] <= frames[1] + 1, frames


@pytest.mark.parametrize("cu, message", [
    ([0, 30, 20, 64], "strictly increasing"),
    ([0, 20, 20, 64], "strictly increasing"),
    ([1, 20, 64], "start at 0 and end at T = 64"),
    ([0, 20, 63], "start at 0 and end at T = 64"),
    ([0], "1-D integer tensor"),
])
def test_bad_cu_seqlens_are_refused(cu, message):
    (doc,) = _documents([64])
    with pytest.raises(ValueError, match=message):
        nsa_attention(**doc, **HP, cu_seqlens=torch.tensor(cu))


@triton_only
@triton_only
def test_eager_calls_read_the_offsets_from_the_device_once(monkeypatch):
    """A model passes one cu_seqlens to every layer: an eager call reads its values (a wait for a GPU) once
    per tensor, not once per layer and check; the Triton path itself reads none. An in-place change of
    the tensor is read again, and still checked."""
    docs = _documents(LENGTHS, dtype=torch.float32, device=DEVICE)
    packed, cu_seqlens = _packed(docs)
    reads = []
    tolist = torch.Tensor.tolist

    def counted(self):
        reads.append(self is cu_seqlens)
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    for _ in range(3):  # as three layers of one forward
        out = nsa_attention(**packed, **HP, backend="triton", cu_seqlens=cu_seqlens)
        out.sum().backward()
    assert reads.count(True) == 1
    cu_seqlens[1] = cu_seqlens[2]  # an empty document now
    with pytest.raises(ValueError, match="strictly increasing"):
        nsa_attention(**packed, **HP, backend="triton", cu_seqlens=cu_seqlens)
    assert reads.count(True) == 2


def test_packed_rows_must_be_one_batch_row_and_float_boundaries_are_refused():
    docs = _documents([64, 64])
    two_rows = {k: torch.cat([docs[0][k].detach(), docs[1][k].detach()], dim=0) for k in ORDER}
    with pytest.raises(ValueError, match="B = 1"):
        nsa_attention(**two_rows, **HP, cu_seqlens=torch.tensor([0, 64]))
    with pytest.raises(ValueError, match="integer"):
        nsa_attention(**docs[0], **HP, cu_seqlens=torch.tensor([0.0, 64.0]))


def test_a_backend_without_packing_says_so():
    from components.errors import UserError
    from components.nsa.backends import register_backend, unregister_backend

    def unpacked_only(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, block_size, block_stride,
                      sel_block_size, num_selected, window_size):
        return reference_attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, block_size, block_stride,
                                   sel_block_size, num_selected, window_size)

    docs = _documents([20, 12], dtype=torch.float32)
    packed, cu_seqlens = _packed(docs)
    register_backend("unpacked_only", unpacked_only)
    try:
        nsa_attention(**docs[0], **HP, backend="unpacked_only")  # unpacked calls work as before
        with pytest.raises(UserError, match="'unpacked_only' does not take packed documents"):
            nsa_attention(**packed, **HP, cu_seqlens=cu_seqlens, backend="unpacked_only")
    finally:
        unregister_backend("unpacked_only")


@pytest.mark.parametrize("mode", ["mlp", "mean"])
def test_document_layout_and_compression_restart_at_each_document(mode):
    """Compressed blocks never straddle a boundary: packed compression equals each document's own,
    and positions (tokens and compressed keys) count from each document's start."""
    from components.nsa import KVCompressor, compressed_block_positions
    from components.nsa.documents import document_layout

    lengths = [1, 5, 12, 19, 70, 3]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    layout = document_layout(cu_seqlens, sum(lengths), 8, 4)
    phi = KVCompressor(mode, 8, 4, D)
    if mode == "mlp":
        torch.nn.init.normal_(phi.pos_embed)
    x = torch.randn(1, sum(lengths), HKV, D)
    alone, positions, block_positions, start = [], [], [], 0
    for n in lengths:
        alone.append(phi(x[:, start:start + n]))
        positions.append(torch.arange(n))
        block_positions.append(compressed_block_positions(num_compressed_blocks(n, 8, 4), 8, 4))
        start += n
    torch.testing.assert_close(phi(x, layout.block_starts), torch.cat(alone, dim=1), rtol=0, atol=0)
    assert torch.equal(layout.positions, torch.cat(positions))
    assert torch.equal(layout.block_positions, torch.cat(block_positions))
    assert layout.block_starts.tolist() == [1 + 5 + 0, 1 + 5 + 4, 18, 22, 26, 37, 41, 45, 49, 53, 57, 61, 65, 69,
                                            73, 77, 81, 85, 89, 93, 97]
