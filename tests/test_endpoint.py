"""The OpenAI-compatible endpoint (`megarl.rollout.agents.endpoint`, `.agent`), driven by
the real `openai` client, every turn sampled by a real vLLM engine (one in this process, started
once for the module: a tiny Llama with random "dummy" weights over the toy character tokenizer).

The chat template renders tools (their count, so the toy alphabet encodes it), ends an assistant
turn with "<eos> " (a turn end longer than the stop token), and the stop ids are <eos>, "+" and
"=", so turns end early and at different tokens. The tool parser is vLLM's registry's, with a
parser registered here that reads the digits of a turn as a call `lookup(key=<digits>)` (the toy
alphabet cannot spell a real tool-call format). Every call into the engine is recorded (the
engine itself runs) and each session's tokens are checked against them.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from megarl.data.toy import toy_tokenizer
from megarl.envs.config import EnvConfig
from megarl.envs.tool_calls import ToolSetupError
from megarl.models.hf_config import arch_from_hf
from megarl.rollout.agents.agent import AgentTrajectory
from megarl.rollout.agents.endpoint import ChatEndpoint
from megarl.rollout.agents.session import NOT_EXTENDING
from megarl.rollout.config import EngineConfig, SamplingConfig
from megarl.rollout.engine.engine import RolloutEngine
from megarl.rollout.multi_turn.batcher import TurnResult
from megarl.rollout.multi_turn.trajectory import TurnLimits
from megarl.rollout.multi_turn.waves import WaveBatcher
from megarl.rollout.seeds import turn_seed
from tests.sync_workers import LLAMA, model_dir
from tests.tiny import vllm_in_this_process

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

TEMPLATE = (
    "{% if tools %}{{ tools | length }}+{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}<eos> "
    "{% elif m['role'] == 'tool' %}+{{ m['content'] }}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}={% endif %}"
)
HF = {**LLAMA, "vocab_size": 20}  # the toy tokenizer's 20 ids
STOP = (2, 13, 14)  # <eos>, "+", "="
SEED = 5
PARSER = "megarl_test_digits"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a key up.",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string"}},
                "required": ["key"],
            },
        },
    }
]


def register_digits_parser() -> None:
    """vLLM tool parser `PARSER`: the digits of a turn are a call lookup(key=digits)."""
    from vllm.entrypoints.generate.base.protocol import (
        ExtractedToolCallInformation,
        FunctionCall,
        ToolCall,
    )
    from vllm.tool_parsers import ToolParserManager
    from vllm.tool_parsers.abstract_tool_parser import ToolParser

    class DigitsToolParser(ToolParser):
        def extract_tool_calls(self, model_output, request):
            digits = "".join(c for c in model_output if c.isdigit())
            if not digits:
                return ExtractedToolCallInformation(
                    tools_called=False, tool_calls=[], content=model_output
                )
            call = FunctionCall(name="lookup", arguments=json.dumps({"key": digits}))
            rest = "".join(c for c in model_output if not c.isdigit())
            return ExtractedToolCallInformation(
                tools_called=True, tool_calls=[ToolCall(function=call)], content=rest
            )

    ToolParserManager.register_module(PARSER, force=True, module=DigitsToolParser)


def tokenizer():
    tok = toy_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def engine():
    """One vLLM engine for the module, in this process (`tests.tiny.vllm_in_this_process`)."""
    with vllm_in_this_process():
        register_digits_parser()
        cfg = SamplingConfig(n=1, max_tokens=6, stop_token_ids=STOP, seed=7)
        eng = RolloutEngine(
            model_dir(HF), arch_from_hf(HF), cfg, EngineConfig(kv_cache_memory_bytes=64 * 2**20)
        )
        try:
            yield eng
        finally:
            eng.close()


def env_cfg(**kw):
    base = dict(agent="unused:agent", max_turns=3, max_tokens=40, tool_parser=PARSER)
    return EnvConfig(**{**base, **kw})


def run_agents(engine, agents: list, cfg, *, hold=None, clock=None, on_wave=None) -> dict:
    """Run one trajectory per agent function (index i, row {"prompt": "copy 3<i>"}) through an
    endpoint, the batcher and the engine (whose calls are recorded). `hold`: an event every
    wave waits for before it generates; `clock`: the batcher's (time limits); `on_wave()`: runs
    before each wave generates."""
    calls: list = []

    def wave(requests):
        if hold is not None:
            hold.wait(30)
        if on_wave is not None:
            on_wave()
        kw = dict(
            n=1,
            seeds=[r.seed for r in requests],
            max_tokens=[r.max_tokens for r in requests],
        )
        ro = engine.generate([r.ids for r in requests], **kw)
        calls.append(([r.ids for r in requests], kw, ro))
        rows = zip(ro.response_ids, ro.response_logprobs, ro.finish_reason, strict=True)
        return [TurnResult(i, lp, f) for i, lp, f in rows]

    endpoint = ChatEndpoint(tokenizer(), cfg)
    limits = TurnLimits(engine.sampling.max_tokens, engine.max_model_len)
    with endpoint:
        runs = [
            AgentTrajectory(cfg, fn, endpoint, {"prompt": f"copy 3{i}"}, SEED, i, limits)
            for i, fn in enumerate(agents)
        ]
        batcher = WaveBatcher(wave, cfg.wave_wait_s, *([clock] if clock is not None else []))
        clients = [batcher.client() for _ in runs]
        threads = [
            threading.Thread(target=r.run, args=(batcher, c), daemon=True)
            for r, c in zip(runs, clients, strict=True)
        ]
        for t in threads:
            t.start()
        batcher.serve()
        for r, c, t in zip(runs, clients, threads, strict=True):
            if c.timed_out:
                r.abandoned()
            else:
                t.join(30)
        for r in runs:
            if r.bug is not None:
                raise r.bug
    return {"runs": runs, "calls": calls, "waves": batcher.waves, "endpoint": endpoint}


def check_exact(run, calls, fmt) -> int:
    """The session's ids against the engine calls that sampled them: each turn asked from
    exactly the ids before it, the trained ids are prompt + sampled + observation ids in order,
    mask 1 exactly on sampled ids, vLLM's logprobs on them and 0 elsewhere. Returns the turns."""
    by_seed = {}
    for prompts, kw, ro in calls:
        for i, s in enumerate(kw["seeds"]):
            by_seed[s] = (prompts[i], ro.response_ids[i], ro.response_logprobs[i])
    tok, rec = run.tokens, run.record
    initial = []
    for m in rec.messages:
        if m["role"] == "assistant":
            break
        initial.append(m)
    assert tok.prompt == fmt.prompt_ids(initial)
    observations, current, seen = [], [], False
    for m in rec.messages:
        if m["role"] == "assistant":
            if seen:
                observations.append(current)
            current, seen = [], True
        elif seen:
            current.append(m)
    resp, mask, lps = tok.response, tok.mask, tok.logprobs
    assert len(resp) == len(mask) == len(lps)
    at = 0
    for t in range(rec.turns):
        asked, out, out_lps = by_seed[turn_seed(SEED, t, run.index)]
        assert asked == tok.prompt + resp[:at]
        assert resp[at : at + len(out)] == out and mask[at : at + len(out)] == [1] * len(out)
        assert lps[at : at + len(out)] == out_lps
        at += len(out)
        if t < rec.turns - 1:
            want = fmt.observation_ids(observations[t], out[-1] if out[-1] in STOP else None)
            assert resp[at : at + len(want)] == want
            assert mask[at : at + len(want)] == [0] * len(want)
            assert lps[at : at + len(want)] == [0.0] * len(want)
            at += len(want)
    assert at == len(resp)
    return rec.turns


