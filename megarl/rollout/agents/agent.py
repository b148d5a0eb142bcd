"""One trajectory driven by an agent (`AgentTrajectory`), and the trajectories of `env.agent`
(`AgentTrajectories`): the agent's thread opens a session on the endpoint
(`megarl.rollout.agents.session.AgentSession`, which says what the agent may do and how the
token sequence is built) and calls `agent_fn(row=row, base_url=url, seed=seed)`; its return
value (a float, or None) is the trajectory's environment reward.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

from megarl.envs.config import EnvConfig
from megarl.envs.registry import load_agent
from megarl.rollout.agents.endpoint import ChatEndpoint
from megarl.rollout.agents.session import AgentSession
from megarl.rollout.multi_turn.batcher import Client, TurnBatcher
from megarl.rollout.multi_turn.chat_format import ChatFormat
from megarl.rollout.multi_turn.trajectory import Tokens, TrajectoryRecord, TurnLimits
from megarl.rollout.seeds import turn_seed


def agent_reward(value) -> tuple[float | None, str | None]:
    """(reward, None) of an agent's return value, or (None, why) when it is not a finite
    number or None."""
    if value is None:
        return None, None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        what = f"{type(value).__name__} {value!r}"
        return None, f"the agent returned {what}; expected a float or None"
    if not math.isfinite(float(value)):
        return None, f"the agent returned {value!r}; expected a finite float or None"
    return float(value), None


class AgentTrajectory:
    """Runs one agent trajectory in the calling thread (module docstring)."""

    def __init__(
        self,
        cfg: EnvConfig,
        agent_fn: Callable,
        endpoint: ChatEndpoint,
        row: dict,
        base_seed: int,
        index: int,
        limits: TurnLimits,
    ):
        self.cfg, self.agent_fn, self.endpoint = cfg, agent_fn, endpoint
        self.row, self.base_seed, self.index = row, base_seed, index
        self.session = AgentSession(endpoint, base_seed, index, limits)
        self.bug: BaseException | None = None
        """An exception of megarl's own code (not the agent's): re-raised by the caller."""

    @property
    def record(self) -> TrajectoryRecord:
        return self.session.record

    @property
    def tokens(self) -> Tokens:
        return self.session.tokens

    def run(self, batcher: TurnBatcher, client: Client) -> None:
        session = self.session
        try:
            session.begin(batcher, client)
            url = self.endpoint.open_session(session)
            seed = turn_seed(self.base_seed, 0, self.index)
            reward, error = None, None
            try:
                reward = self.agent_fn(row=dict(self.row), base_url=url, seed=seed)
            except Exception as e:  # noqa: BLE001 - the agent's failure ends its trajectory
                error = f"{type(e).__name__}: {e}"
            if session.end_agent():
                return  # timed out: `abandoned` closes the record
            if session.bug is not None:
                self.bug = session.bug
                return
            if error is None:
                reward, error = agent_reward(reward)
            session.conclude(error, reward)
        except BaseException as e:  # noqa: BLE001 - handed to the engine's thread
            self.bug = e
        finally:
            self.endpoint.close_session(session.token)
            batcher.finish(client)

    def abandoned(self) -> None:
        """Close the record of a trajectory whose agent ran past its time limit (call after the
        waves ended; its thread changes nothing more)."""
        self.session.abandon()

    def sample(self, fallback_prompt: list[int]) -> Tokens:
        """The trajectory's tokens; an agent that failed before its first request leaves only
        the data row's prompt (`fallback_prompt`), with no response."""
        if not self.tokens.prompt:
            return Tokens(prompt=list(fallback_prompt))
        return self.tokens


class AgentTrajectories:
    """Trajectories driven by the agent of `env.agent` through one endpoint, started with the
    first trajectory. Building one checks the setup: the agent function resolves and the
    tokenizer's chat template renders a conversation."""

    def __init__(self, cfg: EnvConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.agent_fn = load_agent(cfg)
        self.fmt = ChatFormat(tokenizer, None)
        self.endpoint: ChatEndpoint | None = None

    def make(self, item: dict, seed: int, index: int, limits: TurnLimits) -> AgentTrajectory:
        if self.endpoint is None:
            self.endpoint = ChatEndpoint(self.tokenizer, self.cfg)
            self.endpoint.start()
        row = {**item["row"], "messages": item["messages"]}
        return AgentTrajectory(self.cfg, self.agent_fn, self.endpoint, row, seed, index, limits)

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
