"""Token ids of a conversation that grows turn by turn, from the tokenizer's chat template, with
the history never decoded and re-encoded.

A trajectory's ids are its prompt (the initial messages rendered once, with the generation
prompt), then, per turn, the tokens the model sampled and the tokens of the environment's
answer. The answer's tokens are its *delta*: what its messages add to the template's rendering
of a conversation that ends with an assistant turn, up to the next generation prompt,
tokenized once (`observation_ids`). Two details make that exact:

- The delta is taken on a fixed probe conversation (system, user, assistant), not on the real
  one, so it is computed without re-rendering the history. This assumes a template renders a
  message the same whatever came before it (true of ChatML, Llama 3 and most templates; one
  that rewrites earlier turns, e.g. by dropping past reasoning, breaks it). `retokenized` measures
  how far a trajectory is from one rendering of its final conversation (`rollout/
  retokenize_diff`), which is what a trainer that re-renders would train on.
- The model's turn ends with the stop token it sampled (ChatML: `<|im_end|>`); the template
  writes the turn's end as a longer text (`<|im_end|>\\n`). The rest of that text (`\\n`) opens
  the delta. When the sampled stop token is not how the template ends a turn, the template's
  whole turn end opens it.

Tools: a template that renders `tools=` gets them; for one that ignores them (SmolLM2's), they
are described in a system message (`megarl.envs.tool_calls.with_tools`).
"""

from __future__ import annotations

from megarl.envs.tool_calls import template_renders_tools, with_tools
from megarl.errors import UserError

_PROBE = "MEGARL-PROBE-ASSISTANT"
_PROBE_BASE = [
    {"role": "system", "content": "MEGARL-PROBE-SYSTEM"},
    {"role": "user", "content": "MEGARL-PROBE-USER"},
    {"role": "assistant", "content": _PROBE},
]


class ChatFormatError(UserError, ValueError):
    """A tokenizer / chat template that multi-turn rollouts cannot extend token-exactly."""


class ChatFormat:
    """Renders and tokenizes the pieces of trajectories for one tokenizer (module docstring)."""

    def __init__(self, tokenizer, tools: list[dict] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ChatFormatError(
                "multi-turn rollout (env.name / env.agent) needs a tokenizer with a chat "
                "template; the policy's tokenizer has none (set tokenizer.chat_template in the "
                "model directory's tokenizer_config.json or chat_template.jinja)"
            )
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.native_tools = bool(self.tools) and template_renders_tools(tokenizer)
        base = self._render(_PROBE_BASE, generation_prompt=False)
        if _PROBE not in base:
            raise ChatFormatError(
                "the chat template does not render an assistant message's content; it cannot "
                "be extended turn by turn"
            )
        self.turn_end = base[base.rindex(_PROBE) + len(_PROBE) :]
        """The text the template writes after an assistant message (ChatML: '<|im_end|>\\n')."""
        self._base = base
        self._rest: dict[int, str] = {}

    def _render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        tools = self.tools if self.native_tools else None
        if self.tools and not self.native_tools:
            messages = with_tools(messages, self.tools)
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first turn's prompt: `messages` (and the tools) rendered with the generation
        prompt, tokenized once."""
        return self._encode(self._render(messages, generation_prompt=True))

    def observation_ids(self, messages: list[dict], stop_id: int | None) -> list[int]:
        """The tokens that follow an assistant turn that ended with the sampled token `stop_id`:
        the rest of the template's turn end, `messages` and the next generation prompt.
        `stop_id` None: the turn ended without a stop token (the template's whole turn end)."""
        after = self._render([*_PROBE_BASE, *messages], generation_prompt=True)
        if not after.startswith(self._base):
            raise ChatFormatError(
                "the chat template renders a conversation's earlier turns differently once "
                f"messages of roles {[m.get('role') for m in messages]} follow; it cannot be "
                "extended token-exactly"
            )
        return self._encode(self._turn_rest(stop_id) + after[len(self._base) :])

    def _turn_rest(self, stop_id: int | None) -> str:
        if stop_id is None:
            return self.turn_end
        if stop_id not in self._rest:
            text = self.tokenizer.decode([stop_id], skip_special_tokens=False)
            end = self.turn_end
            self._rest[stop_id] = end[len(text) :] if text and end.startswith(text) else end
        return self._rest[stop_id]

    def retokenized(self, messages: list[dict], last_stop: int | None) -> list[int]:
        """One tokenization of the final conversation `messages` (ending with the model's
        turn, which ended with the sampled token `last_stop`, or None), as a trainer that
        re-renders would train on it: without the generation prompt and without the rest of
        the turn end the model never sampled."""
        text = self._render(messages, generation_prompt=False)
        if last_stop is not None and messages and messages[-1].get("role") == "assistant":
            rest = self._turn_rest(last_stop)
            if rest and text.endswith(rest):
                text = text[: -len(rest)]
        return self._encode(text)
