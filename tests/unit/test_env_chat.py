"""chat.continuation with the real SmolLM2-135M-Instruct tokenizer: the ids appended after each assistant turn.

Token-exactness is checked against an independent derivation: the template's own rendering of the whole
conversation, tokenized in one piece. Where the assistant's sampled ids are that canonical tokenization, the
incrementally built ids equal it token for token; where they were deliberately not (ids that spell the same text
differently), the given ids are kept and everything around them still equals the canonical ids.
"""
import json

import pytest

from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.environments.chat import TemplateError, continuation, prompt_ids
from megatron_rl.paths import default_model_dir

SMOL = default_model_dir()
pytestmark = pytest.mark.skipif(not (SMOL / "tokenizer.json").exists(), reason=f"no SmolLM2 tokenizer at {SMOL}")

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "37 + 45"}}</tool_call>'
OPENING = [{"role": "system", "content": "Solve it. You can use a calculator."},
           {"role": "user", "content": "What is 37 + 45 - 19?"}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(SMOL)


@pytest.fixture(scope="module")
def hf_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(SMOL))


def canonical(tok, messages):
    """The independent derivation: the whole conversation rendered by the template and tokenized at once."""
    return tok.encode(tok.render_chat(messages, add_generation_prompt=True))


def rollout(tok, turns):
    """Build a trajectory the way the rollout loop does: prompt ids, then per turn the engine's sampled ids
    (`sampled`) and the appended continuation. turns: (assistant text, sampled ids, observation messages)."""
    messages, ids, spans, conts = list(OPENING), prompt_ids(tok, OPENING), [], []
    for text, sampled, observation in turns:
        spans.append((len(ids), len(ids) + len(sampled)))
        messages.append({"role": "assistant", "content": text})
        ids = ids + sampled
        c = continuation(tok, messages, ids, observation)
        conts.append(c)
        ids = ids + c.ids
        messages += observation
    return messages, ids, spans, conts


def test_stop_string_and_eos_turn_ends(tok):
    im_end, nl = tok.encode("<|im_end|>"), tok.encode("\n")
    assert im_end == [tok.eos_token_id]  # SmolLM2's EOS is its end-of-turn token
    answer = "So 82 - 19 = 63. <answer>63</answer>"
    turns = [
        # stopped at the stop string: no end of turn sampled
        (f"First 37 + 45. {CALL}", tok.encode(f"First 37 + 45. {CALL}"), [{"role": "tool", "content": "82"}]),
        # ended with EOS: only the newline after it is missing
        (answer, tok.encode(answer) + [tok.eos_token_id], [{"role": "user", "content": "Are you sure?"}]),
    ]
    messages, ids, _, conts = rollout(tok, turns)
    assert conts[0].turn_end == im_end + nl and conts[1].turn_end == nl
    assert tok.decode(conts[0].ids, skip_special_tokens=False) == \
        "<|im_end|>\n<|im_start|>tool\n82<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(conts[1].observation, skip_special_tokens=False) == \
        "<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n"
    # canonical sampled ids: the incremental ids are the template's rendering of the whole conversation, exactly
    assert ids == canonical(tok, messages)


def test_non_canonical_sampled_ids_are_kept(tok):
    text = "hello world, 12345"
    odd = [i for ch in text for i in tok.encode(ch)]  # the same text, one token per character
    assert odd != tok.encode(text) and tok.decode(odd) == text
    turns = [(text, odd + [tok.eos_token_id], [{"role": "user", "content": "again"}]),
             (CALL, tok.encode(CALL), [{"role": "tool", "content": "82"}])]
    messages, ids, spans, _ = rollout(tok, turns)
    want = canonical(tok, messages)
    assert ids != want  # re-tokenizing would have lost the sampled ids
    (s, e), delta = spans[0], len(odd) - len(tok.encode(text))
    assert ids[s:e] == odd + [tok.eos_token_id]  # kept as sampled
    assert ids[:s] == want[:s]
    assert ids[e:] == want[e - delta:]  # everything after the odd span is canonical again
    assert tok.decode(ids, skip_special_tokens=False) == tok.render_chat(messages, add_generation_prompt=True)


def test_several_tool_results_and_an_hf_tokenizer(tok, hf_tok):
    obs = [{"role": "tool", "content": "82"}, {"role": "tool", "content": "63"}]
    messages = OPENING + [{"role": "assistant", "content": CALL + CALL}]
    ids = prompt_ids(tok, OPENING) + tok.encode(CALL + CALL)
    ours = continuation(tok, messages, ids, obs)
    assert continuation(hf_tok, messages, ids, obs) == ours  # the HF tokenizer itself gives the same ids
    assert ids + ours.ids == canonical(tok, messages + obs)


STRIP_THINK = (  # like templates that drop earlier turns' reasoning: the last assistant turn keeps its <think>
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\n' + m['content'].split('</think>')[-1] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture
def stripping_tok():
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(SMOL))
    t.chat_template = STRIP_THINK
    return t


def test_a_template_that_rewrites_earlier_turns_is_refused(stripping_tok):
    reply = "<think>37 + 45 is 82</think>" + CALL
    messages = OPENING + [{"role": "assistant", "content": reply}]
    ids = stripping_tok.encode(stripping_tok.apply_chat_template(OPENING, tokenize=False, add_generation_prompt=True)
                               + reply, add_special_tokens=False)
    with pytest.raises(TemplateError, match="breaks the prefix property") as e:
        continuation(stripping_tok, messages, ids, [{"role": "tool", "content": "82"}])
    text = str(e.value)
    head = stripping_tok.apply_chat_template(OPENING, tokenize=False, add_generation_prompt=True)
    # where the earlier turn was rewritten: "<think>" became "<tool_call>", which share their first two characters
    assert f"character {len(head) + len('<t')}:" in text and "<think>37 + 45" in text
    assert "First difference at token " in text
    # the same template is fine while the assistant turn holds no reasoning to strip
    plain = OPENING + [{"role": "assistant", "content": CALL}]
    continuation(stripping_tok, plain, ids, [{"role": "tool", "content": "82"}])


def test_a_token_merging_across_the_boundary_keeps_the_earlier_ids():
    """A template with nothing between turns: "hi" + "gh" tokenizes as "high" in one piece, so the ids of the longer
    rendering do not start with the earlier ones although its text does. The earlier ids stay; the new text is
    tokenized on its own."""
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(SMOL))
    t.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    enc = lambda text: t.encode(text, add_special_tokens=False)  # noqa: E731
    assert enc("Say high")[:len(enc("Say hi"))] != enc("Say hi")  # the merge this test is about
    messages = [{"role": "user", "content": "Say "}, {"role": "assistant", "content": "hi"}]
    c = continuation(t, messages, enc("Say hi"), [{"role": "user", "content": "gh"}])
    assert (c.turn_end, c.ids) == ([], enc("gh"))


def test_argument_errors(tok):
    with pytest.raises(ValueError, match="must end with the assistant's turn"):
        continuation(tok, OPENING, prompt_ids(tok, OPENING), [{"role": "tool", "content": "1"}])
    with pytest.raises(ValueError, match="no observation"):
        continuation(tok, OPENING + [{"role": "assistant", "content": "x"}], [], [])
    bad = OPENING + [{"role": "assistant", "content": "x"}]
    with pytest.raises(TypeError, match="expected a megatron_rl Tokenizer"):
        continuation(object(), bad, [], [{"role": "tool", "content": json.dumps(1)}])
