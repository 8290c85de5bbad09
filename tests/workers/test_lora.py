"""LoRA adapters on the torch runner (workers.lora) with a tiny random Llama and adapters built by peft:
four adapters and the base in one batch give each request peft's merged model's own greedy tokens on both
model paths (the lean one through the gather-matmul kernel and through `torch.bmm`); in bf16 a request's tokens do not depend on what shares its step; the prefix cache keeps an
adapter's blocks apart from the base's; a bad adapter is refused naming its file; `--max-loras` bounds the
adapters a step mixes."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from models.adapters import Base
from shared.deltas import Content, Error, Finish
from shared.ir import Request
from shared.settings import Settings
from tests.lora_adapters import build_adapter, merged
from workers import lora, lora_kernel
from workers.engine import Engine
from workers.runner import TorchRunner

from .fakes import INFO, ByteTokenizer, make_request

NEW = 12  # tokens each request generates


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def adapters(tiny: LlamaForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "all": build_adapter(tiny, root / "all", seed=1, rank=8),
        "attention": build_adapter(tiny, root / "attention", seed=2, rank=4, targets=("q_proj", "v_proj", "o_proj")),
        "mlp": build_adapter(tiny, root / "mlp", seed=3, rank=16, targets=("gate_proj", "down_proj")),
        "patterns": build_adapter(tiny, root / "patterns", seed=4, rank=8, targets=("k_proj", "up_proj"), use_rslora=True, alpha_pattern={"up_proj": 4}),
    }


def on(request: Request, name: str, folder: Path) -> Request:
    return replace(request, adapter=name, adapter_path=str(folder))


def prompt(rid: str, first: int) -> Request:
    return replace(make_request(rid, max_tokens=NEW, ignore_eos=True), prompt_token_ids=tuple(range(first, first + 9)))


def ways(monkeypatch: pytest.MonkeyPatch, multiply: str) -> str:
    """How the lean path multiplies rows of several adapters: "kernel" (`workers.lora_kernel`), or "bmm"
    (`torch.bmm`: what a worker without a C++ compiler does)."""
    if multiply == "bmm":
        monkeypatch.setattr(lora_kernel, "load", lambda: None)
    return multiply


def run(model: LlamaForCausalLM, requests: list[Request], *, impl: str = "lean", dtype: torch.dtype = torch.float32, max_loras: int = 8, multiply: str = "kernel", **settings: object) -> dict[str, list[int]]:
    runner = TorchRunner(model, max_len=128, kv_budget_mb=16, device=torch.device("cpu"), dtype=dtype, model_impl=impl).enable_adapters(max_loras=max_loras, max_rank=16)
    assert runner.adapters is not None
    assert (runner.adapters.kernel is not None) == (impl == "lean" and multiply == "kernel")  # the way under test, not the other
    engine = Engine(runner, ByteTokenizer(), INFO, settings=Settings(max_running=8, max_tokens_per_step=256, max_loras=max_loras, speculative="off", **settings))  # type: ignore[arg-type]
    out: dict[str, list[int]] = {r.id: [] for r in requests}
    for r in requests:
        engine.add(r)
    for _ in range(400):
        if not engine.has_work():
            assert not runner._held  # every sequence let its adapter go
            return out
        for e in engine.step():
            assert not isinstance(e.delta, Error), e.delta
            if isinstance(e.delta, (Content, Finish)):
                out[e.request_id].extend(e.delta.token_ids)
    raise AssertionError("did not finish")


def reference(model: LlamaForCausalLM, request: Request) -> list[int]:
    ids = torch.tensor([request.prompt_token_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize(("impl", "multiply"), [("lean", "kernel"), ("lean", "bmm"), ("hf", "hooks")])
def test_four_adapters_and_the_base_in_one_batch_each_give_peft_merged_greedy_tokens(tiny: LlamaForCausalLM, adapters: dict[str, Path], impl: str, multiply: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ways(monkeypatch, multiply)
    requests = [prompt("base", 3)] + [on(prompt(name, 3 + 20 * i), name, folder) for i, (name, folder) in enumerate(adapters.items(), start=1)]
    want = {"base": reference(tiny, requests[0])}
    for r in requests[1:]:
        want[r.id] = reference(merged(tiny, Path(r.adapter_path)), r)
    assert len({tuple(t) for t in want.values()}) == len(want)  # every adapter changes what the model says
    got = run(copy.deepcopy(tiny), requests, impl=impl, multiply=multiply)
    assert got == want


def test_the_same_prompt_on_the_base_then_on_an_adapter_reuses_no_base_block(tiny: LlamaForCausalLM, adapters: dict[str, Path]) -> None:
    first = replace(make_request("base", max_tokens=NEW, ignore_eos=True), prompt_token_ids=tuple(range(5, 45)))  # 40 tokens: two full blocks
    second = on(replace(first, id="adapted"), "all", adapters["all"])
    runner = TorchRunner(copy.deepcopy(tiny), max_len=128, kv_budget_mb=16, device=torch.device("cpu"), dtype=torch.float32).enable_adapters(max_loras=2, max_rank=16)
    engine = Engine(runner, ByteTokenizer(), INFO, settings=Settings(max_running=4, speculative="off"))
    tokens: list[int] = []
    for r in (first, second, replace(second, id="again")):
        engine.add(r)
        while engine.has_work():
            for e in engine.step():
                if e.request_id == "adapted" and isinstance(e.delta, (Content, Finish)):
                    tokens.extend(e.delta.token_ids)
        if r.id != "base":
            assert engine.scheduler.pool.hits == (32 if r.id == "again" else 0), r.id  # the adapter's own blocks, never the base's
    assert tokens == reference(merged(tiny, adapters["all"]), second)


@pytest.mark.parametrize("multiply", ["kernel", "bmm"])
def test_in_bf16_a_request_on_an_adapter_gets_the_same_tokens_alone_as_among_others(tiny: LlamaForCausalLM, adapters: dict[str, Path], multiply: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ways(monkeypatch, multiply)
    model = copy.deepcopy(tiny).to(torch.bfloat16)
    me = on(prompt("me", 40), "all", adapters["all"])
    others = [on(prompt(f"o{i}", 7 * i), name, folder) for i, (name, folder) in enumerate(adapters.items())] + [prompt("b", 90)]
    alone = run(model, [me], dtype=torch.bfloat16, multiply=multiply)["me"]
    assert run(model, [*others[:2], me, *others[2:]], dtype=torch.bfloat16, multiply=multiply)["me"] == alone
    assert run(model, [replace(me, adapter="", adapter_path="")], dtype=torch.bfloat16, multiply=multiply)["me"] != alone


def test_max_loras_bounds_the_adapters_running_at_once_and_every_request_still_finishes(tiny: LlamaForCausalLM, adapters: dict[str, Path]) -> None:
    requests = [on(prompt(f"{name}{k}", 10 * k), name, folder) for k in range(2) for name, folder in adapters.items()]
    runner = TorchRunner(copy.deepcopy(tiny), max_len=128, kv_budget_mb=16, device=torch.device("cpu"), dtype=torch.float32).enable_adapters(max_loras=2, max_rank=16)
    engine = Engine(runner, ByteTokenizer(), INFO, settings=Settings(max_running=8, max_loras=2, speculative="off"))
    for r in requests:
        engine.add(r)
    done, most, beats = set(), 0, []
    while engine.has_work():
        for e in engine.step():
            if isinstance(e.delta, Finish):
                done.add(e.request_id)
        most = max(most, len({s.request.adapter for s in engine.scheduler.running}))
        assert len(runner.adapters.resident) <= 2 + len({s.request.adapter for s in engine.scheduler.waiting})  # type: ignore[union-attr]
        beats.append(engine.figures()["adapters"])  # what the heartbeat carries to `met top`
    assert most == 2 and done == {r.id for r in requests}
    # the first heartbeat: two adapters run two requests each, the other two wait with theirs
    assert beats[0] == "all=2/0,attention=2/0,mlp=0/2,patterns=0/2", beats[0]
    assert beats[-1] == ""


def test_a_bad_adapter_file_fails_its_request_naming_the_file_and_loads_nothing(tiny: LlamaForCausalLM, adapters: dict[str, Path], tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((adapters["all"] / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    runner = TorchRunner(copy.deepcopy(tiny), max_len=128, kv_budget_mb=16, device=torch.device("cpu"), dtype=torch.float32).enable_adapters(max_loras=2, max_rank=8)
    engine = Engine(runner, ByteTokenizer(), INFO, settings=Settings(max_running=4, speculative="off"))
    for rid, folder, words in [("broken", broken, "not a safetensors file"), ("wide", adapters["mlp"], "above --max-lora-rank 8"), ("missing", tmp_path / "nowhere", "no such file")]:
        [failed] = engine.add(on(prompt(rid, 3), rid, folder))
        assert isinstance(failed.delta, Error) and str(folder) in failed.delta.message and words in failed.delta.message, failed.delta
    assert not runner.adapters.resident and not engine.has_work()  # type: ignore[union-attr]


def test_a_tensor_of_another_shape_or_module_is_refused_naming_it(tiny: LlamaForCausalLM, adapters: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    for name, change in [("shape", lambda t: {k: (v[:, :-1].contiguous() if "q_proj.lora_A" in k else v) for k, v in t.items()}), ("module", lambda t: {**t, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)})]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text((adapters["all"] / "adapter_config.json").read_text())
        save_file(change(load_file(str(adapters["all"] / "adapter_model.safetensors"))), str(folder / "adapter_model.safetensors"))
        with pytest.raises(lora.AdapterError, match=r"adapter_model\.safetensors") as caught:
            lora.read(folder, base=Base.of(tiny.config), max_rank=64)
        assert ("q_proj" if name == "shape" else "lm_head") in str(caught.value)


def test_peft_is_imported_only_for_an_adapter_with_an_alpha_pattern(tiny: LlamaForCausalLM, adapters: dict[str, Path]) -> None:
    """Importing peft takes ~1.8 s of CPU and brings transformers' model code with it, which a worker
    otherwise never loads (`workers.checkpoint`): only its pattern rule is needed, for `alpha_pattern`."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from models.adapters import Base\n"
        "from workers import lora\n"
        f"base = Base(layers=2, shapes={Base.of(tiny.config).shapes!r})\n"
        "plain = lora.read(sys.argv[1], base=base, max_rank=64)\n"
        "print('peft' in sys.modules)\n"
        "patterned = lora.read(sys.argv[2], base=base, max_rank=64)\n"
        "print('peft.utils.other' in sys.modules)\n"
    )
    args = [str(adapters["all"]), str(adapters["patterns"])]
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, check=False, cwd=Path(__file__).parents[2])
    assert done.stdout.split() == ["False", "True"], done.stderr[-2000:]
