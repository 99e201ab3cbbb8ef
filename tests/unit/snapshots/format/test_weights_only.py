"""The save-time guarantee behind after-save retention: every state the stager accepts loads
back with ``torch.load(weights_only=True)``, equal to what was captured. A state it cannot
guarantee is refused at the call (UnsafeStateError), never discovered at restore time."""

from __future__ import annotations

import collections
import enum
import math
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapshots import UnsafeStateError
from snapshots.format.serialization import Stager, deserialize, serialize

# Prototype/beta/deprecation notices of the odd tensor kinds this test feeds on purpose.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Color(enum.IntEnum):
    RED = 1


class Name(str):
    pass


class Ratio(float):
    pass


class Wrapped(torch.Tensor):
    pass


def _with_metadata(mapping: dict[str, Any], ordered: bool) -> Any:
    out: Any = collections.OrderedDict(mapping) if ordered else _Meta(mapping)
    out._metadata = {"": {"version": 2}}
    return out


class _Meta(dict):  # a dict subclass carrying module versions, as some state_dicts do
    pass


TENSORS = {
    "float": lambda: torch.randn(3, 2),
    "bf16": lambda: torch.ones(4, dtype=torch.bfloat16),
    "complex": lambda: torch.ones(2, dtype=torch.complex64),
    "bool": lambda: torch.tensor([True, False]),
    "fp8": lambda: torch.ones(2).to(torch.float8_e4m3fn),
    "empty": lambda: torch.empty(0, 3),
    "transposed": lambda: torch.arange(6.0).reshape(2, 3).t(),
    "parameter": lambda: torch.nn.Parameter(torch.ones(2)),
    "subclass": lambda: torch.ones(2).as_subclass(Wrapped),
    "sparse": lambda: torch.eye(3).to_sparse(),
    "csr": lambda: torch.eye(3).to_sparse_csr(),
    "quantized": lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
    "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    "meta": lambda: torch.empty(2, device="meta"),
}

# Leaves that look plain but are not (subclasses, numpy scalars, odd tensors) sit next to
# the real ones: the property must hold for every mix.
LEAVES = st.sampled_from(
    [
        0,
        -(10**30),
        1.5,
        math.inf,
        True,
        None,
        "s",
        b"\x00b",
        1 + 2j,
        torch.float16,
        torch.device("cpu"),
        torch.Size([2, 3]),
        Color.RED,
        Name("n"),
        Ratio(0.5),
        np.float64(1.5),
        np.int64(3),
        np.ones(2),
        {1, 2},
        bytearray(b"x"),
        range(3),
        object(),
    ]
) | st.builds(lambda kind: TENSORS[kind](), st.sampled_from(sorted(TENSORS)))

KEYS = st.sampled_from(["a", "b", 0, 1.5, True, None, Color.RED, Name("k"), (1, 2)])


def _trees(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(leaves, max_size=3),
        st.lists(leaves, max_size=3).map(tuple),
        st.dictionaries(KEYS, leaves, max_size=3),
        st.builds(_with_metadata, st.dictionaries(st.just("w"), leaves), st.booleans()),
        st.dictionaries(st.just("x"), leaves).map(lambda d: collections.defaultdict(int, d)),
    )


STATES = st.dictionaries(
    st.sampled_from(["model", "opt", "extra"]),
    st.recursive(LEAVES, _trees, max_leaves=8),
    max_size=3,
)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return type(b) is torch.Tensor and _same_tensor(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_quantized:
        return b.is_quantized and torch.equal(a.dequantize(), b.dequantize())
    if a.layout != torch.strided:
        return a.layout == b.layout and torch.equal(a.to_dense(), b.to_dense())
    same_form = a.dtype == b.dtype and a.shape == b.shape
    return same_form and torch.equal(_bytes(a), _bytes(b))  # bitwise: NaN and fp8 too


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(STATES)
def test_whatever_the_stager_accepts_loads_with_weights_only(state: dict[str, Any]) -> None:
    try:
        staged = Stager().capture(state)
    except UnsafeStateError:
        return  # refused at the call: the promise is kept
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse tensors warn about invariants checks
        loaded = {k: deserialize(serialize(v), what=k) for k, v in staged.items()}
    assert _same(staged, loaded)


@pytest.mark.parametrize(
    "value",
    [Color.RED, Name("n"), Ratio(0.5), np.float64(1.5), {Color.RED: 1}, {Name("k"): 1}],
    ids=["IntEnum", "str subclass", "float subclass", "numpy float64", "enum key", "str key"],
)
def test_subclasses_of_plain_types_are_refused_at_the_call(value: Any) -> None:
    with pytest.raises(UnsafeStateError):
        Stager().capture({"x": value})


@pytest.mark.parametrize("kind", ["nested", "meta"])
def test_tensors_without_a_plain_form_are_refused_at_the_call(kind: str) -> None:
    with pytest.raises(UnsafeStateError, match=kind):
        Stager().capture({"x": TENSORS[kind]()})


def test_an_empty_state_is_refused_at_the_call() -> None:
    with pytest.raises(UnsafeStateError, match="empty"):
        Stager().capture({})