def client_for(base_url):
    """An unmodified client (its retries on: every error says x-should-retry: false)."""
    return openai.OpenAI(base_url=base_url, api_key="x")


def test_tool_calls_two_sessions_one_wave_token_exact(engine):
    """Two agents with tools, three requests each, in one batcher: every turn a tool call is
    answered by a tool message, any other by a user message; both sessions are token-exact and
    their first turns share a wave."""
    seen: dict[int, list] = {}

    def make_agent(i):
        def agent(row, base_url, seed):
            client = client_for(base_url)
            models = [m.id for m in client.models.list()]
            messages = [{"role": "user", "content": row["prompt"]}]
            log = seen.setdefault(i, [])
            for _ in range(3):
                resp = client.chat.completions.create(
                    model="megarl-policy", messages=messages, tools=TOOLS, temperature=0.1
                )
                msg = resp.choices[0].message
                log.append((resp.choices[0].finish_reason, msg, resp.usage, models))
                messages.append(msg.model_dump(exclude_none=True))
                if msg.tool_calls:
                    for call in msg.tool_calls:
                        messages.append({"role": "tool", "tool_call_id": call.id, "content": "7"})
                else:
                    messages.append({"role": "user", "content": " copy 5"})
            return 0.25 * i

        return agent

    cfg = env_cfg(wave_wait_s=5.0)
    out = run_agents(engine, [make_agent(0), make_agent(1)], cfg)
    fmt = out["endpoint"].chat_format(TOOLS)
    runs = out["runs"]
    assert out["waves"][0] == 2
    for r in runs:
        rec = r.record
        assert check_exact(r, out["calls"], fmt) == 3
        assert rec.finish_reason in ("stop", "length") and rec.error is None
        assert rec.env_reward == 0.25 * r.index and rec.retokenize_diff is not None
        assert rec.completion == rec.messages[-1]["content"]
    assert runs[0].tokens.response != runs[1].tokens.response
    finishes = [f for log in seen.values() for f, *_ in log]
    assert "tool_calls" in finishes, finishes
    for log in seen.values():
        for finish, msg, usage, models in log:
            assert models == ["megarl-policy"]
            assert (finish == "tool_calls") == bool(msg.tool_calls) or finish == "length"
            assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
            for call in msg.tool_calls or []:
                assert call.function.name == "lookup"
                assert json.loads(call.function.arguments)["key"].isdigit()
    # a tool call's answer went back as a tool message, rendered as its observation
    for r in runs:
        msgs = r.record.messages
        for j, m in enumerate(msgs[:-1]):
            if m.get("tool_calls"):
                assert msgs[j + 1]["role"] == "tool"
                assert msgs[j + 1]["tool_call_id"] == m["tool_calls"][0]["id"]
    assert sum(r.record.info.get("tool_calls", 0) for r in runs) >= 1


