"""Weight-only int4 (workers.quant): Q4_1-shaped weights are recovered exactly and others are not; the
int4 model runs on both model paths with the same greedy tokens, its lean logits equal its own HF
forward's; the default model's decoder weights (a Q4_1 GGUF) come back within rounding; and the
combinations it does not run are refused by name."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from workers import checkpoint, quant
from workers.runner import TorchRunner

from .test_llama import FAMILIES, Recorded, assert_logits_match_hf, prompt_request, prompts, run, tiny


def q4_1_shaped(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """Weights as a Q4_1 GGUF dequantizes them: per 32 inputs w = d * q + m, q in 0..15, using the full range."""
    g = torch.Generator().manual_seed(seed)
    groups = in_features // quant.GROUP
    d = torch.rand(out_features, groups, 1, generator=g) * 0.02 + 0.001
    m = torch.randn(out_features, groups, 1, generator=g) * 0.05
    q = torch.randint(0, 16, (out_features, groups, quant.GROUP), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # Q4_1 maps each block's min to 0 and its max to 15
    return (d * q + m).reshape(out_features, in_features)


def test_q4_1_shaped_weights_are_recovered_exactly_and_random_ones_are_not() -> None:
    w = q4_1_shaped(96, 128, seed=1)
    packed = quant.quantize(w)
    assert quant.recovery_error(w) < 1e-3  # float32 scale and zero: the same weights
    torch.testing.assert_close(packed.dequantize(), w, atol=1e-5, rtol=0)
    x = torch.randn(5, 128)
    torch.testing.assert_close(quant.linear(x, packed), x @ w.t(), atol=1e-4, rtol=1e-4)
    bias = torch.randn(96)
    torch.testing.assert_close(quant.linear(x[None], packed, bias), (x @ w.t() + bias)[None], atol=1e-4, rtol=1e-4)
    noise = torch.randn(96, 128)
    assert quant.recovery_error(noise) > 0.4  # round-to-nearest: up to half a step


def test_a_row_gets_the_same_int4_result_at_any_batch_size_and_thread_count() -> None:
    """Why int4 never mixes with a dense GEMM: each kernel alone is batch-invariant (replays, seeded n-choices)."""
    w = q4_1_shaped(96, 128, seed=2).to(torch.bfloat16)
    packed = quant.quantize(w)
    x = torch.randn(32, 128, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        alone = quant.linear(x[:1], packed)
        torch.set_num_threads(1)
        assert torch.equal(quant.linear(x, packed)[:1], alone)
    finally:
        torch.set_num_threads(threads)
    assert not torch.equal(alone, F.linear(x[:1], w))  # and it is not the dense GEMM's rounding


def test_a_constant_group_survives_quantization() -> None:
    w = torch.full((16, 64), 0.25)
    torch.testing.assert_close(quant.quantize(w).dequantize(), w, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="a 8 x 64 weight"):
        quant.quantize(torch.ones(8, 64))


@pytest.mark.parametrize("family", FAMILIES)
def test_int4_on_the_lean_path_matches_its_own_hf_forward_and_the_hf_path_token_for_token(family: str) -> None:
    ps = prompts(3, (7, 23, 40))
    arrivals = {0: [prompt_request(f"a{k}", p, 10) for k, p in enumerate(ps[:2])], 3: [prompt_request("late", ps[2], 10)]}
    lean_model, record = tiny(family, seed=3), Recorded()
    lean, lean_engine = run(lean_model, arrivals, quantization="int4", record=record)
    assert lean_engine.runner.lean is not None and isinstance(lean_engine.runner.lean.layers[0].qkv, quant.Int4Weight)  # type: ignore[attr-defined]
    assert_logits_match_hf(lean_model, record)  # the HF modules now read slices of the same int4 weights
    hf_model = tiny(family, seed=3)
    hf, engine = run(hf_model, arrivals, impl="hf", quantization="int4")
    assert engine.runner.lean is None and isinstance(hf_model.model.layers[0].mlp.down_proj, quant.Int4Linear)  # type: ignore[attr-defined]
    assert lean == hf
    for w in (lean_engine.runner.lean.layers[0].gate_up, lean_engine.runner.lean.layers[1].o):  # type: ignore[attr-defined]
        levels = w.dequantize().reshape(w.out_features, -1, quant.GROUP)
        assert max(len(torch.unique(g)) for g in levels.reshape(-1, quant.GROUP)) <= 16  # really 4-bit: at most 16 levels per group


def test_auto_quantizes_only_weights_that_already_are_4bit_and_only_where_int4_runs() -> None:
    random = tiny("llama")
    assert not quant.already_4bit(quant.hf_linears(random))
    assert TorchRunner(random, max_len=64, kv_budget_mb=8, device=torch.device("cpu"), dtype=torch.float32).quantize("auto").quantization == "none"
    shipped = tiny("llama")
    for i, module in enumerate(m for m in shipped.modules() if isinstance(m, torch.nn.Linear) and m is not shipped.lm_head):
        module.weight.data = q4_1_shaped(module.out_features, module.in_features, seed=i)
    assert quant.already_4bit(quant.hf_linears(shipped))
    runner = TorchRunner(shipped, max_len=64, kv_budget_mb=8, device=torch.device("cpu"), dtype=torch.float32).quantize("auto")
    assert runner.quantization == "int4" and isinstance(runner.lean.layers[0].gate_up, quant.Int4Weight)  # type: ignore[union-attr]
    assert quant.resolve("auto", quant.hf_linears(shipped), torch.device("cuda"), torch.bfloat16)[0] == "none"  # where int4 does not run, auto leaves the weights


def test_what_int4_does_not_run_is_refused_by_name() -> None:
    model = tiny("llama")
    with pytest.raises(ValueError, match=r"'int8': choose one of none, int4, auto"):
        quant.check("int8", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="CPU only"):
        quant.check("int4", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        TorchRunner(model, max_len=64, kv_budget_mb=8, device=torch.device("cpu"), dtype=torch.float16).quantize("int4")


@pytest.mark.model
@pytest.mark.timeout(600)
def test_the_default_models_decoder_weights_come_back_from_its_q4_1_gguf_within_rounding() -> None:
    from models.files import local_folder
    from shared.settings import Settings
    from workers.runner import load_model

    settings = Settings.from_env(os.environ)
    _, folder = local_folder(settings.model, settings.model_cache)
    model = load_model(folder, device=torch.device("cpu"), dtype=torch.bfloat16)
    worst = max(quant.recovery_error(m.weight.data) for block in model.model.layers for m in block.modules() if isinstance(m, torch.nn.Linear))
    assert worst < quant.LOSSLESS, worst  # bf16 rounding of the cached copy and of scale/zero; never-4-bit weights reach 0.5
    assert quant.already_4bit(quant.hf_linears(model))
    assert TorchRunner(model, max_len=64, kv_budget_mb=8, device=torch.device("cpu"), dtype=torch.bfloat16, model_impl="hf").quantize("auto").quantization == "int4"
    lean, why = checkpoint.load(folder, max_len=64, device=torch.device("cpu"), dtype=torch.bfloat16)  # as a worker loads it
    assert lean is not None, why
    assert quant.already_4bit(quant.lean_linears(lean))
    runner = TorchRunner(None, lean=lean, config=checkpoint.read_config(folder), max_len=64, kv_budget_mb=8, device=torch.device("cpu"), dtype=torch.bfloat16).quantize("auto")
    assert runner.quantization == "int4" and isinstance(runner.lean.layers[0].qkv, quant.Int4Weight)  # type: ignore[union-attr]
