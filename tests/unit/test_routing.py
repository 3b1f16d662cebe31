"""Routed experts from the engine's records (rollout.routing), their layout, and the routing
travelling with samples through experience batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fsdp_rlhf.rollout.routing import (
    RoutingError,
    StepRecord,
    assemble_routing,
    no_expert,
    pad_routing,
    routing_dtype,
)

LAYERS, K = 2, 2


def experts_of(seq_id: int, positions) -> np.ndarray:
    """A recognisable routing: expert ids derived from the sequence and the position."""
    pos = np.asarray(positions)
    base = (seq_id * 7 + pos)[:, None, None] + np.arange(LAYERS)[None, :, None] * 3
    return ((base + np.arange(K)[None, None, :]) % 50).astype(np.uint8)


def record(parts, media=()) -> StepRecord:
    """One engine step over ``parts``: (request, sequence id, tokens, first position);
    ``media``: each request's image ids."""
    reqs, starts, pos, tok, exp = [], [0], [], [], []
    for req, seq_id, tokens, first in parts:
        positions = np.arange(first, first + len(tokens))
        reqs.append(req)
        starts.append(starts[-1] + len(tokens))
        pos.append(positions)
        tok.append(np.asarray(tokens))
        exp.append(experts_of(seq_id, positions))
    return StepRecord(
        tuple(reqs),
        np.asarray(starts),
        np.concatenate(pos),
        np.concatenate(tok),
        np.concatenate(exp),
        tuple(media),
    )


def test_decode_steps_and_a_cached_prompt_head_are_assembled():
    prompt = [11, 12, 13, 14]
    a, b = [*prompt, 21, 22, 23], [*prompt, 31, 32]  # two samples of one prompt
    records = [
        record([("a", 0, prompt, 0)]),  # a computes the prompt
        record([("a", 0, [21], 4), ("b", 1, prompt[2:], 2)]),  # b: first 2 tokens cached
        record([("a", 0, [22], 5), ("b", 1, [31], 4)]),
    ]
    got = assemble_routing(records, [a, b], fill=255)
    assert got[0].shape == (len(a) - 1, LAYERS, K)
    np.testing.assert_array_equal(got[0], experts_of(0, range(6)))
    # b's head (positions 0-1) is a's routing of the same tokens; its own from there on
    np.testing.assert_array_equal(got[1][:2], experts_of(0, range(2)))
    np.testing.assert_array_equal(got[1][2:], experts_of(1, range(2, 5)))


def test_sequences_are_matched_by_content_whatever_the_request_names():
    s1, s2 = [1, 2, 3], [1, 2, 4]
    records = [record([("zz-9", 2, s2[:-1], 0), ("0_1-abc", 1, s1[:-1], 0)])]
    got = assemble_routing(records, [s1, s2], fill=255)
    np.testing.assert_array_equal(got[0], experts_of(1, range(2)))
    np.testing.assert_array_equal(got[1], experts_of(2, range(2)))


def test_the_same_tokens_with_other_images_are_told_apart_by_their_image_ids():
    """Two prompts of the colour task: the same tokens (an image's placeholder repeated once
    per image token, then the question), other images. Each sample of each prompt takes the
    routing of the request that computed it with its own image, and a sample whose prompt came
    from the prefix cache takes its head from the request with the same image, not the first
    with the same tokens."""
    pad = 9  # the image placeholder, expanded: 4 image tokens
    prompt = [1, pad, pad, pad, pad, 2, 3]
    red, blue = [*prompt, 40, 41], [*prompt, 40, 41]  # the same answer too
    red2 = [*prompt, 50]
    records = [
        record([("b", 1, blue[:-1], 0), ("r", 0, red[:-1], 0)], [("blue",), ("red",)]),
        record([("r2", 2, red2[5:-1], 5)], [("red",)]),  # its head from the prefix cache
    ]
    media = [("red",), ("blue",), ("red",)]
    got = assemble_routing(records, [red, blue, red2], fill=255, media=media)
    np.testing.assert_array_equal(got[0], experts_of(0, range(8)))
    np.testing.assert_array_equal(got[1], experts_of(1, range(8)))
    np.testing.assert_array_equal(got[2][:5], experts_of(0, range(5)))  # red's head
    np.testing.assert_array_equal(got[2][5:], experts_of(2, range(5, 7)))
    # the images are part of the content: no request computed red with a green image
    with pytest.raises(RoutingError, match="no engine forward computed it"):
        assemble_routing(records[:1], [red], fill=255, media=[("green",)])


def test_a_recomputed_position_keeps_the_last_computation():
    seq = [5, 6, 7, 8]
    records = [record([("r", 0, seq[:3], 0)]), record([("r", 9, seq[1:3], 1)])]  # preempted
    got = assemble_routing(records, [seq], fill=255)
    np.testing.assert_array_equal(got[0][0], experts_of(0, [0])[0])
    np.testing.assert_array_equal(got[0][1:], experts_of(9, [1, 2]))


