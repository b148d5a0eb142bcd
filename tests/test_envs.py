"""Environments and their plumbing, on CPU without a model: plugin loading, the registry, the
built-in `retry` and `tools` environments, running tools under a time limit, and vLLM's real
hermes tool parser over the toy character tokenizer (vLLM imported once, ~10 s)."""

from __future__ import annotations

import json
import logging
import pickle
import threading
from fractions import Fraction

import pytest

from megarl.envs import AssistantTurn, Observation, ToolCall
from megarl.envs.config import EnvConfig
from megarl.envs.registry import EnvironmentLoadError, environment_factory, load_agent
from megarl.envs.retry import RetryEnv, last_number
from megarl.envs.tool_calls import (
    ToolSetupError,
    call_tool,
    template_renders_tools,
    tool_schema,
    tools_system_message,
    with_tools,
)
from megarl.envs.tools import ToolsEnv, calculator
from megarl.errors import UserError
from megarl.plugins import PluginError, load_object
from megarl.rewards.scoring import RewardFunctionError, load_reward_function

PLUGIN = """
from dataclasses import dataclass

from megarl.envs import Environment, Observation

VALUE = 7


@dataclass
class Point:
    x: int


class Echo(Environment):
    def __init__(self, word="again", tool_timeout_s=None):
        self.word = word
        self.tool_timeout_s = tool_timeout_s

    def step(self, turn):
        return Observation(messages=[{"role": "user", "content": self.word}])


class NoStep:
    pass


class Picky(Environment):
    def __init__(self, level: int = 1):
        if level > 3:
            raise ValueError(f"level {level} > 3")

    def step(self, turn):
        return Observation(done=True)


def agent(row, base_url, seed):
    return 1.0


def half(prompts, completions, **kw):
    return [0.5] * len(completions)


def make_none():
    return None
"""


@pytest.fixture
def plugin_file(tmp_path, monkeypatch):
    """A plugin file `plugs.py` in a fresh cwd, importable as a module too."""
    path = tmp_path / "plugs.py"
    path.write_text(PLUGIN)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return path


def turn(content: str, calls=(), malformed=None, text=None) -> AssistantTurn:
    return AssistantTurn(text if text is not None else content, content, tuple(calls), malformed)


# ---------------------------------------------------------------- plugins
def test_load_object_from_module_dotted_and_file(plugin_file):
    assert load_object("plugs:VALUE", what="x") == 7
    assert load_object("plugs.VALUE", what="x") == 7
    assert load_object("plugs:Echo.step", what="x").__name__ == "step"
    from_file = load_object("plugs.py:Point", what="x")
    assert from_file.__module__.startswith("megarl_plugin_plugs_")
    assert load_object(str(plugin_file) + ":Point", what="x") is from_file  # loaded once
    # registered in sys.modules: dataclasses work, instances pickle by reference
    assert pickle.loads(pickle.dumps(from_file(3))) == from_file(3)


def test_load_object_errors_name_the_key_the_spec_and_the_cause(plugin_file, tmp_path):
    with pytest.raises(PluginError, match=r"^env.name 'plugs.py:Bar': file plugs.py has no 'Bar'"):
        load_object("plugs.py:Bar", what="env.name")
    with pytest.raises(PluginError, match=r"module 'plugs' has no 'Nope'; it defines: .*Echo"):
        load_object("plugs:Nope", what="env.name")
    with pytest.raises(PluginError, match=r"cannot import 'no_such_pkg_xyz'"):
        load_object("no_such_pkg_xyz:X", what="env.name")
    with pytest.raises(PluginError, match=r"no file 'missing.py' \(relative paths are read from"):
        load_object("missing.py:X", what="env.name")
    with pytest.raises(PluginError, match=r"'justaname' is not a plugin path; accepted: "):
        load_object("justaname", what="env.name")
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(PluginError, match=r"loading file broken.py raised RuntimeError: boom"):
        load_object("broken.py:X", what="env.name")
    with pytest.raises(PluginError):  # a file that failed is not left half-loaded
        load_object("broken.py:X", what="env.name")
    assert issubclass(PluginError, UserError) and issubclass(PluginError, ValueError)


