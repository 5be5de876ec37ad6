"""Token-exact incremental rendering for multi-turn rollouts: the ids to append after an assistant turn.

The problem (retokenization drift). After each assistant turn the next prompt is the conversation so far plus the
environment's observation. The obvious way, rendering the whole conversation with the chat template and tokenizing
the text again, does not give back the ids the engine sampled: text has many tokenizations, and the engine's
sampled ids need not be the canonical one (" 63" may have been sampled as " 6" "3"; a stop string may end inside
a token). Re-tokenized, the trajectory would be trained on ids the policy never produced, with logprobs that belong
to other tokens, and the importance ratios would compare different sequences. So the conversation's ids are kept
exactly as generated (prompt ids + every sampled id, never re-tokenized) and only the NEW part is tokenized.

How the new part is found. With T the text the template puts after an assistant message's content:

1. Render the conversation so far WITHOUT a generation prompt (`before`) and the conversation plus the new messages
   WITH one (`after`), both as the template's text, and tokenize each. The ids of `after` must start with the ids
   of `before` (the prefix property); the suffix is then the observation messages plus the next generation prompt,
   exactly as the template renders and the tokenizer splits them in one piece. A template that rewrites earlier turns
   once more messages follow (reasoning stripped from earlier assistant messages, a date or a turn count in the
   system message) breaks the property: TemplateError names the first differing position. Such a template cannot
   be rendered incrementally at all, whatever tokenization is used.
   If the TEXT is a prefix but the ids are not (a token merging across the boundary, which templates whose turns
   start with a special token never do), the suffix text is tokenized on its own: the earlier ids are fixed anyway.
2. The assistant's turn end: T is found by rendering the conversation with the last assistant content replaced by
   a sentinel. The engine's ids may already hold the start of T: a turn that ended with the end-of-turn token
   (<|im_end|>, which is SmolLM2's EOS) has it as its last id, and a turn that stopped at a stop string
   (`</tool_call>`, environment.stop) has none of it. The longest prefix of T's ids that ends in a stop token and
   that the engine's ids end with is taken as produced; the rest of T's ids is appended (SmolLM2: "\\n" after an EOS,
   "<|im_end|>\\n" after a stop string).

    appended = T_ids[produced:] + ids(after)[len(ids(before)):]

None of the appended ids were sampled: the loss masks them out (they are the environment's, not the policy's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

# stands in for the last assistant message's content to find what the template writes after it; nothing a model or
# an environment writes looks like this
_SENTINEL = "\u2063\u2063megatron-rl-end-of-content\u2063\u2063"
_CONTEXT_CHARS = 30


class TemplateError(ValueError):
    """The chat template cannot be rendered incrementally (or at all) for this conversation; the message says why
    and where."""


@dataclass
class Continuation:
    """What to append to the conversation's ids: `ids` = `turn_end` + `observation`. turn_end: the tokens that close
    the assistant's turn which the engine did not produce; observation: the new messages and the next generation
    prompt."""
    ids: list[int]
    turn_end: list[int]
    observation: list[int]


class _Chat:
    """Our Tokenizer (megatron_rl.data.tokenizer: render_chat/encode) or an HF tokenizer (apply_chat_template)."""

    def __init__(self, tokenizer: Any):
        if hasattr(tokenizer, "render_chat"):
            self._render: Callable = lambda msgs, gen: tokenizer.render_chat(msgs, add_generation_prompt=gen)
            self.encode: Callable[[str], list[int]] = tokenizer.encode
        elif hasattr(tokenizer, "apply_chat_template"):
            if not getattr(tokenizer, "chat_template", None):
                raise TemplateError(f"{getattr(tokenizer, 'name_or_path', 'the tokenizer')} has no chat template")
            self._render = lambda msgs, gen: tokenizer.apply_chat_template(list(msgs), tokenize=False,
                                                                           add_generation_prompt=gen)
            self.encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False))
        else:
            raise TypeError(f"expected a megatron_rl Tokenizer or an HF tokenizer, got {type(tokenizer).__name__}")
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_ids = {int(eos)} if eos is not None else set()

    def render(self, messages: Sequence[dict], gen: bool) -> str:
        try:
            return self._render(list(messages), gen)
        except Exception as e:  # noqa: BLE001 - a template's own error (an unknown role, a raise_exception())
            raise TemplateError(f"the chat template cannot render this conversation (roles "
                                f"{[m.get('role') for m in messages]}): {type(e).__name__}: {e}") from None


def prompt_ids(tokenizer: Any, messages: Sequence[dict]) -> list[int]:
    """The first prompt's ids: the opening messages with the generation prompt (as data/prompts.py builds them)."""
    chat = _Chat(tokenizer)
    return chat.encode(chat.render(messages, True))


