"""Our lean Llama-family forward (workers.llama) against transformers' own forward, family by family:
every sampled row's logits match a full HF forward of that sequence's context, and greedy tokens
match HF greedy — alone, in batches that mix decode rows with prefill chunks at other positions,
on prefix-cache hits, and after preemption. Architectures we do not implement keep the HF path."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import transformers

from shared.deltas import Content, Finish
from shared.ir import Request
from shared.settings import Settings
from workers import llama
from workers.blocks import BLOCK_SIZE
from workers.engine import Engine
from workers.kv_cache import block_tables, gather
from workers.runner import TorchRunner
from workers.scheduler import Sequence

from .fakes import INFO, ByteTokenizer, make_request

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-rope-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2-linear-rope": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "llama-yarn-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
}


# SmolLM2's widths in 2 layers: a bf16 GEMM on AVX2 sums products over 64 or 256 inputs as float32 does,
# over 576 otherwise (measured), so the float32-projection tests need this width to see any difference.
SMOLLM_WIDE = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}


def tiny(family: str, seed: int = 0, **dims: int) -> Any:
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(seed)
    kwargs: dict[str, Any] = {"vocab_size": 257, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    config = getattr(transformers, config_class)(**{**kwargs, **extra, **dims})
    return getattr(transformers, model_class)(config).eval()


def prompt_request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return replace(make_request(rid, max_tokens=max_tokens, ignore_eos=True, temperature=0.0), prompt_token_ids=tuple(prompt))


class Recorded:
    """Every sampled row of a run: the context it was sampled after, and our logits for it."""

    def __init__(self) -> None:
        self.rows: list[tuple[list[int], torch.Tensor]] = []


def run(
    model: Any, arrivals: dict[int, list[Request]], *, impl: str = "lean", step_tokens: int = 24, blocks: int | None = None, record: Recorded | None = None, **quantize: str
) -> tuple[dict[str, list[int]], Engine]:
    runner = TorchRunner(model, max_len=256, kv_budget_mb=8, device=torch.device("cpu"), dtype=torch.float32, model_impl=impl).quantize(quantize.get("quantization", "none"))
    if blocks is not None:
        runner.num_blocks = blocks  # the bookkeeping pool is smaller than the tensors: preemption comes sooner
    if record is not None:
        sample = runner.sample

        def recording(rows: list[Sequence], logits: torch.Tensor, ahead: list[tuple[int, ...]] | None = None) -> Any:
            # a speculative draft's row i computes after its first i guesses (workers.runner._ahead): its context has them
            guesses = ahead or [()] * len(rows)
            record.rows.extend(([*s.prompt, *s.output, *guesses[i]], logits[i].clone()) for i, s in enumerate(rows))
            return sample(rows, logits, ahead)

        runner.sample = recording  # type: ignore[method-assign]
    engine = Engine(runner, ByteTokenizer(), INFO, settings=Settings(max_running=8, max_tokens_per_step=step_tokens))
    tokens: dict[str, list[int]] = {r.id: [] for rs in arrivals.values() for r in rs}
    for step in range(1000):
        for r in arrivals.get(step, []):
            engine.add(r)
        for e in engine.step():
            if isinstance(e.delta, (Content, Finish)):
                tokens[e.request_id].extend(e.delta.token_ids)
        if not engine.has_work() and step >= max(arrivals):
            return tokens, engine
    raise AssertionError("did not finish")


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(n - 1):
        out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@torch.inference_mode()
def assert_logits_match_hf(model: Any, record: Recorded) -> None:
    assert record.rows
    for context, ours in record.rows:
        reference = model(input_ids=torch.tensor([context])).logits[0, -1].float()
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


def prompts(n: int, lengths: tuple[int, ...]) -> list[list[int]]:
    return [[(i * 7 + k * 13) % 250 + 1 for i in range(length)] for k, length in zip(range(n), lengths, strict=False)]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_single_prompt_gives_hf_greedy_tokens_and_logits(family: str) -> None:
    model = tiny(family)
    [prompt] = prompts(1, (37,))
    record = Recorded()
    tokens, engine = run(model, {0: [prompt_request("a", prompt, 16)]}, record=record)
    assert engine.runner.lean is not None  # type: ignore[attr-defined]
    assert tokens["a"] == hf_greedy(model, prompt, 16)
    assert_logits_match_hf(model, record)


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_rows_and_prefill_chunks_in_one_forward_match_hf(family: str) -> None:
    model = tiny(family, seed=1)
    ps = prompts(4, (5, 21, 40, 70))
    requests = [prompt_request(f"r{k}", p, 14) for k, p in enumerate(ps)]
    record = Recorded()
    # 24 tokens a step: the long prompts arrive while the first ones decode, and prefill in chunks beside them
    tokens, engine = run(model, {0: requests[:2], 3: requests[2:3], 6: requests[3:]}, record=record)
    assert engine.stats.batch_peak >= 3
    for r, p in zip(requests, ps, strict=True):
        assert tokens[r.id] == hf_greedy(model, p, 14), r.id
    assert_logits_match_hf(model, record)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hits_reuse_blocks_and_match_hf(family: str) -> None:
    model = tiny(family, seed=2)
    shared = prompts(1, (50,))[0]
    ps = [shared + [200 + k] * (3 + k) for k in range(3)]
    requests = [prompt_request(f"p{k}", p, 10) for k, p in enumerate(ps)]
    record = Recorded()
    tokens, engine = run(model, {0: requests[:1], 20: requests[1:]}, record=record)
    assert engine.scheduler.pool.hits >= 2 * 48
    for r, p in zip(requests, ps, strict=True):
        assert tokens[r.id] == hf_greedy(model, p, 10), r.id
    assert_logits_match_hf(model, record)


@pytest.mark.parametrize("family", FAMILIES)
def test_preempted_sequences_recompute_and_match_hf(family: str) -> None:
    model = tiny(family, seed=3)
    ps = prompts(3, (30, 34, 38))
    requests = [prompt_request(f"g{k}", p, 30) for k, p in enumerate(ps)]
    record = Recorded()
    tokens, engine = run(model, {0: requests}, blocks=8, step_tokens=64, record=record)  # 128 positions for 3 x ~64
    assert engine.scheduler.preemptions >= 1
    for r, p in zip(requests, ps, strict=True):
        assert tokens[r.id] == hf_greedy(model, p, 30), r.id
    assert_logits_match_hf(model, record)


def test_the_hf_path_stays_available_and_agrees_with_the_lean_one() -> None:
    model = tiny("llama", seed=4)
    ps = prompts(3, (9, 26, 45))
    arrivals = {0: [prompt_request(f"h{k}", p, 12) for k, p in enumerate(ps)]}
    lean, _ = run(model, arrivals)
    hf, engine = run(model, arrivals, impl="hf")
    assert engine.runner.lean is None  # type: ignore[attr-defined]
    assert lean == hf


def test_an_unimplemented_rope_type_falls_back_to_the_hf_path() -> None:
    torch.manual_seed(5)
    config = transformers.LlamaConfig(
        vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    assert llama.unsupported(model, max_len=256) == "RoPE type 'dynamic' is not implemented"
    [prompt] = prompts(1, (20,))
    tokens, engine = run(model, {0: [prompt_request("d", prompt, 10)]}, impl="auto")
    assert engine.runner.lean is None  # type: ignore[attr-defined]
    assert tokens["d"] == hf_greedy(model, prompt, 10)
    with pytest.raises(ValueError, match="dynamic"):
        TorchRunner(model, max_len=256, kv_budget_mb=8, device=torch.device("cpu"), dtype=torch.float32, model_impl="lean")


@pytest.mark.model
@pytest.mark.timeout(900)
def test_the_default_model_on_the_lean_path_equals_hf_generate_for_32_tokens() -> None:
    from models.files import local_folder
    from models.prompt import PromptRenderer
    from shared.ir import Message, Protocol, Role, SamplingParams, TextPart
    from workers.runner import load_model

    settings = Settings.from_env(os.environ)
    name, folder = local_folder(settings.model, settings.model_cache)
    renderer = PromptRenderer.load(folder, name=name, max_model_len=512)
    model = load_model(folder, device=torch.device("cpu"), dtype=torch.float32)
    questions = ["What is the capital of France?", "Write a haiku about the sea."]
    requests = []
    for i, q in enumerate(questions):
        req = Request(id=f"q{i}", protocol=Protocol.OPENAI_CHAT, model="m", messages=(Message(role=Role.USER, content=(TextPart(text=q),)),), sampling=SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
        requests.append(replace(req, prompt_token_ids=tuple(renderer.render(req))))
    runner = TorchRunner(model, max_len=512, kv_budget_mb=64, device=torch.device("cpu"), dtype=torch.float32, model_impl="lean")
    engine = Engine(runner, renderer.tokenizer, renderer.info, settings=Settings(max_running=4, max_tokens_per_step=32))
    tokens: dict[str, list[int]] = {r.id: [] for r in requests}
    engine.add(requests[0])
    for step in range(300):
        if step == 2:
            engine.add(requests[1])  # its prompt prefills in chunks beside the first one's decodes
        for e in engine.step():
            if isinstance(e.delta, (Content, Finish)):
                tokens[e.request_id].extend(e.delta.token_ids)
        if not engine.has_work():
            break
    model.generation_config.eos_token_id = None  # EOS off, not banned: our requests ignore it (min_new_tokens would ban it)
    for r in requests:
        prompt = torch.tensor([r.prompt_token_ids])
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False, pad_token_id=0)
        assert tokens[r.id] == generated[0, prompt.shape[1] :].tolist(), r.id


def test_in_bf16_a_prefix_cache_hit_gives_bit_identical_logits_to_the_full_prefill() -> None:
    model = tiny("llama", seed=6).to(torch.bfloat16)
    runner = TorchRunner(model, max_len=256, kv_budget_mb=8, device=torch.device("cpu"), dtype=torch.bfloat16)
    record = Recorded()
    sample = runner.sample

    def recording(rows: list[Sequence], logits: torch.Tensor) -> Any:
        record.rows.extend(([*s.prompt, *s.output], logits[i].clone()) for i, s in enumerate(rows))
        return sample(rows, logits)

    runner.sample = recording  # type: ignore[method-assign]
    engine = Engine(runner, ByteTokenizer(), INFO, settings=Settings(max_running=4, max_tokens_per_step=256, speculative="off"))  # a row a token
    [prompt] = prompts(1, (90,))
    for rid in ("first", "again"):  # the second finds 80 of the 90 prompt tokens cached
        engine.add(prompt_request(rid, prompt, 6))
        while engine.has_work():
            engine.step()
    assert engine.scheduler.pool.hits == 80
    first, again = record.rows[:6], record.rows[6:]
    assert [c for c, _ in first] == [c for c, _ in again]
    for (_, a), (_, b) in zip(first, again, strict=True):
        assert torch.equal(a, b)  # a seeded draw at temperature 1 must not depend on the cache


def _logits_of_me(arrivals: dict[int, list[Request]], *, batch_invariant: bool = False, family: str = "llama") -> list[torch.Tensor]:
    """The logits of request "me" in a bf16 tiny model's run, requests added at their steps, as on a CPU
    without native bf16 whatever this one has: float32 projections where `TorchRunner.wide_mode` puts them,
    and attention's products in float32 (`llama._widen`). On a CPU with native bf16 (AVX-512 BF16) the
    attention otherwise runs in bf16, where `--batch-invariant` promises nothing (docs/cpu.md)."""
    model = tiny(family, seed=7, **SMOLLM_WIDE).to(torch.bfloat16)
    runner = TorchRunner(model, max_len=256, kv_budget_mb=64, device=torch.device("cpu"), dtype=torch.bfloat16)
    runner.widen, runner.batch_invariant = True, batch_invariant
    mine: list[torch.Tensor] = []
    sample = runner.sample

    def recording(rows: list[Sequence], logits: torch.Tensor) -> Any:
        mine.extend(logits[i].clone() for i, s in enumerate(rows) if s.key == "me")
        return sample(rows, logits)

    runner.sample = recording  # type: ignore[method-assign]
    engine = Engine(runner, ByteTokenizer(), INFO, settings=Settings(max_running=32, max_tokens_per_step=64, speculative="off"))  # a row a token
    with mock.patch.object(llama, "native_bf16", lambda: False):
        for step in range(1000):
            for r in arrivals.get(step, []):
                engine.add(r)
            engine.step()
            if not engine.has_work() and step >= max(arrivals):
                return mine
    raise AssertionError("did not finish")


def test_with_batch_invariant_a_sequence_gets_the_same_logits_alone_and_among_batch_mates() -> None:
    """--batch-invariant: prompt tokens in float32, decode tokens in bf16 (row-invariant on AVX2), whatever
    shares the step — here 9 others arriving while "me" decodes, their prompt chunks in its steps."""
    ps = prompts(10, (20, 150, 90, 40, 60, 30, 70, 25, 80, 35))
    me = prompt_request("me", ps[0], 12)
    others = [prompt_request(f"o{k}", p, 12) for k, p in enumerate(ps[1:])]
    alone = _logits_of_me({0: [me]}, batch_invariant=True)
    crowded = _logits_of_me({0: [me], 1: others[:3], 3: others[3:]}, batch_invariant=True)
    assert len(alone) == len(crowded) == 12
    assert all(torch.equal(a, b) for a, b in zip(alone, crowded, strict=True))  # (the hf path differs by ~2e-3 here)


def test_by_default_a_decode_row_gets_the_same_logits_among_6_rows_as_among_16() -> None:
    """Without --batch-invariant a step of WIDE_MIN_ROWS rows or more multiplies in float32, every row padded
    to the same MKL kernel (quant.WIDE_ROWS): a sequence's logits then do not depend on how many share it."""
    ps = prompts(16, (20, *(30 + 7 * k for k in range(15))))
    me = prompt_request("me", ps[0], 10)
    few = _logits_of_me({0: [me, *(prompt_request(f"o{k}", p, 10) for k, p in enumerate(ps[1:6]))]})
    many = _logits_of_me({0: [me, *(prompt_request(f"o{k}", p, 10) for k, p in enumerate(ps[1:]))]})
    assert len(few) == len(many) == 10
    assert all(torch.equal(a, b) for a, b in zip(few, many, strict=True))


