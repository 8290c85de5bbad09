"""The torch runner with a tiny random-init Llama (fast): seeds are batch-independent, batching and
block reuse don't change a sequence's tokens, and a deadline ends a request with a timeout finish."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shared.deltas import Content, Finish, FinishReason
from shared.settings import Settings
from workers.engine import Engine
from workers.runner import TorchRunner

from .fakes import INFO, ByteTokenizer, make_request


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


def run(model: LlamaForCausalLM, requests: list, *, slots: int = 8, settings: Settings | None = None) -> dict[str, list[int]]:  # type: ignore[type-arg]
    runner = TorchRunner(model, max_len=128, kv_budget_mb=64, device=torch.device("cpu"), dtype=torch.float32)
    engine = Engine(runner, ByteTokenizer(), INFO, settings=settings or Settings(max_running=slots, max_tokens_per_step=256))
    for r in requests:
        engine.add(r)
    tokens: dict[str, list[int]] = {r.id: [] for r in requests}
    for _ in range(500):
        if not engine.has_work():
            return tokens
        for e in engine.step():
            if isinstance(e.delta, (Content, Finish)):
                tokens[e.request_id].extend(e.delta.token_ids)
    raise AssertionError("did not finish")


def sampled(rid: str, seed: int, **extra: object) -> object:
    return make_request(rid, prompt_len=6, max_tokens=24, ignore_eos=True, temperature=1.0, seed=seed, **extra)


def test_the_same_seed_gives_the_same_tokens_alone_and_in_a_full_batch(tiny: LlamaForCausalLM) -> None:
    alone = run(tiny, [sampled("me", 42)])["me"]
    crowd = [sampled(f"other{i}", i, top_p=0.9, top_k=20) for i in range(7)]
    together = run(tiny, [*crowd[:3], sampled("me", 42), *crowd[3:]])["me"]
    assert alone == together and len(alone) == 24
    assert run(tiny, [sampled("me", 43)])["me"] != alone


def test_top_k_one_equals_greedy_through_the_runner(tiny: LlamaForCausalLM) -> None:
    greedy = run(tiny, [make_request("g", prompt_len=6, max_tokens=16, ignore_eos=True, temperature=0.0)])["g"]
    top1 = run(tiny, [sampled("k", 7, top_k=1)])["k"][:16]
    assert greedy == top1


def test_logit_bias_plus_100_forces_a_token(tiny: LlamaForCausalLM) -> None:
    forced = run(tiny, [make_request("b", prompt_len=6, max_tokens=8, ignore_eos=True, temperature=1.0, seed=1, logit_bias=((123, 100.0),))])["b"]
    assert forced == [123] * 8


def test_block_reuse_after_a_finish_does_not_leak_into_the_next_sequence(tiny: LlamaForCausalLM) -> None:
    greedy = make_request("x", prompt_len=6, max_tokens=16, ignore_eos=True, temperature=0.0)
    reference = run(tiny, [greedy])["x"]
    before = [replace(make_request(f"p{i}", prompt_len=30, max_tokens=5, ignore_eos=True, temperature=0.0)) for i in range(2)]
    after = run(tiny, [*before, replace(greedy, priority=10)], slots=1)
    assert after["x"] == reference


@pytest.mark.parametrize("impl", ["lean", "hf"])
def test_untouched_pool_memory_never_reaches_a_sequence_whose_last_block_is_read_whole(tiny: LlamaForCausalLM, impl: str) -> None:
    # A fresh pool is torch.empty: it may hold NaN bit patterns. Reads take whole blocks, so a sequence's
    # last block is read past its end (masked out, but 0 * NaN is NaN); each block is zeroed on its first write.
    requests = [make_request(f"r{i}", prompt_len=5 + 7 * i, max_tokens=12, ignore_eos=True, temperature=0.0) for i in range(3)]

    def tokens(poison: bool) -> dict[str, list[int]]:
        runner = TorchRunner(tiny, max_len=128, kv_budget_mb=4, device=torch.device("cpu"), dtype=torch.float32, model_impl=impl)
        if poison:
            for pool in (*runner.cache.keys, *runner.cache.values):
                pool[: runner.cache.pad_block].fill_(float("nan"))
        engine = Engine(runner, ByteTokenizer(), INFO, settings=Settings(max_running=4, max_tokens_per_step=256))
        for r in requests:
            engine.add(r)
        out: dict[str, list[int]] = {r.id: [] for r in requests}
        while engine.has_work():
            for e in engine.step():
                if isinstance(e.delta, (Content, Finish)):
                    out[e.request_id].extend(e.delta.token_ids)
        return out

    clean = tokens(poison=False)
    assert all(len(t) == 12 for t in clean.values())
    assert tokens(poison=True) == clean


def test_a_request_past_its_deadline_ends_with_a_timeout_finish(tiny: LlamaForCausalLM) -> None:
    runner = TorchRunner(tiny, max_len=128, kv_budget_mb=16, device=torch.device("cpu"), dtype=torch.float32)
    now = [1000.0]
    engine = Engine(runner, ByteTokenizer(), INFO, settings=Settings(max_running=2, request_timeout=5.0), clock=lambda: now[0])
    engine.add(replace(make_request("slow", max_tokens=100, ignore_eos=True), created=999.0))
    engine.step()
    now[0] = 1010.0
    [end] = engine.step()
    assert end.request_id == "slow" and isinstance(end.delta, Finish) and end.delta.reason is FinishReason.TIMEOUT
    assert not engine.has_work()


def one_after_another(model: LlamaForCausalLM, requests: list, *, prefix_cache: bool, budget_mb: int = 64) -> tuple[dict[str, list[int]], dict[str, int]]:  # type: ignore[type-arg]
    runner = TorchRunner(model, max_len=128, kv_budget_mb=budget_mb, device=torch.device("cpu"), dtype=torch.float32)
    engine = Engine(runner, ByteTokenizer(), INFO, settings=Settings(max_running=4, max_tokens_per_step=40, prefix_cache=prefix_cache))
    tokens: dict[str, list[int]] = {r.id: [] for r in requests}
    cached: dict[str, int] = {}
    for r in requests:
        engine.add(r)
        for _ in range(500):
            if not engine.has_work():
                break
            for e in engine.step():
                if isinstance(e.delta, (Content, Finish)):
                    tokens[e.request_id].extend(e.delta.token_ids)
                if isinstance(e.delta, Finish):
                    cached[e.request_id] = e.delta.usage.cached_tokens
    return tokens, cached


def test_greedy_output_is_token_identical_with_and_without_the_prefix_cache(tiny: LlamaForCausalLM) -> None:
    shared = [(i * 37) % 250 + 1 for i in range(50)]
    prompts = [shared + [200 + k] * (3 + k) for k in range(4)] + [shared[:33], shared[:48]]
    requests = [replace(make_request(f"p{i}", max_tokens=20, ignore_eos=True, temperature=0.0), prompt_token_ids=tuple(p)) for i, p in enumerate(prompts)]
    plain, none_cached = one_after_another(tiny, requests, prefix_cache=False)
    cached, cached_tokens = one_after_another(tiny, requests, prefix_cache=True)
    assert set(none_cached.values()) == {0}
    assert cached_tokens == {"p0": 0, "p1": 48, "p2": 48, "p3": 48, "p4": 32, "p5": 32}
    assert cached == plain and all(len(t) == 20 for t in plain.values())


def test_sequences_preempted_when_the_pool_runs_out_resume_token_identical() -> None:
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=257, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
    wide = LlamaForCausalLM(config).eval()  # 4 KiB of fp32 KV a token: 1 MiB holds 256 tokens
    long = [replace(make_request(f"g{i}", max_tokens=80, ignore_eos=True, temperature=0.0), prompt_token_ids=tuple([i + 1] * 40)) for i in range(4)]
    alone = {r.id: run(wide, [r])[r.id] for r in long}
    runner = TorchRunner(wide, max_len=128, kv_budget_mb=1, device=torch.device("cpu"), dtype=torch.float32)
    assert runner.num_blocks * runner.block_size == 256 < 4 * 120
    engine = Engine(runner, ByteTokenizer(), INFO, settings=Settings(max_running=4, max_tokens_per_step=64))
    for r in long:
        engine.add(r)
    tokens: dict[str, list[int]] = {r.id: [] for r in long}
    while engine.has_work():
        for e in engine.step():
            if isinstance(e.delta, (Content, Finish)):
                tokens[e.request_id].extend(e.delta.token_ids)
    assert engine.scheduler.preemptions >= 1
    assert tokens == alone


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_each_llama_family_model_runs_on_the_paged_path_with_the_output_of_its_own_forward(family: str) -> None:
    import transformers

    config_class = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig"}[family]
    model_class = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}[family]
    torch.manual_seed(2)
    config = getattr(transformers, config_class)(
        vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    )
    model = getattr(transformers, model_class)(config).eval()
    prompts = [[(i * 7 + k) % 250 + 1 for i in range(n)] for k, n in enumerate((5, 21, 40))]  # partial, past one block, past two
    requests = [replace(make_request(f"f{k}", max_tokens=12, ignore_eos=True, temperature=0.0), prompt_token_ids=tuple(p)) for k, p in enumerate(prompts)]
    together = run(model, requests)
    for r, prompt in zip(requests, prompts, strict=True):
        assert together[r.id] == own_greedy(model, prompt, 12), (family, r.id)


@torch.inference_mode()
def own_greedy(model: object, prompt: list[int], n: int) -> list[int]:
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)  # type: ignore[operator]
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(n - 1):
        out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)  # type: ignore[operator]
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_the_default_kv_pool_is_split_among_the_workers_met_serve_starts_on_one_machine() -> None:
    """`met serve --workers N` (settings.workers reaches each worker): N workers on one CPU machine share the
    default share of its free memory instead of each taking all of it; an explicit budget, one worker or a
    GPU keep theirs."""
    import psutil

    from workers.kv_cache import CPU_SHARE
    from workers.main import kv_budget_mb

    cpu = torch.device("cpu")
    expected = psutil.virtual_memory().available * CPU_SHARE / 3 / 2**20
    assert 0.8 * expected < kv_budget_mb(Settings(workers=3), cpu) < 1.2 * expected
    assert kv_budget_mb(Settings(workers=1), cpu) == 0  # the runner's own default: the whole share
    assert kv_budget_mb(Settings(workers=3, kv_budget_mb=256), cpu) == 256
    assert kv_budget_mb(Settings(workers=3), torch.device("meta")) == 0


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_the_default_kv_pool_takes_its_share_of_what_the_memory_cgroup_leaves(tmp_path: Path, version: str) -> None:
    """In a container psutil sees the host's memory: under a memory limit the pool's share is of the limit
    minus the cgroup's usage (its inactive page cache counted as free); without a limit, of the machine's."""
    import psutil

    from workers.kv_cache import available_bytes

    limit, usage, inactive = 3 * 2**30, 2**30, 256 * 2**20
    v2 = version == "v2"
    folder = tmp_path if v2 else tmp_path / "memory"
    folder.mkdir(exist_ok=True)
    (folder / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(f"{limit}\n")
    (folder / ("memory.current" if v2 else "memory.usage_in_bytes")).write_text(f"{usage}\n")
    (folder / "memory.stat").write_text(f"anon 123\n{'inactive_file' if v2 else 'total_inactive_file'} {inactive}\nactive_file 9\n")
    host = psutil.virtual_memory().available
    assert available_bytes(tmp_path) == min(host, limit - usage + inactive)
    (folder / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text("max\n" if v2 else "9223372036854771712\n")
    assert abs(available_bytes(tmp_path) - psutil.virtual_memory().available) < 256 * 2**20  # no limit: the machine's
    assert abs(available_bytes(tmp_path / "none") - psutil.virtual_memory().available) < 256 * 2**20  # no cgroup files