def test_reward_function_from_a_file(plugin_file):
    fn = load_reward_function("plugs.py:half")
    assert fn(["p"], ["a", "b"]) == [0.5, 0.5]
    with pytest.raises(RewardFunctionError, match=r"'plugs.py:nope': file plugs.py has no"):
        load_reward_function("plugs.py:nope")
    with pytest.raises(RewardFunctionError, match="not callable"):
        load_reward_function("plugs.py:VALUE")


# ---------------------------------------------------------------- registry
def test_registry_builds_builtins_and_plugins(plugin_file):
    make = environment_factory(EnvConfig(name="retry", kwargs={"feedback": "no"}))
    env = make()
    assert isinstance(env, RetryEnv) and env.feedback == "no" and make() is not env
    make = environment_factory(EnvConfig(name="plugs.py:Echo", kwargs={"word": "hi"}))
    obs = make().step(turn("x"))
    assert obs.messages == [{"role": "user", "content": "hi"}]


def test_registry_injects_tool_settings_unless_kwargs_set_them(plugin_file):
    cfg = EnvConfig(name="plugs:Echo", tool_timeout_s=3.0)
    assert environment_factory(cfg)().tool_timeout_s == 3.0
    cfg = EnvConfig(name="plugs:Echo", kwargs={"tool_timeout_s": 1.5}, tool_timeout_s=3.0)
    assert environment_factory(cfg)().tool_timeout_s == 1.5
    env = environment_factory(EnvConfig(name="tools", tool_timeout_s=2.0, on_tool_error="end"))()
    assert (env.tool_timeout_s, env.on_tool_error) == (2.0, "end")
    # a constructor without those parameters gets neither
    assert environment_factory(EnvConfig(name="plugs:Picky", tool_timeout_s=2.0))()


def test_registry_errors(plugin_file):
    with pytest.raises(EnvironmentLoadError, match=r"'foo' is neither a built-in \(retry, tools\)"):
        environment_factory(EnvConfig(name="foo"))
    with pytest.raises(EnvironmentLoadError, match=r"file plugs.py has no 'Gone'"):
        environment_factory(EnvConfig(name="plugs.py:Gone"))
    with pytest.raises(EnvironmentLoadError, match=r"class NoStep has no step\(\) method"):
        environment_factory(EnvConfig(name="plugs:NoStep"))
    with pytest.raises(EnvironmentLoadError, match=r"'plugs:VALUE' is a int"):
        environment_factory(EnvConfig(name="plugs:VALUE"))
    with pytest.raises(EnvironmentLoadError, match=r"built a NoneType without a step\(\)"):
        environment_factory(EnvConfig(name="plugs:make_none"))
    with pytest.raises(EnvironmentLoadError) as info:
        environment_factory(EnvConfig(name="plugs:Picky", kwargs={"level": 5}))
    assert str(info.value) == (
        "env.name 'plugs:Picky' with env.kwargs={'level': 5}: building the environment raised "
        "ValueError: level 5 > 3; its parameters: (level)"
    )
    with pytest.raises(EnvironmentLoadError, match=r"env.kwargs=\{'colour': 1\}: .*TypeError"):
        environment_factory(EnvConfig(name="retry", kwargs={"colour": 1}))


def test_load_agent(plugin_file):
    assert load_agent(EnvConfig(agent="plugs.py:agent"))({}, "http://x", 0) == 1.0
    with pytest.raises(EnvironmentLoadError, match=r"env.agent 'plugs:VALUE' is a int, not"):
        load_agent(EnvConfig(agent="plugs:VALUE"))
    with pytest.raises(EnvironmentLoadError, match=r"env.agent 'plugs:gone': module 'plugs' has"):
        load_agent(EnvConfig(agent="plugs:gone"))
    with pytest.raises(EnvironmentLoadError, match="env.agent is null"):
        load_agent(EnvConfig(name="retry"))


# ---------------------------------------------------------------- retry
@pytest.mark.parametrize(
    "text, value",
    [
        ("The answer is 42.", Fraction(42)),
        ("first 3 then -7", Fraction(-7)),
        ("5-3", Fraction(3)),
        ("$1,000", Fraction(1000)),
        ("x = 2.50", Fraction(5, 2)),
        ("\\boxed{3/4}", Fraction(3, 4)),
        ("no number", None),
    ],
)
def test_last_number(text, value):
    assert last_number(text) == value


