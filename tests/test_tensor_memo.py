"""components.nsa.tensor_memo: what the host reads of offsets and the Triton backend's kept tables rely on."""

import gc
import weakref

import torch

from components.nsa.documents import host_values
from components.nsa.tensor_memo import TensorMemo


def test_a_value_is_built_once_per_tensor_key_and_version():
    memo, built = TensorMemo(), []

    def build(tag):
        built.append(tag)
        return len(built)

    a, b = torch.tensor([0, 3, 7]), torch.tensor([0, 3, 7])
    assert memo.get(a, "x", lambda: build("a.x")) == memo.get(a, "x", lambda: build("again")) == 1
    assert memo.get(a, "y", lambda: build("a.y")) == 2
    assert memo.get(b, "x", lambda: build("b.x")) == 3  # equal values, another tensor
    a.add_(1)  # an in-place change drops every entry of a
    assert memo.get(a, "x", lambda: build("a.x changed")) == 4
    assert memo.get(a, "y", lambda: build("a.y changed")) == 5
    assert built == ["a.x", "a.y", "b.x", "a.x changed", "a.y changed"]


def test_entries_go_with_their_tensor():
    memo = TensorMemo()
    t = torch.arange(4)
    memo.get(t, "x", lambda: "built")
    alive = weakref.ref(t)
    assert len(memo) == 1
    del t
    gc.collect()
    assert alive() is None and len(memo) == 0


def test_host_values_follow_an_in_place_change_and_inference_tensors():
    cu = torch.tensor([0, 5, 9])
    assert host_values(cu) == (0, 5, 9)
    cu[1] = 4
    assert host_values(cu) == (0, 4, 9)
    with torch.inference_mode():
        frozen = torch.tensor([0, 2, 9])
        assert host_values(frozen) == (0, 2, 9)
        frozen[1] = 3  # no version counter: read every time
        assert host_values(frozen) == (0, 3, 9)
