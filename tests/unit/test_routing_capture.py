"""Reading vLLM's own routed-experts capture (router replay on CUDA), the parts that need no
engine: why only the first TP rank's scheduler side of vLLM's connector asks for rows, and a
finished request's rows kept by sample key and checked against its sequence. The engine with
vLLM's connector around it at TP 2, the first rank serving the other its rows, is
tests/distributed/test_routed_capture.py."""

from __future__ import annotations

import numpy as np
import pytest

from fsdp_rlhf.rollout.routing import RoutingError
from fsdp_rlhf.rollout.vllm.moe import CapturedRouting, rows_on_first_rank_only


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