def test_retry_env():
    env = RetryEnv(feedback="Nope.", reward=2.0)
    prompt = [{"role": "user", "content": "2+2?"}]
    assert env.reset(prompt, {"prompt": "2+2?", "answer": "4"}, seed=0) is prompt
    wrong = env.step(turn("I think 5"))
    assert wrong == Observation(messages=[{"role": "user", "content": "Nope."}], reward=0.0)
    assert env.step(turn("so 4.0")) == Observation(reward=2.0, done=True)
    with pytest.raises(KeyError, match=r"no column 'answer' \(env.kwargs.answer_key\)"):
        RetryEnv().reset(prompt, {"prompt": "x", "solution": "4"}, seed=0)
    with pytest.raises(ValueError, match=r"column 'answer' holds 'four', which has no number"):
        RetryEnv().reset(prompt, {"answer": "four"}, seed=0)
    env = RetryEnv(answer_key="solution")
    env.reset(prompt, {"solution": 0.5}, seed=0)
    assert env.step(turn("1/2")).done is True


# ---------------------------------------------------------------- tools
def test_calculator():
    assert calculator("(2 + 3) * 4") == "20"
    assert calculator("7 / 2") == "3.5"
    assert calculator("-2 ** 3 + 17 // 5 % 3") == "-8"
    assert calculator("2 ** 10") == "1024"
    for bad, why in [
        ("__import__('os')", "is not allowed"),
        ("x + 1", "'x' is not allowed"),
        ("True + 1", "only numbers"),
        ("2 ** 100000", "exponent 100000 is too large"),
        ("9 ** 9 ** 9", "too large"),
        ("10.0 ** 400", "too large"),
        ("1 +", "not an arithmetic expression"),
    ]:
        with pytest.raises(ValueError, match=why):
            calculator(bad)
    with pytest.raises(ZeroDivisionError):
        calculator("1 / 0")
    assert tool_schema(calculator)["function"]["name"] == "calculator"
    assert tool_schema(calculator)["function"]["parameters"]["required"] == ["expression"]


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"boom {x}")


RELEASE = threading.Event()
"""Lets `sleepy` calls still running in the background finish when their test ends."""
WOKE = threading.Event()
"""Set by `sleepy` when it returns: still unset after a timed-out call, the caller did not wait
for the tool."""
_ASLEEP = threading.Semaphore(0)
"""One release per `sleepy` call that has returned (the fixture waits for them all)."""
_CALLS = [0]


@pytest.fixture
def release():
    RELEASE.clear()
    WOKE.clear()
    _CALLS[0] = 0
    yield
    RELEASE.set()
    for _ in range(_CALLS[0]):  # the timed-out calls end before the next test clears WOKE
        assert _ASLEEP.acquire(timeout=60)