def test_a_prompt_that_repeats_a_generated_answer_reads_no_block_decoded_in_bf16() -> None:
    """Prompt tokens are computed in float32, generated ones (decoding alone) in bf16: a later prompt that
    holds an earlier answer must not take those blocks from the prefix cache (`Scheduler.salt_outputs`),
    or its logits would depend on whether the cache had them."""
    [base] = prompts(1, (40,))

    def run_with(cache: bool) -> tuple[list[torch.Tensor], int]:
        model = tiny("llama", seed=8, **SMOLLM_WIDE).to(torch.bfloat16)
        runner = TorchRunner(model, max_len=256, kv_budget_mb=64, device=torch.device("cpu"), dtype=torch.bfloat16)
        runner.widen = True
        rows: list[torch.Tensor] = []
        sample = runner.sample

        def recording(seqs: list[Sequence], logits: torch.Tensor) -> Any:
            rows.extend(logits[i].clone() for i, s in enumerate(seqs) if s.key == "next")
            return sample(seqs, logits)

        runner.sample = recording  # type: ignore[method-assign]
        engine = Engine(runner, ByteTokenizer(), INFO, settings=Settings(max_running=4, max_tokens_per_step=256, prefix_cache=cache, speculative="off"))
        answer: list[int] = []
        engine.add(prompt_request("first", base, 40))
        while engine.has_work():
            answer.extend(t for e in engine.step() if isinstance(e.delta, (Content, Finish)) for t in e.delta.token_ids)
        engine.add(prompt_request("next", [*base, *answer, 7, 8, 9], 4))
        while engine.has_work():
            engine.step()
        return rows, engine.scheduler.pool.hits

    cached, hits = run_with(True)
    fresh, _ = run_with(False)
    assert hits == 32  # the two blocks of prompt tokens; not the ones holding the answer
    assert all(torch.equal(a, b) for a, b in zip(cached, fresh, strict=True)) and len(cached) == 4