def test_refusals_limits_and_failures(engine):
    """Requests that do not extend the conversation, streaming, a concurrent request, too many
    turns and the token budget get OpenAI errors; an agent that raises ends with env_error."""
    got: dict = {}
    hold = threading.Event()
    hold.set()

    def rewriter(row, base_url, seed):
        client = client_for(base_url)
        messages = [{"role": "user", "content": row["prompt"]}]
        msg = client.chat.completions.create(model="m", messages=messages).choices[0].message
        changed = [{"role": "user", "content": "copy 99"}, msg.model_dump(exclude_none=True)]
        for bad in (
            [*changed, {"role": "user", "content": "5"}],  # an earlier message changed
            [*messages, {"role": "user", "content": "5"}],  # the assistant turn left out
            [*messages, msg.model_dump(exclude_none=True)],  # nothing new
        ):
            try:
                client.chat.completions.create(model="m", messages=bad)
            except openai.BadRequestError as e:
                got.setdefault("rewriter", []).append((e.status_code, e.message))
        try:
            client.chat.completions.create(model="m", messages=messages, stream=True)
        except openai.BadRequestError as e:
            got["stream"] = e.message
        # the session still takes a good continuation, whitespace changed in its history
        spaced = {**msg.model_dump(exclude_none=True), "content": f" {msg.content} "}
        messages += [spaced, {"role": "user", "content": " copy 5"}]
        resp = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
        got["short"] = resp.usage.completion_tokens
        return 1.0

    def too_many(row, base_url, seed):
        client = client_for(base_url)
        messages = [{"role": "user", "content": row["prompt"]}]
        for k in range(4):
            try:
                resp = client.chat.completions.create(model="m", messages=messages)
            except openai.BadRequestError as e:
                got.setdefault("max_turns", []).append((k, e.code, e.message))
                continue
            messages += [
                resp.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": " copy 5"},
            ]
        return 0.5

    def raiser(row, base_url, seed):
        client_for(base_url).chat.completions.create(
            model="m", messages=[{"role": "user", "content": row["prompt"]}]
        )
        raise RuntimeError("the agent broke")

    def concurrent(row, base_url, seed):
        client = client_for(base_url)
        messages = [{"role": "user", "content": row["prompt"]}]
        hold.clear()  # the waves wait: the first request stays in flight
        first = threading.Thread(
            target=lambda: got.setdefault(
                "first", client.chat.completions.create(model="m", messages=messages)
            )
        )
        first.start()
        time.sleep(0.3)
        try:
            client.chat.completions.create(model="m", messages=messages)
        except openai.ConflictError as e:
            got["conflict"] = (e.status_code, e.message)
        hold.set()
        first.join(30)
        return None

    def budget(row, base_url, seed):
        client = client_for(base_url)
        messages = [{"role": "user", "content": row["prompt"]}]
        for _ in range(3):
            try:
                resp = client.chat.completions.create(model="m", messages=messages)
            except openai.BadRequestError as e:
                got["budget"] = (e.code, e.message)
                break
            messages += [
                resp.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": " copy 55555555555555555555"},
            ]
        return None

    agents = [rewriter, too_many, raiser, concurrent, budget]
    cfg = env_cfg(max_turns=2, max_tokens=24, wave_wait_s=0.2)
    out = run_agents(engine, agents, cfg, hold=hold)
    fmt = out["endpoint"].chat_format(None)
    runs = {fn.__name__: r for fn, r in zip(agents, out["runs"], strict=True)}
    for r in runs.values():
        check_exact(r, out["calls"], fmt)

    assert [s for s, _ in got["rewriter"]] == [400, 400, 400]
    assert all(NOT_EXTENDING in m for _, m in got["rewriter"][:2])
    assert "roles []" in got["rewriter"][2][1]
    assert "stream" in got["stream"]
    assert 1 <= got["short"] <= 2
    rec = runs["rewriter"].record
    assert rec.turns == 2 and rec.env_reward == 1.0 and rec.finish_reason in ("stop", "length")

    assert [(k, code) for k, code, _ in got["max_turns"]] == [
        (2, "max_turns_exceeded"),
        (3, "max_turns_exceeded"),
    ]
    assert "env.max_turns=2" in got["max_turns"][0][2]
    rec = runs["too_many"].record
    assert rec.finish_reason == "max_turns" and rec.turns == 2 and rec.env_reward == 0.5

    rec = runs["raiser"].record
    assert rec.finish_reason == "env_error" and rec.env_reward == 0.0 and rec.turns == 1
    assert "RuntimeError: the agent broke" in rec.error

    assert got["conflict"][0] == 409 and "one request at a time" in got["conflict"][1]
    assert got["first"].choices[0].message is not None
    assert runs["concurrent"].record.turns == 1

    code, message = got["budget"]
    assert code == "token_budget_exceeded" and "env.max_tokens=24" in message
    rec = runs["budget"].record
    assert rec.finish_reason == "length" and len(runs["budget"].tokens.response) <= 24


