"""RequestInfo, Decision, Outcome and RequestSpec: plain classes with value semantics."""

from __future__ import annotations

import copy
import pickle

import pytest

from kiloserve.policies.base import Decision, Outcome, RequestInfo


def _info(**changes: object) -> RequestInfo:
    fields: dict[str, object] = {
        "request_id": "r1", "model": "m", "input_tokens": 10, "predicted_output_tokens": 5,
        "prefix_hashes": (1, 2), "tenant": "t",
    }  # fmt: skip
    fields.update(changes)
    return RequestInfo(**fields)  # type: ignore[arg-type]


def test_equality_and_hash_follow_every_field() -> None:
    assert _info() == _info() and hash(_info()) == hash(_info())
    assert _info() != _info(priority=1)
    assert _info() != _info(prefix_hashes=(1, 3))
    assert len({_info(), _info(), _info(tenant=None)}) == 2
    assert Outcome(ok=True, ttft_ms=1.0) == Outcome(True, 200, 1.0)
    assert Outcome(ok=True) != Outcome(ok=False)
    assert Decision(("a", "b"), "p") == Decision(ranked=("a", "b"), policy="p", reason="")
    assert Decision(("a", "b"), "p") != Decision(("b", "a"), "p")
    assert _info() != Outcome(ok=True) and Outcome(ok=True) != (True, 200, None, None, 0)


def test_decision_with_scores_is_hashable() -> None:
    d = Decision(("a",), "p", scores={"a": 1.0})
    assert hash(d) == hash(Decision(("a",), "p", scores={"a": 2.0}))
    assert d != Decision(("a",), "p", scores={"a": 2.0})
    assert d.backend_id == "a" and Decision((), "p").backend_id is None


def test_repr_names_fields_in_constructor_order() -> None:
    assert repr(Outcome(ok=False, status=503)) == (
        "Outcome(ok=False, status=503, ttft_ms=None, tpot_ms=None, output_tokens=0)"
    )
    assert repr(_info()).startswith("RequestInfo(request_id='r1', model='m', input_tokens=10,")


def test_with_admission_copies_everything_else() -> None:
    info = _info(session_key="s", max_tokens=7)
    admitted = info.with_admission(3, "tenant-a")
    assert (admitted.priority, admitted.tenant) == (3, "tenant-a")
    assert admitted == _info(session_key="s", max_tokens=7, priority=3, tenant="tenant-a")
    assert (info.priority, info.tenant) == (0, "t")  # the original is unchanged


def test_copy_and_pickle_round_trip() -> None:
    for value in (_info(), Decision(("a",), "p", "why"), Outcome(ok=True, output_tokens=3)):
        assert copy.deepcopy(value) == value
        assert pickle.loads(pickle.dumps(value)) == value


def test_request_spec_is_a_value_and_replaced_copies() -> None:
    from kiloserve.workload.request import RequestSpec

    spec = RequestSpec("r", 1.5, 10, 20, "hi there", user="u")
    assert spec == RequestSpec("r", 1.5, 10, 20, "hi there", None, "u", None)
    assert hash(spec) == hash(RequestSpec("r", 1.5, 10, 20, "hi there", user="u"))
    short = spec.replaced(output_tokens=2)
    assert isinstance(short, RequestSpec) and short.output_tokens == 2
    assert short.replaced(output_tokens=20) == spec and spec.output_tokens == 20
    assert not spec.is_closed_loop and spec.replaced(arrival_s=None).is_closed_loop
    with pytest.raises(TypeError, match="no field"):
        spec.replaced(outputs=3)
    assert pickle.loads(pickle.dumps(spec)) == spec


def test_decision_with_ranked_is_replaced_ranked() -> None:
    decision = Decision(("a", "b", "c"), "p", "why", {"a": 1.0}, {"a": 3})
    narrowed = decision.with_ranked(("b",))
    assert narrowed == decision.replaced(ranked=("b",))
    assert (narrowed.scores, narrowed.cached_blocks) == ({"a": 1.0}, {"a": 3})