def _pools(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Position i's keys/values in block i // 16 of a block pool (workers.kv_cache's layout), then the
    zeroed padding block; and the one sequence's block table."""
    n, kv_heads, dim = k.shape
    blocks = -(-n // BLOCK_SIZE)

    def pool(x: torch.Tensor) -> torch.Tensor:
        rows = torch.cat([x, torch.zeros(blocks * BLOCK_SIZE - n, kv_heads, dim, dtype=x.dtype)])
        tiles = rows.view(blocks, BLOCK_SIZE, kv_heads, dim).transpose(1, 2)
        return torch.cat([tiles, torch.zeros(1, kv_heads, BLOCK_SIZE, dim, dtype=x.dtype)]).contiguous()

    return pool(k), pool(v), list(range(blocks))


def _read(
    pools: tuple[torch.Tensor, torch.Tensor], table: list[int], ends: list[int], valid: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple[torch.Tensor | None, ...]]:
    """What `llama.forward` reads for rows whose keys end at `ends` (longest first), padded to the span of
    `valid` ([rows, ..., span] bool, laid out as `_attend`'s scores), and what `_attend` hides per key block."""
    span = valid.shape[-1]
    tables = block_tables([table] * len(ends), ends, width=span // BLOCK_SIZE, block_size=BLOCK_SIZE, pad_block=pools[0].shape[0] - 1)
    reads = llama.key_tiles(tables, tuple(ends), pools[0], valid)
    keys, values = (gather(pool, reads.index, reads.pieces) for pool in pools)
    return keys, values, reads.hidden


def _attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, splits: list[int]) -> torch.Tensor:
    """Every position's attention output through `_chunk_attention`, the prompt cut into chunks at `splits`."""
    k_pool, v_pool, table = _pools(k, v)
    out, start = [], 0
    for end in [*splits, k.shape[0]]:
        mask = torch.arange(llama.key_span(end))[None, :] <= torch.arange(start, end)[:, None]
        group = q.shape[1] // k.shape[1]
        keys, values, hidden = _read((k_pool, v_pool), table, [end], mask.repeat_interleave(group, dim=0)[None, None])
        out.append(llama._chunk_attention(q[start:end], keys, values, mask, hidden=hidden))
        start = end
    return torch.cat(out)


def _decode_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int], span: int) -> torch.Tensor:
    """Decode rows at `positions` of one sequence, batched with keys padded to `span` (as longer batch mates do)."""
    k_pool, v_pool, table = _pools(k, v)
    longest_first = sorted(positions, reverse=True)  # as the runner orders decode rows
    ends = [p + 1 for p in longest_first]
    mask = (torch.arange(span)[None, :] < torch.tensor(ends)[:, None])[:, None, None, :]
    keys, values, hidden = _read((k_pool, v_pool), table, ends, mask)
    rows = llama._decode_attention(q[longest_first], keys, values, mask, hidden=hidden)
    return rows[[longest_first.index(p) for p in positions]]