def test_timeouts_and_unknown_routes(engine):
    """An agent past env.timeout_s is abandoned (env_error, its session closed); an unknown
    session or route is a 404 in OpenAI's error shape."""
    urls: dict = {}
    late = threading.Event()

    def sleeper(row, base_url, seed):
        urls["sleeper"] = base_url
        time.sleep(4.0)
        late.set()
        return 1.0

    def quick(row, base_url, seed):
        urls["quick"] = base_url
        client = client_for(base_url)
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": row["prompt"]}]
        )
        root = base_url.rsplit("/s/", 1)[0]
        for path in ("/s/nosuchsession/v1/models", "/v2/models", "/s/x"):
            try:
                urllib.request.urlopen(root + path, timeout=10)
            except urllib.error.HTTPError as e:
                urls.setdefault("errors", []).append((e.code, json.loads(e.read())["error"]))
        return None

    # the quick agent's own time before its request (the client, a thread) stays far below 2 s
    # on a loaded machine; the sleeper's 4 s does not
    out = run_agents(engine, [sleeper, quick], env_cfg(timeout_s=2.0, wave_wait_s=0.1))
    sleeper_rec, quick_rec = (r.record for r in out["runs"])
    assert sleeper_rec.finish_reason == "env_error" and "env.timeout_s=2.0" in sleeper_rec.error
    assert sleeper_rec.env_reward == 0.0 and not out["runs"][0].tokens.prompt
    assert out["runs"][0].sample([3, 4]).prompt == [3, 4]
    assert quick_rec.finish_reason in ("stop", "length") and quick_rec.turns == 1
    assert [c for c, _ in urls["errors"]] == [404, 404, 404]
    assert all(set(e) == {"message", "type", "param", "code"} for _, e in urls["errors"])
    assert late.wait(5)


def test_a_megarl_failure_is_the_runs(engine):
    """A failure of megarl's own setup in a request (here: an unknown tool parser) is answered
    with 500 and re-raised by the caller, not hidden as the agent's env_error."""
    answers = []

    def agent(row, base_url, seed):
        try:
            client_for(base_url).chat.completions.create(
                model="m", messages=[{"role": "user", "content": row["prompt"]}], tools=TOOLS
            )
        except openai.InternalServerError as e:
            answers.append(e.status_code)
            raise

    with pytest.raises(ToolSetupError, match="env.tool_parser='no_such_parser'"):
        run_agents(engine, [agent], env_cfg(tool_parser="no_such_parser"))
    assert answers == [500]


def post(base_url: str, body: dict) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of a raw POST to the session's chat completions."""
    req = urllib.request.Request(
        base_url + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())