def continuation(tokenizer: Any, messages: Sequence[dict], ids: Sequence[int], observation: Sequence[dict], *,
                 stop_token_ids: Optional[Iterable[int]] = None) -> Continuation:
    """The ids to append to `ids` so the next turn's prompt is `messages` + `observation` with the generation prompt.

    messages: the conversation so far, its last message the assistant's turn (its content: the decoded sampled
    ids). ids: that conversation's ids as generated (prompt ids + each turn's sampled ids + what earlier calls
    appended), never re-tokenized. observation: the environment's new messages. stop_token_ids: ids that end a
    turn besides the tokenizer's EOS (a generation_config's extra eos ids)."""
    messages, observation = list(messages), list(observation)
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("the conversation so far must end with the assistant's turn")
    if not observation:
        raise ValueError("no observation messages to append")
    chat = _Chat(tokenizer)
    stop_ids = chat.stop_ids | {int(i) for i in (stop_token_ids or ())}

    before = chat.render(messages, False)
    after = chat.render(messages + observation, True)
    before_ids, after_ids = chat.encode(before), chat.encode(after)
    if after_ids[:len(before_ids)] == before_ids:
        new = after_ids[len(before_ids):]
    elif after.startswith(before):  # a merge across the boundary only: the suffix text on its own
        new = chat.encode(after[len(before):])
    else:
        raise TemplateError(_prefix_error(before, after, before_ids, after_ids))

    end = _turn_end_text(chat, messages, before)
    end_ids = chat.encode(end) if end else []
    produced = _produced(list(ids), end_ids, stop_ids)
    turn_end = end_ids[produced:]
    return Continuation(ids=turn_end + new, turn_end=turn_end, observation=new)


def _turn_end_text(chat: _Chat, messages: list[dict], before: str) -> str:
    """T: the text the template writes after the last assistant message's content."""
    probe = messages[:-1] + [{**messages[-1], "content": _SENTINEL}]
    text = chat.render(probe, False)
    if text.count(_SENTINEL) != 1:
        raise TemplateError("the chat template does not render an assistant message's content exactly once "
                            f"({text.count(_SENTINEL)} times): its end of turn cannot be found")
    end = text.split(_SENTINEL)[1]
    if not before.endswith(end):
        raise TemplateError(f"the chat template ends an assistant turn with {end!r} for one content but not for "
                            "this one: its end of turn depends on the content")
    return end


def _produced(ids: list[int], end_ids: list[int], stop_ids: set[int]) -> int:
    """How many of the turn end's ids the engine already produced: the longest prefix of end_ids that ends in a
    stop token and that `ids` ends with (generation stops right after a stop token, so that is the only way the
    engine can have produced part of it)."""
    for k in range(len(end_ids), 0, -1):
        if end_ids[k - 1] in stop_ids and ids[-k:] == end_ids[:k]:
            return k
    return 0


def _prefix_error(before: str, after: str, before_ids: list[int], after_ids: list[int]) -> str:
    tok = next((i for i, (a, b) in enumerate(zip(before_ids, after_ids)) if a != b),
               min(len(before_ids), len(after_ids)))
    pos = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
    lo = max(0, pos - _CONTEXT_CHARS)
    return ("the chat template breaks the prefix property: rendering the conversation with the new messages "
            "changes what it rendered for the conversation so far (it rewrites earlier turns, e.g. strips reasoning "
            "from earlier assistant messages), so the next prompt cannot continue the ids generated so far. First "
            f"difference at token {tok}, character {pos}: {before[lo:pos + _CONTEXT_CHARS]!r} became "
            f"{after[lo:pos + _CONTEXT_CHARS]!r}. Use a template that renders earlier turns unchanged.")