def test_bf16_attention_is_the_same_per_token_however_the_prompt_is_chunked_and_whoever_decodes_beside_it() -> None:
    # SmolLM2's geometry (9 heads, 3 kv heads, 64 dims), 1,700 positions: past three key blocks, and past
    # the key lengths where torch's SDPA and oneDNN's K blocking change with the shape of the call.
    gen = torch.Generator().manual_seed(0)
    n = 1700
    q, k, v = (torch.randn(n, heads, 64, generator=gen).bfloat16() for heads in (9, 3, 3))
    whole = _attention_rows(q, k, v, list(range(512, n, 512)))  # the scheduler's biggest chunks
    for splits in ([1], [33, 500], [100, 400, 1013, 1520], list(range(37, n, 37)), [1699]):
        assert torch.equal(_attention_rows(q, k, v, splits), whole), splits
    for positions, span in (([5], 64), ([5], 2048), ([1699], 1700), ([3, 800, 1699], 2048), (list(range(0, n, 97)), 1792)):
        rows = _decode_rows(q, k, v, positions, llama.key_span(span))
        assert torch.equal(rows, whole[positions]), positions  # a decode row equals the same position prefilled
    reference = F.scaled_dot_product_attention(q[None].transpose(1, 2).float(), k[None].transpose(1, 2).float(), v[None].transpose(1, 2).float(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(whole.float(), reference[0].transpose(0, 1), atol=2e-2, rtol=2e-2)  # and it is attention


@pytest.mark.parametrize("widen", [False, True], ids=["bf16-projections", "float32-projections"])
def test_the_default_model_in_bf16_gives_identical_logits_whatever_the_step_budget_cuts_its_prompt_into(widen: bool) -> None:
    """Where the scheduler cuts a prompt (its step budget, its batch mates) must not move a logit: a seeded
    request at temperature 1 would sample differently depending on what else ran (a 387-token prompt,
    prefilled in one chunk and in chunks of 100, 33 and 7 tokens; then its first decode steps). With the
    prompt's projections in float32 (`TorchRunner.wide_mode`, the default on a CPU without native bf16) too."""
    from models.files import local_folder
    from models.prompt import PromptRenderer
    from shared.ir import Message, Protocol, Role, SamplingParams, TextPart
    from workers.runner import load_model

    settings = Settings.from_env(os.environ)
    name, folder = local_folder(settings.model, settings.model_cache)
    renderer = PromptRenderer.load(folder, name=name, max_model_len=1024)
    model = load_model(folder, device=torch.device("cpu"), dtype=torch.bfloat16)
    text = "Tell me a long story about " + "a dragon and a knight " * 70
    req = Request(id="r", protocol=Protocol.OPENAI_CHAT, model="m", messages=(Message(role=Role.USER, content=(TextPart(text=text),)),), sampling=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    req = replace(req, prompt_token_ids=tuple(renderer.render(req)))
    assert len(req.prompt_token_ids) > 300

    def logits(budget: int) -> list[torch.Tensor]:
        runner = TorchRunner(model, max_len=1024, kv_budget_mb=64, device=torch.device("cpu"), dtype=torch.bfloat16, model_impl="lean")
        runner.widen = widen
        assert runner.wide_mode == ("auto" if widen else "off")
        rows: list[torch.Tensor] = []
        sample = runner.sample

        def recording(seqs: list[Sequence], lg: torch.Tensor) -> Any:
            rows.extend(lg[i].clone() for i in range(len(seqs)))
            return sample(seqs, lg)

        runner.sample = recording  # type: ignore[method-assign]
        engine = Engine(runner, renderer.tokenizer, renderer.info, settings=Settings(max_running=4, max_tokens_per_step=budget, prefix_cache=False, speculative="off"))
        engine.add(req)
        while engine.has_work():
            engine.step()
        return rows

    whole = logits(512)
    assert len(whole) == 4
    for budget in (100, 33, 7):
        assert all(torch.equal(a, b) for a, b in zip(whole, logits(budget), strict=True)), budget