def test_a_partial_rollouts_positions_keep_the_routing_that_sampled_the_next_token():
    """Two samples of one prompt (the step-by-step engine of router replay caches no prefix:
    each computes its own prompt). After 2 steps new weights load in flight: both requests
    are computed again from position 0 under the new weights (their KV recomputed), then a
    goes on. With ``keep_first`` (the step-by-step engine's) each position keeps its first
    computation, the forward that sampled the token after it: the old weights' up to the
    switch, the new weights' after it; without, the recomputation's experts win."""
    prompt = [11, 12, 13, 14]
    a, b = [*prompt, 21, 22, 23, 24], [*prompt, 31, 32, 33]
    records = [
        record([("a", 0, prompt, 0), ("b", 1, prompt, 0)]),  # old weights
        record([("a", 0, [21], 4), ("b", 1, [31], 4)]),
        # new weights: both computed again from 0, then decoding
        record([("a", 5, [*prompt, 21, 22], 0), ("b", 6, [*prompt, 31, 32], 0)]),
        record([("a", 5, [23], 6)]),
    ]
    first = assemble_routing(records, [a, b], fill=255, keep_first=True)
    assert [g.shape[0] for g in first] == [len(a) - 1, len(b) - 1]
    np.testing.assert_array_equal(first[0][:5], experts_of(0, range(5)))  # prompt, 21: old
    np.testing.assert_array_equal(first[0][5:], experts_of(5, [5, 6]))  # 22, 23: new
    np.testing.assert_array_equal(first[1][:5], experts_of(1, range(5)))
    np.testing.assert_array_equal(first[1][5], experts_of(6, [5])[0])  # 32: new
    last = assemble_routing(records, [a, b], fill=255)
    np.testing.assert_array_equal(last[0], experts_of(5, range(7)))  # all the new weights'
    np.testing.assert_array_equal(last[1], experts_of(6, range(6)))


def test_missing_routing_is_an_error_not_a_guess():
    seq = [1, 2, 3, 4]
    with pytest.raises(RoutingError, match="no engine forward computed it"):
        assemble_routing([record([("r", 0, [1, 2], 0)])], [seq], fill=255)
    # the head came from a cache no record of this rollout filled
    with pytest.raises(RoutingError, match="prefix cache"):
        assemble_routing([record([("r", 0, [3], 2)])], [seq], fill=255)


def test_pad_routing_lays_rows_out_like_the_sequences():
    r0 = experts_of(0, range(4))  # prompt 3 + response 2 -> 4 positions routed
    r1 = experts_of(1, range(2))  # prompt 2 + response 1
    out = pad_routing([r0, r1], [3, 2], prompt_width=4, response_width=3, dtype=torch.uint8)
    assert out.shape == (2, 7, LAYERS, K) and out.dtype == torch.uint8
    fill = no_expert(torch.uint8)
    assert (out[0, 0] == fill).all() and (out[0, 5:] == fill).all()  # left pad, last token
    assert torch.equal(out[0, 1:5], torch.from_numpy(r0))
    assert (out[1, :2] == fill).all() and torch.equal(out[1, 2:4], torch.from_numpy(r1))
    assert (out[1, 4:] == fill).all()


def test_routing_dtype_is_compact():
    assert routing_dtype(128) == torch.uint8 and no_expert(torch.uint8) == 255
    assert routing_dtype(384) == torch.int16 and no_expert(torch.int16) == -1


def test_routing_travels_through_trimming_and_concatenation():
    from fsdp_rlhf.trainers.experience import Experience
    from fsdp_rlhf.trainers.ppo.dynamic_filtering import concat_experiences

    def exp(P, T, fill):
        N = 2
        mask = torch.zeros(N, P + T, dtype=torch.long)
        mask[:, P - 1 : P + 1] = 1
        routed = torch.full((N, P + T, LAYERS, K), 255, dtype=torch.uint8)
        routed[:, P - 1] = fill
        return Experience(
            input_ids=torch.arange(N * (P + T)).view(N, P + T),
            attention_mask=mask,
            response_mask=mask[:, P:].float(),
            engine_logprobs=torch.zeros(N, T),
            routed_experts=routed,
        )

    trimmed = exp(5, 4, 3).trimmed()
    assert trimmed.routed_experts.shape[:2] == trimmed.input_ids.shape == (2, 2)
    assert (trimmed.routed_experts[:, 0] == 3).all()
    both = concat_experiences([exp(5, 4, 3), exp(3, 6, 4)], pad_id=0)
    assert both.routed_experts.shape[:2] == both.input_ids.shape == (4, 11)
    # each row's routed token stays on its token: the last prompt column
    assert (both.routed_experts[:2, 4] == 3).all() and (both.routed_experts[2:, 4] == 4).all()
    assert (both.routed_experts[2:, :2] == 255).all()  # the added left padding has none


def test_vllms_own_routing_keeps_the_moe_layers_and_checks_its_length():
    from types import SimpleNamespace

    from fsdp_rlhf.rollout.vllm.moe import routing_from_outputs

    all_layers = np.arange(5 * 4 * K).reshape(5, 4, K).astype(np.uint16)  # 4 decoder layers
    comp = SimpleNamespace(index=0, token_ids=[7, 8], routed_experts=all_layers)
    req = SimpleNamespace(prompt_token_ids=[1, 2, 3, 4], outputs=[comp])
    (got,) = routing_from_outputs([req], layers=[1, 3], dtype=np.uint8)
    assert got.dtype == np.uint8 and got.shape == (5, 2, K)
    np.testing.assert_array_equal(got, all_layers[:, [1, 3]])
    short = SimpleNamespace(index=0, token_ids=[7], routed_experts=all_layers)
    with pytest.raises(RoutingError, match="5 positions of routed experts for a sequence of 5"):
        routing_from_outputs(
            [SimpleNamespace(prompt_token_ids=[1, 2, 3, 4], outputs=[short])], [1], np.uint8
        )