def sleepy(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    _CALLS[0] += 1
    RELEASE.wait(seconds)
    WOKE.set()
    _ASLEEP.release()
    return "woke"


def no_args_doc(x: int) -> int:
    """No Args section."""
    return x


def test_call_tool(release):
    assert call_tool(calculator, {"expression": "1+1"}, 5) == ("2", None)
    assert call_tool(lambda: {"a": [1]}, {}, 5) == ('{"a": [1]}', None)
    assert call_tool(boom, {"x": 3}, 5) == ("", "RuntimeError: boom 3")
    result, error = call_tool(boom, {"y": 3}, 5)
    assert result == "" and error.startswith("bad arguments ['y']: ")
    assert call_tool(boom, [1], 5) == ("", "the arguments are a list, not a JSON object")
    assert call_tool(sleepy, {"seconds": 20}, 0.3) == ("", "timed out after 0.3 s")
    assert not WOKE.is_set()  # returned at the limit, not when the tool ended


def test_tool_schema_names_the_function():
    with pytest.raises(ToolSetupError, match=r"tool tests.test_envs.no_args_doc: cannot describe"):
        tool_schema(no_args_doc)


def test_tools_env_runs_calls():
    env = ToolsEnv(tools=["calculator", "tests.test_envs:boom"])
    assert [t["function"]["name"] for t in env.tools] == ["calculator", "boom"]
    calls = [
        ToolCall("calculator", {"expression": "6*7"}, "call00000"),
        ToolCall("boom", {"x": 1}, "call00001"),
        ToolCall("search", {"q": "x"}, "call00002"),
    ]
    obs = env.step(turn("", calls))
    assert obs.messages == [
        {"role": "tool", "name": "calculator", "tool_call_id": "call00000", "content": "42"},
        {
            "role": "tool",
            "name": "boom",
            "tool_call_id": "call00001",
            "content": "error: RuntimeError: boom 1",
        },
        {
            "role": "tool",
            "name": "search",
            "tool_call_id": "call00002",
            "content": "error: unknown tool 'search'; the tools: calculator, boom",
        },
    ]
    assert (obs.done, obs.reward, obs.info) == (False, None, {"tool_calls": 3, "tool_errors": 2})
    final = env.step(turn("It is 42."))
    assert (final.done, final.reward, final.messages) == (True, None, [])


def test_tools_env_malformed_timeout_and_end(release):
    env = ToolsEnv(tools=[sleepy], tool_timeout_s=0.2)
    obs = env.step(turn("<tool_call>{bad", malformed="not JSON"))
    assert obs.messages == [{"role": "tool", "content": "error: not JSON"}]
    assert (obs.done, obs.info) == (False, {"tool_calls": 0, "tool_errors": 1})
    obs = env.step(turn("", [ToolCall("sleepy", {"seconds": 20}, "c")]))
    assert obs.messages[0]["content"] == "error: timed out after 0.2 s"
    assert not WOKE.is_set()  # the step did not wait for the tool
    ending = ToolsEnv(tools=["calculator"], on_tool_error="end")
    assert ending.step(turn("x", malformed="bad")) == Observation(
        done=True, info={"tool_calls": 0, "tool_errors": 1}
    )
    calls = [ToolCall("calculator", {"expression": "1+1"}), ToolCall("calculator", {"e": 1})]
    assert ending.step(turn("", calls)) == Observation(
        done=True, info={"tool_calls": 2, "tool_errors": 1}
    )


def test_tools_env_answer_key_and_errors():
    env = ToolsEnv(answer_key="answer")
    env.reset([], {"answer": "12"}, 0)
    assert env.step(turn("so 12")).reward == 1.0
    assert env.step(turn("so 13")).reward == 0.0
    with pytest.raises(KeyError, match=r"tools environment: the data row has no column 'answer'"):
        env.reset([], {"prompt": "p"}, 0)
    with pytest.raises(ToolSetupError, match=r"env.kwargs.tools 'nope:fn': cannot import"):
        ToolsEnv(tools=["nope:fn"])
    with pytest.raises(ToolSetupError, match=r"'justaname' is not a plugin path.*calculator"):
        ToolsEnv(tools=["justaname"])
    with pytest.raises(ToolSetupError, match=r"two tools are named 'calculator'"):
        ToolsEnv(tools=["calculator", calculator])
    with pytest.raises(ToolSetupError, match=r"env.kwargs.tools='calculator'; accepted: a non"):
        ToolsEnv(tools="calculator")


# ---------------------------------------------------------------- prompts with tools
SCHEMA = tool_schema(calculator)


def test_tools_system_message_and_with_tools():
    text = tools_system_message([SCHEMA])
    assert f"<tools>\n{json.dumps(SCHEMA)}\n</tools>" in text
    assert text.endswith(
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    user = {"role": "user", "content": "hi"}
    system = {"role": "system", "content": "Be brief."}
    assert with_tools([user], [SCHEMA]) == [{"role": "system", "content": text}, user]
    original = [system, user]
    assert with_tools(original, [SCHEMA]) == [
        {"role": "system", "content": "Be brief.\n\n" + text},
        user,
    ]
    assert original[0]["content"] == "Be brief."  # not changed in place


def test_template_renders_tools():
    from megarl.data.toy import toy_tokenizer

    tok = toy_tokenizer()
    assert template_renders_tools(tok) is False  # renders contents only
    tok.chat_template = (
        "{% if tools %}TOOLS{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    assert template_renders_tools(tok) is True


# ---------------------------------------------------------------- vLLM's parser
@pytest.fixture(scope="module")
def hermes():
    from megarl.data.toy import toy_tokenizer
    from megarl.envs.tool_calls import ToolCallParser

    return ToolCallParser("hermes", toy_tokenizer(), [SCHEMA])


def test_hermes_parser_reads_calls(hermes):
    one = 'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}'
    content, calls, malformed = hermes.parse(one + "</tool_call>")
    assert content == "Let me compute. "
    assert calls == (ToolCall("calculator", {"expression": "6*7"}, "call00000"),)
    assert malformed is None
    two = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>\n'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2"}}</tool_call>'
    )
    assert hermes.parse(two) == (
        "",
        (
            ToolCall("calculator", {"expression": "1"}, "call00000"),
            ToolCall("calculator", {"expression": "2"}, "call00001"),
        ),
        None,
    )
    assert hermes.parse("The answer is 42.") == ("The answer is 42.", (), None)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_hermes_parser_reports_malformed_calls_quietly(hermes):
    vllm_logger = logging.getLogger("vllm.tool_parsers.hermes_tool_parser")
    seen = Records()
    vllm_logger.addHandler(seen)
    try:
        bad = '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
        content, calls, malformed = hermes.parse(bad)
        assert (content, calls) == (bad, ())
        assert malformed == "the hermes tool parser found no readable call after '<tool_call>'"
        assert seen.records == []  # vLLM's traceback is dropped...
        vllm_logger.error("outside parse")
        assert [r.getMessage() for r in seen.records] == ["outside parse"]  # ...only in parse
    finally:
        vllm_logger.removeHandler(seen)
    not_object = '<tool_call>{"name": "calculator", "arguments": "6*7"}</tool_call>'
    assert hermes.parse(not_object) == (
        "",
        (),
        "the arguments of 'calculator' are a str, not a JSON object",
    )


def test_parser_setup_errors():
    from megarl.data.toy import toy_tokenizer
    from megarl.envs.tool_calls import ToolCallParser

    with pytest.raises(ToolSetupError, match=r"env.tool_parser='nope' is not one of .*hermes"):
        ToolCallParser("nope", toy_tokenizer(), None)
    with pytest.raises(ToolSetupError, match=r"'llama3_json' .*does not work with the policy's"):
        ToolCallParser("llama3_json", toy_tokenizer(), None)
    with pytest.raises(ToolSetupError, match="not OpenAI function schemas"):
        ToolCallParser("hermes", toy_tokenizer(), [{"type": "function"}])


def test_last_number_reward_wants_the_number_not_the_expression():
    from megarl.rewards.scoring import load_reward_function

    fn = load_reward_function("last_number")
    completions = ["588 + 466", "588 + 466 = 1054", "It is 1,054.", "no number", "x"]
    answers = ["1054", "1054", "1054", "1054", "none"]
    assert fn([None] * 5, completions, answer=answers) == [0.0, 1.0, 1.0, 0.0, None]
    math_verify = load_reward_function("math_verify")  # the expression passes there
    assert math_verify([None], ["588 + 466"], answer=["1054"]) == [1.0]


def test_env_scheduler_is_checked():
    from megarl.errors import ConfigError

    assert EnvConfig(name="retry", scheduler="stream").scheduler == "stream"
    with pytest.raises(ConfigError, match=r"env.scheduler='async'; accepted: waves or stream"):
        EnvConfig(name="retry", scheduler="async")


@pytest.mark.parametrize(
    "rollout, env, message",
    [
        (
            {"engine": {"tensor_parallel": 2}},
            {"scheduler": "stream"},
            "accepted: env.scheduler=waves, or",
        ),
        ({"engine": {"routing_replay": True}}, {}, "accepted: routing_replay=false with env.name"),
    ],
)
def test_multi_turn_refuses_what_its_schedulers_cannot_serve(rollout, env, message):
    from megarl.config import RunConfig, build
    from megarl.errors import ConfigError
    from tests.tiny import TINY_LLAMA

    tree = {"model": {"config": TINY_LLAMA}, "rollout": rollout, "env": {"name": "retry", **env}}
    with pytest.raises(ConfigError, match=message):
        build(RunConfig, tree)
    tree["env"] = {"name": "retry"}  # waves serve any layout
    if "tensor_parallel" in rollout.get("engine", {}):
        assert build(RunConfig, tree).env.scheduler == "waves"