def test_what_a_request_may_ask_and_what_an_agent_may_return(engine):
    """`n > 1` is refused with OpenAI's error shape and `x-should-retry: false`; `tool_choice:
    "none"` turns tool-call parsing off for its turn; `max_completion_tokens` lowers a turn's
    limit; the first request's tools hold for the session (a request with other tools is
    refused; the turns are rendered and parsed with the first's); an agent that returns
    something other than a number or None, or that never asks the model, ends its trajectory
    with env_error."""
    got: dict = {}

    def options(row, base_url, seed):
        messages = [{"role": "user", "content": row["prompt"]}]
        got["n"] = post(base_url, {"model": "m", "messages": messages, "n": 2})
        client = client_for(base_url)
        for key, extra in (
            ("none", {"tools": TOOLS, "tool_choice": "none"}),
            ("one_token", {"tools": TOOLS, "max_completion_tokens": 1}),
            ("held", {"tools": TOOLS}),
        ):
            if key == "held":  # other tools than the first request's: refused, nothing changes
                try:
                    client.chat.completions.create(model="m", messages=messages, tools=TOOLS[:0])
                except openai.BadRequestError as e:
                    got["other_tools"] = (e.status_code, e.message)
            resp = client.chat.completions.create(model="m", messages=messages, **extra)
            got[key] = resp
            messages += [
                resp.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": " copy 5"},
            ]
        return 1.0

    def returns_text(row, base_url, seed):
        client_for(base_url).chat.completions.create(
            model="m", messages=[{"role": "user", "content": row["prompt"]}]
        )
        return "1.0"

    def never_asks(row, base_url, seed):
        return 1.0

    agents = [options, returns_text, never_asks]
    out = run_agents(engine, agents, env_cfg(max_tokens=40, wave_wait_s=0.2))
    runs = {fn.__name__: r for fn, r in zip(agents, out["runs"], strict=True)}

    status, headers, body = got["n"]
    assert status == 400 and headers["x-should-retry"] == "false"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == "n" and "n=2; accepted: 1" in body["error"]["message"]

    rec = runs["options"].record
    assert rec.finish_reason in ("stop", "length") and rec.error is None, rec.error
    assert rec.turns == 3
    said = [m for m in rec.messages if m["role"] == "assistant"]
    # tool_choice none: the turn's digits stay text (the digits parser would call lookup)
    assert any(c.isdigit() for c in said[0]["content"]), said[0]
    assert got["none"].choices[0].message.tool_calls is None and "tool_calls" not in said[0]
    assert got["one_token"].usage.completion_tokens == 1
    # the first request's tools hold: a request with others is refused; the session's tokens
    # are rendered with them and a later turn's call is parsed with them
    status, message = got["other_tools"]
    assert status == 400 and "tools differ from this session's first request's" in message
    check_exact(runs["options"], out["calls"], out["endpoint"].chat_format(TOOLS))
    held = got["held"].choices[0].message
    assert any(c.isdigit() for c in said[2]["content"]), said[2]
    assert held.tool_calls and held.tool_calls[0].function.name == "lookup"

    rec = runs["returns_text"].record
    assert rec.finish_reason == "env_error" and rec.env_reward == 0.0 and rec.turns == 1
    assert rec.error == "the agent returned str '1.0'; expected a float or None"
    rec = runs["never_asks"].record
    assert rec.finish_reason == "env_error" and rec.env_reward == 0.0 and rec.turns == 0
    assert rec.error == "the agent returned without a request to its base_url"


def test_the_time_a_request_waits_for_the_model_is_not_the_agents(engine):
    """env.timeout_s bounds the agent's own time between requests: while each of its requests
    waits for the model, the batcher's clock moves 100 x that limit, and the agent is not
    abandoned (that the limit runs on the batcher's clock and abandons an agent past it:
    `test_timeouts_and_unknown_routes`)."""

    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    clock = Clock()

    def advance():
        clock.t += 100.0

    def patient(row, base_url, seed):
        client = client_for(base_url)
        messages = [{"role": "user", "content": row["prompt"]}]
        for _ in range(2):
            resp = client.chat.completions.create(model="m", messages=messages)
            messages += [
                resp.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": " copy 5"},
            ]
        return 1.0

    cfg = env_cfg(timeout_s=1.0, wave_wait_s=0.1)
    out = run_agents(engine, [patient], cfg, clock=clock, on_wave=advance)
    rec = out["runs"][0].record
    assert rec.finish_reason in ("stop", "length") and rec.error is None and rec.turns == 2
    assert rec.env_reward == 1.0 and clock.t == 200.0  # two waves, each 100 limits long
