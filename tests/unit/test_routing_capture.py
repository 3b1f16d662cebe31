"""Reading vLLM's own routed-experts capture (router replay on CUDA), the parts that need no
engine: why only the first TP rank's scheduler side of vLLM's connector asks for rows,
the first rank serving each rank of the engine its own rows over the engine's gloo group, and
a finished request's rows kept by sample key and checked against its sequence. The engine
with vLLM's connector around it at TP 2 is tests/distributed/test_routed_capture.py."""

from __future__ import annotations

import numpy as np
import pytest

from fsdp_rlhf.rollout.routing import RoutingError
from fsdp_rlhf.rollout.vllm.moe import CapturedRouting, rows_on_first_rank_only
from tests.dist_utils import run_distributed


def test_only_the_first_ranks_scheduler_side_asks_for_rows():
    """vLLM 0.32's scheduler side of the connector asks every emitting request's rows of its
    runner's output; the runner of a TP rank but the first keeps none, so each such rank's
    scheduler failed at its first step. There it now takes none; the first rank's still fails
    without them (the rows are asked where they are)."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector
    from vllm.v1.request import Request

    request = Request("r0", [1, 2, 3], SamplingParams(max_tokens=4), None)
    missing = "auxiliary output worker output is missing r0"
    with pytest.raises(AssertionError, match=missing):
        AuxOutputSchedulerConnector().take_output(request, None)
    first, other = (_Scheduler(AuxOutputSchedulerConnector()) for _ in range(2))
    assert rows_on_first_rank_only(first, first=True) == "connector"
    assert rows_on_first_rank_only(other, first=False) == "connector"
    assert other.aux_output_connector.take_output(request, None) is None
    with pytest.raises(AssertionError, match=missing):
        first.aux_output_connector.take_output(request, None)
    with pytest.raises(RuntimeError, match="capture is off"):
        rows_on_first_rank_only(_Scheduler(None), first=True)
    with pytest.raises(RuntimeError, match="neither the routed-experts connector"):
        rows_on_first_rank_only(object(), first=True)


class _Scheduler:
    """Where vLLM 0.32's scheduler holds its side of the connector (None: capture off)."""

    def __init__(self, side) -> None:
        self.aux_output_connector = side


class _Completion:
    def __init__(self, n_tokens: int, routed) -> None:
        self.token_ids = list(range(n_tokens))  # a DELTA output: the last step's tokens only
        self.routed_experts = routed


class _Output:
    def __init__(self, finished: bool, routed) -> None:
        self.finished = finished
        self.prompt_token_ids = [1, 2, 3]
        self.outputs = [_Completion(1, routed)]


def test_finished_requests_rows_are_kept_by_key_and_checked_against_the_sequence():
    # vLLM's rows: every decoder layer (3, the dense first one unfilled), k = 2, uint8
    rows = np.arange(7 * 3 * 2, dtype=np.uint8).reshape(7, 3, 2)
    captured = CapturedRouting(layers=[1, 2], dtype=np.int16)
    captured.note((0, 0), _Output(False, None))  # still running: nothing yet
    captured.note((0, 1), _Output(True, rows))
    with pytest.raises(RoutingError, match=r"no routed experts for samples \[\(0, 0\)\]"):
        captured.take([(0, 0)], [8])
    with pytest.raises(RoutingError, match="returned 7 positions .* 9 tokens"):
        captured.take([(0, 1)], [9])
    captured.note((0, 1), _Output(True, rows))
    (got,) = captured.take([(0, 1)], [8])  # a sequence of 8 tokens: 7 routed positions
    assert got.dtype == np.int16 and np.array_equal(got, rows[:, 1:])
    captured.note((1, 0), _Output(True, rows))
    captured.clear()  # a new rollout
    with pytest.raises(RoutingError):
        captured.take([(1, 0)], [8])


def _serve(rank: int, world: int) -> dict:
    from fsdp_rlhf.rollout.groups import build_rollout_groups, serve_from_first

    groups = build_rollout_groups(2)
    held = {f"k{i}": np.full((i + 1, 2), i) for i in range(5)}  # only the first rank's

    def lookup(keys):
        return [held[k] for k in keys]

    wanted = {0: ["k0", "k3"], 1: ["k4", "k1", "k2"]}[rank]
    got = serve_from_first(groups, wanted, lookup if rank == 0 else None)
    try:
        serve_from_first(groups, ["k9"], lookup if rank == 0 else None)
        error = None
    except KeyError as e:
        error = str(e)
    return {"got": [(a.shape[0], int(a[0, 0])) for a in got], "error": error}


def test_the_first_rank_serves_each_rank_its_own_rows():
    """Each rank asks its keys; the first rank alone holds the rows; a failed look-up there
    raises on every rank (none is left waiting in the scatter)."""
    results = run_distributed(_serve, 2)
    assert results[0]["got"] == [(1, 0), (4, 3)]
    assert results[1]["got"] == [(5, 4), (2, 1), (3, 2)]
    assert [r["error"] for r in results] == ["'k9'", "'k9'"]
